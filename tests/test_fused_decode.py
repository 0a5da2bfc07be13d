"""The fused decoder (`61a_fused_decode`): with an fp32 copy its greedy completions are transformers' `generate` token
for token (Llama and Qwen2 layouts, LoRA adapters, left padding, one-token prompts, unshared prompts, after a weight
sync), seeded sampling is reproducible, the sampler's log-probs are the copy's own, a bf16 copy stays close, and the
trainer picks it (or refuses it) as the config says."""
import pytest, torch
from mmrgrpo.config import ConfigError, load_config
from mmrgrpo.fused_decode import (FusedBackend, FusedDecoder, PREFIX_MIN_SAVED, fused_support, pack, linear,
                                  shared_prefix)
from mmrgrpo.logprobs import completion_stats
from mmrgrpo.models import add_lora, cpu_support, tiny_random_model
from mmrgrpo.sampler_copy import CopyBackend
from mmrgrpo.sampling import HFBackend
from mmrgrpo.config import GRPOConfig

PROMPTS = ["What is 2 + 3?", "Name a prime number larger than ten, please, and say why.", "x"]
LEAD = "You are a careful assistant. Think step by step, then put the final answer alone in a box at the very end. "
PREFIXED = [LEAD + p for p in PROMPTS]     # a shared prefix long enough to be prefilled once (PREFIX_MIN_SAVED)


def lively(model, seed=0, scale=0.2):
    "Random weights big enough that greedy decoding does not repeat one token, with every fifth token id a stop id."
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2: p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.generation_config.eos_token_id = list(range(0, model.config.vocab_size, 5))
    return model


def qwen2(tokenizer, seed=0):
    "A tiny random Qwen2 (biases on q/k/v) with SmolLM2's vocabulary."
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


def lora_policy(model, seed=0):
    "`model` with a LoRA adapter whose B is not zero (so the merged copy differs from the base)."
    policy = add_lora(model, GRPOConfig(lora_r=4, lora_alpha=8))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name: p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return policy.eval()


def greedy_reference(policy, tok, prompts, G, n):
    return HFBackend(policy, tok, drop_finished=False).generate(prompts, G, n, greedy=True).completion_ids


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("prompts", [PROMPTS, PREFIXED], ids=["plain", "shared-prefix"])
def test_fp32_greedy_equals_generate(tokenizer, arch, prompts):
    base = lively(tiny_random_model(tokenizer, seed=1) if arch == "llama" else qwen2(tokenizer))
    assert fused_support(base) == ""
    policy = lora_policy(base)
    want = greedy_reference(policy, tokenizer, prompts, 3, 16)
    for share in (True, False):
        for prefix in (True, False):
            got = FusedBackend(policy, tokenizer, share_prompt=share, share_prefix=prefix,
                               copy_dtype=torch.float32).generate(prompts, 3, 16, greedy=True)
            assert torch.equal(got.completion_ids, want), (share, prefix)
    assert len(set(map(tuple, want.tolist()))) > 1                 # the example is not degenerate: completions differ


def test_one_token_prompts(tokenizer):
    model = lively(tiny_random_model(tokenizer, seed=2))
    want = greedy_reference(model, tokenizer, ["x", "y"], 2, 8)
    got = FusedBackend(model, tokenizer, copy_dtype=torch.float32).generate(["x", "y"], 2, 8, greedy=True)
    assert torch.equal(got.completion_ids, want)


def test_sync_follows_the_policy(tokenizer):
    policy = lora_policy(lively(tiny_random_model(tokenizer, seed=3)))
    backend = FusedBackend(policy, tokenizer, copy_dtype=torch.float32)
    before = backend.generate(PROMPTS, 2, 12, greedy=True).completion_ids
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name: p.mul_(-2)
    stale = backend.generate(PROMPTS, 2, 12, greedy=True).completion_ids
    assert torch.equal(stale, before)                                # no sync: the copy has not moved
    backend.sync_weights(policy)
    assert torch.equal(backend.generate(PROMPTS, 2, 12, greedy=True).completion_ids,
                       greedy_reference(policy, tokenizer, PROMPTS, 2, 12))


def test_sampling_is_seeded_and_records_its_logprobs(tokenizer):
    policy = lora_policy(lively(tiny_random_model(tokenizer, seed=4)))
    backend = FusedBackend(policy, tokenizer, copy_dtype=torch.float32, record_logprobs=True)
    a, b = backend.generate(PROMPTS, 4, 12, seed=7), backend.generate(PROMPTS, 4, 12, seed=7)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.completions == b.completions
    assert not torch.equal(a.completion_ids, backend.generate(PROMPTS, 4, 12, seed=8).completion_ids)
    # the recorded log-prob of each drawn token is the copy's own, as a forward pass gives it
    with torch.no_grad():
        own = completion_stats(backend.model, a.prompt_ids, a.prompt_mask, a.completion_ids, a.completion_mask)[0]
    torch.testing.assert_close(a.sampler_logprobs, own * a.completion_mask, atol=1e-4, rtol=1e-4)
    nucleus = backend.generate(PROMPTS, 4, 12, seed=7, top_p=0.5)
    assert nucleus.completion_ids.shape[0] == 12


