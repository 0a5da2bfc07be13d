"""Ours against TRL 1.16's GRPOTrainer on one device (a lent GPU or this CPU): same model, same work, one run, issue 47.

Each arm (ours, TRL) runs in a process of its own, the arms alternating, with trl_compare.py's shared settings (LoRA
r=16, alpha 32, dropout 0 on q/k/v/o/gate/up/down; G=8 completions x 8 prompts in one forward/backward pass;
temperature 1; loss grpo, eps 0.2, group-scaled advantages; AdamW lr 1e-4; no gradient checkpointing; the same prompts
in the same order), but: beta 0 (no reference pass) and bf16 (both load the base weights in bf16; ours trains under
bf16 autocast and samples with its default copy, `sampler_dtype=auto`; TRL runs with bf16=True). Two workloads, as
issue 47 measured TRL on an H200:
- `smollm2`: SmolLM2-135M-Instruct (the embedded model), arithmetic level 2, 128 new tokens, rewards accuracy + 0.2
  format.
- `qwen1.5b`: random weights of Qwen2.5-1.5B's shape (hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960, tied
  head: 1.39 B parameters) with SmolLM2's vocabulary and tokenizer, built on the device in a process of its own and
  saved in bf16 to a temporary folder beside the result (removed at the end). 256 new tokens and every completion runs
  to the limit: the weights are edited so that no stop token can be drawn (`never_ends`), for both trainers alike. The
  reward is a hash of the completion's text (`distinct_reward`), so its values differ inside every group and neither
  trainer can skip work.

Measured per arm, over steps 2..n (step 1 warms up): step time (median); peak memory (CUDA: the arm process's
`torch.cuda.max_memory_allocated`; CPU: its peak RSS); time per sampled token (sampling seconds / completion tokens
sampled; ours: `time/generate`, TRL: its `_generate`); update seconds (the step minus sampling, rewards and advantages;
ours: `time/step - time/generate - time/reward`, TRL: the step minus its `_generate_and_score_completions`); and the
update's share of the bf16 peak: nominal update FLOPs / update seconds / the bf16 matmul rate measured in the same run
on the same device (a square bf16 matmul, in the process that builds the models, before them). The nominal FLOPs are
the same count for both arms, for LoRA on a frozen base: 4 x base linear weights x tokens through the body (forward 2,
backward to the inputs 2; the frozen base has no weight gradients; full training would be 6) + 4 x head weights x
completion tokens; tokens are every row's prompt and completion (no credit for prompt sharing); attention scores and
the adapters' own FLOPs are left out.

    pip install trl==1.16.0                        # in the dev and bench extras
    python bench/gpu_compare.py --device cuda --out bench/results/gpu_compare_h200.json   # a lent GPU
    python bench/gpu_compare.py --tiny             # both workloads on tiny random models, 2 steps, CPU: 1-3 min
"""
import argparse, sys, tempfile, time, zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl
import trl_compare as tc

QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)
QWEN_TINY = dict(QWEN_1_5B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=1024)
WORKLOADS = {"smollm2": dict(task="arithmetic:2", max_completion_length=128),
             "qwen1.5b": dict(task="arithmetic:2", max_completion_length=256,
                              reward_funcs=["gpu_compare:distinct_reward"], reward_weights=[1.0])}
TINY_TOKENS = {"smollm2": 8, "qwen1.5b": 16}
PEAK_SIZE = {"cuda": 8192, "cpu": 2048, "tiny": 512}


def distinct_reward(prompts, completions, **kw) -> list:
    "A reward in [0, 1) from a hash of each completion's text: different texts score differently (no uniform group)."
    return [zlib.crc32(str(c).encode()) / 2**32 for c in completions]


def never_ends(model, stop_ids: list, lift: float = 0.1, push: float = 1e4):
    "Make `stop_ids` impossible to draw: residual dimension 0 holds `lift`, and the head's stop rows read -push x it."
    # With a tied head the stop tokens' embeddings become those rows too, so a position whose input is a stop token
    # holds -push there: only prompts (pads, turn ends) have such inputs, and nothing is drawn or scored after them.
    import torch
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = lift          # every token puts `lift` in dimension 0 ...
        for layer in model.model.layers:                             # ... and no layer writes to it (no biases there)
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.down_proj.weight[0] = 0
        model.model.norm.weight[0] = 1.0                             # so the final norm's dimension 0 is always > 0
        head = model.get_output_embeddings().weight
        head[stop_ids] = 0
        head[stop_ids, 0] = -push                                    # a stop token's logit: -push x that (> 0)
    return model


