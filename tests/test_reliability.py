"""What happens when things go wrong, proven on the tiny random model: crashes and resume, determinism, bad
configuration, bad data, hostile completions, bad reward functions, NaN/inf updates, memory, and a full disk.
nbs/50_reliability.ipynb tabulates them.

The runs use `reward_fixtures:varied` (tests/reward_fixtures.py) as their reward: on a random model the built-in rewards
are all 0, so every advantage, gradient and update would be zero and "the weights did not change" or "the metrics match"
would prove nothing."""
import dataclasses, errno, json, math, os, random, re, signal, subprocess, sys, time
from pathlib import Path

import pytest
import torch

import mmrgrpo.trainer as T
from mmrgrpo.config import ConfigError, GRPOConfig, load_config
from mmrgrpo.data import DataError
from mmrgrpo.rewards import RewardFunctionError
from mmrgrpo.sampling import HFBackend
from mmrgrpo.trainer import latest_checkpoint, load_checkpoint, read_metrics, train  # the trainer's own imports

TESTS = Path(__file__).resolve().parent
# reward_fixtures:<name> must import here and in children
if str(TESTS) not in sys.path: sys.path.insert(0, str(TESTS))

# fp32 throughout: these tests compare runs bit for bit, and on a CPU with AMX the fused bf16 decoder ("auto" there) has
# given one of two results in separate processes (BENCHMARKS_HISTORY.md, section 0a)
BASE = dict(model="tiny-random", num_generations=4, prompts_per_step=2, max_completion_length=8, eval_size=0,
            log_completions_every=0, save_every=1, learning_rate=1e-3, reward_funcs=["reward_fixtures:varied"],
            reward_weights=None, autocast_bf16=False, sampler_dtype="float32")


def cfg(out, **kw) -> GRPOConfig:
    return load_config(**{**BASE, "output_dir": str(out), **kw})


def step_rows(out) -> list:
    "The per-step rows of a run's metrics.jsonl, without measurement keys (time/*, memory/*, eval/time)."
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/")) and k != "eval/time"}
            for r in read_metrics(Path(out) / "metrics.jsonl") if "loss" in r]


def child_env(**extra) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), **extra}


def one_line(e) -> str:
    msg = str(e.value if hasattr(e, "value") else e)
    assert "\n" not in msg, f"the error is not one line: {msg!r}"
    return msg


def trainable(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def fresh_policy(c):
    "A fresh policy, optimizer and scheduler to load a checkpoint into."
    model, _ = T.load_policy(c)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=c.learning_rate)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- 1 and 2: crashes, resume and determinism

STEPS = 8