def test_bf16_copy_is_close(tokenizer):
    """A bf16 fused copy is the bf16 copy computed another way: its log-probs of its own tokens stay near the fp32
    policy's."""
    policy = lora_policy(lively(tiny_random_model(tokenizer, seed=5), scale=0.05))
    ro = FusedBackend(policy, tokenizer, copy_dtype=torch.bfloat16,
                      record_logprobs=True).generate(PROMPTS, 4, 12, seed=1)
    with torch.no_grad():
        learner = completion_stats(policy, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)[0]
    gap = ((ro.sampler_logprobs - learner).abs() * ro.completion_mask).sum() / ro.completion_mask.sum()
    assert gap < 0.05, gap


def test_packed_weights_multiply_like_plain_ones():
    w, x = torch.randn(96, 32).bfloat16(), torch.randn(5, 32).bfloat16()
    assert torch.equal(linear(x, pack(w)), torch.nn.functional.linear(x, w))
    # packed only where torch says oneDNN's bf16 runs
    assert pack(w).is_mkldnn == cpu_support().onednn_bf16
    assert not pack(w.float()).is_mkldnn                              # fp32 weights stay as they are


def test_refusals(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    assert "no decoder layers" in fused_support(gpt2)
    with pytest.raises(ValueError, match="cannot run this model"): FusedDecoder(gpt2)
    model = tiny_random_model(tokenizer)
    with pytest.raises(ValueError, match="drop_finished"):
        FusedBackend(model, tokenizer, drop_finished=False, copy_dtype=torch.float32)
    add_lora(model, GRPOConfig(lora_r=2))                              # LoRA layers injected into the model itself
    with pytest.raises(ValueError, match="merge an adapter"): FusedDecoder(model)


def test_the_trainer_picks_it_as_the_config_says(tokenizer):
    from mmrgrpo.trainer import make_backend
    policy = lora_policy(tiny_random_model(tokenizer, seed=6))
    kinds = {v: type(make_backend(load_config(model="tiny-random", sampler_dtype="float32", fused_decode=v),
                                  policy, tokenizer))
             for v in ("auto", True, False)}
    assert kinds == {"auto": FusedBackend, True: FusedBackend, False: CopyBackend}
    assert type(make_backend(load_config(model="tiny-random", sampler_dtype="policy"), policy, tokenizer)) is HFBackend
    with pytest.raises(ConfigError, match="fused_decode=true"):
        load_config(model="tiny-random", sampler_dtype="policy", fused_decode=True)
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tokenizer)))
    assert type(make_backend(load_config(model="tiny-random", sampler_dtype="float32"), gpt2, tokenizer)) is CopyBackend
    with pytest.raises(ConfigError, match="no decoder layers"):
        make_backend(load_config(model="tiny-random", sampler_dtype="float32", fused_decode=True), gpt2, tokenizer)


@pytest.mark.slow
def test_smollm2_greedy_equals_generate(smollm2_path, tokenizer):
    "The embedded SmolLM2-135M with an fp32 fused copy: greedy completions are transformers' token for token."
    from mmrgrpo.models import load_policy
    policy, tok = load_policy(load_config(model="smollm2", dtype="float32", autocast_bf16=False))
    chats = [tok.apply_chat_template([{"role": "user",
                                       "content": f"What is {a} + {b}? Put the final answer in \\boxed{{}}."}],
                                     tokenize=False, add_generation_prompt=True)
             for a, b in [(7, 5), (23, 45), (31, 12)]]
    want = greedy_reference(policy, tok, chats, 2, 24)
    assert torch.equal(
        FusedBackend(policy, tok, copy_dtype=torch.float32).generate(chats, 2, 24, greedy=True).completion_ids, want)


def test_shared_prefix_is_used_and_sampling_matches(tokenizer):
    """The prefixed prompts do share a prefix worth splitting off, and seeded sampling gives the same completions with
    and without it."""
    enc = tokenizer(PREFIXED, return_tensors="pt", padding=True, add_special_tokens=False)
    K = shared_prefix(enc.input_ids[:, :-1], enc.attention_mask[:, :-1])
    assert K * (len(PREFIXED) - 1) >= PREFIX_MIN_SAVED
    policy = lora_policy(lively(tiny_random_model(tokenizer, seed=4)))
    runs = [FusedBackend(policy, tokenizer, share_prefix=p, copy_dtype=torch.float32).generate(PREFIXED, 4, 12, seed=7)
            for p in (True, False)]
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
