"""Trust, round 3 (issue 21), proven on the tiny random model: a lost final checkpoint is an error, a run folder is
never another run's checkpoint, links are not written through, config and data sizes are bounded up front, reward
functions get copies and a time limit, and every error a user can cause is one line from the CLI with exit code 2.
nbs/50_reliability.ipynb tabulates them."""
import errno, json, math, os, signal, subprocess, sys, time
from pathlib import Path

import pytest
import torch

import mmrgrpo.checkpoints as K
import mmrgrpo.trainer as T
from mmrgrpo.checkpoints import (CheckpointError, checkpoint_problem, latest_checkpoint, load_checkpoint,
                                 TrainingInterrupted)
from mmrgrpo.cli import main
from mmrgrpo.config import ConfigError, load_config
from mmrgrpo.data import DataError, load_tasks
from mmrgrpo.rewards import RewardFunctionError, compute_rewards
from mmrgrpo.sampling import HFBackend
from mmrgrpo.trainer import train

TESTS = Path(__file__).resolve().parent
# reward_fixtures:<name> must import here and in children
if str(TESTS) not in sys.path: sys.path.insert(0, str(TESTS))
from test_runs import BASE, SELF_TERM, args, cfg, child_env, names, steps_logged


def err_lines(capsys) -> list:
    return capsys.readouterr().err.strip().splitlines()


