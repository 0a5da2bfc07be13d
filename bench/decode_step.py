"""One decode step of the sampler at fixed row counts, split into its parts: the fixed cost per step and where it goes.

The fixed cost per step is what generation pays whatever the batch. The bench config's policy (SmolLM2-135M-Instruct +
LoRA r=16 on all seven projections, fp32), its 8 arithmetic prompts of training step 0 (the longest ~100 tokens),
prefilled, then decode steps of B rows (B = 1, 8, 16, 32, 64; the prompts repeated to B rows) at the positions right
after the prompt. Arms, interleaved, each a median over `--repeats` rounds of `--steps` steps:
- `policy`: transformers' forward on the fp32 LoRA policy (three matmuls per adapted layer), the reserved KV cache;
- `copy-fp32`, `copy-bf16`: transformers' forward on the merged sampling copy (61_sampler_copy);
- `fused-fp32`, `fused-bf16`: the fused decoder (61a_fused_decode) on the same copy;
- `fused-bf16-plain`: the fused decoder with packing (and so norm folding) off: what the blocked weight layout buys;
- `fused-bf16-attn16`: the fused decoder with its KV cache and attention in bf16 whatever the CPU (`attn_dtype`; the
  default attends in fp32 on a CPU without AMX, `attention_dtype`).
Per arm: time per step = fixed + per_row x rows, a least-squares fit over the five batch sizes; the fixed part is the
cost a decode step pays whatever the batch.

Parts: torch's profiler over `--steps` decode steps at 32 rows for `copy-bf16`, `fused-bf16` and `fused-bf16-attn16`,
each op's own CPU time sorted into matmuls (mm, addmm, bmm, oneDNN linear), attention (scaled_dot_product_*), copies and
casts (copy_, _to_copy, cat, index*, clone, contiguous), elementwise (everything else the profiler counts), and
"outside ops": the wall-clock of the step minus the ops' CPU time (Python, transformers' bookkeeping, the dispatcher
between ops).

`torch.compile` (`--compile`): the fused decoder's step (its plain weights: oneDNN's packed weights are opaque to the
compiler) compiled for one fixed shape (32 rows, one position), the first call's compile time counted and reported, then
the median step, beside the eager fused step.

    python bench/decode_step.py                 # about 4 min on 2 cores (with --compile: plus the compile)
    python bench/decode_step.py --quick         # tiny random model, seconds
"""
import argparse, statistics, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl

ARMS = ["policy", "copy-fp32", "copy-bf16", "fused-fp32", "fused-bf16", "fused-bf16-plain", "fused-bf16-attn16"]
ROWS = [1, 8, 16, 32, 64]


def decoder_for(arm, model, dtype):
    """A function (ids, pos, state) -> logits for one decode step of `arm`, and a function making the state after a
    prefill."""
    import torch
    from mmrgrpo import fused_decode as fd
    from mmrgrpo.kvcache import reserve_cache
    from mmrgrpo.sampler_copy import merged_copy
    from mmrgrpo.logprobs import cache_kwarg, output_cache
    if arm.startswith("fused"):
        copy = merged_copy(model, dtype)
        if arm.endswith("-plain"):
            keep, fd.can_pack = fd.can_pack, lambda w: False
            try: dec = fd.FusedDecoder(copy)
            finally: fd.can_pack = keep
        else: dec = fd.FusedDecoder(copy, torch.bfloat16 if arm.endswith("-attn16") else None)
        def prefill(ids, mask, room): return dec.prefill(ids, mask, 1, room)
        def step(ids, pos, cache): return dec.decode(ids, pos, cache)
        return prefill, step
    net = model if arm == "policy" else merged_copy(model, dtype)
    name = cache_kwarg(net)
    def prefill(ids, mask, room):
        with torch.no_grad():
            cache = output_cache(net.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=True,
                                                   position_ids=(mask.cumsum(-1) - 1).clamp(min=0)))
        return {"cache": reserve_cache(cache, room), "mask": mask}
    def step(ids, pos, state):
        state["mask"] = torch.cat([state["mask"], state["mask"].new_ones(len(ids), 1)], 1)
        with torch.no_grad():
            return net(input_ids=ids, attention_mask=state["mask"], position_ids=pos, use_cache=True, logits_to_keep=1,
                       **{name: state["cache"]}).logits[:, -1]
    return prefill, step


def time_steps(prefill, step, ids, mask, steps: int) -> list:
    "Seconds of each of `steps` decode steps after a prefill of `ids` (B, P)."
    import torch
    state = prefill(ids[:, :-1], mask[:, :-1], steps + 1)
    pos, tok, out = mask.sum(-1, keepdim=True) - 1, ids[:, -1:], []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = step(tok, pos, state)
        out.append(time.perf_counter() - t0)
        tok, pos = logits.float().max(-1).indices[:, None], pos + 1
    return out


def fit(rows: list, seconds: list) -> tuple:
    "(fixed, per_row) of the least-squares line seconds = fixed + per_row x rows."
    mx, my = statistics.fmean(rows), statistics.fmean(seconds)
    per_row = sum((x - mx) * (y - my) for x, y in zip(rows, seconds)) / sum((x - mx) ** 2 for x in rows)
    return my - per_row * mx, per_row


def parts(prefill, step, ids, mask, steps: int) -> dict:
    """Milliseconds per step by kind of op (own CPU time), and outside ops (wall minus the ops' time), from torch's
    profiler."""
    from torch.profiler import profile, ProfilerActivity
    state = prefill(ids[:, :-1], mask[:, :-1], steps + 1)
    pos, tok = mask.sum(-1, keepdim=True) - 1, ids[:, -1:]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = step(tok, pos, state); tok, pos = logits.float().max(-1).indices[:, None], pos + 1
        wall = time.perf_counter() - t0
    out = {k: v * 1e3 for k, v in bl.op_kinds(prof, wall, steps).items()}
    out["step (wall, profiled)"] = out.pop("wall (profiled)")
    return out


