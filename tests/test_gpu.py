"""`pytest -m gpu`: the combinations bench/gpu_check.sh runs, as tests on a CUDA GPU (skipped on CPU CI): a LoRA run
that evaluates its checkpoint and resumes as the uninterrupted run (stages hf_lora, eval, resume), each method alone
and all three (methods), the float16 path of a GPU below compute capability 8.0 with its loss scaler (a T4's, faked on
any GPU), QLoRA with checkpointing (qlora), and 2 processes on one GPU, data-parallel and FSDP2 (ddp, fsdp2).
A flow check on a CPU: MMRGRPO_STAND_IN_GPU=8.0 MMRGRPO_GPU_TEST_MODEL=tiny-random pytest -m gpu tests/test_gpu.py
runs them on the stand-in GPU (tests/fake_cuda.py), less QLoRA and the 2-process launches, which it cannot hold."""
import json, math, os, subprocess, sys
import pytest, torch
from mmrgrpo import models, step
from mmrgrpo.config import load_config
from mmrgrpo.runlog import read_metrics
from mmrgrpo.trainer import latest_checkpoint, train

pytestmark = pytest.mark.gpu
MODEL = os.environ.get("MMRGRPO_GPU_TEST_MODEL", "smollm2")
STAND_IN = bool(os.environ.get("MMRGRPO_STAND_IN_GPU"))       # a CPU with the stand-in: a flow check only
needs_a_real_gpu = pytest.mark.skipif(STAND_IN, reason="the stand-in GPU lives in one process, without CUDA kernels")


def _config(out, **kw):
    base = dict(model=MODEL, task="arithmetic:2", num_generations=4, prompts_per_step=4, max_completion_length=24,
                lora_r=8, lora_alpha=16, beta=0.0, steps=3, eval_size=4, eval_every=0, save_every=1, seed=0,
                log_completions_every=0, learning_rate=5e-4, output_dir=str(out), threads=1 if STAND_IN else 0)
    return load_config(**{**base, **kw})


def _close(a: float, b: float) -> bool:
    "Equal to what a GPU's reduction order moves (the tolerance of bench/gpu_check.sh's resume stage)."
    return abs(a - b) <= 1e-4 + 1e-3 * abs(a)


def _steps(out) -> list: return [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def test_a_lora_run_evaluates_its_checkpoint_and_resumes(tmp_path, capsys):
    "Stages hf_lora, eval and resume: the GPU's precision, its memory in the log, a checkpoint that evaluates."
    from mmrgrpo.cli import main
    full = train(_config(tmp_path / "full"), progress=False)
    assert next(full.model.parameters()).is_cuda
    train(_config(tmp_path / "cut"), progress=False, stop_after=2)
    train(_config(tmp_path / "cut", resume_from="latest"), progress=False)
    a, b = _steps(tmp_path / "full"), _steps(tmp_path / "cut")
    assert [r["step"] for r in b] == [1, 2, 3] and all(_close(a[-1][k], b[-1][k]) for k in ("loss", "grad_norm"))
    expected = models.choose_dtype("cuda", frozen_base=True).metrics()
    assert {k: a[0][k] for k in expected} == expected
    assert a[0]["memory/update"] > 0 and a[0]["memory_reserved/peak"] >= a[0]["memory/peak"]
    assert "host_memory/process_peak" in a[0] and "memory/process_peak" not in a[0]
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(latest_checkpoint(tmp_path / "full")), f"model={MODEL}",
                 "task=arithmetic:2", "eval_size=4", "max_completion_length=24"]) == 0
    assert 0 <= json.loads(capsys.readouterr().out)["eval/accuracy"] <= 1


@pytest.mark.parametrize("methods", [dict(mmr=True), dict(prune_rate=0.5), dict(token_selection="gmts"),
                                     dict(mmr=True, prune_rate=0.5, token_selection="gmts")],
                         ids=["mmr", "prune", "gmts", "all3"])
def test_each_method_trains_on_the_gpu(tmp_path, methods):
    "Stage methods: each method alone and the three together take two finite steps."
    res = train(_config(tmp_path, steps=2, eval_size=0, save_every=0, **methods), progress=False)
    assert [r["step"] for r in res.metrics] == [1, 2] and all(math.isfinite(r["loss"]) for r in res.metrics)
    assert all(r["nonfinite_updates"] == 0 for r in res.metrics)


def test_the_float16_path_scales_the_loss_and_resumes_its_scale(tmp_path, monkeypatch):
    "A GPU of compute capability 7.x (faked): float16 base and autocast, a loss scaler whose state a resume restores."
    monkeypatch.setattr(models, "half_dtype", lambda device="cpu": torch.float16 if torch.device(device).type == "cuda"
                        else None)
    monkeypatch.setattr(torch.amp, "GradScaler", lambda *a, **k: torch.amp.grad_scaler.GradScaler(
        *a, **{**k, "growth_interval": 1}))                  # the scale moves every good step
    train(_config(tmp_path / "full", eval_size=0), progress=False)
    train(_config(tmp_path / "cut", eval_size=0), progress=False, stop_after=2)
    train(_config(tmp_path / "cut", eval_size=0, resume_from="latest"), progress=False)
    a, b = _steps(tmp_path / "full"), _steps(tmp_path / "cut")
    assert (a[0]["precision/weights"], a[0]["precision/autocast"]) == ("float16", "float16")
    assert [r["amp/grad_scale"] for r in a] == [r["amp/grad_scale"] for r in b]
    assert a[-1]["amp/grad_scale"] > step.GRAD_SCALE_START


@needs_a_real_gpu
def test_qlora_trains_with_checkpointing(tmp_path):
    "Stage qlora: the 4-bit NF4 base with gradient checkpointing takes two finite steps."
    pytest.importorskip("bitsandbytes")
    res = train(_config(tmp_path, steps=2, eval_size=0, save_every=0, load_in_4bit=True, gradient_checkpointing=True),
                progress=False)
    assert res.metrics[0]["precision/base"].startswith("4-bit") and all(math.isfinite(r["loss"]) for r in res.metrics)


@needs_a_real_gpu
@pytest.mark.parametrize("sharding", ["none", "fsdp2"], ids=["ddp", "fsdp2"])
def test_two_processes_on_one_gpu(tmp_path, sharding):
    "Stages ddp and fsdp2: torchrun starts 2 processes, which share the GPU(s) they find (gloo where they must)."
    out = tmp_path / sharding
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "mmrgrpo.cli",
           "train", f"model={MODEL}", "task=arithmetic:2", "num_generations=4", "prompts_per_step=4",
           "max_completion_length=16", "lora_r=8", "lora_alpha=16", "beta=0.0", "steps=2", "eval_size=0",
           "save_every=0", "log_completions_every=0", f"sharding={sharding}", f"output_dir={out}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _steps(out)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
