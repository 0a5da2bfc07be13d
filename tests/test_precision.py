"""Precision: one helper (`choose_dtype`) decides the weights' dtype and the update's autocast from the hardware, for
the trainer, the models and the vLLM backend; CPU flags and CUDA capabilities are faked. Also: activation checkpointing
is non-reentrant under QLoRA as under 16-bit weights, and no deprecated transformers names are called."""
import dataclasses, os, warnings
from pathlib import Path
import pytest, torch
from mmrgrpo import models
from mmrgrpo.config import ConfigError, load_config
from mmrgrpo.models import AVX2_CPU, Precision, autocast, choose_dtype, cpu_flags, cpu_support, load_policy
from conftest import cpu_with

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.fixture()
def hardware(monkeypatch):
    """Fake the CPU's flags and the GPU's compute capability:
    hardware(flags=..., capability=..., cuda=whether a GPU is visible)."""
    def set_(flags=(), capability=(8, 0), cuda=False):
        monkeypatch.setattr(models, "cpu_support", lambda: cpu_with(flags))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        # what a T4 answers: emulation counts
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
        if cuda:       # (bitsandbytes must be imported already)
            monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return set_


@pytest.mark.parametrize("device,flags,capability,frozen_base,weights,ac", [
    # weights stay fp32 on a CPU; bf16 autocast where it is fast
    ("cpu", {"avx512f", "avx512_bf16"}, None, True, F32, BF16),
    ("cpu", {"amx_bf16", "amx_tile"}, None, False, F32, BF16),
    ("cpu", {"avx2", "avx512f"}, None, True, F32, None),             # no native bf16: fp32 throughout
    ("cuda", (), (7, 5), True, F16, F16),                            # T4: fp16, never bf16
    ("cuda", (), (7, 5), False, F32, F16),                           # full fine-tuning keeps fp32 weights, autocasts
    ("cuda", (), (8, 0), True, BF16, BF16),                          # A100
    ("cuda", (), (9, 0), False, F32, BF16),                          # H100, full fine-tuning
    ("cuda", (), (6, 1), True, F32, None),                           # Pascal: no fast 16-bit
])
def test_auto_precision_per_hardware(hardware, device, flags, capability, frozen_base, weights, ac):
    hardware(flags, capability or (8, 0))
    p = choose_dtype(device, "auto", "auto", frozen_base=frozen_base)
    assert (p.weights, p.autocast) == (weights, ac)
    assert ("CUDA compute capability {}.{}".format(*capability) if device == "cuda" else "CPU") in p.reason
    assert p.metrics() == {"precision/weights": str(weights)[6:], "precision/autocast": str(ac)[6:] if ac else "off"}


def test_explicit_choices_win_over_the_hardware(hardware):
    hardware({"amx_bf16"}, (7, 5))
    assert choose_dtype("cpu", "float32", False) == Precision(F32, None, "CPU with amx_bf16")
    p = choose_dtype("cuda", "bfloat16", True)
    assert (p.weights, p.autocast) == (BF16, BF16)                  # what you ask for, even on a T4
    hardware(set(), (9, 0))
    assert choose_dtype("cpu", "auto", True).autocast is BF16          # true forces bf16 even where it is slow
    assert choose_dtype("cuda", "float32", False).autocast is None


def test_vllm_and_models_agree_on_a_t4(hardware):
    "is_bf16_supported() says True on a T4 (emulation); vLLM refuses bf16 below compute capability 8.0."
    from mmrgrpo.vllm_backend import engine_kwargs, vllm_dtype
    hardware((), (7, 5), cuda=True)
    assert vllm_dtype() == "float16" and choose_dtype("cuda").weights is F16
    assert engine_kwargs(load_config(model="tiny-random"), "m", lora=True)["dtype"] == "float16"
    hardware((), (8, 6), cuda=True)
    assert vllm_dtype() == "bfloat16" and choose_dtype("cuda").weights is BF16


@pytest.mark.parametrize("flags,expected", [({"amx_bf16"}, BF16), ({"avx2"}, None)])
def test_autocast_auto_follows_the_cpu_flags(hardware, flags, expected):
    hardware(flags)
    for setting, dtype in (("auto", expected), (True, BF16), (False, None)):
        with autocast(setting, "cpu"):
            assert torch.is_autocast_enabled("cpu") == (dtype is not None)
            if dtype is not None: assert torch.get_autocast_dtype("cpu") == dtype


def test_cpu_flags_reads_this_machine():
    info = Path("/proc/cpuinfo")
    lines = [l for l in info.read_text().splitlines() if l.startswith("flags")] if info.exists() else []
    assert cpu_flags() == (frozenset(lines[0].split(":", 1)[1].split()) if lines else frozenset())


