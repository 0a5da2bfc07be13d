"""Trust, round 4 (issue 45, items 14-20): files that would hang a run or blow up its memory, numbers and structures
that would end it in a traceback, and command-line slips; each is refused in one line, before any model loads where it
can be. nbs/50_reliability.ipynb tabulates them."""
import json, os, shutil, sys
from pathlib import Path

import pytest

import mmrgrpo.checkpoints as K
from mmrgrpo.cli import main
from mmrgrpo.config import ConfigError, load_config
from mmrgrpo.data import DataError, load_tasks
from mmrgrpo.rewards import RewardFunctionError, compute_rewards
from mmrgrpo.trainer import train

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path: sys.path.insert(0, str(TESTS))
from test_runs import args, cfg

BOMB = "".join(f"b{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9 if i else ["'x'"] * 9) + "]\n" for i in range(8))
DEEP = "[" * 100_000 + "]" * 100_000


def one_error(capsys) -> str:
    "The one line a refused command wrote to stderr (it must be one short line)."
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and len(err[0]) < 600 and err[0].startswith("error: "), err[:3]
    return err[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    "A one-step run of the tiny model, copied by each test that tampers with it."
    out = tmp_path_factory.mktemp("trained") / "run"
    train(cfg(out, steps=1), progress=False)
    return out


@pytest.fixture
def run(trained, tmp_path) -> Path:
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def tamper(ck: Path, name: str, text: str):
    "Rewrite one file of a checkpoint and its manifest to match (what a hostile hand does)."
    (ck / name).write_text(text); K.write_manifest(ck)


# --- 14: a checkpoint's config.yaml goes through the config loader's guards

@pytest.mark.parametrize("command", ["eval", "resume"])
def test_an_alias_bomb_in_a_checkpoints_config_is_one_line(command, run, capsys):
    ck = run / "checkpoint-1"
    tamper(ck, "config.yaml", BOMB + "model: *l7\n")
    argv = (["eval", "--checkpoint", str(ck), "eval_size=1"] if command == "eval"
            else args(run, steps=2, resume_from="latest"))
    assert main(argv) == 2
    assert "aliases (*name) are expanded" in one_error(capsys)


# --- 15: files that are not regular, or too large, are refused before they are read

def test_a_manifest_that_is_a_device_or_a_pipe_is_refused_before_reading(run, capsys):
    ck = run / "checkpoint-1"
    (ck / K.MANIFEST).unlink(); (ck / K.MANIFEST).symlink_to("/dev/zero")
    assert "is a character device, not a file" in K.checkpoint_problem(ck)
    (ck / K.MANIFEST).unlink(); os.mkfifo(ck / K.MANIFEST)
    assert "is a named pipe, not a file" in K.checkpoint_problem(ck)        # before: open() waited for a writer forever
    assert main(["eval", "--checkpoint", str(ck), "eval_size=1"]) == 2
    assert "named pipe" in one_error(capsys)


def test_a_metrics_file_that_is_a_pipe_is_refused_on_resume(run, capsys):
    (run / "metrics.jsonl").unlink(); os.mkfifo(run / "metrics.jsonl")
    assert main(args(run, steps=2, resume_from="latest")) == 2
    assert "metrics.jsonl is a named pipe, not a file" in one_error(capsys)


@pytest.mark.parametrize("what", ["/dev/zero", "6 MB"])
def test_a_config_that_is_a_device_or_huge_is_refused_before_reading(what, tmp_path, capsys, no_model):
    path = what
    if what == "6 MB": path = tmp_path / "c.yaml"; path.write_text("# padding\n" * 600_000 + "steps: 1\n")
    assert main(["train", "--config", str(path)]) == 2
    assert ("is a character device" if what == "/dev/zero"
            else "over the 1,048,576 such a file may have") in one_error(capsys)


# --- 16: numbers: refused in the config check, before any model loads

@pytest.mark.parametrize("override, says", [
    ("learning_rate=1" + "0" * 400, "learning_rate=an integer of about 401 digits: too large"),
    ("reward_timeout=1" + "0" * 400, "reward_timeout=an integer of about 401 digits: too large"),
    ("lora_alpha=1" + "0" * 400, "lora_alpha=an integer of about 401 digits: far too large"),
    ("lora_alpha=10000000", "lora_alpha=10000000: at most"),
    ("threads=3000000000", "threads=3000000000: at most 4096"),
    ("temperature=1e-300", "temperature=1e-300: must be at least 0.001"),
])
def test_numbers_out_of_range_are_one_line_before_the_model_loads(override, says, tmp_path, capsys, no_model):
    assert main(["train", "model=tiny-random", f"output_dir={tmp_path / 'r'}", override]) == 2
    assert says in one_error(capsys)


@pytest.mark.parametrize("on_error", ["raise", "zero"])
def test_a_reward_of_2_to_the_1100_follows_the_error_policy(on_error):
    def huge(prompts, completions, **kw): return [2**1100, 1.0]
    if on_error == "raise":
        with pytest.raises(RewardFunctionError, match="returned an integer of 1101 bits at index 0"):
            compute_rewards([huge], None, ["p", "p"], ["a", "b"], {}, on_error=on_error)
    else:
        total, metrics = compute_rewards([huge], None, ["p", "p"], ["a", "b"], {}, on_error=on_error)
        assert total.tolist() == [0.0, 1.0] and metrics["rewards/huge_errors"] == 1


# --- 17: structure: deep nesting, broken parquet, a system prompt that cannot fit, a question that is not text

def test_yaml_nested_100000_deep_is_one_line(tmp_path, capsys, no_model):
    path = tmp_path / "c.yaml"; path.write_text(f"reward_funcs: {DEEP}\n")
    assert main(["train", "--config", str(path)]) == 2
    assert "nested too deep" in one_error(capsys)
    assert main(["train", f"reward_weights={DEEP}"]) == 2
    assert "nested too deep" in one_error(capsys)


def test_a_jsonl_row_nested_100000_deep_is_a_bad_row(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n"
                    + '{"question": ' + DEEP + ', "answer": "2"}\n')
    with pytest.raises(DataError, match="row 2: JSON nested too deep"): load_tasks(str(path))
    records, skipped = load_tasks(str(path), skip_bad_rows=True, return_skipped=True)
    assert (len(records), skipped) == (1, 1)


@pytest.mark.parametrize("content", [b"", b"PAR1 this is not parquet at all PAR1"])
def test_a_garbage_or_empty_parquet_is_a_data_error(content, tmp_path):
    path = tmp_path / "t.parquet"; path.write_bytes(content)
    with pytest.raises(DataError, match="is not a readable parquet file"): load_tasks(str(path))


def test_a_system_prompt_that_cannot_fit_is_refused_before_the_model_loads(tmp_path, capsys, no_model):
    assert main(["train", f"output_dir={tmp_path / 'r'}", "system_prompt=" + "word " * 120_000]) == 2
    assert "system_prompt has 599,999 characters" in one_error(capsys)


@pytest.mark.parametrize("question", [["what", "is", "1+1"], {"q": "1+1"}])
def test_a_question_that_is_a_list_or_dict_is_a_bad_row(question, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n"
                    + json.dumps({"question": question, "answer": "2"}) + "\n")
    with pytest.raises(DataError,
                       match=f"row 2: the question .field 'question'. is a {type(question).__name__}, not text"):
        load_tasks(str(path))
    assert len(load_tasks(str(path), skip_bad_rows=True)) == 1


# --- 18: every built-in reward's parameters are reserved column names

@pytest.mark.parametrize("column", ["wrong", "max_len", "correct"])
def test_columns_named_like_a_rewards_parameters_are_refused(column, tmp_path):
    path = tmp_path / "t.jsonl"; path.write_text(json.dumps({"question": "1+1?", "answer": "2", column: 7}) + "\n")
    with pytest.raises(DataError, match=f"field '{column}' is a name the reward functions are called with"):
        load_tasks(str(path))


# --- 19: the command line

def test_a_field_given_twice_on_the_command_line_is_an_error(tmp_path, capsys, no_model):
    assert main(["train", "steps=1", "steps=2"]) == 2
    assert "steps is given twice on the command line" in one_error(capsys)


def test_overrides_before_and_after_config(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr("mmrgrpo.cli.run_command", lambda a: seen.append((a.config, a.overrides)) or 0)
    assert main(["train", "model=x", "--config", "c.yaml", "eval_size=0"]) == 0
    assert seen == [("c.yaml", ["model=x", "eval_size=0"])]


def test_a_home_folder_in_output_dir_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    c = load_config(model="tiny-random", output_dir="~/runs/x", resume_from="~/runs/x/checkpoint-1")
    assert (c.output_dir, c.resume_from) == (str(tmp_path / "runs/x"), str(tmp_path / "runs/x/checkpoint-1"))


# --- 20: a full model cache, a bad environment variable, a stored step that is not a number

def test_a_full_model_cache_is_one_line_and_leaves_no_temporary_folder(tmp_path, monkeypatch):
    import transformers
    from safetensors import SafetensorError
    import mmrgrpo.models as M
    class Fake:
        config = type("Config", (), {})()
        def save_pretrained(self, d): raise SafetensorError("Error while serializing: IoError(No space left on device)")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Fake())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Fake())
    with pytest.raises(ConfigError, match="cannot be written to .*No space left on device.*set MMRGRPO_CACHE"):
        M.gguf_to_folder(tmp_path, "m.gguf", tmp_path / "cache" / "model")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_bad_reward_workers_variable_is_named(monkeypatch, capsys, no_model):
    monkeypatch.setenv("MMRGRPO_REWARD_WORKERS", "abc")
    assert main(["train", "model=tiny-random"]) == 2
    assert one_error(capsys).startswith("error: MMRGRPO_REWARD_WORKERS=abc: ")


def test_a_stored_step_that_is_not_a_number_is_one_line(run, capsys):
    ck = run / "checkpoint-1"
    tamper(ck, "trainer_state.json", json.dumps({"step": "one"}))
    assert main(args(run, steps=2, resume_from=str(ck))) == 2
    assert "step='one' is not a step number" in one_error(capsys)


def test_a_metrics_line_without_a_step_number_is_one_line(run, capsys):
    with open(run / "metrics.jsonl", "a") as f: f.write('{"step": null}\n')
    assert main(args(run, steps=2, resume_from="latest")) == 2
    assert "line 2: step=None is not a step number" in one_error(capsys)
