"""Trust, round 4 (issue 45, items 1-13), proven on the tiny random model: ordinary stops (a dead terminal, nohup, a
scheduler's SIGTERM) never lose a step, a run never claims what it did not do, and no folder or file it is handed is
overwritten by mistake. nbs/50_reliability.ipynb tabulates them."""
import errno, json, os, signal, subprocess, sys
from pathlib import Path

import pytest

import mmrgrpo.trainer as T
from mmrgrpo.checkpoints import CheckpointError, TrainingInterrupted
from mmrgrpo.cli import main
from mmrgrpo.config import ConfigError
from mmrgrpo.trainer import train

TESTS = Path(__file__).resolve().parent
# reward_fixtures:<name> must import here and in children
if str(TESTS) not in sys.path: sys.path.insert(0, str(TESTS))
from test_runs import DEFAULT_SIGNALS, args, cfg, child_env, names, steps_logged


def err_lines(capsys) -> list:
    return capsys.readouterr().err.strip().splitlines()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    "A finished two-step run (checkpoint-1 and checkpoint-2), for tests that only read it; copy it before changing it."
    out = tmp_path_factory.mktemp("finished") / "run"
    train(cfg(out, steps=2), progress=False)
    return out


def copy_run(src: Path, dest: Path) -> Path:
    import shutil
    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns(".mmrgrpo.lock"))
    return dest


# --- 10: resuming with steps not past the checkpoint's step is an error, and config.yaml is left alone

@pytest.mark.parametrize("steps", [1, 2])
def test_resume_with_steps_not_past_the_checkpoint_is_refused(steps, finished_run, tmp_path, no_model):
    out = copy_run(finished_run, tmp_path / "run")
    before = (out / "config.yaml").read_text()
    with pytest.raises(ConfigError) as e: train(cfg(out, steps=steps, resume_from="latest"), progress=False)
    assert str(e.value) == (f"steps={steps}: {out / 'checkpoint-2'} is already at step 2, so resuming would train "
                            "nothing: set steps above 2"), str(e.value)
    assert (out / "config.yaml").read_text() == before


# --- 11: an output_dir that is a link to a checkpoint is inside that checkpoint

def test_output_dir_linking_to_a_checkpoint_is_refused(finished_run, tmp_path, no_model):
    out = copy_run(finished_run, tmp_path / "run")
    link = tmp_path / "link"; link.symlink_to(out / "checkpoint-2")
    before = sorted(p.name for p in (out / "checkpoint-2").iterdir())
    with pytest.raises(ConfigError) as e: train(cfg(link), progress=False)
    assert f"output_dir={str(link)!r} is inside the checkpoint {out / 'checkpoint-2'}" in str(e.value), str(e.value)
    assert sorted(p.name for p in (out / "checkpoint-2").iterdir()) == before


# --- 12: a new run never replaces the config file it was started from

def test_a_new_run_does_not_overwrite_its_own_config_file(tmp_path, capsys, no_model):
    out = tmp_path / "run"; out.mkdir()
    text = "# my notes\n" + "".join(f"{k}: {json.dumps(v)}\n" for k, v in {**cfg(out).__dict__}.items() if k in (
        "model", "num_generations", "prompts_per_step", "max_completion_length", "eval_size", "output_dir"))
    (out / "config.yaml").write_text(text)
    assert main(["train", "--config", str(out / "config.yaml"), "steps=1"]) == 2
    line = err_lines(capsys)[-1]
    assert line == (f"error: --config {out / 'config.yaml'} is the config.yaml that a run in output_dir={str(out)!r} "
                    "writes: copy it out of output_dir and pass the copy, or pass overwrite=true to let the run "
                    "replace it"), line
    assert (out / "config.yaml").read_text() == text


# --- 13: the demo replaces only its own earlier run

def test_the_demo_does_not_delete_a_train_run_in_its_folder(finished_run, tmp_path, monkeypatch, capsys, no_model):
    monkeypatch.chdir(tmp_path)
    out = copy_run(finished_run, tmp_path / "runs" / "demo")
    before = sorted(p.name for p in out.iterdir())
    assert main(["demo"]) == 2
    line = err_lines(capsys)[-1]
    assert line == ("error: runs/demo holds a run that the demo did not write (checkpoint-1, checkpoint-2, "
                    "metrics.jsonl): move it away, or run the demo elsewhere with output_dir=<folder>"), line
    assert sorted(p.name for p in out.iterdir()) == before


