"""Trust, round 5 (issue 59, items 6-8 and 11-18), proven on the tiny random model: `eval --checkpoint` scores the
run's own held-out rows, a copy of the training file is no held-out data, an empty MMRGRPO_CACHE is unset, and what a
user hands the package (a model folder, data, a system prompt, sizes, WORLD_SIZE, a mapping, a read-only HOME, a full
disk) fails in one line, before the model loads where it can; a finished run survives a failed plot.
nbs/50_reliability.ipynb tabulates them."""
import errno, json, os, shutil
from pathlib import Path

import pytest

import mmrgrpo.trainer as T
from mmrgrpo.cli import main
from mmrgrpo.config import ConfigError, load_config
from mmrgrpo.data import DataError
from mmrgrpo.trainer import train

S = dict(model="tiny-random", num_generations=4, prompts_per_step=2, max_completion_length=8, eval_size=0, steps=2)


def cfg(out, **kw):
    return load_config(**{**S, "log_completions_every": 0, "output_dir": str(out), **kw})


def argv(out, **kw) -> list:
    "`mmrgrpo train` arguments for the issue's set-up, S."
    return ["train", *[f"{k}={json.dumps(v)}" for k, v in {**S, "output_dir": str(out), **kw}.items()]]


def error_line(capsys) -> str:
    "The one line a refused command printed (warnings, the precision line and the progress bar aside)."
    err = capsys.readouterr().err.strip().splitlines()
    err = [l for l in err if not l.startswith(("WARNING", "precision:", "eval:"))]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def questions(path: Path, n: int = 12, start: int = 0) -> Path:
    path.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(start, start + n)))
    return path


# --- 6: eval --checkpoint scores the checkpoint's task, on the rows its run held out

@pytest.fixture(scope="module")
def file_run(tmp_path_factory):
    "A one-step run on a 12-row file with 3 rows held out (relative paths, as a user types them)."
    home = tmp_path_factory.mktemp("file_run")
    questions(home / "t.jsonl")
    here = os.getcwd(); os.chdir(home)
    try: train(cfg("run", steps=1, task="t.jsonl", eval_size=3, eval_before=False), progress=False)
    finally: os.chdir(here)
    return home


def test_eval_of_a_checkpoint_scores_its_runs_held_out_rows(file_run, tmp_path, monkeypatch, capsys):
    from mmrgrpo.data import load_tasks, split_held_out
    home = Path(shutil.copytree(file_run, tmp_path / "home")); monkeypatch.chdir(home)
    held = [t["question"] for t in split_held_out(load_tasks("t.jsonl"), 3, "t.jsonl")[1]]
    scored = []
    monkeypatch.setattr(T, "run_eval", lambda backend, prompts, *a, **k: scored.extend(prompts) or {})
    assert main(["eval", "--checkpoint", "run/checkpoint-1"]) == 0
    assert [[q for q in held if q in p] for p in scored] == [[q] for q in held], scored
    err = capsys.readouterr().err
    assert "eval: task='t.jsonl' from the checkpoint" in err and "eval_size=3 from the checkpoint" in err, err
    # a run that held nothing out trained on every row: no rows to score, said in one line
    from mmrgrpo.checkpoints import write_manifest
    ck = home / "run" / "checkpoint-1"
    (ck / "config.yaml").write_text((ck / "config.yaml").read_text().replace("eval_size: 3", "eval_size: 0"))
    write_manifest(ck)
    assert main(["eval", "--checkpoint", str(ck)]) == 2
    assert "trained on every row of t.jsonl (eval_size=0 held none out)" in error_line(capsys)


# --- 7: held-out rows that are training rows, by content

def test_an_eval_task_copying_the_training_rows_is_refused(tmp_path, capsys, no_model):
    task, copy = questions(tmp_path / "t.jsonl"), tmp_path / "copy.jsonl"
    shutil.copy(task, copy)
    assert main(argv(tmp_path / "run", task=str(task), eval_task=str(copy), eval_size=4)) == 2
    assert (f"all 4 held-out rows of eval_task={str(copy)!r} are training rows of task={str(task)!r}"
            in error_line(capsys))
    partly = questions(tmp_path / "partly.jsonl", start=10)            # rows 10 and 11 are training rows
    with pytest.raises(AssertionError, match="a model was loaded"):
        train(cfg(tmp_path / "run2", task=str(task), eval_task=str(partly), eval_size=6), progress=False)
    assert (f"WARNING: 2 of the 6 held-out rows of eval_task={str(partly)!r} are training rows of "
            f"task={str(task)!r}") in capsys.readouterr().err


