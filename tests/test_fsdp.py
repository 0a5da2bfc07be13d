"""FSDP2 (torch's `fully_shard`, `sharding='fsdp2'`) on 2 gloo processes, for LoRA and for full fine-tuning.

Launched once under `torchrun --standalone --nproc_per_node=2` (this very file), each process:
- runs `update` on a sharded copy of the fixed batch of tests/test_distributed.py (its half of the groups) and saves the
  gradient it would apply, gathered whole; the test compares it with the 1-process gradient of the whole batch;
- trains the tiny model 2 steps data-parallel (`sharding='none'`) and sharded, and once more sharded but stopped after
  step 1 and resumed; the test compares the trained weights and optimizer states;
- trains sharded with `save_best` (its best-checkpoint is written through the same collective as every checkpoint).
A second test launches the command line through `accelerate launch` with the shipped fsdp2 and ddp configs.
"""
import json, os, subprocess, sys, time
from pathlib import Path
import pytest, torch

TESTS, ROOT = Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]
# test_distributed and reward_fixtures import here and in children
if str(TESTS) not in sys.path: sys.path.insert(0, str(TESTS))
from test_distributed import B, G, make_batch, rollout_rows, case_config, small_llama

KINDS, CASES = ("lora", "full"), ("grpo", "dapo+gmts")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")])}
# sampler_dtype="policy": a sharded policy has no merged sampling copy (61_sampler_copy): neither arm
RUN = dict(model="tiny-random", num_generations=4, prompts_per_step=2, max_completion_length=6, eval_size=0,
           save_every=1, log_completions_every=0, learning_rate=1e-3, beta=0.04, autocast_bf16=False,
           reward_funcs=["reward_fixtures:varied"], reward_weights=None, steps=2, sampler_dtype="policy")


class WholeGradCapture:
    """Stands in for the optimizer: keeps the gradient `update` would apply, whole (a sharded gradient is gathered), and
    moves nothing."""
    def __init__(self, params): self.params, self.grads = list(params), None
    def zero_grad(self, set_to_none=True):
        for p in self.params: p.grad = None
    def step(self):
        from mmrgrpo.distributed import full_value
        self.grads = [full_value(p.grad).detach().clone() for p in self.params]


def policy(batch, kind):
    """The batch's policy weights; 'lora': under a LoRA adapter whose B is not zero (so every adapter weight has a
    gradient)."""
    model = small_llama(0); model.load_state_dict(batch["policy"])
    if kind == "full": return model
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(2)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                            init_lora_weights=False, task_type="CAUSAL_LM"))


def run_update(batch, name, kind, rows, shard=False):
    "The gradient and metrics of one `update` on `rows` of the batch; `shard`: FSDP2 over the processes."
    from mmrgrpo.distributed import shard_model
    from mmrgrpo.step import update
    model, ref = policy(batch, kind), None
    # LoRA: adapter off
    if kind == "full": ref = small_llama(1).requires_grad_(False); ref.load_state_dict(batch["ref"])
    if shard: shard_model(model)
    opt = WholeGradCapture(p for p in model.parameters() if p.requires_grad)
    if shard:     # sampling before the update, as in a run: a gradient-free forward leaves the root's weights gathered
        with torch.no_grad(): model(input_ids=batch["prompt_ids"][rows], attention_mask=batch["prompt_mask"][rows])
    m = update(model, opt, rollout_rows(batch, rows), batch["adv"][rows], case_config(name), ref_model=ref)
    return opt.grads, m


def run_config(out, kind, **kw):
    from mmrgrpo.config import load_config
    return load_config(**{**RUN, "lora": kind == "lora", "output_dir": str(out), **kw})


def worker(out: Path):
    "Body of each torchrun process."
    from mmrgrpo.distributed import init_distributed, is_sharded
    from mmrgrpo.trainer import train
    rank, world = init_distributed()
    batch = torch.load(out / "batch.pt", weights_only=False)
    n = B * G // world
    for kind in KINDS:
        for name in CASES:
            grads, m = run_update(batch, name, kind, slice(rank * n, (rank + 1) * n), shard=True)
            torch.save({"grads": grads, "metrics": m}, out / f"{kind}-{name}-rank{rank}.pt")
    seen = {}
    for kind in KINDS:
        for sharding in ("none", "fsdp2"):
            r = train(run_config(out / f"{kind}-{sharding}", kind, sharding=sharding), progress=False)
            seen[f"{kind}-{sharding}"] = [is_sharded(r.model), type(next(r.model.parameters())).__name__]
        train(run_config(out / f"{kind}-resumed", kind, sharding="fsdp2"), progress=False, stop_after=1)
        torch.distributed.barrier()                          # rank 0 has written checkpoint-1
        train(run_config(out / f"{kind}-resumed", kind, sharding="fsdp2", resume_from="latest"), progress=False)
    train(run_config(out / "lora-best", "lora", sharding="fsdp2", eval_size=2, eval_every=1, save_best=True),
          progress=False)
    (out / f"seen-rank{rank}.json").write_text(json.dumps(seen))


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, smollm2_path):
    "Launch this file on 2 processes once; return its output folder (smollm2_path: the tokenizer is converted before)."
    out = tmp_path_factory.mktemp("fsdp")
    torch.save(make_batch(), out / "batch.pt")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                        str(out)], env=ENV, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    print(f"2-process FSDP run: {time.perf_counter() - t0:.1f} s")
    return out


