"""The three methods switched on together, with every option: batch-scope pruning, ties, iterations, loss weights,
counts."""
import copy, warnings
import pytest, torch
from mmrgrpo.config import ConfigError, load_config
from mmrgrpo.logprobs import completion_stats
from mmrgrpo.mmr import embed_completions, load_embedder, mmr_reweight_groups, dra_reweight
from mmrgrpo.models import tiny_random_model
from mmrgrpo.sampling import Rollout
from mmrgrpo import step as trainer     # the step's functions, patched where the update looks them up
from mmrgrpo.step import advantages_for, prune, update, choose_tokens

VOCAB = 200


class _Vocab:
    "Just what `tiny_random_model` reads from a tokenizer."
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0
    def __len__(self): return VOCAB


def _model(seed=0):
    m = tiny_random_model(_Vocab(), seed=seed)
    return m.float()


def _config(tmp_path, **kw):
    base = dict(model="tiny-random", num_generations=4, prompts_per_step=2, max_completion_length=6, eval_size=0,
                beta=0.0, lora=False, max_grad_norm=0.0, output_dir=str(tmp_path), log_completions_every=0,
                autocast_bf16=False)  # exact float32 comparisons: no bf16 autocast, even where the CPU runs it fast
    return load_config(**{**base, **kw})


def _rollout(G=4, B=2, T=6, seed=0, texts=None):
    """B groups of G completions; the prompts differ in length (left padding) so a row scored on another group's prompt
    shows."""
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 4][:B]
    P = max(lengths)
    p_ids, p_mask = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, P, dtype=torch.long)
    for b, n in enumerate(lengths):
        p_ids[b, P - n:] = torch.randint(3, VOCAB, (n,), generator=g); p_mask[b, P - n:] = 1
    N = B * G
    c_ids = torch.randint(3, VOCAB, (N, T), generator=g)
    c_mask = torch.ones(N, T, dtype=torch.long); c_mask[1, 3:] = 0
    if B > 1: c_mask[G + 2, 2:] = 0
    texts = texts or [f"completion {i}" for i in range(N)]
    return Rollout([f"prompt {i // G}" for i in range(N)], texts, p_ids.repeat_interleave(G, 0),
                   p_mask.repeat_interleave(G, 0), c_ids, c_mask, G)


class _Recording:
    "An optimizer wrapper that records the gradients of every step before taking it."
    def __init__(self, opt, model): self.opt, self.model, self.grads = opt, model, []
    def zero_grad(self, set_to_none=True): self.opt.zero_grad(set_to_none=set_to_none)
    def step(self):
        self.grads.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None})
        self.opt.step()


def _run_update(c, model, rollout, adv, lr=0.0):
    opt = _Recording(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr), model)
    metrics = update(model, opt, rollout, adv, c)
    return opt.grads, metrics


def _assert_same_grads(a, b, atol=1e-6):
    assert len(a) == len(b)
    for ga, gb in zip(a, b):
        assert ga.keys() == gb.keys()
        for n in ga: torch.testing.assert_close(ga[n], gb[n], atol=atol, rtol=1e-4, msg=n)


# --- finding 1: batch-scope pruning leaves groups of different sizes

def test_batch_scope_pruning_follows_group_ids(tmp_path):
    rollout = _rollout()
    rewards = torch.tensor([1., 0, 0, 0, 1, 0, 1, 0])     # |A|: group 0 [1.5, .5, .5, .5], group 1 [.87] * 4
    c = _config(tmp_path, prune_rate=0.375, prune_scope="batch", token_selection="gmts", keep_ratio=0.5)
    adv, _ = advantages_for(rewards, rollout, c)
    kept, kept_adv, _ = prune(rollout, adv, c)
    assert kept.group_ids.tolist() == [0, 1, 1, 1, 1]            # 1 + 4 rows: no uniform group size
    assert kept.group_size == 0
    # log-probs with the prompt shared per group equal those of every row running its own prompt
    model = _model()
    shared = completion_stats(model, kept.prompt_ids, kept.prompt_mask, kept.completion_ids, kept.completion_mask,
                              group_size=kept.group_ids)[0]
    own = completion_stats(model, kept.prompt_ids, kept.prompt_mask, kept.completion_ids, kept.completion_mask)[0]
    m = kept.completion_mask.bool()
    torch.testing.assert_close(shared[m], own[m], atol=1e-5, rtol=1e-5)
    # and so do the gradients of a whole update (it crashed before: "5 values cannot be split into groups of 2")
    grads = {}
    for share in (True, False):
        cs = _config(tmp_path, prune_rate=0.375, prune_scope="batch", token_selection="gmts", keep_ratio=0.5,
                     share_prompt=share)
        grads[share], _ = _run_update(cs, _model(), kept, kept_adv)
    _assert_same_grads(grads[True], grads[False])


