"""The speed appendix plugs in through `mmrgrpo.speedups` (`40b_speedups`): the installed entry points are the
appendix's, each speed-up changes how a step computes, not what, and a run with none is plain GRPO that says so."""
import ast, dataclasses, importlib.metadata, re
from pathlib import Path
import pytest, torch
from mmrgrpo.config import GRPOConfig, load_config
from mmrgrpo.sampling import HFBackend
from mmrgrpo.speedups import ENTRY_POINTS, HOOKS, Speedup, load_speedups, speedups, use_speedups
from test_fast_update import assert_grads_close, one_update

ROOT = Path(__file__).resolve().parents[1]


def declared() -> dict:
    "pyproject.toml's entry points for the speed-ups: name -> 'module:object'."
    text = (ROOT / "pyproject.toml").read_text()            # (tomllib is Python 3.11+; the package supports 3.10)
    section = text.split(f'[project.entry-points."{ENTRY_POINTS}"]\n', 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^(\w+) = "([\w.:]+)"$', section, re.M))


def modules_with_a_speedup() -> set:
    "The package's modules that define a module-level `SPEEDUP`."
    return {p.stem for p in (ROOT / "mmrgrpo").glob("*.py")
            if any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "SPEEDUP" for t in n.targets)
                   for n in ast.parse(p.read_text()).body)}


def test_pyproject_registers_every_speedup_the_package_defines():
    assert {v.split(":")[0].removeprefix("mmrgrpo.") for v in declared().values()} == modules_with_a_speedup()
    assert all(v.endswith(":SPEEDUP") for v in declared().values())


def test_the_installed_entry_points_are_the_declared_ones():
    "An install older than pyproject.toml (run `pip install -e .` again) would silently lose a speed-up."
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)}
    assert installed == declared()
    assert [s.name for s in load_speedups()] == [s.name for s in speedups()]
    assert len(speedups()) == len(declared())


def test_an_uninstalled_checkout_finds_them_in_its_pyproject(monkeypatch):
    """A clone on PYTHONPATH (no package index on the machine) has no installed entry points: pyproject.toml supplies
    them."""
    import mmrgrpo.speedups as S
    monkeypatch.setattr(S.importlib.metadata, "entry_points", lambda group: [])
    assert [s.name for s in S.load_speedups()] == [s.name for s in speedups()]


def test_every_registered_speedup_sets_a_hook():
    for s in load_speedups():
        assert [h for h in HOOKS if getattr(s, h) is not None], s.name


def test_a_speedup_changes_the_update_by_float_rounding_at_most(tokenizer):
    """One update of a tiny LoRA policy in fp32, with token selection, pruning and a KL term: plain parts against all
    of them."""
    c = GRPOConfig(model="tiny-random", lora_r=4, beta=0.04, autocast_bf16=False, prune_rate=0.25, logp_chunk_size=3,
                   token_selection="gmts", keep_ratio=0.5, micro_batch_size=0)
    with use_speedups(()): loss_plain, g_plain = one_update(tokenizer, c)
    loss_fast, g_fast = one_update(tokenizer, c)
    assert loss_fast == pytest.approx(loss_plain, rel=1e-5, abs=1e-7)
    assert_grads_close(g_fast, g_plain)
    assert g_plain.abs().sum() > 0


def test_a_run_with_no_speedup_is_plain_grpo_and_says_so(tmp_path, capsys):
    from mmrgrpo.trainer import make_backend, train
    c = load_config(model="tiny-random", steps=1, num_generations=2, prompts_per_step=2, max_completion_length=4,
                    eval_size=0, log_completions_every=0, output_dir=str(tmp_path))
    with use_speedups(()):
        res = train(c, progress=False)
        assert type(res.backend) is HFBackend and res.backend.cache_room is None
        with pytest.raises(Exception, match="generation_backend=vllm: no installed speed-up serves it"):
            make_backend(dataclasses.replace(c, generation_backend="vllm"), res.model, res.tokenizer)
    assert "sampling from the policy; no speed-ups (plain GRPO)" in capsys.readouterr().out
    first = res.metrics[0]
    assert (first["precision/base"] == "float32" and "allocator/keep_freed" not in first
            and "update/attention" not in first)


def test_a_third_party_speedup_plugs_in_where_the_hooks_say(tmp_path):
    "A speed-up of one's own: its set-up metric, its after-step metric every step, and its tear-down once."
    calls = []
    mine = Speedup("mine", set_up=lambda c, model, device: {"mine/set_up": 1.0},
                   after_step=lambda c, device: (lambda: {"mine/after": float(len(calls))}),
                   tear_down=lambda c: calls.append("down"))
    c = load_config(model="tiny-random", steps=2, num_generations=2, prompts_per_step=2, max_completion_length=4,
                    eval_size=0, log_completions_every=0, output_dir=str(tmp_path))
    from mmrgrpo.trainer import train
    with use_speedups([*speedups(), mine]): res = train(c, progress=False)
    assert calls == ["down"]
    steps = [r for r in res.metrics if "mine/after" in r]
    assert len(steps) == 2 and res.metrics[0]["mine/set_up"] == 1.0


def test_hooks_answer_in_rank_order():
    a = Speedup("a", rank=5, pass_positions=lambda c, kind: None)
    b = Speedup("b", rank=7, pass_positions=lambda c, kind: 4096)
    from mmrgrpo.step import pass_positions
    with use_speedups([b, a]): assert pass_positions(GRPOConfig(), "cpu") == 4096
    with use_speedups([a]): assert pass_positions(GRPOConfig(), "cpu") == 1024
