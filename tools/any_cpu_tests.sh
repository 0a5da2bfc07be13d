#!/usr/bin/env bash
# The lessons, the quick benchmarks and the tests of the CPU-dependent paths as on a CPU without AVX-512 or bf16 units (most
# laptops), on any machine: MMRGRPO_CPU=avx2 makes the package act as on such a CPU and makes oneDNN's bf16 weight ops fail as
# they do there (nbs/13_models.ipynb), and ATEN_CPU_CAPABILITY=avx2 makes torch pick its AVX2 kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
if grep -qw avx2 /proc/cpuinfo 2>/dev/null && ! grep -qwE 'avx512f|amx_bf16' /proc/cpuinfo; then
    # an x86 CPU with AVX2 and no AVX-512: the test command's own nbdev-test and pytest just ran everything on such a CPU
    echo "any_cpu_tests: this CPU has AVX2 and no AVX-512, so the run before this one was already the AVX2 run; skipped"
    exit 0
fi
export MMRGRPO_CPU=avx2 ATEN_CPU_CAPABILITY=avx2
echo "any_cpu_tests: the lessons and quick benchmarks as on an AVX2 CPU ($MMRGRPO_CPU)"
nbdev-test --n-workers 2
python -m pytest -q tests/test_bench_quick.py tests/test_fused_decode.py tests/test_precision.py tests/test_importance.py