def test_batch_scope_micro_batch_rule_counts_the_kept_rows(tmp_path):
    # 2 x 4 rows, floor(0.375 * 8) = 3 pruned: 5 kept rows per step, so micro batches of 5 fit and of 2 do not
    _config(tmp_path, prune_rate=0.375, prune_scope="batch", micro_batch_size=5)
    with pytest.raises(ConfigError, match="does not divide the 5 completions"):
        _config(tmp_path, prune_rate=0.375, prune_scope="batch", micro_batch_size=2)


# --- finding 2: ties and duplicates

class _FakeEmbedder:
    "Embeds a text by a fixed random vector per distinct text (identical texts get identical embeddings)."
    tokenizer = None
    def encode(self, texts, **kw):
        return torch.stack([torch.randn(16, generator=torch.Generator().manual_seed(hash(t) % 2**31)) for t in texts])


def test_identical_completions_never_update_with_all_three_methods_on(tmp_path):
    model = _model()
    base = _rollout(B=1)
    same = Rollout(base.prompts, ["the same wrong answer"] * 4, base.prompt_ids, base.prompt_mask,
                   base.completion_ids[:1].repeat(4, 1), torch.ones(4, 6, dtype=torch.long), 4)
    rewards = torch.zeros(4)
    for scope in ("group", "batch"):
        c = _config(tmp_path, prompts_per_step=1, mmr=True, prune_rate=0.75, prune_scope=scope, token_selection="gmts",
                    temperature=1.0, beta=0.0)
        adv, metrics = advantages_for(rewards, same, c, _FakeEmbedder())
        # before: the first pick got +1.5, the rest -0.5
        assert torch.equal(adv, torch.zeros(4)), adv
        kept, kept_adv, _ = prune(same, adv, c)
        grads, _ = _run_update(c, model, kept, kept_adv)
        assert all(float(g.abs().max()) == 0.0 for g in grads[0].values())


def test_mmr_tie_goes_to_the_most_distinct_completion_whatever_its_row():
    from mmrgrpo.mmr import mmr_greedy, similarity_matrix
    rewards = torch.zeros(4)
    E = torch.tensor([[1., 0, 0], [0.9, 0.1, 0], [0, 1, 0], [0.7, 0.7, 0.1]])   # row 2 is the least similar to the rest
    _, order = mmr_greedy(rewards[None], similarity_matrix(E, 4), torch.tensor([0.5]))
    assert order[0, 0] == 2                                              # the first pick: the most distinct completion
    out, _ = mmr_reweight_groups(rewards, E, 4)
    perms = ([3, 2, 1, 0], [2, 0, 3, 1], [1, 3, 0, 2])
    for perm in perms:                                                   # permuting the rows permutes the outputs
        p = torch.tensor(perm)
        torch.testing.assert_close(mmr_reweight_groups(rewards, E[p], 4)[0], out[p])
    idx, _ = mmr_reweight_groups(rewards, E, 4, tie_break="index")       # the reference code's rule: row 0 first
    _, order = mmr_greedy(rewards[None], similarity_matrix(E, 4), torch.tensor([0.5]), tie_break="index")
    assert order[0, 0] == 0
    assert any(not torch.equal(mmr_reweight_groups(rewards, E[torch.tensor(p)], 4, tie_break="index")[0],
                               idx[torch.tensor(p)])
               for p in perms)                                           # ... which depends on the row order


def test_duplicates_share_one_reweighted_reward(tmp_path):
    texts = ["a", "b", "a", "c"] + ["x", "y", "z", "x"]
    rollout = _rollout(texts=texts)
    rewards = torch.tensor([1., 0, 1, 0, 1, 1, 0, 1])
    c = _config(tmp_path, mmr=True)
    adv, _ = advantages_for(rewards, rollout, c, _FakeEmbedder())
    assert adv[0] == adv[2] and adv[4] == adv[7]


# --- finding 3: token selection re-scores every iteration, whatever the micro-batch size