# --- 1: a lost stdout or terminal stops the run after the step in progress, saved, naming the reason

class DeadAfter:
    "A stream that fails like a closed pipe (EPIPE) or a lost terminal (EIO) once `when` has been written."
    def __init__(self, err: int, when: str = "step 1/"):
        self.err, self.when, self.dead, self.text = err, when, False, ""
    def write(self, s):
        if self.dead or self.when in s: self.dead = True; raise OSError(self.err, os.strerror(self.err))
        self.text += s; return len(s)
    def flush(self):
        if self.dead: raise OSError(self.err, os.strerror(self.err))


@pytest.mark.parametrize("err,signum", [(errno.EPIPE, signal.SIGPIPE), (errno.EIO, signal.SIGHUP)])
def test_a_lost_stdout_stops_the_run_after_the_step_with_it_saved(err, signum, tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "stdout", DeadAfter(err))
    with pytest.raises(TrainingInterrupted) as e: train(cfg(out, steps=4, save_every=5), progress=False)
    cause = "BrokenPipeError: Broken pipe" if err == errno.EPIPE else "OSError: Input/output error"
    assert str(e.value) == (f"stdout was lost ({cause}): stopped after step 1; saved {out / 'checkpoint-1'} "
                            "(resume_from=latest continues from it)"), str(e.value)
    assert e.value.exit_code == 128 + signum and names(out) == ["checkpoint-1"] and steps_logged(out) == [1]


def test_a_closed_stdout_pipe_in_a_cli_run_saves_and_exits_141(tmp_path):
    out, (r, w) = tmp_path / "run", os.pipe()
    os.close(r)                                     # `| tee` was killed: every write to stdout fails with EPIPE
    code = "import sys; from mmrgrpo.cli import main; sys.exit(main(sys.argv[1:]))"
    p = subprocess.run([sys.executable, "-c", code, *args(out, steps=4, save_every=5)], env=child_env(), stdout=w,
                       stderr=subprocess.PIPE, text=True, timeout=600)
    os.close(w)
    assert p.returncode == 141, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == (
        f"stdout was lost (BrokenPipeError: Broken pipe): stopped after step 1; saved "
        f"{out / 'checkpoint-1'} (resume_from=latest continues from it)"), p.stderr[-3000:]
    assert "Traceback" not in p.stderr and names(out) == ["checkpoint-1"]


def test_the_terminals_sighup_after_its_lost_output_is_still_a_first_signal(tmp_path):
    from mmrgrpo.signals import StopSignals
    stop = StopSignals(tmp_path); stop.defer = True
    # a write failed before the hang-up arrived
    stop.lost_output("stdout", OSError(errno.EIO, os.strerror(errno.EIO)))
    # not "again": the step still ends and is saved
    stop._handle(signal.SIGHUP, None)
    assert stop.requested() and stop.why() == "stdout was lost (OSError: Input/output error)"

# --- 2: nohup's SIGHUP ignore is kept

def test_an_ignored_sighup_stays_ignored(tmp_path, monkeypatch):
    from mmrgrpo.sampling import HFBackend
    real, calls = HFBackend.generate, []
    def generate(self, *a, **k):
        calls.append(1)
        if len(calls) == 1: os.kill(os.getpid(), signal.SIGHUP)          # the terminal went away; nohup said to go on
        return real(self, *a, **k)
    monkeypatch.setattr(HFBackend, "generate", generate)
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try: train(cfg(tmp_path / "run", steps=2), progress=False)
    finally: signal.signal(signal.SIGHUP, old)
    assert steps_logged(tmp_path / "run") == [1, 2]


# --- 3: SIGTERM to the process group while rewards run leaves the verifier processes scoring

