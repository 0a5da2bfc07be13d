"""The vLLM backend. On the CPU: vLLM-shaped outputs become a `Rollout` in exactly `HFBackend`'s layout, and the module imports
without vLLM. On a GPU with vLLM installed (`gpu` marker): seeded sampling, the layout of real outputs, LoRA and full-weight
sync, sleep mode, the sampler/trainer log-prob gap, and a short training run with `generation_backend: vllm`."""
import importlib.util, sys
from types import SimpleNamespace
import pytest, torch
from mmrgrpo.config import load_config
from mmrgrpo.sampling import HFBackend, completion_mask
from mmrgrpo.vllm_backend import VLLMBackend, logprob_gap, outputs_to_lists, rollout_from_token_ids

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def chat(tok, q):
    return tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)


def as_vllm_outputs(ro, logp):
    "What vLLM would return for `ro`: per completion, its ids up to and including the stop token, log-probs, finish reason."
    outs = []
    for ids, m, lp, trunc in zip(ro.completion_ids, ro.completion_mask, logp, ro.truncated):
        n = int(m.sum())
        outs.append(SimpleNamespace(outputs=[SimpleNamespace(
            token_ids=ids[:n].tolist(), finish_reason="length" if trunc else "stop",
            logprobs=[{t: SimpleNamespace(logprob=float(x))} for t, x in zip(ids[:n].tolist(), lp[:n])])]))
    return outs


def test_vllm_shaped_outputs_give_the_hf_backend_layout(tiny_model, tokenizer):
    tiny_model.generation_config.eos_token_id = list(range(3, 6000))   # many stop ids: completions end at different lengths
    hf = HFBackend(tiny_model, tokenizer)
    prompts = [chat(tokenizer, "What is 2 + 3?"), chat(tokenizer, "Name a prime number larger than ten, please."),
               chat(tokenizer, "Hi")]
    ref = hf.generate(prompts, num_generations=4, max_new_tokens=12, seed=3)
    assert ref.truncated.any() and not ref.truncated.all() and len(set(ref.completion_mask.sum(-1).tolist())) > 2
    logp = -torch.rand(ref.completion_ids.shape)
    tokens, lps, stopped = outputs_to_lists(as_vllm_outputs(ref, logp))
    enc = hf.tokenize(prompts)
    ro = rollout_from_token_ids(prompts, enc.input_ids, enc.attention_mask, tokens, 4, hf.eos_ids, tokenizer.pad_token_id,
                                tokenizer, lps, stopped)
    for f in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
        assert torch.equal(getattr(ro, f), getattr(ref, f)), f
    assert (ro.prompts, ro.completions, ro.group_size) == (ref.prompts, ref.completions, ref.group_size)
    assert torch.allclose(ro.sampler_logprobs, logp * ref.completion_mask)
    # against the trainer's own log-probs shifted by 0.125, the gap is 0.125
    from mmrgrpo.loss import completion_stats
    own = completion_stats(tiny_model, ref.prompt_ids, ref.prompt_mask, ref.completion_ids, ref.completion_mask)[0].detach()
    ro.sampler_logprobs = own + 0.125
    g = logprob_gap(None, tiny_model, ro)
    assert abs(g["logprob_gap/mean"] - 0.125) < 1e-5 and abs(g["logprob_gap/max"] - 0.125) < 1e-5


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed")
def test_without_vllm_the_module_imports_and_the_backend_says_what_to_install(tiny_model, tokenizer):
    with pytest.raises(ImportError, match=r"mmrgrpo\[vllm\]"):
        VLLMBackend(tiny_model, tokenizer, load_config(model="tiny-random", generation_backend="vllm"))


# ---------------------------------------------------------------- GPU + vLLM
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install 'mmrgrpo[vllm]')")


def policy_and_backend(**kw):
    from mmrgrpo.models import load_policy
    c = load_config(model="smollm2", dtype="bfloat16", vllm_gpu_memory_utilization=0.25, max_completion_length=64, **kw)
    model, tok = load_policy(c)
    return c, model, tok, VLLMBackend(model, tok, c)


@pytest.mark.gpu
@needs_vllm
def test_vllm_lora_sampling_seed_layout_sync_and_gap():
    c, model, tok, backend = policy_and_backend(lora_r=16)
    prompts = [chat(tok, "What is 7 + 5? Put the final answer in \\boxed{}."), chat(tok, "What is 2 + 2?")]
    ro = backend.generate(prompts, 4, 64, seed=0)
    assert backend.generate(prompts, 4, 64, seed=0).completions == ro.completions          # seeded
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
    c, model, tok, backend = policy_and_backend(lora=False, vllm_sleep=True)
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
    c = load_config(model="smollm2", dtype="bfloat16", generation_backend="vllm", vllm_gpu_memory_utilization=0.25, steps=2,
                    num_generations=4, prompts_per_step=2, max_completion_length=32, eval_size=4, save_every=1,
                    log_completions_every=0, output_dir=str(tmp_path))
    res = train(c, progress=False)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "reward" in r] == [1, 2] and "eval/accuracy" in res.eval_after