def test_gmts_with_iterations_does_not_depend_on_micro_batches(tmp_path, monkeypatch):
    rollout = _rollout()
    adv = torch.tensor([1.2, -0.4, 0.3, -1.1, 0.9, -0.2, 0.6, -1.3])
    chosen = {}
    real = trainer.choose_tokens
    def recording(c, stats, *a, **k):
        keep = real(c, stats, *a, **k)
        chosen.setdefault(c.micro_batch_size, []).append(keep.clone()); return keep
    monkeypatch.setattr(trainer, "choose_tokens", recording)
    grads = {}
    for mb in (2, 4):            # 2 splits every group (a scoring pass), 4 holds whole groups (scored in the loss pass)
        c = _config(tmp_path, token_selection="gmts", keep_ratio=0.3, num_iterations=2, micro_batch_size=mb)
        m = _model()
        # SGD, not AdamW: the two splits sum the same gradient in another order, and Adam's first step (g / |g|) turns
        # rounding in near-zero gradients into full-size steps of either sign, which the second iteration then
        # differs by
        opt = torch.optim.SGD(list(m.parameters()), lr=1.0)
        rec = _Recording(opt, m)
        update(m, rec, rollout, adv, c)
        grads[mb] = rec.grads
    _assert_same_grads(grads[2], grads[4], atol=1e-5)
    per_iteration = {mb: [torch.cat(keeps[i * len(keeps) // 2:(i + 1) * len(keeps) // 2]) for i in range(2)]
                     for mb, keeps in chosen.items()}
    for i in range(2): assert torch.equal(per_iteration[2][i], per_iteration[4][i]), i
    assert not torch.equal(per_iteration[4][0], per_iteration[4][1])     # the second iteration really chose anew


# --- finding 4: the GMTS score carries the loss weight of each token

def test_gmts_score_uses_the_loss_weight(tmp_path):
    # ALGORITHMS.md's example: lengths 1 and 4, entropies [1.0] and [0.5, 0.5, 0.5, 2.0], A = [+1, -1],
    # keep 1 of 5 tokens
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])
    ent = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0.5, 2.0]])
    lp = torch.zeros(2, 4)
    adv = torch.tensor([1., -1.])
    keep = {}
    for loss_type in ("grpo", "dapo"):
        c = _config(tmp_path, num_generations=2, prompts_per_step=1, token_selection="gmts", keep_ratio=0.2,
                    loss_type=loss_type)
        keep[loss_type] = choose_tokens(c, (lp, ent, None), None, None, adv, mask, torch.zeros(2, dtype=torch.long))
    assert keep["dapo"].nonzero().tolist() == [[1, 3]]             # unweighted: the score 2.0 wins
    assert keep["grpo"].nonzero().tolist() == [[0, 0]]             # 1/|o|: 1.0 against 2.0 / 4


# --- finding 5: Dr. GRPO removes the std

def test_dr_grpo_does_not_divide_by_the_std(tmp_path):
    rewards = torch.tensor([3., 0, 2.5, 1])
    c = _config(tmp_path, loss_type="dr_grpo", num_generations=4, prompts_per_step=1)
    assert c.scale_rewards_ == "none"
    adv, _ = advantages_for(rewards, _rollout(B=1), c)
    torch.testing.assert_close(adv, rewards - rewards.mean())
    # unless the user says
    assert _config(tmp_path, loss_type="dr_grpo", scale_rewards="group").scale_rewards_ == "group"
    assert _config(tmp_path).scale_rewards_ == "group"


# --- finding 6: counts

def test_a_rate_that_prunes_nothing_is_warned_about(tmp_path):
    with pytest.warns(UserWarning, match="prunes nothing"):
        _config(tmp_path, prune_rate=0.2)                       # floor(0.2 * 4) = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _config(tmp_path, prune_rate=0.25)                      # floor(1.0) = 1
        _config(tmp_path, prune_rate=0.2, prune_scope="batch")  # floor(0.2 * 8) = 1


def test_a_keep_ratio_that_keeps_no_token_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="keep_ratio=1e-08: keeps no token"):
        _config(tmp_path, token_selection="gmts", keep_ratio=1e-8)


# --- finding 7: clip_ratio counts the tokens that carry advantage

