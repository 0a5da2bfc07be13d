#!/usr/bin/env bash
# The test command's steps after the install, each timed; every step runs, and the command fails if any failed.
# Steps: the notebooks' own tests, pytest, the lessons as on a CPU without AVX-512, vLLM's CPU build, a fresh Colab
# runtime simulated, the lowest versions pyproject.toml allows, and the lessons' website checked in Chromium.
# `bash tools/test.sh pytest site` runs only the steps named.
set -uo pipefail
cd "$(dirname "$0")/.."
declare -A RUN=(
    [nbdev-test]="nbdev-test --n-workers 2"
    [pytest]="python -m pytest -q"
    [any-cpu]="bash tools/any_cpu_tests.sh"
    [vllm-cpu]="bash tools/vllm_cpu_tests.sh"
    [colab-sim]="bash tools/colab_sim.sh"
    [lowest-versions]="bash tools/lowest_versions.sh"
    [site]="bash tools/site.sh"
)
ORDER=(nbdev-test pytest any-cpu vllm-cpu colab-sim lowest-versions site)
steps=("${@:-${ORDER[@]}}")
for s in "${steps[@]}"; do
    [ -n "${RUN[$s]:-}" ] || { echo "test.sh: no step named '$s': use any of ${ORDER[*]}"; exit 2; }
done
summary=() failed=0 start_all=$SECONDS
for s in "${steps[@]}"; do
    echo "=== test.sh: $s: ${RUN[$s]}  ($(date -u +%H:%M:%S) UTC)"
    start=$SECONDS
    bash -c "${RUN[$s]}"; rc=$?
    took=$((SECONDS - start))
    [ $rc = 0 ] && word=passed || { word="FAILED (exit $rc)"; failed=1; }
    echo "=== test.sh: $s $word in $((took / 60))m$((took % 60))s"
    summary+=("$(printf '%-16s %-18s %4dm%02ds' "$s" "$word" $((took / 60)) $((took % 60)))")
done
total=$((SECONDS - start_all))
echo "=== test.sh: step times"
printf '  %s\n' "${summary[@]}"
printf '  %-35s %4dm%02ds\n' "all" $((total / 60)) $((total % 60))
exit $failed
