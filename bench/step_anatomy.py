"""Where the time of one training step goes: wall-clock per phase, generation tokens/s, peak memory.

Runs the real training loop (`mmrgrpo.trainer.train`) on a fixed config: SmolLM2-135M-Instruct with LoRA (r=16,
alpha=32, all seven projections), G=8 completions for each of 8 prompts (64 per step), 48 new tokens, arithmetic level
2, beta=0.04 (so the reference-model pass runs), MMR on (embed + reweight) and GMTS token selection on. It reads the
per-phase times the trainer logs for every step (`time/generate`, `time/reward`, `time/mmr`, `time/ref`, `time/update`,
`time/select`, `time/step`); `other` is the rest of the step (advantages, pruning bookkeeping, optimizer bookkeeping,
weight sync). The first step is a warm-up (first-call allocation and kernel selection) and is reported but left out of
the medians.

Generation throughput is given two ways: valid completion tokens per second (tokens up to and including EOS, what the
loss sees) and generated positions per second (rows x the longest completion of the batch: what `generate` computes,
padding after EOS included). The recorded rollout shapes come from a thin wrapper of the sampler the trainer builds
(`make_backend`) that only counts.

    python bench/step_anatomy.py                # full: 5 steps, about 6 min on 2 cores (~60 s/step)
    python bench/step_anatomy.py --quick        # tiny random model, seconds
"""
import argparse, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl

PHASES = ["generate", "reward", "mmr", "ref", "update", "select"]


def recording_backend(log: list):
    """The trainer's `make_backend`, wrapped: the sampler it builds records the shape of every sampled rollout it
    returns."""
    import mmrgrpo.trainer as tr
    make = tr.make_backend
    def make_recording(*args, **kwargs):
        backend = make(*args, **kwargs)
        generate = backend.generate
        def recorded(prompts, num_generations, max_new_tokens, *a, greedy=False, **kw):
            ro = generate(prompts, num_generations, max_new_tokens, *a, greedy=greedy, **kw)
            if not greedy:
                log.append({"rows": len(ro.completions), "prompt_len": ro.prompt_ids.shape[1],
                            "gen_len": ro.completion_ids.shape[1], "valid_tokens": int(ro.completion_mask.sum())})
            return ro
        backend.generate = recorded
        return backend
    return make_recording


