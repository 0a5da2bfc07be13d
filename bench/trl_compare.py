"""Step time and peak memory of mmrgrpo against TRL's GRPOTrainer on the same GRPO configuration, on CPU.

Both sides train the same model folder (`mmrgrpo.models.resolve_model("smollm2")`: SmolLM2-135M-Instruct dequantised
once to a plain safetensors folder; TRL refuses GGUF-quantised models) with the same settings: LoRA r=16, alpha=32,
dropout 0 on q/k/v/o/gate/up/down; G=8 completions for each of 8 prompts per step, all 64 in one forward/backward pass
(TRL: per_device_train_batch_size=64, gradient_accumulation_steps=1); 48 new tokens, temperature 1, top_p 1, top_k 0;
loss_type grpo, beta 0.04 (reference = base model with the adapter off), eps 0.2, group-scaled advantages, one iteration
per batch; AdamW lr 1e-4 constant, grad-norm clip 1; fp32, no gradient checkpointing (TRL's defaults bf16=True and
gradient_checkpointing=True are switched off); rewards accuracy (weight 1) and format (0.2), the same Python functions
(they use TRL's reward signature). The prompts are the same strings: mmrgrpo's chat prompts for the tasks of steps
0..S-1 of arithmetic level 2 (TRL with shuffle_dataset=False reads them in that order). Differences that stay: mmrgrpo
runs each group's prompt once in the update (prompt sharing, on by default) and computes log-probs in chunks; TRL
materialises the full logits. Set --ours-set share_prompt=false to compare without prompt sharing.

Both arms optimise the same objective: TRL's GRPOConfig gets ours field by field (`trl_objective_args`), its
defaults that differ from ours included: the KL term plain k3 (TRL's default is the bias-corrected r * k3,
`use_bias_correction_kl`), epsilon_high, scale_rewards, and the importance-sampling mode and cap. Neither arm
corrects for a sampler here (both sample with their learner: TRL applies its correction only with vLLM, ours only
with tis_cap), and the run prints and saves (meta.objective) what each arm optimised, read back from its own config,
and any difference.

Each arm runs in its own subprocess (clean peak RSS from getrusage), the arms alternate (ours, trl, trl, ours, ...).
Step time excludes model loading: ours is the trainer's `time/step`; TRL's is the time between the trainer callbacks
on_step_begin and on_step_end (generation, rewards, reference pass, forward/backward and optimizer step of that step;
TRL's own logged `step_time` is stored beside it as a cross-check). The first step of each run is a warm-up and is left
out of the medians.

    pip install trl==1.16.0               # in the dev and bench extras; leaves torch 2.13 and transformers as they are
    python bench/trl_compare.py           # full: 2 runs per arm x 4 steps, about 20 min on 2 cores
    python bench/trl_compare.py --quick   # a tiny random model saved to a temp folder, 1-3 min
"""
import argparse, json, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def shared_config(quick: bool, model_path: str, steps: int, threads: int) -> dict:
    base = bl.QUICK_CONFIG if quick else bl.BENCH_CONFIG
    return dict(base, model=model_path, steps=steps, threads=threads, lora_r=16, lora_alpha=32, lora_dropout=0.0,
                lora_target_modules=LORA_TARGETS, temperature=1.0, top_p=1.0, eps_low=0.2, eps_high=0.2,
                scale_rewards="group", num_iterations=1, learning_rate=1e-4, warmup_steps=0, weight_decay=0.0,
                max_grad_norm=1.0, micro_batch_size=0, autocast_bf16=False, gradient_checkpointing=False,
                reward_funcs=["accuracy", "format"], reward_weights=[1.0, 0.2])


def our_objective(c) -> dict:
    "What mmrgrpo's arm optimises, in both configs' terms: the loss, its KL form, clipping, the sampler correction."
    selected = {"none": 1.0, "entropy": c.keep_ratio}.get(c.token_selection, c.token_selection)   # TRL: only entropy
    return {"loss_type": c.loss_type, "beta": c.beta_, "kl": "r * k3" if c.use_bias_correction_kl else "k3",
            "eps_low": c.eps_low, "eps_high": c.eps_high_, "delta": c.delta,
            "importance_sampling_level": c.importance_sampling_level,
            "mask_truncated_completions": c.mask_truncated_completions, "top_entropy_quantile": selected,
            "scale_rewards": c.scale_rewards_,
            "sampler_correction": f"{c.vllm_importance_sampling_mode}, cap {c.tis_cap_:g}" if c.tis_cap_ else "off"}


