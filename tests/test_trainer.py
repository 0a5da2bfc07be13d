"""End-to-end tests of the training loop: the real SmolLM2 model, resume, pruning's saving, token selection's identity
case."""
import json, math, sys
from pathlib import Path
import pytest, torch
from mmrgrpo.config import load_config
from mmrgrpo.trainer import train, read_metrics, latest_checkpoint
from mmrgrpo.step import update
from mmrgrpo.sampling import Rollout

TRL_NAMES = ["reward", "reward_std", "frac_reward_zero_std", "completion_length", "kl", "clip_ratio", "entropy",
             "rewards/accuracy_reward", "rewards/format_reward", "loss", "grad_norm", "learning_rate",
             "time/generate", "time/reward", "time/update", "time/step"]
METHOD_NAMES = ["mmr/lambda", "mmr/zero_std_groups_revived", "mmr/credit_moved", "prune/kept_fraction",
                "tokens/kept_fraction", "time/mmr", "time/select"]


def _tiny(tmp_path, **kw):
    base = dict(model="tiny-random", steps=3, num_generations=4, prompts_per_step=2, max_completion_length=8,
                eval_size=0, log_completions_every=0, save_every=1, output_dir=str(tmp_path), seed=3, beta=0.04)
    return load_config(**{**base, **kw})


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("time/", "memory/")) and k != "eval/time"}


