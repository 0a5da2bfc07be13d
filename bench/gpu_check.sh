#!/usr/bin/env bash
# One-shot GPU check: everything in mmrgrpo that needs a CUDA GPU, in one command that finishes inside one 10-minute
# call of the lent GPU machine (budget GPU_CHECK_BUDGET_S=540 s), without network or package index: it runs from the
# payload of ../shared/gpu/prepare.sh (packages, the embedded SmolLM2, a tiny random embedder at $GPU_EMBEDDER for MMR).
#
#   bash bench/gpu_check.sh [OUT]       # OUT defaults to bench/results/gpu_check; the summary is OUT/gpu_check.json
#
# Stages, each with its own time limit (s); skipped, and recorded as skipped, once the whole budget is spent; the
# suite takes what is left. Logs: OUT/gpu_check_logs.tgz (each stage's log, its nvidia-smi samples, its result JSON).
#   env         30  GPU, driver, torch/CUDA, bitsandbytes, compute capability, the precision `choose_dtype` picks, vLLM
#   pytest_gpu  75  the GPU-marked tests (`pytest -m gpu`), except the vLLM full-weight test
#   demo        80  configs/demo.yaml (what `mmrgrpo demo` trains), eval before and after only: held-out accuracy rises?
#   hf_lora     45  10 steps, LoRA, dtype/autocast auto (bf16 on compute capability >= 8); its checkpoint feeds `eval`
#   eval        35  `mmrgrpo eval --checkpoint` of hf_lora's last checkpoint
#   methods     90  4 steps each: mmr=true (embedding_model=$GPU_EMBEDDER), prune_rate=0.5, token_selection=gmts,
#                   and all three
#   qlora       45  4 steps, load_in_4bit=true (NF4) with gradient checkpointing
#   qlora_grads 60  LoRA gradients of 4-bit SmolLM2 against its dequantized twin: fp32 and bf16 compute,
#                   inputs of 1 and of many tokens
#   resume      70  4 steps straight vs. stopped at step 2 and resumed (resume_from=latest): the same last loss/reward
#   ddp         50  `accelerate launch --num_processes 1 --config_file configs/accelerate/ddp.yaml -m mmrgrpo.cli train`
#   fsdp2       50  the same with configs/accelerate/fsdp2.yaml
#   pytest_vllm_fw, vllm_lora (90, 120): only where `import vllm` works (skipped with the reason otherwise)
#   colab      120  nbs/tutorials/colab_qlora.ipynb at reduced size: only where nbdev/execnb import (not in the payload)
#   suite     rest  python -m pytest -q -x --timeout 120 tests -m "not browser and not slow" with CUDA visible: counts
# Not a stage (it needs the bench extra, pip install trl==1.16.0, and minutes more): issue 47's comparison with TRL,
#   python bench/gpu_compare.py --device cuda --out bench/results/gpu_compare_h200.json
#   (BENCHMARKS_HISTORY.md section 6a)
# Each stage's status (passed/failed/skipped), wall time and peak GPU memory (nvidia-smi, whole GPU, every 250 ms) go to
# the summary, with each run's own numbers: precision, median step times, torch's peak allocated memory, rewards,
# accuracy, gradient errors, pytest counts. At most three files stay in OUT: gpu_check.json, gpu_check_logs.tgz and
# colab_outputs.txt. Exit: 0 all passed, 1 a stage failed, 2 no CUDA GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/gpu_check}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
BUDGET=${GPU_CHECK_BUDGET_S:-540}
RESERVE=15                                  # seconds kept for the summary and the tar after the last stage
START=$(date +%s)
STAGES="$OUT/stages.jsonl"

python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
    || { echo "gpu_check: no CUDA GPU is visible" >&2; exit 2; }

: > "$STAGES"
RUNS_DIR=$(mktemp -d)                       # the runs' output_dir (checkpoints): scratch, removed at the end
trap 'rm -rf "$RUNS_DIR"' EXIT
export GPU_CHECK_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
RUNS="python bench/gpu_check_runs.py"

skip() {    # skip NAME REASON: record a stage as skipped
    printf '{"stage": "%s", "status": "skipped", "reason": "%s"}\n' "$1" "$2" >> "$STAGES"
    printf '%-16s skipped (%s)\n' "$1" "$2"
}

