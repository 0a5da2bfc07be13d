"""Time to accuracy: held-out greedy accuracy against step and wall-clock for GRPO and its accelerations, over seeds.

Arms (same task, seeds, prompts per step, model and evaluation set; only the acceleration differs):
  grpo          plain GRPO
  mmr           MMR with the default rule, the diversity credit (credit moved among above-mean completions only)
  mmr_ref       MMR-GRPO's own rule: completions reweighted by diversity before the advantages
  cppo          CPPO: the 75% of each group with the smallest |advantage| pruned before the update (allocation off:
                the same prompts per step; --cppo-allocation samples B/(1-P) prompts instead)
  gmts          GMTS: the update trains on the top 20% of tokens by |gradient| estimate
  all           MMR (credit) + CPPO + GMTS together; all_ref the same with the paper's MMR rule
  cppo_p875     CPPO pruning harder: P=0.875, the one completion of each group with the largest |advantage| kept
  cppo_alloc    CPPO with its paper's completion allocation: P=0.75 and B/(1-P) prompts sampled per step, so the kept
                batch is as large as GRPO's (16 prompts x 2 kept completions instead of 4 x 8)
  cppo_alloc_random   the same with the 2 kept completions of each group drawn at random (the paper's ablation): what
                the selection by |advantage| adds to seeing more questions
  grpo_p16      GRPO on the prompts cppo_alloc samples (16 prompts x 8 completions, all 128 in the update): what
                CPPO's pruning gives up against spending the whole sample
  cppo_gmts     CPPO + GMTS
  all_p50, all_k50   all three with a milder cut: CPPO at P=0.5 (4 of 8 completions kept), or GMTS keeping 50% of tokens
  dr_grpo, mmr_dr_grpo   (with --with-dr) DR-GRPO (advantage r - mean, loss_type dr_grpo) without and with MMR

Default setting (sized for about 50 minutes on 2 CPU cores): SmolLM2-135M-Instruct + LoRA, arithmetic level 2 (two-digit
sums; the base model gets about 11% sampled and 25% greedy), G=8 completions for 4 prompts per step, 32 new tokens, 12
steps, greedy accuracy on 50 held-out tasks every 3 steps, seeds 0 and 1. The base model (step 0) is evaluated once:
every arm starts from it (LoRA's B matrix starts at zero) and the held-out set does not depend on the seed.

Reported per arm: peak accuracy (of the seed-mean curve, and per seed), the first evaluated step at which the arm
reaches 95% of plain GRPO's peak and the training wall-clock spent by then (sum of `time/step`, evaluation excluded),
the median step time, and the spread over seeds. Curves: accuracy vs step and vs wall-clock, PNGs beside the JSON. With
50 tasks one task is 2 points of accuracy and the binomial standard error near 25% is about 6 points: read small
differences as noise.

Crash safety: each (arm, seed) run trains in runs/bench_tta/<tag>/<arm>-seed<k>/ with a checkpoint at every evaluation;
a finished run writes bench/results/time_to_accuracy[_quick]/<arm>-seed<k>.json and the summary is rewritten after every
run. Running the script again skips finished runs and resumes an interrupted one from its last checkpoint (--fresh
starts over).

    python bench/time_to_accuracy.py               # full: grpo, mmr, cppo, gmts, all x 2 seeds x 12 steps, about 50 min
    python bench/time_to_accuracy.py --arms all_k50,all_p50   # other arms by name (grpo is added as the reference)
    python bench/time_to_accuracy.py --with-dr     # + the two DR-GRPO arms, about 70 min
    python bench/time_to_accuracy.py --steps 15    # longer curves, about 60 min
    python bench/time_to_accuracy.py --quick       # the default arms, 2 steps, tiny random model: about 2-3 min
    python bench/time_to_accuracy.py --report-only # rebuild the summary and plots from the finished runs
    python bench/time_to_accuracy.py --compare _l3a24/cppo_alloc@24 _l3r3/grpo_p16@12 --seeds 0,1,2,3,4,5,6,7,8,9
        # one arm at one step against another at another (two studies' runs, paired by seed and task)
    python bench/time_to_accuracy.py --matched _l3r3/grpo _l3r3/grpo_p16 --step-times _l3r3u --seeds 0,1,2 --out F.json
        # their curves against wall-clock, each step costed at its arm's step time side by side
"""
import argparse, dataclasses, gc, json, os, shutil, statistics, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl

ARMS = {"grpo": {}, "grpo_p16": {"prompts_per_step": 16}, "mmr": {"mmr": True},
        "mmr_ref": {"mmr": True, "mmr_variant": "reference"},
        "cppo": {"prune_rate": 0.75}, "cppo_p875": {"prune_rate": 0.875},
        "cppo_alloc": {"prune_rate": 0.75, "allocation": True},
        "cppo_alloc_random": {"prune_rate": 0.75, "allocation": True, "prune_mode": "random"},
        "gmts": {"token_selection": "gmts"},
        "all": {"mmr": True, "prune_rate": 0.75, "token_selection": "gmts"},
        "all_ref": {"mmr": True, "mmr_variant": "reference", "prune_rate": 0.75, "token_selection": "gmts"},
        "cppo_gmts": {"prune_rate": 0.75, "token_selection": "gmts"},
        "all_p50": {"mmr": True, "prune_rate": 0.5, "token_selection": "gmts"},
        "all_k50": {"mmr": True, "prune_rate": 0.75, "token_selection": "gmts", "keep_ratio": 0.5}}
# "mmr" and "all" use the default MMR rule, the diversity credit; "mmr_ref" and "all_ref" the paper's rule
DR_ARMS = {"dr_grpo": {"loss_type": "dr_grpo", "scale_rewards": "none"},
           "mmr_dr_grpo": {"loss_type": "dr_grpo", "scale_rewards": "none", "mmr": True}}
DEFAULT_ARMS = ("grpo", "mmr", "cppo", "gmts", "all")     # the study's five; name the others with --arms
TARGET = 0.95


def base_config(args) -> dict:
    quick = args.quick
    d = dict(model=args.model or ("tiny-random" if quick else "smollm2"), task="arithmetic:2", lora=True,
             num_generations=args.G or (4 if quick else 8), prompts_per_step=args.prompts or (2 if quick else 4),
             max_completion_length=args.tokens or (8 if quick else 32), learning_rate=args.lr,
             steps=args.steps or (2 if quick else 12), eval_every=args.eval_every or (1 if quick else 3),
             eval_size=args.eval_size or (8 if quick else 50), eval_before=False, log_completions_every=0,
             threads=args.threads)
    if args.beta is not None: d["beta"] = args.beta
    d["save_every"] = d["eval_every"]
    return d


def arm_config(base: dict, arm: str, seed: int, out: Path, cppo_allocation: bool, overrides: list):
    from mmrgrpo.config import load_config
    extra = dict(ARMS, **DR_ARMS)[arm]
    if cppo_allocation and extra.get("prune_rate"): extra = dict(extra, allocation=True)
    return load_config(overrides=overrides, **dict(base, **extra, seed=seed, output_dir=str(out)))


def base_eval(c) -> dict:
    "Greedy held-out accuracy of the untrained model (step 0 of every arm), with the trainer's evaluation settings."
    import mmrgrpo.trainer as tr
    from mmrgrpo.data import load_tasks
    from mmrgrpo.models import load_policy
    model, tok = load_policy(c)
    src = tr.eval_source(c)
    tasks = load_tasks(src, "test", limit=c.eval_size, data_dir=c.data_dir)
    prompts = [tr.build_prompt(tok, c, t["question"], src) for t in tasks]
    # the trainer's sampler
    res = tr.run_eval(tr.make_backend(c, model, tok), prompts, [t["answer"] for t in tasks], c, tok)
    del model; gc.collect()
    return res


def run_arm(c, run_dir: Path) -> list:
    "Train one (arm, seed), resuming from its last checkpoint if an earlier attempt stopped; return its metrics rows."
    import mmrgrpo.trainer as tr
    if tr.latest_checkpoint(run_dir) is not None:
        print(f"  resuming from {tr.latest_checkpoint(run_dir)}", flush=True)
        c = dataclasses.replace(c, resume_from="latest")
    # an attempt that died before its first checkpoint: start over
    else: c = dataclasses.replace(c, overwrite=True)
    tr.train(c, progress=False)
    return tr.read_metrics(run_dir / "metrics.jsonl")