def build_model(kind: str, folder: str, device: str, tiny: bool) -> dict:
    "Build the workload's random model on `device`, save it with SmolLM2's tokenizer to `folder`, and describe it."
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config
    from mmrgrpo.models import load_tokenizer, resolve_model, tiny_random_model
    from mmrgrpo.sampling import stop_token_ids
    tok = load_tokenizer(resolve_model("smollm2"))
    t0 = time.perf_counter()
    if kind == "smollm2": model = tiny_random_model(tok)
    else:
        ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        cfg = Qwen2Config(vocab_size=len(tok), tie_word_embeddings=True, **ids, **(QWEN_TINY if tiny else QWEN_1_5B))
        torch.manual_seed(0)
        with torch.device(device): model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        never_ends(model, stop_token_ids(model, tok))
    model.save_pretrained(folder); tok.save_pretrained(folder)
    return {"kind": kind, "params": sum(p.numel() for p in model.parameters()), "dtype": str(model.dtype),
            "stop_ids": stop_token_ids(model, tok), "build_s": time.perf_counter() - t0}


def matmul_peak(device: str, n: int) -> dict:
    "The bf16 matmul rate of `device` (FLOP/s): the best of three timed loops of an n x n x n product."
    import torch
    from compute_efficiency import time_matmul
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    secs = [time_matmul(a, b, 0.5 if device == "cuda" else 0.2) for _ in range(3)]
    return {"n": n, "seconds": secs, "bf16_flops": 2 * n ** 3 / min(secs), "device": str(a.device),
            "threads": torch.get_num_threads()}


def prepare(device: str, n: int, builds: dict, tiny: bool) -> dict:
    "One process before the arms: the bf16 matmul peak, then each model of `builds` ({kind: folder}) built and saved."
    return {"peak": matmul_peak(device, n), "built": {k: build_model(k, f, device, tiny) for k, f in builds.items()}}


def model_folders(names: list, tiny: bool, folder: Path) -> dict:
    "Where each workload's model is: the embedded SmolLM2 folder, or a folder under `folder` to build it in."
    from mmrgrpo.models import resolve_model
    return {n: resolve_model("smollm2") if n == "smollm2" and not tiny else str(folder / n) for n in names}


def workload_config(name: str, model_path: str, tiny: bool, steps: int, threads: int) -> dict:
    "trl_compare's shared settings with the workload's: beta 0, bf16, its task, length and rewards."
    cfg = tc.shared_config(tiny, model_path, steps, threads)
    cfg.update(WORKLOADS[name], beta=0.0, dtype="bfloat16", autocast_bf16=True, sampler_dtype="auto")
    if tiny: cfg["max_completion_length"] = TINY_TOKENS[name]
    return cfg


def prompt_tokens(cfg: dict) -> list:
    "Prompt tokens of each step's rows (every completion carries its prompt: G x the step's prompts' lengths)."
    from mmrgrpo.config import load_config
    from mmrgrpo.models import load_tokenizer
    c = load_config(**dict(cfg, output_dir="unused"))
    tok, pa = load_tokenizer(c.model), tc.prompts_and_answers(c)
    lens = [len(tok(p, add_special_tokens=False).input_ids) for p, _ in pa]
    B = c.prompts_per_step
    return [c.num_generations * sum(lens[s * B:(s + 1) * B]) for s in range(c.steps)]


def step_rows(r: dict, cfg: dict, prompt_toks: list) -> list:
    "Per step of one arm's run: step, sampling and update seconds, and the completion tokens sampled."
    rows_n = cfg["num_generations"] * cfg["prompts_per_step"]
    if r["arm"] == "ours": prep = [g + (w or 0.0) for g, w in zip(r["generate_s"], r["reward_s"])]
    else: prep = r["prepare_s"]
    return [{"step_s": s, "generate_s": g, "update_s": s - p, "completion_tokens": L * rows_n, "prompt_tokens": P}
            for s, g, p, L, P in zip(r["step_s"], r["generate_s"], prep, r["completion_length"], prompt_toks)]


