#!/usr/bin/env bash
# One-shot GPU check: what mmrgrpo needs a CUDA GPU for, in one command that fits a lease of the lent GPU machine
# (budget GPU_CHECK_BUDGET_S=300 s, so that one lease runs it, a fix, and it again), without network or package index:
# it runs from the payload of ../shared/gpu/prepare.sh (packages, the embedded SmolLM2, a tiny random embedder at
# $GPU_EMBEDDER for MMR), as `python3` finds them (PYTHON=... names another interpreter).
#
#   bash bench/gpu_check.sh [OUT]       # OUT defaults to bench/results/gpu_check; the summary is OUT/gpu_check.json
#
# Stages run in order, each under its own deadline (s); one that would start with under 20 s of the budget left is
# recorded as skipped. OUT/gpu_check.json is rewritten after every stage, so a stage that hangs, or a call that ends
# early, leaves the summary of those before it. GPU_CHECK_STAGES="env hf_lora ..." runs another list.
#   default (about 300 s on an H100; GPU_CHECK_DEADLINE_SCALE=2 doubles every deadline, e.g. on a slower GPU):
#   env         45  GPU, driver, torch/CUDA, bitsandbytes, compute capability, the precision `choose_dtype` picks, vLLM;
#                   converts the embedded SmolLM2 once (the stages below load it)
#   hf_lora     35  6 steps, LoRA, dtype/autocast auto (bf16 on compute capability >= 8); its checkpoint feeds `eval`
#   eval        25  `mmrgrpo eval --checkpoint` of hf_lora's last checkpoint
#   resume      40  4 steps straight vs. stopped at step 2 and resumed (resume_from=latest): the same last loss/reward
#   methods     45  3 steps each: mmr=true (embedding_model=$GPU_EMBEDDER), prune_rate=0.5, token_selection=gmts,
#                   all three
#   qlora       30  3 steps, load_in_4bit=true (NF4) with gradient checkpointing
#   qlora_grads 35  LoRA gradients of 4-bit SmolLM2 against its dequantized twin: fp32 and bf16 compute, 1 and many
#                   tokens
#   ddp         45  torchrun --nproc_per_node 2 -m mmrgrpo.cli train: 2 processes; on one GPU they share it (gloo)
#   fsdp2       45  the same with sharding=fsdp2
#   on request (GPU_CHECK_STAGES): pytest_gpu 150 (`pytest -m gpu`: tests/test_gpu.py covers the stages above as
#   tests), demo 80 (configs/demo.yaml, held-out accuracy before and after), pytest_vllm_fw 90 and vllm_lora 120
#   (where `import vllm` works), colab 120 (where nbdev/execnb import), suite (the rest of the budget: pytest, tests/)
# Not a stage (it needs the bench extra, pip install trl==1.16.0, and minutes more): issue 47's comparison with TRL,
#   python bench/gpu_compare.py --device cuda --out bench/results/gpu_compare_h200.json
#   (BENCHMARKS_HISTORY.md section 6a)
# Each stage's status (passed/failed/skipped), wall time, deadline and peak GPU memory (nvidia-smi, whole GPU, every
# 250 ms) go to the summary, with each run's own numbers: precision, median step times, torch's peak allocated and
# reserved memory, rewards, accuracy, gradient errors, pytest counts. At most three files stay in OUT: gpu_check.json,
# gpu_check_logs.tgz (each stage's log, nvidia-smi samples and result JSON) and colab_outputs.txt.
#
# A dry run on a CPU, to check the script's flow before a lease (GPU_CHECK_DRY_RUN=1): model=tiny-random at small
# sizes, the Python stages on the stand-in GPU of tests/fake_cuda.py (compute capability 8.0), the command-line ones
# (eval, ddp, fsdp2) on the CPU, deadlines x4 and a 1200 s budget; qlora and qlora_grads are skipped (bitsandbytes' CUDA
# kernels), as is the suite (CI's).
# Exit: 0 all passed, 1 a stage failed, 2 no CUDA GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/gpu_check}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DRY=${GPU_CHECK_DRY_RUN:-0}
BUDGET=${GPU_CHECK_BUDGET_S:-$( [ "$DRY" = 1 ] && echo 1200 || echo 300 )}
SCALE=${GPU_CHECK_DEADLINE_SCALE:-$( [ "$DRY" = 1 ] && echo 4 || echo 1 )}
RESERVE=10                                  # seconds kept for the summary and the tar after the last stage
START=$(date +%s)
STAGES="$OUT/stages.jsonl"
DEFAULT="env hf_lora eval resume methods qlora qlora_grads ddp fsdp2"
declare -A LIMIT=([env]=45 [hf_lora]=35 [eval]=25 [resume]=40 [methods]=45 [qlora]=30 [qlora_grads]=35 [ddp]=45
                  [fsdp2]=45 [pytest_gpu]=150 [demo]=80 [pytest_vllm_fw]=90 [vllm_lora]=120 [colab]=120 [suite]=0)