def curve_of(rows: list, base: dict, steps: int) -> list:
    "[(step, accuracy, training seconds so far)] from a run's metrics rows, step 0 being the base model."
    t, cum, pts = 0.0, {}, [(0, base["eval/accuracy"], 0.0)]
    for r in sorted((r for r in rows if "time/step" in r), key=lambda r: r["step"]):
        t += r["time/step"]; cum[r["step"]] = t
    seen = set()
    for r in rows:
        if "eval/accuracy" in r and r["step"] not in seen and r["step"] in cum:
            seen.add(r["step"]); pts.append((r["step"], r["eval/accuracy"], cum[r["step"]]))
    return sorted(pts)


def first_reach(curve: list, target: float):
    "The first (step, seconds) of `curve` at or above `target`, or (None, None)."
    for s, a, t in curve:
        if a >= target - 1e-12: return s, t
    return None, None


def wilson(p: float, n: int, z: float = 1.96) -> tuple:
    "95% Wilson interval of a proportion p measured on n independent tasks."
    if n <= 0: return (float("nan"), float("nan"))
    d = 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / d
    return (mid - half, mid + half)


def correct_matrix(run: dict) -> tuple:
    """(evaluated steps after 0, (steps, tasks) 0/1 array) from a run's rows; None where its evaluations have no
    per-task record."""
    import numpy as np
    got = {}
    for r in run.get("rows", []):
        if r.get("eval/correct") is not None and r["step"] > 0: got.setdefault(r["step"], r["eval/correct"])
    if not got: return None
    steps = sorted(got)
    return steps, np.array([got[s] for s in steps], dtype=float)


def bootstrap_paired(A, B, stats: dict, n_boot: int = 2000) -> dict:
    """For each named stat (a function of a (seeds, evals, tasks) 0/1 array giving one value per seed): the mean over
    seeds of stat(A) - stat(B), per seed and with a 95% bootstrap interval that resamples seeds and held-out tasks
    together."""
    import numpy as np
    rng = np.random.default_rng(0)
    k, T = A.shape[0], A.shape[2]
    boot = {name: [] for name in stats}
    for _ in range(n_boot):
        si, ti = rng.integers(0, k, k), rng.integers(0, T, T)
        a, b = A[si][:, :, ti], B[si][:, :, ti]
        for name, f in stats.items(): boot[name].append((f(a) - f(b)).mean())
    out = {"n_boot": n_boot}
    for name, f in stats.items():
        d = f(A) - f(B)
        out[f"{name}_diff"], out[f"{name}_diff_per_seed"] = float(d.mean()), [float(x) for x in d]
        out[f"{name}_diff_ci95"] = [float(np.percentile(boot[name], 2.5)), float(np.percentile(boot[name], 97.5))]
    return out


def paired_vs_grpo(runs: dict, arm: str, seeds: list, n_boot: int = 2000) -> dict | None:
    """Arm minus GRPO, same seed and same held-out tasks: final and peak accuracy per seed, with a bootstrap over seeds
    and tasks."""
    import numpy as np
    pairs = []
    for s in seeds:
        a, g = runs.get((arm, s)), runs.get(("grpo", s))
        ma, mg = (correct_matrix(a) if a else None), (correct_matrix(g) if g else None)
        if ma and mg and ma[0] == mg[0] and ma[1].shape == mg[1].shape: pairs.append((s, ma[1], mg[1]))
    if not pairs: return None
    A, Gm = np.stack([p[1] for p in pairs]), np.stack([p[2] for p in pairs])        # (seeds, evals, tasks)
    stats = {"final": lambda X: X[:, -1].mean(-1), "peak": lambda X: X.mean(-1).max(-1)}
    return {"seeds": [p[0] for p in pairs], **bootstrap_paired(A, Gm, stats, n_boot)}