# --- 8 and 18: the converted-model cache: an empty MMRGRPO_CACHE is unset; a read-only HOME names MMRGRPO_CACHE

def test_an_empty_mmrgrpo_cache_is_unset(tmp_path, monkeypatch):
    from mmrgrpo.models import cache_dir
    monkeypatch.setenv("HOME", str(tmp_path)); monkeypatch.setenv("MMRGRPO_CACHE", "")
    assert cache_dir().parent == tmp_path / ".cache" / "mmrgrpo"     # a folder per transformers version below it


def test_a_read_only_home_names_mmrgrpo_cache(tmp_path, monkeypatch, capsys, no_model):
    home = tmp_path / "home"; home.mkdir()
    monkeypatch.setenv("HOME", str(home)); monkeypatch.delenv("MMRGRPO_CACHE", raising=False)
    real = os.mkdir
    def read_only(path, *a, **k):           # (as root, a chmod'ed folder is still writable)
        if str(path).startswith(str(home)): raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, *a, **k)
    monkeypatch.setattr(os, "mkdir", read_only)
    assert main(argv(tmp_path / "run")) == 2
    line = error_line(capsys)
    assert f"{home / '.cache'}" in line and "Read-only file system" in line and "set MMRGRPO_CACHE" in line, line


# --- 18: a disk that fills while metrics.jsonl is written

@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a device whose writes fail: disk full")
def test_a_full_disk_under_metrics_jsonl_names_the_file(tmp_path):
    from mmrgrpo.runlog import MetricsLogger
    logger = MetricsLogger(tmp_path)
    logger.f.close(); logger.f = open("/dev/full", "w")          # every write now fails as on a full disk
    with pytest.raises(OSError) as e: logger.log({"loss": 0.5}, 1)
    msg = str(e.value)
    assert msg == (f"{tmp_path / 'metrics.jsonl'} cannot be written (the disk is full: [Errno 28] No space left on "
                   "device): free space on that disk, or move output_dir to one with room"), msg
    logger.close()                                                # the failed line is not written again


# --- 11: a tokenizer without a chat template

def test_a_model_whose_tokenizer_has_no_chat_template_is_one_line(tmp_path, capsys, no_model):
    from mmrgrpo.models import load_tokenizer, resolve_model, tiny_random_model
    tok = load_tokenizer(resolve_model("smollm2"))
    folder = tmp_path / "mine"
    tiny_random_model(tok).config.save_pretrained(folder)
    tok.chat_template = None; tok.save_pretrained(folder)
    assert main(argv(tmp_path / "run", model=str(folder))) == 2
    line = error_line(capsys)
    assert f"model={str(folder)!r}: its tokenizer has no chat template" in line and "chat_template" in line, line


# --- 12: a question holding a lone surrogate

def test_a_question_with_a_lone_surrogate_is_a_data_error(tmp_path, capsys, no_model):
    path = tmp_path / "t.jsonl"
    path.write_text('{"question": "What is 2 + 2?", "answer": "4"}\n'
                    '{"question": "What is 1 + \\ud800 1?", "answer": "2"}\n')
    assert main(argv(tmp_path / "run", task=str(path))) == 2
    assert f"{path} row 2: the question holds a lone surrogate" in error_line(capsys)


# --- 13: a system prompt that leaves no room in max_prompt_length

def test_a_system_prompt_longer_than_max_prompt_length_is_refused_before_the_model(tmp_path, capsys, no_model):
    assert main(argv(tmp_path / "run", system_prompt="7 " * 12000, max_prompt_length=1000)) == 2
    line = error_line(capsys)
    assert "system_prompt, the num_shots=1 worked example(s) and the chat template take" in line, line
    assert "more than max_prompt_length=1000: shorten system_prompt" in line, line


