"""Trust in a run's folder, proven on the tiny random model: checkpoints hold only data and are checked against their
checksums, a used folder is not silently reused, one run per folder at a time, a resume refuses config changes that
alter the run, SIGINT/SIGTERM save before stopping, and metrics.jsonl stays strict JSON. nbs/50_reliability.ipynb
tabulates them."""
import json, os, shutil, signal, subprocess, sys, threading, time, warnings
from pathlib import Path

import pytest
import torch

import mmrgrpo.trainer as T
from mmrgrpo.cli import main
from mmrgrpo.config import ConfigError, load_config
from mmrgrpo.sampling import HFBackend
import mmrgrpo.checkpoints as K
from mmrgrpo.checkpoints import (CheckpointError, TrainingInterrupted, checkpoint_problem, latest_checkpoint,
                                 load_checkpoint)
from mmrgrpo.runlog import MetricsLogger, read_metrics
from mmrgrpo.trainer import plot_rewards, train

TESTS = Path(__file__).resolve().parent
# reward_fixtures:<name> must import here and in children
if str(TESTS) not in sys.path: sys.path.insert(0, str(TESTS))

BASE = dict(model="tiny-random", num_generations=4, prompts_per_step=2, max_completion_length=8, eval_size=0,
            log_completions_every=0, save_every=1, learning_rate=1e-3, reward_funcs=["reward_fixtures:varied"],
            reward_weights=None)


def cfg(out, **kw):
    return load_config(**{**BASE, "output_dir": str(out), **kw})


def args(out, **kw) -> list:
    "`mmrgrpo train` arguments for the same run."
    return ["train", *[f"{k}={json.dumps(v)}" for k, v in {**BASE, "output_dir": str(out), **kw}.items()]]


def steps_logged(out) -> list:
    return [r["step"] for r in read_metrics(Path(out) / "metrics.jsonl") if "loss" in r]


def names(out, pattern="checkpoint-*") -> list:
    return sorted(p.name for p in Path(out).glob(pattern))


def child_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def fresh_policy(c):
    model, _ = T.load_policy(c)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=c.learning_rate)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


@pytest.fixture(scope="module")
def run3(tmp_path_factory):
    "A finished 3-step run (checkpoint-2 and checkpoint-3 kept); tests work on copies."
    out = tmp_path_factory.mktemp("run3")
    train(cfg(out, steps=3), progress=False)
    assert names(out) == ["checkpoint-2", "checkpoint-3"] and steps_logged(out) == [1, 2, 3]
    return out


@pytest.fixture
def run(run3, tmp_path):
    return Path(shutil.copytree(run3, tmp_path / "run"))


def send_in_generate(monkeypatch, at: dict):
    """Make the sampler send this process the signals `at[call]` when it is called for the call-th time (one call per
    step)."""
    real, calls = HFBackend.generate, []
    def generate(self, *a, **k):
        calls.append(1)
        for s in at.get(len(calls), []): os.kill(os.getpid(), s)
        return real(self, *a, **k)
    monkeypatch.setattr(HFBackend, "generate", generate)


# --- 1: a checkpoint is data: loading one runs no code


class Payload:
    "Unpickling this runs code: it writes a marker file."
    def __init__(self, marker): self.marker = str(marker)
    def __reduce__(self): return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_a_checkpoint_cannot_run_code(run, tmp_path):
    ck, marker = run / "checkpoint-3", tmp_path / "ran"
    t = torch.load(ck / "training.pt", weights_only=True)       # what we write loads with weights_only=True
    assert set(t) == {"optimizer", "scheduler", "rng"}
    t["note"] = Payload(marker)
    torch.save(t, ck / "training.pt")
    K.write_manifest(ck)                                         # as a forger would: the checksums match
    c = cfg(run, steps=4)
    with pytest.raises(CheckpointError, match="holds objects other than tensors and plain data, which are not loaded"):
        load_checkpoint(ck, *fresh_policy(c))
    assert main(["eval", "model=tiny-random", "eval_size=1", "--checkpoint", str(ck)]) == 2
    with pytest.raises(CheckpointError): train(cfg(run, steps=4, resume_from="latest"), progress=False)
    assert not marker.exists(), "the payload ran"


