"""The transformers backend's own decode loop (`HFBackend.decode`): greedy completions equal transformers' `generate`
token for token, seeded sampling is reproducible and draws what the `generate` path draws, and finished rows really
leave the batch."""
import inspect
import pytest, torch
from mmrgrpo.kvcache import reserve_cache
from mmrgrpo.logprobs import cache_kwarg, output_cache
from mmrgrpo.sampling import GenerationBackend, HFBackend


def chat(tok, q):
    return tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)


@pytest.fixture()
def prompts(tokenizer):
    "Three chat prompts of different lengths (so two are left-padded)."
    return [chat(tokenizer, "What is 2 + 3?"),
            chat(tokenizer, "Name a prime number larger than ten, please, and say why."),
            chat(tokenizer, "Hi")]


@pytest.fixture()
def many_stops(tiny_model):
    """The tiny random model with livelier weights (its greedy output is not one repeated token) and every fifth token
    id a stop id, so completions end at many different lengths, greedy or sampled."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in tiny_model.parameters():
            if p.dim() == 2: p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    tiny_model.generation_config.eos_token_id = list(range(0, tiny_model.config.vocab_size, 5))
    return tiny_model


def reference(model, tok, backend, prompts, G, max_new_tokens):
    "transformers' own greedy loop, untouched: every prompt repeated G times, no shared prefill."
    enc = backend.tokenize(prompts)
    out = model.generate(input_ids=enc.input_ids.repeat_interleave(G, 0),
                         attention_mask=enc.attention_mask.repeat_interleave(G, 0),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=backend.eos_ids,
                         pad_token_id=tok.pad_token_id, temperature=None, top_p=None, top_k=None)
    return out[:, enc.input_ids.shape[1]:]


def count_forward_rows(model):
    """A list that collects the batch size of every forward call of `model`'s body, prefill included (and the hook
    handle)."""
    rows = []
    h = model.get_decoder().register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[0]),
                                                      with_kwargs=True)
    return rows, h


@pytest.mark.parametrize("share_prompt", [True, False])
@pytest.mark.parametrize("compact_at", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("cache_room", [None, reserve_cache])      # the plain cache, and the trainer's (room reserved)
def test_greedy_equals_transformers_generate(many_stops, tokenizer, prompts, share_prompt, compact_at, cache_room):
    b = HFBackend(many_stops, tokenizer, share_prompt=share_prompt, compact_at=compact_at, cache_room=cache_room)
    ro = b.generate(prompts, num_generations=2, max_new_tokens=12, greedy=True)
    lengths = ro.completion_mask.sum(-1)
    assert len(set(lengths.tolist())) > 1 and not ro.truncated.all()        # rows end at different steps
    assert torch.equal(ro.completion_ids, reference(many_stops, tokenizer, b, prompts, 2, 12))


def test_greedy_equals_transformers_generate_smollm2(smollm2_path, tokenizer):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    prompts = [chat(tokenizer, "What is 2+2? Reply with just the digit."), chat(tokenizer, "Say yes.")]
    b = HFBackend(model, tokenizer)
    ro = b.generate(prompts, num_generations=2, max_new_tokens=12, greedy=True)
    # '2 + 2 = 4' ends after 8 tokens, the other runs on
    assert ro.truncated.tolist() == [False, False, True, True]
    assert torch.equal(ro.completion_ids, reference(model, tokenizer, b, prompts, 2, 12))


def test_one_token_prompts_need_no_prefill(many_stops, tokenizer):
    b = HFBackend(many_stops, tokenizer)
    ro = b.generate(["Hi", "Hello"], num_generations=2, max_new_tokens=6, greedy=True)
    assert ro.prompt_ids.shape[1] == 1
    assert torch.equal(ro.completion_ids, reference(many_stops, tokenizer, b, ["Hi", "Hello"], 2, 6))


def test_sampling_is_seeded_and_draws_what_generate_draws(many_stops, tokenizer, prompts):
    new = HFBackend(many_stops, tokenizer).generate(prompts, 4, 12, temperature=1.3, seed=7)
    assert len(set(new.completion_mask.sum(-1).tolist())) > 2                # rows leave the batch at many steps
    again = HFBackend(many_stops, tokenizer).generate(prompts, 4, 12, temperature=1.3, seed=7)
    assert torch.equal(new.completion_ids, again.completion_ids)
    assert not torch.equal(new.completion_ids,
                           HFBackend(many_stops, tokenizer).generate(prompts, 4, 12, 1.3, seed=8).completion_ids)
    # one uniform draw per output row and step, as in transformers' loop: same seed, same completions on either path
    old = HFBackend(many_stops, tokenizer, drop_finished=False).generate(prompts, 4, 12, temperature=1.3, seed=7)
    for f in ("completion_ids", "completion_mask", "prompt_ids", "prompt_mask"):
        assert torch.equal(getattr(new, f), getattr(old, f)), f
    assert new.completions == old.completions
    nucleus = HFBackend(many_stops, tokenizer).generate(prompts, 4, 12, top_p=0.5, seed=7)
    assert torch.equal(nucleus.completion_ids,
                       HFBackend(many_stops, tokenizer, drop_finished=False)
                       .generate(prompts, 4, 12, top_p=0.5, seed=7).completion_ids)


def test_finished_rows_leave_the_batch(many_stops, tokenizer, prompts):
    G, T = 4, 12
    counts = {}
    for name, kw in {"old": dict(drop_finished=False), "every": dict(compact_at=0.0),
                     "quarter": dict(compact_at=0.25)}.items():
        rows, h = count_forward_rows(many_stops)
        try: ro = HFBackend(many_stops, tokenizer, **kw).generate(prompts, G, T, seed=1)
        finally: h.remove()
        assert rows[0] == len(prompts)                                     # the shared prefill: each prompt once
        counts[name] = sum(rows[1:])
    lengths = ro.completion_mask.sum(-1)
    assert not ro.truncated.all() and lengths.max() > lengths.min()
    assert counts["old"] == len(lengths) * ro.completion_ids.shape[1]     # every row to the longest completion
    # each row exactly until its end-of-sequence token
    assert counts["every"] == int(lengths.sum())
    assert counts["every"] <= counts["quarter"] < counts["old"]


def test_truncated_rows_and_zero_new_tokens(many_stops, tokenizer, prompts):
    many_stops.generation_config.eos_token_id = [tokenizer.eos_token_id]
    b = HFBackend(many_stops, tokenizer)
    ro = b.generate(prompts, 2, 5, seed=0)
    assert ro.completion_ids.shape == (6, 5)
    old = HFBackend(many_stops, tokenizer, drop_finished=False).generate(prompts, 2, 5, seed=0)
    assert torch.equal(ro.completion_ids, old.completion_ids) and torch.equal(ro.completion_mask, old.completion_mask)
    assert b.generate(prompts, 2, 0).completion_ids.shape == (6, 1)


def test_reserved_cache_keeps_selected_rows(tiny_model):
    ids = torch.randint(10, 1000, (4, 6))
    cache = reserve_cache(output_cache(tiny_model(input_ids=ids, use_cache=True)), 3)
    k = cache.layers[0].keys.clone()
    cache.batch_select_indices(torch.tensor([0, 3, 2]))        # row 1 ends: the last row takes its place
    assert torch.equal(cache.layers[0].keys, k[[0, 3, 2]]) and cache.layers[0]._k.shape[0] == 3
    cache.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(cache.layers[0].keys, k[[2, 0]])
    # room left: in place
    out = tiny_model(input_ids=ids[[2, 0], :1], use_cache=True, **{cache_kwarg(tiny_model): cache})
    assert output_cache(out).layers[0].keys.shape[-2] == 7


def protocol_methods() -> dict:
    "The methods `GenerationBackend` asks for, with their parameter names."
    return {n: list(inspect.signature(f).parameters) for n, f in vars(GenerationBackend).items()
            if callable(f) and not n.startswith("_")}


def test_backends_satisfy_the_generation_protocol(tiny_model, tokenizer):
    from mmrgrpo.vllm_backend import VLLMBackend                  # importable without vLLM: the engine loads lazily
    assert sorted(protocol_methods()) == ["generate", "sync_weights"]
    assert isinstance(HFBackend(tiny_model, tokenizer), GenerationBackend)
    assert not isinstance(object(), GenerationBackend)
    for backend in (HFBackend, VLLMBackend):                      # the same methods, taking the same arguments
        for name, params in protocol_methods().items():
            assert list(inspect.signature(getattr(backend, name)).parameters) == params, (backend.__name__, name)



def test_a_completion_that_stops_on_the_last_column_is_not_truncated(many_stops, tokenizer, prompts):
    """Every row stops early, so the batch is as wide as its longest completion, whose mask row is all 1: it stopped, it
    was not cut off. After pruning away the longest, the next longest fills the trimmed width: not truncated either."""
    ro = HFBackend(many_stops, tokenizer).generate(prompts, 4, 64, seed=1)
    lengths = ro.completion_mask.sum(-1)
    assert ro.completion_ids.shape[1] == lengths.max() < 64                  # all stopped before the limit
    assert not ro.truncated.any()
    keep = lengths < lengths.max()
    kept = ro.select(keep)
    assert kept.completion_mask.all(-1).any() and not kept.truncated.any()
    cut = HFBackend(many_stops, tokenizer).generate(prompts, 4, 3, seed=1)    # 3 tokens: some run out
    assert torch.equal(cut.truncated, ~torch.isin(cut.completion_ids, torch.tensor(many_stops.generation_config
                                                                                    .eos_token_id)).any(-1))
    assert cut.truncated.any()