# A training process that SIGKILLs itself in the middle of writing checkpoint-$KILL_IN_CHECKPOINT: after the weights,
# the optimizer state and the config are in the temp folder, before trainer_state.json (what makes a checkpoint
# complete).
CHILD = """
import json, os, signal, sys
from pathlib import Path
import mmrgrpo.trainer as T, mmrgrpo.checkpoints as K
from mmrgrpo.config import load_config
kill_in = os.environ.get("KILL_IN_CHECKPOINT")
if kill_in:
    real = K.save_config
    def save_config(c, path):
        real(c, path)
        if Path(path).parent.name.startswith(f".tmp-checkpoint-{kill_in}-"): os.kill(os.getpid(), signal.SIGKILL)
    K.save_config = save_config
T.train(load_config(**json.loads(sys.argv[1])), progress=False)
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    "The step rows of an uninterrupted run of STEPS steps."
    out = tmp_path_factory.mktemp("reference")
    train(cfg(out, steps=STEPS), progress=False)
    rows = step_rows(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert len({r["loss"] for r in rows}) > 1 and max(r["kl"] for r in rows) > 0, "the run must actually train"
    return rows


def test_sigkill_at_any_moment_then_resume_continues_exactly(tmp_path, reference):
    out = tmp_path / "run"
    kw = {**BASE, "output_dir": str(out), "steps": STEPS}
    # 1. killed while writing checkpoint-3: the half-written folder is there, and it is not taken for a checkpoint
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kw)], env=child_env(KILL_IN_CHECKPOINT="3"),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    half = list(out.glob(".tmp-checkpoint-3-*"))
    assert len(half) == 1 and (half[0] / "training.pt").exists() and not (half[0] / "trainer_state.json").exists()
    assert latest_checkpoint(out).name == "checkpoint-2"
    # 2. `mmrgrpo train ... resume_from=latest` continues from checkpoint-2 and is killed at a random moment within the
    #    two steps after checkpoint-4 (timed by the gap between checkpoints 3 and 4, so a fast machine does not finish
    #    first)
    cli = [sys.executable, "-c", "import sys; from mmrgrpo.cli import main; sys.exit(main())", "train",
           *[f"{k}={json.dumps(v)}" for k, v in {**kw, "resume_from": "latest"}.items()]]
    log = tmp_path / "cli.log"
    with open(log, "w") as f: proc = subprocess.Popen(cli, env=child_env(), stdout=f, stderr=subprocess.STDOUT)
    seen, deadline = {}, time.monotonic() + 300
    while 4 not in seen and proc.poll() is None and time.monotonic() < deadline:
        for k in (3, 4):
            if k not in seen and (out / f"checkpoint-{k}" / "trainer_state.json").exists(): seen[k] = time.monotonic()
        time.sleep(0.01)
    assert seen.keys() == {3, 4}, log.read_text(errors="replace")[-3000:]
    delay = random.uniform(0.0, 2 * (seen[4] - seen[3]))
    time.sleep(delay)
    proc.kill()
    proc.wait(timeout=60)
    err = log.read_text(errors="replace")
    assert proc.returncode == -signal.SIGKILL, (f"the CLI run ended by itself before the kill ({delay=:.2f} s): "
                                                f"{err[-3000:]}")
    assert "Resuming from" in err and "checkpoint-2" in err, err[-3000:]
    assert not half[0].exists(), "the next run removes the half-written folder"
    # a crash may also cut the last metrics line short; resuming drops it with the other lines after the checkpoint
    with open(out / "metrics.jsonl", "a") as f: f.write('{"step": 99, "loss": 0.12')
    # 3. resume in-process to the end: the metrics are those of the uninterrupted run, exactly
    resumed_from = latest_checkpoint(out).name
    train(cfg(out, steps=STEPS, resume_from="latest"), progress=False)
    rows = step_rows(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for got, want in zip(rows, reference):
        assert got == want, (f"step {want['step']} differs after a kill at +{delay:.2f} s and a resume from "
                             f"{resumed_from}: "
                             f"{ {k: (got.get(k), want.get(k)) for k in want if got.get(k) != want.get(k)} }")


def test_same_seed_same_metrics(tmp_path):
    a, b, other = (step_rows(train(cfg(tmp_path / name, steps=3, seed=seed), progress=False).output_dir)
                   for name, seed in [("a", 7), ("b", 7), ("c", 8)])
    assert len(a) == 3 and a == b
    assert [r["loss"] for r in a] != [r["loss"] for r in other], "a different seed must give a different run"


# --- 3: bad configuration is a one-line error naming the field and the fix, before any model loads

def write_gguf(path, arch):
    import gguf, numpy as np
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return str(path)


BAD_CONFIGS = {   # change -> (what the message must name, what it must say to do)
    "G < 2": (dict(num_generations=1), "num_generations=1", "use at least 2"),
    "micro-batch": (dict(micro_batch_size=3), "micro_batch_size=3", "pick a divisor of 8"),
    "prune_rate 1": (dict(prune_rate=1.0), "prune_rate=1.0", "must be in [0, 1)"),
    "keep_ratio 0": (dict(keep_ratio=0.0), "keep_ratio=0.0", "must be in (0, 1]"),
    "keep_ratio > 1": (dict(keep_ratio=1.5), "keep_ratio=1.5", "must be in (0, 1]"),
    "wrong type": (dict(steps="3"), "steps='3'", "must be an integer"),
    "wrong type, list": (dict(reward_funcs="accuracy"), "reward_funcs='accuracy'", "must be a list"),
    "missing folder": (dict(model="/no/such/model"), "model='/no/such/model'", "for a hub model use its id"),
    "missing .gguf": (dict(model="./missing.gguf"), "model='./missing.gguf'", "check the path"),
    "missing gguf folder": (dict(model="/no/such/dir", gguf_file="m.gguf"), "model='/no/such/dir'", "no such folder"),
    "model name slip": (dict(model="smolm2"), "model='smolm2'", "did you mean 'smollm2'?"),
    "eps_low >= 1": (dict(eps_low=1.5), "eps_low=1.5", "must be below 1"),
    "vLLM LoRA rank": (dict(generation_backend="vllm", lora_r=1024), "lora_r=1024 with generation_backend=vllm",
                       "use lora_r <= 512, or generation_backend=hf"),
    "unsupported GGUF": ("rwkv7", "architecture 'rwkv7'", "use a GGUF file of one of llama"),
    "unreadable GGUF": (b"GGUF but not really", "is not a readable GGUF file", "download it again"),
    # values that invert training or fail later with a raw error (issue 14, item 12)
    "warmup_steps < 0": (dict(warmup_steps=-3), "warmup_steps=-3", "must be >= 0 (0: no warm-up)"),
    "warmup_steps = -1": (dict(warmup_steps=-1), "warmup_steps=-1", "must be >= 0 (0: no warm-up)"),
    "max_grad_norm < 0": (dict(max_grad_norm=-1.0), "max_grad_norm=-1.0", "must be >= 0 (0 disables clipping)"),
    "threads < 0": (dict(threads=-2), "threads=-2", "use 0 (torch's default) or a positive number"),
    "lora_r 0": (dict(lora_r=0), "lora_r=0", "must be at least 1"),
    "weight_decay < 0": (dict(weight_decay=-0.1), "weight_decay=-0.1", "must be >= 0"),
    "num_shots too many": (dict(num_shots=3), "num_shots=3", "use 0 to 2"),
    "num_shots < 0": (dict(num_shots=-1), "num_shots=-1", "use 0 to 2"),
    "num_shots, eval_task": (dict(num_shots=3, eval_task="gsm8k"), "num_shots=3", "use 0 to 2"),
    "reward_timeout 0": (dict(reward_timeout=0.0), "reward_timeout=0.0", "must be > 0 seconds"),
    "eval_size < 0": (dict(eval_size=-1), "eval_size=-1", "must be >= 0"),
    # the other numeric fields
    "lora_alpha 0": (dict(lora_alpha=0), "lora_alpha=0", "must be > 0"),
    "lora_dropout 1": (dict(lora_dropout=1.0), "lora_dropout=1.0", "must be in [0, 1)"),
    "lora_dropout < 0": (dict(lora_dropout=-0.1), "lora_dropout=-0.1", "must be in [0, 1)"),
    "eval_every < 0": (dict(eval_every=-1), "eval_every=-1", "must be >= 0"),
    "save_every < 0": (dict(save_every=-5), "save_every=-5", "must be >= 0"),
    "save_best without evaluations": (dict(save_best=True, eval_every=0), "save_best=true with eval_every=0",
                                      "set both above 0"),
    "log_completions_every < 0": (dict(log_completions_every=-1), "log_completions_every=-1", "must be >= 0"),
    "eval_samples < 0": (dict(eval_samples=-4), "eval_samples=-4", "must be >= 0"),
    "vLLM memory 0": (dict(vllm_gpu_memory_utilization=0.0), "vllm_gpu_memory_utilization=0.0", "must be in (0, 1]"),
    "vLLM memory > 1": (dict(vllm_gpu_memory_utilization=1.5), "vllm_gpu_memory_utilization=1.5", "must be in (0, 1]"),
    "seed < 0": (dict(seed=-1), "seed=-1", "use 0 to 2147483647"),
    "learning_rate inf": (dict(learning_rate=math.inf), "learning_rate=inf", "must be a finite number"),
    "max_grad_norm nan": (dict(max_grad_norm=math.nan), "max_grad_norm=nan", "must be a finite number"),
    "reward weight not a number": (dict(reward_weights=["1"]), "reward_weights=['1']",
                                   "each weight must be a finite number"),
    # a reward function that cannot be imported (item 3); more cases in
    # test_reward_functions_are_imported_with_the_config
    "reward function missing": (dict(reward_funcs=["reward_fixtures:no_such"]), "'reward_fixtures:no_such'",
                                "module 'reward_fixtures' has no attribute 'no_such'"),
    # the current folder by accident (item 14)
    "output_dir ''": (dict(output_dir=""), "output_dir=''", "name a folder, e.g. runs/latest"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_fails_before_the_model_loads(case, tmp_path, no_model, monkeypatch):
    monkeypatch.chdir(tmp_path)                               # output_dir='' must not write into the repository either
    change, names, fix = BAD_CONFIGS[case]
    if isinstance(change, str): change = dict(model=write_gguf(tmp_path / "m.gguf", change))
    if isinstance(change, bytes):
        (tmp_path / "m.gguf").write_bytes(change); change = dict(model=str(tmp_path / "m.gguf"))
    c = dataclasses.replace(cfg(tmp_path), **change)          # built in code: no load_config checks on the way
    with pytest.raises(ConfigError) as e: train(c, progress=False)
    msg = one_line(e)
    assert names in msg and fix in msg, msg


def test_unknown_key_and_wrong_type_from_yaml_and_cli(tmp_path, no_model, capsys):
    from mmrgrpo.cli import main
    with pytest.raises(ConfigError) as e: load_config(num_generation=4)
    assert "unknown key(s) 'num_generation' (did you mean 'num_generations'?)" in one_line(e)
    (tmp_path / "c.yaml").write_text("model: tiny-random\nlearning_rat: 0.001\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml")]) == 2
    assert main(["train", "model=tiny-random", "steps=ten"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: ") and "'learning_rat' (did you mean 'learning_rate'?)" in err[0]
    assert err[1] == "error: steps='ten' must be an integer" and len(err) == 2


def test_eval_size_0_is_refused_by_mmrgrpo_eval(no_model, capsys):
    from mmrgrpo.cli import main
    assert main(["eval", "model=tiny-random", "eval_size=0"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: eval_size=0: mmrgrpo eval needs at least 1 held-out task"]


# --- a config file is code: its reward functions are imported when it is checked, before any model loads

def test_reward_functions_are_imported_with_the_config(tmp_path, monkeypatch, no_model):
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('no GPU found')\n")
    monkeypatch.syspath_prepend(tmp_path)
    cases = {"no_such_module_xyz:score": "importing 'no_such_module_xyz' raised ModuleNotFoundError: No module named "
                                         "'no_such_module_xyz' (install it, or put its folder on PYTHONPATH)",
             "reward_fixtures:no_such": "module 'reward_fixtures' has no attribute 'no_such'",
             "math:pi": "is a float, not a function",
             "broken_rewards:score": "importing 'broken_rewards' raised RuntimeError: no GPU found"}
    for name, says in cases.items():
        with pytest.raises(ConfigError) as e: load_config(reward_funcs=["accuracy", name], reward_weights=None)
        msg = one_line(e)
        assert msg.startswith(f"reward_funcs: ") and repr(name) in msg and says in msg, msg


# --- a model's own code runs only with trust_remote_code=true

def code_model(folder: Path, marker: Path) -> str:
    "A model folder whose config.json maps the auto classes to its own marker.py, which writes `marker` when imported."
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "marker_model", "auto_map": {
        "AutoConfig": "marker.MarkerConfig", "AutoModel": "marker.MarkerModel",
        "AutoModelForCausalLM": "marker.MarkerModel"}}))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["marker.MarkerTokenizer", None]}}))
    (folder / "marker.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n")
    return str(folder)


TRUSTED = """
import json, sys
import mmrgrpo.trainer as T
from mmrgrpo.config import load_config
try: T.train(load_config(**json.loads(sys.argv[1])), progress=False)
except Exception as e: print(type(e).__name__)
"""


@pytest.mark.parametrize("field", ["model", "embedding_model"])
def test_model_code_runs_only_with_trust_remote_code(field, tmp_path):
    from mmrgrpo.models import load_tokenizer
    from mmrgrpo.vllm_backend import engine_kwargs
    marker = tmp_path / "IMPORTED"
    folder = code_model(tmp_path / "m", marker)
    kw = {**BASE, "output_dir": str(tmp_path / "run"), **({"model": folder} if field == "model" else
                                                         {"mmr": True, "embedding_model": folder})}
    with pytest.raises(ConfigError) as e: train(load_config(**kw), progress=False)
    assert f"{field}={folder!r} ships its own Python code" in one_line(e) and "trust_remote_code=true" in one_line(e)
    with pytest.raises(ConfigError, match="trust_remote_code=true"): load_tokenizer(folder)
    assert not marker.exists()
    assert engine_kwargs(load_config(), "m", lora=False)["trust_remote_code"] is False
    assert engine_kwargs(load_config(trust_remote_code=True), "m", lora=False)["trust_remote_code"] is True
    # the same folder with trust_remote_code=true: its code runs (in a child: transformers caches the module in
    # HF_MODULES_CACHE)
    p = subprocess.run([sys.executable, "-c", TRUSTED, json.dumps({**kw, "trust_remote_code": True})],
                       capture_output=True, text=True, timeout=600,
                       env=child_env(HF_MODULES_CACHE=str(tmp_path / "modules")))
    assert marker.read_text() == "imported", p.stdout[-2000:] + p.stderr[-3000:]


def test_a_model_folder_without_weights_is_one_line(tmp_path):
    """A folder with a config and a tokenizer but no weights file: a ConfigError, not transformers' OSError from deep
    inside."""
    from mmrgrpo.models import load_policy, load_tokenizer, resolve_model, tiny_random_model
    tok = load_tokenizer(resolve_model("smollm2"))
    folder = tmp_path / "no_weights"
    tiny_random_model(tok).config.save_pretrained(folder); tok.save_pretrained(folder)
    with pytest.raises(ConfigError) as e: load_policy(load_config(**{**BASE, "model": str(folder)}))
    assert f"model={str(folder)!r}: the folder has a config.json but no weights" in one_line(e)


# --- 4: bad data at train time names the file and row, before the model loads; skip_bad_rows skips and counts

GOOD = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]]
line = lambda r: json.dumps(r).encode() + b"\n"
LONG = {"question": "Explain " + "this " * 800, "answer": "1"}          # ~800 tokens > max_prompt_length=512

BAD_DATA = {   # file bytes -> (row, what is wrong)
    "empty file": (b"", "the file is empty (row 1)"),
    "missing field": (line(GOOD[0]) + line(GOOD[1]) + line({"q": "What is 1 + 1?", "answer": "2"}),
                      "row 3: no field 'question'"),
    "unparseable gold": (line(GOOD[0]) + line({"question": "What is half of it?", "answer": "?!"}),
                         "row 2: gold answer '?!' cannot be parsed"),
    "invalid UTF-8": (line(GOOD[0]) * 3 + b'{"question": "caf\xe9 + 1?", "answer": "2"}\n', "row 4: invalid UTF-8"),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_fails_before_the_model_loads(case, tmp_path, no_model):
    data, where = BAD_DATA[case]
    path = tmp_path / "tasks.jsonl"; path.write_bytes(data)
    with pytest.raises(DataError) as e: train(cfg(tmp_path, task=str(path)), progress=False)
    assert f"{path}: {where}" in one_line(e) or f"{path} {where}" in one_line(e), one_line(e)


@pytest.mark.parametrize("which", ["task", "eval_task"])
def test_too_long_prompt_fails_before_the_first_step(which, tmp_path, tokenizer, tiny_model, monkeypatch):
    def sampled(*a, **k): raise AssertionError("a step started before the error")
    monkeypatch.setattr(HFBackend, "generate", sampled)
    good, bad = tmp_path / "good.jsonl", tmp_path / "long.jsonl"
    good.write_bytes(b"".join(map(line, GOOD)))
    bad.write_bytes(b"".join(map(line, GOOD[:2] + [LONG] + GOOD[2:])))
    kw = dict(task=str(bad)) if which == "task" else dict(task=str(good), eval_task=str(bad), eval_size=5)
    with pytest.raises(DataError) as e:
        train(cfg(tmp_path, **kw), model=tiny_model, tokenizer=tokenizer, progress=False)
    assert re.search(rf"{re.escape(str(bad))} row 3: the prompt has \d+ tokens, more than max_prompt_length=512",
                     one_line(e))
    assert "skip_bad_rows=True" in one_line(e)


def test_skip_bad_rows_trains_on_the_rest_and_counts(tmp_path, monkeypatch):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"".join([line(GOOD[0]), line({"q": "x", "answer": "1"}), line(GOOD[1]), line(LONG),
                               line({"question": "What?", "answer": "?!"}), line(GOOD[2]), b'{"question": "\xff"}\n',
                               line(GOOD[3])]))
    drawn, real = [], T.tasks_for_step
    def spy(*a, **k):
        records = real(*a, **k); drawn.extend(records); return records
    monkeypatch.setattr(T, "tasks_for_step", spy)
    train(cfg(tmp_path, task=str(path), skip_bad_rows=True, steps=2), progress=False)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[0] == {"step": 0, "data/skipped_rows": 4.0, "data/eval_skipped_rows": 0.0}
    assert [r["step"] for r in rows[1:]] == [1, 2]
    assert sorted(t["question"] for t in drawn) == sorted(t["question"] for t in GOOD)   # one epoch: the good rows only


# --- 5: hostile completions score 0 within the time limit, and the run goes on

HOSTILE = {
    "empty": "",
    "no end, no answer": "Let me think about this step by step and then some more " * 30,
    "10,000 nested braces": "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
    "power tower": "\\boxed{9^{9^{9^{9}}}}",
    "5000 digits": "\\boxed{" + "7" * 5000 + "}",
    "random unicode": "".join(chr(random.Random(0).randrange(0x20, 0x2FFFF)) for _ in range(300)) + "\\boxed{\ud800}",
}


def test_hostile_completions_score_zero_and_the_run_goes_on(tmp_path, monkeypatch):
    real_generate, real_score, rewards = HFBackend.generate, T.score, []
    def hostile(self, prompts, G, *a, **k):
        # the ids come from the model (8 tokens, no EOS: truncated)
        ro = real_generate(self, prompts, G, *a, **k)
        x, y = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", prompts[-1])[-1])
        # two right answers, as a control
        ro.completions = list(HOSTILE.values()) + [f"So the answer is \\boxed{{{x + y}}}."] * 2
        return ro
    def spy(ro, *a, **k):
        r, m = real_score(ro, *a, **k); rewards.append(r.tolist()); return r, m
    monkeypatch.setattr(HFBackend, "generate", hostile)
    monkeypatch.setattr(T, "score", spy)
    c = cfg(tmp_path, steps=2, reward_funcs=["accuracy"], task="arithmetic:1")
    train(c, progress=False)
    rows = step_rows(tmp_path)
    assert rewards == [[0.0] * len(HOSTILE) + [1.0, 1.0]] * 2
    assert [r["step"] for r in rows] == [1, 2] and all(r["nonfinite_updates"] == 0 for r in rows)
    assert all(r["rewards/timeouts"] >= 2 for r in rows), rows          # at least the tower and the braces, every step
    times = [r["time/reward"] for r in read_metrics(tmp_path / "metrics.jsonl") if "time/reward" in r]
    assert max(times) < len(HOSTILE) * c.reward_timeout + 20, times


# --- 6: user reward functions that raise, return the wrong length, or return NaN

@pytest.mark.parametrize("func, message", [
    ("raises", "reward function 'raises' raised RuntimeError: cannot score completion 2 of 8"),
    ("wrong_length", "reward function 'wrong_length' returned 7 scores for 8 completions: "
                     "return a list with one float"),
    ("nan_at_2", "reward function 'nan_at_2' returned nan at index 2: a reward must be a finite number"),
])
def test_bad_reward_function_stops_the_run(func, message, tmp_path):
    c = cfg(tmp_path, steps=2, reward_funcs=["reward_fixtures:varied", f"reward_fixtures:{func}"],
            on_reward_error="raise")
    with pytest.raises(RewardFunctionError) as e: train(c, progress=False)
    assert message in one_line(e)
    assert latest_checkpoint(tmp_path) is None and step_rows(tmp_path) == []       # stopped in step 1


def test_bad_reward_functions_score_zero_and_are_counted(tmp_path):
    fixtures = ["raises", "wrong_length", "nan_at_2"]
    c = cfg(tmp_path, steps=2, reward_funcs=["reward_fixtures:varied", *(f"reward_fixtures:{f}" for f in fixtures)],
            on_reward_error="zero")
    train(c, progress=False)
    rows = step_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert (r["rewards/raises_errors"], r["rewards/wrong_length_errors"], r["rewards/nan_at_2_errors"]) == (8, 8, 1)
        assert (r["rewards/raises"], r["rewards/wrong_length"], r["rewards/nan_at_2"]) == (0.0, 0.0, 7 / 8)
        assert math.isclose(r["reward"], r["rewards/varied"] + 7 / 8, rel_tol=1e-6)


# --- 7: NaN/inf loss or gradient: the update is skipped and counted; too many in a row stop the run

def test_nonfinite_updates_are_skipped_counted_and_stop_the_run(tmp_path, monkeypatch):
    faults = {2: "nan loss", 5: "inf gradient", 6: "nan loss"}     # steps (1-based); 5 and 6 are two in a row
    state, snaps = {"step": 0}, {}
    import mmrgrpo.step as S
    real_agg, real_update = S.aggregate_loss, T.update
    def agg(*a, **k):
        loss = real_agg(*a, **k)
        fault = faults.get(state["step"])
        if fault == "nan loss": return loss * math.nan
        if fault == "inf gradient":                              # the value stays finite; d sqrt(x)/dx at 0 is inf
            d = loss - loss.detach()
            return loss + (d * d).sqrt()
        return loss
    def update(model, optimizer, *a, **k):
        state["step"] += 1
        opt_state = lambda: {f"{i}.{k}": v.clone()
                             for i, s in enumerate(optimizer.state.values()) for k, v in s.items()}
        before = (trainable(model), opt_state())
        m = real_update(model, optimizer, *a, **k)
        snaps[state["step"]] = (before, (trainable(model), opt_state()))
        return m
    monkeypatch.setattr(S, "aggregate_loss", agg)
    monkeypatch.setattr(T, "update", update)
    c = cfg(tmp_path, steps=STEPS, max_nonfinite_steps=2)
    with pytest.raises(FloatingPointError) as e: train(c, progress=False)
    msg = one_line(e)
    assert "2 updates in a row had a NaN/inf loss or gradient and were skipped (step 6)" in msg
    assert f"the last good checkpoint is {tmp_path / 'checkpoint-4'}" in msg and "Lower learning_rate" in msg
    assert [r["nonfinite_updates"] for r in step_rows(tmp_path)] == [0, 1, 0, 0, 1, 1]
    # a skipped update changes nothing; any other moves AdamW's state
    for step, ((w0, o0), (w1, o1)) in snaps.items():
        assert same_tensors(o0, o1) == (step in faults) and (step not in faults or same_tensors(w0, w1)), step
    assert not same_tensors(snaps[1][0][0], snaps[4][1][0]), "the good updates must change the weights"
    assert sorted(p.name for p in tmp_path.glob("*checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    model, opt, sched = fresh_policy(c)
    assert load_checkpoint(tmp_path / "checkpoint-4", model, opt, sched)["step"] == 4
    assert same_tensors(trainable(model), snaps[4][1][0])


# --- 8: log-probs and entropies in chunks: peak memory does not grow with vocabulary x length x batch

MEMORY = """
import json, resource, sys, torch
from mmrgrpo.logprobs import completion_stats
from mmrgrpo.models import load_tokenizer, resolve_model, tiny_random_model
N, P, T, CHUNK = 8, 16, 512, 256
tok = load_tokenizer(resolve_model("smollm2"))
model = tiny_random_model(tok)
V = model.config.vocab_size
g = torch.Generator().manual_seed(0)
p_ids, c_ids = torch.randint(0, V, (N, P), generator=g), torch.randint(0, V, (N, T), generator=g)
p_mask, c_mask = torch.ones_like(p_ids), torch.ones_like(c_ids)
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10      # MiB (Linux reports KiB)
def chunked(n, t):
    logp, ent, _ = completion_stats(model, p_ids[:n], p_mask[:n], c_ids[:n, :t], c_mask[:n, :t], chunk_size=CHUNK)
    (logp.sum() + ent.sum()).backward()