def test_save_best_on_a_sharded_run(fsdp_run):
    from mmrgrpo.checkpoints import checkpoint_problem
    best = fsdp_run / "lora-best" / "best-checkpoint"
    assert checkpoint_problem(best) is None
    state = json.loads((best / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["best"]["step"] == state["step"]


def trained_weights(ck: Path) -> dict:
    from safetensors.torch import load_file
    return (load_file(ck / "adapter" / "adapter_model.safetensors") if (ck / "adapter").exists()
            else load_file(ck / "model" / "model.safetensors"))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", CASES)
def test_sharded_gradient_is_the_single_process_gradient(fsdp_run, kind, name):
    batch = torch.load(fsdp_run / "batch.pt", weights_only=False)
    one, m1 = run_update(batch, name, kind, slice(0, B * G))
    r0, r1 = (torch.load(fsdp_run / f"{kind}-{name}-rank{r}.pt", weights_only=False) for r in (0, 1))
    assert len(one) == len(r0["grads"]) and all(g.abs().sum() > 0 for g in one) and m1["kl"] > 0
    diff = max((a - b).abs().max().item() for a, b in zip(one, r0["grads"]))
    print(f"{kind} {name}: max |grad(1 process) - grad(2 processes, FSDP2)| = {diff:.2e}")
    assert diff < 1e-5          # summed, not averaged: FSDP2's default would halve it
    assert all(torch.equal(a, b) for a, b in zip(r0["grads"], r1["grads"]))
    for k in ("loss", "kl", "clip_ratio", "entropy", "grad_norm"):
        assert r0["metrics"][k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_run_trains_what_data_parallel_trains_and_resumes_exactly(fsdp_run, kind):
    for r in (0, 1):
        seen = json.loads((fsdp_run / f"seen-rank{r}.json").read_text())
        assert seen[f"{kind}-fsdp2"] == [True, "DTensor"] and seen[f"{kind}-none"][0] is False
    ddp, fsdp, resumed = (fsdp_run / f"{kind}-{s}" for s in ("none", "fsdp2", "resumed"))
    w = {p.name: trained_weights(p / "checkpoint-2") for p in (ddp, fsdp, resumed)}
    # the second step moved the weights
    assert max_diff(trained_weights(fsdp / "checkpoint-1"), w[fsdp.name]) > 1e-5
    diff = max_diff(w[ddp.name], w[fsdp.name])
    print(f"{kind}: max |weights(DDP) - weights(FSDP2)| after 2 steps = {diff:.2e}")
    assert diff < 1e-6
    assert max_diff(w[fsdp.name], w[resumed.name]) == 0                                # resumed: the same run, exactly
    opt = {p.name: torch.load(p / "checkpoint-2" / "training.pt", weights_only=True)["optimizer"]
           for p in (fsdp, resumed)}
    a, b = opt[fsdp.name]["state"], opt[resumed.name]["state"]
    assert a.keys() == b.keys() and all(isinstance(k, str) for k in a)                 # whole, by parameter name
    assert all(torch.equal(a[k][s], b[k][s]) for k in a for s in a[k])
    from mmrgrpo.trainer import read_metrics
    rows = {p.name: read_metrics(p / "metrics.jsonl") for p in (ddp, fsdp, resumed)}
    assert [r["step"] for r in rows[resumed.name]] == [1, 2]
    for k in ("reward", "loss", "kl", "grad_norm"):
        assert rows[resumed.name][1][k] == rows[fsdp.name][1][k], k
        assert rows[ddp.name][1][k] == pytest.approx(rows[fsdp.name][1][k], rel=1e-5, abs=1e-7), k


def test_accelerate_launch_with_the_fsdp2_config_trains_the_ddp_adapter(tmp_path, smollm2_path):
    "The shipped accelerate configs, 2 CPU processes each, 2 steps of the tiny model: the same adapter."
    args = [f"{k}={json.dumps(v) if isinstance(v, list) else 'null' if v is None else v}" for k, v in RUN.items()]
    outs = {}
    for name in ("fsdp2", "ddp"):
        outs[name] = tmp_path / name
        r = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                            str(ROOT / "configs" / "accelerate" / f"{name}.yaml"), "-m", "mmrgrpo.cli", "train", *args,
                            f"output_dir={outs[name]}"],
                           env=ENV, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    fsdp, ddp = (torch.load(outs[n] / "checkpoint-2" / "training.pt", weights_only=True)["optimizer"]["state"]
                 for n in ("fsdp2", "ddp"))
    # the fsdp2 launch really sharded
    assert all(isinstance(k, str) for k in fsdp) and all(isinstance(k, int) for k in ddp)
    diff = max_diff(trained_weights(outs["fsdp2"] / "checkpoint-2"), trained_weights(outs["ddp"] / "checkpoint-2"))
    print(f"accelerate fsdp2 vs ddp: max |adapter difference| = {diff:.2e}")
    assert diff < 1e-6


if __name__ == "__main__":
    worker(Path(sys.argv[1]))


@pytest.mark.parametrize("how", ["sharding", "accelerate"])
def test_fsdp2_refuses_an_explicit_sampler_dtype(how, monkeypatch):
    """A merged sampling copy (sampler_dtype=float32/bfloat16/float16) needs the whole weights: under FSDP2 it is
    refused at config time."""
    from mmrgrpo.config import ConfigError, check_config, load_config
    kw = dict(model="tiny-random", sampler_dtype="float32", **({"sharding": "fsdp2"} if how == "sharding" else {}))
    if how == "accelerate": monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    # one process: sharding changes nothing, so nothing to refuse
    c = load_config(**kw)
    with pytest.raises(ConfigError,
                       match=r"^sampler_dtype=float32 with FSDP2 sharding: .* use sampler_dtype=auto or policy$"):
        check_config(c, world_size=2)
    for ok in ("auto", "policy"): check_config(load_config(**{**kw, "sampler_dtype": ok}), world_size=2)
