"""Trust, round 5 (issue 59), proven on the tiny random model: a second signal while `best-checkpoint` is replaced
leaves the old one or the new, `overwrite=true` removes only what the run wrote, an error after completed steps saves
the last one first and says where to resume, a data column never replaces a reward function's setting, a reward
function that forks trains nothing on its child's scores, checkpoint weights that are a named pipe are refused at once,
and a reward module that blocks at import meets a time limit. nbs/50_reliability.ipynb tabulates them."""
import json, os, shutil, sys, time
from pathlib import Path

import pytest

import mmrgrpo.checkpoints as K
import mmrgrpo.rewards as R
import mmrgrpo.trainer as T
from mmrgrpo.checkpoints import BEST, where_to_resume
from mmrgrpo.cli import main, with_checkpoint_model
from mmrgrpo.config import ConfigError, load_config
from mmrgrpo.runlog import read_metrics
from mmrgrpo.sampling import HFBackend
from mmrgrpo.trainer import train

TESTS = Path(__file__).resolve().parent
# reward_fixtures:<name> must import here and in children
if str(TESTS) not in sys.path: sys.path.insert(0, str(TESTS))
from test_runs import args, cfg, fresh_policy, names, steps_logged


def err_lines(capsys) -> list:
    return capsys.readouterr().err.strip().splitlines()


def saved_run(tmp_path, best: bool = True):
    "A run folder holding checkpoint-1 and (`best`) a best-checkpoint of step 1, as a save_best run leaves them."
    out = tmp_path / "run"; c = cfg(out, steps=4)
    K.prepare_output_dir(out, c)
    policy = fresh_policy(c)
    state = {"nonfinite_in_a_row": 0, "world_size": 1, "best": {"step": 1, "eval/accuracy": 0.25}}
    K.save_checkpoint(out, 1, *policy, c, state)
    if best: K.save_checkpoint(out, 1, *policy, c, state, name=BEST)
    return out, c, policy, state


# --- 1: a second signal while best-checkpoint is replaced leaves the old one or the new

@pytest.mark.parametrize("stop_at", [2, 3])     # between the two renames; before the old folder is removed
def test_a_second_signal_while_best_checkpoint_is_replaced_leaves_the_old_or_the_new(stop_at, tmp_path, monkeypatch):
    out, c, policy, state = saved_run(tmp_path)
    calls, written = [], []
    def stopped(real):         # the `stop_at`-th rename or removal once the new folder is complete: a second SIGTERM
        def call(*a, **k):
            if written and len(calls.append(a) or calls) == stop_at: raise KeyboardInterrupt("SIGTERM again")
            return real(*a, **k)
        return call
    real_manifest = K.write_manifest
    monkeypatch.setattr(K, "write_manifest", lambda d: (real_manifest(d), written.append(d)))
    monkeypatch.setattr(os, "rename", stopped(os.rename)); monkeypatch.setattr(shutil, "rmtree", stopped(shutil.rmtree))
    try: K.save_checkpoint(out, 2, *policy, c, {**state, "best": {"step": 2, "eval/accuracy": 0.5}}, name=BEST)
    except KeyboardInterrupt: pass
    monkeypatch.undo()
    copy = Path(shutil.copytree(out, tmp_path / "copy", symlinks=True))
    with_checkpoint_model(load_config(model="tiny-random"), copy / BEST)            # what eval --checkpoint does first
    assert K.prepare_output_dir(out, cfg(out, steps=4, resume_from="latest")) == out / "checkpoint-1"
    assert K.best_record(out)["step"] in (1, 2) and K.checkpoint_problem(out / BEST) is None
    assert not [*out.glob(".replaced-*"), *copy.glob(".replaced-*")]


# --- 2: overwrite=true removes what the run wrote, and nothing else

def test_overwrite_removes_what_the_run_wrote_and_nothing_else(tmp_path, capsys):
    out = tmp_path / "run"
    train(cfg(out, steps=1, log_with=["jsonl", "tensorboard"]), progress=False)
    board = out / "tensorboard"
    (out / "summary.md").write_text("my notes\n"); (board / "x").mkdir(); (board / "x" / "mine").write_text("mine")
    capsys.readouterr()
    K.prepare_output_dir(out, cfg(out, steps=1, overwrite=True))
    assert capsys.readouterr().out.strip() == (f"overwrite=true: removed the previous run's files from {out}; "
                                               "kept summary.md, tensorboard (they hold what it did not write)")
    assert (out / "summary.md").read_text() == "my notes\n" and (board / "x" / "mine").read_text() == "mine"
    assert [p.name for p in board.iterdir()] == ["x"], "the run's event file is left"
    assert names(out) == [] and not (out / "metrics.jsonl").exists() and not (out / K.WRITTEN).exists()


def test_overwrite_keeps_a_summary_and_a_tensorboard_folder_the_run_did_not_write(tmp_path, no_model):
    out = tmp_path / "run"; (out / "tensorboard" / "x").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 0.0}\n'); (out / "summary.md").write_text("notes\n")
    K.prepare_output_dir(out, cfg(out, steps=1, overwrite=True))
    assert (out / "summary.md").read_text() == "notes\n" and (out / "tensorboard" / "x").is_dir()


