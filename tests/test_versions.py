"""What the oldest versions pyproject.toml allows do differently, emulated here on the newest; tools/lowest_versions.sh
meets them for real (transformers 4.56, peft 0.17)."""
import importlib.metadata
import pytest
from mmrgrpo import models
from mmrgrpo.config import load_config


def test_converted_models_are_kept_per_transformers_major_version(monkeypatch, tmp_path):
    "A tokenizer that transformers 5 saved names a class transformers 4 lacks: each major version converts its own."
    monkeypatch.setenv("MMRGRPO_CACHE", str(tmp_path))
    written, real = [], importlib.metadata.version
    monkeypatch.setattr(models, "gguf_to_folder", lambda folder, name, out: written.append(out) or out)
    for version in ("4.56.0", "5.25.0", "4.57.6"):
        monkeypatch.setattr(importlib.metadata, "version", lambda n: version if n == "transformers" else real(n))
        models.resolve_model("smollm2")
    assert written == [tmp_path / f"transformers{v}" / "SmolLM2-135M-Instruct" for v in (4, 5, 4)]


def test_a_step_runs_where_get_decoder_answers_none(monkeypatch, tmp_path, tokenizer):
    """transformers 4.56's `LlamaForCausalLM.get_decoder()` asks `LlamaModel.get_decoder()`, which answers None:
    sampling, the packed update and the reference pass find the decoder all the same (`decoder_of`)."""
    from transformers import LlamaModel
    from mmrgrpo.trainer import train
    monkeypatch.setattr(LlamaModel, "get_decoder", lambda self: None)
    c = load_config(model="tiny-random", steps=1, num_generations=4, prompts_per_step=2, max_completion_length=6,
                    beta=0.04, eval_size=0, save_every=0, log_completions_every=0, output_dir=str(tmp_path / "run"))
    assert c.pack_completions
    res = train(c, progress=False)
    assert [r["step"] for r in res.metrics if "loss" in r] == [1]


def test_cache_room_where_layers_have_no_is_initialized(tiny_model, tokenizer):
    "transformers 4.56's `DynamicLayer` has no `is_initialized` (its keys are None until the first token): room still."
    import torch
    from mmrgrpo.kvcache import reserve_cache
    from mmrgrpo.logprobs import output_cache
    ids = torch.tensor([tokenizer("What is 2 + 2?").input_ids])
    cache = output_cache(tiny_model(input_ids=ids, use_cache=True))
    for layer in cache.layers: layer.__dict__.pop("is_initialized", None)   # as in 4.56 (there: never set)
    n = cache.layers[0].keys.shape[-2]
    reserve_cache(cache, 8)
    assert all(type(layer).__name__ == "ReservedLayer" and layer._k.shape[-2] == n + 8 for layer in cache.layers)
