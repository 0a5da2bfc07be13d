"""The diversity credit (ALGORITHMS.md section 3b): each promise it makes, checked on hand-made and random groups, and
the reference MMR rule shown to break the ones it breaks. Also the config wiring and the paper's cosine reward."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmrgrpo.advantages import group_advantages
from mmrgrpo.config import ConfigError, load_config
from mmrgrpo.diversity import diversity_advantages, positive_redundancy, diversity_credit, above_mean
from mmrgrpo.mmr import similarity_matrix

E_D = torch.tensor([[1., 0], [1, 0], [0.6, 0.8], [0, 1]])
R_D = torch.tensor([1., 1, 1, 0])


def test_worked_examples():
    test = lambda a, b: torch.testing.assert_close(a, torch.tensor(b), atol=1e-5, rtol=0)
    test(diversity_advantages(R_D, E_D, 4), [0.460112, 0.460112, 0.579475, -1.4997])
    test(diversity_advantages(R_D, E_D, 4, variant="reference"), [1.260939, -0.192196, 0.098431, -1.167174])
    E_A = torch.tensor([[1., 0], [0.6, 0.8], [0.8, 0.6], [0, 1]])
    test(diversity_advantages(torch.tensor([1., 0, 1, 0]), E_A, 4), [0.865875, -0.865875, 0.865875, -0.865875])
    test(diversity_advantages(torch.tensor([1., 0, 1, 0]), E_A, 4, variant="reference"),
         [1.318667, -0.879997, 0.221992, -0.660662])
    # the reference rule's privileged first pick, and the credit's answer to it
    test(diversity_advantages(torch.ones(4), torch.eye(4), 4, variant="reference"),
         [1.4994, -0.4998, -0.4998, -0.4998])  # eps 1e-4
    test(diversity_advantages(torch.ones(4), torch.eye(4), 4), [0., 0, 0, 0])


def random_groups(seed, n=400, G=6, D=4, binary=True):
    gen = torch.Generator().manual_seed(seed)
    # ties are common
    r = torch.randint(0, 3 if binary else 5, (n, G), generator=gen).float() * (1 if binary else 0.25)
    if binary: r = (r > 0).float()
    E = torch.randn(n, G, D, generator=gen)
    dup = torch.rand(n, generator=gen) < 0.5             # row 1 an exact copy of row 0 in half the groups
    E[dup, 1], r[dup, 1] = E[dup, 0], r[dup, 0]
    flat = torch.rand(n, generator=gen) < 0.2            # and some groups with all-equal rewards
    r[flat] = r[flat, :1]
    return r, E


def credit_and_reference(r, E):
    n, G = r.shape
    f = lambda v: diversity_advantages(r.flatten(), E.reshape(n * G, -1), G, variant=v).reshape(n, G)
    return f("credit"), f("reference")


def redundancy(A, E):
    "m written out with loops over pairs: the largest non-negative similarity to another above-mean completion."
    S = torch.nn.functional.normalize(E, dim=-1) @ torch.nn.functional.normalize(E, dim=-1).transpose(1, 2)
    n, G = A.shape
    m = torch.zeros(n, G)
    for i in range(G):
        for j in range(G):
            if i != j:
                m[:, i] = torch.where((A[:, i] > 1e-4) & (A[:, j] > 1e-4),
                                      torch.maximum(m[:, i], S[:, i, j].clamp(min=0)), m[:, i])
    return m


@pytest.mark.parametrize("binary", [True, False])
def test_all_equal_groups_get_exactly_zero(binary):
    r, E = random_groups(0, binary=binary)
    credit, reference = credit_and_reference(r, E)
    flat = r.amax(1) == r.amin(1)
    assert flat.sum() > 50
    assert torch.equal(credit[flat], torch.zeros_like(credit[flat]))
    if binary: assert (reference[flat].abs().amax(1) > 0.1).all()     # the reference rule revives them


@pytest.mark.parametrize("binary", [True, False])
def test_signs_kept_and_below_mean_exact(binary):
    r, E = random_groups(1, binary=binary)
    credit, reference = credit_and_reference(r, E)
    A = group_advantages(r.flatten(), r.shape[1]).reshape(r.shape)
    assert not (credit * A < 0).any()
    below = r < r.mean(1, keepdim=True)
    assert torch.equal(credit[below], A[below])                      # exactly, not approximately
    assert (reference * A < -1e-3).any()                             # the reference flips signs


@pytest.mark.parametrize("binary", [True, False])
def test_more_redundant_never_gets_more(binary):
    r, E = random_groups(2, binary=binary)
    credit, reference = credit_and_reference(r, E)
    A = group_advantages(r.flatten(), r.shape[1]).reshape(r.shape)
    m = redundancy(A, E)
    pairs = (r[:, :, None] == r[:, None, :]) & (m[:, :, None] > m[:, None, :] + 1e-4) & (A[:, :, None] > 1e-4)
    assert pairs.sum() > 100
    assert not (pairs & (credit[:, :, None] > credit[:, None, :] + 1e-6)).any()
    if binary: assert (pairs & (reference[:, :, None] > reference[:, None, :] + 1e-3)).any()


def test_row_order_does_not_matter():
    r, E = random_groups(3, binary=False)
    credit, _ = credit_and_reference(r, E)
    for seed in range(5):
        perm = torch.randperm(r.shape[1], generator=torch.Generator().manual_seed(seed))
        shuffled, _ = credit_and_reference(r[:, perm], E[:, perm])
        torch.testing.assert_close(shuffled, credit[:, perm], atol=1e-5, rtol=0)


def test_exact_duplicates_equal():
    r, E = random_groups(4)
    credit, reference = credit_and_reference(r, E)
    same = (E[:, 0] == E[:, 1]).all(-1)
    assert same.sum() > 100
    assert torch.equal(credit[same, 0], credit[same, 1])
    assert ((reference[same, 0] - reference[same, 1]).abs() > 1e-3).any()


def test_winners_keep_their_total_push():
    r, E = random_groups(5, binary=False)
    credit, _ = credit_and_reference(r, E)
    A = group_advantages(r.flatten(), r.shape[1]).reshape(r.shape)
    pos = above_mean(A)
    torch.testing.assert_close(torch.where(pos, credit, 0.).sum(1), torch.where(pos, A, 0.).sum(1),
                               atol=1e-4, rtol=1e-5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=2, max_size=8), st.integers(0, 2**31 - 1))
def test_invariants_hold_for_any_group(rewards, seed):
    r = torch.tensor(rewards)
    E = torch.randn(len(rewards), 3, generator=torch.Generator().manual_seed(seed))
    A = group_advantages(r, len(r))
    out = diversity_advantages(r, E, len(r))
    if r.max() == r.min(): assert torch.equal(out, torch.zeros_like(out))
    assert not (out * A < 0).any()
    below = r < r.mean()
    assert torch.equal(out[below], A[below])
    assert torch.isfinite(out).all()


def test_dr_grpo_scale_and_fixed_lambda():
    out = diversity_advantages(R_D, E_D, 4, scale="none")
    A = R_D - R_D.mean()
    assert torch.equal(out[3], A[3]) and (out[:3] > 0).all()
    torch.testing.assert_close(out[:3].sum(), A[:3].sum())
    # a fixed lambda of 1 means beta = 0: no diversity term at all
    torch.testing.assert_close(diversity_advantages(R_D, E_D, 4, lam=1.0), group_advantages(R_D, 4))


def test_redundancy_building_blocks():
    S = similarity_matrix(E_D, 4)
    A = group_advantages(R_D, 4)[None]
    torch.testing.assert_close(positive_redundancy(A, S), torch.tensor([[1., 1, 0.6, 0]]))
    torch.testing.assert_close(diversity_credit(A, R_D[None], S), diversity_advantages(R_D, E_D, 4)[None])


def test_config_default_and_reference():
    c = load_config(mmr=True)
    assert (c.reweight, c.mmr_variant) == ("mmr", "credit")
    assert load_config(mmr=True, mmr_variant="reference", mmr_scope="batch").mmr_scope == "batch"
    with pytest.raises(ConfigError, match="mmr_variant=reference"): load_config(mmr=True, mmr_scope="batch")
    with pytest.raises(ConfigError): load_config(mmr_variant="paper")


def test_trainer_phase_uses_the_credit():
    "advantages_for with the default variant gives the credit, shares exact duplicates, and logs no revived group."
    from mmrgrpo.step import advantages_for
    from mmrgrpo.sampling import Rollout
    texts = ["a", "a", "b", "c"] + ["x", "y", "z", "w"]
    ids = torch.ones(8, 1, dtype=torch.long)
    ro = Rollout(["p"] * 8, texts, ids, ids, ids, ids, 4)
    class Embedder:      # a stand-in with the sentence-transformers interface embed_completions uses
        tokenizer = None
        def encode(self, texts, **kw):
            table = {"a": [1., 0], "b": [0.6, 0.8], "c": [0, 1], "x": [1, 0], "y": [0, 1], "z": [1, 1], "w": [-1, 0]}
            return torch.tensor([table[t] for t in texts])
    r = torch.tensor([1., 1, 1, 0, 0, 0, 0, 0])
    adv, m = advantages_for(r, ro, load_config(mmr=True), embedder=Embedder())
    torch.testing.assert_close(adv[:4], torch.tensor([0.460112, 0.460112, 0.579475, -1.4997]), atol=1e-5, rtol=0)
    assert torch.equal(adv[4:], torch.zeros(4)) and m["mmr/zero_std_groups_revived"] == 0.0
    assert 0 < m["mmr/credit_moved"] < 0.2
    adv_ref, m_ref = advantages_for(r, ro, load_config(mmr=True, mmr_variant="reference"), embedder=Embedder())
    assert m_ref["mmr/zero_std_groups_revived"] == 0.5 and adv_ref[4:].abs().max() > 0


def test_cosine_reward_matches_the_formula():
    from mmrgrpo.rewards import cosine_reward, get_reward_funcs
    assert get_reward_funcs(["cosine"]) == [cosine_reward]
    texts = ["\\boxed{7}", "\\boxed{8}", "y" * 990 + "\\boxed{7}", "y" * 3000 + "\\boxed{7}"]
    got = cosine_reward(["q"] * 4, texts, ["7"] * 4)
    want = lambda ok, n: (0.5 if ok else -0.5) + 0.25 * (1 + math.cos(math.pi * min(n / 1000, 1)))
    assert got == pytest.approx([want(1, 9), want(0, 9), want(1, 999), 0.5])
    assert cosine_reward(["q"], ["\\boxed{8}"], ["7"], wrong=(-1.0, -0.5), max_len=9) == pytest.approx([-1.0])


def test_credit_moved_is_zero_when_every_group_is_flat():
    """All-equal groups (rewards whose float mean is not exact, e.g. 0.2) leave nothing to move: the metric is 0, not
    0/0."""
    from mmrgrpo.step import advantages_for
    from mmrgrpo.sampling import Rollout
    ids = torch.ones(4, 1, dtype=torch.long)
    ro = Rollout(["p"] * 4, ["a", "b", "c", "d"], ids, ids, ids, ids, 4)
    class Embedder:
        tokenizer = None
        def encode(self, texts, **kw): return torch.eye(4)[: len(texts)]
    adv, m = advantages_for(torch.full((4,), 0.2), ro, load_config(mmr=True), embedder=Embedder())
    assert torch.equal(adv, torch.zeros(4)) and m["mmr/credit_moved"] == 0.0
