"""GRPO for math reasoning, taught in notebooks: the names a user needs, each imported on first use (a cheap import).

`GRPOConfig`, `load_config` and `train` run a training; `evaluate` scores a model on held-out tasks; the reward
functions have TRL's signature, `f(prompts, completions, **dataset_columns) -> list[float | None]`, so your own sits
beside them."""
__version__ = "0.1.0"

import importlib as _importlib
import logging as _logging

# peft and sentence-transformers import bitsandbytes, which on CPUs with AVX512-BF16 logs that it could not fetch an
# optional kernel from the hub ("pip install kernels"); with `kernels` installed and the hub offline, `kernels` also
# logs that it skips the kernel's publisher check. Nothing a user can act on (the kernel is downloaded at run time, and
# runs are offline), so those two messages are dropped, before any of our modules can import them.
_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward"))
_logging.getLogger("kernels._internals.hf_hub").addFilter(
    lambda record: not record.getMessage().startswith("Skipping publisher trust check for 'kernels-community/"))

_PUBLIC = {                   # name -> the module that defines it
    "GRPOConfig": "config", "ConfigError": "config", "load_config": "config",
    "train": "trainer", "TrainResult": "trainer",
    "evaluate": "evaluation",
    "accuracy_reward": "rewards", "format_reward": "rewards", "cosine_reward": "rewards",
    "BUILTIN_REWARDS": "rewards", "get_reward_funcs": "rewards", "compute_rewards": "rewards",
    "RewardFunctionError": "rewards", "has_own_time_limit": "rewards", "verify_batch": "rewards",
    "extract_boxed": "rewards",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    "A public name, imported from its module on first use (a submodule such as `mmrgrpo.mmr` imports as usual)."
    if name not in _PUBLIC: raise AttributeError(f"module 'mmrgrpo' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    globals()[name] = value
    return value


def __dir__(): return sorted(list(globals()) + __all__)
