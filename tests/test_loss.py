"The loss against a direct, hand-written computation on a tiny random model, and ALGORITHMS.md sections 2 and 6."
import math
import pytest, torch
from mmrgrpo.advantages import group_advantages
from mmrgrpo.loss import aggregate_loss, per_token_loss
from mmrgrpo.logprobs import completion_stats, token_stats


def test_section2_example():
    A = group_advantages(torch.tensor([3, 0, 2.5, 1.0]), 4)
    assert torch.allclose(A, torch.tensor([0.998553, -1.180108, 0.635443, -0.453888]), atol=1e-5)
    assert torch.allclose(group_advantages(torch.tensor([3, 0, 2.5, 1.0]), 4, scale="none"),
                          torch.tensor([1.375, -1.625, 0.875, -0.625]))
    assert torch.equal(group_advantages(torch.full((4,), 7.0), 4), torch.zeros(4))


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradient_match_hand_written(tiny_model, loss_type, beta):
    torch.manual_seed(0)
    m = tiny_model.double()
    N, P, T, V = 4, 5, 6, m.config.vocab_size
    p_ids = torch.randint(0, V, (N, P)); c_ids = torch.randint(0, V, (N, T))
    p_mask = torch.ones(N, P, dtype=torch.long); p_mask[0, :2] = 0; p_mask[2, :1] = 0        # left padding
    c_mask = torch.ones(N, T, dtype=torch.long); c_mask[1, 4:] = 0; c_mask[3, 2:] = 0          # short completions
    A = torch.tensor([1.0, -0.5, 0.25, -0.75], dtype=torch.double)
    logp_old = torch.randn(N, T, dtype=torch.double) * 0.1 - 10       # off-policy so that clipping happens
    logp_ref = torch.randn(N, T, dtype=torch.double) * 0.1 - 10

    # ours: hidden states + chunked log-probs + surrogate + aggregation
    lp, _, _ = completion_stats(m, p_ids, p_mask, c_ids, c_mask, temperature=0.9, chunk_size=5)
    ours = aggregate_loss(per_token_loss(lp, logp_old, A, logp_ref, beta=beta, eps_low=0.2, eps_high=0.28)[0], c_mask,
                          loss_type, max_completion_length=8)
    g_ours = torch.autograd.grad(ours, [p for p in m.parameters()], allow_unused=True)

    # direct: full logits, full log-softmax, explicit loops over completions and tokens
    ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
    logits = m(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits / 0.9
    logprobs = torch.log_softmax(logits, -1)
    per_seq, total, ntok = [], 0.0, 0
    for i in range(N):
        terms = []
        for t in range(T):
            if not c_mask[i, t]: continue
            lpt = logprobs[i, P - 1 + t, c_ids[i, t]]
            ratio = torch.exp(lpt - logp_old[i, t])
            obj = torch.minimum(ratio * A[i], torch.clamp(ratio, 0.8, 1.28) * A[i])
            d = logp_ref[i, t] - lpt
            terms.append(-obj + beta * (torch.exp(d) - d - 1))
        per_seq.append(sum(terms) / len(terms)); total = total + sum(terms); ntok += len(terms)
    direct = {"grpo": sum(per_seq) / N, "dr_grpo": total / (N * 8), "dapo": total / ntok}[loss_type]
    g_direct = torch.autograd.grad(direct, [p for p in m.parameters()], allow_unused=True)

    assert torch.allclose(ours, direct, atol=1e-10)
    for a, b in zip(g_ours, g_direct):
        if a is None: assert b is None or torch.count_nonzero(b) == 0
        else: assert torch.allclose(a, b, atol=1e-9)


def test_section6_kl_and_on_policy_gradient():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, clipped, kl = per_token_loss(lp, lp.detach(), torch.tensor([2.0]), logp_ref=lp.detach() - 0.5, beta=0.04)
    assert torch.allclose(kl, torch.full((1, 2), math.exp(-0.5) + 0.5 - 1))
    assert not clipped.any()
    total = aggregate_loss(loss, torch.ones(1, 2), "grpo")
    assert abs(total.item() - (-2.0 + 0.04 * (math.exp(-0.5) - 0.5))) < 1e-6   # r = 1, so the surrogate is -A
    g, = torch.autograd.grad(total, lp)
    # d/dlogp of -r*A is -A*r = -2 ; of beta*(e^{ref-lp} - (ref-lp) - 1) is beta*(1 - e^{ref-lp}); mean over 2 tokens
    assert torch.allclose(g, torch.full((1, 2), (-2.0 + 0.04 * (1 - math.exp(-0.5))) / 2))


def test_chunking_bounds_memory_and_is_exact():
    "Chunk size changes nothing numerically; only one chunk of logits is alive at a time."
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 5000, bias=False)
    h = torch.randn(8, 64, 16, requires_grad=True); y = torch.randint(0, 5000, (8, 64))
    a = token_stats(h, y, head, chunk_size=37)[0]
    b = token_stats(h, y, head, chunk_size=10_000)[0]
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("group_size", [1, 2])
def test_eager_and_sdpa_attention_agree_with_padding(tokenizer, group_size):
    """Left-padded prompts (some query positions see only padding) give finite, equal log-probs and gradients under both
    kernels. In float32 (and bf16): in float64, transformers' eager attention takes the softmax in float32, where
    float64's mask minimum becomes -inf, so fully padded query rows come out NaN. That is transformers', and nobody
    trains in float64."""
    from mmrgrpo.models import tiny_random_model
    torch.manual_seed(0)
    N, P, T = 4, 6, 5
    p_ids = torch.randint(1, 1000, (N // 2, P)).repeat_interleave(2, 0); c_ids = torch.randint(1, 1000, (N, T))
    p_mask = torch.ones(N, P, dtype=torch.long); p_mask[2:, :3] = 0          # the second group's prompt is left-padded
    c_mask = torch.ones(N, T, dtype=torch.long); c_mask[1, 2:] = 0
    out = {}
    for impl in ("sdpa", "eager"):
        m = tiny_random_model(tokenizer, seed=0)
        m.set_attn_implementation(impl)
        lp, _, _ = completion_stats(m, p_ids, p_mask, c_ids, c_mask, group_size=group_size)
        grads = torch.autograd.grad((lp * c_mask).sum(), list(m.parameters()))
        assert torch.isfinite(lp).all() and all(torch.isfinite(g).all() for g in grads), impl
        out[impl] = (lp, grads)
    assert torch.allclose(out["sdpa"][0], out["eager"][0], atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in zip(out["sdpa"][1], out["eager"][1]))


def test_inputs_that_would_give_a_silent_wrong_result_are_refused():
    "Found by calling the functions as a careless user would: each used to return a wrong number without a word."
    import numpy as np
    from mmrgrpo.loss import sampler_is_weights
    from mmrgrpo.pruning import keep_mask
    from mmrgrpo.rewards import compute_rewards, format_reward
    from mmrgrpo.safety import pruned_count
    from mmrgrpo.tokens import select_tokens
    with pytest.raises(ValueError, match="rewards hold 1 non-finite"):
        group_advantages(torch.tensor([1., math.nan, 0., 1.]), 4)
    with pytest.raises(ValueError, match="group_size=1"): group_advantages(torch.ones(4), 1)
    with pytest.raises(ValueError, match="counts cannot be negative"):
        aggregate_loss(torch.ones(2, 3), torch.ones(2, 3), num_sequences=-1)
    with pytest.raises(ValueError, match="cap=0"): sampler_is_weights(torch.zeros(2, 3), torch.zeros(2, 3), cap=0)
    with pytest.raises(ValueError, match="one mask entry per score"):
        select_tokens(torch.rand(4, 5), torch.ones(1, 5), 2, keep_ratio=1.0)
    with pytest.raises(ValueError, match=r"reward weights \[nan\]"):
        compute_rewards([format_reward], [math.nan], ["p"], ["c"], {})
    # a float32 0.7 is 7/10
    assert pruned_count(10, np.float32(0.7)) == 7 and pruned_count(10, torch.tensor(0.7)) == 7
    assert int(keep_mask(torch.randn(10), 10, torch.tensor(0.7)).sum()) == 3


def test_lists_work_as_tensors_and_what_is_no_number_is_named():
    """The algorithm functions take plain lists (or numpy arrays) as a notebook user types them, and refuse the rest by
    name."""
    import numpy as np
    from mmrgrpo.mmr import dra_reweight, mmr_reweight, mmr_reweight_groups, similarity_matrix
    from mmrgrpo.diversity import diversity_advantages
    from mmrgrpo.pruning import keep_mask
    from mmrgrpo.rewards import compute_rewards, format_reward, length_scaled
    r, E = [1., 0., 1., 0.], [[1., 0.], [.6, .8], [.8, .6], [0., 1.]]
    rt, Et = torch.tensor(r), torch.tensor(E)
    assert torch.equal(group_advantages(r, 4), group_advantages(rt, 4))
    assert torch.equal(group_advantages(np.array(r), 4), group_advantages(rt, 4))
    assert torch.equal(mmr_reweight_groups(r, E, 4)[0], mmr_reweight_groups(rt, Et, 4)[0])
    assert torch.equal(mmr_reweight(r, E)[0], mmr_reweight(rt, Et)[0])
    assert torch.equal(diversity_advantages(r, E, 4), diversity_advantages(rt, Et, 4))
    assert torch.equal(keep_mask(r, 4, 0.5), keep_mask(rt, 4, 0.5))
    with pytest.raises(TypeError, match="rewards: a tensor"): group_advantages("1010", 4)
    with pytest.raises(TypeError, match="rewards: a tensor"): group_advantages(["1", "0"], 2)
    with pytest.raises(ValueError, match="group_size=0"): similarity_matrix(Et, 0)          # was a ZeroDivisionError
    with pytest.raises(TypeError, match="group_size=2.0"): similarity_matrix(Et, 2.0)
    # DRA: completions pointing apart would divide a reward by a similarity sum of zero (inf); negative counts as unlike
    assert torch.equal(dra_reweight([1., 0.], [[1., 0.], [-1., 0.]], 2), torch.tensor([1., 0.]))
    # rewards: a string of completions was scored character by character; lists of unequal length reached the reward
    # functions
    with pytest.raises(TypeError, match="completions is one string"):
        compute_rewards([format_reward], None, ["p"] * 3, "abc", {})
    with pytest.raises(ValueError, match="one entry per completion"):
        compute_rewards([format_reward], None, ["p", "q"], ["c"], {})
    with pytest.raises(ValueError, match="max_len=0"): length_scaled(True, 5, max_len=0)


def test_more_calls_that_gave_a_silent_wrong_result_are_refused(tmp_path):
    """Found by a second round of careless calls: each returned a plausible number (often token 0, end-of-text) without
    a word."""
    from mmrgrpo.data import DataError, load_tasks
    from mmrgrpo.pruning import keep_mask
    from mmrgrpo.rewards import compute_rewards
    from mmrgrpo.sampling import Rollout, sample_tokens
    from mmrgrpo.tokens import select_tokens
    from mmrgrpo.rewards import accuracy_reward
    logits = torch.randn(3, 100)
    # was token 0 on every row
    with pytest.raises(ValueError, match="temperature=0"): sample_tokens(logits, 0.0)
    with pytest.raises(ValueError, match="top_p=0"): sample_tokens(logits, 1.0, 0.0)
    with pytest.raises(ValueError, match=r"row\(s\) \[0\] hold NaN"): sample_tokens(torch.tensor([[1., math.nan, 3.]]))
    with pytest.raises(ValueError, match=r"row\(s\) \[0\]"):
        sample_tokens(torch.full((2, 4), -math.inf).index_fill(0, torch.tensor([1]), 0.))
    # a finite row still samples
    assert sample_tokens(torch.tensor([[0., 50., 0.]]), 1.0, 1.0).item() == 1
    r = Rollout(["p0", "p0", "p1", "p1"], [f"c{i}" for i in range(4)], torch.ones(4, 3, dtype=torch.long),
                torch.ones(4, 3, dtype=torch.long), torch.ones(4, 4, dtype=torch.long),
                torch.ones(4, 4, dtype=torch.long), 2)
    # texts and ids disagreed
    with pytest.raises(TypeError, match="keep: a bool tensor"): r.select(torch.tensor([1, 0, 1, 0]))
    assert r.select(torch.tensor([True, False, True, False])).completions == ["c0", "c2"]
    # golds "1" and "2"
    with pytest.raises(TypeError, match="one string"): accuracy_reward(["q", "q"], ["\\boxed{12}"] * 2, "12")
    with pytest.raises(TypeError, match="answer is one string"):
        compute_rewards([accuracy_reward], None, ["q", "q"], ["\\boxed{12}"] * 2, {"answer": "12"})
    # was the test set
    with pytest.raises(DataError, match="no 'Train' split"): load_tasks("arithmetic:1", "Train", limit=3)
    assert load_tasks("arithmetic:1", "validation", limit=3) == load_tasks("arithmetic:1", "test", limit=3)
    (tmp_path / "t.jsonl").write_text('{"question": "What is 1 + 1?", "answer": "2"}\n')
    assert load_tasks(tmp_path / "t.jsonl")[0]["answer"] == "2"                  # a pathlib.Path is a path
    lp = -torch.rand(3, 3)
    with pytest.raises(ValueError, match="advantages are"): per_token_loss(lp, lp + .1, torch.tensor([[1., 0., -1.]]))
    # inverted the clip range
    with pytest.raises(ValueError, match="not its bounds"): per_token_loss(lp, lp, torch.ones(3), eps_low=-0.2)
    with pytest.raises(ValueError, match="beta=-0.1"): per_token_loss(lp, lp, torch.ones(3), logp_ref=lp, beta=-0.1)
    scores = torch.tensor([[math.nan, math.nan, .9, .3], [.2, .8, 0., .4]])
    with pytest.raises(ValueError, match="token scores hold 2"): select_tokens(scores, torch.ones(2, 4), 2, 0.25)
    # NaN at padding: fine
    assert select_tokens(scores, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), 2, 0.5).sum() == 3
    with pytest.raises(ValueError, match="advantages hold 1"): keep_mask(torch.tensor([math.nan, 1., 0., -1.]), 4, 0.5)
    # and raw errors deep inside that now name the argument (or take the obvious meaning)
    from mmrgrpo.pruning import kept_count
    from mmrgrpo.safety import pruned_count
    from mmrgrpo.sampling import completion_mask
    # was "Invalid literal for Fraction", or float()'s TypeError
    for bad in (math.nan, math.inf, None, "0.5", [0.5]):
        with pytest.raises(ValueError, match="prune_rate=.*a number in"): pruned_count(10, bad)
    with pytest.raises(TypeError, match="group_size=2.5"): kept_count(2.5, 0.5)                   # was 1.5 completions
    with pytest.raises(TypeError, match="group_size=2.0"): select_tokens(torch.rand(4, 3), torch.ones(4, 3), 2.0, 0.5)
    # one end-of-sequence id
    assert completion_mask(torch.tensor([[5, 2, 7]]), 2).tolist() == [[1, 1, 0]]
    from mmrgrpo.data import tasks_for_step
    from mmrgrpo.models import load_tokenizer, resolve_model
    from mmrgrpo.prompts import check_prompt_lengths, format_prompt
    tok = load_tokenizer(resolve_model("smollm2"))
    # was a dict-update error
    with pytest.raises(DataError, match="pass task_source"): tasks_for_step("arithmetic:1", 0, 2)
    with pytest.raises(TypeError, match="shots a list of"):
        format_prompt(tok, "Q", shots=[{"question": "a", "answer": "b"}])
    # one index per character
    with pytest.raises(TypeError, match="one string"): check_prompt_lengths(tok, "abc def", 1)
    assert check_prompt_lengths(tok, [], 2) == []
    from mmrgrpo.loss import loss_weights
    # group ids typed as a list
    assert torch.equal(select_tokens(scores.nan_to_num(), torch.ones(2, 4), [0, 1], 0.5),
                       select_tokens(scores.nan_to_num(), torch.ones(2, 4), torch.tensor([0, 1]), 0.5))
    with pytest.raises(ValueError, match="one id >= 0 per row"):
        select_tokens(torch.rand(2, 4), torch.ones(2, 4), torch.tensor([0, -1]), 0.5)
    with pytest.raises(ValueError, match="not their lengths"): loss_weights(torch.tensor([2, 0, 3]))   # was tensor(0.2)


def test_the_update_hands_every_loss_option_to_the_loss(tmp_path, monkeypatch):
    """`step.update` passes each loss option of the config on (the ratio's level, delta, the KL's form, bnpo's count of
    micro-batches, the truncation mask, the sampler mode): what the TRL-parity tests check per formula, wired in."""
    from mmrgrpo import step
    from test_combinations import _config, _model, _rollout, _run_update
    seen = {}
    real_loss, real_agg, real_is = step.per_token_loss, step.aggregate_loss, step.sampler_is_weights
    def loss(*a, **k): seen.update(loss=k); return real_loss(*a, **k)
    def agg(*a, **k): seen.update(agg=a); return real_agg(*a, **k)
    def is_weights(*a, **k): seen.update(is_mode=a[4]); return real_is(*a, **k)
    monkeypatch.setattr(step, "per_token_loss", loss)
    monkeypatch.setattr(step, "aggregate_loss", agg)
    monkeypatch.setattr(step, "sampler_is_weights", is_weights)
    ro = _rollout()
    ro.sampler_logprobs = torch.zeros_like(ro.completion_mask, dtype=torch.float)
    c = _config(tmp_path, loss_type="bnpo", importance_sampling_level="sequence", delta=4.0,
                use_bias_correction_kl=True, beta=0.04, lora=True, mask_truncated_completions=True, micro_batch_size=4,
                tis_cap=3.0, vllm_importance_sampling_mode="token_mask")
    from mmrgrpo.models import add_lora
    _run_update(c, add_lora(_model(), c), ro, torch.linspace(-1, 1, 8))
    assert {k: seen["loss"][k] for k in ("level", "delta", "use_bias_correction_kl", "beta")} == dict(
        level="sequence", delta=4.0, use_bias_correction_kl=True, beta=0.04)
    truncated_rows = ro.truncated[4:]                          # the last micro-batch's rows
    assert truncated_rows.any() and not seen["loss"]["mask"][truncated_rows].any()     # their tokens left out
    assert seen["agg"][6] == 2 and seen["is_mode"] == "token_mask"                      # micro-batches; sampler mode
