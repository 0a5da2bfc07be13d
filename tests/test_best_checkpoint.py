"""save_best: the run keeps best-checkpoint, the weights of its best held-out evaluation so far, on the tiny random
model. The evaluations are scripted (the tiny model's accuracy is always 0), so each test says which step must win."""
import json, shutil, sys
from pathlib import Path

import pytest

import mmrgrpo.trainer as T
from mmrgrpo.checkpoints import BEST, checkpoint_problem
from mmrgrpo.config import load_config
from mmrgrpo.trainer import train

TESTS = Path(__file__).resolve().parent
# reward_fixtures:varied, rewards that differ in a group
if str(TESTS) not in sys.path: sys.path.insert(0, str(TESTS))

RUN = dict(reward_funcs=["reward_fixtures:varied"], reward_weights=None, model="tiny-random", num_generations=4,
           prompts_per_step=2, max_completion_length=6, eval_size=2, eval_every=1,
           save_every=1, log_completions_every=0, learning_rate=1e-3, save_best=True, autocast_bf16=False,
           sampler_dtype="float32")


def scripted_evals(monkeypatch, accuracies: list):
    "Each held-out evaluation returns the next accuracy of the list (and fails if the run evaluates more often)."
    left = list(accuracies)
    monkeypatch.setattr(T, "run_eval", lambda *a, **k: {"eval/accuracy": left.pop(0)})
    return left


def saves(monkeypatch, keep: Path) -> list:
    "Record every checkpoint the trainer writes, as (folder name, step), and keep a copy of each under `keep`."
    written, save = [], T.save_checkpoint
    def spy(out, step, *a, name=None, **k):
        dest = save(out, step, *a, name=name, **k)
        written.append((dest.name, step)); shutil.copytree(dest, keep / f"{dest.name}-at-{len(written)}")
        return dest
    monkeypatch.setattr(T, "save_checkpoint", spy)
    return written


def trainer_state(ck: Path) -> dict:
    return json.loads((ck / "trainer_state.json").read_text())


def adapter_bytes(ck: Path) -> bytes:
    return (ck / "adapter" / "adapter_model.safetensors").read_bytes()


def test_best_checkpoint_holds_the_weights_of_the_best_evaluation(tmp_path, monkeypatch, capsys):
    out, keep = tmp_path / "run", tmp_path / "copies"; keep.mkdir()
    left = scripted_evals(monkeypatch, [0.2, 0.3, 0.6, 0.6, 0.4])      # before training, steps 1-3, after step 4
    written = saves(monkeypatch, keep)
    res = train(load_config(**RUN, steps=4, output_dir=str(out)), progress=False)
    assert left == []
    # a new best at steps 0, 1 and 2; the tie at step 3 keeps step 2, the final 0.4 is below it
    assert [w for w in written if w[0] == BEST] == [(BEST, 0), (BEST, 1), (BEST, 2)]
    best = out / BEST
    assert checkpoint_problem(best) is None
    assert trainer_state(best)["step"] == 2 and trainer_state(best)["best"] == {"step": 2, "eval/accuracy": 0.6}
    assert res.best == {"step": 2, "eval/accuracy": 0.6}
    # rotated out of the run folder since
    regular = keep / f"checkpoint-2-at-{written.index(('checkpoint-2', 2)) + 1}"
    assert adapter_bytes(best) == adapter_bytes(regular)                               # the weights as step 2 left them
    assert adapter_bytes(best) != adapter_bytes(out / "checkpoint-4")
    # rotation leaves it alone
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert f"best held-out accuracy 0.600 at step 2: {best}" in capsys.readouterr().out
    assert T.plot_rewards(out / "metrics.jsonl", tmp_path / "curve.png", best=res.best).stat().st_size > 0   # starred


def test_a_resumed_run_compares_with_what_best_checkpoint_holds(tmp_path, monkeypatch):
    """The evaluation after the last step can be the best: it is in best-checkpoint and not in the last checkpoint's
    state."""
    out = tmp_path / "run"
    # before, step 1, after step 2: step 2 is the best
    scripted_evals(monkeypatch, [0.1, 0.2, 0.7])
    train(load_config(**RUN, steps=2, output_dir=str(out)), progress=False)
    assert trainer_state(out / BEST)["best"] == {"step": 2, "eval/accuracy": 0.7}
    assert trainer_state(out / "checkpoint-2")["best"] == {"step": 1, "eval/accuracy": 0.2}
    left = scripted_evals(monkeypatch, [0.5, 0.6])                       # step 3, after step 4: neither beats 0.7
    res = train(load_config(**RUN, steps=4, output_dir=str(out), resume_from="latest"), progress=False)
    assert left == [] and res.best == {"step": 2, "eval/accuracy": 0.7}
    assert trainer_state(out / BEST)["step"] == 2


def test_without_save_best_no_best_checkpoint(tmp_path, monkeypatch):
    scripted_evals(monkeypatch, [0.1, 0.5, 0.2])
    res = train(load_config(**{**RUN, "save_best": False}, steps=2, output_dir=str(tmp_path)), progress=False)
    assert res.best is None and not (tmp_path / BEST).exists()