def trl_objective(args) -> dict:
    "The same, read back from TRL's GRPOConfig (after --trl-set): what its arm optimises."
    on = args.use_vllm and args.vllm_importance_sampling_correction
    return {"loss_type": args.loss_type, "beta": args.beta, "kl": "r * k3" if args.use_bias_correction_kl else "k3",
            "eps_low": args.epsilon, "eps_high": args.epsilon if args.epsilon_high is None else args.epsilon_high,
            "delta": args.delta, "importance_sampling_level": args.importance_sampling_level,
            "mask_truncated_completions": args.mask_truncated_completions,
            "top_entropy_quantile": args.top_entropy_quantile, "scale_rewards": args.scale_rewards,
            "sampler_correction": (f"{args.vllm_importance_sampling_mode}, cap "
                                   f"{args.vllm_importance_sampling_clip_max:g}" if on else "off")}


def trl_objective_args(c) -> dict:
    "TRL GRPOConfig fields that make its arm optimise what ours (config `c`) does."
    return dict(loss_type=c.loss_type, beta=c.beta_, use_bias_correction_kl=c.use_bias_correction_kl,
                epsilon=c.eps_low, epsilon_high=c.eps_high_, delta=c.delta,
                importance_sampling_level=c.importance_sampling_level,
                mask_truncated_completions=c.mask_truncated_completions, scale_rewards=c.scale_rewards_,
                top_entropy_quantile=c.keep_ratio if c.token_selection == "entropy" else 1.0,
                vllm_importance_sampling_mode=c.vllm_importance_sampling_mode,
                vllm_importance_sampling_clip_max=c.tis_cap_ or 2.0)


def prompts_and_answers(c) -> list:
    "The (prompt, answer) of every prompt mmrgrpo's trainer uses in steps 0..steps-1, in order."
    import mmrgrpo.trainer as tr
    from mmrgrpo.data import task_source, tasks_for_step
    from mmrgrpo.models import load_tokenizer
    tok = load_tokenizer(c.model)
    src = task_source(c.task, seed=c.seed)
    recs = [r for s in range(c.steps) for r in tasks_for_step(src, s, c.prompts_per_step, c.seed)]
    return [(tr.build_prompt(tok, c, r["question"], c.task), r["answer"]) for r in recs]


def worker_ours(cfg: dict, extra: list, device: str = None) -> dict:
    "One run of mmrgrpo's trainer on `device` (default: CUDA if any): per-step times, phases, rewards, lengths."
    import torch
    from mmrgrpo.config import load_config
    import mmrgrpo.trainer as tr
    from compute_efficiency import param_counts
    with tempfile.TemporaryDirectory() as d:
        c = load_config(overrides=extra, **dict(cfg, output_dir=d))
        bl.set_threads(c.threads)
        t0 = time.perf_counter()
        from mmrgrpo.models import load_policy
        model, tok = load_policy(c, device)
        load_s = time.perf_counter() - t0
        rss_loaded, params = bl.peak_rss_mb(), param_counts(model)
        t0 = time.perf_counter()
        res = tr.train(c, model=model, tokenizer=tok, progress=False)
        train_s = time.perf_counter() - t0
    rows = res.metrics
    return {"step_s": [r["time/step"] for r in rows], "generate_s": [r.get("time/generate") for r in rows],
            "reward": [r.get("reward") for r in rows], "completion_length": [r.get("completion_length") for r in rows],
            "kl": [r.get("kl") for r in rows], "load_s": load_s, "train_wall_s": train_s,
            "rss_after_load_mb": rss_loaded,
            "reward_s": [r.get("time/reward") for r in rows],
            "phases_s": [{k: v for k, v in r.items() if k.startswith("time/")} for r in rows],
            "params": params, "device": str(next(model.parameters()).device), "threads": torch.get_num_threads(),
            "objective": our_objective(c)}


def timed_method(obj, name: str, into: list, device: str):
    "Replace `obj.name` by a wrapper that appends each call's wall-clock seconds (device work finished) to `into`."
    fn = getattr(obj, name)
    def timed(*a, **kw):
        bl.sync(device); t0 = time.perf_counter()
        out = fn(*a, **kw)
        bl.sync(device); into.append(time.perf_counter() - t0)
        return out
    setattr(obj, name, timed)


