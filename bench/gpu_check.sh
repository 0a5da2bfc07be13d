#!/usr/bin/env bash
# One-shot GPU check: everything in mmrgrpo that needs a CUDA GPU, in one command that finishes in under 8 minutes on one
# modern GPU, without network (the models come from the embedded wheels; the vLLM parts run only when vLLM loads).
#
#   bash bench/gpu_check.sh [OUT]          # OUT defaults to bench/results/gpu_check; the summary is OUT/gpu_check.json
#
# Stages (each logged to OUT/<stage>.log; skipped, and recorded as skipped, once the time budget GPU_CHECK_BUDGET_S=450 is spent):
#   env            GPU, driver, torch/CUDA, compute capability, the precision `choose_dtype` picks, vllm_status()
#   pytest_gpu     the GPU-marked tests (`pytest -m gpu`), except the vLLM full-weight test
#   pytest_vllm_fw the vLLM full-weight test, in a process of its own (vLLM allows one sleep-mode engine per process)
#   hf_lora        20 steps, transformers sampling, LoRA, dtype/autocast auto (bf16 on compute capability >= 8)
#   hf_qlora       the same with 4-bit NF4 base weights and gradient checkpointing (QLoRA)
#   vllm_lora      20 steps with generation_backend=vllm, then the learner/sampler log-prob gap on fresh completions, and
#                  the gap of a QLoRA policy sampled by the same (reused) engine
#   colab          nbs/tutorials/colab_qlora.ipynb, gpu cells included, at reduced size (SmolLM2, 4 steps, 8 eval questions)
# Not a stage (it needs the bench extra, pip install trl==1.16.0, and minutes more): issue 47's comparison with TRL,
#   python bench/gpu_compare.py --device cuda --out bench/results/gpu_compare_h200.json   (BENCHMARKS section 6a)
# Each stage's wall time and peak GPU memory (nvidia-smi, whole GPU, every 250 ms) go to the summary, with each run's own
# numbers: the precision used, median step/generate/update times, torch's peak allocated memory, rewards, accuracy, gaps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/gpu_check}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
BUDGET=${GPU_CHECK_BUDGET_S:-450}
START=$(date +%s)
STAGES="$OUT/stages.jsonl"
: > "$STAGES"

python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || { echo "gpu_check: no CUDA GPU is visible" >&2; exit 2; }

cat > "$OUT/gpu_runs.py" <<'PY'
"The Python side of bench/gpu_check.sh: python gpu_runs.py MODE OUT (MODE: env, hf_lora, hf_qlora, vllm_lora, colab, summary)."
import json, os, statistics, sys, time
from pathlib import Path
import torch

mode, out = sys.argv[1], Path(sys.argv[2])
REPO = Path.cwd()
RUN = dict(model="smollm2", task="arithmetic:2", num_generations=8, prompts_per_step=8, max_completion_length=32,
           learning_rate=5e-4, lora_r=16, lora_alpha=32, beta=0.0, steps=20, eval_size=32, eval_every=0, save_every=0,
           log_completions_every=0, seed=0)


def med(rows, k):
    v = [r[k] for r in rows if k in r]
    return statistics.median(v) if v else None


def train_run(name, **kw):
    from mmrgrpo.config import load_config
    from mmrgrpo.models import choose_dtype
    from mmrgrpo.trainer import train
    c = load_config(**{**RUN, **kw, "output_dir": str(out / "runs" / name)})
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
                    "eval_before": res.eval_before.get("eval/accuracy"), "eval_after": res.eval_after.get("eval/accuracy"),
                    "nonfinite_updates": sum(r.get("nonfinite_updates", 0) for r in res.metrics)}


def gap(backend, model, tok, c):
    "The learner/sampler log-prob gap on 32 fresh completions of held-out prompts."
    from mmrgrpo.data import load_tasks
    from mmrgrpo.trainer import build_prompt
    from mmrgrpo.vllm_backend import logprob_gap
    prompts = [build_prompt(tok, c, t["question"], c.task) for t in load_tasks(c.task, "test", limit=8)]
    return logprob_gap(backend, model, backend.generate(prompts, 4, c.max_completion_length, seed=123))


def env():
    from mmrgrpo.models import choose_dtype
    from mmrgrpo.vllm_backend import vllm_status
    import transformers, peft
    ok, why = vllm_status()
    return {"gpu": torch.cuda.get_device_name(0), "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
            "memory_gb": torch.cuda.get_device_properties(0).total_memory / 2**30, "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__, "peft": peft.__version__,
            "precision_auto_lora": choose_dtype("cuda").describe(),
            "precision_auto_full": choose_dtype("cuda", frozen_base=False).describe(), "vllm": why if ok else None,
            "vllm_status": why}


