"""How close the update phase gets to this machine's matmul peak, in fp32 and under bf16 autocast.

Part 1 measures matmul throughput here, fp32 and bf16 interleaved in one run: a square 2048^3 product and the model's
own shapes at the update's token count (tokens x 576 @ 576 x 1536 for gate/up, tokens x 1536 @ 1536 x 576 for down,
tokens x 576 @ 576 x 576 for the attention projections, and a 1024-row chunk of the 576 x 49152 output head). The peak
of a dtype is its best shape. Each number is a median of `--repeats` timings of a loop lasting >= 0.3 s.

Part 2 samples one rollout with the fixed config (SmolLM2-135M-Instruct + LoRA r=16 on all seven projections, G=8 x 8
prompts, 48 new tokens, beta=0.04, no token selection, prompt sharing on) and times the trainer's `update` on it, each
arm from the same initial LoRA weights with a fresh AdamW, interleaved. The process keeps freed memory for reuse
(`keep_freed_memory`, as the trainer does on a CPU). Arms, the first six in micro-batches of 16 completions (the bench
config's):
- `fp32, padded`: no autocast, the completions' padded rows (`pack_completions=false`);
- `fp32`: no autocast, each group's completions packed without padding (`pack_completions`, 62_fast_update);
- `fp32, matmul attention`: and the packed passes' masked attention in plain matmuls (`update_attention=matmul`; "auto"
  leaves fp32 on torch's fused kernel, 62a_matmul_attention);
- `bf16 autocast, plain head`: bf16 autocast, padded rows, the head's log-probs by autograd through a checkpointed chunk
  (04_logprobs);
- `bf16 autocast`: the head in closed form (`fused_head`, 62_fast_update);
- `bf16 base`: and the frozen base stored in bf16 (`bf16_base`, 62b_bf16_update);
- `bf16 base, auto passes`: and the automatic micro-batch size for bf16 (`micro_batch_positions`, 62b_bf16_update);
- `bf16 base, auto passes, packed`: and the completions packed (what "auto" gives on a CPU with bf16 units); the bf16
  arms' masked attention runs in plain matmuls where `update_attention=auto` takes it (62a_matmul_attention);
- `bf16 base, auto passes, packed, sdpa attention`: the arm above with torch's fused attention kernel
  (`update_attention=sdpa`);
- `bf16 base, auto passes, packed, peft input casts`: the default arm with peft's casts of each LoRA layer's bf16 input
  to fp32 and back left in (the update leaves the input as it comes under autocast, `lora_inputs_uncast`,
  62b_bf16_update);
- `fp32@REF`, `bf16 autocast@REF` (with `--baseline-ref REF`): the update as the package was at commit REF, on the same
  rollout and initial weights, in a process of its own that runs that code and its allocator defaults
  (`benchlib.BaselineWorker`).

FLOP count of the update phase (multiply-add = 2 FLOPs). Counted twice: on the padded rows, as the padded arms compute
them (below), and on the tokens that count (`useful_counts`: the prompts' shared prefix once, each group's own prompt
tokens after it, each completion up to its last counted token, the head at counted positions, attention over the causal
half), the work any arm must do. The packed arms compute a little more than the second (the shared prefix once per pass,
a packed row's padded tail, the full attention rectangle), far less than the first; efficiency by the first count
credits padding as work, so the packed arms are judged by the second.
The padded count:
- tokens through the decoder body per pass: with prompt sharing, (N/G) x P for the prompts plus N x (T-1) for the
  completions; without, N x (P + T). N rows, P prompt width, T completion width.
- linear layers, forward: 2 x (base linear weights + LoRA A/B weights of the 30 layers) per token (embedding excluded:
  it is a lookup). The reference pass (adapter off) uses the base weights only.
- attention scores and values, forward: 4 x d_model x context per query token per layer, context = the full key length
  (the masked kernels compute the whole rectangle, not the causal half).
- output head: 2 x 576 x 49152 per completion position (N x T), every pass.
- backward: base weights are frozen under LoRA, so linear layers need only activation gradients (1 x their forward);
  LoRA weights need activation and weight gradients (2 x); attention backward is 2 x its forward; the head is recomputed
  (checkpointed chunks) and back-propagated to its input: 2 x its forward.
- update phase = reference forward + policy forward + backward. The conventional count (backward = 2 x forward, as for
  full fine-tuning) is reported beside it for comparison with MFU figures elsewhere.
Achieved FLOP/s = FLOPs / wall-clock of the update phase (ref + update); its fraction of the measured peak of the dtype
the matmuls ran in (fp32, or bf16 under autocast) is the efficiency (`frac_of_own_peak` by the padded count,
`useful_frac_of_own_peak` by the count of the tokens that count).

Profile (`--profile [ARM ...]`): after the timed rounds, one more update of each named arm (default: `fp32` and
`bf16 base, auto passes, packed`, what "auto" gives) under torch's profiler, its seconds split by kind of op: matmuls,
attention forward and backward, copies and casts, the optimizer's own ops, everything else (elementwise: norms, rotary
embeddings, activations, the head's log-softmax), and outside ops (the wall-clock minus the ops' CPU time). Saved as
`update_profile_s`.

    python bench/compute_efficiency.py             # full: about 9 min on 2 cores
    python bench/compute_efficiency.py --quick     # tiny random model and small matmuls, seconds
    python bench/compute_efficiency.py --arms "bf16 base, auto passes, packed" \
        "bf16 base, auto passes, packed, peft input casts"
"""
import argparse, contextlib, dataclasses, math, sys, time
from unittest import mock
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl


def time_matmul(a, b, min_s: float = 0.3) -> float:
    "Seconds per a @ b, from a loop lasting at least `min_s` (one warm-up call first; on a GPU, its queue drained)."
    import torch
    torch.matmul(a, b); bl.sync(a.device)
    t0 = time.perf_counter(); torch.matmul(a, b); bl.sync(a.device); one = time.perf_counter() - t0
    n = max(1, math.ceil(min_s / max(one, 1e-6)))
    t0 = time.perf_counter()
    for _ in range(n): torch.matmul(a, b)
    bl.sync(a.device)
    return (time.perf_counter() - t0) / n


def matmul_bench(shapes: dict, repeats: int) -> dict:
    "{shape name: {dtype: spread of GFLOP/s}} with fp32 and bf16 interleaved."
    import torch
    out = {k: {"fp32": [], "bf16": []} for k in shapes}
    data = {}
    for k, (m, kk, n) in shapes.items():
        a, b = torch.randn(m, kk), torch.randn(kk, n)
        data[k] = {"fp32": (a, b), "bf16": (a.bfloat16(), b.bfloat16())}
    for r, (k, dt) in bl.interleaved([(k, dt) for k in shapes for dt in ("fp32", "bf16")], repeats):
        m, kk, n = shapes[k]
        t = time_matmul(*data[k][dt])
        out[k][dt].append(2 * m * kk * n / t / 1e9)
    return {k: {dt: bl.spread(v) for dt, v in d.items()} for k, d in out.items()}


def param_counts(model) -> dict:
    "Weights of the decoder's linear layers (base and LoRA), the head, and the model's dimensions."
    cfg = model.config
    base = lora = 0
    for n, p in model.named_parameters():
        if p.dim() != 2 or "embed_tokens" in n or "lm_head" in n: continue
        if "lora_" in n: lora += p.numel()
        else: base += p.numel()
    head = model.get_output_embeddings().weight
    return {"base_linear": base, "lora": lora, "head": head.numel(), "d_model": cfg.hidden_size, "vocab": head.shape[0],
            "layers": cfg.num_hidden_layers, "total_params": sum(p.numel() for p in model.parameters())}