export GPU_CHECK_MODEL=smollm2 GPU_CHECK_DRY_RUN=$DRY
if [ "$DRY" = 1 ]; then
    export GPU_CHECK_MODEL=tiny-random
    echo "gpu_check: dry run on the CPU (tiny-random; Python stages on the stand-in GPU)"
else
    "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
        || { echo "gpu_check: no CUDA GPU is visible (GPU_CHECK_DRY_RUN=1 checks the flow on a CPU)" >&2; exit 2; }
fi

: > "$STAGES"
RUNS_DIR=$(mktemp -d)                       # the runs' output_dir (checkpoints): scratch, removed at the end
trap 'rm -rf "$RUNS_DIR"' EXIT
export GPU_CHECK_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
RUNS="$PY bench/gpu_check_runs.py"

summarize() { $RUNS summary "$OUT" "$RUNS_DIR" > /dev/null 2>&1; }     # rewrite gpu_check.json from what ran so far

skip() {    # skip NAME REASON: record a stage as skipped
    printf '{"stage": "%s", "status": "skipped", "reason": "%s"}\n' "$1" "$2" >> "$STAGES"
    printf '%-16s skipped (%s)\n' "$1" "$2"
    summarize
}

stage() {   # stage NAME COMMAND...: run it under its deadline within the budget; log, exit code, wall time, peak memory
    local name=$1 limit=$(( ${LIMIT[$1]} * SCALE )); shift
    local left=$(( BUDGET - RESERVE - ($(date +%s) - START) ))
    if (( left < 20 )); then skip "$name" "time budget spent"; return; fi
    (( limit > left || limit == 0 )) && limit=$left
    local mon=""
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > "$OUT/$name.mem" 2>/dev/null &
        mon=$!
    fi
    local t0 rc t1 peak wall
    t0=$(date +%s.%N)
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1; rc=$?
    t1=$(date +%s.%N)
    [ -n "$mon" ] && { kill "$mon" 2>/dev/null; wait "$mon" 2>/dev/null; }
    peak=$(sort -n "$OUT/$name.mem" 2>/dev/null | tail -1 | tr -dc '0-9')
    wall=$(awk "BEGIN{printf \"%.1f\", $t1 - $t0}")
    printf '{"stage": "%s", "rc": %s, "wall_s": %s, "peak_gpu_mb": %s, "limit_s": %s}\n' \
        "$name" "$rc" "$wall" "${peak:-null}" "$limit" >> "$STAGES"
    printf '%-16s rc=%-3s %7s s (deadline %3s s)  peak GPU memory %s MB\n' "$name" "$rc" "$wall" "$limit" "${peak:-?}"
    summarize
}

# a short run through the command line, for eval and the 2-process launches
CLI_RUN="model=$GPU_CHECK_MODEL task=arithmetic:2 num_generations=8 prompts_per_step=8 max_completion_length=32
         lora_r=16 lora_alpha=32 beta=0.0 steps=3 eval_size=0 save_every=0 log_completions_every=0 seed=0"