# --- 4: a fresh run into a used output_dir is refused; overwrite=true replaces the old run


def test_a_fresh_run_refuses_a_used_folder_and_overwrite_replaces_it(run, capsys):
    (run / "notes.txt").write_text("mine")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError) as e: train(cfg(run, steps=1), progress=False)
    assert str(e.value) == (f"output_dir={str(run)!r} holds a run (checkpoint-2, checkpoint-3, metrics.jsonl): "
                            "continue it with resume_from=latest, replace it with overwrite=true, "
                            "or choose another output_dir")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before, "a refused run changed the folder"
    train(cfg(run, steps=1, overwrite=True), progress=False)
    assert "overwrite=true: removed the previous run's files" in capsys.readouterr().out
    assert names(run) == ["checkpoint-1"] and latest_checkpoint(run).name == "checkpoint-1"
    assert steps_logged(run) == [1] and (run / "notes.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="overwrite=true removes the run that resume_from='latest' continues"):
        cfg(run, overwrite=True, resume_from="latest")


# --- 5: two runs in one folder at once: the second is refused; a killed run's lock is not in the way


BLOCKED = """
import json, sys, time
from pathlib import Path
from mmrgrpo.config import load_config
from mmrgrpo.sampling import HFBackend
from mmrgrpo.trainer import train
def generate(self, *a, **k):
    Path(sys.argv[2]).write_text("in step 1"); time.sleep(600)
HFBackend.generate = generate
train(load_config(**json.loads(sys.argv[1])), progress=False)
"""


def test_a_second_run_in_the_same_folder_is_refused(tmp_path):
    out, started = tmp_path / "run", tmp_path / "started"
    first = subprocess.Popen([sys.executable, "-c", BLOCKED, json.dumps({**BASE, "output_dir": str(out), "steps": 2}),
                              str(started)],
                             env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not started.exists() and first.poll() is None and time.monotonic() < deadline: time.sleep(0.1)
        assert started.exists(), (first.stderr.read()[-3000:] if first.poll() is not None
                                  else "the first run did not start")
        with pytest.raises(ConfigError) as e: train(cfg(out, steps=1), progress=False)
        assert f"output_dir={str(out)!r} is in use by another run (process {first.pid} on " in str(e.value)
    finally:
        first.kill(); first.wait(timeout=60)
    assert (out / K.LOCK).exists()              # killed: its lock file is left behind, and it no longer holds anything
    with K.output_dir_lock(out): assert (out / K.LOCK).read_text().startswith(f"process {os.getpid()} on ")
    assert not (out / K.LOCK).exists()


# --- 6: a resume compares configs: changes that alter the run are refused, schedule and logging changes are allowed and
# logged


REFUSED = {"learning rate": dict(learning_rate=1e-2), "G": dict(num_generations=2), "batch": dict(prompts_per_step=4),
           "loss": dict(loss_type="dr_grpo"), "method": dict(mmr=True), "seed": dict(seed=5),
           "model": dict(model="smollm2")}


@pytest.mark.parametrize("case", list(REFUSED))
def test_resume_refuses_a_config_change_that_alters_the_run(case, run, no_model):
    (key, value), = REFUSED[case].items()
    config_before = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError) as e:
        train(cfg(run, steps=4, resume_from="latest", **REFUSED[case]), progress=False)
    was, now = str(e.value).split("; this config has ")        # a switch may move a derived field too (mmr -> reweight)
    assert (was.startswith(f"resume_from='latest': {run / 'checkpoint-3'} was trained with ")
            and f"{key}={getattr(cfg(run), key)!r}" in was)
    assert f"{key}={value!r}" in now and now.endswith(
        ". These change what the run is: resume with the checkpoint's values, "
        "or start a new run (overwrite=true or another output_dir)")
    assert (run / "config.yaml").read_text() == config_before


def test_resume_allows_and_logs_schedule_changes(run, capsys):
    train(cfg(run, steps=4, save_every=2, eval_every=5, resume_from="latest"), progress=False)
    out = capsys.readouterr().out
    for line in ["resume: steps changed from 3 to 4", "resume: save_every changed from 1 to 2",
                 "resume: eval_every changed from 0 to 5", f"Resuming from {run / 'checkpoint-3'} (step 3)"]:
        assert line in out, out
    assert steps_logged(run) == [1, 2, 3, 4] and latest_checkpoint(run).name == "checkpoint-4"


# --- 7: a corrupted newest checkpoint is found by its manifest and skipped, saying which and why


def cut(p): p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def flip(p, at=-20):
    b = bytearray(p.read_bytes()); b[at] ^= 0x01; p.write_bytes(bytes(b))


CORRUPT = {   # what is done to checkpoint-3 -> what the skip says
    "cut weights": (lambda ck: cut(ck / "adapter" / "adapter_model.safetensors"),
                    "adapter/adapter_model.safetensors has {} bytes, its manifest says"),
    "flipped byte in training.pt": (lambda ck: flip(ck / "training.pt"),
                                    "training.pt does not match its SHA-256 in manifest.json (altered or corrupted)"),
    "flipped byte in trainer_state.json": (lambda ck: flip(ck / "trainer_state.json", at=-2),
                                           "trainer_state.json does not match its SHA-256"),
    "cut manifest": (lambda ck: cut(ck / "manifest.json"), "its manifest.json is unreadable"),
    "no manifest": (lambda ck: (ck / "manifest.json").unlink(), "it has no manifest.json"),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_a_corrupted_checkpoint_is_skipped_saying_why(case, run, capsys, no_model):
    ck = run / "checkpoint-3"
    damage, why = CORRUPT[case]
    damage(ck)
    if "{}" in why: why = why.format((ck / "adapter" / "adapter_model.safetensors").stat().st_size)
    assert why in checkpoint_problem(ck)
    assert latest_checkpoint(run, verify=True) == run / "checkpoint-2"
    assert f"WARNING: skipping {ck}: {why}" in capsys.readouterr().err
    with pytest.raises(CheckpointError) as e: train(cfg(run, steps=4, resume_from=str(ck)), progress=False)
    assert f"resume_from={str(ck)!r} cannot be used: {why}" in str(e.value)
    with pytest.raises(CheckpointError) as e: load_checkpoint(ck, None, None, None)
    assert f"checkpoint {ck} cannot be used: {why}" in str(e.value)


def test_resume_latest_continues_from_the_newest_checkpoint_that_verifies(run, capsys):
    flip(run / "checkpoint-3" / "training.pt")
    train(cfg(run, steps=3, resume_from="latest"), progress=False)
    err, out = capsys.readouterr()[::-1]
    assert f"WARNING: skipping {run / 'checkpoint-3'}: training.pt does not match its SHA-256" in err
    assert f"Resuming from {run / 'checkpoint-2'} (step 2)" in out
    assert steps_logged(run) == [1, 2, 3] and checkpoint_problem(run / "checkpoint-3") is None     # rewritten


def test_an_unreadable_checkpoint_file_is_an_error_naming_it(run):
    cut(run / "checkpoint-3" / "training.pt")
    c = cfg(run)
    with pytest.raises(CheckpointError, match=rf"checkpoint {run / 'checkpoint-3'} cannot be loaded \(RuntimeError: "):
        load_checkpoint(run / "checkpoint-3", *fresh_policy(c), verify=False)


# --- 8: only checkpoint-<number> folders are the run's


def test_an_earlier_checkpoint_continues_only_in_an_empty_folder(run, tmp_path):
    """In its own folder the new steps would be rotated away first (checkpoint-3 is newer) and a crash would resume the
    old branch."""
    with pytest.raises(ConfigError) as e:
        train(cfg(run, steps=4, resume_from=str(run / "checkpoint-2")), progress=False)
    assert f"is step 2 of the run in {run}, which went on to checkpoint-3" in str(e.value)
    assert names(run) == ["checkpoint-2", "checkpoint-3"] and steps_logged(run) == [1, 2, 3]        # nothing touched
    branch = tmp_path / "branch"
    train(cfg(branch, steps=4, resume_from=str(run / "checkpoint-2")), progress=False)
    assert names(branch) == ["checkpoint-3", "checkpoint-4"] and steps_logged(branch) == [3, 4]


def test_only_numbered_checkpoint_folders_are_the_runs(run):
    mine = {"checkpoint-best/weights.bin": "best", "checkpoint-2-backup/weights.bin": "backup",
            "checkpoint-notes.txt": "notes"}
    for name, text in mine.items():
        (run / name).parent.mkdir(exist_ok=True); (run / name).write_text(text)
    train(cfg(run, steps=4, resume_from="latest"), progress=False)        # resume, then prune checkpoint-2
    assert names(run) == ["checkpoint-2-backup", "checkpoint-3", "checkpoint-4", "checkpoint-best",
                          "checkpoint-notes.txt"]
    assert all((run / name).read_text() == text for name, text in mine.items())
    assert steps_logged(run) == [1, 2, 3, 4] and latest_checkpoint(run).name == "checkpoint-4"


# --- 9: SIGTERM and SIGINT end the step, save a checkpoint, say where, and exit non-zero


# A child that is sent signals sets the dispositions it needs itself: the test command may run with SIGHUP ignored
# (`nohup`), or SIGINT ignored (`&` in a script), and a child inherits what was ignored.
DEFAULT_SIGNALS = """
import signal
for _s in (signal.SIGHUP, signal.SIGTERM): signal.signal(_s, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
"""

SELF_TERM = DEFAULT_SIGNALS + """
import os, signal, sys
from mmrgrpo.cli import main
from mmrgrpo.sampling import HFBackend
real, calls = HFBackend.generate, []
def generate(self, *a, **k):
    calls.append(1)
    if len(calls) == 2: os.kill(os.getpid(), signal.SIGTERM)      # what a scheduler sends, in the middle of step 2
    return real(self, *a, **k)
HFBackend.generate = generate
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", SELF_TERM, *args(out, steps=4, save_every=3)], env=child_env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 143, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == (f"SIGTERM: stopped after step 2; saved {out / 'checkpoint-2'} "
                                                 "(resume_from=latest continues from it)"), p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "SIGTERM: finishing this step" in p.stderr
    assert (names(out) == ["checkpoint-2"] and checkpoint_problem(out / "checkpoint-2") is None
            and steps_logged(out) == [1, 2])
    assert not (out / K.LOCK).exists()


def test_ctrl_c_saves_and_the_cli_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    send_in_generate(monkeypatch, {2: [signal.SIGINT]})
    try: code = main(args(out, steps=4, save_every=3))
    # (uncaught, it would stop the whole session)
    except KeyboardInterrupt as e: pytest.fail(f"the CLI let {e!r} escape")
    assert code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"SIGINT: stopped after step 2; saved {out / 'checkpoint-2'} "
                       "(resume_from=latest continues from it)")
    assert names(out) == ["checkpoint-2"] and steps_logged(out) == [1, 2]
    assert (signal.getsignal(signal.SIGINT),
            signal.getsignal(signal.SIGTERM)) == handlers, "train must restore the handlers"


def test_a_second_signal_abandons_the_step(tmp_path, monkeypatch):
    out = tmp_path / "run"
    send_in_generate(monkeypatch, {2: [signal.SIGINT, signal.SIGINT]})
    with pytest.raises(KeyboardInterrupt) as e: train(cfg(out, steps=4), progress=False)
    assert isinstance(e.value, TrainingInterrupted), repr(e.value)
    assert str(e.value) == (f"SIGINT again: abandoned the step in progress; the last checkpoint is "
                            f"{out / 'checkpoint-1'} (resume_from=latest continues from it)")
    assert e.value.exit_code == 130 and names(out) == ["checkpoint-1"] and steps_logged(out) == [1]


def test_train_in_a_thread_installs_no_handlers(tmp_path):
    handlers, errors = signal.getsignal(signal.SIGINT), []
    def run():
        try: train(cfg(tmp_path / "run", steps=1), progress=False)
        except BaseException as e: errors.append(e)
    t = threading.Thread(target=run); t.start(); t.join(timeout=600)
    assert not errors and steps_logged(tmp_path / "run") == [1] and signal.getsignal(signal.SIGINT) is handlers


# --- 10: metrics.jsonl: a cut last line is skipped and counted, NaN is written as null, the resume rewrite is atomic


def test_a_cut_last_metrics_line_is_skipped_and_counted(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.7}\n{"step": 3, "rew')
    assert read_metrics(path) == [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.7}]
    assert f"WARNING: {path}: skipped 1 line cut short (line 3, the last" in capsys.readouterr().err
    assert plot_rewards(path, tmp_path / "curve.png").exists()
    path.write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew\n{"step": 3, "reward": 0.7}\n')
    with pytest.raises(ValueError, match=f"{path} line 2 is not JSON"): read_metrics(path)


def test_nonfinite_metrics_are_written_as_null(tmp_path):
    log = MetricsLogger(tmp_path)
    log.log({"reward": float("nan"), "loss": float("inf"), "kl": 0.25, "eval/by_level": [1.0, float("-inf")]}, 1)
    log.close()
    def strict(constant): raise ValueError(f"{constant} is not JSON")
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line, parse_constant=strict) == {"step": 1, "reward": None, "loss": None, "kl": 0.25,
                                                       "eval/by_level": [1.0, None]}
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["reward"] is None
    with warnings.catch_warnings():
        # nothing finite to draw: a note on the plot, no legend warning
        warnings.simplefilter("error", UserWarning)
        assert plot_rewards(tmp_path / "metrics.jsonl", tmp_path / "curve.png").exists()


def test_close_finishes_the_trackio_run(tmp_path, monkeypatch):
    "A stand-in trackio records its calls: the logger's close ends the trackio run, as it ends wandb's."
    import types
    calls = []
    trackio = types.ModuleType("trackio")
    trackio.init = lambda **kw: calls.append("init")
    trackio.log = lambda metrics, step=None: calls.append(("log", step))
    trackio.finish = lambda: calls.append("finish")
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    log = MetricsLogger(tmp_path, ("jsonl", "trackio"))
    log.log({"reward": 0.5}, 1)
    log.close()
    assert calls == ["init", ("log", 1), "finish"], calls


FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from mmrgrpo.runlog import MetricsLogger
# a write past the limit then fails with EFBIG instead of killing us
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
path = Path(sys.argv[1]) / "metrics.jsonl"
resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size // 2, resource.RLIM_INFINITY))   # room for half the file
# a resume rewrites the file (dropping lines after the checkpoint)
try: MetricsLogger(path.parent, resume_step=10**9)
except OSError as e: print("failed:", e.strerror)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE")
def test_the_resume_rewrite_of_metrics_never_leaves_half_a_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward": s / 100, "pad": "x" * 200}) + "\n" for s in range(1, 201)))
    before = path.read_bytes()
    p = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], env=child_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and "failed: File too large" in p.stdout, p.stdout + p.stderr[-3000:]
    assert path.read_bytes() == before, "the rewrite cut metrics.jsonl"
    assert sorted(q.name for q in tmp_path.iterdir()) == ["metrics.jsonl"]          # no temporary file left
