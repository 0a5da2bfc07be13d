"""The update's speed settings (`62_fast_update`, `62b_bf16_update`) change how, not what, it computes: the closed-form
head gives the checkpointed chunk's loss and gradients, a bf16 base gives the autocast path's exactly, micro-batches
follow the update's dtype, and a run records what it applied and the whole process's peak memory."""
import copy, dataclasses, tempfile
import pytest, torch
from mmrgrpo.config import ConfigError, GRPOConfig, load_config
from mmrgrpo.fast_update import HeadStats, cast_frozen, keep_freed_memory
from mmrgrpo.bf16_update import bf16_frozen_base, micro_batch_positions, wants_bf16_base
from mmrgrpo.models import add_lora, tiny_random_model
from mmrgrpo.sampling import Rollout
from mmrgrpo.step import UpdateBatch, prune, update
from mmrgrpo.runlog import Phases


def rollout(tokenizer, groups=2, G=4, P=6, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    p_ids = torch.randint(10, 1000, (groups, P), generator=g).repeat_interleave(G, 0)
    p_mask = torch.ones_like(p_ids); p_mask[:G, :2] = 0                      # the first group's prompt is left-padded
    c_ids = torch.randint(10, 1000, (groups * G, T), generator=g)
    c_mask = torch.ones_like(c_ids); c_mask[1, 3:] = 0; c_mask[5, 1:] = 0
    return Rollout(["p"] * groups * G, ["c"] * groups * G, p_ids, p_mask, c_ids, c_mask, G)


def one_update(tokenizer, c, bf16_base=False):
    "Loss and the adapters' gradients after one `update` of a fresh tiny LoRA policy (seeded) on a fixed rollout."
    torch.manual_seed(0)
    policy = add_lora(tiny_random_model(tokenizer, seed=0), c)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name: p.normal_(0, 0.05)
    if bf16_base: bf16_frozen_base(policy)
    params = [p for p in policy.parameters() if p.requires_grad]
    grads = {}
    class Keep(torch.optim.SGD):          # an optimizer that records the gradients it is given and steps nothing
        def step(self, closure=None):
            for i, p in enumerate(params): grads[i] = p.grad.detach().clone()
    # CPPO where c asks
    ro, adv, _ = prune(rollout(tokenizer), torch.tensor([1.0, -1.0, 0.5, -0.5, 0.2, -0.2, 1.5, -1.5]), c)
    metrics = update(policy, Keep(params, lr=0.0), ro, adv, c)
    return metrics["loss"], torch.cat([grads[i].flatten() for i in range(len(params))])


def assert_grads_close(got, want):
    "Equal to fp32 rounding: each element within 1e-4 relative or 1e-5 of the largest gradient."
    # sums in another order differ by ~1e-6 of the largest gradient on some CPUs (4e-7 of 0.098 on an AMD EPYC), far
    # below what a wrong mask or position moves
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def test_closed_form_head_gives_the_checkpointed_chunk(tokenizer):
    c = GRPOConfig(model="tiny-random", lora_r=4, beta=0.04, autocast_bf16=False, logp_chunk_size=7, temperature=0.8)
    loss_a, g_a = one_update(tokenizer, dataclasses.replace(c, fused_head=False))
    loss_b, g_b = one_update(tokenizer, dataclasses.replace(c, fused_head=True))
    assert loss_a == pytest.approx(loss_b, rel=1e-5, abs=1e-7)
    assert_grads_close(g_b, g_a)
    assert g_a.abs().sum() > 0


def test_bf16_base_is_the_autocast_path_exactly(tokenizer):
    c = GRPOConfig(model="tiny-random", lora_r=4, beta=0.04, autocast_bf16=True)
    loss_a, g_a = one_update(tokenizer, c)
    loss_b, g_b = one_update(tokenizer, c, bf16_base=True)
    assert loss_a == loss_b and torch.equal(g_a, g_b)
    loss_32, g_32 = one_update(tokenizer, dataclasses.replace(c, autocast_bf16=False))
    assert not torch.equal(g_a, g_32)                                   # bf16 is not fp32: the check above can fail
    assert ((g_a - g_32).norm() / g_32.norm()) < 0.05


def test_bf16_base_stores_only_the_frozen_linears(tokenizer):
    policy = add_lora(tiny_random_model(tokenizer), GRPOConfig(lora_r=4))
    n = bf16_frozen_base(policy)
    assert n == 2 * 7                                                 # 2 layers x q, k, v, o, gate, up, down
    dtypes = {name: p.dtype for name, p in policy.named_parameters()}
    assert all(d == torch.float32 for k, d in dtypes.items() if "lora_" in k or "norm" in k or "embed" in k)
    assert all(d == torch.bfloat16 for k, d in dtypes.items() if "base_layer.weight" in k)
    assert policy.get_output_embeddings().weight.dtype == torch.float32


def test_a_sampling_copy_merges_from_the_fp32_weights_of_a_bf16_base(tokenizer):
    """An adapter's first steps are smaller than bf16's spacing: merged into a bf16 weight they round away; the copy
    must see them."""
    from mmrgrpo.sampler_copy import CopyBackend
    def copy_of(policy):
        return CopyBackend(policy, tokenizer, copy_dtype=torch.bfloat16).model.model.layers[0].mlp.up_proj.weight
    torch.manual_seed(0)
    fp32 = add_lora(tiny_random_model(tokenizer, seed=0), GRPOConfig(lora_r=4, lora_alpha=8))
    with torch.no_grad():
        for name, p in fp32.named_parameters():
            if "lora_B" in name: p.normal_(0, 2e-5)                   # a delta mostly under half of bf16's spacing
    base16 = copy.deepcopy(fp32)
    bf16_frozen_base(base16)
    want, got = copy_of(fp32), copy_of(base16)
    layer = base16.base_model.model.model.layers[0].mlp.up_proj
    w16, delta = layer.base_layer.weight, layer.get_delta_weight("default").float()
    # the share of the delta a copy shows
    kept = lambda w: ((w.float() - w16.float()) * delta.sign()).sum() / delta.abs().sum()
    # merged into the bf16 weight alone: mostly rounded away
    assert kept((w16.float() + delta).bfloat16()) < 0.3
    # from the fp32 base, and from full_weight: all of it
    assert kept(want) > 0.9 and kept(got) > 0.9
    # the same copy, to the rounding of the kept rounding
    assert (got == want).float().mean() > 0.999


def test_a_bf16_base_runs_outside_autocast_too(tokenizer):
    """The vLLM log-prob check and a user's own `model(...)` call the policy without autocast: the base casts in and
    back."""
    policy = add_lora(tiny_random_model(tokenizer), GRPOConfig(lora_r=4))
    ids = torch.randint(10, 1000, (2, 7))
    with torch.no_grad():
        fp32 = policy(input_ids=ids).logits
        bf16_frozen_base(policy)
        plain = policy(input_ids=ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = policy(input_ids=ids).logits
    assert plain.dtype == torch.float32 and not torch.equal(plain, fp32)    # the weights are bf16-rounded ...
    # ... and only that
    assert torch.allclose(plain, fp32, atol=0.05) and torch.allclose(autocast.float(), fp32, atol=0.05)
    assert all(isinstance(m, torch.nn.Linear) for m in policy.modules() if type(m).__name__ == "BaseLinear16")


def test_when_a_run_stores_a_bf16_base():
    assert wants_bf16_base(GRPOConfig(autocast_bf16=True), "cpu")
    assert not wants_bf16_base(GRPOConfig(autocast_bf16=False), "cpu")
    assert not wants_bf16_base(GRPOConfig(autocast_bf16=True, bf16_base=False), "cpu")
    assert not wants_bf16_base(GRPOConfig(autocast_bf16=True, lora=False), "cpu")
    with pytest.raises(ConfigError, match="bf16_base=true"):
        wants_bf16_base(GRPOConfig(bf16_base=True, autocast_bf16=False), "cpu")
    with pytest.raises(ConfigError, match="bf16_base=true"):
        load_config(bf16_base=True, lora=False)


def test_a_frozen_weight_is_cast_once():
    w = torch.randn(8, 4)
    a, b = cast_frozen(w, torch.bfloat16), cast_frozen(w, torch.bfloat16)
    assert a is b and a.dtype == torch.bfloat16
    with torch.no_grad(): w.mul_(2)                                   # a new version of the weight: cast again
    assert torch.equal(cast_frozen(w, torch.bfloat16), w.bfloat16())
    trained = torch.randn(8, 4, requires_grad=True)
    assert cast_frozen(trained, torch.bfloat16) is not cast_frozen(trained, torch.bfloat16)


def test_head_stats_gradient_for_a_trained_head():
    "Full fine-tuning trains the head: `HeadStats` gives its gradient too, as autograd through log_softmax does."
    torch.manual_seed(0)
    h, w = torch.randn(6, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True)
    y = torch.randint(0, 30, (6,))
    logp, ent, _ = HeadStats.apply(h, w, y, 1.3, False)
    ref = (h @ w.t() / 1.3).log_softmax(-1)
    torch.testing.assert_close(logp, ref.gather(-1, y[:, None]).squeeze(-1))
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))
    ga = torch.autograd.grad(logp.sum(), [h, w]); gb = torch.autograd.grad(ref.gather(-1, y[:, None]).sum(), [h, w])
    for a, b in zip(ga, gb): torch.testing.assert_close(a, b)


