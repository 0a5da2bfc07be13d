import os
from pathlib import Path
import pytest, torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# small excerpts of GSM8K and MATH-500 shipped with the repository
DATA = Path(__file__).resolve().parents[1] / "nbs" / "data"


@pytest.fixture(scope="session")
def data_dir():
    "The repository's `nbs/data`: gsm8k/{train,test}.jsonl (50 rows each, plus one) and math500/test.jsonl (20 rows)."
    return DATA


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
    """Tests marked `gpu` are skipped where there is no CUDA device (CPU CI); they run on GPU machines, and on the
    stand-in GPU where MMRGRPO_STAND_IN_GPU asks for one (a flow check)."""
    if torch.cuda.is_available() or os.environ.get("MMRGRPO_STAND_IN_GPU"): return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"): item.add_marker(skip)


@pytest.fixture
def no_model(monkeypatch):
    "Loading a model fails the test: errors and refusals must come before."
    def loaded(*a, **k): raise AssertionError("a model was loaded before the error")
    import transformers
    import mmrgrpo.trainer as T
    monkeypatch.setattr(T, "load_policy", loaded)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)


def cpu_with(flags) -> "CPUSupport":
    """The `CPUSupport` of a CPU with these /proc/cpuinfo-style flags (avx512_bf16, amx_bf16, avx512bw), to fake the
    hardware."""
    from mmrgrpo.models import CPUSupport
    flags = set(flags)
    bf16, amx = bool(flags & {"avx512_bf16", "amx_bf16"}), "amx_bf16" in flags
    units = sorted(flags & {"avx512_bf16", "amx_bf16"})
    return CPUSupport(bf16, amx, bf16 or "avx512bw" in flags,
                      f"CPU with {', '.join(units)}" if units else "CPU without avx512_bf16/amx")


@pytest.fixture(autouse=True)
def stand_in_gpu_when_asked():
    """MMRGRPO_STAND_IN_GPU=<compute capability> (e.g. 8.0): every test runs with a stand-in GPU visible
    (tests/fake_cuda.py), to check on a CPU that a test which asserts the CPU's choices pins the CPU."""
    wanted = os.environ.get("MMRGRPO_STAND_IN_GPU")
    if not wanted:
        yield
        return
    from fake_cuda import stand_in_gpu
    with stand_in_gpu(tuple(int(x) for x in wanted.split("."))): yield
