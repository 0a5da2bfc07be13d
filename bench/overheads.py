"""What the accelerations cost and save, side by side on one rollout: MMR, token selection, pruning, prompt sharing.

One process, one model, one rollout. The fixed config (SmolLM2-135M-Instruct + LoRA, G=8 x 8 prompts, 48 new tokens,
arithmetic level 2, beta=0.04) samples a batch once; then every arm below runs on that SAME rollout, each update
starting from the same initial LoRA weights and a fresh AdamW, so only the arm's setting differs:

- `P=0`, `P=0.5`, `P=0.75`, `P=0.875`: completion pruning (CPPO, allocation off: the same prompts), then the update
  (reference pass + forward/backward + optimizer step);
- `P=0 gmts`: the update with GMTS token selection (its `time/select` share of the update);
- `P=0 no-share`: the update with `share_prompt=False` (each completion runs its own copy of the prompt);
- `P=0 sdpa`, `P=0.75 sdpa`: the update with torch's fused attention kernel (`update_attention=sdpa`), against the arms
  above, whose masked attention runs in plain matmuls where `update_attention=auto` takes it (62a_matmul_attention);
- `P=0 mb=64`, `mb=32`, `mb=16`, `mb=8`: the update in micro-batches of that many completions (whole groups, so prompt
  sharing stays on), against the default (`micro_batch_size=0`: on a CPU, whole groups of about 1,024 completion
  positions in fp32, 1,536 in bf16, counted up to each row's last counted token when the completions are packed): time
  and the update's peak resident memory;
- `mmr`: embedding the 64 completions and the MMR reweighting (`time/mmr` of the trainer's `advantages_for`).

The arms are interleaved (round-robin, order reversed every other round) and repeated `--repeats` times after `--warmup`
unrecorded rounds (the first call on a new batch shape is slow); medians are reported. Generation and reward are
measured on the shared rollout (`--gen-repeats` times), so a whole step at pruning rate P is generate + reward + prune +
update(P) (MMR off), and the MMR fraction is mmr / (generate + reward + mmr + update(P=0)).

    python bench/overheads.py                  # full: 1 warm-up + 3 rounds, about 12 min on 2 cores
    python bench/overheads.py --quick          # tiny random model, seconds
"""
import argparse, dataclasses, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl

P_RATES = [0.0, 0.5, 0.75, 0.875]


