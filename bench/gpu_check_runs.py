"""The Python side of bench/gpu_check.sh: python bench/gpu_check_runs.py MODE OUT RUNS
MODE: env, demo, hf_lora, methods, qlora, qlora_grads, resume, vllm_lora, colab, summary. OUT holds the stage logs and
results (MODE.json); RUNS is a scratch folder for the runs' output_dir (checkpoints stay out of OUT). `summary` (after
every stage) imports no torch. GPU_CHECK_DRY_RUN=1: the runs on the stand-in GPU of tests/fake_cuda.py (a flow check on
a CPU), with GPU_CHECK_MODEL (tiny-random) in place of SmolLM2."""
import contextlib, json, os, re, statistics, sys, time, traceback
from pathlib import Path

mode, out = sys.argv[1], Path(sys.argv[2])
runs = Path(sys.argv[3]) if len(sys.argv) > 3 else out / "runs"
REPO = Path.cwd()
DRY = os.environ.get("GPU_CHECK_DRY_RUN") == "1"
RUN = dict(model=os.environ.get("GPU_CHECK_MODEL", "smollm2"), task="arithmetic:2", num_generations=8,
           prompts_per_step=8, max_completion_length=32, learning_rate=5e-4, lora_r=16, lora_alpha=32, beta=0.0,
           steps=20, eval_size=32, eval_every=0, save_every=0, log_completions_every=0, seed=0)
if DRY:                                              # the stand-in runs on a CPU: small sizes for a flow check
    RUN.update(threads=1, num_generations=4, prompts_per_step=4, max_completion_length=8, eval_size=4)
SHORT = dict(steps=3, eval_size=4 if DRY else 8)     # the short runs: each method alone and together, QLoRA


def med(rows, k):
    v = [r[k] for r in rows if k in r]
    return statistics.median(v) if v else None


def train_run(name, config=None, **kw):
    from mmrgrpo.config import load_config
    from mmrgrpo.models import choose_dtype
    from mmrgrpo.trainer import train
    base = {} if config else RUN
    c = load_config(config, **{**base, **kw, "output_dir": str(runs / name)})
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    res = train(c, progress=False)
    steps = [r for r in res.metrics if "time/step" in r][1:]                 # step 1 warms up
    p = choose_dtype("cuda", c.dtype, c.autocast_bf16, frozen_base=c.lora)
    return res, c, {"config": {k: v for k, v in kw.items()}, "precision": p.describe(), **p.metrics(),
                    "wall_s": time.perf_counter() - t0, "median_step_s": med(steps, "time/step"),
                    "median_generate_s": med(steps, "time/generate"), "median_update_s": med(steps, "time/update"),
                    "torch_peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
                    "torch_peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
                    "reward_first": res.metrics[0].get("reward"), "reward_last": res.metrics[-1].get("reward"),
                    "loss_last": res.metrics[-1].get("loss"), "eval_before": res.eval_before.get("eval/accuracy"),
                    "eval_after": res.eval_after.get("eval/accuracy"),
                    "nonfinite_updates": sum(r.get("nonfinite_updates", 0) for r in res.metrics)}


def demo():
    "configs/demo.yaml (what `mmrgrpo demo` trains) with evaluation before and after only: does held-out accuracy rise?"
    steps = int(os.environ.get("GPU_CHECK_DEMO_STEPS", "15"))
    r = train_run("demo", config=REPO / "configs" / "demo.yaml", steps=steps, eval_every=0, save_every=0,
                  save_best=False, log_completions_every=0)[2]
    r["accuracy_rose"] = None if None in (r["eval_before"], r["eval_after"]) else r["eval_after"] > r["eval_before"]
    return r


