"""Shared pieces of the benchmark scripts: run metadata, JSON results, tables, timing helpers, and the fixed bench
config.

Every script writes bench/results/<name>.json (or <name>_quick.json for --quick) holding `meta` (the exact command line,
git commit and dirty flag, machine, torch version and threads, date, load average before and after) and all raw numbers,
so a result can be traced to the code and machine that produced it.
"""
import datetime, json, os, platform, resource, shlex, statistics, subprocess, sys, tempfile, time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"

# The fixed configuration the step benchmarks share (step_anatomy, overheads, compute_efficiency, trl_compare).
# fp32 throughout (update and sampler), whatever the hardware, so that tables from different machines compare; the
# "best dtype" arms set autocast_bf16=auto sampler_dtype=auto (what a user gets by default) and say so
BENCH_CONFIG = dict(model="smollm2", lora=True, num_generations=8, prompts_per_step=8, max_completion_length=48,
                    task="arithmetic:2", beta=0.04, loss_type="grpo", learning_rate=1e-4, seed=0,
                    eval_size=0, eval_before=False, save_every=0, log_completions_every=0,
                    dtype="float32", autocast_bf16=False, sampler_dtype="float32")
# --quick: the same code paths on the 2-layer random model, in seconds
QUICK_CONFIG = dict(BENCH_CONFIG, model="tiny-random", num_generations=4, prompts_per_step=2, max_completion_length=8)


def git_info() -> dict:
    "Short commit of HEAD and whether tracked files differ from it (bench/results is ignored for the flag)."
    def run(*a):
        try: return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=20).stdout.rstrip()
        except Exception: return ""
    status = [l for l in run("status", "--porcelain", "--untracked-files=no").splitlines() if "bench/results/" not in l]
    return {"commit": run("rev-parse", "--short", "HEAD").strip() or None, "dirty": bool(status),
            "dirty_files": [l[3:] for l in status]}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"): return line.split(":", 1)[1].strip()
    except OSError: pass
    return platform.processor() or "unknown"


def cpu_flags(wanted=("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni")) -> list:
    "The listed CPU flags this machine has (bf16 matmuls are fast only with avx512_bf16 or AMX)."
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in have]
    except OSError: pass
    return []


def auto_precision() -> str:
    """What `dtype`/`autocast_bf16`/`sampler_dtype` 'auto' pick on this machine's CPU (the benchmarks' own config may
    pin them)."""
    from mmrgrpo.models import choose_dtype
    from mmrgrpo.sampler_copy import sampler_dtype
    return f"{choose_dtype('cpu').describe()}; sampler copy {sampler_dtype('auto', 'cpu')}"


def gpu_info() -> dict:
    "The CUDA GPU torch sees first: name, compute capability, memory and CUDA version (empty without one)."
    import torch
    if not torch.cuda.is_available(): return {}
    p = torch.cuda.get_device_properties(0)
    return {"gpu": p.name, "gpu_count": torch.cuda.device_count(), "capability": f"{p.major}.{p.minor}",
            "gpu_mem_gb": round(p.total_memory / 2**30, 1), "cuda_version": torch.version.cuda}


def machine_info() -> dict:
    import torch, transformers
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {**gpu_info(), "nproc": os.cpu_count(), "affinity": affinity,
            "cpu_model": cpu_model(), "cpu_flags": cpu_flags(), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(), "python": platform.python_version(), "hostname": platform.node(),
            "auto_precision": auto_precision(),
            "mem_total_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


def start_meta() -> dict:
    "Metadata taken when a script starts; `finish_meta` adds the end."
    return {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]), "cwd": os.getcwd(),
            "git": git_info(), "machine": machine_info(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "loadavg_start": os.getloadavg(), "_t0": time.time()}


def finish_meta(meta: dict) -> dict:
    m = {k: v for k, v in meta.items() if k != "_t0"}
    m["loadavg_end"] = os.getloadavg()
    m["wall_s"] = round(time.time() - meta["_t0"], 1)
    m["peak_rss_mb"] = peak_rss_mb()
    return m


