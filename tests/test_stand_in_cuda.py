"""The package's CUDA branches on CPU CI (issue 56): whole runs on a stand-in GPU (`tests/fake_cuda.py`) of compute
capability 7.5 (a T4: float16), 8.0 (an A100: bfloat16) and 9.0 (an H100), each through set-up, sampling, the update,
evaluation, a checkpoint and a resume that must end where the uninterrupted run ends; and each CUDA defect the issue
lists, shown on the stand-in. What the stand-in cannot emulate is said in its docstring."""
import contextlib, io, re
import pytest, torch
from fake_cuda import OnGPU, stand_in_gpu
from mmrgrpo import fast_update, step
from mmrgrpo.config import ConfigError, load_config
from mmrgrpo.runlog import Phases, read_metrics
from mmrgrpo.trainer import latest_checkpoint, train

F16, BF16, F32 = "float16", "bfloat16", "float32"


@pytest.fixture(autouse=True)
def one_thread():
    "One CPU thread (the runs are tiny and a busy 2-core machine makes two threads wait on each other), then as before."
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture()
def glibc_calls(monkeypatch):
    "The glibc heap calls a run makes (mallopt through `keep_freed_memory`, `malloc_trim`), recorded, not made."
    calls = []
    monkeypatch.setattr(fast_update, "keep_freed_memory", lambda on=True, limit=0: calls.append(("mallopt", on)))
    monkeypatch.setattr(fast_update, "trim_freed_memory", lambda: calls.append(("malloc_trim",)))
    return calls


def _config(out, **kw):
    base = dict(model="tiny-random", steps=3, num_generations=2, prompts_per_step=2, max_completion_length=4,
                eval_size=2, eval_every=0, log_completions_every=0, save_every=1, num_shots=0, seed=3, threads=1,
                reward_funcs=["reward_fixtures:varied"], reward_weights=None, learning_rate=0.05, lora_r=4,
                lora_alpha=8, output_dir=str(out))
    return load_config(**{**base, **kw})


def _comparable(row):
    "A metrics row less what differs between two runs of the same steps: times and memory."
    return {k: v for k, v in row.items() if not k.startswith(("time/", "memory", "host_memory/")) and k != "eval/time"}


# capability -> (the run's settings, the precision it must choose, GPUs visible when the cut run is written)
RUNS = {
    (7, 5): (dict(), (F16, F16), 1),                                      # a T4 with LoRA: fp16 base, loss scaler
    (8, 0): (dict(beta=0.04, prune_rate=0.5, token_selection="gmts", keep_ratio=0.5), (BF16, BF16), 2),
    (9, 0): (dict(lora=False, beta=0.04), (F32, BF16), 1),               # full fine-tuning: fp32 weights, bf16 passes
}


@pytest.mark.parametrize("capability", RUNS, ids=lambda c: f"{c[0]}.{c[1]}")
def test_a_run_on_a_gpu_trains_saves_and_resumes_as_the_uninterrupted_run(tmp_path, monkeypatch, capsys, glibc_calls,
                                                                           capability):
    kw, precision, gpus_then = RUNS[capability]
    # the loss scale doubles after every good step, so a resumed run that lost it would log other scales
    monkeypatch.setattr(torch.amp, "GradScaler", lambda *a, **k: torch.amp.grad_scaler.GradScaler(
        *a, **{**k, "growth_interval": 1}))
    with stand_in_gpu(capability) as gpu:
        full = train(_config(tmp_path / "full", **kw), progress=False)
        assert isinstance(next(full.model.parameters()), OnGPU) and next(full.model.parameters()).is_cuda
    with stand_in_gpu(capability, count=gpus_then):
        train(_config(tmp_path / "cut", **kw), progress=False, stop_after=2)
    assert latest_checkpoint(tmp_path / "cut").name == "checkpoint-2"
    capsys.readouterr()
    with stand_in_gpu(capability):
        train(_config(tmp_path / "cut", resume_from="latest", **kw), progress=False)
    said = capsys.readouterr()
    rows = read_metrics(tmp_path / "full" / "metrics.jsonl")
    a, b = ([_comparable(r) for r in read_metrics(tmp_path / run / "metrics.jsonl")] for run in ("full", "cut"))
    assert [r["step"] for r in b] == [0, 1, 2, 3, 3] and a == b          # eval before, 3 steps, eval after
    assert (rows[1]["precision/weights"], rows[1]["precision/autocast"]) == precision
    scaled = precision[1] == F16
    assert [("amp/grad_scale" in r) for r in rows[1:4]] == [scaled] * 3
    if scaled: assert rows[3]["amp/grad_scale"] > step.GRAD_SCALE_START        # it moved, and the resume kept it
    # GPU memory per phase, the host's labelled as such, and phases synchronised on the GPU
    for r in rows[1:4]:
        assert r["memory/peak"] == max(v for k, v in r.items() if k.startswith("memory/") and k != "memory/peak")
        assert 0 < r["memory/update"] <= r["memory_reserved/update"] and "memory/process_peak" not in r
        assert r["host_memory/process_peak"] > 0 and "allocator/handed_back" not in r
    assert "memory/eval" in rows[0] and gpu.calls["synchronize"] >= 2 * 4 * 3
    assert re.search(r"gpu_mem=\d+\.\dGB \(reserved \d+\.\dGB; host process \d+\.\dGB\)", said.out)
    assert glibc_calls == []                                                 # no heap tricks on a GPU run
    if gpus_then > 1:                                                        # written with 2 GPUs visible, resumed on 1
        assert "holds the CUDA generator states of 2 GPUs and 1 are visible" in said.err


