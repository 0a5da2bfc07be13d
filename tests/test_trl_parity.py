"""Equality with TRL's `GRPOTrainer` (1.16, pinned in the `dev` extra), TRL's own code run on the same numbers.

TRL prepares one fixed batch itself: its `rollout_func` hook hands it our completions and a sampler's log-probs, its
reward functions score them, and `_generate_and_score_completions` computes the advantages (`None` rewards included),
the truncation mask and the importance-sampling ratios, which are compared with ours. Its `_compute_loss` then runs on
log-probs we give it, and its loss, its per-token loss (read from the function's locals as it returns) and the gradient
are compared with `per_token_loss` and `aggregate_loss` for every option both have, each alone, every pair, and all of
them at once. Last, one whole update with gradient accumulation: TRL's `train()` for one step against `step.update` on
the same micro-batches. Where we differ on purpose, a test says how, and measures by how much."""
import itertools, os, re, sys
from pathlib import Path
import pytest, torch

trl = pytest.importorskip("trl", reason="TRL is a test dependency: pip install -e '.[dev]' (it pins trl==1.16.0)")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")       # rollout_func is "experimental" in TRL 1.16
from trl import GRPOConfig as TRLConfig, GRPOTrainer                                            # noqa: E402
from mmrgrpo.config import load_config                                                          # noqa: E402
from mmrgrpo.loss import aggregate_loss, mask_truncated, per_token_loss, sampler_is_weights     # noqa: E402
from mmrgrpo.sampling import Rollout, completion_mask, truncated_rows                           # noqa: E402
from mmrgrpo.step import advantages_for, score, update                                         # noqa: E402
from mmrgrpo.tokens import entropy_quantile_mask, mask_advantages                               # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
G, B, T = 4, 2, 6                     # completions per prompt, prompts, the longest completion
CAP = 2.0                             # the importance-sampling cap of both (TRL: vllm_importance_sampling_clip_max)
WEIGHTS = [1.0, 0.5]
# two reward functions; None where they do not apply. Row 4 is scored by neither: TRL's "unscorable" completion
FIRST = [1.0, None, 0.0, 1.0, None, None, 0.5, 0.0]
SECOND = [0.2, 0.2, 0.2, 0.0, None, 0.2, None, 0.0]
RTOL, ATOL = 1e-5, 1e-6               # float32, the same numbers through two codes


def first_reward(prompts, completions, **kwargs): return list(FIRST)
def second_reward(prompts, completions, **kwargs): return list(SECOND)