TERM_WHILE_VERIFYING = DEFAULT_SIGNALS + """
import sys, mmrgrpo.rewards as V, reward_fixtures as F       # where accuracy_reward looks verify_batch up
real = V.verify_batch
def verify_batch(golds, completions, timeout=2.0, _score_fn=None):     # the first pair's worker sends the SIGTERM
    return real(["term"] + ["1"] * (len(golds) - 1), completions, timeout, _score_fn=F._term_trainer_then_score)
V.verify_batch = verify_batch
from mmrgrpo.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_to_the_process_group_during_rewards_scores_nothing_as_zero(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", TERM_WHILE_VERIFYING,
                        *args(out, steps=3, save_every=5, task="arithmetic:1", reward_funcs=["accuracy"])],
                       env={**child_env(), "MMRGRPO_REWARD_WORKERS": "2"}, capture_output=True, text=True, timeout=600,
                       start_new_session=True)          # its own process group, as a scheduler's job has
    assert p.returncode == 143, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == (f"SIGTERM: stopped after step 1; saved {out / 'checkpoint-1'} "
                                                 "(resume_from=latest continues from it)"), p.stderr[-3000:]
    from mmrgrpo.runlog import read_metrics
    row = [r for r in read_metrics(out / "metrics.jsonl") if r.get("step") == 1][0]
    assert (row["rewards/errors"], row["rewards/accuracy_reward"]) == (0, 1.0), row

# --- 6: a reward module that calls sys.exit on import is an error, not "exit 0, nothing trained"

@pytest.mark.parametrize("code", [0, 3])
def test_a_reward_module_exiting_on_import_is_an_error(code, tmp_path, monkeypatch, capsys, no_model):
    (tmp_path / "exits_on_import.py").write_text(f"import sys\nsys.exit({code})\n"
                                                 "def reward(prompts, completions, **k): return [0.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(args(tmp_path / "run", reward_funcs=["exits_on_import:reward"])) == 2
    assert err_lines(capsys)[-1] == ("error: reward_funcs: cannot load reward function 'exits_on_import:reward': "
                                     f"importing 'exits_on_import' raised SystemExit: {code}"), err_lines(capsys)


# --- 7: a best-checkpoint that could not be written is an error, never reported as there

def test_a_failed_best_checkpoint_save_is_an_error_not_a_claim(tmp_path, monkeypatch, capsys):
    from test_best_checkpoint import RUN, scripted_evals
    from mmrgrpo.checkpoints import BEST
    out = tmp_path / "run"
    left = scripted_evals(monkeypatch, [0.2, 0.5, 0.4])                  # before training, after step 1, after step 2
    real = T.save_checkpoint
    # the name is taken by a file (or the disk is full)
    def taken(out, step, *a, name=None, **k):
        if name == BEST: (out / BEST).write_text("not a folder")
        return real(out, step, *a, name=name, **k)
    monkeypatch.setattr(T, "save_checkpoint", taken)
    assert main(args(out, **{**RUN, "steps": 2})) == 2
    assert left == [] and (out / BEST).is_file()
    err = capsys.readouterr()
    assert "best held-out accuracy" not in err.out
    assert err.err.strip().splitlines()[-1] == (
        f"error: save_best: {out / BEST} was not written for the best held-out evaluation (eval/accuracy 0.500 after "
        f"step 1; the warning above says why), there is no best-checkpoint; the final checkpoint is "
        f"{out / 'checkpoint-2'}: free space or remove what holds the name {BEST}, then train again"), err.err[-2000:]


# --- 9: an adapter whose tensor names were changed or half removed is refused, naming them

@pytest.mark.parametrize("change", ["renamed", "half removed"])
def test_an_adapter_with_changed_tensor_names_is_refused(change, finished_run, tmp_path):
    from safetensors.torch import load_file, save_file
    from mmrgrpo.checkpoints import load_checkpoint, write_manifest
    from test_runs import fresh_policy
    ck = copy_run(finished_run, tmp_path / "run") / "checkpoint-2"
    path = ck / "adapter" / "adapter_model.safetensors"
    weights = load_file(path); keys = sorted(weights)
    if change == "renamed": weights = {k.replace("lora_B", "lora_b"): v for k, v in weights.items()}
    else: weights = {k: weights[k] for k in keys[: len(keys) // 2]}
    save_file(weights, path); write_manifest(ck)                       # the manifest rewritten to match
    with pytest.raises(CheckpointError) as e: load_checkpoint(ck, *fresh_policy(cfg(tmp_path / "x")))
    first_missing = sorted(set(keys) - set(weights))[0]
    assert str(e.value).startswith(f"{path} does not match this model's adapter (missing tensors: "), str(e.value)
    assert first_missing in str(e.value) and ("unknown tensors" in str(e.value)) == (change == "renamed"), str(e.value)
    assert str(e.value).endswith("use another checkpoint") and "\n" not in str(e.value)


# --- 8: eval_task naming the task's own file is refused; `mmrgrpo eval` on a file scores the rows a run holds out

def questions_file(tmp_path) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(12)))
    return path


@pytest.mark.parametrize("how", ["same path", "relative", "link"])
def test_eval_task_naming_the_training_file_is_refused(how, tmp_path, monkeypatch, no_model):
    path = questions_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    other = {"same path": str(path), "relative": "tasks.jsonl", "link": str(tmp_path / "link.jsonl")}[how]
    if how == "link": (tmp_path / "link.jsonl").symlink_to(path)
    with pytest.raises(ConfigError) as e:
        train(cfg(tmp_path / "run", task=str(path), eval_task=other, eval_size=2), progress=False)
    assert str(e.value) == (f"eval_task={other!r} is the file task={str(path)!r} names, so every held-out row would "
                            "be a training row: leave eval_task out (the run then holds eval_size=2 rows of it out) "
                            "or name other data")


def test_mmrgrpo_eval_on_a_file_scores_the_rows_a_run_holds_out(tmp_path, monkeypatch, capsys):
    from mmrgrpo.data import load_tasks, split_held_out
    path = questions_file(tmp_path)
    trained, held = split_held_out(load_tasks(str(path)), 3, str(path))
    # not the first rows
    assert [t["question"] for t in held] != [t["question"] for t in load_tasks(str(path), limit=3)]
    scored = []
    monkeypatch.setattr(T, "run_eval",
                        lambda backend, prompts, *a, **k: scored.extend(prompts) or {"eval/accuracy": 0.0})
    assert main(["eval", "model=tiny-random", f"task={path}", "eval_size=3"]) == 0
    assert [[t["question"] for t in held if t["question"] in p] for p in scored] == [[t["question"]] for t in held]
    assert not any(t["question"] in p for p in scored for t in trained)
    assert (f"eval: {path} is a file: scoring the 3 rows that a training run with eval_size=3 holds out"
            in capsys.readouterr().err)


# --- 5: a thread a reward function leaves running does not keep the process alive after the run

def test_a_thread_left_running_by_a_reward_does_not_hold_the_process(tmp_path):
    code = "from mmrgrpo.cli import entry; entry()"
    p = subprocess.run([sys.executable, "-c", code, *args(tmp_path / "run", steps=1,
                        reward_funcs=["leaves_a_thread:reward"])],
                       env=child_env(), capture_output=True, text=True, timeout=240)   # (before the fix it never ended)
    assert p.returncode == 0, p.stderr[-3000:]
    assert ("WARNING: exiting without waiting for a thread still running 10 s after the command ended"
            in p.stderr), p.stderr[-2000:]
    assert names(tmp_path / "run") == ["checkpoint-1"]


# --- 4: a named reward function that holds the interpreter is stopped by its time limit (it runs in its own process)

def test_a_reward_holding_the_interpreter_is_stopped_by_its_time_limit(tmp_path, capsys):
    assert main(args(tmp_path / "run", steps=1, reward_funcs=["reward_fixtures:holds_the_interpreter"],
                     reward_timeout=0.05)) == 2
    assert err_lines(capsys)[-1] == ("error: reward function 'holds_the_interpreter' took more than 0.4 s for 8 "
                                     "completions (reward_timeout=0.05 s per completion)"), err_lines(capsys)[-3:]


def test_a_late_reward_passed_as_an_object_says_what_remains():
    import threading
    from mmrgrpo.rewards import RewardFunctionError, compute_rewards
    release = threading.Event()
    def waits(prompts, completions, **k): release.wait(60); return [0.0]
    try:
        with pytest.raises(RewardFunctionError) as e: compute_rewards([waits], None, ["p"], ["a"], {}, timeout=0.1)
    finally: release.set()
    assert str(e.value).endswith(
        "a function passed as an object runs on in a thread, which no limit stops: name it as "
        "'module:function' in reward_funcs to run it in a process the limit kills"), str(e.value)