def test_two_steps_on_real_smollm2_change_lora_and_log_everything(tmp_path):
    c = load_config(model="smollm2", steps=2, num_generations=4, prompts_per_step=2, max_completion_length=16,
                    eval_size=4, output_dir=str(tmp_path), log_completions_every=1, learning_rate=1e-3, beta=0.04)
    from mmrgrpo.models import load_policy
    model, tok = load_policy(c)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    res = train(c, model, tok, progress=False)
    after = dict(model.named_parameters())
    assert before and all("lora_" in n for n in before)
    changed = [n for n, p in before.items() if not torch.equal(p, after[n].detach())]
    assert len(changed) >= len(before) // 2, f"only {len(changed)} of {len(before)} LoRA tensors changed"
    rows = read_metrics(tmp_path / "metrics.jsonl")
    steps = [r for r in rows if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for k in TRL_NAMES + ["time/ref"]:
            assert k in r and math.isfinite(r[k]), k
        if sys.platform == "linux":      # per-phase peak memory: the update holds the model plus its activations
            assert r["memory/peak"] == max(v for k, v in r.items() if k.startswith("memory/")
                                           and k not in ("memory/peak", "memory/process_peak"))
            # the whole process so far: loading and evaluation too
            assert r["memory/process_peak"] >= r["memory/peak"]
            assert 300 < r["memory/update"] < 20_000, r["memory/update"]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    assert res.eval_before and res.eval_after
    assert (tmp_path / "checkpoint-2" / "adapter" / "adapter_model.safetensors").exists()


def test_resume_reproduces_uninterrupted_metrics(tmp_path):
    full = train(_tiny(tmp_path / "full"), progress=False)
    # the same run, stopped after step 2 (checkpoint-2 written), then resumed from it
    train(_tiny(tmp_path / "cut"), progress=False, stop_after=2)
    assert latest_checkpoint(tmp_path / "cut").name == "checkpoint-2"
    train(_tiny(tmp_path / "cut", resume_from="latest"), progress=False)
    a = [_comparable(r) for r in read_metrics(tmp_path / "full" / "metrics.jsonl")]
    b = [_comparable(r) for r in read_metrics(tmp_path / "cut" / "metrics.jsonl")]
    assert [r["step"] for r in b] == [1, 2, 3]
    assert a == b                     # every step, step 3 included, identical to the uninterrupted run


def _on_cpu(c):
    "`train`'s arguments for config `c` with the policy on the CPU, where a GPU is visible too: a CPU speed-up's test."
    from mmrgrpo.models import load_policy
    torch.manual_seed(c.seed)                     # the adapter's initial weights, as `train` seeds them when it loads
    return (c, *load_policy(c, device="cpu"))


def test_resume_refreshes_the_sampling_copy(tmp_path):
    """The merged sampling copy (61_sampler_copy) is made before the checkpoint's weights are loaded: resume must
    refresh it."""
    kw = dict(sampler_dtype="float32", learning_rate=0.05, steps=3, reward_funcs=["reward_fixtures:varied"],
              reward_weights=None)
    full = train(*_on_cpu(_tiny(tmp_path / "full", **kw)), progress=False)
    assert full.backend.copy_dtype == torch.float32 and full.backend.model is not full.model
    train(*_on_cpu(_tiny(tmp_path / "cut", **kw)), progress=False, stop_after=2)
    train(*_on_cpu(_tiny(tmp_path / "cut", resume_from="latest", **kw)), progress=False)
    a = [_comparable(r) for r in read_metrics(tmp_path / "full" / "metrics.jsonl")]
    b = [_comparable(r) for r in read_metrics(tmp_path / "cut" / "metrics.jsonl")]
    assert a[0]["precision/sampler"] == "a merged copy in float32 (fused decoder)"
    assert a == b


def test_all_three_methods_log_their_metrics(tmp_path):
    res = train(_tiny(tmp_path, steps=2, mmr=True, prune_rate=0.5, token_selection="gmts", keep_ratio=0.5),
                progress=False)
    for r in res.metrics:
        for k in METHOD_NAMES: assert k in r, k
        assert r["prune/kept_fraction"] == 0.5
        assert 0 < r["tokens/kept_fraction"] <= 0.5 + 1e-9 or r["frac_reward_zero_std"] == 1.0


def _rollout(N=8, G=4, P=5, T=6, seed=0, vocab=200):
    g = torch.Generator().manual_seed(seed)
    p_ids = torch.randint(1, vocab, (N // G, P), generator=g).repeat_interleave(G, 0)
    c_ids = torch.randint(1, vocab, (N, T), generator=g)
    c_mask = torch.ones(N, T, dtype=torch.long); c_mask[1, 3:] = 0; c_mask[6, 1:] = 0
    return Rollout(["p"] * N, ["c"] * N, p_ids, torch.ones_like(p_ids), c_ids, c_mask, G)


class _Counting(torch.nn.Module):
    "Wraps a model's decoder to count the rows that reach it."
    def __init__(self, model):
        super().__init__(); self.model, self.rows = model, 0
        body = model.get_decoder(); orig = body.forward
        def fwd(*a, **k):
            self.rows += (k.get("input_ids") if "input_ids" in k else a[0]).shape[0]
            return orig(*a, **k)
        body.forward = fwd


@pytest.mark.parametrize("prune_rate,kept", [(0.0, 8), (0.5, 4), (0.75, 2)])
def test_pruned_completions_never_reach_the_model(tmp_path, tiny_model, prune_rate, kept):
    from mmrgrpo.step import prune, Phases
    from mmrgrpo.models import add_lora
    c = _tiny(tmp_path, prune_rate=prune_rate, share_prompt=False)
    m = add_lora(tiny_model, c)
    ro = _rollout()
    adv = torch.tensor([1.0, -1.0, 0.1, -0.1, 2.0, -2.0, 0.3, -0.3])
    kro, kadv, pm = prune(ro, adv, c)
    counter = _Counting(m)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    stats = {}
    update(m, opt, kro, kadv, c, counter=stats)
    # policy forward (kept rows) + reference forward (kept rows, beta > 0): the pruned rows reach neither
    assert counter.rows == 2 * kept
    assert stats["forward_rows"] == 2 * kept
    assert pm["prune/kept_fraction"] == kept / 8


def test_keep_ratio_one_reproduces_plain_update(tmp_path, tokenizer):
    from mmrgrpo.models import add_lora, tiny_random_model
    grads = {}
    for sel in ["none", "gmts", "entropy"]:
        c = _tiny(tmp_path, token_selection=sel, keep_ratio=1.0, max_grad_norm=0.0)
        torch.manual_seed(0)                             # LoRA A is initialised from the global RNG
        m = add_lora(tiny_random_model(tokenizer, seed=0), c)
        # LoRA B starts at 0; give it values so every gradient is non-trivial
        for n, p in m.named_parameters():
            if "lora_B" in n: torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(1))
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.0)
        ro = _rollout(vocab=len(tokenizer))
        adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.3, -0.3])
        captured = {}
        orig = opt.step
        def step(*a, **k):
            captured.update({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
            return orig(*a, **k)
        opt.step = step
        update(m, opt, ro, adv, c)
        grads[sel] = captured
    for sel in ["gmts", "entropy"]:
        assert grads[sel].keys() == grads["none"].keys()
        for n in grads["none"]: assert torch.equal(grads[sel][n], grads["none"][n]), (sel, n)
