"""Two processes (torchrun, gloo, CPU) against one: the same update, reduced metrics, rank-0 logging, world-size-checked
resume.

The test writes a fixed batch (prompt and completion ids, advantages, model weights) to a folder and launches this very
file under `torchrun --standalone --nproc_per_node=2`; each process runs `update` on its contiguous half of the batch
(whole groups) for every loss type and saves the gradient it would apply. In-process, the test runs `update` on the
whole batch and compares. An optimizer stand-in (`GradCapture`) records the gradient at `step()` and moves no
parameter, so nothing in `update` changes.
"""
import contextlib, io, json, os, subprocess, sys, time
from pathlib import Path
import pytest, torch

CASES = {"grpo": dict(loss_type="grpo"), "dr_grpo": dict(loss_type="dr_grpo"), "dapo": dict(loss_type="dapo"),
         "dapo+gmts": dict(loss_type="dapo", token_selection="gmts", keep_ratio=0.5)}
B, G, P, T, V = 4, 4, 5, 6, 128          # prompts, group size, prompt and completion lengths, vocabulary


class GradCapture:
    "Stands in for the optimizer: keeps the gradient `update` would apply and changes no parameter."
    def __init__(self, params): self.params, self.grads = list(params), None
    def zero_grad(self, set_to_none=True):
        for p in self.params: p.grad = None
    def step(self): self.grads = [p.grad.detach().clone() for p in self.params]


def small_llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def make_batch():
    """A fixed rollout of B groups of G (left-padded prompts, completions ending at an EOS or truncated) with its
    advantages."""
    from mmrgrpo.advantages import group_advantages
    from mmrgrpo.sampling import completion_mask
    g = torch.Generator().manual_seed(0)
    eos = 2
    p_ids = torch.randint(3, V, (B, P), generator=g).repeat_interleave(G, 0)
    p_mask = torch.ones(B * G, P, dtype=torch.long)
    p_mask[:G, :2] = 0; p_mask[2 * G:3 * G, :1] = 0                     # groups 0 and 2 have shorter prompts
    c_ids = torch.randint(3, V, (B * G, T), generator=g)
    stop = torch.randint(0, T + 2, (B * G,), generator=g)                 # >= T: no EOS, truncated
    for i, s in enumerate(stop.tolist()):
        if s < T: c_ids[i, s] = eos; c_ids[i, s + 1:] = 0
    rewards = torch.randint(0, 3, (B * G,), generator=g).float()
    return dict(prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=c_ids,
                completion_mask=completion_mask(c_ids, [eos]), adv=group_advantages(rewards, G),
                policy=small_llama(0).state_dict(), ref=small_llama(1).state_dict())


def rollout_rows(batch, rows):
    from mmrgrpo.sampling import Rollout
    n = rows.stop - rows.start
    return Rollout([f"prompt {i // G}" for i in range(rows.start, rows.stop)], ["completion"] * n,
                   batch["prompt_ids"][rows], batch["prompt_mask"][rows], batch["completion_ids"][rows],
                   batch["completion_mask"][rows], G)


def case_config(name):
    from mmrgrpo.config import load_config
    return load_config(model="tiny-random", lora=False, num_generations=G, prompts_per_step=B, micro_batch_size=G,
                       max_completion_length=T, max_grad_norm=0.0, beta=0.04, autocast_bf16=False,  # exact: fp32
                       **CASES[name])


def run_update(batch, name, rows):
    "The gradient and metrics of one `update` on `rows` of the batch (summed over processes when there are several)."
    from mmrgrpo.step import update
    model, ref = small_llama(0), small_llama(1).requires_grad_(False)
    model.load_state_dict(batch["policy"]); ref.load_state_dict(batch["ref"])
    opt = GradCapture(model.parameters())
    m = update(model, opt, rollout_rows(batch, rows), batch["adv"][rows], case_config(name), ref_model=ref)
    return opt.grads, m


def tiny_run_args(out, **kw):
    args = dict(model="tiny-random", steps=1, num_generations=4, prompts_per_step=2, max_completion_length=6,
                eval_size=0, save_every=1, log_completions_every=0, output_dir=str(out))
    args.update(kw)
    return ["train"] + [f"{k}={v}" for k, v in args.items()]