def padded_counts(rows: int, group: int, P: int, T: int, share: bool) -> dict:
    """Tokens through the body, attention context (sum over query tokens of the key length) and head positions, as the
    padded rows compute them."""
    if share:
        return {"body_tokens": rows // group * P + rows * (T - 1), "head_positions": rows * T,
                "attn_ctx": rows // group * P * P + rows * (T - 1) * (P + T - 1)}
    return {"body_tokens": rows * (P + T), "attn_ctx": rows * (P + T) * (P + T), "head_positions": rows * T}


def useful_counts(ro) -> dict:
    """The same counts over the tokens that count: the prompts' shared prefix once, each group's own prompt tokens,
    each completion up to its last counted token."""
    import torch
    from mmrgrpo.fast_update import counted_lengths
    from mmrgrpo.fused_decode import shared_prefix
    runs = torch.unique_consecutive(ro.group_ids, return_counts=True)[1].tolist()
    first = [sum(runs[:i]) for i in range(len(runs))]
    K = shared_prefix(ro.prompt_ids[first], ro.prompt_mask[first])
    cm, last = ro.completion_mask.bool(), counted_lengths(ro.completion_mask).tolist()
    body, attn, head = K, K * (K + 1) // 2, 0
    for g, n in zip(first, runs):
        p = int(ro.prompt_mask[g].sum())
        body, attn = body + p - K, attn + (p * (p + 1) - K * (K + 1)) // 2
        for r in range(g, g + n):
            k = max(last[r] - 1, 0)
            body, attn, head = body + k, attn + k * p + k * (k + 1) // 2, head + int(cm[r].sum())
    return {"body_tokens": body, "attn_ctx": attn, "head_positions": head, "shared_prefix": K}


def update_flops(pc: dict, counts: dict, beta: bool) -> dict:
    """FLOPs of one update phase (see the module docstring) from its token counts, split into parts, plus the
    conventional 3x-forward count."""
    L, d = pc["layers"], pc["d_model"]
    lin_base, lin_lora = 2 * pc["base_linear"] * counts["body_tokens"], 2 * pc["lora"] * counts["body_tokens"]
    attn = 4 * d * counts["attn_ctx"] * L
    head = 2 * pc["head"] * counts["head_positions"]
    ref_fwd = (lin_base + attn + head) if beta else 0
    pol_fwd = lin_base + lin_lora + attn + head
    bwd = lin_base + 2 * lin_lora + 2 * attn + 2 * head
    total = ref_fwd + pol_fwd + bwd
    return {**counts, "ref_forward": ref_fwd, "policy_forward": pol_fwd,
            "backward": bwd, "total": total, "conventional_total": ref_fwd + 3 * pol_fwd,
            "parts_forward": {"linear_base": lin_base, "linear_lora": lin_lora, "attention": attn, "head": head}}


def baseline_worker(args):
    """Under the package of `--baseline-ref`: the update on the main process's rollout, from its initial LoRA weights,
    per request."""
    import torch
    import mmrgrpo.trainer as tr
    from mmrgrpo.config import load_config
    from mmrgrpo.models import load_policy, trainable_parameters
    from mmrgrpo.sampling import Rollout
    c = load_config(overrides=args.set, **dict(bl.QUICK_CONFIG if args.quick else bl.BENCH_CONFIG, steps=1,
                                               output_dir="runs/bench_compute", threads=args.threads))
    model, _ = load_policy(c)
    params = trainable_parameters(model)
    def one(request):
        shared = torch.load(request["shared"], weights_only=False)
        ro, adv = Rollout(**shared["rollout"]), shared["advantages"]
        with torch.no_grad():
            for n, p in params.items(): p.copy_(shared["init"][n])
        opt = torch.optim.AdamW(list(params.values()), lr=c.learning_rate, weight_decay=c.weight_decay)
        cfg = dataclasses.replace(c, autocast_bf16=request["arm"] != "fp32",
                                  micro_batch_size=16 if not args.quick else 0)
        ph = tr.Phases()
        t0 = time.perf_counter()
        m = tr.update(model, opt, ro, adv, cfg, None, ph, {})
        return {"total": time.perf_counter() - t0, "times": dict(ph.t), "loss": m["loss"]}
    bl.serve_baseline(one)


def peft_casts(arm: str):
    """For the `peft input casts` arm: the update's passes without `lora_inputs_uncast`, so peft casts each LoRA input
    to fp32 and autocast back."""
    import mmrgrpo.bf16_update as b16              # its speed-up's pass_context calls lora_inputs_uncast from there
    if "peft input casts" not in arm: return contextlib.nullcontext()
    return mock.patch.object(b16, "lora_inputs_uncast", lambda model: contextlib.nullcontext())


def profile_update(net, cfg, params: dict, init: dict, ro, adv, c) -> dict:
    """Seconds by kind of op (`benchlib.op_kinds`) of one update of `net` with `cfg` from the initial weights, under
    torch's profiler."""
    import torch
    import mmrgrpo.trainer as tr
    from torch.profiler import profile, ProfilerActivity
    with torch.no_grad():
        for n, p in params.items(): p.copy_(init[n])
    opt = torch.optim.AdamW(list(params.values()), lr=c.learning_rate, weight_decay=c.weight_decay)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter(); tr.update(net, opt, ro, adv, cfg, None, tr.Phases(), {})
        wall = time.perf_counter() - t0
    return bl.op_kinds(prof, wall, kinds=("matmul", "attention backward", "attention", "copies and casts", "optimizer"))


def main(argv=None):
    ap = bl.common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--repeats", type=int, default=None,
                    help="timings per matmul shape and per update arm (default 3; --quick 2)")
    ap.add_argument("--warmup", type=int, default=1, help="unrecorded update rounds first")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    ap.add_argument("--baseline-ref", default=None,
                    help="also time the update (fp32, bf16 autocast) as the package was at this commit")
    ap.add_argument("--baseline-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--arms", nargs="+", default=None, metavar="ARM",
                    help="time only these arms (default: all); the first is the ratios' base")
    ap.add_argument("--profile", nargs="*", default=None, metavar="ARM",
                    help="after the timed rounds, one more update of each ARM (default: fp32 and what auto gives) "
                         "under torch's profiler, its time split by kind of op")
    args = ap.parse_args(argv)
    if args.baseline_worker: return baseline_worker(args)
    bl.set_threads(args.threads)
    meta = bl.start_meta()
    import torch
    import mmrgrpo.trainer as tr
    from mmrgrpo.config import load_config
    from mmrgrpo.data import task_source, tasks_for_step
    from mmrgrpo.models import load_policy, trainable_parameters
    from mmrgrpo.rewards import get_reward_funcs
    from mmrgrpo.advantages import group_advantages
    from mmrgrpo.fast_update import keep_freed_memory
    from mmrgrpo.bf16_update import bf16_frozen_base
    import copy, tempfile
    # as the trainer does on a CPU (62_fast_update); the old code's arms run without it
    kept = keep_freed_memory()
    repeats = args.repeats or (2 if args.quick else 3)
    c = load_config(overrides=args.set, **dict(bl.QUICK_CONFIG if args.quick else bl.BENCH_CONFIG, steps=1,
                                               output_dir="runs/bench_compute", threads=args.threads))
    # ---- part 2's rollout first, so the matmul shapes can use its token count
    model, tok = load_policy(c)
    backend = tr.make_backend(c, model, tok)           # the trainer's sampler (the bench config: a merged fp32 copy)
    records = tasks_for_step(task_source(c.task, seed=c.seed), 0, c.prompts_per_step, c.seed)
    prompts = [tr.build_prompt(tok, c, r["question"], c.task) for r in records]
    ro = backend.generate(prompts, c.num_generations, c.max_completion_length, c.temperature, c.top_p,
                          seed=tr.step_seed(c.seed, 0))
    rewards, _ = tr.score(ro, records, get_reward_funcs(c.reward_funcs), c)
    adv = group_advantages(rewards, ro.group_size, scale=c.scale_rewards_)
    N, T = ro.completion_ids.shape
    P = ro.prompt_ids.shape[1]
    pc = param_counts(model)
    share = c.share_prompt and not c.gradient_checkpointing
    flops = update_flops(pc, padded_counts(N, ro.group_size, P, T, share), bool(c.beta_))
    useful = update_flops(pc, useful_counts(ro), bool(c.beta_))

    # ---- part 1: matmul peaks
    tokens = 256 if args.quick else flops["body_tokens"]
    sq = 256 if args.quick else 2048
    d, f, V = (64, 128, pc["vocab"]) if args.quick else (576, 1536, pc["vocab"])
    shapes = {f"square {sq}^3": (sq, sq, sq), f"{tokens}x{d} @ {d}x{f} (gate/up)": (tokens, d, f),
              f"{tokens}x{f} @ {f}x{d} (down)": (tokens, f, d), f"{tokens}x{d} @ {d}x{d} (q/o)": (tokens, d, d),
              f"1024x{d} @ {d}x{V} (head chunk)": (1024, d, V)}
    print(f"matmul throughput, fp32 and bf16 interleaved, {repeats} repeats, threads={torch.get_num_threads()}, "
          f"CPU flags {bl.cpu_flags()}")
    mm = matmul_bench(shapes, repeats)
    mm_rows = [{"shape": k, "fp32_GFLOPs": v["fp32"]["median"], "bf16_GFLOPs": v["bf16"]["median"],
                "bf16/fp32": v["bf16"]["median"] / v["fp32"]["median"]} for k, v in mm.items()]
    print(bl.table(mm_rows, ["shape", "fp32_GFLOPs", "bf16_GFLOPs", "bf16/fp32"],
                   {"fp32_GFLOPs": ".1f", "bf16_GFLOPs": ".1f", "bf16/fp32": ".2f"}))
    peak = {dt: max(v[dt]["median"] for v in mm.values()) for dt in ("fp32", "bf16")}
    print(f"peak (best shape): fp32 {peak['fp32']:.1f} GFLOP/s, bf16 {peak['bf16']:.1f} GFLOP/s")

    # ---- part 2: the update phase, its arms interleaved (62_fast_update's and 62b_bf16_update's switches one at a
    # time, and the old code)
    params = trainable_parameters(model)
    init = {n: p.detach().clone() for n, p in params.items()}
    base16 = copy.deepcopy(model)                       # the same policy with its frozen base stored in bf16
    bf16_frozen_base(base16)
    p16 = trainable_parameters(base16)
    # the bench config's passes; `bf16 base, auto passes` drops it
    mb = dict(micro_batch_size=16 if not args.quick else 0)
    pad = dict(pack_completions=False)
    arms = {"fp32, padded": (model, dataclasses.replace(c, autocast_bf16=False, **mb, **pad)),
            "fp32": (model, dataclasses.replace(c, autocast_bf16=False, **mb)),
            "fp32, matmul attention": (model, dataclasses.replace(c, autocast_bf16=False, update_attention="matmul",
                                                                  **mb)),
            "bf16 autocast, plain head": (model, dataclasses.replace(c, autocast_bf16=True, fused_head=False, **mb,
                                                                     **pad)),
            "bf16 autocast": (model, dataclasses.replace(c, autocast_bf16=True, **mb, **pad)),
            "bf16 base": (base16, dataclasses.replace(c, autocast_bf16=True, **mb, **pad)),
            "bf16 base, auto passes": (base16, dataclasses.replace(c, autocast_bf16=True, micro_batch_size=0, **pad)),
            "bf16 base, auto passes, packed": (base16, dataclasses.replace(c, autocast_bf16=True, micro_batch_size=0)),
            "bf16 base, auto passes, packed, sdpa attention":
                (base16, dataclasses.replace(c, autocast_bf16=True, micro_batch_size=0, update_attention="sdpa")),
            "bf16 base, auto passes, packed, peft input casts":
                (base16, dataclasses.replace(c, autocast_bf16=True, micro_batch_size=0))}
    if args.arms:
        if unknown := [a for a in args.arms if a not in arms]:
            raise SystemExit(f"--arms: no arm {unknown}; arms: {list(arms)}")
        arms = {a: arms[a] for a in args.arms}
    worker = None
    if args.baseline_ref:
        with tempfile.NamedTemporaryFile(suffix=".pt", delete=False) as f: shared = f.name
        torch.save({"rollout": {k: getattr(ro, k) for k in ("prompts", "completions", "prompt_ids", "prompt_mask",
                                                           "completion_ids", "completion_mask", "group_size")},
                    "advantages": adv, "init": init}, shared)
        worker = bl.BaselineWorker(args.baseline_ref, __file__,
                                   ["--threads", str(args.threads), *(["--quick"] if args.quick else []),
                                    *(["--set", *args.set] if args.set else [])])
        for name in ("fp32", "bf16 autocast"): arms[f"{name}@{worker.ref}"] = None
    raw = {k: [] for k in arms}
    for rep, name in bl.interleaved(list(arms), args.warmup + repeats):
        if arms[name] is None:
            rec = worker.run(arm=name.split("@")[0], shared=shared)
            total, times, loss = rec["total"], rec["times"], rec["loss"]
        else:
            net, cfg = arms[name]
            ps = p16 if net is base16 else params
            with torch.no_grad():
                for n, p in ps.items(): p.copy_(init[n])
            opt = torch.optim.AdamW(list(ps.values()), lr=c.learning_rate, weight_decay=c.weight_decay)
            ph = tr.Phases()
            with peft_casts(name):
                t0 = time.perf_counter()
                m = tr.update(net, opt, ro, adv, cfg, None, ph, {})
                total, times, loss = time.perf_counter() - t0, dict(ph.t), m["loss"]
        print(f"  {'warm-up' if rep < args.warmup else f'round {rep - args.warmup + 1}'} {name:28s} {total:6.2f}s  " +
              " ".join(f"{k}={v:.2f}" for k, v in times.items()), flush=True)
        if rep >= args.warmup:
            raw[name].append({"total": total, **{f"time/{k}": v for k, v in times.items()}, "loss": loss})
    if worker is not None: worker.close(); Path(shared).unlink()
    profiled = {}
    for name in ([] if args.profile is None else args.profile or ["fp32", "bf16 base, auto passes, packed"]):
        if arms.get(name) is None:
            raise SystemExit(f"--profile: no arm {name!r} of this process; arms: {[a for a in arms if arms[a]]}")
        with peft_casts(name):
            profiled[name] = profile_update(*arms[name], p16 if arms[name][0] is base16 else params, init, ro, adv, c)
    upd_rows = []
    for name, xs in raw.items():
        t = bl.median([x["total"] for x in xs])
        t_ref = bl.median([x.get("time/ref", 0.0) for x in xs])
        t_pol = bl.median([x.get("time/update", 0.0) for x in xs])
        dt = "bf16" if "bf16" in name else "fp32"
        ach = flops["total"] / t
        upd_rows.append({"arm": name, "update_phase_s": t, "ref_s": t_ref, "policy_s": t_pol,
                         "GFLOPs_achieved": ach / 1e9, "frac_of_own_peak": ach / (peak[dt] * 1e9),
                         "useful_GFLOPs": useful["total"] / t / 1e9,
                         "useful_frac_of_own_peak": useful["total"] / t / (peak[dt] * 1e9),
                         "frac_of_fp32_peak": ach / (peak["fp32"] * 1e9),
                         "ref_GFLOPs": flops["ref_forward"] / t_ref / 1e9 if t_ref else None,
                         "policy_GFLOPs": (flops["policy_forward"] + flops["backward"]) / t_pol / 1e9
                                          if t_pol else None,
                         "conventional_frac_of_own_peak": flops["conventional_total"] / t / (peak[dt] * 1e9)})
    for r in upd_rows: r["time_ratio_vs_fp32"] = r["update_phase_s"] / upd_rows[0]["update_phase_s"]
    print(f"\nupdate phase on {N} completions (prompt width {P}, completion width {T}, prompt sharing {share}, "
          f"beta {c.beta_}): {flops['total'] / 1e12:.3f} TFLOP on the padded rows "
          f"({flops['conventional_total'] / 1e12:.3f} conventional), "
          f"{useful['total'] / 1e12:.3f} TFLOP on the tokens that count")
    print(bl.table(upd_rows, ["arm", "update_phase_s", "ref_s", "policy_s", "GFLOPs_achieved", "frac_of_own_peak",
                              "useful_frac_of_own_peak", "frac_of_fp32_peak", "ref_GFLOPs", "policy_GFLOPs"],
                   {"update_phase_s": ".2f", "ref_s": ".2f", "policy_s": ".2f", "GFLOPs_achieved": ".1f",
                    "frac_of_own_peak": ".1%", "useful_frac_of_own_peak": ".1%", "frac_of_fp32_peak": ".1%",
                    "ref_GFLOPs": ".1f", "policy_GFLOPs": ".1f"}))
    print(f"update time / {upd_rows[0]['arm']}'s: "
          + ", ".join(f"{r['arm']} {r['time_ratio_vs_fp32']:.2f}" for r in upd_rows))
    if profiled:
        print("\none update per arm under torch's profiler, seconds by kind of op "
              "(own CPU time; outside ops: wall minus the ops)")
        print(bl.table([{"arm": a, **v} for a, v in profiled.items()], ["arm", *next(iter(profiled.values()))],
                       {k: ".2f" for k in next(iter(profiled.values()))}))
    out = {"name": "compute_efficiency", "quick": args.quick, "baseline_ref": worker.ref if worker else None,
           "keep_freed_memory": kept, "config": dataclasses.asdict(c), "repeats": repeats,
           "matmul": {"shapes": {k: list(v) for k, v in shapes.items()}, "gflops": mm, "peak_gflops": peak},
           "model": pc, "rollout": {"rows": N, "prompt_width": P, "completion_width": T, "prompt_sharing": share,
                                    "valid_tokens": int(ro.completion_mask.sum())},
           "update_flops": flops, "useful_update_flops": useful, "update": upd_rows, "raw": raw,
           "update_profile_s": profiled,
           "flop_formula": __doc__[__doc__.index("FLOP count"):__doc__.index("    python bench")].strip(),
           "meta": bl.finish_meta(meta)}
    p = bl.write_json(Path(args.out) if args.out else bl.result_path("compute_efficiency", args.quick), out)
    print(f"wrote {p}")


if __name__ == "__main__":
    main()