def test_cpu_support_asks_torch(monkeypatch):
    "The fast paths follow torch's own capability queries, not /proc/cpuinfo alone."
    monkeypatch.delenv("MMRGRPO_CPU", raising=False)
    models.cpu_support.cache_clear()
    try:
        here = cpu_support()
        assert here.bf16 == (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        assert here.onednn_bf16 == torch.ops.mkldnn._is_mkldnn_bf16_supported()
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert not models.native_cpu_support().bf16
        monkeypatch.setattr(models.platform, "machine", lambda: "arm64")            # Apple silicon: no oneDNN packing
        assert not models.native_cpu_support().onednn_bf16
    finally: models.cpu_support.cache_clear()


@pytest.mark.parametrize("value,expected", [("avx2", AVX2_CPU), ("", None), ("native", None), ("avx512", "error")])
def test_the_cpu_can_be_treated_as_an_avx2_laptop(monkeypatch, value, expected):
    monkeypatch.setenv("MMRGRPO_CPU", value)
    models.cpu_support.cache_clear()
    try:
        if expected == "error":
            with pytest.raises(ConfigError, match="MMRGRPO_CPU='avx512': set it to 'avx2'"): cpu_support()
        else: assert cpu_support() == (expected or models.native_cpu_support())
    finally: models.cpu_support.cache_clear()


def test_treated_as_avx2_the_onednn_bf16_ops_fail_as_there():
    "With MMRGRPO_CPU=avx2 a bf16 weight reorder fails as on such a CPU, and the package's own paths do not call it."
    import subprocess, sys
    code = ("import torch, mmrgrpo.models as m, mmrgrpo.fused_decode as fd\n"
            "w = torch.randn(64, 64).bfloat16()\n"
            "assert not fd.can_pack(w) and fd.pack(w) is w and m.choose_dtype('cpu').autocast is None\n"
            "assert fd.attention_dtype(torch.bfloat16) == torch.float32\n"
            "try: torch.ops.mkldnn._reorder_linear_weight(w, 64)\n"
            "except RuntimeError as e: print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MMRGRPO_CPU": "avx2"},
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: _reorder_linear_weight: bf16 path needs the cpu support" in out.stdout


def test_config_dtype_fields_take_auto_and_explicit_values():
    c = load_config()
    assert (c.dtype, c.autocast_bf16) == ("auto", "auto")
    assert load_config(overrides=["autocast_bf16=true", "dtype=float16"]).autocast_bf16 is True
    assert load_config(overrides=["autocast_bf16=auto"]).autocast_bf16 == "auto"
    with pytest.raises(ConfigError, match=r"autocast_bf16='yes' must be true or false or 'auto'"):
        load_config(autocast_bf16="yes")
    with pytest.raises(ConfigError, match=r"dtype='half' is not one of \['auto', 'float32', 'bfloat16', 'float16'\]"):
        load_config(dtype="half")


def test_auto_keeps_weights_fp32_on_a_cpu_even_with_bf16_hardware(hardware):
    hardware({"amx_bf16"})
    model, _ = load_policy(load_config(model="tiny-random", lora_r=4), device="cpu")
    assert {p.dtype for p in model.parameters()} == {F32}
    model, _ = load_policy(load_config(model="tiny-random", lora_r=4, dtype="bfloat16"), device="cpu")
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {F32}     # the trained adapter stays fp32
    assert {p.dtype for n, p in model.named_parameters() if "lora_" not in n} == {BF16}


def checkpointing(model):
    "(flags, checkpoint kwargs) of the decoder layers."
    layers = model.get_base_model().model.layers
    return ({l.gradient_checkpointing for l in layers},
            [getattr(l, "_gradient_checkpointing_func").keywords for l in layers])


@pytest.mark.parametrize("four_bit", [False, True])
def test_checkpointing_is_non_reentrant_with_and_without_4bit(monkeypatch, four_bit):
    "QLoRA went through peft's own checkpointing call (reentrant, the deprecated name); now both paths are the same."
    make = models.tiny_random_model
    def tiny(*a, **k):
        m = make(*a, **k)
        # what from_pretrained sets on a bitsandbytes model: peft's kbit path
        if four_bit: m.is_loaded_in_4bit = True
        return m
    monkeypatch.setattr(models, "tiny_random_model", tiny)
    c = load_config(model="tiny-random", lora_r=4, gradient_checkpointing=True, autocast_bf16=False)
    # load_config refuses 4 bits for the tiny model (never quantized); the test fakes only the flag peft reads
    c = dataclasses.replace(c, load_in_4bit=four_bit)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, tok = load_policy(c, device="cpu")         # the ids below are built on the CPU
    deprecated = [str(w.message) for w in caught
                  if "checkpointing" in str(w.message) and "deprecated" in str(w.message)]
    assert not deprecated, deprecated
    flags, kwargs = checkpointing(model)
    assert flags == {True} and all(k == {"use_reentrant": False} for k in kwargs)
    # and it computes the gradients the unchecked model computes
    plain, _ = load_policy(load_config(model="tiny-random", lora_r=4, autocast_bf16=False), device="cpu")
    plain.load_state_dict(model.state_dict())
    ids = tok("What is 2 + 3? Think step by step.", return_tensors="pt").input_ids
    grads = []
    for m in (model, plain):
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n: p.fill_(0.01)
        m(ids).logits.float().logsumexp(-1).mean().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all(torch.allclose(grads[0][k], grads[1][k], atol=1e-6)
                                                      for k in grads[0])


# --- fp16 autocast (compute capability < 8.0) scales the loss; nothing else does

def test_a_loss_scaler_only_for_fp16_autocast_on_cuda(hardware):
    """choose_dtype picks fp16 autocast on a T4 (7.5): the update scales the loss there; bf16 GPUs, fp32 and CPUs take
    no scaler."""
    from mmrgrpo.step import grad_scaler, needs_grad_scaler
    for capability, setting, expected in [((7, 5), "auto", True), ((8, 0), "auto", False), ((7, 5), False, False),
                                          ((7, 5), True, False)]:
        hardware((), capability)
        assert needs_grad_scaler("cuda",
                                 choose_dtype("cuda", autocast=setting).autocast) is expected, (capability, setting)
    for flags in ({"amx_bf16"}, set()):
        hardware(flags)
        assert not needs_grad_scaler("cpu", choose_dtype("cpu").autocast)
    opt, other = (torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1) for _ in range(2))
    assert (grad_scaler(opt, "cpu", BF16) is None and grad_scaler(opt, "cpu", None) is None
            and grad_scaler(opt, "cuda", BF16) is None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # on a machine without CUDA the scaler warns that it disables itself
        scaler = grad_scaler(opt, "cuda", F16)
        # one per optimizer: the scale carries over
        assert scaler is not None and grad_scaler(opt, "cuda", F16) is scaler
        assert grad_scaler(other, "cuda", F16) is not scaler


@pytest.mark.parametrize("setting", [True, False])
def test_cpu_updates_take_no_loss_scaler(tmp_path, setting):
    "bf16 and fp32 autocast on a CPU: the update's step is the plain optimizer step, as before."
    from mmrgrpo import step
    from test_combinations import _config, _model, _rollout
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = step.update(model, opt, _rollout(), torch.linspace(-1, 1, 8), _config(tmp_path, autocast_bf16=setting))
    assert "amp/grad_scale" not in metrics and opt not in step._SCALERS and metrics["nonfinite_updates"] == 0


@pytest.mark.gpu
def test_fp16_autocast_on_cuda_unscales_before_the_step(tmp_path, monkeypatch):
    "A T4's fp16 autocast (faked on any GPU): the scaled backward, unscaled, moves the weights as the fp32 update does."
    import copy, dataclasses
    from mmrgrpo import step
    from test_combinations import _config, _model, _rollout
    monkeypatch.setattr(models, "half_dtype", lambda device="cpu": F16 if torch.device(device).type == "cuda" else None)
    ro = _rollout()
    ro = dataclasses.replace(ro, **{f.name: getattr(ro, f.name).cuda() for f in dataclasses.fields(ro)
                                    if isinstance(getattr(ro, f.name), torch.Tensor)})
    adv, start = torch.linspace(-1, 1, 8).cuda(), _model().cuda()
    moved, metrics = {}, {}
    for setting in ("auto", False):             # fp16 autocast with a scaler; fp32 without
        model = copy.deepcopy(start)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        metrics[setting] = step.update(model, opt, ro, adv, _config(tmp_path, autocast_bf16=setting))
        moved[setting] = {n: (p - start.get_parameter(n)).detach() for n, p in model.named_parameters()}
        assert (opt in step._SCALERS) == (setting == "auto")
    assert metrics["auto"]["amp/grad_scale"] == step.GRAD_SCALE_START and metrics["auto"]["nonfinite_updates"] == 0
    assert "amp/grad_scale" not in metrics[False]
    for n in moved[False]:
        torch.testing.assert_close(moved["auto"][n], moved[False][n], rtol=0.05, atol=1e-4, msg=n)


def test_the_first_metrics_row_records_the_precision(tmp_path):
    "The dtypes the trainer prints are also in the log: strings in step 1's row, which read_metrics and the plot take."
    from mmrgrpo.runlog import read_metrics
    from mmrgrpo.trainer import plot_rewards, train
    c = load_config(model="tiny-random", steps=2, num_generations=2, prompts_per_step=2, max_completion_length=4,
                    eval_size=0, log_completions_every=0, save_every=0, lora_r=4, output_dir=str(tmp_path))
    train(c, *load_policy(c, device="cpu"), progress=False)        # the CPU's choice (test_stand_in_cuda: a GPU's)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    expected = choose_dtype("cpu", c.dtype, c.autocast_bf16, frozen_base=c.lora).metrics()
    assert {k: rows[0].get(k) for k in expected} == expected and expected["precision/weights"] == "float32"
    assert not any(k.startswith("precision/") for k in rows[1])
    assert plot_rewards(tmp_path / "metrics.jsonl", tmp_path / "curve.png").exists()