def test_clip_ratio_is_over_selected_tokens(tmp_path, monkeypatch):
    real = trainer.per_token_loss
    def all_carrying_clipped(logp, old, adv, *a, **k):       # pretend every token with advantage is clipped
        loss, _, kl = real(logp, old, adv, *a, **k)
        A = adv if adv.dim() == 2 else adv[:, None].expand_as(logp)
        return loss, A != 0, kl
    monkeypatch.setattr(trainer, "per_token_loss", all_carrying_clipped)
    c = _config(tmp_path, token_selection="gmts", keep_ratio=0.2)
    _, metrics = _run_update(c, _model(), _rollout(), torch.tensor([1.2, -0.4, 0.3, -1.1, 0.9, -0.2, 0.6, -1.3]))
    assert metrics["clip_ratio"] == 1.0 and metrics["tokens/kept_fraction"] < 0.5


# --- finding 8: long completions are embedded from their end

def test_long_completions_are_embedded_from_the_end():
    embedder = load_embedder(device="cpu")
    body = " ".join(f"step {i}: add {i} and {i + 1}." for i in range(100))
    texts = [body + " So the answer is 17.", body + " So the answer is 42.", "short"]
    emb, n_long = embed_completions(texts, embedder, return_truncated=True)
    assert n_long == 2
    assert float(emb[0] @ emb[1]) < 0.999                  # before: 0.9999999, the answers were cut off


# --- options the papers have

def test_dra_is_reachable_from_the_config(tmp_path):
    rollout, rewards = _rollout(), torch.tensor([1., 0, 1, 0, 1, 1, 0, 1])
    c = _config(tmp_path, reweight="dra")
    adv, metrics = advantages_for(rewards, rollout, c, _FakeEmbedder())
    emb = embed_completions(rollout.completions, _FakeEmbedder())
    from mmrgrpo.advantages import group_advantages
    torch.testing.assert_close(adv, group_advantages(dra_reweight(rewards, emb, 4), 4))
    assert "reward_dra" in metrics
    with pytest.raises(ConfigError, match="contradict"):
        _config(tmp_path, mmr=True, reweight="dra")


def test_inverse_selection_keeps_the_lowest_scores():
    from mmrgrpo.tokens import select_tokens
    s = torch.tensor([[0.5, 2.0, 0.1], [1.0, 0.2, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert select_tokens(s, m, 2, 0.4).nonzero().tolist() == [[0, 1], [1, 0]]
    assert select_tokens(s, m, 2, 0.4, inverse=True).nonzero().tolist() == [[0, 2], [1, 1]]


# --- issue 45 item 22: share_prompt changes the update's arithmetic order, not its gradients

@pytest.mark.parametrize("methods", [{}, dict(prune_rate=0.25, token_selection="gmts", keep_ratio=0.5),
                                     dict(prune_rate=0.375, prune_scope="batch", token_selection="gmts",
                                          keep_ratio=0.5)])
def test_share_prompt_gives_the_same_lora_gradients(methods, tmp_path):
    """After one step with AdamW the adapters of share_prompt=true and false differed by 2.6e-4 (plain) to 4.2e-3 (batch
    pruning, GMTS). Their gradients differ by at most 6e-7 of the largest (measured): fp32 sums taken in another order.
    Adam's first step is lr * g / (|g| + eps), so an element whose gradient is ~1e-7 moves by a share of lr that that
    rounding changes; that, not the update, is the difference. Tolerance 1e-5 of the largest gradient: ten times fp32's
    rounding over the few hundred terms of a sum here; a row scored on the wrong prompt, or a token kept by one and not
    the other, differs by 1e-2 or more."""
    from mmrgrpo.models import add_lora
    rollout, rewards, grads = _rollout(), torch.tensor([1., 0, 0, 0, 1, 0, 1, 0]), {}
    for share in (True, False):
        c = _config(tmp_path, lora=True, lora_r=8, share_prompt=share, sampler_dtype="float32", **methods)
        torch.manual_seed(0)
        model = add_lora(_model(), c)
        with torch.no_grad():          # a non-zero adapter B: every adapter weight has a gradient
            for n, p in model.named_parameters():
                if "lora_B" in n: p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
        adv, _ = advantages_for(rewards, rollout, c)
        kept, kept_adv, _ = prune(rollout, adv, c)
        grads[share] = _run_update(c, model, kept, kept_adv)[0][0]
    scale = max(g.abs().max() for g in grads[False].values())
    assert grads[True].keys() == grads[False].keys() and scale > 0.01
    for n in grads[False]:
        assert (grads[True][n] - grads[False][n]).abs().max() / scale < 1e-5, n
