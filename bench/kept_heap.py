"""When the trainer hands kept memory back: after every step, once the heap has grown (`KeptHeap`, default), or never.

With `keep_freed_memory` on (a CPU run's default), glibc keeps freed memory in the process so a step reuses its blocks
instead of faulting fresh pages in. Between steps the trainer may hand it back (`malloc_trim`): memory stays bounded,
but the next step faults everything in again. Three arms, each a training run in a process of its own (clean memory
accounting), alternated arm by arm `--repeats` times:
- `every`: hand back after every step (the trainer before `KeptHeap`);
- `grown`: hand back once the resident set a step ends with has grown by more than 10% (`KeptHeap`, the default);
- `never`: keep everything between steps.
The run is the demo's training (`mmrgrpo.cli.DEMO`: SmolLM2-135M + LoRA, 8 prompts x 8 completions of up to 32 tokens,
auto precision; `--set KEY=VALUE ...` overrides it) for `--steps` steps, without its evaluations and checkpoints. Per
run: the medians over steps 2.. of `time/step`, `time/generate` and `time/update`; minor page faults per step (the
kernel's count, read at every step's end); each step's resident memory at its end and `memory/update`; the process's
maximum resident set; how often memory was handed back (`allocator/handed_back`).

    python bench/kept_heap.py                  # 3 arms x 2 runs x 12 steps: about 15 min on 2 cores
    python bench/kept_heap.py --quick          # tiny random model, seconds
"""
import argparse, json, statistics, subprocess, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl

ARMS = ["every", "grown", "never"]


def one_run(arm: str, steps: int, quick: bool, threads: int, overrides=()) -> dict:
    "A training run with `arm`'s rule, in this process; per-step records."
    import resource, tempfile, time
    import mmrgrpo.trainer as tr
    from mmrgrpo.cli import DEMO
    from mmrgrpo.config import load_config
    from mmrgrpo.fast_update import KeptHeap, trim_freed_memory
    from mmrgrpo.runlog import rss_sampler
    if arm == "every": KeptHeap.after_step = lambda self, rss_mb: trim_freed_memory() or True
    elif arm == "never": KeptHeap.after_step = lambda self, rss_mb: False
    faults, ends = [], []
    step = tr.train_step
    def counted(*a, **kw):                     # the kernel's minor faults and the resident set at each step's end
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = step(*a, **kw)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0); ends.append(rss_sampler().rss_mb())
        return out
    tr.train_step = counted
    base = dict(bl.QUICK_CONFIG, num_generations=4) if quick else DEMO
    with tempfile.TemporaryDirectory() as out:
        c = load_config(overrides=list(overrides) or None,
                        **dict(base, steps=steps, eval_size=0, eval_before=False, save_every=0, save_best=False,
                               log_completions_every=0, output_dir=out, overwrite=True, threads=threads))
        t0 = time.perf_counter(); res = tr.train(c); wall = time.perf_counter() - t0
    rows = [{"time/step": m["time/step"], "time/generate": m.get("time/generate"), "time/update": m.get("time/update"),
             "memory/update": m.get("memory/update"), "handed_back": m.get("allocator/handed_back"),
             "minor_faults": f, "rss_end_mb": e} for m, f, e in zip(res.metrics, faults, ends)]
    return {"arm": arm, "wall_s": wall, "max_rss_mb": bl.peak_rss_mb(), "steps": rows}


def main(argv=None):
    ap = bl.common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--steps", type=int, default=None, help="training steps a run (default 12; --quick: 3)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per arm, alternated arm by arm")
    ap.add_argument("--arms", nargs="*", default=ARMS, choices=ARMS)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides, e.g. autocast_bf16=false sampler_dtype=float32")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    steps = args.steps or (3 if args.quick else 12)
    if args.worker:
        bl.set_threads(args.threads)
        print("RESULT " + json.dumps(one_run(args.worker, steps, args.quick, args.threads, args.set)))
        return
    meta = bl.start_meta()
    runs = []
    for rep, arm in bl.interleaved(args.arms, args.repeats):
        cmd = [sys.executable, __file__, "--worker", arm, "--steps", str(steps), "--threads", str(args.threads),
               *(["--quick"] if args.quick else []), *(["--set", *args.set] if args.set else [])]
        done = subprocess.run(cmd, capture_output=True, text=True)
        line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
        if done.returncode or line is None: raise SystemExit(f"{arm} run failed:\n{done.stderr[-3000:]}")
        run = json.loads(line[len("RESULT "):]); run["repeat"] = rep; runs.append(run)
        later = run["steps"][1:] or run["steps"]
        med = lambda k: statistics.median(r[k] for r in later if r[k] is not None)
        print(f"  run {rep + 1} {arm:5s} step {med('time/step'):6.2f}s  generate {med('time/generate'):5.2f}s  update "
              f"{med('time/update'):5.2f}s  faults/step {med('minor_faults') * 4 / 1024:6.0f} MiB  handed back "
              f"{sum(r['handed_back'] or 0 for r in run['steps']):.0f}x  max RSS {run['max_rss_mb']:.0f} MiB  ends "
              f"{[round(r['rss_end_mb']) for r in run['steps']]}", flush=True)
    summary = []
    for arm in args.arms:
        rs = [r for r in runs if r["arm"] == arm]
        later = [s for r in rs for s in (r["steps"][1:] or r["steps"])]
        med = lambda k: statistics.median(s[k] for s in later if s[k] is not None)
        summary.append({"arm": arm, "step_s": med("time/step"), "generate_s": med("time/generate"),
                        "update_s": med("time/update"),
                        "faulted_MiB_per_step": med("minor_faults") * 4 / 1024, "handed_back_per_run": statistics.mean(
                            sum(s["handed_back"] or 0 for s in r["steps"]) for r in rs),
                        "max_rss_MiB": max(r["max_rss_mb"] for r in rs),
                        "last_end_MiB": max(r["steps"][-1]["rss_end_mb"] for r in rs)})
    for s in summary: s["step_vs_every"] = s["step_s"] / summary[0]["step_s"]
    print(f"\nmedians over steps 2..{steps} of {args.repeats} runs per arm (faults: the kernel's minor faults x 4 KiB)")
    print(bl.table(summary, list(summary[0]),
                   {k: ".2f" for k in ("step_s", "generate_s", "update_s", "step_vs_every")} |
                   {"faulted_MiB_per_step": ".0f", "handed_back_per_run": ".1f", "max_rss_MiB": ".0f",
                    "last_end_MiB": ".0f"}))
    out = {"name": "kept_heap", "quick": args.quick, "overrides": args.set, "steps": steps, "repeats": args.repeats,
           "summary": summary, "runs": runs, "meta": bl.finish_meta(meta)}
    p = bl.write_json(Path(args.out) if args.out else bl.result_path("kept_heap", args.quick), out)
    print(f"wrote {p}")


if __name__ == "__main__":
    main()