def test_a_stream_prompt_past_max_prompt_length_is_a_data_error(tokenizer):
    from mmrgrpo.data import ArithmeticStream
    from mmrgrpo.prompts import frame_tokens
    c = load_config(**S, system_prompt="Be brief.")
    room = frame_tokens(tokenizer, c.system_prompt, T.default_shots(c.task, c.num_shots)) + 2
    c = load_config(**S, system_prompt="Be brief.", max_prompt_length=room)   # the frame fits, no question does
    with pytest.raises(DataError, match=rf"arithmetic:1 \(train\): its prompts take up to \d+ tokens, more than "
                                        rf"max_prompt_length={room}: raise max_prompt_length, shorten system_prompt"):
        T.fit_prompts(tokenizer, c, ArithmeticStream(1), c.task)


def test_an_integer_of_thousands_of_digits_in_an_override_is_one_line():
    with pytest.raises(ConfigError) as e: load_config(overrides=["system_prompt=" + "7" * 12000])
    assert "an integer of 12000 digits" in str(e.value) and "quote it" in str(e.value), str(e.value)


# --- 14: the memory estimate of a huge step is arithmetic, and refuses it in one line

def test_the_memory_estimate_of_a_huge_step_allocates_nothing(tiny_model):
    from mmrgrpo.runlog import process_peak_rss_mb
    from mmrgrpo.step import check_step_memory, estimate_step_memory
    c = load_config(**{**S, "prompts_per_step": 4096, "prune_rate": 0.999999, "allocation": True})
    before = process_peak_rss_mb()
    est = estimate_step_memory(tiny_model, c)
    assert process_peak_rss_mb() - before < 100, "the estimate itself allocated memory"
    assert est["rows"] == 4096000000 * 4
    with pytest.raises(ConfigError) as e: check_step_memory(tiny_model, c)
    assert ("prompts_per_step=4096 with allocation at prune_rate=0.999999 samples 4096000000 prompts" in str(e.value)
            and "\n" not in str(e.value)), str(e.value)


def test_the_arithmetic_micro_batch_is_the_one_the_update_takes():
    import torch
    from mmrgrpo.step import largest_micro_batch, micro_batches
    for G in (2, 3, 4, 8):
        for n_groups in range(1, 40):
            for T_ in (1, 8, 100, 300, 1024, 3000):
                for size in (0, 1, 5):
                    ids = torch.arange(n_groups).repeat_interleave(G)
                    slices = micro_batches(ids, T_, size, "cpu", 1024)
                    want = max(s.stop - s.start for s in slices)
                    assert largest_micro_batch(n_groups * G, G, T_, size, "cpu", 1024) == want, (G, n_groups, T_, size)


# --- 15: a finished, saved run whose plot fails ends with its result and a warning

def test_a_failed_plot_after_a_finished_run_is_a_warning(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"; (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "manifest.json").touch()                # a complete checkpoint, for `latest_checkpoint`
    (out / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    monkeypatch.setattr(T, "train", lambda c: T.TrainResult(out, [{"step": 1}], {}, {}))
    def no_memory(*a, **k): raise MemoryError()
    monkeypatch.setattr(T, "plot_rewards", no_memory)
    assert main(argv(out)) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"WARNING: the reward curve was not plotted (MemoryError); the run itself finished: its weights "
                       f"are in {out / 'checkpoint-2'}, its metrics in {out / 'metrics.jsonl'}"), err


# --- 16: WORLD_SIZE without a launcher

@pytest.mark.parametrize("world, says", [("abc", "WORLD_SIZE='abc' is not a number of processes"),
                                         ("2", "WORLD_SIZE=2 but RANK, MASTER_ADDR, MASTER_PORT are not set")])
def test_world_size_without_a_launcher_is_one_line(world, says, tmp_path, monkeypatch, capsys, no_model):
    monkeypatch.setenv("WORLD_SIZE", world)
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"): monkeypatch.delenv(name, raising=False)
    assert main(argv(tmp_path / "run")) == 2
    line = error_line(capsys)
    assert says in line and "torchrun --nproc_per_node" in line and "unset WORLD_SIZE" in line, line


# --- 17: load_config takes a mapping as readily as a path

def test_load_config_takes_a_mapping():
    import mmrgrpo
    assert mmrgrpo.load_config({"steps": 1}).steps == 1
    assert mmrgrpo.load_config({"steps": 1}, ["steps=3"], prune_rate=0.5).steps == 3
    with pytest.raises(ConfigError) as e: mmrgrpo.load_config(7)
    assert str(e.value) == ("load_config takes a YAML file's path or a mapping of fields, got 7 (type int): e.g. "
                            "load_config('config.yaml') or load_config({'steps': 5})"), str(e.value)