def methods():
    "A short train with each method alone and all three together; every run is tried, the stage fails if any failed."
    emb = os.environ.get("GPU_EMBEDDER")
    mmr = dict(mmr=True, **({"embedding_model": emb} if emb else {}))
    combos = {"mmr": mmr, "prune": dict(prune_rate=0.5), "gmts": dict(token_selection="gmts"),
              "all3": dict(**mmr, prune_rate=0.5, token_selection="gmts")}
    result, failed = {"embedding_model": emb}, []
    for name, kw in combos.items():
        try: result[name] = train_run(f"method_{name}", **SHORT, **kw)[2]
        except Exception as e:
            failed.append(name)
            result[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            print(result[name]["trace"], file=sys.stderr)
    result["failed"] = failed
    return result, not failed


def lora_twins(c):
    "The 4-bit policy (non-zero adapter B) and the same model with plain linear layers holding the dequantized weights."
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit
    from mmrgrpo.config import load_config
    from mmrgrpo.models import load_policy
    q_model, _ = load_policy(c)
    torch.manual_seed(1)
    with torch.no_grad():                   # a non-zero adapter B, so that every adapter weight has a gradient
        for n, p in q_model.named_parameters():
            if "lora_B" in n: p.normal_(0, 0.05)
    d_model, _ = load_policy(load_config(**{**vars(c), "load_in_4bit": False}))
    plain = dict(d_model.named_modules())
    n4 = 0
    for name, m in q_model.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            w = plain[name].weight
            w.data = dequantize_4bit(m.weight.data, m.weight.quant_state).to(w.dtype).to(w.device)
            n4 += 1
    d_model.load_state_dict({n: p for n, p in q_model.state_dict().items() if "lora_" in n}, strict=False)
    return q_model, d_model, n4


def forward_grads(model, ids, bf16) -> dict:
    "The LoRA gradients of sum(sin(logits)) for input ids `ids`, in train mode (autocast bf16 when `bf16`)."
    model.train(); model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=ids.to(model.device)).logits
    logits.float().sin().sum().backward()
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


def qlora_grads():
    """QLoRA on the GPU: the LoRA gradients of SmolLM2 in 4-bit NF4 against the same model with the dequantized weights,
    compute in fp32 and in bf16, inputs of 1 token and of many (tests/test_qlora.py's check, on the GPU). The tolerance
    is relative to the model's largest gradient: 1e-3 in fp32, 5e-2 in bf16 (rounding of bf16 activations)."""
    from mmrgrpo.config import load_config
    result, ok = {}, True
    cases = {"fp32": (dict(dtype="float32", autocast_bf16=False), False, 1e-3),
             "bf16": (dict(autocast_bf16=True), True, 5e-2)}
    for label, (kw, bf16, tol) in cases.items():
        try:
            c = load_config(**{**RUN, **kw, "load_in_4bit": True, "output_dir": str(runs / f"qg_{label}")})
            q_model, d_model, n4 = lora_twins(c)
            q_model.eval()
            with torch.no_grad(): q_model(input_ids=torch.tensor([[7]], device=q_model.device))   # no-grad first
            rows = {}
            for shape in [(1, 1), (4, 1), (1, 64), (4, 128)]:
                ids = torch.randint(5, 1000, shape, generator=torch.Generator().manual_seed(0))
                g4, gd = forward_grads(q_model, ids, bf16), forward_grads(d_model, ids, bf16)
                scale = max(g.abs().max() for g in gd.values()).item()
                worst = (max(((g4[n] - gd[n]).abs().max().item() / scale, n) for n in gd) if scale > 0
                         else (float("inf"), ""))
                rows["x".join(map(str, shape))] = {"max_rel_err": worst[0], "worst_param": worst[1], "scale": scale,
                                                   "params": len(gd), "ok": scale > 0 and worst[0] < tol}
                ok &= rows["x".join(map(str, shape))]["ok"]
            result[label] = {"linear4bit_layers": n4, "tolerance": tol, "compute_dtype": str(next(
                m.compute_dtype for m in q_model.modules() if hasattr(m, "compute_dtype"))), "shapes": rows}
            del q_model, d_model; torch.cuda.empty_cache()
        except Exception as e:
            ok = False
            result[label] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            print(result[label]["trace"], file=sys.stderr)
    return result, ok


def resume():
    "A run stopped at step k and resumed (resume_from=latest) ends where the uninterrupted run ends (loss, reward)."
    from mmrgrpo.config import load_config
    from mmrgrpo.trainer import train
    steps, k = 4, 2
    kw = {**RUN, **SHORT, "steps": steps, "save_every": k}
    full = train(load_config(**kw, output_dir=str(runs / "resume_full")), progress=False).metrics
    train(load_config(**kw, output_dir=str(runs / "resume_part")), progress=False, stop_after=k)
    rest = train(load_config(**kw, output_dir=str(runs / "resume_part"), resume_from="latest"), progress=False).metrics
    last = lambda rows: [r for r in rows if "loss" in r][-1]
    a, b = last(full), last(rest)
    keys = [x for x in ("loss", "reward", "grad_norm") if x in a and x in b]
    diffs = {x: abs(a[x] - b[x]) for x in keys}
    ok = a.get("step") == b.get("step") == steps and all(d <= 1e-4 + 1e-3 * abs(a[x]) for x, d in diffs.items())
    return {"steps": steps, "stopped_at": k, "full_last": {x: a[x] for x in keys},
            "resumed_last": {x: b[x] for x in keys},
            "abs_diff": diffs, "resumed_first_step": ([r["step"] for r in rest if "step" in r] or [None])[0],
            "matches": ok}, ok