def test_micro_batches_follow_the_update_dtype(tokenizer):
    policy = add_lora(tiny_random_model(tokenizer), GRPOConfig(lora_r=4))
    ro = rollout(tokenizer, groups=8, G=8, T=48)
    adv = torch.zeros(64)
    sizes = {ac: [s.stop - s.start
                  for s in UpdateBatch(policy, None, ro, adv, GRPOConfig(autocast_bf16=ac), Phases(), {}).slices]
             for ac in (False, True)}
    assert micro_batch_positions(torch.float32) == 1024 and micro_batch_positions(torch.bfloat16) == 1536
    assert sizes == {False: [16, 16, 16, 16], True: [32, 32]}



def test_packed_passes_count_the_counted_positions(tokenizer):
    """Packed, a pass holds rows up to their last counted token, so short completions make fuller passes; padded, every
    row costs T."""
    policy = add_lora(tiny_random_model(tokenizer), GRPOConfig(lora_r=4))
    ro = rollout(tokenizer, groups=8, G=8, T=48)
    ro.completion_mask[:, 12:] = 0                                     # every completion ends at 12 tokens
    adv = torch.zeros(64)
    sizes = {pack: [s.stop - s.start
                    for s in UpdateBatch(policy, None, ro, adv, GRPOConfig(autocast_bf16=False, pack_completions=pack),
                                         Phases(), {}).slices] for pack in (False, True)}
    assert sizes == {False: [16, 16, 16, 16], True: [64]}             # 64 x 48 > 1,024 a pass; 64 x 12 = 768 fits

