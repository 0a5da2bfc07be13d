"""Token selection (GMTS and its baselines): ALGORITHMS.md section 5, the clip indicator, the KL term, exact counts,
masking."""
import pytest, torch
from mmrgrpo.loss import aggregate_loss, per_token_loss
from mmrgrpo.tokens import (gmts_scores, kept_tokens, logit_grad_scores, mask_advantages, policy_grad_coef,
                            select_tokens, token_scores)

# the small example: one group of two completions, the second with 2 tokens + 1 padding position
H = torch.tensor([[0.5, 2.0, 0.1], [1.0, 0.2, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()
LP = torch.full((2, 3), -1.0)
A = torch.tensor([1., -1])


def test_small_example():
    s = gmts_scores(H, LP, LP, None, A)
    assert torch.allclose(s[MASK], torch.tensor([0.5, 2.0, 0.1, 1.0, 0.2]), atol=1e-6)
    keep = select_tokens(s, MASK, 2, keep_ratio=0.4)
    assert keep.tolist() == [[False, True, False], [True, False, False]]
    assert mask_advantages(A, keep).tolist() == [[0., 1, 0], [-1, 0, 0]]


def test_clip_indicator():
    lp = torch.log(torch.tensor([[1.0, 1.3, 0.7]]))  # ratios 1, 1.3, 0.7 against logp_old = 0
    old, H1 = torch.zeros(1, 3), torch.ones(1, 3)
    # r > 1 + eps_high with A > 0: no gradient; r < 1 - eps_low with A > 0 still has one
    assert torch.allclose(gmts_scores(H1, lp, old, None, torch.tensor([2.])), torch.tensor([[2., 0, 1.4]]), atol=1e-6)
    # r < 1 - eps_low with A < 0: no gradient; r > 1 + eps_high with A < 0 still has one
    assert torch.allclose(gmts_scores(H1, lp, old, None, torch.tensor([-2.])), torch.tensor([[2., 2.6, 0]]), atol=1e-6)
    # a wider clip range clips nothing
    assert torch.allclose(gmts_scores(H1, lp, old, None, torch.tensor([-2.]), eps_low=0.5, eps_high=0.5),
                          torch.tensor([[2., 2.6, 1.4]]), atol=1e-6)


def test_beta_term():
    lp, old = torch.log(torch.tensor([[1.0, 0.7]])), torch.zeros(1, 2)
    ref = torch.log(torch.tensor([[2.0, 0.35]]))        # exp(ref - logp) = 2, 0.5
    c = policy_grad_coef(lp, old, torch.tensor([1.]), ref, beta=0.1)
    assert torch.allclose(c, torch.tensor([[1.0 + 0.1, 0.7 - 0.05]]), atol=1e-6)
    s = gmts_scores(torch.tensor([[2., 3.]]), lp, old, ref, torch.tensor([0.]), beta=0.1)
    assert torch.allclose(s, torch.tensor([[0.2, 0.15]]), atol=1e-6)
    assert torch.equal(gmts_scores(H, LP, LP, None, A, beta=0.0), gmts_scores(H, LP, LP, LP + 1, A, beta=0.0))
    with pytest.raises(ValueError, match="needs logp_ref"):
        gmts_scores(H, LP, LP, None, A, beta=0.04)


def test_scores_are_detached():
    lp = LP.clone().requires_grad_()
    assert not gmts_scores(H.clone().requires_grad_(), lp, lp, None, A.clone().requires_grad_()).requires_grad
    assert not logit_grad_scores(H, lp, lp, None, A).requires_grad


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_logit_grad_is_the_gradient_norm_wrt_the_logits(beta):
    g = torch.Generator().manual_seed(0)
    N, T, V = 4, 5, 11
    z = torch.randn(N, T, V, generator=g, dtype=torch.double, requires_grad=True)
    y = torch.randint(0, V, (N, T), generator=g)
    lp = z.log_softmax(-1).gather(-1, y[..., None]).squeeze(-1)
    old = lp.detach() + 0.3 * torch.randn(N, T, generator=g, dtype=torch.double)   # off-policy: some tokens clipped
    ref = torch.randn(N, T, generator=g, dtype=torch.double) - 2
    adv = torch.tensor([1.5, -0.7, 0.4, -2.0], dtype=torch.double)
    loss, clipped, _ = per_token_loss(lp, old, adv, ref, beta=beta)
    assert clipped.any()
    loss.sum().backward()
    lsq = (2 * z.detach()).logsumexp(-1) - 2 * z.detach().logsumexp(-1)
    got = logit_grad_scores(lsq, lp, old, ref, adv, beta=beta).double()
    assert torch.allclose(got, z.grad.norm(dim=-1), atol=1e-5)
    # and |c| is the gradient w.r.t. the log-prob itself
    lp2 = lp.detach().requires_grad_()
    per_token_loss(lp2, old, adv, ref, beta=beta)[0].sum().backward()
    assert torch.allclose(policy_grad_coef(lp2, old, adv, ref, beta=beta).double(), -lp2.grad, atol=1e-5)


def test_token_scores_dispatch():
    assert torch.equal(token_scores("gmts", H, LP, LP, A), gmts_scores(H, LP, LP, None, A))
    assert torch.equal(token_scores("entropy", H, LP, LP, A), H)
    lsq = torch.full((2, 3), -0.5)
    assert torch.equal(token_scores("logit_grad", H, LP, LP, A, log_sumsq=lsq), logit_grad_scores(lsq, LP, LP, None, A))
    with pytest.raises(ValueError, match="needs log_sumsq"):
        token_scores("logit_grad", H, LP, LP, A)
    with pytest.raises(ValueError, match="selector='random'"):
        token_scores("random", H, LP, LP, A)


@pytest.mark.parametrize("n,ratio,k", [(5, 0.4, 2), (5, 0.2, 1), (7, 0.2, 2), (3, 0.2, 1), (10, 0.2, 2), (0, 0.2, 0),
                                       (100, 0.3, 30), (50, 0.3, 15), (1000, 0.15, 150), (37, 1.0, 37)])
def test_kept_tokens_is_exact_ceil(n, ratio, k):
    assert kept_tokens(torch.tensor([n]), ratio).item() == k


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, 2])
def test_keep_ratio_out_of_range(bad):
    with pytest.raises(ValueError, match=f"keep_ratio={bad}"):
        select_tokens(H, MASK, 2, keep_ratio=bad)


def test_never_padding_never_zero_score():
    s = gmts_scores(H, LP, LP, None, A)
    big_padding = s + 100 * ~MASK
    for r in (0.2, 0.4, 0.9):
        assert not (select_tokens(big_padding, MASK, 2, keep_ratio=r) & ~MASK).any()
    assert select_tokens(big_padding, MASK, 2, keep_ratio=0.9).sum() == 5      # ceil(4.5), all valid
    zeros = torch.tensor([[0., 0, 2], [3, 0, 9]])                              # the 9 is padding
    keep = select_tokens(zeros, MASK, 2, keep_ratio=0.8)                        # k = 4 but only 2 valid non-zero scores
    assert keep.tolist() == [[False, False, True], [True, False, False]]
    g = torch.Generator().manual_seed(0)
    sc, m = torch.rand(16, 9, generator=g), torch.rand(16, 9, generator=g) < 0.6
    for scope in ("group", "batch"):
        assert not (select_tokens(sc, m, 4, 0.3, scope=scope) & ~m).any()


def test_keep_ratio_one_is_the_plain_loss():
    zero_entropy = H.clone(); zero_entropy[0, 2] = 0                       # a certain token with a non-zero advantage
    keep = select_tokens(gmts_scores(zero_entropy, LP, LP, None, A), MASK, 2, keep_ratio=1.0)
    assert torch.equal(keep, MASK)
    g = torch.Generator().manual_seed(1)
    N, T = 8, 6
    mask = torch.rand(N, T, generator=g) < 0.7
    adv, old = torch.randn(N, generator=g), -torch.rand(N, T, generator=g)
    lp = (old + 0.1 * torch.randn(N, T, generator=g)).requires_grad_()
    A_tok = mask_advantages(adv, select_tokens(torch.rand(N, T, generator=g), mask, 4, keep_ratio=1.0))
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        plain = aggregate_loss(per_token_loss(lp, old, adv)[0], mask, loss_type)
        selected = aggregate_loss(per_token_loss(lp, old, A_tok)[0], mask, loss_type)
        assert torch.equal(plain, selected)
        assert torch.equal(torch.autograd.grad(plain, lp)[0], torch.autograd.grad(selected, lp)[0])


def test_groups_are_ranked_separately_unless_batch_scope():
    s = gmts_scores(H, LP, LP, None, A)
    two_s, two_m = torch.cat([s, s / 10]), torch.cat([MASK, MASK])
    keep = select_tokens(s, MASK, 2, keep_ratio=0.3)
    assert torch.equal(select_tokens(two_s, two_m, 2, keep_ratio=0.3), torch.cat([keep, keep]))
    batch = select_tokens(two_s, two_m, 2, keep_ratio=0.3, scope="batch")            # top 3 of 10: 2.0, 1.0, 0.5
    assert batch.tolist() == [[True, True, False], [True, False, False], [False] * 3, [False] * 3]
    with pytest.raises(ValueError, match="cannot be split into groups of 2"):
        select_tokens(torch.ones(3, 2), torch.ones(3, 2), 2)


@pytest.mark.parametrize("seed", range(3))
def test_vectorised_selection_matches_a_per_group_reference(seed):
    g = torch.Generator().manual_seed(seed)
    B, G, T, ratio = 3, 4, 7, 0.25
    scores = torch.randint(0, 4, (B * G, T), generator=g).float()           # many ties and zeros
    mask = torch.rand(B * G, T, generator=g) < 0.7
    keep = select_tokens(scores, mask, G, ratio)
    for b in range(B):                                                       # slow, obvious reference
        s, m = scores[b * G:(b + 1) * G].flatten(), mask[b * G:(b + 1) * G].flatten()
        valid = [i for i in range(len(s)) if m[i]]
        k = -(-len(valid) // 4)                                              # ceil(n / 4)
        top = sorted(valid, key=lambda i: (-s[i].item(), i))[:k]
        want = torch.zeros(len(s), dtype=torch.bool)
        want[[i for i in top if s[i] != 0]] = True
        assert torch.equal(keep[b * G:(b + 1) * G].flatten(), want)
    assert torch.equal(keep, select_tokens(scores, mask, G, ratio))


def test_mask_advantages_per_token_input():
    keep = torch.tensor([[False, True, False], [True, False, False]])
    assert mask_advantages(torch.tensor([[1., 2, 3], [4, 5, 6]]), keep).tolist() == [[0., 2, 0], [4, 0, 0]]
    assert mask_advantages(A.double(), keep).dtype == torch.double


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    g = torch.Generator().manual_seed(0)
    N, T = 16, 9
    H2, lp, adv = torch.rand(N, T, generator=g), -torch.rand(N, T, generator=g), torch.randn(N, generator=g)
    m = torch.rand(N, T, generator=g) < 0.7
    s = gmts_scores(H2, lp, lp, None, adv)
    for scope in ("group", "batch"):
        keep = select_tokens(gmts_scores(H2.cuda(), lp.cuda(), lp.cuda(), None, adv.cuda()), m.cuda(), 4, 0.3, scope)
        assert keep.is_cuda and torch.equal(keep.cpu(), select_tokens(s, m, 4, 0.3, scope))
        assert torch.equal(mask_advantages(adv.cuda(), keep).cpu(), mask_advantages(adv, keep.cpu()))