launch() {  # launch none|fsdp2: 2 processes through torchrun (on a 1-GPU machine they share it: gloo, said in the log)
    "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m mmrgrpo.cli train $CLI_RUN sharding="$1" \
        output_dir="$RUNS_DIR/launch_$1"
}
evaluate() {    # `mmrgrpo eval` of hf_lora's last checkpoint
    local ck
    ck=$(ls -d "$RUNS_DIR"/hf_lora/checkpoint-[0-9]* 2>/dev/null | sort -t- -k2 -n | tail -1)
    [ -n "$ck" ] || { echo "eval: hf_lora left no checkpoint in $RUNS_DIR/hf_lora" >&2; return 3; }
    echo "checkpoint: $ck"
    "$PY" -m mmrgrpo.cli eval --checkpoint "$ck" model="$GPU_CHECK_MODEL" task=arithmetic:2 eval_size=32 \
        max_completion_length=32
}
pytest_gpu() {  # the GPU-marked tests (dry: one of tests/test_gpu.py on the stand-in)
    if [ "$DRY" = 1 ]; then MMRGRPO_STAND_IN_GPU=8.0 MMRGRPO_GPU_TEST_MODEL=tiny-random "$PY" -m pytest -q \
        -p no:cacheprovider -m gpu tests/test_gpu.py -k gmts
    else "$PY" -m pytest -q -p no:cacheprovider -m gpu tests --deselect "$FW"; fi
}
export RUNS_DIR CLI_RUN PY DRY; export -f launch evaluate pytest_gpu    # `timeout` runs them through bash -c

HAS_VLLM=$("$PY" -c "import vllm" >/dev/null 2>&1 && echo 1 || echo 0)
export FW=tests/test_vllm.py::test_vllm_full_weight_sync_and_sleep
[ -n "${GPU_EMBEDDER:-}" ] || echo "gpu_check: GPU_EMBEDDER is not set: MMR uses the configured default embedder" >&2
for name in ${GPU_CHECK_STAGES:-$DEFAULT}; do
    [ -n "${LIMIT[$name]+x}" ] || { skip "$name" "no such stage"; continue; }
    case $name in
        env|hf_lora|resume|methods|demo) stage "$name" $RUNS "$name" "$OUT" "$RUNS_DIR" ;;
        qlora|qlora_grads)
            if [ "$DRY" = 1 ]; then skip "$name" "dry run: bitsandbytes' 4-bit CUDA kernels"
            else stage "$name" $RUNS "$name" "$OUT" "$RUNS_DIR"; fi ;;
        eval) stage eval bash -c evaluate ;;
        ddp) stage ddp bash -c "launch none" ;;
        fsdp2) stage fsdp2 bash -c "launch fsdp2" ;;
        pytest_gpu) stage pytest_gpu bash -c pytest_gpu ;;
        pytest_vllm_fw|vllm_lora)
            if (( ! HAS_VLLM )); then skip "$name" "import vllm fails: vLLM is not installed here"
            elif [ "$name" = vllm_lora ]; then stage vllm_lora $RUNS vllm_lora "$OUT" "$RUNS_DIR"
            else stage pytest_vllm_fw "$PY" -m pytest -q -p no:cacheprovider -m gpu "$FW"; fi ;;
        colab)
            if "$PY" -c "import nbdev, execnb" >/dev/null 2>&1; then stage colab $RUNS colab "$OUT" "$RUNS_DIR"
            else skip colab "nbdev/execnb are not installed here"; fi ;;
        suite)
            if [ "$DRY" = 1 ]; then skip suite "dry run: CI runs the suite on the CPU"
            else stage suite "$PY" -m pytest -q -x -p no:cacheprovider --timeout 120 tests -m "not browser and not slow"
            fi ;;
    esac
done
echo "total $(( $(date +%s) - START )) s (budget $BUDGET s); summary: $OUT/gpu_check.json"
$RUNS summary "$OUT" "$RUNS_DIR"; rc=$?
# at most a few files come back from a device call: the logs, samples and results go into one archive
(cd "$OUT" && tar czf gpu_check_logs.tgz --remove-files stages.jsonl \
    $(ls *.log *.mem 2>/dev/null) $(ls *.json 2>/dev/null | grep -vx gpu_check.json))
exit $rc