def main(argv=None):
    ap = bl.common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps (default 5; --quick: 3); the first is a warm-up")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides, e.g. max_completion_length=32")
    args = ap.parse_args(argv)
    bl.set_threads(args.threads)
    meta = bl.start_meta()
    import mmrgrpo.trainer as tr
    from mmrgrpo.config import load_config
    steps = args.steps or (3 if args.quick else 5)
    base = dict(bl.QUICK_CONFIG if args.quick else bl.BENCH_CONFIG, mmr=True, token_selection="gmts", steps=steps,
                threads=args.threads)
    shapes = []
    orig = tr.make_backend
    tr.make_backend = recording_backend(shapes)
    try:
        with tempfile.TemporaryDirectory() as d:
            c = load_config(overrides=args.set, **dict(base, output_dir=d))
            t0 = time.perf_counter()
            res = tr.train(c, progress=False)
            wall = time.perf_counter() - t0
    finally:
        tr.make_backend = orig
    # the trainer no longer builds its sampler with tr.make_backend: estimate instead
    if len(shapes) != len(res.metrics):
        print(f"WARNING: recorded {len(shapes)} rollouts for {len(res.metrics)} steps; "
              "generated positions/s is an estimate (rows x max_completion_length)")
        n = c.num_generations * c.prompts_per_step
        shapes = [{"rows": n, "prompt_len": None, "gen_len": c.max_completion_length,
                   "valid_tokens": round(r["completion_length"] * n)} for r in res.metrics]
    global PHASES     # any other phase the trainer times (e.g. old_logp with num_iterations > 1) gets a column too
    PHASES = PHASES + sorted({k[5:] for r in res.metrics for k in r if k.startswith("time/")} - set(PHASES) - {"step"})
    rows = []
    for r, s in zip(res.metrics, shapes):
        row = {"step": r["step"], **{p: r.get(f"time/{p}", 0.0) for p in PHASES}, "step_s": r["time/step"]}
        row["other"] = row["step_s"] - sum(row[p] for p in PHASES)
        row.update(s)
        row["valid_tok_per_s"] = s["valid_tokens"] / row["generate"]
        row["gen_pos_per_s"] = s["rows"] * s["gen_len"] / row["generate"]
        row["mean_reward"] = r.get("reward"); row["completion_length"] = r.get("completion_length")
        row["tokens/kept_fraction"] = r.get("tokens/kept_fraction")
        row.update({f"mem_{p}": r[f"memory/{p}"] for p in PHASES if f"memory/{p}" in r})
        rows.append(row)
    timed = rows[1:] if len(rows) > 1 else rows
    cols = PHASES + ["other", "step_s", "valid_tok_per_s", "gen_pos_per_s"]
    med = {k: bl.median([r[k] for r in timed]) for k in cols}
    share = {p: med[p] / med["step_s"] for p in PHASES + ["other"]}
    print(f"config: {c.model}, G={c.num_generations}, prompts={c.prompts_per_step}, "
          f"new tokens={c.max_completion_length}, task={c.task}, beta={c.beta_}, mmr={c.mmr}, "
          f"token_selection={c.token_selection}, threads={bl.machine_info()['torch_threads']}")
    print("\nper step (seconds; step 1 is a warm-up, left out of the medians)")
    print(bl.table(rows, ["step"] + PHASES + ["other", "step_s", "valid_tok_per_s", "gen_pos_per_s"], {"step": "d"}))
    print("\nmedian over timed steps")
    print(bl.table([{"phase": p, "seconds": med[p], "share_of_step": share[p]} for p in PHASES + ["other"]] +
                   [{"phase": "step", "seconds": med["step_s"], "share_of_step": 1.0}],
                   ["phase", "seconds", "share_of_step"], {"seconds": ".2f", "share_of_step": ".1%"}))
    print(f"\ngeneration: {med['valid_tok_per_s']:.0f} valid completion tokens/s, "
          f"{med['gen_pos_per_s']:.0f} generated positions/s")
    mem = {p: max(r[f"mem_{p}"] for r in rows if f"mem_{p}" in r) for p in PHASES if any(f"mem_{p}" in r for r in rows)}
    if mem:
        print("\npeak resident memory of the whole process during each phase (MiB, max over steps; "
              "sampled every 5 ms by the trainer, from each phase's start)")
        print(bl.table([{"phase": p, "peak_mb": v} for p, v in mem.items()], ["phase", "peak_mb"], {"peak_mb": ".0f"}))
    rss_self, rss_children = bl.peak_rss_mb(), bl.peak_rss_mb(bl.resource.RUSAGE_CHILDREN)
    print(f"peak RSS: {rss_self:.0f} MiB (this process), {rss_children:.0f} MiB (largest child: reward workers)")
    from dataclasses import asdict
    out = {"name": "step_anatomy", "quick": args.quick, "config": asdict(c), "steps": rows, "warmup_steps": 1,
           "median": med, "share_of_step": share, "phase_peak_rss_mb": mem, "peak_rss_mb": rss_self,
           "peak_rss_children_mb": rss_children,
           "train_wall_s": wall, "meta": bl.finish_meta(meta),
           "notes": "times in seconds from the trainer's time/* metrics; other = time/step - sum of the listed phases; "
                    "valid_tok_per_s = completion tokens up to EOS / time/generate; gen_pos_per_s = rows x longest "
                    "completion / time/generate"}
    p = bl.write_json(Path(args.out) if args.out else bl.result_path("step_anatomy", args.quick), out)
    print(f"wrote {p}")


if __name__ == "__main__":
    main()
