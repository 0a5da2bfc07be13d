"Completion pruning (CPPO): exact counts, the examples of ALGORITHMS.md section 4, ties and the batch scope."
from fractions import Fraction

import pytest, torch
from mmrgrpo.advantages import group_advantages, group_view
import math
from mmrgrpo.pruning import allocated_prompts, exact_rate, keep_mask, kept_count, pruned_count

A = group_advantages(torch.tensor([3, 0, 2.5, 1]), 4)  # [0.998553, -1.180108, 0.635443, -0.453888]


def test_examples():
    assert keep_mask(A, 4, 0.5).tolist() == [True, True, False, False]
    assert keep_mask(A, 4, 0.75).tolist() == [False, True, False, False]
    assert keep_mask(A, 4, 0).all()


def test_two_groups_batch_scope():
    A2 = group_advantages(torch.tensor([3., 3, 3, 3, 3, 0, 2.5, 1]), 4)
    assert keep_mask(A2, 4, 0.5, scope="batch").tolist() == [False] * 4 + [True] * 4
    assert keep_mask(A2, 4, 0.5).tolist() == [True, True, False, False] * 2
    with pytest.raises(ValueError, match="scope='prompt'"):
        keep_mask(A2, 4, 0.5, scope="prompt")


@pytest.mark.parametrize("G,P,k", [
    (16, 0, 16), (16, 0.5, 8), (16, 0.75, 4), (16, 0.875, 2), (16, 0.9375, 1),
    (16, 0.7, 5),     # floor(11.2) = 11 pruned; float int(16 * 0.3...) would keep 4
    (10, 0.8, 2),     # floor(8) exactly, though 10 * 0.8 is 8.000000000000002 in floats
    (10, 0.9, 1),
    (8, 0.3, 6),      # floor(2.4) = 2 pruned
    (16, 0.9, 2),     # floor(14.4) = 14 pruned
    (6, 0.25, 5),     # floor(1.5) = 1 pruned: never more than asked (half-to-even rounding kept 4, i.e. pruned 33%)
    (10, 0.25, 8),    # floor(2.5) = 2 pruned
    (16, Fraction(11, 16), 5),
    (4, 0.875, 1), (1, 0.5, 1), (8, 0.95, 1), (4, 0.2, 4),   # P < 1 always keeps at least one; 0.2 of 4 prunes nothing
])
def test_kept_count(G, P, k):
    assert kept_count(G, P) == k


def test_exact_rate_reads_the_decimal():
    assert exact_rate(0.7) == Fraction(7, 10)
    assert exact_rate(0.875) == Fraction(7, 8)
    assert exact_rate(Fraction(1, 3)) == Fraction(1, 3)


def test_never_prunes_more_than_asked():
    for n in range(1, 40):
        for P in (0.1, 0.25, 1 / 3, 0.5, 0.6, 0.7, 0.75, 0.875, 0.9, 0.99):
            d = pruned_count(n, P)
            assert d <= exact_rate(P) * n < d + 1 and 1 <= n - d
    # floor(3)
    assert keep_mask(torch.tensor([0., 1, 0, 0]), 2, 0.75, scope="batch").tolist() == [False, True, False, False]
    # floor(3.6)
    assert keep_mask(torch.randn(4), 2, 0.9, scope="batch").sum() == 1


@pytest.mark.parametrize("P", [1.0, 1.5, -0.1])
def test_prune_rate_out_of_range(P):
    with pytest.raises(ValueError, match=r"prune_rate=.*\[0, 1\)"):
        kept_count(8, P)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        allocated_prompts(8, P)


def test_allocated_prompts():
    assert [allocated_prompts(4, P) for P in (0, 0.5, 0.75, 0.875)] == [4, 8, 16, 32]
    assert allocated_prompts(3, 0.7) == 10
    assert allocated_prompts(5, 0.6) == 12  # 12.5 -> even
    with pytest.raises(ValueError, match="num_prompts=0"):
        allocated_prompts(0, 0.5)


def test_ties_go_to_the_lowest_index_and_are_deterministic():
    adv = torch.tensor([0.5, -0.5, 0.5, -0.5, 0, 0])
    assert keep_mask(adv, 6, 0.5).tolist() == [True, True, True, False, False, False]
    assert keep_mask(torch.zeros(8), 8, 0.75).tolist() == [True, True] + [False] * 6
    big = torch.randint(-2, 3, (64 * 16,)).float()  # many ties
    m = keep_mask(big, 16, 0.625)
    assert torch.equal(m, keep_mask(big, 16, 0.625))
    # among equal |A| inside a group, every kept row comes before every pruned one
    a = group_view(big.abs(), 16)
    mg = group_view(m, 16)
    idx = torch.arange(16).expand_as(a)
    for v in range(3):
        kept_last = torch.where(mg & (a == v), idx, -1).max(1).values
        pruned_first = torch.where(~mg & (a == v), idx, 99).min(1).values
        assert (kept_last < pruned_first).all()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("P", [0.25, 0.5, 0.7, 0.875])
def test_keeps_the_largest_per_group(seed, P):
    g = torch.Generator().manual_seed(seed)
    B, G = 7, 16
    adv = torch.randn(B * G, generator=g)
    m = group_view(keep_mask(adv, G, P), G)
    assert (m.sum(1) == kept_count(G, P)).all()
    a = group_view(adv.abs(), G)
    assert (torch.where(m, a, torch.inf).min(1).values >= torch.where(m, -torch.inf, a).max(1).values).all()
    mb = keep_mask(adv, G, P, scope="batch")
    assert int(mb.sum()) == B * G - math.floor(B * G * Fraction(str(P)))
    assert adv.abs()[mb].min() >= adv.abs()[~mb].max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    adv = torch.randint(-2, 3, (64,)).float()
    for scope in ("group", "batch"):
        m = keep_mask(adv.cuda(), 8, 0.625, scope)
        assert m.is_cuda and torch.equal(m.cpu(), keep_mask(adv, 8, 0.625, scope))


def test_prune_modes():
    adv = torch.tensor([3., -0.5, 1, 0.1, -2, 0.2, 0.3, 4])
    assert keep_mask(adv, 4, 0.5).tolist() == [True, False, True, False, True, False, False, True]
    assert keep_mask(adv, 4, 0.5, mode="largest").tolist() == [False, True, False, True, False, True, True, False]
    r1 = keep_mask(adv, 4, 0.5, mode="random", generator=torch.Generator().manual_seed(0))
    r2 = keep_mask(adv, 4, 0.5, mode="random", generator=torch.Generator().manual_seed(0))
    assert torch.equal(r1, r2) and (group_view(r1, 4).sum(1) == 2).all()
    seen = {tuple(keep_mask(adv, 4, 0.5, mode="random", generator=torch.Generator().manual_seed(s)).tolist())
            for s in range(20)}
    assert len(seen) > 1
    with pytest.raises(ValueError, match="mode='smallest'"):
        keep_mask(adv, 4, 0.5, mode="smallest")
