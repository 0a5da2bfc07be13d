"""The demo's held-out accuracy across seeds, with the speed switches on (the defaults) and off.

Each run is `mmrgrpo demo seed=S output_dir=... [switches]` in its own process; `--parallel N` runs N at once, each on
`--threads` CPU threads. The runs are for their accuracy only: with several at once, their times mean nothing.

    python bench/demo_seeds.py --seeds 2 3 4 5 --parallel 2 --threads 1
    python bench/demo_seeds.py --seeds 0 1 2 3 4 5 6 7 8 9 --arms defaults --runs runs/demo_seeds_packed \
        --out bench/results/demo_seeds_packed.json --parallel 2 --threads 1      # one arm only

Each arm after the first is compared with the first seed by seed: the mean difference of the final accuracy, on how many
seeds it is lower, and the two-sided p of an exact sign-flip permutation test over the pairs. With one thread per run a
run is reproducible (the same command gives the same metrics), so a run already in `--runs` is not run again.
"""
import argparse, json, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import mean
sys.path.insert(0, str(Path(__file__).parent))
from benchlib import finish_meta, start_meta, write_json

# "switches off": the plain path of the first lessons (pack_completions came after the study in demo_seeds.json, whose
# code had no packing: the same path)
ARMS = {"defaults": [], "switches off": ["fused_decode=false", "fused_head=false", "bf16_base=false",
                                         "keep_freed_memory=false", "pack_completions=false"],
        "fused decoder off": ["fused_decode=false"], "bf16 base off": ["bf16_base=false"],
        "fused head off": ["fused_head=false"],
        "packing off": ["pack_completions=false"],
        "freed memory returned": ["keep_freed_memory=false"]}

def evals(folder: Path) -> dict:
    "{step: held-out accuracy} from a run's metrics.jsonl."
    rows = [json.loads(l) for l in (folder / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}

def run(arm: str, seed: int, out: Path, threads: int) -> dict:
    folder = out / f"{arm.replace(' ', '_')}_seed{seed}"
    if not (folder / "metrics.jsonl").exists() or max(evals(folder), default=-1) < 15:
        cmd = [sys.executable, "-m", "mmrgrpo.cli", "demo", f"seed={seed}", f"output_dir={folder}", "overwrite=true",
               f"threads={threads}", *ARMS[arm]]
        t = time.time()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode: raise RuntimeError(f"{arm} seed {seed} failed:\n{done.stderr[-3000:]}")
        print(f"{arm} seed {seed}: {time.time() - t:.0f} s", flush=True)
    return dict(arm=arm, seed=seed, accuracy=evals(folder))

def sign_flip_p(diffs: list) -> float:
    "Two-sided p of a paired difference's mean under an exact sign-flip permutation test (every sign pattern, 2^n)."
    from itertools import product
    observed = abs(sum(diffs))
    flips = [abs(sum(s * d for s, d in zip(signs, diffs))) for signs in product((1, -1), repeat=len(diffs))]
    return sum(f >= observed - 1e-12 for f in flips) / len(flips)

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    p.add_argument("--runs", default="runs/demo_seeds",
                   help="folder for the runs (kept: a finished run is not run again)")
    p.add_argument("--out", default="bench/results/demo_seeds.json")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="which arms to run")
    a = p.parse_args()
    meta = start_meta()
    jobs = [(arm, s) for s in a.seeds for arm in a.arms]
    with ThreadPoolExecutor(a.parallel) as pool:
        results = list(pool.map(lambda j: run(*j, Path(a.runs), a.threads), jobs))
    print("\nheld-out accuracy at the last step (15), by seed")
    summary = {}
    for arm in a.arms:
        final = [r["accuracy"][15] for r in results if r["arm"] == arm]
        best = [max(r["accuracy"].values()) for r in results if r["arm"] == arm]
        summary[arm] = dict(final=final, final_mean=mean(final), best_mean=mean(best))
        print(f"{arm:>13}: " + " ".join(f"{x:.3f}" for x in final)
              + f"   mean {mean(final):.3f} (best step's mean {mean(best):.3f})")
    first = a.arms[0]
    for arm in a.arms[1:]:          # each arm against the first, seed by seed
        diffs = [x - y for x, y in zip(summary[arm]["final"], summary[first]["final"])]
        summary[arm][f"vs {first}"] = dict(mean_difference=mean(diffs), lower=sum(d < 0 for d in diffs),
                                           higher=sum(d > 0 for d in diffs), sign_flip_p=sign_flip_p(diffs))
        print(f"{arm} - {first}: mean {mean(diffs):+.3f}, lower on {sum(d < 0 for d in diffs)} seeds of {len(diffs)}, "
              f"higher on {sum(d > 0 for d in diffs)}, sign-flip p = {sign_flip_p(diffs):.3f}")
    saved = write_json(a.out, dict(meta=finish_meta(meta), arms={k: ARMS[k] for k in a.arms}, runs=results,
                                   summary=summary))
    print(f"saved {saved}")

if __name__ == "__main__": main()