# --- 3: an error after completed steps saves the last one first, and says where to resume

def test_a_reward_that_raises_after_a_step_saves_it_and_says_where_to_resume(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(args(out, steps=3, save_every=5, reward_funcs=["reward_fixtures:fails_second"])) == 2
    assert err_lines(capsys)[-1] == ("error: reward function 'fails_second' raised RuntimeError: cannot score this "
                                     f"batch; the last checkpoint is {out / 'checkpoint-1'} "
                                     "(resume_from=latest continues from it)")
    assert names(out) == ["checkpoint-1"] and steps_logged(out) == [1]
    assert K.checkpoint_problem(out / "checkpoint-1") is None


@pytest.mark.parametrize("where", ["generate", "rollout_metrics"])
def test_an_error_in_a_step_saves_the_last_one_unless_the_weights_changed(where, tmp_path, monkeypatch):
    out, calls = tmp_path / "run", []
    owner = HFBackend if where == "generate" else T         # sampling (before the update), or a metric after it
    real = getattr(owner, where)
    def fails_second(*a, **k):
        calls.append(1)
        if len(calls) == 2: raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(*a, **k)
    monkeypatch.setattr(owner, where, fails_second)
    with pytest.raises(RuntimeError) as e: train(cfg(out, steps=3, save_every=5), progress=False)
    # after the update the weights are step 2's, not step 1's: nothing is saved in step 1's name
    saved = out / "checkpoint-1" if where == "generate" else None
    assert e.value.__notes__ == [where_to_resume(saved)] and names(out) == ([saved.name] if saved else [])


# --- 4: a data column never replaces a reward function's setting

def test_a_data_column_named_like_a_reward_functions_setting_is_refused(tmp_path, capsys, no_model):
    task = tmp_path / "t.jsonl"
    task.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1), "bounds": 7}) + "\n"
                            for i in range(4)))
    assert main(args(tmp_path / "run", steps=1, task=str(task), reward_funcs=["reward_fixtures:clipped"])) == 2
    assert err_lines(capsys)[-1] == (
        "error: reward function 'clipped' has the parameter bounds=(0.0, 1.0) and the data has a column 'bounds', "
        "which would be passed in its place: rename the column or the parameter (a parameter without a default, or "
        "with None, is what takes a column)")


# --- 5: a reward function that forks: its child never answers for it

def test_a_reward_function_that_forks_is_scored_by_its_own_process(tmp_path):
    out = tmp_path / "run"
    train(cfg(out, steps=2, reward_funcs=["reward_fixtures:forks"]), progress=False)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["rewards/forks"] < 3 for r in rows), rows   # 100: the child's


# --- 9: checkpoint weights that are a named pipe are refused, never read

def test_checkpoint_weights_that_are_a_named_pipe_are_refused_not_read(tmp_path, capsys):
    out, _, _, _ = saved_run(tmp_path, best=False)
    ck = out / "checkpoint-1"; weights = ck / "adapter" / "adapter_model.safetensors"
    weights.unlink(); os.mkfifo(weights); K.write_manifest(ck)             # as a forger would: the manifest matches
    # (a read would hang in safetensors with the interpreter held, past any time limit: what each checks first)
    with pytest.raises(ConfigError) as e: with_checkpoint_model(load_config(model="tiny-random"), ck)   # eval
    assert str(e.value) == (f"--checkpoint {ck} cannot be used: adapter/adapter_model.safetensors is a named pipe, "
                            "not a file (the checkpoint was altered)")
    assert K.latest_checkpoint(out, verify=True) is None                                     # resume_from=latest
    assert capsys.readouterr().err.strip() == (f"WARNING: skipping {ck}: adapter/adapter_model.safetensors is a named "
                                               "pipe, not a file (the checkpoint was altered)")


# --- 10: a reward module that blocks at import meets a time limit

def test_a_reward_module_that_blocks_at_import_meets_a_time_limit(tmp_path, monkeypatch, capsys, no_model):
    (tmp_path / "blocks_at_import.py").write_text("import time\ntime.sleep(30)        # waits for a server, say\n"
                                                  "def reward(prompts, completions, **k): return [0.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, seconds in (("STARTUP_TIMEOUT_S", 1.0), ("IMPORT_NOTE_S", 0.2)):
        monkeypatch.setattr(R, name, seconds, raising=False)
    started = time.perf_counter()
    assert main(args(tmp_path / "run", steps=1, reward_funcs=["blocks_at_import:reward"])) == 2
    assert time.perf_counter() - started < 15
    assert err_lines(capsys)[-2:] == [
        "waiting for the reward module 'blocks_at_import' (reward_funcs: 'blocks_at_import:reward') to import; "
        "given up after 1 s",
        "error: reward_funcs: cannot load reward function 'blocks_at_import:reward': importing 'blocks_at_import' took "
        "more than 1 s (does it wait for input, a lock or the network when imported?): make its import quick, e.g. do "
        "that work in the function"]