def compare_at_steps(a: str, b: str, seeds: list, n_boot: int = 2000) -> dict:
    """Held-out accuracy of one arm at one step minus another's at another, same seeds and tasks, across studies: `a`
    and `b` are TAG/ARM@STEP (TAG the study's `--tag`, its finished runs read from
    bench/results/time_to_accuracy<TAG>/)."""
    import numpy as np
    sides = []
    for spec in (a, b):
        where, _, step = spec.rpartition("@")
        if not where or not step.isdigit(): sys.exit(f"--compare {spec!r}: write TAG/ARM@STEP, e.g. _l3r3/grpo_p16@12")
        tag, arm = study_arm(where)
        runs, rows = finished_runs(tag, arm, seeds), []
        for s in seeds:
            m = correct_matrix(runs[s]) if s in runs else None
            if m is None or int(step) not in m[0]:
                sys.exit(f"--compare {spec}: seed {s} has no finished run with per-task evaluation at step {step}")
            rows.append(m[1][m[0].index(int(step))])
        sides.append(np.stack(rows)[:, None])                                      # (seeds, 1, tasks)
    A, B = sides
    acc = lambda X: X[:, -1].mean(-1)
    return {"a": a, "b": b, "seeds": seeds, "a_per_seed": [float(x) for x in acc(A)],
            "b_per_seed": [float(x) for x in acc(B)], "a_mean": float(acc(A).mean()), "b_mean": float(acc(B).mean()),
            **bootstrap_paired(A, B, {"accuracy": acc}, n_boot)}


def study_arm(spec: str) -> tuple:
    "(tag, arm) of 'TAG/ARM' (a bare ARM: the default study, tag '')."
    return tuple(spec.rsplit("/", 1)) if "/" in spec else ("", spec)


def finished_runs(tag: str, arm: str, seeds=None) -> dict:
    """{seed: run} of an arm's finished runs in study `tag` (bench/results/time_to_accuracy<tag>/): of `seeds` that have
    one, or all."""
    d = bl.RESULTS / f"time_to_accuracy{tag}"
    paths = {int(f.stem.rsplit("-seed", 1)[1]): f for f in d.glob(f"{arm}-seed*.json")}
    return {s: json.loads(paths[s].read_text()) for s in sorted(paths) if seeds is None or s in seeds}


def summarise(runs: dict, arms: list, seeds: list, eval_size: int) -> dict:
    "Per-arm peaks, time to 95% of GRPO's peak (seed-mean curve and per seed), step times, and spreads."
    out = {"arms": {}, "target_fraction": TARGET}
    have = {a: [s for s in seeds if (a, s) in runs] for a in arms}
    def mean_curve(a):
        cs = [runs[(a, s)]["curve"] for s in have[a]]
        if not cs: return []
        steps = sorted(set.intersection(*[{p[0] for p in c} for c in cs]))
        pick = lambda c, st: next(p for p in c if p[0] == st)
        return [(st, statistics.mean(pick(c, st)[1] for c in cs), statistics.mean(pick(c, st)[2] for c in cs),
                 min(pick(c, st)[1] for c in cs), max(pick(c, st)[1] for c in cs),
                 statistics.pstdev([pick(c, st)[1] for c in cs])) for st in steps]
    mc = {a: mean_curve(a) for a in arms}
    g = mc.get("grpo") or []
    target = TARGET * max(p[1] for p in g) if g else None
    out["grpo_peak"] = max(p[1] for p in g) if g else None
    out["target_accuracy"] = target
    base = g[0][1] if g else None
    out["base_accuracy"] = base
    out["target_at_or_below_base"] = bool(g) and target <= base
    out["binomial_se_at_target"] = (target * (1 - target) / eval_size) ** 0.5 if target is not None else None
    for a in arms:
        if not mc[a]: continue
        s_reach, t_reach = (first_reach([(p[0], p[1], p[2]) for p in mc[a]], target) if target is not None
                            else (None, None))
        per_seed = {}
        for s in have[a]:
            cur = runs[(a, s)]["curve"]
            gs = runs.get(("grpo", s))
            tgt = TARGET * max(p[1] for p in gs["curve"]) if gs else None
            st, tt = first_reach(cur, tgt) if tgt is not None else (None, None)
            per_seed[s] = {"peak": max(p[1] for p in cur), "target": tgt, "step_reached": st, "seconds_reached": tt,
                           "median_step_s": runs[(a, s)]["median_step_s"], "final": cur[-1][1]}
        peaks = [v["peak"] for v in per_seed.values()]
        out["arms"][a] = {
            "seeds": have[a], "peak_mean_curve": max(p[1] for p in mc[a]),
            "peak_per_seed_mean": statistics.mean(peaks), "peak_per_seed_std": statistics.pstdev(peaks),
            "final_mean": mc[a][-1][1], "step_reached": s_reach, "seconds_reached": t_reach,
            # pooled over seeds (eval_size x seeds answers; the same tasks each seed, so this understates the spread a
            # little)
            "peak_ci95": wilson(max(p[1] for p in mc[a]), eval_size * len(have[a])),
            "final_ci95": wilson(mc[a][-1][1], eval_size * len(have[a])),
            "median_step_s": statistics.median(v["median_step_s"] for v in per_seed.values()),
            "mean_curve": [dict(zip(("step", "accuracy", "seconds", "acc_min", "acc_max", "acc_std"), p))
                           for p in mc[a]],
            "per_seed": per_seed}
    for a, v in out["arms"].items():
        if a != "grpo": v["paired_vs_grpo"] = paired_vs_grpo(runs, a, seeds)
    gr = out["arms"].get("grpo")
    for a, v in out["arms"].items():
        if gr and v["step_reached"] and gr["step_reached"]:
            v["steps_ratio_vs_grpo"] = v["step_reached"] / gr["step_reached"]
            v["wallclock_ratio_vs_grpo"] = (v["seconds_reached"] / gr["seconds_reached"] if gr["seconds_reached"]
                                            else None)
        if gr: v["step_time_ratio_vs_grpo"] = v["median_step_s"] / gr["median_step_s"]
    return out


