import os
from pathlib import Path
import pytest, torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def shared_data():
    d = SHARED / "data"
    if not d.exists(): pytest.skip(f"shared data not found at {d}")
    return d


@pytest.fixture(scope="session")
def smollm2_path():
    "The embedded SmolLM2-135M-Instruct, converted once to a plain folder."
    from mmrgrpo.models import resolve_model
    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    from mmrgrpo.models import load_tokenizer
    return load_tokenizer(smollm2_path)


@pytest.fixture()
def tiny_model(tokenizer):
    "A fresh 2-layer random Llama with SmolLM2's vocabulary."
    from mmrgrpo.models import tiny_random_model
    return tiny_random_model(tokenizer, seed=0)


def pytest_collection_modifyitems(config, items):
    "Tests marked `gpu` are skipped where there is no CUDA device (CPU CI); they run on GPU machines."
    if torch.cuda.is_available(): return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"): item.add_marker(skip)
