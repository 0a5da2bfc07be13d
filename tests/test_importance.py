"""Truncated importance sampling for a sampler that is not the learner (`tis_cap`): a sampler equal to the learner
changes nothing; a deliberately perturbed one gets the weights min(exp(delta), C), the logged clipped share, and the
gradient of the loss weighted by hand; the config's auto/explicit/off cases; pruning keeps the sampler's log-probs of
the kept rows; a run with (fake) vLLM applies and logs it by default."""
import math
import pytest, torch
from mmrgrpo.config import ConfigError, load_config
from mmrgrpo.loss import sampler_is_weights
from mmrgrpo.step import batch_logprobs, micro_batches, policy_stats
from mmrgrpo.trainer import train
from test_combinations import _assert_same_grads, _config, _model, _rollout, _run_update
from test_vllm import fake_vllm         # a fixture: the fake vLLM engine (each sampled token's log-prob: -1)

CAP = 2.0
ADV = torch.tensor([1.0, -0.5, 0.25, -0.75, 0.5, -1.0, 0.75, 0.25])


def learner_logprobs(model, rollout, c) -> torch.Tensor:
    "(N, T) the learner's log-probs of the rollout's tokens, 0 on padding (what the vLLM backend records for its own)."
    slices = micro_batches(rollout.group_ids, rollout.completion_mask.shape[1], c.micro_batch_size)
    return batch_logprobs(model, rollout, c, slices)[0] * rollout.completion_mask


def perturbation(rollout) -> torch.Tensor:
    """(N, T) delta = logp_learner - logp_sampler: -0.6 .. 1.2 in steps of 0.3, so some tokens lie above log 2 (0.69)
    and none on it."""
    n = rollout.completion_mask.numel()
    return (((torch.arange(n) % 7) - 2) * 0.3).reshape(rollout.completion_mask.shape)


def test_a_sampler_equal_to_the_learner_changes_no_gradient(tmp_path):
    model, rollout = _model(), _rollout()
    on, off = _config(tmp_path, generation_backend="vllm"), _config(tmp_path, generation_backend="vllm", tis_cap=0)
    assert (on.tis_cap_, off.tis_cap_) == (CAP, 0.0)
    rollout.sampler_logprobs = learner_logprobs(model, rollout, on)
    grads_on, m_on = _run_update(on, model, rollout, ADV)
    grads_off, m_off = _run_update(off, model, rollout, ADV)
    # the weights were applied, and only with the cap on
    assert "is/ratio_mean" in m_on and "is/ratio_mean" not in m_off
    assert m_on["is/ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m_on["is/clipped_frac"] == 0.0
    _assert_same_grads(grads_on, grads_off)


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_a_perturbed_sampler_gets_capped_weights_and_the_hand_weighted_gradient(tmp_path, num_iterations):
    model, rollout = _model(), _rollout()
    c = _config(tmp_path, generation_backend="vllm", num_iterations=num_iterations)
    mask = rollout.completion_mask.bool()
    logp = learner_logprobs(model, rollout, c)
    delta = perturbation(rollout)
    rollout.sampler_logprobs = (logp - delta) * mask
    expected = torch.where(mask, delta.exp().clamp(max=CAP), torch.ones_like(delta))
    weights, capped, ratio = sampler_is_weights(logp, rollout.sampler_logprobs, CAP, mask)
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=0)
    assert torch.equal(capped, (delta > math.log(CAP)) & mask) and capped.any() and (mask & ~capped).any()

    grads, metrics = _run_update(c, model, rollout, ADV)        # lr 0: every iteration sees the same weights
    assert metrics["is/clipped_frac"] == pytest.approx(((delta > math.log(CAP)) & mask).sum().item()
                                                       / mask.sum().item())
    assert metrics["is/ratio_mean"] == pytest.approx(delta.exp()[mask].mean().item(), rel=1e-5)

    # by hand: on-policy the ratio r is 1 (inside the clip range), so the grpo loss is mean_i mean_t -w * r * A_i
    model.zero_grad(set_to_none=True)
    lp = policy_stats(model, rollout, c, slice(0, len(ADV)))[0]
    r = (lp - lp.detach()).exp()
    per_token = -expected * r * ADV[:, None]
    loss = ((per_token * mask).sum(-1) / mask.sum(-1)).sum() / len(ADV)
    loss.backward()
    hand = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    _assert_same_grads(grads, [hand] * num_iterations)


def test_cap_settings(tmp_path):
    "Auto: 2.0 with vLLM and off with HF; 0 is off; negative and explicit-with-HF are config errors."
    assert _config(tmp_path).tis_cap_ == 0.0
    assert _config(tmp_path, generation_backend="vllm").tis_cap_ == CAP
    assert _config(tmp_path, generation_backend="vllm", tis_cap=3).tis_cap_ == 3.0
    with pytest.raises(ConfigError, match=r"tis_cap=-0.5: must be >= 0"):
        _config(tmp_path, generation_backend="vllm", tis_cap=-0.5)
    with pytest.raises(ConfigError, match="tis_cap=2.0 with generation_backend=hf and sampler_dtype=policy"):
        _config(tmp_path, tis_cap=2, sampler_dtype="policy")
    # a bf16 copy samples: it can be corrected
    assert _config(tmp_path, tis_cap=2, sampler_dtype="bfloat16").tis_cap_ == CAP