def result_path(name: str, quick: bool = False) -> Path:
    return RESULTS / f"{name}{'_quick' if quick else ''}.json"


def write_json(path: Path, obj: dict) -> Path:
    "Write `obj` as indented JSON atomically (temp file + rename), so a crash never leaves half a file."
    path = Path(path); path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    with os.fdopen(fd, "w") as f: json.dump(obj, f, indent=1, default=_jsonable); f.write("\n")
    os.replace(tmp, path)
    return path


def _jsonable(x):
    import torch
    if isinstance(x, torch.Tensor): return x.tolist()
    if isinstance(x, Path): return str(x)
    if hasattr(x, "item"): return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def peak_rss_mb(who=resource.RUSAGE_SELF) -> float:
    "Peak resident set size so far, MiB (Linux reports ru_maxrss in KiB)."
    return round(resource.getrusage(who).ru_maxrss / 1024, 1)


def peak_cuda_mb() -> float:
    "Torch's peak allocated CUDA memory in this process so far, MiB (None where CUDA was never used)."
    import torch
    return round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_initialized() else None


def sync(device="cpu"):
    "Wait for `device`'s queued work (CUDA runs asynchronously; a CPU needs nothing)."
    import torch
    if torch.device(device).type == "cuda": torch.cuda.synchronize()


def release_memory():
    """Collect garbage and hand the C allocator's free memory back to the OS (glibc), so a later peak-RSS reading starts
    clean."""
    import ctypes, gc
    gc.collect()
    try: ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError): pass


def median(xs): return statistics.median(xs) if xs else float("nan")


def spread(xs) -> dict:
    "Median, min, max and all values of repeated measurements."
    xs = list(xs)
    return {"median": median(xs), "min": min(xs) if xs else None, "max": max(xs) if xs else None, "n": len(xs),
            "values": xs}


def table(rows: list, headers: list, fmt: dict = None) -> str:
    "A plain fixed-width table; `fmt` maps a header to a format spec for its numbers (default '.3g')."
    fmt = fmt or {}
    def cell(h, v):
        if isinstance(v, float): return format(v, fmt.get(h, ".3g"))
        return "" if v is None else str(v)
    body = [[cell(h, r.get(h) if isinstance(r, dict) else r[i]) for i, h in enumerate(headers)] for r in rows]
    w = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(cells))
    return "\n".join([line(headers), line(["-" * x for x in w]), *map(line, body)])


OP_KINDS = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "aten::baddbmm"),
            "attention backward": ("aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                                   "aten::_scaled_dot_product_efficient_attention_backward",
                                   "aten::_scaled_dot_product_flash_attention_backward"),
            "attention": ("aten::_scaled_dot_product", "aten::scaled_dot_product"),
            "copies and casts": ("aten::copy_", "aten::_to_copy", "aten::cat", "aten::index", "aten::clone",
                                 "aten::contiguous", "aten::_index_put_impl_", "aten::index_select"),
            "optimizer": ("Optimizer.step", "aten::_foreach_", "aten::_fused_adamw")}
OTHER_OPS = "elementwise and other ops"


def op_kinds(prof, wall: float, per: float = 1.0, kinds: tuple = ("matmul", "attention", "copies and casts")) -> dict:
    """Seconds / `per` by kind of op from a finished `torch.profiler.profile`: each op's own CPU time sorted into
    `kinds` (the first whose names an op's name starts with; `OP_KINDS`), the rest as elementwise and other ops, and
    "outside ops": `wall` (the profiled code's wall-clock) minus the ops' time (Python, bookkeeping, the dispatcher
    between ops)."""
    out = dict.fromkeys([*kinds, OTHER_OPS], 0.0)
    for e in prof.key_averages():
        kind = next((k for k in kinds if e.key.startswith(OP_KINDS[k])), OTHER_OPS)
        out[kind] += e.self_cpu_time_total / 1e6 / per
    out["outside ops (Python, bookkeeping)"] = max(wall / per - sum(out.values()), 0.0)
    out["wall (profiled)"] = wall / per
    return out


