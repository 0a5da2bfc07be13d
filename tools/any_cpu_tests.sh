#!/usr/bin/env bash
# The lessons, the quick benchmarks and the tests of the CPU-dependent paths as on a CPU without AVX-512 or bf16 units (most
# laptops), on any machine: MMRGRPO_CPU=avx2 makes the package act as on such a CPU and makes oneDNN's bf16 weight ops fail as
# they do there (nbs/13_models.ipynb), and ATEN_CPU_CAPABILITY=avx2 makes torch pick its AVX2 kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
export MMRGRPO_CPU=avx2 ATEN_CPU_CAPABILITY=avx2
echo "any_cpu_tests: the lessons and quick benchmarks as on an AVX2 CPU ($MMRGRPO_CPU)"
nbdev-test --n-workers 2
python -m pytest -q tests/test_bench_quick.py tests/test_fused_decode.py tests/test_precision.py tests/test_importance.py