chunked(1, 4); model.zero_grad()                    # warm up kernels and the allocator
base = peak()
chunked(N, T); model.zero_grad()
after_chunked = peak()
logits = model(input_ids=torch.cat([p_ids, c_ids], 1)).logits[:, P - 1:-1]     # the naive way: (N, T, V) at once
logits.log_softmax(-1).gather(-1, c_ids[..., None]).sum().backward()
print(json.dumps(dict(vocab=V, full_logits=N * T * V * 4 / 2**20, chunked=after_chunked - base,
                      naive=peak() - after_chunked)))
"""


def test_chunked_logprobs_bound_peak_memory():
    p = subprocess.run([sys.executable, "-c", MEMORY], env=child_env(OMP_NUM_THREADS="2"), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"\nfull fp32 logits {m['full_logits']:.0f} MiB; "
          f"peak growth chunked {m['chunked']:.0f} MiB, naive {m['naive']:.0f} MiB")
    assert m["vocab"] == 49152 and round(m["full_logits"]) == 768            # 8 x 512 x 49152 x 4 bytes
    assert m["chunked"] < m["full_logits"] / 2, m                            # measured ~290 MiB
    assert m["naive"] > m["full_logits"], m                                  # measured ~2.7 GiB: the bound can fail


# --- 9: a failed checkpoint write keeps the previous checkpoint, says so, and the run goes on

@pytest.mark.parametrize("fail", ["torch.save", "os.rename"])
def test_failed_checkpoint_write_keeps_the_previous_one(fail, tmp_path, monkeypatch, capsys):
    def failing(real, code):
        def f(*a, **k):
            if ".tmp-checkpoint-2-" in str(a[1] if fail == "torch.save" else a[0]):
                raise OSError(code, os.strerror(code))
            return real(*a, **k)
        return f
    if fail == "torch.save": monkeypatch.setattr(torch, "save", failing(torch.save, errno.ENOSPC))
    else: monkeypatch.setattr(os, "rename", failing(os.rename, errno.EIO))
    saved, real_save = {}, T.save_checkpoint
    def spy(out, step, model, *a, **k):
        saved[step] = trainable(model); return real_save(out, step, model, *a, **k)
    monkeypatch.setattr(T, "save_checkpoint", spy)
    c = cfg(tmp_path, steps=3)
    train(c, progress=False)
    err = capsys.readouterr().err
    code = "[Errno 28] No space left on device" if fail == "torch.save" else "[Errno 5] Input/output error"
    assert (f"WARNING: writing checkpoint-2 failed (OSError: {code}); "
            f"the previous checkpoint {tmp_path / 'checkpoint-1'} is intact") in err
    assert [r["step"] for r in step_rows(tmp_path)] == [1, 2, 3]                     # the run went on
    # no temp folder left
    assert sorted(p.name for p in tmp_path.glob("*checkpoint-*")) == ["checkpoint-1", "checkpoint-3"]
    model, opt, sched = fresh_policy(c)
    assert load_checkpoint(tmp_path / "checkpoint-1", model, opt, sched)["step"] == 1
    assert same_tensors(trainable(model), saved[1]) and not same_tensors(saved[1], saved[3])


def test_lora_targets_that_match_no_module_are_refused():
    from mmrgrpo.models import load_policy
    for targets, says in (([], "names no module"), (["qproj", "v_proj"], "no module named 'qproj' in this model")):
        with pytest.raises(ConfigError) as e: load_policy(load_config(model="tiny-random", lora_target_modules=targets))
        assert says in one_line(e) and "its linear layers are down_proj, gate_proj" in one_line(e), one_line(e)


def test_a_metrics_sink_that_is_not_installed_is_refused_with_the_config(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as e: load_config(log_with=["jsonl", "wandb"])
    assert "wandb is not installed: `pip install wandb`" in one_line(e)
