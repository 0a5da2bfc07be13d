"""How OpenMP's wait policy changes 4-bit sampling on a CPU, alone and beside busy neighbours (the Colab tutorial's CPU
preview: SmolLM2 in NF4 through bitsandbytes' CPU layers).

Two arms, each a worker process that loads the model once: OpenMP's default waits (threads spin a while before they
sleep) and `OMP_WAIT_POLICY=PASSIVE` (they sleep at once); the policy is read when OpenMP starts, so each arm has its
own process. Each round times greedy sampling of `--tokens` tokens for 4 arithmetic prompts in both arms: alone,
beside one pure-Python busy loop per core, and beside a process of torch matmuls on all cores (another training job or
a test suite on a shared machine); arms and neighbours interleaved. `tools/colab_sim.sh` and
`tools/lowest_versions.sh` set PASSIVE because of this measurement (BENCHMARKS_HISTORY.md section 10).

    python bench/omp_wait.py --repeats 3   # ~2.5 min on 2 cores
    python bench/omp_wait.py --quick       # 2 tokens, 1 round
"""
import argparse, json, multiprocessing, os, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl

ARMS = {"default": None, "passive": "PASSIVE"}


def serve(tokens: int):
    "The worker: load the 4-bit model, say ready, then answer each stdin line with one timed sampling."
    import torch
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    from mmrgrpo.config import load_config
    from mmrgrpo.models import load_policy
    from mmrgrpo.trainer import build_prompt, make_backend
    c = load_config(bl.REPO / "configs" / "colab_qlora.yaml", model="smollm2", data_dir=str(bl.REPO / "nbs" / "data"))
    t0 = time.perf_counter()
    model, tok = load_policy(c, device="cpu")
    prompts = [build_prompt(tok, c, f"What is {a} + {b}?", c.task) for a, b in [(17, 25), (43, 38), (9, 66), (71, 14)]]
    backend = make_backend(c, model, tok)
    backend.generate(prompts[:1], 1, 1, greedy=True)                     # first call: one-time set-up, not timed
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - t0, "threads": torch.get_num_threads(),
                      "precision": str(getattr(model, "dtype", ""))}), flush=True)
    for line in sys.stdin:
        t0 = time.perf_counter()
        backend.generate(prompts, 1, tokens, greedy=True)
        print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


class Worker:
    "One arm's process (its OMP_WAIT_POLICY set or unset), answering a JSON line per timed sampling."
    def __init__(self, policy, tokens):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if policy: env["OMP_WAIT_POLICY"] = policy
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", str(tokens)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=bl.REPO)
        self.ready = self.read()

    def read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line: raise RuntimeError(f"the worker exited (code {self.proc.wait()})")
            if line.startswith("{"): return json.loads(line)

    def time(self) -> float:
        self.proc.stdin.write("go\n"); self.proc.stdin.flush()
        return self.read()["seconds"]

    def close(self):
        self.proc.stdin.close(); self.proc.wait(timeout=60)


def _spin():
    while True: pass


def _matmuls():
    import torch
    a = torch.randn(512, 512)
    while True: a = torch.tanh(a @ a)


NEIGHBOURS = {"alone": (None, 0), "spinning": (_spin, None), "torch": (_matmuls, 1)}


def timed(worker, neighbour: str) -> float:
    """One timed sampling beside `neighbour`: nothing, one pure-Python spinning process per core, or one process of
    torch matmuls on all cores (another training job, a test suite)."""
    target, count = NEIGHBOURS[neighbour]
    hogs = [multiprocessing.Process(target=target, daemon=True) for _ in range(count or os.cpu_count() or 1)] \
        if target else []
    for h in hogs: h.start()
    try:
        if hogs: time.sleep(2)                               # the neighbours are running (torch's imported)
        return worker.time()
    finally:
        for h in hogs: h.terminate(); h.join()


def main(argv=None):
    ap = bl.common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), "2 tokens, 1 round")
    ap.add_argument("--tokens", type=int, default=8, help="tokens sampled per timing (4 prompts)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds (each times every arm alone and beside neighbours)")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve is not None: return serve(args.serve)
    tokens, repeats = (2, 1) if args.quick else (args.tokens, args.repeats)
    conds = list(NEIGHBOURS)
    meta = bl.start_meta()
    workers = {arm: Worker(policy, tokens) for arm, policy in ARMS.items()}
    times = {(arm, cond): [] for arm in ARMS for cond in conds}
    for r, arm in bl.interleaved(list(ARMS), repeats):
        for cond in conds if r % 2 == 0 else conds[::-1]:
            s = timed(workers[arm], cond)
            times[arm, cond].append(s)
            print(f"round {r}: {arm:8s} {cond:8s} {s:8.2f} s", flush=True)
    for w in workers.values(): w.close()
    rows = [[arm, cond, bl.median(v), len(v)] for (arm, cond), v in times.items()]
    col = f"median s ({tokens} tokens, 4 prompts)"
    print(bl.table(rows, ["OpenMP waits", "neighbour", col, "n"], {col: ".2f"}))
    ratio = {cond: bl.median(times["default", cond]) / bl.median(times["passive", cond]) for cond in conds}
    print("default / passive: " + ", ".join(f"{c} {r:.2f}x" for c, r in ratio.items()))
    out = bl.write_json(Path(args.out) if args.out else bl.result_path("omp_wait", args.quick), {
        "meta": bl.finish_meta(meta), "tokens": tokens, "prompts": 4, "cores": os.cpu_count(),
        "neighbours": {"alone": "none", "spinning": "one pure-Python busy loop per core",
                       "torch": "one process of 512x512 fp32 matmuls on all cores"},
        "workers": {a: w.ready for a, w in workers.items()},
        "seconds": {f"{a}/{c}": v for (a, c), v in times.items()}, "default_over_passive": ratio})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