# ---------------------------------------------------------------- the backend's control flow, on the CPU, with a fake vLLM
class FakeLLM:
    "Records what the backend asks of vLLM; answers each request with seeded random tokens (stop id 2 or max_tokens)."
    def __init__(self, **kw):
        self.kw, self.calls, self.asleep, self.loaded = kw, [], False, []
    def sleep(self, level=1): assert not self.asleep and level == 1; self.asleep = True; self.calls.append("sleep")
    def wake_up(self): assert self.asleep; self.asleep = False; self.calls.append("wake")
    def apply_model(self, f): assert not self.asleep; return [f(SimpleNamespace(load_weights=lambda w: self.loaded.append(dict(w))))]
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
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, finish_reason="stop" if ids[-1] == 2 else "length",
                                                                 logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in ids])]))
        return outs


@pytest.fixture()
def fake_vllm(monkeypatch):
    made = []
    def llm(**kw): made.append(FakeLLM(**kw)); return made[-1]
    lora = SimpleNamespace(LoRARequest=lambda name, i, path: SimpleNamespace(lora_name=name, lora_int_id=i, lora_path=path))
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=llm, SamplingParams=lambda **kw: SimpleNamespace(**kw)))
    monkeypatch.setitem(sys.modules, "vllm.lora", SimpleNamespace(request=lora))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora)
    return made


def test_backend_flow_lora(fake_vllm, tokenizer):
    from pathlib import Path
    from mmrgrpo.models import load_policy
    c = load_config(model="tiny-random", lora_r=4, generation_backend="vllm", max_prompt_length=64, max_completion_length=8)
    model, tok = load_policy(c)
    b = VLLMBackend(model, tok, c)
    llm = fake_vllm[0]
    assert llm.kw["enable_lora"] and llm.kw["max_lora_rank"] == 8 and llm.kw["enable_sleep_mode"] and llm.asleep
    assert (Path(llm.kw["model"]) / "config.json").exists()            # tiny-random written out for the engine
    prompts = [chat(tok, "What is 2 + 3?"), chat(tok, "Hi")]
    ro = b.generate(prompts, 4, 8, seed=5)
    assert llm.calls == ["sleep", "wake", ("generate", 1), "sleep"] and llm.asleep
    assert ro.completion_ids.shape[0] == 8 and torch.equal(ro.completion_mask, completion_mask(ro.completion_ids, b.eos_ids))
    assert torch.equal(b.generate(prompts, 4, 8, seed=5).completion_ids, ro.completion_ids)   # seeded per request
    assert (ro.sampler_logprobs == -ro.completion_mask.float()).all()
    for v in (2, 3, 4): b.sync_weights(model)                          # a new adapter version per update
    assert b.lora_request.lora_int_id == 4 and (Path(b.lora_request.lora_path) / "adapter_config.json").exists()
    assert sorted(p.name for p in b.folder.glob("adapter-*")) == ["adapter-3", "adapter-4"]
    b.generate(prompts, 1, 8, greedy=True)
    assert llm.calls[-2] == ("generate", 4)


def test_backend_flow_full_weights_and_training(fake_vllm, tmp_path):
    from mmrgrpo.trainer import read_metrics, train
    c = load_config(model="tiny-random", lora=False, beta=0.0, generation_backend="vllm", steps=2, num_generations=4,
                    prompts_per_step=2, max_completion_length=6, eval_size=2, save_every=0, log_completions_every=0,
                    output_dir=str(tmp_path))
    res = train(c, progress=False)
    llm = fake_vllm[0]
    assert "enable_lora" not in llm.kw and len(llm.loaded) == 2         # the full weights, loaded once after each update
    assert set(llm.loaded[-1]) == set(res.model.state_dict()) and torch.equal(
        llm.loaded[-1]["model.norm.weight"], res.model.state_dict()["model.norm.weight"])
    gens = [i for i, x in enumerate(llm.calls) if isinstance(x, tuple)]
    assert all(llm.calls[i - 1] in ("wake", "reset") and llm.calls[i + 1] == "sleep" for i in gens)
    assert llm.calls.count("reset") == 2
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "reward" in r] == [1, 2]