def test_a_merged_copy_records_its_own_logprobs(tmp_path):
    """The hf backend on a merged copy (61_sampler_copy) records each drawn token's log-prob; an fp32 copy's are the
    learner's own."""
    import dataclasses
    from mmrgrpo.sampling import HFBackend
    from mmrgrpo.sampler_copy import CopyBackend
    from mmrgrpo.models import resolve_model, load_tokenizer, tiny_random_model, add_lora
    tok = load_tokenizer(resolve_model("smollm2"))
    c = dataclasses.replace(_config(tmp_path), temperature=0.7)
    model = add_lora(tiny_random_model(tok, seed=0), c)
    prompts = ["What is 2 + 3?", "Name a colour."]
    ro = CopyBackend(model, tok, copy_dtype=torch.float32,
                     record_logprobs=True).generate(prompts, 3, 6, temperature=0.7, seed=1)
    assert ro.sampler_logprobs is not None and ro.sampler_logprobs.shape == ro.completion_mask.shape
    assert ((ro.sampler_logprobs[ro.completion_mask == 0] == 0).all()
            and (ro.sampler_logprobs[ro.completion_mask == 1] < 0).all())
    assert torch.allclose(ro.sampler_logprobs, learner_logprobs(model, ro, c), atol=1e-4)
    bf16 = CopyBackend(model, tok, copy_dtype=torch.bfloat16,
                       record_logprobs=True).generate(prompts, 3, 6, temperature=0.7, seed=1)
    gap = (bf16.sampler_logprobs - learner_logprobs(model, bf16, c)).abs()[bf16.completion_mask.bool()]
    # close, not equal: the mismatch tis_cap corrects
    assert 0 < gap.max() < 0.5
    # the policy itself: none
    assert HFBackend(model, tok).generate(prompts, 3, 6, seed=1).sampler_logprobs is None
    assert CopyBackend(model, tok, copy_dtype=torch.float32,
                       record_logprobs=True).generate(prompts, 3, 6, greedy=True).sampler_logprobs is None
    # not asked
    assert CopyBackend(model, tok, copy_dtype=torch.float32).generate(prompts, 3, 6, seed=1).sampler_logprobs is None


def test_a_bf16_copy_run_with_a_cap_weights_and_logs(tmp_path):
    """tis_cap with the hf backend on a bf16 sampling copy: the trainer records the copy's log-probs and applies the
    weights."""
    res = train(_config(tmp_path, steps=2, tis_cap=2, sampler_dtype="bfloat16", reward_funcs=["reward_fixtures:varied"],
                        reward_weights=None), progress=False)
    assert res.backend.record_logprobs and all("is/ratio_mean" in r and 0.5 < r["is/ratio_mean"] < 2
                                               for r in res.metrics)


def test_an_explicit_cap_needs_the_samplers_logprobs_and_auto_does_not(tmp_path):
    model, rollout = _model(), _rollout()
    assert rollout.sampler_logprobs is None
    with pytest.raises(ValueError, match=r"tis_cap=2.0: the rollout has no sampler log-probs"):
        _run_update(_config(tmp_path, generation_backend="vllm", tis_cap=2), model, rollout, ADV)
    _, metrics = _run_update(_config(tmp_path, generation_backend="vllm"), model, rollout, ADV)
    assert not any(k.startswith("is/") for k in metrics)


def test_pruning_keeps_the_samplers_logprobs_of_the_kept_rows(tmp_path):
    rollout = _rollout()
    rollout.sampler_logprobs = -torch.arange(rollout.completion_mask.numel(),
                                             dtype=torch.float).reshape(rollout.completion_mask.shape)
    # the two short completions: 3 and 2 tokens
    keep = torch.tensor([False, True, False, False, False, False, True, False])
    kept = rollout.select(keep)
    t = kept.completion_mask.shape[1]
    assert t == 3 < rollout.completion_mask.shape[1]                                  # the padding columns were trimmed
    assert torch.equal(kept.sampler_logprobs, rollout.sampler_logprobs[keep][:, :t])
    assert _rollout().select(keep).sampler_logprobs is None


def test_a_vllm_run_weights_its_tokens_and_logs_it(fake_vllm, tmp_path):
    """End to end with the fake engine: the trainer applies the correction by default and logs it; tis_cap=0 turns it
    off."""
    base = dict(model="tiny-random", lora=False, beta=0.0, generation_backend="vllm", steps=1, num_generations=4,
                prompts_per_step=2, max_completion_length=6, eval_size=0, save_every=0, log_completions_every=0)
    row = train(load_config(**base, output_dir=str(tmp_path / "on")), progress=False).metrics[0]
    # a random model gives a token about 1/49152 (log-prob -10.8), the fake sampler e^-1: ratios near e^-9.8, none
    # capped
    assert row["is/clipped_frac"] == 0 and 0 < row["is/ratio_mean"] < 1e-2
    row = train(load_config(**base, tis_cap=0, output_dir=str(tmp_path / "off")), progress=False).metrics[0]
    assert not any(k.startswith("is/") for k in row)