def matched_curves(specs: list, seeds: list, timing_tag: str, png: Path) -> dict:
    """Seed-mean held-out accuracy of each TAG/ARM in `specs` against training wall-clock, every step costed at the
    arm's median step time in study `timing_tag`, whose runs ran side by side: arms trained on different days, under
    different loads, on one clock. Plotted to `png` (band: min-max over seeds)."""
    import matplotlib; matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out, (fig, ax) = {"timing_tag": timing_tag, "curves": {}}, plt.subplots(figsize=(7, 4.2))
    for spec in specs:
        tag, arm = study_arm(spec)
        runs, timing = finished_runs(tag, arm, seeds), finished_runs(timing_tag, arm)
        if not runs: sys.exit(f"--matched {spec}: no finished runs for seeds {seeds}")
        if not timing:
            sys.exit(f"--matched {spec}: no run of arm {arm} in study {timing_tag} to take its step time from")
        step_s = statistics.median(r["median_step_s"] for r in timing.values())
        steps = sorted(set.intersection(*[{p[0] for p in r["curve"]} for r in runs.values()]))
        acc = [[next(p[1] for p in r["curve"] if p[0] == st) for r in runs.values()] for st in steps]
        xs = [st * step_s for st in steps]
        line, = ax.plot(xs, [statistics.mean(a) for a in acc], marker="o", ms=3,
                        label=f"{arm} [study {tag.strip('_') or 'default'}] ({len(runs)} seeds, {step_s:.1f} s a step)")
        ax.fill_between(xs, [min(a) for a in acc], [max(a) for a in acc], color=line.get_color(), alpha=0.12)
        out["curves"][spec] = {"seeds": list(runs), "step_s": step_s, "steps": steps, "seconds": xs,
                               "accuracy": [statistics.mean(a) for a in acc], "acc_min": [min(a) for a in acc],
                               "acc_max": [max(a) for a in acc]}
    ax.set_xlabel(f"training wall-clock (s): steps x each arm's step time side by side (study {timing_tag})")
    ax.set_ylabel("held-out greedy accuracy"); ax.grid(alpha=0.3); ax.legend(fontsize=8)
    ax.set_title("mean over seeds (band: min-max)", fontsize=9)
    fig.tight_layout(); fig.savefig(png, dpi=110); plt.close(fig)
    out["plot"] = str(png)
    return out


