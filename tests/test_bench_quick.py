"""The quickest benchmark scripts, run with `--quick` (the tiny random model, seconds each): a script that no longer runs
against the package is found here, not by the next person who needs its numbers. (Two had drifted: a decoder subclass
missed a new prefill argument, and `load_config(overrides=None)` failed.) The slower scripts' `--quick` runs are listed in
bench/README.md."""
import json, os, subprocess, sys
from pathlib import Path
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
QUICK = ["decode_attention", "decode_step", "generation", "merge_lag", "step_anatomy"]


@pytest.mark.parametrize("script", QUICK)
def test_a_benchmark_runs_quick(script, tmp_path):
    out = tmp_path / f"{script}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--quick", "--threads", "2", "--out", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["meta"]["git"]["commit"], "a result records the commit it ran"