def test_fp16_full_fine_tuning_is_refused_naming_lora(tmp_path):
    "lora=false dtype=float16 on a T4: AdamW on fp16 weights, and a GradScaler that cannot unscale fp16 gradients."
    with stand_in_gpu((7, 5)), pytest.raises(ConfigError, match="dtype=float16 with lora=false .* set lora=true"):
        train(_config(tmp_path, lora=False, dtype="float16", steps=1, eval_size=0), progress=False)


def test_full_fine_tuning_on_a_t4_keeps_fp32_weights_and_scales_the_loss(tmp_path):
    "lora=false with dtype=auto on a T4: float32 weights that AdamW updates, float16 passes, a loss scaler."
    with stand_in_gpu((7, 5)):
        res = train(_config(tmp_path, lora=False, steps=1, eval_size=0), progress=False)
    row = res.metrics[0]
    assert (row["precision/weights"], row["precision/autocast"], row["amp/grad_scale"]) == (F32, F16, 1024.0)
    assert {p.dtype for p in res.model.parameters()} == {torch.float32} and row["nonfinite_updates"] == 0
    saved = torch.load(tmp_path / "checkpoint-1" / "training.pt", weights_only=True)
    assert saved["grad_scaler"]["scale"] == 1024.0 and saved["grad_scaler"]["_growth_tracker"] == 1


def test_phases_on_a_gpu_synchronise_and_measure_its_memory(monkeypatch):
    "A phase on CUDA starts and ends with a device sync and keeps the GPU's allocated and reserved peaks."
    with stand_in_gpu((8, 0)) as gpu:
        phases = Phases(device=torch.device("cuda", 0))
        with phases("alloc"):
            x = torch.ones(1 << 20, device="cuda")                       # 4 MiB
            del x
        with phases("idle"): pass
        assert gpu.calls["synchronize"] == 4
    m = phases.metrics()
    assert m["memory/alloc"] >= 4 and m["memory/idle"] < 4 and m["memory_reserved/alloc"] >= m["memory/alloc"]
    assert m["memory/peak"] == m["memory/alloc"] and m["memory_reserved/peak"] == m["memory_reserved/alloc"]
    # on the CPU nothing asks CUDA anything
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("synchronize on a CPU run"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: pytest.fail("GPU memory on a CPU run"))
    cpu = Phases()
    with cpu("work"): pass
    assert "memory_reserved/work" not in cpu.metrics()


def test_a_rollout_keeps_its_group_ids_on_its_device(tokenizer):
    "HFBackend on a GPU: every tensor of the rollout, `group_ids` too, is on the policy's device."
    from mmrgrpo.models import tiny_random_model
    from mmrgrpo.sampling import HFBackend
    with stand_in_gpu((8, 0)):
        model = tiny_random_model(tokenizer).to("cuda")
        ro = HFBackend(model, tokenizer).generate(["What is 2 + 2?"], 2, 3, seed=0)
        assert {t.device.type for t in (ro.prompt_ids, ro.completion_ids, ro.group_ids)} == {"cuda"}
        assert ro.group_ids.tolist() == [0, 0]


def test_the_stand_in_fails_as_cuda_fails():
    "The harness itself: a host tensor meeting a GPU one fails; moves, host copies and numpy behave as on CUDA."
    with stand_in_gpu((9, 0)) as gpu:
        x = torch.arange(4.0, device="cuda")
        assert isinstance(x, OnGPU) and x.device == torch.device("cuda", 0)
        assert torch.cuda.get_device_capability() == (9, 0) and torch.cuda.get_device_name() == "NVIDIA H100 80GB HBM3"
        with pytest.raises(RuntimeError, match="found at least two devices, cuda:0 and cpu"): x + torch.ones(4)
        assert (x + torch.tensor(1.0)).tolist() == [1.0, 2.0, 3.0, 4.0]        # a 0-dim host scalar is allowed
        host = x.cpu()
        assert type(host) is torch.Tensor and host.device.type == "cpu" and (x * 2).to("cpu").tolist()[1] == 2.0
        with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"): x.numpy()
        assert isinstance(torch.tensor([1, 2], device="cuda"), OnGPU) and torch.cuda.memory_allocated() > 0
        torch.cuda.manual_seed(0); a = torch.rand(3, device="cuda")
        torch.cuda.manual_seed(0); b = torch.rand(3, device="cuda")
        assert torch.equal(a.cpu(), b.cpu()) and "synchronize" not in gpu.calls
        with torch.autocast("cuda", dtype=torch.float16):                   # the dtypes flow as on a GPU
            y = x[None] @ torch.ones(4, 2, device="cuda")
        assert y.dtype == torch.float16 and torch.is_autocast_enabled("cuda") is False
    assert not torch.cuda.is_available() and torch.autocast is torch.amp.autocast_mode.autocast