def trainable(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


# --- 1: a failed or missing final save is an error; a full disk says so; rewards are checked in float32

TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 4416 vs 4304"


@pytest.mark.parametrize("error", ["ENOSPC", "torch"])
def test_a_failed_final_save_exits_non_zero_and_says_the_disk_is_full(error, tmp_path, monkeypatch, capsys):
    out, real = tmp_path / "run", torch.save
    def save(obj, f, *a, **k):
        if ".tmp-checkpoint-2-" in str(f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if error == "ENOSPC" else RuntimeError(TORCH_FULL)
        return real(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", save)
    if error == "torch": monkeypatch.setattr(K, "free_bytes", lambda path: 1000)     # what a full tmpfs reports
    assert main(args(out, steps=2)) == 2
    last = err_lines(capsys)[-1]
    assert last.startswith("error: the final checkpoint checkpoint-2 was not written: the disk is full"), last
    assert ("needs about" in last and "1000 bytes free" * (error == "torch") in last
            and "resume_from=latest" in last), last
    assert names(out) == ["checkpoint-1"]


def test_a_skipped_last_update_still_writes_the_final_checkpoint(tmp_path, monkeypatch, capsys):
    import mmrgrpo.step as S
    calls, real = [], S.aggregate_loss
    def nan_in_step_2(*a, **k):
        calls.append(1)
        return real(*a, **k) * (math.nan if len(calls) == 2 else 1.0)     # one micro-batch per step here
    monkeypatch.setattr(S, "aggregate_loss", nan_in_step_2)
    out = tmp_path / "run"
    train(cfg(out, steps=2, save_every=0), progress=False)
    assert names(out) == ["checkpoint-2"] and checkpoint_problem(out / "checkpoint-2") is None
    assert "the last update (step 2) was skipped" in capsys.readouterr().err


def test_rewards_are_checked_in_float32():
    huge = lambda prompts, completions, **k: [1e39, 1.0]
    with pytest.raises(RewardFunctionError, match=r"returned 1e\+39 at index 0: .*float32"):
        compute_rewards([huge], None, ["p", "p"], ["a", "b"], {})
    big = lambda prompts, completions, **k: [3e38, 1.0]
    with pytest.raises(RewardFunctionError, match=r"weighted sum .* index 0 .*float32"):
        compute_rewards([big, big], [1.0, 1.0], ["p", "p"], ["a", "b"], {})
    r, m = compute_rewards([huge], None, ["p", "p"], ["a", "b"], {}, on_error="zero")
    assert r.tolist() == [0.0, 1.0] and m["rewards/<lambda>_errors"] == 1 and torch.isfinite(r).all()


# --- 2 and 3: a run folder is never another run's checkpoint

def fake_checkpoint(run: Path, step: int = 1) -> Path:
    ck = run / f"checkpoint-{step}"
    ck.mkdir(parents=True); (ck / K.MANIFEST).write_text("{}")
    return ck


@pytest.mark.parametrize("where", ["checkpoint-1", "checkpoint-1/adapter"])
def test_output_dir_inside_a_checkpoint_is_refused(where, tmp_path, no_model):
    ck = fake_checkpoint(tmp_path / "A")
    with pytest.raises(ConfigError) as e: train(cfg(tmp_path / "A" / where), progress=False)
    assert f"output_dir={str(tmp_path / 'A' / where)!r} is inside the checkpoint {ck}" in str(e.value), str(e.value)
    assert sorted(p.name for p in ck.iterdir()) == [K.MANIFEST]


def test_resume_from_another_runs_checkpoint_into_a_used_folder_is_refused(tmp_path, no_model):
    ck = fake_checkpoint(tmp_path / "A")
    (tmp_path / "B").mkdir(); (tmp_path / "B" / "metrics.jsonl").write_text('{"step": 1, "loss": 0.0}\n')
    with pytest.raises(ConfigError) as e: train(cfg(tmp_path / "B", resume_from=str(ck)), progress=False)
    msg = str(e.value)
    assert (f"resume_from={str(ck)!r} is a checkpoint of the run in {tmp_path / 'A'}" in msg
            and "holds another run" in msg), msg
    with pytest.raises(CheckpointError):            # an empty folder may take it (this fake one then fails its checks)
        train(cfg(tmp_path / "C", resume_from=str(ck)), progress=False)
    assert not (tmp_path / "C").exists(), "a refused run left the folder it was given"


@pytest.mark.parametrize("refused_by", ["check_output_dir", "prepare_output_dir"])
def test_a_refused_run_leaves_no_new_folder(refused_by, tmp_path, monkeypatch, no_model):
    out = tmp_path / "new" / "run"
    c = cfg(out, resume_from="latest" if refused_by == "prepare_output_dir" else None)
    if refused_by == "check_output_dir":                     # (as root, a chmod'ed folder is still writable)
        monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(ConfigError) as e: train(c, progress=False)
    says = {"check_output_dir": f"output_dir={str(out)!r} cannot be created (Permission denied: {tmp_path})",
            "prepare_output_dir": f"resume_from='latest' but {out} holds no run to continue"}[refused_by]
    assert says in str(e.value), str(e.value)
    assert list(tmp_path.iterdir()) == [], "a refused run left a folder behind"


# --- 4: SIGHUP is SIGTERM; a step that runs past the grace period after a signal is abandoned, and the last one saved

SELF_HUP = SELF_TERM.replace("signal.SIGTERM", "signal.SIGHUP")     # the terminal went away, in the middle of step 2


def test_sighup_saves_a_checkpoint_like_sigterm(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", SELF_HUP, *args(out, steps=4, save_every=3)], env=child_env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 129, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == (f"SIGHUP: stopped after step 2; saved {out / 'checkpoint-2'} "
                                                 "(resume_from=latest continues from it)"), p.stderr[-3000:]
    assert names(out) == ["checkpoint-2"]


@pytest.mark.parametrize("phase", ["generate", "update"])
def test_a_long_step_is_abandoned_and_the_last_completed_step_saved(phase, tmp_path, monkeypatch):
    import mmrgrpo.step as S
    reference = tmp_path / "reference"
    train(cfg(reference, steps=2), progress=False)
    import mmrgrpo.signals as signals
    monkeypatch.setattr(signals, "STOP_GRACE_S", 0.0)                  # a step "longer than the grace period": any step
    calls, weights, real_gen, real_agg = [], {}, HFBackend.generate, S.aggregate_loss
    def generate(self, *a, **k):
        calls.append(1)
        if phase == "generate" and len(calls) == 2: os.kill(os.getpid(), signal.SIGTERM)
        return real_gen(self, *a, **k)
    def agg(*a, **k):
        if phase == "update" and len(calls) == 2: os.kill(os.getpid(), signal.SIGTERM)
        return real_agg(*a, **k)
    real_save = T.save_checkpoint
    def save(out, step, model, *a, **k):
        weights[step] = trainable(model); return real_save(out, step, model, *a, **k)
    monkeypatch.setattr(HFBackend, "generate", generate)
    monkeypatch.setattr(S, "aggregate_loss", agg)
    monkeypatch.setattr(T, "save_checkpoint", save)
    out = tmp_path / "run"
    with pytest.raises(TrainingInterrupted) as e: train(cfg(out, steps=4, save_every=3), progress=False)
    assert str(e.value).startswith("SIGTERM: abandoned step 2 ") and str(e.value).endswith(
        f"saved {out / 'checkpoint-1'} (resume_from=latest continues from it)"), str(e.value)
    assert e.value.exit_code == 143 and names(out) == ["checkpoint-1"] and steps_logged(out) == [1]
    monkeypatch.undo()
    train(cfg(out, steps=2, resume_from="latest"), progress=False)    # the abandoned step left nothing behind
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows]
    from mmrgrpo.runlog import read_metrics
    assert strip(read_metrics(out / "metrics.jsonl")) == strip(read_metrics(reference / "metrics.jsonl"))


# --- 5: links in the run folder are not written through

@pytest.mark.parametrize("name", [K.LOCK, "config.yaml", "metrics.jsonl", "reward_curve.png", "checkpoint-1"])
def test_links_in_the_run_folder_are_not_written_through(name, tmp_path, capsys):
    victim = tmp_path / "victim"
    if name.startswith("checkpoint"): victim.mkdir(); (victim / "notes.txt").write_text("precious")
    else: victim.write_text("precious")
    out = tmp_path / "run"; out.mkdir()
    (out / name).symlink_to(victim)
    assert main(args(out, steps=1)) == 2
    err = err_lines(capsys)
    assert len(err) == 1 and str(out / name) in err[0] and "link" in err[0], err
    assert (victim / "notes.txt" if victim.is_dir() else victim).read_text() == "precious"


def test_run_files_are_written_through_a_temporary_file_and_a_rename(tmp_path):
    from mmrgrpo.safety import replace_file
    victim, link = tmp_path / "victim", tmp_path / "config.yaml"
    victim.write_text("precious"); link.symlink_to(victim)
    replace_file(link, "steps: 1\n")
    assert victim.read_text() == "precious" and not link.is_symlink() and link.read_text() == "steps: 1\n"
    (tmp_path / ".config.yaml.tmp").symlink_to(victim)          # a link planted where the temporary file goes
    replace_file(link, "steps: 2\n")
    assert victim.read_text() == "precious" and link.read_text() == "steps: 2\n"


# --- 6: a YAML alias bomb is refused in well under a second; list fields are bounded

BOMB = "".join(f"  - &l{i} [" + ", ".join([f"*l{i - 1}"] * 9 if i else ["'x'"] * 9) + "]\n" for i in range(8))


@pytest.mark.parametrize("field", ["reward_weights", "reward_funcs"])
def test_a_yaml_alias_bomb_is_refused_quickly(field, tmp_path, capsys, no_model):
    path = tmp_path / "bomb.yaml"; path.write_text(f"{field}:\n{BOMB}")
    assert len(path.read_text()) < 1200
    started = time.perf_counter()
    assert main(["train", "--config", str(path)]) == 2
    err = err_lines(capsys)
    assert time.perf_counter() - started < 5 and len(err) == 1 and len(err[0]) < 400, (
        time.perf_counter() - started, err)
    # refused as read (issue 45)
    assert err[0].startswith(f"error: {path}") and "aliases (*name) are expanded" in err[0], err


def test_list_fields_are_bounded():
    with pytest.raises(ConfigError, match=r"reward_funcs has 1000 entries: at most 64"):
        load_config(reward_funcs=["format"] * 1000, reward_weights=None)
    with pytest.raises(ConfigError, match=r"lora_target_modules=\[1, 2\]: must be a list of strings"):
        load_config(lora_target_modules=[1, 2])


# --- 7: mmrgrpo eval --checkpoint takes the model and adapter settings from the checkpoint

def test_eval_takes_the_adapter_settings_from_the_checkpoint(tmp_path, monkeypatch, capsys):
    import mmrgrpo.models as M
    out = tmp_path / "run"
    train(cfg(out, steps=1, lora_r=8, lora_alpha=64, lora_target_modules=["q_proj", "v_proj"]), progress=False)
    seen, real = [], M.load_policy
    def load_policy(c, *a, **k):
        seen.append((c.model, c.lora_r, c.lora_alpha, c.lora_target_modules)); return real(c, *a, **k)
    monkeypatch.setattr(M, "load_policy", load_policy)
    ev = ["eval", "--checkpoint", str(out / "checkpoint-1"), "eval_size=2", "max_completion_length=4"]
    assert main(ev) == 0
    assert seen == [("tiny-random", 8, 64, ["q_proj", "v_proj"])]
    assert "eval: lora_alpha=64 from the checkpoint" in capsys.readouterr().err
    assert main(ev + ["lora_alpha=16"]) == 2
    err = err_lines(capsys)
    assert len(err) == 1 and "lora_alpha=64" in err[0] and "lora_alpha=16" in err[0], err


# --- 8: reward functions get copies, a time limit, reserved names, at least one function, and no way to end the run

def test_a_reward_function_gets_a_time_limit(tmp_path):
    started = time.perf_counter()
    with pytest.raises(RewardFunctionError) as e:
        train(cfg(tmp_path, steps=1, reward_funcs=["reward_fixtures:sleeps"], reward_timeout=0.05), progress=False)
    assert time.perf_counter() - started < 25
    assert ("reward function 'sleeps' took more than 0.4 s for 8 completions "
            "(reward_timeout=0.05 s per completion)" in str(e.value))


def test_reward_functions_get_copies():
    import reward_fixtures as F
    seen = []
    def spy(prompts, completions, answer, **k): seen.append((list(completions), list(answer))); return [0.0, 0.0]
    completions, columns = ["a", "b"], {"answer": ["1", "2"]}
    compute_rewards([F.mutates, spy], None, ["p", "p"], completions, columns)
    assert seen == [(["a", "b"], ["1", "2"])] and completions == ["a", "b"] and columns == {"answer": ["1", "2"]}


@pytest.mark.parametrize("column", ["prompts", "completions", "reward_timeout"])
def test_reserved_column_names_are_refused_at_data_load(column, tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2", column: "x"}) + "\n")
    with pytest.raises(DataError) as e: load_tasks(str(path))
    assert (f"{path} row 1: field {column!r} is a name the reward functions are called with"
            in str(e.value)), str(e.value)


def test_no_reward_function_is_refused():
    with pytest.raises(ConfigError, match=r"reward_funcs=\[\]: .*at least one"):
        load_config(reward_funcs=[], reward_weights=None)


@pytest.mark.parametrize("exc", [SystemExit(0), KeyboardInterrupt()])
def test_a_reward_function_cannot_end_the_run(exc):
    def ends(prompts, completions, **k): raise exc
    with pytest.raises(RewardFunctionError, match=f"reward function 'ends' raised {type(exc).__name__}"):
        compute_rewards([ends], None, ["p"], ["a"], {}, timeout=5.0)


def test_a_reward_function_raising_systemexit_fails_the_cli_run(tmp_path, capsys):
    assert main(args(tmp_path / "run", steps=1, reward_funcs=["reward_fixtures:exits"])) == 2
    assert err_lines(capsys)[-1] == "error: reward function 'exits' raised SystemExit: 0"


def test_ctrl_c_while_rewards_run_still_stops_with_a_save(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(args(out, steps=3, save_every=5, reward_funcs=["reward_fixtures:sends_sigint"])) == 130
    assert err_lines(capsys)[-1] == (f"SIGINT: stopped after step 1; saved {out / 'checkpoint-1'} "
                                     "(resume_from=latest continues from it)")


# --- 9: duplicate YAML keys

def test_duplicate_yaml_keys_are_an_error_naming_the_key(tmp_path):
    path = tmp_path / "c.yaml"; path.write_text("steps: 3\nlearning_rate: 0.001\nsteps: 4\n")
    with pytest.raises(ConfigError) as e: load_config(path)
    assert str(e.value) == f"{path} line 3: duplicate key 'steps' (line 1 sets it too): keep one"
    with pytest.raises(ConfigError, match="override 'log_with=.*duplicate key 'a'"):
        load_config(overrides=["log_with={a: 1, a: 2}"])


# --- 10: every error a user can cause is one line from the CLI, names the input, says what to change, exit 2

def cli_cases(tmp_path) -> dict:
    bad_data = tmp_path / "tasks.jsonl"; bad_data.write_text('{"q": "What is 1 + 1?", "answer": "2"}\n')
    (tmp_path / "a_file").write_text("")
    latin1, tagged = tmp_path / "latin1.yaml", tmp_path / "tagged.yaml"
    latin1.write_bytes(b"system_prompt: caf\xe9\n")
    tagged.write_text("steps: !!python/object/apply:os.system ['true']\n")
    broken = tmp_path / "broken.yaml"; broken.write_text("steps: [3\n")
    return {   # arguments -> what the line must say
        "DataError": (args(tmp_path / "r1", task=str(bad_data)), f"{bad_data} row 1: no field 'question'"),
        "RewardFunctionError": (args(tmp_path / "r2", steps=1, reward_funcs=["reward_fixtures:raises"]),
                                "reward function 'raises' raised RuntimeError"),
        "output_dir is a file": (args(tmp_path / "a_file"), f"output_dir={str(tmp_path / 'a_file')!r} is a file"),
        "output_dir under a file": (args(tmp_path / "a_file" / "run"),
                                    f"output_dir={str(tmp_path / 'a_file' / 'run')!r} cannot be"),
        "UnicodeDecodeError": (["train", "--config", str(latin1)], f"{latin1} is not UTF-8 text (byte 0xe9 at line 1"),
        "ConstructorError": (["train", "--config", str(tagged)],
                             f"{tagged} line 1: the tag '!!python/object/apply:os.system'"),
        "YAML syntax": (["train", "--config", str(broken)], f"{broken} is not valid YAML"),
    }


@pytest.mark.parametrize("case", ["DataError", "RewardFunctionError", "output_dir is a file", "output_dir under a file",
                                  "UnicodeDecodeError", "ConstructorError", "YAML syntax"])
def test_user_errors_from_the_cli_are_one_line_and_exit_2(case, tmp_path, capsys):
    argv, says = cli_cases(tmp_path)[case]
    assert main(argv) == 2
    err = [l for l in err_lines(capsys) if not l.startswith(("precision:", "WARNING", "GRPO:"))]
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def test_a_read_only_output_dir_is_one_line(tmp_path, monkeypatch, capsys, no_model):
    def denied(self, *a, **k): raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
    monkeypatch.setattr(Path, "mkdir", denied)                   # (as root, a chmod'ed folder is still writable)
    assert main(args(tmp_path / "ro" / "run")) == 2
    err = err_lines(capsys)
    assert (len(err) == 1 and f"output_dir={str(tmp_path / 'ro' / 'run')!r} cannot be created" in err[0]
            and "Permission denied" in err[0]), err


# --- 11: sizes are checked up front

@pytest.mark.parametrize("change, says", [
    (dict(num_generations=10**6), "num_generations=1000000: at most 1024"),
    (dict(prompts_per_step=10**6), "prompts_per_step=1000000: at most 4096"),
    (dict(max_completion_length=10**7), "max_completion_length=10000000: at most 131072"),
    (dict(reward_timeout=1e300), "reward_timeout=1e+300: at most 3600 seconds"),
    (dict(lora_r=100000), "lora_r=100000: at most 4096"),
])
def test_sizes_are_bounded_in_the_config(change, says, no_model):
    with pytest.raises(ConfigError) as e: load_config(**{**BASE, **change})
    assert says in str(e.value), str(e.value)


def test_lora_r_beyond_the_models_width_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e: train(cfg(tmp_path, lora_r=128), progress=False)
    assert "lora_r=128 is more than the model's hidden size (64)" in str(e.value), str(e.value)


def test_a_huge_question_is_refused_by_its_length_before_tokenizing(tmp_path, monkeypatch):
    import mmrgrpo.prompts as P
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"question": "What is 1 + 1?", "answer": "2"},
                                                           {"question": "1 + " * 50_000 + "1?", "answer": "2"}]))
    tokenized, real = [], P.check_prompt_lengths
    def spy(tok, prompts, *a, **k): tokenized.append(max(map(len, prompts))); return real(tok, prompts, *a, **k)
    monkeypatch.setattr(T, "check_prompt_lengths", spy)
    with pytest.raises(DataError) as e: train(cfg(tmp_path / "run", task=str(path)), progress=False)
    assert (f"{path} row 2: the question has 200002 characters" in str(e.value)
            and "max_prompt_length=512" in str(e.value))
    assert not tokenized or max(tokenized) < 100_000