def test_keep_freed_memory_where_glibc_is():
    import ctypes.util, platform
    kept, restored = keep_freed_memory(), keep_freed_memory(False)      # on, then back to glibc's starting thresholds
    assert isinstance(kept, bool) and isinstance(restored, bool)
    if platform.system() == "Linux" and "glibc" in platform.libc_ver()[0]: assert kept and restored


def test_trim_hands_kept_memory_back():
    """Freed memory kept for reuse stays resident until `trim_freed_memory`; run in a process of its own (the setting is
    the process's)."""
    import platform, subprocess, sys
    if not (platform.system() == "Linux" and "glibc" in platform.libc_ver()[0]): pytest.skip("glibc only")
    probe = """
import os, torch
from mmrgrpo.fast_update import keep_freed_memory, trim_freed_memory
rss = lambda: int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') >> 20
keep_freed_memory()
# something live above the big block, so it sits in the heap's middle
small = [torch.ones(1 << 20) for _ in range(4)]
big = torch.ones(300 << 18); small.append(torch.ones(1 << 20)); del big
kept = rss()
trim_freed_memory()
print(kept, rss())
"""
    kept, trimmed = map(int, subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                            check=True).stdout.split())
    assert kept - trimmed > 200                        # MiB: the freed 300 MiB block was resident, and is handed back


def test_a_run_records_its_settings_and_whole_peak(tokenizer):
    "A CPU run (pinned there: these are CPU speed-ups) records what it applied and the whole process's peak."
    from mmrgrpo.models import load_policy
    from mmrgrpo.trainer import train
    with tempfile.TemporaryDirectory() as d:
        c = load_config(model="tiny-random", steps=1, num_generations=4, prompts_per_step=2, max_completion_length=6,
                        autocast_bf16=True, eval_size=4, save_every=0, log_completions_every=0, output_dir=d)
        res = train(c, *load_policy(c, device="cpu"), progress=False)
    row = res.metrics[0]
    assert row["precision/base"] == "bfloat16" and isinstance(row["allocator/keep_freed"], bool)
    assert row["allocator/handed_back"] == 0.0         # the first step only sets the kept heap's level (`KeptHeap`)
    assert row["memory/process_peak"] >= row["memory/peak"] > 0
    assert res.eval_before["memory/eval"] > 0
    assert "fused decoder" in row["precision/sampler"]
    assert row["update/attention"] == "matmul"         # bf16 autocast on a CPU (`62a_matmul_attention`)


@pytest.mark.parametrize("methods", [{}, {"prune_rate": 0.5},
                                     {"prune_rate": 0.5, "token_selection": "gmts", "keep_ratio": 0.5}])