def update_flops(params: dict, row: dict) -> float:
    "Nominal update FLOPs of one step, LoRA on a frozen base (see the module docstring): the same count for both arms."
    return 4 * params["base_linear"] * (row["prompt_tokens"] + row["completion_tokens"]) + \
        4 * params["head"] * row["completion_tokens"]


def summarise(runs: list, arm: str, cfg: dict, prompt_toks: list, params: dict, peak: float, device: str) -> dict:
    "Medians over the timed steps (2..n of each run) of one arm, its peak memory, and its share of the bf16 peak."
    mine = [r for r in runs if r["arm"] == arm]
    timed = [row for r in mine for row in step_rows(r, cfg, prompt_toks)[1:]]
    med = lambda f: bl.median([f(x) for x in timed])
    rows_n = cfg["num_generations"] * cfg["prompts_per_step"]
    mem_key = "peak_cuda_mb" if device == "cuda" else "peak_rss_mb"
    return {"runs": len(mine), "timed_steps": len(timed), "median_step_s": med(lambda x: x["step_s"]),
            "median_generate_s": med(lambda x: x["generate_s"]), "median_update_s": med(lambda x: x["update_s"]),
            "ms_per_sampled_token": med(lambda x: 1e3 * x["generate_s"] / x["completion_tokens"]),
            "update_share_of_bf16_peak": med(lambda x: update_flops(params, x) / x["update_s"] / peak),
            "peak_memory_mb": max(r[mem_key] for r in mine), "memory_measure": mem_key,
            "mean_completion_length": med(lambda x: x["completion_tokens"]) / rows_n,
            "load_s": bl.median([r["load_s"] for r in mine]), "steps": [step_rows(r, cfg, prompt_toks) for r in mine]}


def run_workload(name: str, args, device: str, model_path: str, built: dict, peak: float) -> dict:
    "Run the workload's arms alternately on its model and compare them."
    steps = args.steps or (2 if args.quick else 4)
    cfg = workload_config(name, model_path, args.quick, steps, args.threads)
    spec = {"ours": {"device": device, "extra": args.ours_set}, "trl": {"device": device, "bf16": True,
                                                                      "extra": args.trl_set}}
    runs = []
    for _, arm in bl.interleaved(["ours", "trl"], args.runs):
        print(f"  {name}: {arm} ...", flush=True)
        r = bl.run_worker(__file__, {"arm": arm, "cfg": cfg, **spec[arm]})
        runs.append(r)
        print(f"    steps {[round(t, 3) for t in r['step_s']]} s, lengths {r['completion_length']}", flush=True)
    params = next(r["params"] for r in runs if r["arm"] == "ours")
    toks = prompt_tokens(cfg)
    s = {arm: summarise(runs, arm, cfg, toks, params, peak, device) for arm in ("ours", "trl")}
    ratio = lambda k: s["ours"][k] / s["trl"][k]
    ratios = {"step_time": ratio("median_step_s"), "peak_memory": ratio("peak_memory_mb"),
              "time_per_sampled_token": ratio("ms_per_sampled_token"), "update_time": ratio("median_update_s")}
    to_limit = {arm: v["mean_completion_length"] >= cfg["max_completion_length"] for arm, v in s.items()}
    return {"config": cfg, "model": "built: " + name if built else model_path, "built": built, "params": params,
            "runs": runs, "summary": s, "ratios_ours_over_trl": ratios, "all_to_the_limit": to_limit}