def main(argv=None):
    ap = bl.common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--repeats", type=int, default=None, help="rounds over all arms (default 3; --quick: 2)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="unrecorded rounds over all arms first (first calls on a new shape are slow)")
    ap.add_argument("--gen-repeats", type=int, default=1,
                    help="times the shared generation is timed (same seed, same rollout)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides, e.g. max_completion_length=32")
    args = ap.parse_args(argv)
    bl.set_threads(args.threads)
    meta = bl.start_meta()
    import torch
    import mmrgrpo.trainer as tr
    from mmrgrpo.config import load_config, check_config
    from mmrgrpo.data import task_source, tasks_for_step
    from mmrgrpo.models import load_policy, trainable_parameters
    from mmrgrpo.rewards import get_reward_funcs
    from mmrgrpo.mmr import load_embedder
    from mmrgrpo.advantages import group_advantages, frac_zero_std
    from mmrgrpo.step import micro_batches, pass_positions, pass_stats
    repeats = args.repeats or (2 if args.quick else 3)
    base = dict(bl.QUICK_CONFIG, num_generations=8) if args.quick else dict(bl.BENCH_CONFIG)
    c = load_config(overrides=args.set, **dict(base, steps=1, output_dir="runs/bench_overheads", threads=args.threads))

    model, tok = load_policy(c)
    # as the trainer: freed memory kept, a bf16 base where the config asks
    speed = tr.speed_settings(c, model, "cpu")
    # the trainer's sampler (the bench config: a merged fp32 copy, fused)
    backend = tr.make_backend(c, model, tok)
    embedder = load_embedder(c.embedding_model)
    reward_funcs = get_reward_funcs(c.reward_funcs)
    records = tasks_for_step(task_source(c.task, seed=c.seed), 0, c.prompts_per_step, c.seed)
    prompts = [tr.build_prompt(tok, c, r["question"], c.task) for r in records]

    gen_t = []
    for _ in range(args.gen_repeats):
        t0 = time.perf_counter()
        ro = backend.generate(prompts, c.num_generations, c.max_completion_length, c.temperature, c.top_p,
                              seed=tr.step_seed(c.seed, 0))
        gen_t.append(time.perf_counter() - t0)
    rewards, _ = tr.score(ro, records, reward_funcs, c)          # warm the verifier pool
    adv = group_advantages(rewards, ro.group_size, scale=c.scale_rewards_)
    N, T = ro.completion_ids.shape
    print(f"rollout: {N} completions, prompt width {ro.prompt_ids.shape[1]}, completion width {T}, "
          f"{int(ro.completion_mask.sum())} valid tokens, mean reward {rewards.mean().item():.3f}, "
          f"zero-std groups {frac_zero_std(rewards, ro.group_size):.2f}")

    params = trainable_parameters(model)
    init = {n: p.detach().clone() for n, p in params.items()}

    def fresh_optimizer():
        with torch.no_grad():
            for n, p in params.items(): p.copy_(init[n])
        return torch.optim.AdamW(list(params.values()), lr=c.learning_rate, weight_decay=c.weight_decay)

    arms = {f"P={p:g}": dict(prune_rate=p) for p in P_RATES}
    arms["P=0 gmts"] = dict(token_selection="gmts")
    arms["P=0 no-share"] = dict(share_prompt=False)
    # the fused kernel's attention (62a_matmul_attention)
    arms.update({f"P={p:g} sdpa": dict(prune_rate=p, update_attention="sdpa") for p in (0.0, 0.75)})
    widths = pass_stats(c, model).widths                  # what a pass holds of each row: its own length (packed), or T
    width = widths(ro.completion_mask).tolist() if widths else T
    groups = torch.arange(N) // c.num_generations
    auto_mb = c.micro_batch_size or micro_batches(groups, width, positions=pass_positions(c))[0].stop   # rows in pass 1
    MB = [m for m in (N, 32, 16, 8) if m != auto_mb and N % m == 0 and m % c.num_generations == 0]
    arms.update({f"P=0 mb={m}": dict(micro_batch_size=m) for m in MB})
    cfgs = {k: check_config(dataclasses.replace(c, **v)) for k, v in arms.items()}
    c_mmr = check_config(dataclasses.replace(c, mmr=True))
    names = list(arms) + ["mmr", "reward"]
    raw = {k: [] for k in names}
    for rep, name in bl.interleaved(names, args.warmup + repeats):
        rep -= args.warmup
        if name == "reward":
            t0 = time.perf_counter(); tr.score(ro, records, reward_funcs, c)
            if rep >= 0: raw[name].append({"total": time.perf_counter() - t0})
            continue
        if name == "mmr":
            ph = tr.Phases(); tr.advantages_for(rewards, ro, c_mmr, embedder, ph)
            if rep >= 0: raw[name].append({"total": ph.t["mmr"]})
            continue
        cc = cfgs[name]
        bl.release_memory()          # what the previous arm's allocator kept would otherwise count in this arm's peak
        opt = fresh_optimizer()
        ph, counter = tr.Phases(), {}
        t0 = time.perf_counter()
        kept, kadv, pm = tr.prune(ro, adv, cc)
        m = tr.update(model, opt, kept, kadv, cc, None, ph, counter)
        total = time.perf_counter() - t0
        kmask = kept.completion_mask
        if rep < 0: print(f"  warm-up   {name:13s} update phase {total:7.2f}s", flush=True); continue
        raw[name].append({"total": total, **{f"time/{k}": v for k, v in ph.t.items()},
                          "forward_rows": counter.get("forward_rows", 0),
                          "kept_rows": len(kept.completions), "kept_fraction": pm["prune/kept_fraction"],
                          "kept_valid_tokens": int(kmask.sum()), "kept_width": kmask.shape[1],
                          "kept_longest": int(kmask.sum(-1).max()), "loss": m["loss"],
                          "peak_mb": max(ph.mem.values(), default=None),
                          "tokens/kept_fraction": m.get("tokens/kept_fraction")})
        print(f"  round {rep + 1}/{repeats} {name:13s} update phase {total:7.2f}s  " +
              " ".join(f"{k}={v:.2f}" for k, v in ph.t.items()), flush=True)

    med = {k: bl.median([x["total"] for x in v]) for k, v in raw.items()}
    gen, rew = bl.median(gen_t), med["reward"]
    t0u = med["P=0"]
    step0 = gen + rew + t0u
    prune_rows = []
    for p in P_RATES:
        k = f"P={p:g}"; x = raw[k][0]
        step = gen + rew + med[k]
        prune_rows.append({"P": p, "kept_fraction": x["kept_fraction"], "kept_valid_tokens": x["kept_valid_tokens"],
                           "forward_rows": x["forward_rows"], "update_s": med[k], "update_ratio": med[k] / t0u,
                           "step_s": step, "step_ratio": step / step0, "speedup": step0 / step})
    # update time against the kept fraction: least-squares t = a + b * kept
    ks = [r["kept_fraction"] for r in prune_rows]; ts = [r["update_s"] for r in prune_rows]
    kbar, tbar = sum(ks) / len(ks), sum(ts) / len(ts)
    b = sum((k - kbar) * (t - tbar) for k, t in zip(ks, ts)) / sum((k - kbar) ** 2 for k in ks)
    a = tbar - b * kbar
    ss_res = sum((t - a - b * k) ** 2 for k, t in zip(ks, ts)); ss_tot = sum((t - tbar) ** 2 for t in ts)
    fit = {"intercept_s": a, "slope_s": b, "fixed_share_at_P0": a / t0u,
           "r2": 1 - ss_res / ss_tot if ss_tot else float("nan")}
    rows_ok = all(r["forward_rows"] == round(r["kept_fraction"] * N) * (2 if c.beta_ else 1) for r in prune_rows)
    sel = raw["P=0 gmts"]
    sel_s = bl.median([x.get("time/select", 0.0) for x in sel])
    upd_s = bl.median([x["total"] for x in sel])
    gmts = {"select_s": sel_s, "update_phase_s": upd_s, "select_fraction_of_update": sel_s / upd_s,
            "update_ratio_vs_none": upd_s / t0u, "tokens_kept_fraction": sel[0]["tokens/kept_fraction"]}
    share = {"share_s": t0u, "no_share_s": med["P=0 no-share"], "ratio_share_over_no_share": t0u / med["P=0 no-share"]}
    peak = lambda k: max((x["peak_mb"] or 0.0) for x in raw[k])
    micro = sorted([{"micro_batch": mb, "update_s": med[k], "update_ratio": med[k] / t0u, "peak_mb": peak(k),
                     "peak_ratio": peak(k) / peak("P=0"), "arm": k}
                    for mb, k in [(auto_mb, "P=0")] + [(m, f"P=0 mb={m}") for m in MB]],
                   key=lambda r: -r["micro_batch"])
    mmr = {"mmr_s": med["mmr"], "step_with_mmr_s": step0 + med["mmr"],
           "fraction_of_step": med["mmr"] / (step0 + med["mmr"])}
    # padding the kept batch still carries: width of the kept batch vs its longest kept completion
    pad = {r["P"]: {"kept_width": raw[f"P={r['P']:g}"][0]["kept_width"],
                    "kept_longest": raw[f"P={r['P']:g}"][0]["kept_longest"]}
           for r in prune_rows}

    print(f"\nconfig: {c.model}, G={c.num_generations}, prompts={c.prompts_per_step}, "
          f"new tokens={c.max_completion_length}, beta={c.beta_}, repeats={repeats} (medians), "
          f"threads={torch.get_num_threads()}")
    print(f"shared: generate {gen:.2f}s (x{len(gen_t)}), reward {rew:.3f}s\n")
    print("pruning (allocation off, same rollout; update = ref pass + forward/backward + optimizer step)")
    print(bl.table(prune_rows, ["P", "kept_fraction", "forward_rows", "kept_valid_tokens", "update_s", "update_ratio",
                                "step_s", "step_ratio", "speedup"],
                   {"P": "g", "kept_fraction": ".3f", "update_s": ".2f", "update_ratio": ".3f", "step_s": ".2f",
                    "step_ratio": ".3f", "speedup": ".2f"}))
    print(f"update time ~ {a:.2f}s + {b:.2f}s x kept_fraction (R^2 {fit['r2']:.3f}): the fixed part is "
          f"{fit['fixed_share_at_P0']:.1%} of the P=0 update; pruned rows never reached the model: {rows_ok}")
    print(f"\nMMR (embed + reweight): {mmr['mmr_s']:.3f}s = {mmr['fraction_of_step']:.2%} of a step")
    print(f"GMTS token selection: {sel_s:.3f}s = {gmts['select_fraction_of_update']:.2%} of its update phase "
          f"({upd_s:.2f}s; {gmts['update_ratio_vs_none']:.3f}x the update without selection)")
    print(f"prompt sharing: update {t0u:.2f}s with, {share['no_share_s']:.2f}s without: "
          f"ratio {share['ratio_share_over_no_share']:.3f}")
    print(f"\nmicro-batches (P=0; the default micro_batch_size=0 chose {auto_mb}; peak = the whole process's peak "
          "resident memory during the ref + update phases, the allocator's free memory released before each arm)")
    print(bl.table(micro, ["arm", "micro_batch", "update_s", "update_ratio", "peak_mb", "peak_ratio"],
                   {"update_s": ".2f", "update_ratio": ".3f", "peak_mb": ".0f", "peak_ratio": ".3f"}))
    out = {"name": "overheads", "quick": args.quick, "config": dataclasses.asdict(c), "repeats": repeats,
           "rollout": {"rows": N, "prompt_width": ro.prompt_ids.shape[1], "completion_width": T,
                       "valid_tokens": int(ro.completion_mask.sum()), "mean_reward": rewards.mean().item()},
           "generate_s": gen_t, "pruning": prune_rows, "update_vs_kept_fit": fit, "pruned_rows_skip_model": rows_ok,
           "kept_batch_padding": pad, "mmr": mmr, "token_selection": gmts, "prompt_sharing": share,
           "micro_batches": micro, "auto_micro_batch": auto_mb, "speed_settings": speed,
           "medians": med, "raw": raw, "meta": bl.finish_meta(meta)}
    p = bl.write_json(Path(args.out) if args.out else bl.result_path("overheads", args.quick), out)
    print(f"wrote {p}")


if __name__ == "__main__":
    main()
