"""The quickest benchmark scripts, run with `--quick` (the tiny random model, seconds each): a script that no longer
runs against the package is found here, not by the next person who needs its numbers. (Two had drifted: a decoder
subclass missed a new prefill argument, and `load_config(overrides=None)` failed.) The slower scripts' `--quick` runs
are listed in bench/README.md."""
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


def test_gpu_compare_runs_tiny_on_the_cpu(tmp_path):
    "bench/gpu_compare.py --tiny: both workloads, both arms, on the CPU; every qwen-shape completion runs to the limit."
    pytest.importorskip("trl", reason="TRL is in the dev and bench extras: pip install -e '.[dev]'")
    out = tmp_path / "gpu_compare.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, str(BENCH / "gpu_compare.py"), "--tiny", "--device", "cpu", "--threads", "2",
                        "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["meta"]["git"]["commit"] and saved["device"] == "cpu"
    assert set(saved["workloads"]) == {"smollm2", "qwen1.5b"}
    for w in saved["workloads"].values():
        assert all(v > 0 for v in w["ratios_ours_over_trl"].values()), w["ratios_ours_over_trl"]
    assert saved["workloads"]["qwen1.5b"]["all_to_the_limit"] == {"ours": True, "trl": True}
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".gpu_compare_models_")], "built models are removed"


def test_never_ends_makes_the_stop_tokens_impossible():
    "gpu_compare's weight edit: a stop token's probability is exactly 0 after any other token, tied head or not."
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config
    sys.path.insert(0, str(BENCH))
    from gpu_compare import QWEN_TINY, never_ends
    torch.manual_seed(0)
    stops, ids = [2, 7], torch.randint(8, 300, (4, 40))
    ids[:, 5] = 2                                    # a stop token inside the input (a prompt's turn end, a pad)
    for tied in (True, False):
        model = never_ends(AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=300, tie_word_embeddings=tied,
                                                                         **QWEN_TINY)), stops)
        probs = model(ids).logits.softmax(-1)
        after_other = (ids != 2)[..., None]              # predictions made after a token that is not a stop token
        assert (probs[..., stops] * after_other).max() == 0 and probs.sum(-1).allclose(torch.ones(4, 40))