def plot(summary: dict, png_dir: Path, tag: str) -> list:
    import matplotlib; matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for x, xlabel, name in (("step", "training step", "step"),
                            ("seconds", "training wall-clock (s, evaluation excluded)", "wallclock")):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for a, v in summary["arms"].items():
            xs = [p[x] for p in v["mean_curve"]]
            line, = ax.plot(xs, [p["accuracy"] for p in v["mean_curve"]], marker="o", ms=3,
                            label=f"{a} ({len(v['seeds'])} seeds)")
            ax.fill_between(xs, [p["acc_min"] for p in v["mean_curve"]], [p["acc_max"] for p in v["mean_curve"]],
                            color=line.get_color(), alpha=0.12)
        if summary.get("target_accuracy") is not None:
            ax.axhline(summary["target_accuracy"], ls="--", color="gray", lw=1, label=f"{TARGET:.0%} of GRPO's peak")
        ax.set_xlabel(xlabel); ax.set_ylabel("held-out greedy accuracy"); ax.grid(alpha=0.3); ax.legend(fontsize=8)
        ax.set_title("mean over seeds (band: min-max)", fontsize=9)
        fig.tight_layout()
        p = png_dir / f"time_to_accuracy{tag}_{name}.png"; fig.savefig(p, dpi=110); plt.close(fig); paths.append(p)
    return paths


def _diff(paired: dict | None, name: str) -> str:
    "'+0.012 (-0.020..+0.043)': the paired mean difference to GRPO and its bootstrap interval."
    if not paired: return ""
    lo, hi = paired[f"{name}_diff_ci95"]
    return f"{paired[f'{name}_diff']:+.3f} ({lo:+.3f}..{hi:+.3f})"


def report(runs, arms, seeds, base, c0, args, meta, res_dir, tag) -> dict:
    s = summarise(runs, arms, seeds, c0["eval_size"])
    rows = [{"arm": a, "seeds": len(v["seeds"]), "peak": v["peak_mean_curve"],
             "peak_seed_mean": v["peak_per_seed_mean"],
             "peak_seed_std": v["peak_per_seed_std"], "final": v["final_mean"],
             "final_ci95": "{:.3f}-{:.3f}".format(*v["final_ci95"]), "step_95": v["step_reached"],
             "seconds_95": v["seconds_reached"],
             "step_95_per_seed": "/".join(str(x["step_reached"]) for x in v["per_seed"].values()),
             "step_s": v["median_step_s"], "step_time_vs_grpo": v.get("step_time_ratio_vs_grpo"),
             "wallclock_vs_grpo": v.get("wallclock_ratio_vs_grpo"),
             "final_minus_grpo": _diff(v.get("paired_vs_grpo"), "final"),
             "peak_minus_grpo": _diff(v.get("paired_vs_grpo"), "peak")}
            for a, v in s["arms"].items()]
    print(f"\nheld-out greedy accuracy on {c0['eval_size']} tasks; base model {base['eval/accuracy']:.3f}; "
          f"target = {TARGET:.0%} of GRPO's peak = "
          f"{s['target_accuracy'] if s['target_accuracy'] is not None else float('nan'):.3f} "
          f"(binomial s.e. there ~{s['binomial_se_at_target'] or 0:.3f})")
    if s["target_at_or_below_base"]:
        print("NOTE: the target is at or below the base model's accuracy, so every arm 'reaches' it at step 0: "
              "GRPO did not improve on the base here, and the time-to-accuracy comparison says nothing.")
    print(bl.table(rows, ["arm", "seeds", "peak", "peak_seed_mean", "peak_seed_std", "final", "final_ci95", "step_95",
                          "seconds_95", "step_95_per_seed", "step_s", "step_time_vs_grpo", "wallclock_vs_grpo",
                          "final_minus_grpo", "peak_minus_grpo"],
                   {"peak": ".3f", "peak_seed_mean": ".3f", "peak_seed_std": ".3f", "final": ".3f", "seconds_95": ".0f",
                    "step_s": ".1f", "step_time_vs_grpo": ".2f", "wallclock_vs_grpo": ".2f"}))
    pngs = plot(s, bl.RESULTS, tag) if s["arms"] else []
    out = {"name": "time_to_accuracy", "quick": args.quick, "settings": c0, "arms_requested": arms, "seeds": seeds,
           "cppo_allocation": args.cppo_allocation, "base_eval": base, "summary": s,
           "runs": {f"{a}-seed{sd}": {k: v for k, v in r.items() if k != "rows"} for (a, sd), r in runs.items()},
           "plots": [str(p) for p in pngs], "meta": bl.finish_meta(meta)}
    p = bl.write_json(Path(args.out) if args.out else bl.RESULTS / f"time_to_accuracy{tag}.json", out)
    print(f"wrote {p}" + "".join(f"\nwrote {x}" for x in pngs))
    return out