def worker_trl(cfg: dict, extra: list, device: str = "cpu", bf16: bool = False, ours_extra: list = ()) -> dict:
    """One run of TRL's GRPOTrainer with the same settings and objective as ours (`cfg` with `ours_extra`), on `device`;
    `bf16`: bf16 weights and mixed precision; `extra`: TRL fields set last."""
    import torch, trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig as TRLConfig, GRPOTrainer
    from mmrgrpo.config import load_config
    from mmrgrpo.models import load_tokenizer
    from mmrgrpo.rewards import get_reward_funcs
    c = load_config(overrides=list(ours_extra), **dict(cfg, output_dir="unused"))
    bl.set_threads(c.threads)
    pa = prompts_and_answers(c)
    ds = Dataset.from_dict({"prompt": [p for p, _ in pa], "answer": [a for _, a in pa]})
    times, starts = [], {}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw): bl.sync(device); starts["t"] = time.perf_counter()
        def on_step_end(self, args, state, control, **kw):
            bl.sync(device); times.append(time.perf_counter() - starts["t"])

    logged = []
    class LogKeeper(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs: logged.append(dict(logs))

    with tempfile.TemporaryDirectory() as d:
        targs = TRLConfig(output_dir=d, use_cpu=device == "cpu", bf16=bf16, fp16=False, gradient_checkpointing=False,
                          per_device_train_batch_size=c.prompts_per_step * c.num_generations,
                          gradient_accumulation_steps=1,
                          num_generations=c.num_generations, max_completion_length=c.max_completion_length,
                          temperature=c.temperature, top_p=c.top_p, top_k=0, **trl_objective_args(c), num_iterations=1,
                          learning_rate=c.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
                          weight_decay=c.weight_decay, max_grad_norm=c.max_grad_norm, optim="adamw_torch",
                          max_steps=c.steps, logging_steps=1, save_strategy="no", report_to="none", seed=c.seed,
                          shuffle_dataset=False, disable_dropout=True, reward_weights=c.reward_weights,
                          log_completions=False, dataloader_num_workers=0,
                          model_init_kwargs={"dtype": "bfloat16" if bf16 else "float32"})
        for kv in extra:
            k, v = kv.split("=", 1); setattr(targs, k, json.loads(v) if v[:1] in "[{0123456789-tf" else v)
        peft = LoraConfig(r=c.lora_r, lora_alpha=c.lora_alpha, lora_dropout=c.lora_dropout,
                          target_modules=list(c.lora_target_modules), task_type="CAUSAL_LM")
        t0 = time.perf_counter()
        trainer = GRPOTrainer(model=c.model, reward_funcs=get_reward_funcs(c.reward_funcs), args=targs,
                              train_dataset=ds, processing_class=load_tokenizer(c.model), peft_config=peft,
                              callbacks=[StepTimer(), LogKeeper()])
        generate_s, prepare_s = [], []       # sampling alone; sampling, rewards and advantages together
        timed_method(trainer, "_generate", generate_s, device)
        timed_method(trainer, "_generate_and_score_completions", prepare_s, device)
        load_s = time.perf_counter() - t0
        rss_loaded = bl.peak_rss_mb()
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
    steps = [l for l in logged if "reward" in l]
    return {"step_s": times, "trl_logged_step_time": [l.get("step_time") for l in steps],
            "reward": [l.get("reward") for l in steps],
            "completion_length": [l.get("completions/mean_length") for l in steps], "kl": [l.get("kl") for l in steps],
            "load_s": load_s, "train_wall_s": train_s, "rss_after_load_mb": rss_loaded, "trl_version": trl.__version__,
            "generate_s": generate_s, "prepare_s": prepare_s, "device": str(trainer.accelerator.device),
            "threads": torch.get_num_threads(), "objective": trl_objective(targs)}


def run_worker(arm: str, cfg: dict, extra: list, ours_extra: list) -> dict:
    "Run one arm in a fresh Python process; return its result dict (with peak RSS)."
    return bl.run_worker(__file__, {"arm": arm, "cfg": cfg, "extra": extra,
                                    **({"ours_extra": ours_extra} if arm == "trl" else {})})


def same_objective(runs: list) -> dict:
    "Each arm's objective as its own config reads, and the fields where they differ."
    objective = {r["arm"]: r["objective"] for r in runs}
    ours, trl = objective["ours"], objective["trl"]
    return {**objective, "differ": sorted(k for k in ours if ours[k] != trl.get(k))}


def summarise(runs: list, arm: str) -> dict:
    mine = [r for r in runs if r["arm"] == arm]
    timed = [t for r in mine for t in r["step_s"][1:]] or [t for r in mine for t in r["step_s"]]
    return {"runs": len(mine), "median_step_s": bl.median(timed), "mean_step_s": sum(timed) / len(timed),
            "timed_steps": len(timed), "peak_rss_mb": max(r["peak_rss_mb"] for r in mine),
            "peak_rss_mb_each": [r["peak_rss_mb"] for r in mine],
            "rss_after_load_mb": max(r["rss_after_load_mb"] for r in mine),
            "load_s": bl.median([r["load_s"] for r in mine]),
            "mean_reward": bl.median([x for r in mine for x in r["reward"] if x is not None]),
            "mean_completion_length": bl.median([x for r in mine for x in r["completion_length"] if x is not None])}


def main(argv=None):
    ap = bl.common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per run (default 4; --quick 3); the first is a warm-up")
    ap.add_argument("--runs", type=int, default=2, help="runs per arm, alternating the order")
    ap.add_argument("--ours-set", nargs="*", default=[], metavar="KEY=VALUE", help="extra mmrgrpo config overrides")
    ap.add_argument("--trl-set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="extra TRL GRPOConfig fields (JSON values)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker: return bl.serve_worker(args.worker, args.worker_out, {"ours": worker_ours, "trl": worker_trl})
    meta = bl.start_meta()
    try: import trl; trl_version = trl.__version__
    except ImportError: sys.exit("TRL is not installed: pip install trl==1.16.0 (in the dev and bench extras)")
    steps = args.steps or (3 if args.quick else 4)
    tmp = tempfile.TemporaryDirectory()
    if args.quick:     # the tiny random model, saved as a plain folder both trainers can load
        from mmrgrpo.models import resolve_model, load_tokenizer, tiny_random_model
        tok = load_tokenizer(resolve_model("smollm2"))
        tiny_random_model(tok).save_pretrained(tmp.name); tok.save_pretrained(tmp.name)
        model_path = tmp.name
    else:
        from mmrgrpo.models import resolve_model
        model_path = resolve_model("smollm2")
    cfg = shared_config(args.quick, model_path, steps, args.threads)
    order = [arm for r, arm in bl.interleaved(["ours", "trl"], args.runs)]
    runs = []
    for i, arm in enumerate(order):
        extra = args.ours_set if arm == "ours" else args.trl_set
        print(f"run {i + 1}/{len(order)}: {arm} ...", flush=True)
        r = run_worker(arm, cfg, extra, args.ours_set)
        runs.append(r)
        print(f"  steps {[round(t, 2) for t in r['step_s']]} s, peak RSS {r['peak_rss_mb']:.0f} MiB, "
              f"load {r['load_s']:.1f} s, reward {[round(x, 3) for x in r['reward'] if x is not None]}", flush=True)
    s = {arm: summarise(runs, arm) for arm in ("ours", "trl")}
    ratio = s["ours"]["median_step_s"] / s["trl"]["median_step_s"]
    mem_ratio = s["ours"]["peak_rss_mb"] / s["trl"]["peak_rss_mb"]
    objective = same_objective(runs)
    print(f"\nconfig: model {Path(model_path).name}, G={cfg['num_generations']}, prompts={cfg['prompts_per_step']}, "
          f"new tokens={cfg['max_completion_length']}, LoRA r=16 alpha=32, TRL {trl_version}, "
          f"{args.runs} runs x {steps} steps per arm (first step of each run is a warm-up)")
    print("objective, both arms: " + ", ".join(f"{k} {v}" for k, v in objective["ours"].items()))
    if objective["differ"]:
        print("WARNING: the arms optimise different objectives: " + ", ".join(
            f"{k} ours {objective['ours'][k]!r}, TRL {objective['trl'].get(k)!r}" for k in objective["differ"]))
    print(bl.table([{"arm": a, **v} for a, v in s.items()],
                   ["arm", "median_step_s", "mean_step_s", "timed_steps", "peak_rss_mb", "rss_after_load_mb", "load_s",
                    "mean_reward", "mean_completion_length"],
                   {"median_step_s": ".2f", "mean_step_s": ".2f", "peak_rss_mb": ".0f", "rss_after_load_mb": ".0f",
                    "load_s": ".1f", "mean_reward": ".3f", "mean_completion_length": ".1f"}))
    print(f"step time ours/TRL: {ratio:.3f} (speed-up {1 / ratio:.2f}x); peak RSS ours/TRL: {mem_ratio:.3f}")
    out = {"name": "trl_compare", "quick": args.quick, "trl_version": trl_version, "config": cfg,
           "ours_overrides": args.ours_set, "trl_overrides": args.trl_set, "order": order, "runs": runs, "summary": s,
           "step_time_ratio_ours_over_trl": ratio, "peak_rss_ratio_ours_over_trl": mem_ratio,
           "meta": {**bl.finish_meta(meta), "objective": objective}}
    p = bl.write_json(Path(args.out) if args.out else bl.result_path("trl_compare", args.quick), out)
    print(f"wrote {p}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