def compiled_step(model, ids, mask, steps: int) -> dict:
    """torch.compile of the fused decoder's step for one fixed shape (unpacked weights): first-call seconds and the
    median step."""
    import torch
    from mmrgrpo import fused_decode as fd
    from mmrgrpo.sampler_copy import merged_copy
    keep, fd.can_pack = fd.can_pack, lambda w: False
    try: dec = fd.FusedDecoder(merged_copy(model, torch.bfloat16))
    finally: fd.can_pack = keep
    cache = dec.prefill(ids[:, :-1], mask[:, :-1], 1, 2)
    n, pos, tok = cache.n, mask.sum(-1, keepdim=True) - 1, ids[:, -1:]
    fn = torch.compile(lambda t, p: dec.forward(t, p, cache, cache.bias[..., :n + 1]), dynamic=False)
    def once():
        cache.n = n                    # the same position every call: one shape, one compilation
        t0 = time.perf_counter(); fn(tok, pos); return time.perf_counter() - t0
    first = once()
    times = [once() for _ in range(steps)]
    eager = []
    for _ in range(steps):
        cache.n = n; t0 = time.perf_counter(); dec.decode(tok, pos, cache); eager.append(time.perf_counter() - t0)
    return {"first_call_s": first, "compiled_step_s": statistics.median(times),
            "eager_plain_step_s": statistics.median(eager), "rows": len(ids)}


def main(argv=None):
    ap = bl.common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--repeats", type=int, default=None, help="rounds per arm and batch size (default 3; --quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per round (default 8; --quick 2)")
    ap.add_argument("--arms", nargs="*", default=ARMS, choices=ARMS)
    ap.add_argument("--compile", action="store_true",
                    help="also time torch.compile of the fused step (compile time counted)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    args = ap.parse_args(argv)
    bl.set_threads(args.threads)
    meta = bl.start_meta()
    import torch
    from generation import bench_inputs
    repeats, steps = args.repeats or (1 if args.quick else 3), args.steps or (2 if args.quick else 8)
    c, model, tok, prompts, seed = bench_inputs(args)
    model.eval()
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    rows = [1, 4] if args.quick else ROWS
    batch = {b: (enc.input_ids.repeat(-(-b // len(prompts)), 1)[:b],
                 enc.attention_mask.repeat(-(-b // len(prompts)), 1)[:b])
             for b in rows}
    dtypes = {a: torch.bfloat16 if "bf16" in a else torch.float32 for a in args.arms}
    arms = {a: decoder_for(a, model, dtypes[a]) for a in args.arms}
    raw = {a: {b: [] for b in rows} for a in args.arms}
    for rnd, arm in bl.interleaved(args.arms, repeats + 1):
        for b in rows:
            ts = time_steps(*arms[arm], *batch[b], steps)
            if rnd: raw[arm][b].append(statistics.median(ts))
        print(f"  {'warm-up' if rnd == 0 else f'round {rnd}'} {arm:17s} " +
              " ".join(f"{b}:{raw[arm][b][-1] * 1e3:.1f}ms" for b in rows if raw[arm][b]), flush=True)
    summary = []
    for a in args.arms:
        med = [statistics.median(raw[a][b]) for b in rows]
        fixed, per_row = fit(rows, med)
        summary.append({"arm": a, **{f"ms@{b}": m * 1e3 for b, m in zip(rows, med)}, "fixed_ms": fixed * 1e3,
                        "per_row_ms": per_row * 1e3})
    print(f"\none decode step after the prompt (width {enc.input_ids.shape[1]}), "
          f"medians of {repeats} rounds of {steps} steps:")
    print(bl.table(summary, ["arm", *[f"ms@{b}" for b in rows], "fixed_ms", "per_row_ms"],
                   {k: ".1f" for k in [*[f"ms@{b}" for b in rows], "fixed_ms"]} | {"per_row_ms": ".2f"}))
    prof_rows = 4 if args.quick else 32
    breakdown = {a: parts(*arms[a], *batch[prof_rows], steps)
                 for a in ("copy-bf16", "fused-bf16", "fused-bf16-attn16") if a in arms}
    for a, p in breakdown.items():
        print(f"\n{a}, one step of {prof_rows} rows, ms by part: " + ", ".join(f"{k} {v:.1f}" for k, v in p.items()))
    comp = compiled_step(model, *batch[prof_rows], steps) if args.compile else None
    if comp:
        print(f"\ntorch.compile of the fused step ({prof_rows} rows, plain bf16 weights): "
              f"first call {comp['first_call_s']:.1f} s, then {comp['compiled_step_s'] * 1e3:.1f} ms a step "
              f"against {comp['eager_plain_step_s'] * 1e3:.1f} ms eager")
    from dataclasses import asdict
    out = {"name": "decode_step", "quick": args.quick, "config": asdict(c), "rows": rows, "repeats": repeats,
           "steps": steps,
           "prompt_width": enc.input_ids.shape[1], "summary": summary, "raw_s": raw, "parts_ms": breakdown,
           "parts_rows": prof_rows, "compile": comp, "meta": bl.finish_meta(meta),
           "notes": "fixed_ms/per_row_ms: least-squares fit of the median step time over the row counts; "
                    "parts: own CPU time of each kind of op per step under torch's profiler, "
                    "outside ops = profiled wall minus the ops' time"}
    p = bl.write_json(Path(args.out) if args.out else bl.result_path("decode_step", args.quick), out)
    print(f"wrote {p}")


if __name__ == "__main__":
    main()
