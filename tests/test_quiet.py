"A user sees no warnings they can do nothing about: not on import, not when a LoRA adapter is added."
import os, subprocess, sys, warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_importing_what_we_use_prints_nothing():
    """sentence-transformers and peft import bitsandbytes, whose CPU backend may log a notice about an optional hub
    kernel, and `kernels` (where it is installed) one about skipping that kernel's publisher check offline."""
    code = "import mmrgrpo.trainer, mmrgrpo.mmr; import peft, sentence_transformers"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not any(s in out.stderr for s in ("gemm_4bit_forward", "pip install kernels", "kernels-community")), \
        out.stderr[-2000:]


def test_adding_lora_warns_nothing(tokenizer):
    "peft reads `is_gradient_checkpointing`, which transformers 5 deprecates with a FutureWarning on every call."
    from mmrgrpo.config import GRPOConfig
    from mmrgrpo.models import add_lora, tiny_random_model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        add_lora(tiny_random_model(tokenizer), GRPOConfig())
    # shown to users by default
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