def pinned_trl() -> str:
    "The TRL version the dev extra pins."
    return re.search(r'^dev = \[[^\]]*"trl==([\d.]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


class Batch:
    "The fixed batch both sides see: prompts, completions (some stopped, some cut off), the sampler's log-probs."
    def __init__(self, tok, model):
        g = torch.Generator().manual_seed(0)
        eos = tok.eos_token_id
        self.prompt_ids = [tok("Add the two numbers, please:", add_special_tokens=False).input_ids,
                           tok("Sum:", add_special_tokens=False).input_ids]
        # lengths 6, 4, 6, 2, 6, 3, 5, 6; rows 1, 3, 5, 6 stop early, row 2 stops on the last column (not truncated)
        stops = {1: 3, 2: 5, 3: 1, 5: 2, 6: 4}
        self.completion_ids = []
        for i in range(B * G):
            ids = torch.randint(100, 2000, (T,), generator=g).tolist()
            self.completion_ids.append(ids[:stops[i]] + [eos] if i in stops else ids)
        P = max(map(len, self.prompt_ids))
        p_rows = [[tok.pad_token_id] * (P - len(p)) + p for p in self.prompt_ids for _ in range(G)]
        p_mask = [[0] * (P - len(p)) + [1] * len(p) for p in self.prompt_ids for _ in range(G)]
        c_rows = [c + [tok.pad_token_id] * (T - len(c)) for c in self.completion_ids]
        c_ids = torch.tensor(c_rows)
        self.rollout = Rollout([f"prompt {i // G}" for i in range(B * G)], [f"completion {i}" for i in range(B * G)],
                               torch.tensor(p_rows), torch.tensor(p_mask), c_ids, completion_mask(c_ids, [eos]), G,
                               truncated=truncated_rows(c_ids, [eos]))
        self.mask = self.rollout.completion_mask
        with torch.no_grad():
            from mmrgrpo.logprobs import completion_stats
            self.old = completion_stats(model, self.rollout.prompt_ids, self.rollout.prompt_mask, c_ids,
                                        torch.ones_like(c_ids))[0] * self.mask   # (N, T) the learner's, 0 on padding
        n = self.mask.numel()
        # the current policy against the old one: ratios from 0.5 to 3.5, some past the clip range, some past delta
        ratios = torch.tensor([0.5, 0.9, 1.1, 1.25, 1.35, 3.5, 0.75, 1.0, 1.3])
        self.log_ratio = ratios[torch.arange(n) % len(ratios)].log().reshape(self.mask.shape)
        # the sampler against the learner: token ratios from 0.5 to 3, sequence products on both sides of the cap
        steps = torch.tensor([0.4, -0.3, 0.9, 0.1, -0.7, 0.2, 1.1])
        self.sampler = (self.old - steps[torch.arange(n) % len(steps)].reshape(self.mask.shape)) * self.mask
        self.ref = self.old + 0.3 * torch.randn(self.mask.shape, generator=g)
        self.entropy = torch.rand(self.mask.shape, generator=g) * 3

    def rollout_func(self, prompts, trainer):
        "TRL's `rollout_func`: these completions and the sampler's log-probs, row by row."
        return {"prompt_ids": [self.prompt_ids[i // G] for i in range(len(prompts))],
                "completion_ids": [list(c) for c in self.completion_ids],
                "logprobs": [self.sampler[i, :len(c)].tolist() for i, c in enumerate(self.completion_ids)]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    "The tiny random model and its tokenizer in a folder, from which TRL builds its reference model."
    from mmrgrpo.models import tiny_random_model
    d = tmp_path_factory.mktemp("tiny")
    tiny_random_model(tokenizer, seed=0).save_pretrained(d); tokenizer.save_pretrained(d)
    return d


def load_model(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def batch(tokenizer, model_dir):
    return Batch(tokenizer, load_model(model_dir))


def trl_trainer(model_dir, tok, batch, model=None, **options) -> GRPOTrainer:
    "TRL's trainer on the tiny model, fed `batch` by `rollout_func`, with `options` in its GRPOConfig."
    from datasets import Dataset
    is_mode = options.pop("is_mode", None)
    base = dict(output_dir=str(model_dir / "trl"), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                per_device_train_batch_size=B * G, num_generations=G, max_completion_length=T, beta=0.0,
                loss_type="grpo", gradient_checkpointing=False, disable_dropout=True, shuffle_dataset=False, seed=0,
                reward_weights=WEIGHTS, logging_steps=1, vllm_importance_sampling_clip_max=CAP,
                vllm_importance_sampling_mode=is_mode or "token_truncate", use_bias_correction_kl=False)
    args = TRLConfig(**{**base, **options})
    trainer = GRPOTrainer(model=model if model is not None else load_model(model_dir),
                          reward_funcs=[first_reward, second_reward], args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": [f"prompt {b}" for b in range(B)]}),
                          rollout_func=batch.rollout_func)
    if is_mode:           # TRL corrects only a vLLM sampler; our rollout_func stands in for one, its log-probs recorded
        trainer.use_vllm, trainer._last_loaded_step = True, trainer.state.global_step
    return trainer


def trl_prepared(trainer) -> dict:
    "TRL's prepared batch: its advantages, masks, reference log-probs and importance-sampling ratios."
    inputs = [{"prompt": f"prompt {i // G}"} for i in range(B * G)]
    return trainer._generate_and_score_completions(inputs)


def trl_loss(trainer, inputs: dict, logp: torch.Tensor, entropy: torch.Tensor) -> tuple:
    "TRL's `_compute_loss` on log-probs we give it: the loss and the function's locals as it returns."
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropy, None)
    trainer.current_gradient_accumulation_steps = 1
    seen = {}
    def watch(frame, event, arg):
        if event == "return" and frame.f_code is GRPOTrainer._compute_loss.__code__: seen.update(frame.f_locals)
    sys.setprofile(watch)
    try: loss = trainer._compute_loss(trainer.model, inputs)
    finally: sys.setprofile(None)
    return loss, seen


def our_config(**options):
    """Our config for TRL's `options`, read by `load_config` in TRL's names; where our defaults differ from TRL's
    (`beta`, `scale_rewards` under dr_grpo, `eps_high` under dapo or another `epsilon`) TRL's are spelled out."""
    opts = dict(options)
    mode = opts.pop("is_mode", None)
    if mode: opts.update(tis_cap=CAP, vllm_importance_sampling_mode=mode)
    opts.setdefault("epsilon_high", opts.get("epsilon", 0.2))       # TRL: epsilon_high defaults to epsilon
    return load_config(model="tiny-random", num_generations=G, prompts_per_step=B, max_completion_length=T, lora=False,
                       beta=opts.pop("beta", 0.0), scale_rewards=opts.pop("scale_rewards", "group"),
                       reward_funcs=["format", "format"], reward_weights=WEIGHTS, **opts)


def our_step_inputs(batch, c) -> tuple:
    "Our rewards, advantages (`step.advantages_for`) and loss mask for the batch under config `c`."
    rewards, _ = score(batch.rollout, [{"question": "q0"}, {"question": "q1"}], [first_reward, second_reward], c)
    advantages, _ = advantages_for(rewards, batch.rollout, c)
    loss_mask = mask_truncated(batch.mask, batch.rollout.truncated) if c.mask_truncated_completions else batch.mask
    return rewards, advantages, loss_mask


def our_loss(batch, c, logp, advantages, loss_mask) -> tuple:
    "Our per-token loss and loss, composed as `step.micro_batch_pass` composes them (one micro-batch)."
    adv = advantages
    if c.token_selection == "entropy":
        adv = mask_advantages(adv, entropy_quantile_mask(batch.entropy, loss_mask, c.keep_ratio))
    w = None
    if c.tis_cap:
        w = sampler_is_weights(batch.old, batch.sampler, c.tis_cap, loss_mask, c.vllm_importance_sampling_mode)[0]
    loss_t, _, _ = per_token_loss(logp, batch.old, adv, batch.ref if c.beta_ else None, beta=c.beta_,
                                  eps_low=c.eps_low, eps_high=c.eps_high_, is_weights=w, mask=loss_mask,
                                  level=c.importance_sampling_level, delta=c.delta,
                                  use_bias_correction_kl=c.use_bias_correction_kl)
    total = aggregate_loss(loss_t, loss_mask, c.loss_type, c.max_completion_length)
    return loss_t, total


# --- the options both have: each non-default setting, in TRL's names (our config reads them as they are)
SETTINGS = {"bnpo": dict(loss_type="bnpo"), "dr_grpo": dict(loss_type="dr_grpo"), "dapo": dict(loss_type="dapo"),
            "beta": dict(beta=0.04), "bias_kl": dict(beta=0.04, use_bias_correction_kl=True),
            "epsilon": dict(epsilon=0.15), "epsilon_high": dict(epsilon_high=0.28), "delta": dict(delta=3.0),
            "gspo": dict(importance_sampling_level="sequence"), "top_entropy": dict(top_entropy_quantile=0.3),
            "mask_truncated": dict(mask_truncated_completions=True),
            **{m: dict(is_mode=m) for m in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")},
            "batch_scale": dict(scale_rewards="batch"), "no_scale": dict(scale_rewards="none")}
CLASHES = [{"bnpo", "dr_grpo", "dapo"}, {"beta", "bias_kl"}, {"batch_scale", "no_scale"},
           {"token_truncate", "token_mask", "sequence_truncate", "sequence_mask"}]


def combos() -> list:
    "Every setting alone, every pair that can go together, and all at once for each loss type and sampler mode."
    pairs = [p for p in itertools.combinations(SETTINGS, 2) if not any(set(p) <= clash for clash in CLASHES)]
    alls = [("bias_kl", "epsilon", "epsilon_high", "delta", "gspo", "top_entropy", "mask_truncated", lt, m)
            for lt in ("grpo", "bnpo", "dr_grpo", "dapo") for m in ("token_truncate", "sequence_mask")]
    return [()] + [(s,) for s in SETTINGS] + pairs + alls


def options_of(names) -> dict:
    out = {}
    for n in names: out.update(SETTINGS.get(n, dict(loss_type=n)))
    return out


def test_trl_is_the_pinned_version():
    assert trl.__version__ == pinned_trl() == "1.16.0"


def test_trl_defaults_are_what_our_docs_say():
    "12_config, 03_loss and ALGORITHMS.md name TRL's defaults where ours differ; this keeps them true."
    a = TRLConfig(output_dir="unused", use_cpu=True)
    assert (a.loss_type, a.beta, a.use_bias_correction_kl, a.epsilon, a.epsilon_high) == ("dapo", 0.0, True, 0.2, None)
    assert (a.vllm_importance_sampling_mode, a.vllm_importance_sampling_clip_max) == ("sequence_mask", 3.0)
    assert (a.importance_sampling_level, a.delta, a.top_entropy_quantile, a.mask_truncated_completions) == \
        ("token", None, 1.0, False)
    assert a.vllm_importance_sampling_clip_min is None and a.scale_rewards == "group"


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("mask_truncated", [False, True])
def test_advantages_none_rewards_and_the_truncation_mask_equal_trls(model_dir, tokenizer, batch, scale, mask_truncated):
    "TRL's own preparation of the batch: advantages with an unscorable row, and which tokens the loss counts."
    trainer = trl_trainer(model_dir, tokenizer, batch, scale_rewards=scale, mask_truncated_completions=mask_truncated)
    prepared = trl_prepared(trainer)
    c = our_config(scale_rewards=scale, mask_truncated_completions=mask_truncated)
    rewards, advantages, loss_mask = our_step_inputs(batch, c)
    assert rewards[4].isnan() and prepared["advantages"][4] == 0 == advantages[4]        # the unscorable row
    torch.testing.assert_close(advantages, prepared["advantages"], rtol=RTOL, atol=ATOL)
    assert torch.equal(loss_mask, prepared["completion_mask"])
    assert batch.rollout.truncated.tolist() == [True, False, False, False, True, False, False, True]


def test_none_rewards_the_old_way_differ_from_trls_by_this_much(model_dir, tokenizer, batch):
    "on_reward_none=zero (the rule before TRL's) scores the unscorable completion 0: its advantage is no longer 0."
    prepared = trl_prepared(trl_trainer(model_dir, tokenizer, batch))
    _, advantages, _ = our_step_inputs(batch, our_config(on_reward_none="zero"))
    diff = (advantages - prepared["advantages"]).abs()
    assert diff[:G].max() < ATOL                                  # the group with every row scored: the same
    # the second group's rewards [-, 0.1, 0.5, 0]: TRL compares the last three (mean 0.2) and gives the first 0; scored
    # 0 it joins them (mean 0.15, std 0.2380) and gets -0.15 / 0.2380 = -0.630, the others shift by up to 0.336
    assert advantages[4].item() == pytest.approx(-0.630, abs=1e-3)
    assert diff[G + 1:].max() == pytest.approx(0.336, abs=1e-3)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("mask_truncated", [False, True])
def test_importance_sampling_ratios_equal_trls(model_dir, tokenizer, batch, mode, mask_truncated):
    "TRL's four modes of correcting a sampler that is not the learner, at the same cap: `sampler_is_weights`."
    prepared = trl_prepared(trl_trainer(model_dir, tokenizer, batch, is_mode=mode,
                                        mask_truncated_completions=mask_truncated))
    loss_mask = prepared["completion_mask"]
    ours = sampler_is_weights(batch.old, batch.sampler, CAP, loss_mask, mode)[0]
    theirs = prepared["importance_sampling_ratio"].expand_as(ours)
    m = loss_mask.bool()
    torch.testing.assert_close(ours[m], theirs[m], rtol=1e-5, atol=1e-6)
    assert (ours[m] == 0).any() == mode.endswith("mask") and (ours[m] == CAP).any() == mode.endswith("truncate")


def test_the_entropy_selector_equals_trls_top_entropy_quantile(model_dir, tokenizer, batch):
    """`entropy_quantile_mask` against TRL's own `get_high_entropy_mask` (one process): random entropies and masks,
    shares from 0.01 to 0.99, with and without ties (entropies on a grid of 0.25), the same tokens every time."""
    trainer = trl_trainer(model_dir, tokenizer, batch)
    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        H = torch.rand(6, 11, generator=g) * 4
        if trial % 2: H = (H * 4).round() / 4                                      # ties at the threshold
        mask = torch.rand(6, 11, generator=g) < 0.8
        for q in (0.01, 0.1, 0.2, 0.25, 0.3, 1 / 3, 0.5, 0.8, 0.99):
            theirs = trainer.get_high_entropy_mask(H, mask.long(), 1 - q)
            assert torch.equal(entropy_quantile_mask(H, mask, q), theirs), (trial, q)


def test_the_loss_equals_trls_for_every_option_and_pair(model_dir, tokenizer, batch):
    """Loss, per-token loss (on the tokens the loss counts) and gradient, ours against TRL's `_compute_loss` on the
    same log-probs: off-policy ratios from 0.5 to 3.5, some clipped, some past delta, 130 combinations."""
    prepared = {}                 # TRL's preparation depends only on the sampler mode, the truncation mask, the scale
    model = load_model(model_dir)
    failures, cases = [], combos()
    for names in cases:
        options = options_of(names)
        key = (options.get("is_mode"), options.get("mask_truncated_completions", False), options.get("scale_rewards"))
        trainer = trl_trainer(model_dir, tokenizer, batch, model=model, **options)
        if key not in prepared: prepared[key] = trl_prepared(trainer)
        inputs = {**prepared[key], "old_per_token_logps": batch.old, "ref_per_token_logps": batch.ref}
        logp = (batch.old + batch.log_ratio).requires_grad_()
        theirs, seen = trl_loss(trainer, inputs, logp, batch.entropy)
        their_grad, = torch.autograd.grad(theirs, logp)
        c = our_config(**options)
        _, advantages, loss_mask = our_step_inputs(batch, c)
        logp_ours = (batch.old + batch.log_ratio).requires_grad_()
        loss_t, ours = our_loss(batch, c, logp_ours, advantages, loss_mask)
        our_grad, = torch.autograd.grad(ours, logp_ours)
        m = inputs["completion_mask"].bool()
        their_t = seen["per_token_loss"].expand_as(loss_t)
        for what, a, b in (("loss", ours, theirs), ("per-token loss", loss_t[m], their_t[m]), ("gradient", our_grad,
                                                                                                  their_grad)):
            if not torch.allclose(a.detach(), b.detach(), rtol=RTOL, atol=ATOL):
                failures.append(f"{'+'.join(names) or 'defaults'}: {what} differs by "
                                f"{(a.detach() - b.detach()).abs().max().item():.2e}")
    assert len(cases) >= 120 and not failures, "\n".join(failures)


def test_our_defaults_and_trls_optimise_different_objectives_by_this_much(model_dir, tokenizer, batch):
    """Two defaults differ on purpose. The KL: plain k3 (ours) against TRL's bias-corrected k3, off-policy at beta 0.04,
    moves the gradient by a few percent. The sampler correction: our token_truncate at cap 2 against TRL's
    sequence_mask at cap 3 drops whole completions whose product of ratios is above 3, moving the loss by more than
    half."""
    model = load_model(model_dir)
    def loss_and_grad(**options):
        trainer = trl_trainer(model_dir, tokenizer, batch, model=model, **options)
        inputs = {**trl_prepared(trainer), "old_per_token_logps": batch.old, "ref_per_token_logps": batch.ref}
        logp = (batch.old + batch.log_ratio).requires_grad_()
        loss, _ = trl_loss(trainer, inputs, logp, batch.entropy)
        return loss.item(), torch.autograd.grad(loss, logp)[0]
    _, plain = loss_and_grad(beta=0.04)
    _, corrected = loss_and_grad(beta=0.04, use_bias_correction_kl=True)
    kl_shift = ((plain - corrected).norm() / corrected.norm()).item()
    assert 1e-3 < kl_shift < 0.2
    ours, _ = loss_and_grad(is_mode="token_truncate")
    theirs, _ = loss_and_grad(is_mode="sequence_mask", vllm_importance_sampling_clip_max=3.0)
    assert abs(ours - theirs) / abs(theirs) > 0.5


def rows_in_order(batch, completion_ids: torch.Tensor) -> list:
    "The batch's row of each of TRL's (shuffled) rows, found by its completion."
    ours = [tuple(r) for r in batch.rollout.completion_ids.tolist()]
    return [ours.index(tuple(r)) for r in completion_ids.tolist()]


def one_trl_step(model_dir, tok, batch, lr, **options):
    """One batch through TRL's own `train()`: two micro-batches of 4 rows, one optimizer step per iteration
    (`num_iterations`, the later ones off-policy); the weights before and after, and its order of the rows."""
    model = load_model(model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    trainer = trl_trainer(model_dir, tok, batch, model=model, per_device_train_batch_size=B * G // 2,
                          gradient_accumulation_steps=2, max_steps=options.get("num_iterations", 1), max_grad_norm=0.0,
                          **options)
    trainer.optimizer, trainer.lr_scheduler = opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    trainer.train()
    order = [rows_in_order(batch, mb["completion_ids"]) for mb in trainer._buffered_inputs]
    return before, {n: p.detach() for n, p in model.named_parameters()}, order


def one_update_of_ours(model_dir, batch, order, lr, **options):
    "One `step.update` of ours on the rows in TRL's order, in micro-batches of TRL's size."
    rows = torch.tensor([r for mb in order for r in mb])
    ro = batch.rollout
    shuffled = Rollout([ro.prompts[i] for i in rows], [ro.completions[i] for i in rows], ro.prompt_ids[rows],
                       ro.prompt_mask[rows], ro.completion_ids[rows], ro.completion_mask[rows], 0, ro.group_ids[rows],
                       batch.sampler[rows], ro.truncated[rows])
    c = our_config(micro_batch_size=len(order[0]), max_grad_norm=0.0, learning_rate=lr, autocast_bf16=False,
                   **options)
    _, advantages, _ = our_step_inputs(batch, c)
    model, ref = load_model(model_dir), load_model(model_dir) if c.beta_ else None
    update(model, torch.optim.SGD(model.parameters(), lr=lr), shuffled, advantages[rows], c, ref_model=ref)
    return {n: p.detach() for n, p in model.named_parameters()}


# two iterations where the objective differs off-policy only: the second step's ratios are not 1, its KL not 0
UPDATES = {"grpo": dict(beta=0.04), "bnpo": dict(loss_type="bnpo", beta=0.04),
           "dapo": dict(loss_type="dapo", epsilon_high=0.28, num_iterations=2), "dr_grpo": dict(loss_type="dr_grpo"),
           "gspo_and_more": dict(importance_sampling_level="sequence", beta=0.04, use_bias_correction_kl=True,
                                 mask_truncated_completions=True, delta=3.0, num_iterations=2),
           "sampler": dict(loss_type="bnpo", is_mode="sequence_truncate")}


@pytest.mark.parametrize("name", list(UPDATES))
def test_one_update_with_gradient_accumulation_equals_trls(model_dir, tokenizer, batch, name):
    """TRL's `train()` on one batch in two micro-batches (gradient accumulation 2) against our `update` with TRL's
    micro-batches: the same weights after the SGD steps (one per iteration). bnpo normalises each micro-batch by its own
    tokens, so this checks its per-micro-batch count; the model's own forward passes on both sides (ours with its
    speed-ups); with two iterations the second is off-policy, where the ratio's level, delta and the KL's form
    matter."""
    lr = 1.0
    before, theirs, order = one_trl_step(model_dir, tokenizer, batch, lr, **UPDATES[name])
    ours = one_update_of_ours(model_dir, batch, order, lr, **UPDATES[name])
    moved = max((theirs[n] - before[n]).abs().max().item() for n in before)
    assert moved > 1e-4                                                         # the step did move the weights
    for n in before:
        torch.testing.assert_close(ours[n] - before[n], theirs[n] - before[n], rtol=1e-3, atol=2e-6 * moved, msg=n)


def test_top_entropy_quantile_over_the_batch_differs_from_trls_per_micro_batch(model_dir, tokenizer, batch):
    """TRL takes the entropy quantile of each micro-batch; we take it over the whole batch, so that the tokens kept do
    not depend on how the batch is split. With the batch in one micro-batch the two updates are equal; in two they
    differ, here by this much."""
    lr, options = 1.0, dict(top_entropy_quantile=0.3)
    before, theirs, order = one_trl_step(model_dir, tokenizer, batch, lr, **options)
    ours = one_update_of_ours(model_dir, batch, order, lr, **options)
    delta = lambda w: torch.cat([(w[n] - before[n]).flatten() for n in before])
    gap = ((delta(ours) - delta(theirs)).norm() / delta(theirs).norm()).item()
    assert 0.01 < gap < 1.0
    whole = one_update_of_ours(model_dir, batch, [sum(order, [])], lr, **options)     # one micro-batch of 8 rows
    torch.testing.assert_close(delta(whole), delta(ours), rtol=1e-4, atol=1e-7)       # ours: the split does not matter