def worker(out: Path):
    "Body of each torchrun process."
    from mmrgrpo.cli import main
    from mmrgrpo.distributed import init_distributed, reduce_metrics
    rank, world = init_distributed()
    batch = torch.load(out / "batch.pt", weights_only=False)
    n = B * G // world
    for name in CASES:
        grads, m = run_update(batch, name, slice(rank * n, (rank + 1) * n))
        torch.save({"grads": grads, "metrics": m}, out / f"{name}-rank{rank}.pt")
    reduced = reduce_metrics({"reward": float(rank), "time/step": float(rank + 1), "rewards/x_errors": rank + 1,
                              "loss": 7.0})
    err = io.StringIO()
    with contextlib.redirect_stderr(err): code = main(tiny_run_args(out / "bad", prompts_per_step=3))
    (out / f"worker-rank{rank}.json").write_text(json.dumps({"reduced": reduced, "bad_code": code,
                                                             "bad_err": err.getvalue()}))
    from mmrgrpo.config import load_config
    from mmrgrpo.trainer import train
    # a 2-process step; rank 0 logs, checkpoints
    train(load_config(overrides=tiny_run_args(out / "run")[1:]), progress=False)
    torch.distributed.barrier()                                                     # checkpoint-1 is written
    train(load_config(overrides=tiny_run_args(out / "best", steps=2, eval_size=2, eval_every=1, save_best=True)[1:]),
          progress=False)                                # keep_if_best: one decision on both processes, rank 0 writes
    sys.exit(main(tiny_run_args(out / "run", steps=2, resume_from="latest")))      # resumed through the command line


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, smollm2_path):
    "Launch this file on 2 processes once; return its output folder (smollm2_path: the tokenizer is converted before)."
    out = tmp_path_factory.mktemp("dist")
    torch.save(make_batch(), out / "batch.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                        str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    print(f"2-process run: {time.perf_counter() - t0:.1f} s")
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_two_processes_apply_the_single_process_gradient(two_process_run, name):
    batch = torch.load(two_process_run / "batch.pt", weights_only=False)
    one, m1 = run_update(batch, name, slice(0, B * G))
    r0, r1 = (torch.load(two_process_run / f"{name}-rank{r}.pt", weights_only=False) for r in (0, 1))
    assert len(one) == len(r0["grads"]) and all(g.abs().sum() > 0 for g in one) and m1["kl"] > 0
    diff = max((a - b).abs().max().item() for a, b in zip(one, r0["grads"]))
    print(f"{name}: max |grad(1 process) - grad(2 processes)| = {diff:.2e}")
    assert diff < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(r0["grads"], r1["grads"]))      # both processes take the same step
    for k in (("loss", "kl", "clip_ratio", "entropy", "grad_norm")
              + (("tokens/kept_fraction",) if "gmts" in name else ())):
        assert r0["metrics"][k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
        assert r1["metrics"][k] == r0["metrics"][k], k


def test_metrics_reduction_and_real_world_size(two_process_run):
    for r in (0, 1):
        w = json.loads((two_process_run / f"worker-rank{r}.json").read_text())
        assert w["reduced"] == {"reward": 0.5, "time/step": 2.0, "rewards/x_errors": 3, "loss": 7.0}
        assert w["bad_code"] == 2 and "not divisible by the 2 processes" in w["bad_err"]


def test_rank0_logs_and_checkpoints_and_resume_needs_same_world_size(two_process_run):
    from mmrgrpo.config import ConfigError, load_config
    from mmrgrpo.trainer import read_metrics, train
    run = two_process_run / "run"
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]               # one writer (no duplicated lines); step 2 after resuming
    assert json.loads((run / "checkpoint-2" / "trainer_state.json").read_text()) == {"nonfinite_in_a_row": 0,
                                                                                    "world_size": 2, "step": 2}
    assert (run / "reward_curve.png").exists() and not list(run.glob(".tmp-*"))
    c = load_config(overrides=tiny_run_args(run, steps=3, resume_from="latest")[1:])
    with pytest.raises(ConfigError, match=r"written by a run on 2 process\(es\) and this run has 1"):
        train(c, progress=False)


def test_save_best_on_two_processes(two_process_run):
    from mmrgrpo.checkpoints import checkpoint_problem
    best = two_process_run / "best" / "best-checkpoint"
    assert checkpoint_problem(best) is None
    state = json.loads((best / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["best"]["step"] == state["step"]


@pytest.mark.parametrize("cuda,gpus,backend,device", [(True, 2, "cpu:gloo,cuda:nccl", 1), (False, 0, "gloo", None),
                                                      (True, 1, "gloo", 0)])
def test_process_group_backend_per_machine(monkeypatch, capsys, cuda, gpus, backend, device):
    """On GPUs the group has gloo for CPU tensors (numbers, metrics) and nccl for CUDA ones: nccl alone cannot reduce
    CPU tensors. Two processes on one GPU (nccl refuses them): both on cuda:0, gloo for everything, said once."""
    import torch.distributed as dist
    from mmrgrpo.distributed import init_distributed
    asked, devices = [], []
    # what torchrun sets in the second of two processes
    for k, v in dict(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29500").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: asked.append(backend))
    for rank in (0, 1):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        init_distributed()
    assert asked == [backend] * 2 and devices == ([0, device] if cuda else [])
    said = capsys.readouterr().err
    assert said.count("2 processes share 1 GPU(s): gloo sums their CUDA tensors") == (gpus == 1)


@pytest.mark.parametrize("backend,x,device", [
    ("gloo", 3.0, "cpu"), ("cpu:gloo,cuda:nccl", 3.0, "cpu"), ("cpu:gloo,cuda:nccl", torch.ones(2), "cpu"),
    # a group someone else made with nccl alone: reduce on the GPU
    ("nccl", 3.0, "cuda:0"), ("nccl", torch.ones(2), "cuda:0"),
])
def test_reduce_device_per_backend(monkeypatch, backend, x, device):
    from mmrgrpo.distributed import reduce_device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert reduce_device(backend, x) == torch.device(device)


def test_all_reduce_sum_hands_the_group_tensors_on_devices_it_serves(monkeypatch):
    import torch.distributed as dist
    from mmrgrpo import distributed
    seen = []
    def all_reduce(t):
        if t.device.type not in distributed._served(dist.get_backend()):      # what NCCL says to a CPU tensor
            raise RuntimeError(f"No backend type associated with device type {t.device.type}")
        seen.append((t.device.type, t.dtype)); t.mul_(2)                 # two processes holding the same value
    monkeypatch.setattr(distributed, "dist_info", lambda: (0, 2))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    g = torch.tensor([0.25, 1.5])
    assert distributed.all_reduce_sum(3) == 6.0 and torch.equal(distributed.all_reduce_sum(g),
                                                                torch.tensor([0.5, 3.0], dtype=torch.float64))
    # the input is not changed
    assert torch.equal(g, torch.tensor([0.25, 1.5])) and seen == [("cpu", torch.float64)] * 2


def test_python_m_cli_runs_main():
    r = subprocess.run([sys.executable, "-m", "mmrgrpo.cli", "train", "stepz=3"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "did you mean 'steps'" in r.stderr


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
