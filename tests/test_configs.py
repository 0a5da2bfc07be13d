"""Every shipped config file loads: run configs through `load_config`, accelerate launch configs through accelerate's
own reader."""
from pathlib import Path
import pytest
from mmrgrpo.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_run_config_loads(path):
    c = load_config(path)
    assert c.output_dir.startswith("runs/")


def test_colab_config_is_the_tutorials_qlora_run():
    c = load_config(CONFIGS / "colab_qlora.yaml")
    assert ((c.model, c.task, c.load_in_4bit, c.lora, c.mmr, c.dtype)
            == ("Qwen/Qwen2.5-0.5B-Instruct", "gsm8k", True, True, True, "auto"))
    assert c.autocast_bf16 == "auto"                     # a T4 computes the 4-bit layers and the update in float16
    assert c.prune_rate > 0 and c.gradient_checkpointing and c.generation_backend == "hf"   # works without vLLM


@pytest.mark.parametrize("name,kind", [("ddp", "MULTI_GPU"), ("fsdp2", "FSDP"), ("deepspeed_zero2", "DEEPSPEED"),
                                       ("deepspeed_zero3", "DEEPSPEED")])
def test_accelerate_config_reads(name, kind):
    from accelerate.commands.config.config_args import ClusterConfig
    path = CONFIGS / "accelerate" / f"{name}.yaml"
    cfg = ClusterConfig.from_yaml_file(path)
    assert cfg.distributed_type == kind and cfg.num_processes == 2 and cfg.mixed_precision == "no"
    # the file says so before anyone launches it
    if kind == "DEEPSPEED": assert "NOT SUPPORTED YET" in path.read_text()
    if name == "fsdp2": assert cfg.fsdp_config["fsdp_version"] == 2
    if kind == "DEEPSPEED": assert cfg.deepspeed_config["zero_stage"] == int(name[-1])


@pytest.mark.parametrize("var", ["ACCELERATE_USE_DEEPSPEED"])
def test_sharded_launch_is_refused_not_silently_unsharded(monkeypatch, var):
    from mmrgrpo.distributed import init_distributed
    monkeypatch.setenv(var, "true")
    with pytest.raises(ConfigError, match=f"{var}=true.*configs/accelerate/ddp.yaml"):
        init_distributed()


def test_accelerate_fsdp_launch_means_fsdp2(monkeypatch):
    """An accelerate FSDP launch is served (sharded by `shard_policy`), not refused; sharded only with more than one
    process."""
    from mmrgrpo import distributed
    from mmrgrpo.config import load_config
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert distributed.init_distributed() == (0, 1) and not distributed.uses_fsdp(load_config())
    monkeypatch.setattr(distributed, "dist_info", lambda: (0, 2))
    assert distributed.uses_fsdp(load_config())
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    assert not distributed.uses_fsdp(load_config()) and distributed.uses_fsdp(load_config(sharding="fsdp2"))
    for kw, field in [(dict(generation_backend="vllm"), "vllm"), (dict(load_in_4bit=True), "load_in_4bit"),
                      (dict(gradient_checkpointing=True), "gradient_checkpointing")]:
        with pytest.raises(ConfigError, match=f"sharding='fsdp2'.*{field}"):
            distributed.shard_policy(object(), load_config(sharding="fsdp2", **kw))


def test_settings_that_do_nothing_as_set_are_warned_about():
    from mmrgrpo.config import load_config
    for kw, says in ((dict(allocation=True), "allocation=true does nothing with prune_rate=0"),
                     (dict(token_selection_inverse=True),
                      "token_selection_inverse=true does nothing with token_selection=none"),
                     (dict(warmup_steps=20, steps=5), "warmup_steps=20 with steps=5: the learning rate never reaches")):
        with pytest.warns(UserWarning, match=says): load_config(**kw)


TRL_STYLE = """# written for TRL's GRPOTrainer: its names for the options both have
model: tiny-random
steps: 1
num_generations: 4
prompts_per_step: 2
max_completion_length: 6
eval_size: 0
log_completions_every: 0
reward_funcs: [format]
reward_weights: null
loss_type: bnpo
beta: 0.04
use_bias_correction_kl: true
epsilon: 0.15
epsilon_high: 0.28
delta: 4.0
mask_truncated_completions: true
top_entropy_quantile: 0.2
vllm_importance_sampling_mode: sequence_mask
vllm_importance_sampling_clip_max: 3.0
scale_rewards: group
"""


def test_mmrgrpo_train_runs_a_config_written_with_trls_names(tmp_path):
    "`mmrgrpo train --config` with TRL's names: trained as they say, and saved under ours."
    import json, yaml
    from mmrgrpo.cli import main
    (tmp_path / "trl.yaml").write_text(TRL_STYLE)
    out = tmp_path / "run"
    assert main(["train", "--config", str(tmp_path / "trl.yaml"), f"output_dir={out}", "sampler_dtype=float32"]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert {k: saved[k] for k in ("eps_low", "eps_high", "tis_cap", "token_selection", "keep_ratio", "loss_type",
                                  "use_bias_correction_kl", "delta", "mask_truncated_completions",
                                  "vllm_importance_sampling_mode")} == dict(
        eps_low=0.15, eps_high=0.28, tis_cap=3.0, token_selection="entropy", keep_ratio=0.2, loss_type="bnpo",
        use_bias_correction_kl=True, delta=4.0, mask_truncated_completions=True,
        vllm_importance_sampling_mode="sequence_mask")
    assert "epsilon" not in saved and load_config(out / "config.yaml").eps_low == 0.15     # it reads back
    step = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in l][0]
    assert "tokens/kept_fraction" in step and "is/ratio_mean" in step   # the entropy selector and the correction ran


def test_tiny_random_in_4_bits_is_refused():
    "The tiny random model is built in float32 in code: load_in_4bit would leave it unquantized (and off the GPU)."
    with pytest.raises(ConfigError, match=r"load_in_4bit=true with model='tiny-random'.*set load_in_4bit=false"):
        load_config(model="tiny-random", load_in_4bit=True)
    load_config(model="tiny-random", load_in_4bit=False)