def gap(backend, model, tok, c):
    "The learner/sampler log-prob gap on 32 fresh completions of held-out prompts."
    from mmrgrpo.data import load_tasks
    from mmrgrpo.trainer import build_prompt
    from mmrgrpo.vllm_backend import logprob_gap
    prompts = [build_prompt(tok, c, t["question"], c.task) for t in load_tasks(c.task, "test", limit=8)]
    return logprob_gap(backend, model, backend.generate(prompts, 4, c.max_completion_length, seed=123))


def env():
    from mmrgrpo.models import choose_dtype, resolve_model
    from mmrgrpo.vllm_backend import vllm_status
    import transformers, peft
    t0 = time.perf_counter()
    resolve_model("smollm2")                         # converted once here: the stages after this load it
    convert_s = time.perf_counter() - t0
    ok, why = vllm_status()
    try: import bitsandbytes; bnb = bitsandbytes.__version__
    except Exception as e: bnb = f"not importable: {e}"
    return {"gpu": torch.cuda.get_device_name(0), "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
            "memory_gb": torch.cuda.get_device_properties(0).total_memory / 2**30, "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__, "peft": peft.__version__,
            "bitsandbytes": bnb, "precision_auto_lora": choose_dtype("cuda").describe(),
            "precision_auto_full": choose_dtype("cuda", frozen_base=False).describe(), "vllm": why if ok else None,
            "vllm_status": why, "embedder": os.environ.get("GPU_EMBEDDER"), "smollm2_ready_s": convert_s,
            "dry_run": DRY}


def colab():
    "The Colab tutorial, gpu cells included, with the run cut down (SmolLM2 in place of Qwen: no network here)."
    from nbdev.process import mk_cell, read_nb
    from execnb.shell import CaptureShell
    nb_path = REPO / "nbs" / "tutorials" / "colab_qlora.ipynb"
    nb = read_nb(nb_path)
    i = next(k for k, cell in enumerate(nb.cells) if cell.get("id") == "126616aa")        # the config cell
    nb.cells.insert(i + 1, mk_cell(
        "c = load_config(CONFIG, data_dir=c.data_dir, generation_backend=c.generation_backend, model='smollm2',\n"
        "                steps=4, eval_size=8, eval_every=2, save_every=2, log_completions_every=2,\n"
        f"                output_dir={str(runs / 'colab')!r})"))
    skip = lambda cell: cell.cell_type == "code" and cell.source.lstrip().startswith("#| notest")
    t0, cwd = time.perf_counter(), os.getcwd()
    sh = CaptureShell(nb_path)
    os.chdir(nb_path.parent)                          # the notebook finds its config and data from its own folder
    try: sh.run_all(nb, exc_stop=True, preproc=skip)
    finally: os.chdir(cwd)
    text = "\n".join(o.get("text", "") if isinstance(o.get("text", ""), str) else "".join(o["text"])
                     for cell in nb.cells for o in cell.get("outputs", []) if "text" in o)
    (out / "colab_outputs.txt").write_text(text)
    return {"wall_s": time.perf_counter() - t0, "backend": sh.user_ns["c"].generation_backend,
            "eval_after": sh.user_ns["res"].eval_after.get("eval/accuracy")}


def vllm_lora():
    from mmrgrpo.config import load_config
    from mmrgrpo.models import load_policy
    from mmrgrpo.vllm_backend import VLLMBackend
    res, c, result = train_run("vllm_lora", generation_backend="vllm", vllm_gpu_memory_utilization=0.3)
    result["logprob_gap_lora"] = gap(res.backend, res.model, res.tokenizer, c)
    q = load_config(**{**vars(c), "load_in_4bit": True, "gradient_checkpointing": True, "output_dir": str(runs / "q")})
    model, tok = load_policy(q)
    backend = VLLMBackend(model, tok, q)                    # fits the engine the run built: reused, not a second one
    result["engine_reused"] = backend.engine is res.backend.engine
    result["logprob_gap_qlora_16bit_sampler"] = gap(backend, model, tok, q)
    folder = backend.folder
    backend.close()                                         # shuts the engine down and removes its temporary folder
    result["engine_folder_removed"] = not folder.exists()
    return result


PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")


def log_numbers(s):
    "The key numbers of a stage run from the shell (pytest counts, eval accuracy, a run's last metrics line)."
    log = out / f"{s['stage']}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    r = {}
    if s["stage"].startswith("pytest") or s["stage"] == "suite":
        tail = [l for l in text.splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
        if tail: r = {k.rstrip("s") if k.startswith("error") else k: int(n) for n, k in PYTEST_COUNT.findall(tail[-1])}
        if not tail:                          # killed at its deadline: count the progress characters instead
            prog = "".join(l.split("[")[0].strip() for l in text.splitlines()
                           if re.fullmatch(r"[.FEsxX]+( +\[ *\d+%\])?", l))
            r = {"passed": prog.count("."), "failed": prog.count("F"), "error": prog.count("E"),
                 "skipped": prog.count("s"), "incomplete": True}
        r["first_failures"] = [l for l in text.splitlines() if l.startswith(("FAILED ", "ERROR "))][:20]
    elif s["stage"] == "eval":
        m = re.search(r'"eval/accuracy":\s*([0-9.eE+-]+)', text)
        r["eval_accuracy"] = float(m.group(1)) if m else None
    launched = {"ddp": "launch_none", "fsdp2": "launch_fsdp2"}.get(s["stage"], s["stage"])
    metrics = runs / launched / "metrics.jsonl"
    if s["stage"] in ("ddp", "fsdp2") and metrics.exists():
        rows = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
        rows = [x for x in rows if "loss" in x]
        if rows: r["last"] = {k: rows[-1].get(k) for k in ("step", "loss", "reward", "grad_norm", "time/step")}
    if s.get("status") == "failed":
        r["log_tail"] = text[-1500:]
    return r


def summary():
    stages = [json.loads(l) for l in (out / "stages.jsonl").read_text().splitlines() if l.strip()]
    for s in stages:
        f = out / f"{s['stage']}.json"
        if f.exists(): s["result"] = json.loads(f.read_text())
        if "rc" in s:
            s["status"] = "passed" if s["rc"] == 0 else "failed"
            if s["rc"] in (124, 137): s["timed_out"] = True
        extra = log_numbers(s)
        if extra and isinstance(s.setdefault("result", {}), dict): s["result"].update(extra)
    env_f = out / "env.json"
    counts = {k: sum(s.get("status") == k for s in stages) for k in ("passed", "failed", "skipped")}
    summary = {"env": json.loads(env_f.read_text()) if env_f.exists() else None, "counts": counts, "stages": stages,
               "ok": counts["failed"] == 0, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "commit": os.environ.get("GPU_CHECK_COMMIT")}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))
    keys = ("status", "rc", "wall_s", "peak_gpu_mb", "reason")
    print(json.dumps({s["stage"]: {k: s[k] for k in keys if k in s} for s in stages}, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    if mode == "summary": sys.exit(summary())
    import torch
    stand_in = contextlib.nullcontext()
    if DRY:                                          # a flow check on a CPU: the stand-in GPU of tests/fake_cuda.py
        sys.path.insert(0, str(REPO / "tests"))
        from fake_cuda import stand_in_gpu
        stand_in = stand_in_gpu((8, 0))
    ok = True
    with stand_in:
        if mode == "env": result = env()
        elif mode == "demo": result = demo()
        elif mode == "hf_lora": result = train_run("hf_lora", steps=int(os.environ.get("GPU_CHECK_LORA_STEPS", "6")))[2]
        elif mode == "methods": result, ok = methods()
        elif mode == "qlora": result = train_run("qlora", **SHORT, load_in_4bit=True, gradient_checkpointing=True)[2]
        elif mode == "qlora_grads": result, ok = qlora_grads()
        elif mode == "resume": result, ok = resume()
        elif mode == "vllm_lora": result = vllm_lora()
        elif mode == "colab": result = colab()
        else: sys.exit(f"unknown mode {mode}")
    (out / f"{mode}.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, indent=1, default=str))
    sys.exit(0 if ok else 1)