def main(argv=None):
    ap = bl.common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]),
                        "the arms for 2 steps on the tiny random model (checks the pipeline, about 2-3 min)")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                    help=f"comma-separated, from {list(ARMS) + list(DR_ARMS)} (default: {','.join(DEFAULT_ARMS)})")
    ap.add_argument("--with-dr", action="store_true", help="add the dr_grpo and mmr_dr_grpo arms")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--model", default=None, help="default smollm2 (--quick: tiny-random)")
    ap.add_argument("--steps", type=int, default=None); ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--eval-size", type=int, default=None); ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--G", type=int, default=None); ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--beta", type=float, default=None,
                    help="KL weight (default: the config's, 0.04 for grpo and dr_grpo)")
    ap.add_argument("--cppo-allocation", action="store_true", help="CPPO arms sample B/(1-P) prompts per step")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every arm")
    ap.add_argument("--fresh", action="store_true", help="discard finished runs and checkpoints of this setting")
    ap.add_argument("--tag", default=None,
                    help="suffix of the result names (default '' or '_quick'), to keep trial settings apart")
    ap.add_argument("--report-only", action="store_true", help="only rebuild the summary from finished runs")
    ap.add_argument("--no-reference", action="store_true",
                    help="do not add the grpo arm (another process runs it; for splitting a study)")
    ap.add_argument("--compare", nargs=2, metavar="TAG/ARM@STEP",
                    help="only compare finished runs: the first's held-out accuracy at its step minus the second's at "
                         "its, paired by seed and task (e.g. _l3a24/cppo_alloc@24 _l3r3/grpo_p16@12)")
    ap.add_argument("--matched", nargs="+", metavar="TAG/ARM",
                    help="only plot finished runs of one study or several against wall-clock, each step costed at its "
                         "arm's step time in the study --step-times names (runs side by side)")
    ap.add_argument("--step-times", default=None, metavar="TAG",
                    help="with --matched: the study to take step times from")
    args = ap.parse_args(argv)
    if args.matched:
        if not args.step_times or not args.out:
            sys.exit("--matched needs --step-times TAG and --out PATH.json (the plot goes beside it)")
        r = matched_curves(args.matched, [int(s) for s in args.seeds.split(",")], args.step_times,
                           Path(args.out).with_suffix(".png"))
        for spec, c in r["curves"].items():
            print(f"{spec}: {len(c['seeds'])} seeds, {c['step_s']:.1f} s a step; " +
                  ", ".join(f"{t:.0f} s {a:.3f}" for t, a in zip(c["seconds"], c["accuracy"])))
        print(f"wrote {bl.write_json(Path(args.out), {**r, 'meta': bl.finish_meta(bl.start_meta())})}"
              f"\nwrote {r['plot']}")
        return r
    if args.compare:
        seeds = [int(s) for s in args.seeds.split(",")]
        r = compare_at_steps(*args.compare, seeds)
        print(bl.table([{"seed": s, "a": x, "b": y, "a - b": x - y}
                        for s, x, y in zip(seeds, r["a_per_seed"], r["b_per_seed"])],
                       ["seed", "a", "b", "a - b"], {"a": ".3f", "b": ".3f", "a - b": "+.3f"}))
        lo, hi = r["accuracy_diff_ci95"]
        print(f"a = {r['a']}: {r['a_mean']:.3f}; b = {r['b']}: {r['b_mean']:.3f}; a - b = {r['accuracy_diff']:+.3f} "
              f"(95% bootstrap over seeds and tasks {lo:+.3f} to {hi:+.3f})")
        if args.out: print(f"wrote {bl.write_json(Path(args.out), {**r, 'meta': bl.finish_meta(bl.start_meta())})}")
        return r
    bl.set_threads(args.threads)
    meta = bl.start_meta()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()] + (list(DR_ARMS) if args.with_dr else [])
    arms = list(dict.fromkeys(arms))
    bad = [a for a in arms if a not in ARMS and a not in DR_ARMS]
    if bad: sys.exit(f"unknown arm(s) {bad}: use {list(ARMS) + list(DR_ARMS)}")
    # the reference every target is taken from
    if "grpo" not in arms and not args.no_reference: arms.insert(0, "grpo")
    seeds = [int(s) for s in args.seeds.split(",")]
    c0 = base_config(args)
    tag = args.tag if args.tag is not None else ("_quick" if args.quick else "")
    res_dir = bl.RESULTS / f"time_to_accuracy{tag}"
    run_root = bl.REPO / "runs" / "bench_tta" / (tag.strip("_") or "full")
    if args.fresh and not args.report_only:
        shutil.rmtree(res_dir, ignore_errors=True); shutil.rmtree(run_root, ignore_errors=True)
    res_dir.mkdir(parents=True, exist_ok=True)
    settings_key = {k: v for k, v in c0.items() if k != "threads"}
    base_path = res_dir / "base.json"
    base = None
    if base_path.exists():
        b = json.loads(base_path.read_text())
        if b.get("settings") == settings_key: base = b["eval"]
    if base is None and not args.report_only:
        print("evaluating the base model (step 0 of every arm) ...", flush=True)
        base = base_eval(arm_config(c0, "grpo", seeds[0], run_root / "base", False, args.set))
        bl.write_json(base_path, {"settings": settings_key, "eval": base})
    if base is None: sys.exit(f"no base evaluation in {res_dir}: run without --report-only first")
    print(f"base model: greedy accuracy {base['eval/accuracy']:.3f} on {c0['eval_size']} tasks")

    runs, reported = {}, False
    # seed-major: a crash after seed 0 still leaves a full comparison
    order = [(a, s) for s in seeds for a in arms]
    for i, (a, s) in enumerate(order):
        path = res_dir / f"{a}-seed{s}.json"
        if path.exists():
            r = json.loads(path.read_text())
            if r.get("complete") and r.get("settings") == settings_key and r.get("overrides") == args.set \
                    and r.get("cppo_allocation") == args.cppo_allocation:
                runs[(a, s)] = r; continue
        if args.report_only: continue
        run_dir = run_root / f"{a}-seed{s}"
        c = arm_config(c0, a, s, run_dir, args.cppo_allocation, args.set)
        print(f"\n[{i + 1}/{len(order)}] arm {a}, seed {s}: {c.steps} steps, "
              f"eval every {c.eval_every} on {c.eval_size} tasks", flush=True)
        t0 = time.perf_counter()
        rows = run_arm(c, run_dir)
        curve = curve_of(rows, base, c.steps)
        steps_t = [r["time/step"] for r in rows if "time/step" in r]
        r = {"arm": a, "seed": s, "complete": True, "settings": settings_key, "overrides": args.set,
             "cppo_allocation": args.cppo_allocation, "config": dataclasses.asdict(c), "curve": curve,
             "median_step_s": statistics.median(steps_t), "train_s": sum(steps_t),
             "process_wall_s": time.perf_counter() - t0,
             "eval_s": [r["eval/time"] for r in rows if "eval/time" in r], "rows": rows,
             "git": bl.git_info(), "date": bl.start_meta()["date"], "loadavg_after": list(os.getloadavg())}
        bl.write_json(path, r)
        runs[(a, s)] = r
        for ck in run_dir.glob("checkpoint-*"): shutil.rmtree(ck, ignore_errors=True)
        print(f"  curve (step, acc, s): {[(p[0], round(p[1], 3), round(p[2])) for p in curve]}", flush=True)
        gc.collect()
        reported = i == len(order) - 1
        report(runs, arms, seeds, base, c0, args, meta, res_dir, tag)     # a summary after every run
    if not reported: report(runs, arms, seeds, base, c0, args, meta, res_dir, tag)


if __name__ == "__main__":
    main()