stage() {   # stage NAME LIMIT_S COMMAND...: run it within the budget; log, exit code, wall time, peak GPU memory
    local name=$1 limit=$2; shift 2
    local left=$(( BUDGET - RESERVE - ($(date +%s) - START) ))
    if (( left < 30 )); then skip "$name" "time budget spent"; return; fi
    (( limit > left || limit == 0 )) && limit=$left
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > "$OUT/$name.mem" 2>/dev/null &
    local mon=$! t0 rc t1 peak wall
    t0=$(date +%s.%N)
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1; rc=$?
    t1=$(date +%s.%N)
    kill "$mon" 2>/dev/null; wait "$mon" 2>/dev/null
    peak=$(sort -n "$OUT/$name.mem" 2>/dev/null | tail -1 | tr -dc '0-9')
    wall=$(awk "BEGIN{printf \"%.1f\", $t1 - $t0}")
    printf '{"stage": "%s", "rc": %s, "wall_s": %s, "peak_gpu_mb": %s, "limit_s": %s}\n' \
        "$name" "$rc" "$wall" "${peak:-null}" "$limit" >> "$STAGES"
    printf '%-16s rc=%-3s %7s s  peak GPU memory %s MB\n' "$name" "$rc" "$wall" "${peak:-?}"
}

# a short run through the command line, for eval and the accelerate launches
CLI_RUN="model=smollm2 task=arithmetic:2 num_generations=8 prompts_per_step=8 max_completion_length=32 lora_r=16
         lora_alpha=32 beta=0.0 steps=3 eval_size=8 eval_every=0 save_every=0 log_completions_every=0 seed=0"
launch() {  # launch ddp|fsdp2: one process on one GPU through accelerate launch
    local acc=(accelerate launch); command -v accelerate >/dev/null || acc=(python -m accelerate.commands.launch)
    "${acc[@]}" --num_processes 1 --config_file "configs/accelerate/$1.yaml" -m mmrgrpo.cli train \
        $CLI_RUN output_dir="$RUNS_DIR/$1"
}
evaluate() {    # `mmrgrpo eval` of hf_lora's last checkpoint
    local ck
    ck=$(ls -d "$RUNS_DIR"/hf_lora/checkpoint-[0-9]* 2>/dev/null | sort -t- -k2 -n | tail -1)
    [ -n "$ck" ] || { echo "eval: hf_lora left no checkpoint in $RUNS_DIR/hf_lora" >&2; return 3; }
    echo "checkpoint: $ck"
    python -m mmrgrpo.cli eval --checkpoint "$ck" model=smollm2 task=arithmetic:2 eval_size=32 max_completion_length=32
}
export RUNS_DIR CLI_RUN; export -f launch evaluate      # `timeout` runs them through bash -c

stage env 30 $RUNS env "$OUT" "$RUNS_DIR"
HAS_VLLM=$(python -c "import vllm" >/dev/null 2>&1 && echo 1 || echo 0)
FW=tests/test_vllm.py::test_vllm_full_weight_sync_and_sleep
stage pytest_gpu 75 python -m pytest -q -p no:cacheprovider -m gpu tests --deselect "$FW"
if (( HAS_VLLM )); then stage pytest_vllm_fw 90 python -m pytest -q -p no:cacheprovider -m gpu "$FW"
else skip pytest_vllm_fw "import vllm fails: vLLM is not installed here"; fi
stage demo 80 $RUNS demo "$OUT" "$RUNS_DIR"
stage hf_lora 45 $RUNS hf_lora "$OUT" "$RUNS_DIR"
stage eval 35 bash -c evaluate
[ -n "${GPU_EMBEDDER:-}" ] || echo "gpu_check: GPU_EMBEDDER is not set: MMR uses the configured default embedder" >&2
stage methods 90 $RUNS methods "$OUT" "$RUNS_DIR"
stage qlora 45 $RUNS qlora "$OUT" "$RUNS_DIR"
stage qlora_grads 60 $RUNS qlora_grads "$OUT" "$RUNS_DIR"
stage resume 70 $RUNS resume "$OUT" "$RUNS_DIR"
stage ddp 50 bash -c "launch ddp"
stage fsdp2 50 bash -c "launch fsdp2"
if (( HAS_VLLM )); then stage vllm_lora 120 $RUNS vllm_lora "$OUT" "$RUNS_DIR"
else skip vllm_lora "import vllm fails: vLLM is not installed here"; fi
if python -c "import nbdev, execnb" >/dev/null 2>&1; then stage colab 120 $RUNS colab "$OUT" "$RUNS_DIR"
else skip colab "nbdev/execnb are not installed here"; fi
stage suite 0 python -m pytest -q -x -p no:cacheprovider --timeout 120 tests -m "not browser and not slow"
echo "total $(( $(date +%s) - START )) s (budget $BUDGET s); summary: $OUT/gpu_check.json"
$RUNS summary "$OUT" "$RUNS_DIR"; rc=$?
# at most a few files come back from a device call: the logs, samples and results go into one archive
(cd "$OUT" && tar czf gpu_check_logs.tgz --remove-files stages.jsonl \
    $(ls *.log *.mem 2>/dev/null) $(ls *.json 2>/dev/null | grep -vx gpu_check.json))
exit $rc