def test_a_step_too_large_for_the_machine_is_refused_and_a_large_one_warned(tmp_path, monkeypatch, capsys):
    import mmrgrpo.step as R
    def generate(*a, **k): raise AssertionError("a step started")
    monkeypatch.setattr(HFBackend, "generate", generate)
    monkeypatch.setattr(R, "machine_memory", lambda device: (2**20, 2**20))           # a 1 MiB machine
    with pytest.raises(ConfigError) as e: train(cfg(tmp_path / "a", steps=1), progress=False)
    assert "a step needs at least" in str(e.value) and "this machine has 1 MiB" in str(e.value), str(e.value)
    monkeypatch.undo()
    est = R.estimate_step_memory(T.load_policy(cfg(tmp_path / "b"))[0], cfg(tmp_path / "b"))
    # room for what is certain, not for a step
    monkeypatch.setattr(R, "machine_memory", lambda device: (10 * est["total"], 2**20))
    train(cfg(tmp_path / "b", steps=1), progress=False)
    assert "WARNING: a step may need about" in capsys.readouterr().err
    big = R.estimate_step_memory(T.load_policy(cfg(tmp_path / "c"))[0],
                                 cfg(tmp_path / "c", num_generations=64, max_completion_length=64))
    assert big["total"] > est["total"] and math.isclose(big["kv_cache"] / est["kv_cache"], 16 * (512 + 64) / (512 + 8))


def test_the_memory_estimate_uses_the_runs_longest_prompt(tmp_path, monkeypatch):
    import mmrgrpo.step as R
    seen, real = [], R.estimate_step_memory
    monkeypatch.setattr(R, "estimate_step_memory", lambda *a, **k: seen.append(a[-1]) or real(*a, **k))
    # an arithmetic stream: measured on its held-out prompts
    train(cfg(tmp_path / "a", steps=1, eval_size=4), progress=False)
    train(cfg(tmp_path / "b", steps=1), progress=False)                  # nothing to measure: max_prompt_length
    assert 20 < seen[0] < 512 and seen[1] == 0, seen
    est = [real(T.load_policy(cfg(tmp_path / "c"))[0], cfg(tmp_path / "c"), 1, (), p) for p in (seen[0], 0)]
    assert est[0]["activations"] < est[1]["activations"] / 4, est      # short prompts, run once per group