def test_packed_rows_give_the_padded_update(tokenizer, methods):
    """`pack_completions` drops the pad positions; the loss and the adapters' gradients are the padded rows' to float
    rounding, with CPPO and GMTS on too."""
    c = GRPOConfig(model="tiny-random", lora_r=4, beta=0.04, autocast_bf16=False, logp_chunk_size=7, **methods)
    loss_a, g_a = one_update(tokenizer, dataclasses.replace(c, pack_completions=False))
    loss_b, g_b = one_update(tokenizer, dataclasses.replace(c, pack_completions=True))
    assert loss_a == pytest.approx(loss_b, rel=1e-5, abs=1e-7)
    assert_grads_close(g_b, g_a)
    assert g_a.abs().sum() > 0


@pytest.mark.parametrize("change, packs", [({}, True), ({"pack_completions": False}, False),
                                           ({"share_prompt": False}, False), ({"attn": "eager"}, False)])
def test_the_update_packs_only_where_it_can(tokenizer, monkeypatch, change, packs):
    """Packing needs each group's prompt cache (prompt sharing) and attention that reads a boolean 4-D mask as it is
    (sdpa)."""
    import mmrgrpo.fast_update as fast           # its speed-up's `pass_stats` hands the passes this function
    calls = []
    real = fast.packed_completion_stats
    monkeypatch.setattr(fast, "packed_completion_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    c = GRPOConfig(model="tiny-random", lora_r=4, beta=0.0, autocast_bf16=False,
                   **{k: v for k, v in change.items() if k != "attn"})
    policy = add_lora(tiny_random_model(tokenizer, seed=0), c)
    if "attn" in change: policy.config._attn_implementation = change["attn"]
    params = [p for p in policy.parameters() if p.requires_grad]
    metrics = update(policy, torch.optim.SGD(params, lr=0.0), rollout(tokenizer), torch.tensor([1.0, -1.0] * 4), c)
    assert bool(calls) == packs
    assert torch.isfinite(torch.tensor(metrics["loss"]))


@pytest.mark.parametrize("methods", [{}, {"prune_rate": 0.5, "token_selection": "gmts", "keep_ratio": 0.5},
                                     {"pack_completions": False}])
def test_matmul_attention_gives_the_fused_kernels_update(tokenizer, monkeypatch, methods):
    """`update_attention=matmul` (`62a_matmul_attention`) takes the packed passes' attention calls; loss and gradients
    are sdpa's to fp32 rounding."""
    import mmrgrpo.matmul_attention as ma
    calls = []
    real = ma.MatmulAttention.apply
    monkeypatch.setattr(ma.MatmulAttention, "apply", lambda *a: calls.append(a[0].shape) or real(*a))
    c = GRPOConfig(model="tiny-random", lora_r=4, beta=0.04, autocast_bf16=False, logp_chunk_size=7, **methods)
    loss_a, g_a = one_update(tokenizer, dataclasses.replace(c, update_attention="sdpa"))
    assert not calls
    loss_b, g_b = one_update(tokenizer, dataclasses.replace(c, update_attention="matmul"))
    assert len(calls) >= 2 * 2                       # 2 layers, the reference and the policy pass
    assert loss_a == pytest.approx(loss_b, rel=1e-5, abs=1e-7)
    assert_grads_close(g_b, g_a)
    assert g_a.abs().sum() > 0


def test_matmul_attention_in_bf16_is_within_bf16_rounding(tokenizer):
    c = GRPOConfig(model="tiny-random", lora_r=4, beta=0.04, autocast_bf16=True)
    loss_a, g_a = one_update(tokenizer, dataclasses.replace(c, update_attention="sdpa"))
    loss_b, g_b = one_update(tokenizer, dataclasses.replace(c, update_attention="matmul"))
    loss_32, g_32 = one_update(tokenizer, dataclasses.replace(c, update_attention="sdpa", autocast_bf16=False))
    assert not torch.equal(g_a, g_b)                 # another computation in bf16: not bit for bit
    assert ((g_b - g_32).norm() / g_32.norm()) < 0.05 and ((g_a - g_32).norm() / g_32.norm()) < 0.05


def test_matmul_attention_is_not_for_checkpointed_layers():
    """A checkpointed layer recomputes its forward in the backward pass, after the update's attention has been handed
    back."""
    from mmrgrpo.matmul_attention import wants_matmul_attention
    with pytest.raises(ConfigError, match="update_attention=matmul with gradient_checkpointing"):
        load_config(model="tiny-random", update_attention="matmul", gradient_checkpointing=True)
    assert not wants_matmul_attention(
        load_config(model="tiny-random", autocast_bf16=True, gradient_checkpointing=True), "cpu")
    with pytest.raises(ConfigError, match="update_attention"):
        load_config(model="tiny-random", update_attention="fast")
