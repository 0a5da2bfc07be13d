"""The demo's wall-clock as on a CPU without AVX-512 or bf16 units (issue 46), beside the demo of an earlier commit.

Each arm is one `mmrgrpo demo` in its own process, one after the other, under
`MMRGRPO_CPU=avx2 ATEN_CPU_CAPABILITY=avx2` (`--native`: as the CPU is). An arm `@REF` runs the package as it was at
git commit REF (extracted with `git archive` into the output folder), with `autocast_bf16=false sampler_dtype=float32`:
what that code chose on an AVX2 CPU, since it read the CPU's flags itself and knew no MMRGRPO_CPU. Each arm records
its wall-clock, its held-out accuracy by step, the median generate/update time of a step and the process's peak memory
(the run's own `memory/process_peak`).

    python bench/demo_cpu.py --baseline-ref 5e6217e --out bench/results/demo_cpu_avx2.json
    python bench/demo_cpu.py --native --out bench/results/demo_cpu_native.json         # the current demo only
"""
import argparse, json, os, shutil, statistics, subprocess, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from benchlib import finish_meta, start_meta, table, write_json

ROOT = Path(__file__).resolve().parents[1]
AVX2 = {"MMRGRPO_CPU": "avx2", "ATEN_CPU_CAPABILITY": "avx2"}
OLD_CODE_AS_ON_AVX2 = ["autocast_bf16=false", "sampler_dtype=float32"]


def package_at(ref: str, into: Path) -> Path:
    "The repository's files at commit `ref`, extracted into `into` (its package is imported from there)."
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "x", "-C", str(into)], input=archive, check=True)
    return into


def metrics(folder: Path) -> list:
    "The rows of a run's metrics.jsonl."
    return [json.loads(l) for l in (folder / "metrics.jsonl").read_text().splitlines() if l.strip()]


def run_arm(name: str, code: Path, extra: list, env: dict, out: Path) -> dict:
    "One demo in its own process, importing the package from `code`: its wall-clock and what its metrics say."
    folder = out / name.replace("@", "_at_")
    cmd = [sys.executable, "-m", "mmrgrpo.cli", "demo", f"output_dir={folder}", "overwrite=true", *extra]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=code, env={**os.environ, **env, "PYTHONPATH": str(code)}, capture_output=True,
                          text=True)
    wall = time.perf_counter() - started
    if done.returncode: raise SystemExit(f"arm {name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = metrics(folder)
    steps = [r for r in rows if "time/step" in r]
    med = lambda k: statistics.median(r[k] for r in steps if k in r) if steps else None
    return {"arm": name, "command": " ".join(cmd), "env": env, "wall_s": wall,
            "eval_accuracy": {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r},
            "steps": len(steps), "generate_s": med("time/generate"), "update_s": med("time/update"),
            "step_s": med("time/step"),
            "peak_mb": max((r.get("memory/process_peak", 0.0) for r in rows), default=None),
            "precision": next((l for l in done.stdout.splitlines() if l.startswith("precision:")), "")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-ref", default=None, help="also run the demo as it was at this git commit (first)")
    ap.add_argument("--native", action="store_true", help="run as the CPU is, not as an AVX2 CPU")
    ap.add_argument("--runs", default=None, help="where the runs go (default: a temporary folder beside --out)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "demo_cpu_avx2.json"))
    args = ap.parse_args()
    meta, env = start_meta(), {} if args.native else AVX2
    # arms run elsewhere
    out = Path(args.runs or tempfile.mkdtemp(prefix=".demo_cpu_", dir=Path(args.out).parent)).resolve()
    arms = []
    try:
        if args.baseline_ref:
            code = package_at(args.baseline_ref, out / f"code_{args.baseline_ref}")
            arms.append(run_arm(f"demo@{args.baseline_ref}", code, [] if args.native else OLD_CODE_AS_ON_AVX2, env,
                                out))
        arms.append(run_arm("demo", ROOT, [], env, out))
    finally:
        if not args.runs: shutil.rmtree(out, ignore_errors=True)
    print(table([[a["arm"], f"{a['wall_s']:.0f}", a["steps"], f"{a['generate_s']:.1f}", f"{a['update_s']:.1f}",
                  " ".join(f"{s}:{v:.3f}" for s, v in a["eval_accuracy"].items()), f"{a['peak_mb']:.0f}"]
                 for a in arms],
                ["arm", "wall s", "steps", "generate s", "update s", "held-out accuracy by step", "peak MB"]))
    if len(arms) == 2:
        print(f"wall-clock, this demo against {arms[0]['arm']}: {arms[1]['wall_s'] / arms[0]['wall_s']:.2f}x")
    write_json(Path(args.out), {"arms": arms, "avx2_emulated": not args.native, "meta": finish_meta(meta)})


if __name__ == "__main__":
    main()