def print_workload(name: str, w: dict):
    "The workload's table and ratios."
    cols = ["arm", "median_step_s", "median_generate_s", "median_update_s", "ms_per_sampled_token",
            "update_share_of_bf16_peak", "peak_memory_mb", "mean_completion_length"]
    print(f"\n{name}: G={w['config']['num_generations']} x {w['config']['prompts_per_step']} prompts, "
          f"{w['config']['max_completion_length']} new tokens, {w['params']['total_params'] / 1e6:.1f} M parameters")
    print(bl.table([{"arm": a, **v} for a, v in w["summary"].items()], cols,
                   {"median_step_s": ".3f", "median_generate_s": ".3f", "median_update_s": ".3f",
                    "ms_per_sampled_token": ".3f", "update_share_of_bf16_peak": ".2%", "peak_memory_mb": ".0f",
                    "mean_completion_length": ".1f"}))
    r = w["ratios_ours_over_trl"]
    print(f"ours/TRL: step time {r['step_time']:.3f}, peak memory ({w['summary']['ours']['memory_measure']}) "
          f"{r['peak_memory']:.3f}, time per sampled token {r['time_per_sampled_token']:.3f}, "
          f"update {r['update_time']:.3f}")


def pick_device(ap, name: str) -> str:
    "The device --device names ('auto': CUDA where there is one), refused in one line where it is not there."
    import torch
    if name == "auto": return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available(): ap.error("--device cuda: torch sees no CUDA GPU here")
    return name


def main(argv=None):
    ap = bl.common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]),
                        "both workloads on tiny random models, few tokens, 2 steps: checks the code path on a CPU")
    ap.add_argument("--tiny", dest="quick", action="store_true", help="the same as --quick")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where both arms run")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 4; --tiny 2); the first warms up")
    ap.add_argument("--runs", type=int, default=1, help="runs per arm, alternating the order")
    ap.add_argument("--ours-set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="mmrgrpo config overrides for both workloads (e.g. micro_batch_size=16); "
                         "saved with the result")
    ap.add_argument("--trl-set", nargs="*", default=[], metavar="KEY=VALUE", help="TRL GRPOConfig fields (JSON values)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return bl.serve_worker(args.worker, args.worker_out, {"ours": tc.worker_ours, "trl": tc.worker_trl,
                                                              "prepare": prepare})
    if args.steps is not None and args.steps < 2: ap.error(f"--steps {args.steps}: at least 2 (the first warms up)")
    if args.runs < 1: ap.error(f"--runs {args.runs}: at least 1")
    try: import trl; trl_version = trl.__version__
    except ImportError: sys.exit("TRL is not installed: pip install trl==1.16.0 (in the dev and bench extras)")
    device = pick_device(ap, args.device)
    meta = bl.start_meta()
    out = Path(args.out) if args.out else bl.result_path("gpu_compare", args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = PEAK_SIZE["tiny" if args.quick else device]
    with tempfile.TemporaryDirectory(prefix=f".{out.stem}_models_", dir=out.parent) as folder:
        paths = model_folders(args.workloads, args.quick, Path(folder))
        builds = {k: f for k, f in paths.items() if f.startswith(folder)}
        prep = bl.run_worker(__file__, dict(arm="prepare", device=device, n=n, builds=builds, tiny=args.quick))
        peak = prep["peak"]
        mach = meta["machine"]
        where = mach.get("gpu") if device == "cuda" else f"{mach['cpu_model']}, {' '.join(mach['cpu_flags'])}"
        print(f"bf16 matmul peak on {device} ({where}): {peak['bf16_flops'] / 1e12:.3f} TFLOP/s ({n}^3)", flush=True)
        for k, b in prep["built"].items():
            print(f"built {k}: {b['params'] / 1e6:.1f} M parameters ({b['dtype']}), stop ids {b['stop_ids']}"
                  + (" never drawn" if k != "smollm2" else ""), flush=True)
        work = {k: run_workload(k, args, device, paths[k], prep["built"].get(k), peak["bf16_flops"])
                for k in args.workloads}
    for name, w in work.items(): print_workload(name, w)
    if args.quick: print("\n(--tiny: tiny random models on a few tokens; the ratios say nothing about real workloads)")
    res = {"name": "gpu_compare", "tiny": args.quick, "device": device, "trl_version": trl_version, "bf16_peak": peak,
           "ours_overrides": args.ours_set, "trl_overrides": args.trl_set,
           "flop_count": "LoRA, frozen base: 4 x base linear weights x (prompt + completion tokens of every row) + "
                         "4 x head weights x completion tokens; attention scores and adapters left out",
           "workloads": work, "meta": bl.finish_meta(meta)}
    print(f"wrote {bl.write_json(out, res)}")


if __name__ == "__main__":
    main()