def interleaved(arms: list, repeats: int):
    "Yield (repeat, arm) round-robin, reversing the arm order on odd repeats so no arm always runs first or last."
    for r in range(repeats):
        for a in (arms if r % 2 == 0 else arms[::-1]): yield r, a


def set_threads(n: int):
    import torch
    if n: torch.set_num_threads(n)


def common_args(ap, quick_help: str = "small settings on the tiny random model: checks the code path in seconds"):
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", default=None, help="result JSON path (default bench/results/<name>[_quick].json)")
    return ap


class BaselineWorker:
    """One arm of a benchmark run by the package as it was at an earlier commit, in a process of its own, side by side
    with the current code: `git archive REF` is unpacked into a temporary folder and
    `python SCRIPT --baseline-worker ...` runs with that folder first on sys.path. The script's worker answers one JSON
    line per `run()` call (a timed round), so rounds stay interleaved with the other arms and only one process computes
    at a time."""
    def __init__(self, ref: str, script: str, args: list):
        self.ref = subprocess.run(["git", "rev-parse", "--short", ref], cwd=REPO, capture_output=True, text=True,
                                  check=True).stdout.strip()
        self.dir = tempfile.mkdtemp(prefix=f"mmrgrpo-{self.ref}-")
        tar = subprocess.run(["git", "archive", self.ref], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", self.dir], input=tar, check=True)
        env = {**os.environ, "PYTHONPATH": self.dir + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, script, "--baseline-worker", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=self.dir)
        ready = self._read()
        if ready.get("package") != self.dir:
            raise RuntimeError(f"the baseline worker imported mmrgrpo from {ready.get('package')}")

    def _read(self) -> dict:
        "The worker's next JSON line (other lines it prints pass through to our stdout)."
        while True:
            line = self.proc.stdout.readline()
            if not line: raise RuntimeError(f"the baseline worker at {self.ref} exited (code {self.proc.wait()})")
            if line.startswith("{"): return json.loads(line)
            print(f"  [{self.ref}] {line.rstrip()}", flush=True)

    def run(self, **kw) -> dict:
        self.proc.stdin.write(json.dumps(kw) + "\n"); self.proc.stdin.flush()
        return self._read()

    def close(self):
        if self.proc.poll() is None: self.proc.stdin.close(); self.proc.wait(timeout=60)
        import shutil; shutil.rmtree(self.dir, ignore_errors=True)


def serve_baseline(handle):
    """The worker side of `BaselineWorker`: say where mmrgrpo was imported from, then answer `handle(request)` per stdin
    line."""
    import mmrgrpo
    print(json.dumps({"package": str(Path(mmrgrpo.__file__).resolve().parents[1])}), flush=True)
    for line in sys.stdin:
        print(json.dumps(handle(json.loads(line)), default=_jsonable), flush=True)


def run_worker(script, spec: dict) -> dict:
    "Run `python SCRIPT --worker SPEC --worker-out OUT` in a fresh process (clean peak memory); return what it wrote."
    with tempfile.TemporaryDirectory() as d:
        spec_path, out = Path(d) / "spec.json", Path(d) / "out.json"
        spec_path.write_text(json.dumps(spec))
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, str(script), "--worker", str(spec_path), "--worker-out", str(out)],
                           capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode != 0 or not out.exists():
            raise RuntimeError(f"{spec.get('arm')} worker failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
        return {**json.loads(out.read_text()), "process_wall_s": wall}


def serve_worker(spec_path, out_path, handlers: dict):
    "The worker side of `run_worker`: call `handlers[arm](**the spec's other keys)`, add peak memory, write JSON."
    spec = json.loads(Path(spec_path).read_text())
    arm = spec.pop("arm")
    r = handlers[arm](**spec)
    r.update(arm=arm, peak_rss_mb=peak_rss_mb(), peak_rss_children_mb=peak_rss_mb(resource.RUSAGE_CHILDREN),
             peak_cuda_mb=peak_cuda_mb() if "torch" in sys.modules else None)
    Path(out_path).write_text(json.dumps(r, default=_jsonable))