def colab():
    "The Colab tutorial, gpu cells included, with the run cut down (SmolLM2 in place of Qwen: no network here)."
    from nbdev.process import mk_cell, read_nb
    from execnb.shell import CaptureShell
    nb_path = REPO / "nbs" / "tutorials" / "colab_qlora.ipynb"
    nb = read_nb(nb_path)
    i = next(k for k, cell in enumerate(nb.cells) if cell.get("id") == "126616aa")        # the config cell
    nb.cells.insert(i + 1, mk_cell(
        "c = load_config(CONFIG, data_dir=c.data_dir, generation_backend=c.generation_backend, model='smollm2', steps=4,\n"
        f"                eval_size=8, eval_every=2, save_every=2, log_completions_every=2, output_dir={str(out / 'runs' / 'colab')!r})"))
    skip = lambda cell: cell.cell_type == "code" and cell.source.lstrip().startswith("#| notest")
    t0, cwd = time.perf_counter(), os.getcwd()
    sh = CaptureShell(nb_path)
    os.chdir(nb_path.parent)                                  # the notebook finds its config and data from its own folder
    try: sh.run_all(nb, exc_stop=True, preproc=skip)
    finally: os.chdir(cwd)
    text = "\n".join(o.get("text", "") if isinstance(o.get("text", ""), str) else "".join(o["text"])
                     for cell in nb.cells for o in cell.get("outputs", []) if "text" in o)
    (out / "colab_outputs.txt").write_text(text)
    return {"wall_s": time.perf_counter() - t0, "backend": sh.user_ns["c"].generation_backend,
            "eval_after": sh.user_ns["res"].eval_after.get("eval/accuracy")}


result = {}
if mode == "env": result = env()
elif mode == "hf_lora": result = train_run("hf_lora")[2]
elif mode == "hf_qlora": result = train_run("hf_qlora", load_in_4bit=True, gradient_checkpointing=True)[2]
elif mode == "vllm_lora":
    from mmrgrpo.config import load_config
    from mmrgrpo.models import load_policy
    from mmrgrpo.vllm_backend import VLLMBackend
    res, c, result = train_run("vllm_lora", generation_backend="vllm", vllm_gpu_memory_utilization=0.3)
    result["logprob_gap_lora"] = gap(res.backend, res.model, res.tokenizer, c)
    q = load_config(**{**vars(c), "load_in_4bit": True, "gradient_checkpointing": True, "output_dir": str(out / "runs" / "q")})
    model, tok = load_policy(q)
    backend = VLLMBackend(model, tok, q)                    # fits the engine the run built: reused, not a second one
    result["engine_reused"] = backend.engine is res.backend.engine
    result["logprob_gap_qlora_16bit_sampler"] = gap(backend, model, tok, q)
    folder = backend.folder
    backend.close()                                         # shuts the engine down and removes its temporary folder
    result["engine_folder_removed"] = not folder.exists()
elif mode == "colab": result = colab()
elif mode == "summary":
    stages = [json.loads(l) for l in (out / "stages.jsonl").read_text().splitlines() if l.strip()]
    for s in stages:
        f = out / f"{s['stage']}.json"
        if f.exists(): s["result"] = json.loads(f.read_text())
    env_f = out / "env.json"
    summary = {"env": json.loads(env_f.read_text()) if env_f.exists() else None, "stages": stages,
               "ok": all(s.get("rc") == 0 for s in stages if "rc" in s), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({s["stage"]: {k: s.get(k) for k in ("rc", "wall_s", "peak_gpu_mb", "skipped") if k in s} for s in stages}, indent=1))
    sys.exit(0 if summary["ok"] else 1)
(out / f"{mode}.json").write_text(json.dumps(result, indent=1, default=str))
print(json.dumps(result, indent=1, default=str))
PY

stage() {   # stage NAME LIMIT_S COMMAND...: run it within the budget; log, exit code, wall time, peak GPU memory
    local name=$1 limit=$2; shift 2
    local left=$(( BUDGET - ($(date +%s) - START) ))
    if (( left < 30 )); then
        echo "{\"stage\": \"$name\", \"skipped\": \"time budget spent\"}" >> "$STAGES"; printf '%-16s skipped (time budget)\n' "$name"; return
    fi
    (( limit > left )) && limit=$left
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > "$OUT/$name.mem" 2>/dev/null &
    local mon=$! t0 rc t1 peak wall
    t0=$(date +%s.%N)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1; rc=$?
    t1=$(date +%s.%N)
    kill "$mon" 2>/dev/null; wait "$mon" 2>/dev/null
    peak=$(sort -n "$OUT/$name.mem" 2>/dev/null | tail -1 | tr -dc '0-9')
    wall=$(awk "BEGIN{printf \"%.1f\", $t1 - $t0}")
    echo "{\"stage\": \"$name\", \"rc\": $rc, \"wall_s\": $wall, \"peak_gpu_mb\": ${peak:-null}, \"limit_s\": $limit}" >> "$STAGES"
    printf '%-16s rc=%-3s %7s s  peak GPU memory %s MB\n' "$name" "$rc" "$wall" "${peak:-?}"
}

RUNS="$OUT/gpu_runs.py"
stage env 60 python "$RUNS" env "$OUT"
HAS_VLLM=$(python -c "from mmrgrpo.vllm_backend import vllm_status; print(int(vllm_status()[0]))" 2>/dev/null || echo 0)
FW=tests/test_vllm.py::test_vllm_full_weight_sync_and_sleep
stage pytest_gpu 200 python -m pytest -q -p no:cacheprovider -m gpu tests --deselect "$FW"
(( HAS_VLLM )) && stage pytest_vllm_fw 90 python -m pytest -q -p no:cacheprovider -m gpu "$FW"
stage hf_lora 90 python "$RUNS" hf_lora "$OUT"
stage hf_qlora 100 python "$RUNS" hf_qlora "$OUT"
(( HAS_VLLM )) && stage vllm_lora 120 python "$RUNS" vllm_lora "$OUT"
stage colab 120 python "$RUNS" colab "$OUT"
echo "total $(( $(date +%s) - START )) s (budget $BUDGET s); summary: $OUT/gpu_check.json"
python "$RUNS" summary "$OUT"
