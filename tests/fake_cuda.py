"""A stand-in CUDA GPU for CPU CI: inside `stand_in_gpu(capability)`, tensors sent to "cuda" hold host data but report
`cuda:0`, and `torch.cuda` answers as a GPU of that compute capability would, so that every branch of the package
that asks `device.type == "cuda"` or calls `torch.cuda` runs on a CPU-only torch build.

How it works: an `OnGPU` tensor wraps a CPU tensor (a `__torch_dispatch__` wrapper subclass, as torch's own FakeTensor
and tests/elsewhere.py are); its Python `device` says `cuda:0` while its C++ device stays the CPU, so the autograd
engine and the CPU kernels run it (a CPU-only build has no CUDA stream or accelerator for the engine, which a C++
device of "cuda" would need; `register_cuda_guard` gives torch the one thing it asks on `.to("cuda")`, a device guard).
A dispatch mode turns factory calls and moves aimed at "cuda" into `OnGPU` tensors; `.cpu()`, `.to("cpu")` and
`device="cpu"` make plain host copies; an op where a CPU tensor of one dimension or more meets an `OnGPU` one fails, as
on CUDA (index tensors, copies and 0-dim CPU scalars are allowed, as there). `module.to("cuda")` swaps each
parameter's insides, so tied weights stay tied and the parameter objects are kept, as on CUDA. What `torch.cuda`
answers: `is_available`, `device_count`, `current_device`, `get_device_name`/`_capability`/`_properties`,
`is_bf16_supported` (True below 8.0 too: emulation counts, as there), `mem_get_info`, `memory_allocated`/`reserved`
with their `max_*`, `reset_peak_memory_stats`, `empty_cache`, `synchronize` (counted), `manual_seed(_all)`,
`get_rng_state(_all)`/`set_rng_state(_all)` (an index past `device_count` fails as there): random ops on the stand-in
draw from a generator of its own, as CUDA's is apart from the CPU's.

What it cannot emulate, and how that is covered instead:
- Autocast on "cuda": torch's CUDA autocast kernels only cast tensors whose C++ device is CUDA. `torch.autocast("cuda")`
  here sets torch's CUDA autocast state (what `torch.is_autocast_enabled("cuda")` and `get_autocast_dtype` read) and,
  inside it, CPU autocast in the same dtype casts the stand-in's tensors: the dtypes flow as on a GPU (float16 on 7.5,
  so the loss scaler and its "cannot unscale FP16 gradients" check run), through CPU autocast's op lists (matmuls,
  linear and attention in 16 bits; a few of its float32-listed ops differ from CUDA's).
- Memory numbers count the bytes of live `OnGPU` storages (reserved: their high-water mark in 2 MiB blocks), not a real
  caching allocator: they show that the package reads and reports them, not what a GPU would hold.
- Kernels, streams and timings are the CPU's: a stand-in run says nothing about GPU speed or numerics. bitsandbytes'
  4-bit CUDA kernels, vLLM and NCCL cannot run (their branches are decided by functions that tests call with the
  stand-in's answers: `choose_dtype`, `process_group_backend`); `pytest -m gpu` (tests/test_gpu.py) runs them on a GPU.
- Under `torch.inference_mode` a stand-in tensor's views cannot take the inference flag: such calls run under
  `no_grad` instead (sentence-transformers encodes in inference mode).
- A CPU-only build is assumed; nothing here touches a CUDA library.
"""
import contextlib, copy, ctypes, threading, types, weakref
from pathlib import Path
import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
BLOCK = 2 << 20                        # the caching allocator's rounding of reserved memory (bytes)
# compute capability -> (what the device calls itself, its memory in GiB)
GPUS = {(7, 5): ("Tesla T4", 15), (8, 0): ("NVIDIA A100-SXM4-40GB", 40), (9, 0): ("NVIDIA H100 80GB HBM3", 80)}
# ops where a host tensor may meet a stand-in one, as on CUDA: copies across, and indexing with host index tensors
CROSSING = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten.index.Tensor,
            torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default,
            torch.ops.aten._index_put_impl_.default, torch.ops.aten.lift_fresh.default}


class GPUState:
    "What the stand-in GPU answers: its name, capability and memory, its generator, and the calls the package made."
    def __init__(self, capability=(8, 0), count: int = 1):
        self.capability, self.count = tuple(capability), count
        self.name, gib = GPUS.get(self.capability, (f"stand-in GPU {capability[0]}.{capability[1]}", 16))
        self.total = gib << 30
        self.allocated = self.peak = self.reserved = self.peak_reserved = 0
        self.storages = {}                 # data pointer -> [bytes, live OnGPU tensors over it]
        self.rng = [torch.Generator().manual_seed(0).get_state() for _ in range(count)]
        self.calls = {}                    # torch.cuda function -> times called

    def called(self, name): self.calls[name] = self.calls.get(name, 0) + 1

    def track(self, t: torch.Tensor):
        "Count the storage under a new stand-in tensor's host tensor `t` while a stand-in tensor holds it."
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if not ptr: return
        entry = self.storages.get(ptr)
        if entry is None:
            entry = self.storages[ptr] = [storage.nbytes(), 0]
            self.allocated += entry[0]
            self.peak = max(self.peak, self.allocated)
            self.reserved = max(self.reserved, -(-self.allocated // BLOCK) * BLOCK)
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        entry[1] += 1
        weakref.finalize(t, self.release, ptr)

    def release(self, ptr):
        entry = self.storages.get(ptr)
        if entry is None: return
        entry[1] -= 1
        if entry[1] == 0: self.allocated -= self.storages.pop(ptr)[0]


_GPU = None                            # the stand-in in use (None: none)
# set while a call that names the CPU runs: torch's C++ code passes the stand-in's own C++ device (the CPU) to the ops
# it calls (e.g. `to(options)` in a backward pass), so an op's `device` argument alone cannot say where a result goes
_HOST = threading.local()
_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


class OnGPU(torch.Tensor):
    "Host data that reports `cuda:0`: a GPU tensor as the package, transformers and peft see it."
    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                   storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                   device=CPU, requires_grad=inner.requires_grad)

    def __init__(self, inner):
        self.inner = inner
        if _GPU is not None: _GPU.track(inner)

    # a traceable wrapper subclass: `module.to("cuda")` then swaps each parameter's insides (`swap_tensors`) and keeps
    # the parameter objects, so tied weights stay tied and an optimizer's references hold, as on CUDA
    def __tensor_flatten__(self): return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride): return OnGPU(inner_tensors["inner"])

    device = property(lambda self: CUDA)
    is_cuda = property(lambda self: True)
    is_cpu = property(lambda self: False)
    def get_device(self): return 0
    def untyped_storage(self): return self.inner.untyped_storage()
    def data_ptr(self): return self.inner.data_ptr()
    def tolist(self): return self.inner.tolist()
    def __repr__(self): return f"OnGPU({self.inner!r})"

    def numpy(self, *a, **k):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host "
                        "memory first.")

    def __reduce_ex__(self, protocol):      # torch.save: as a host tensor (what map_location="cpu" loads)
        return self.inner.__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        new = OnGPU(self.inner.detach().clone()).requires_grad_(self.requires_grad)
        for k, v in self.__dict__.items():
            if k != "inner": setattr(new, k, copy.deepcopy(v, memo))
        memo[id(self)] = new
        return new

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        "A call that names the CPU (`.cpu()`, `.to('cpu')`, `device='cpu'`) makes host tensors; others stay here."
        kwargs = kwargs or {}
        move = func is torch.Tensor.cpu or (func is torch.Tensor.to and _to_host(*args[1:], **kwargs))
        host = move or (kwargs.get("device") is not None and not _is_cuda(kwargs["device"]))
        previous, _HOST.on = getattr(_HOST, "on", False), host
        # under inference mode a view of a stand-in tensor fails ("Cannot set version_counter for inference tensor"):
        # the stand-in runs such calls without gradients instead
        inference = torch.is_inference_mode_enabled()
        try:
            with torch._C.DisableTorchFunctionSubclass(), torch.inference_mode(False) if inference else \
                    contextlib.nullcontext(), torch.no_grad() if inference else contextlib.nullcontext():
                if not move: return func(*args, **kwargs)
                # a copy, as from a GPU (torch's C++ `to` would return this tensor: its C++ device is the CPU)
                to = {k: v for k, v in kwargs.items() if k != "copy"}
                dtype = None if func is torch.Tensor.cpu else torch._C._nn._parse_to(*args[1:], **to)[1]
                return torch.ops.aten._to_copy(args[0], device=CPU, dtype=dtype)
        finally: _HOST.on = previous

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None): return _run(func, args, kwargs or {})


def _to_host(*args, **kwargs) -> bool:
    "Whether `Tensor.to(*args, **kwargs)` names the CPU."
    if args and isinstance(args[0], torch.Tensor): return not isinstance(args[0], OnGPU) and args[0].device == CPU
    device = torch._C._nn._parse_to(*args, **{k: v for k, v in kwargs.items() if k != "copy"})[0]
    return device is not None and device.type == "cpu"


def _is_cuda(d) -> bool: return d is not None and torch.device(d).type == "cuda"


@contextlib.contextmanager
def _gpu_generator(func, kwargs):
    "Random ops on the stand-in draw from its own generator (the CPU's default one, its state swapped in and out)."
    if _GPU is None or kwargs.get("generator") is not None or torch.Tag.nondeterministic_seeded not in func.tags:
        yield; return
    host = torch.get_rng_state()
    torch.set_rng_state(_GPU.rng[0])
    try: yield
    finally: _GPU.rng[0] = torch.get_rng_state(); torch.set_rng_state(host)


def _run(func, args, kwargs):
    "Run `func` on host data; its results are stand-in tensors when it read one (and no call named the CPU) or was "
    "aimed at cuda."
    tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    on_gpu, device = any(isinstance(t, OnGPU) for t in tensors), kwargs.get("device")
    if not on_gpu and not _is_cuda(device): return func(*args, **kwargs)
    if on_gpu and func not in CROSSING:
        host = [t for t in tensors if not isinstance(t, OnGPU) and t.dim() > 0]
        if host:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"cuda:0 and cpu! ({func} met a cpu tensor of shape {tuple(host[0].shape)})")
    unwrap = lambda a: a.inner if isinstance(a, OnGPU) else CPU if isinstance(a, torch.device) and _is_cuda(a) else a
    plain_args, plain_kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    # autocast chose the dtypes above this op already; host tensors must not meet CPU autocast a second time
    with _gpu_generator(func, kwargs), torch._C._ExcludeDispatchKeyGuard(_AUTOCAST):
        out = func(*plain_args, **plain_kwargs)
    if getattr(_HOST, "on", False) and not _is_cuda(device): return out        # .cpu(), .to("cpu"), device="cpu"
    if args and isinstance(out, torch.Tensor) and out is plain_args[0]:
        first = func._schema.arguments[0].alias_info
        if first is not None and first.is_write: return args[0]                  # in place: the same tensor
        if not isinstance(args[0], OnGPU): out = out.clone()       # `to` (inference mode) kept a host tensor: copy it
    return tree_map(lambda o: OnGPU(o) if isinstance(o, torch.Tensor) and not isinstance(o, OnGPU) else o, out)


class _OnGPUMode(TorchDispatchMode):
    "Factory calls and moves aimed at cuda make stand-in tensors; ops on them run on their host data."
    def __torch_dispatch__(self, func, types, args=(), kwargs=None): return _run(func, args, kwargs or {})


_Autocast = torch.amp.autocast_mode.autocast


class _MirroredAutocast(_Autocast):
    "`torch.autocast`, where cuda also turns on CPU autocast in the same dtype, which casts the stand-in's tensors."
    def __enter__(self):
        out = super().__enter__()
        self.mirror = None
        if self.device == "cuda":
            self.mirror = _Autocast("cpu", dtype=self.fast_dtype, enabled=self._enabled)
            self.mirror.__enter__()
        return out

    def __exit__(self, *exc):
        if self.mirror is not None: self.mirror.__exit__(*exc)
        return super().__exit__(*exc)


def _device_index(device=None) -> int:
    if device is None or isinstance(device, int): return device or 0
    return torch.device(device).index or 0


def _cuda_functions(gpu: GPUState) -> dict:
    "What `torch.cuda` answers for the stand-in `gpu`."
    def props(device=None):
        return types.SimpleNamespace(name=gpu.name, major=gpu.capability[0], minor=gpu.capability[1],
                                     total_memory=gpu.total, multi_processor_count=40, is_integrated=False)

    def get_rng_state(device="cuda"):
        i = _device_index(device)
        if i >= gpu.count: raise IndexError("tuple index out of range")       # torch.cuda.default_generators[i]
        return gpu.rng[i].clone()

    def set_rng_state(state, device="cuda"):
        i = _device_index(device)
        if i >= gpu.count: raise IndexError("tuple index out of range")
        gpu.rng[i] = state.clone()

    def manual_seed_all(seed):
        for i in range(gpu.count): gpu.rng[i] = torch.Generator().manual_seed(int(seed)).get_state()

    def reset_peaks(device=None): gpu.peak, gpu.peak_reserved = gpu.allocated, gpu.reserved

    def empty_cache(): gpu.reserved = -(-gpu.allocated // BLOCK) * BLOCK

    def synchronize(device=None): gpu.called("synchronize")

    return dict(is_available=lambda: True, is_initialized=lambda: True, _lazy_init=lambda: None,
                device_count=lambda: gpu.count, current_device=lambda: 0, set_device=lambda device: None,
                get_device_name=lambda device=None: gpu.name, get_device_capability=lambda device=None: gpu.capability,
                get_device_properties=props, is_bf16_supported=lambda including_emulation=True: (
                    gpu.capability[0] >= 8 or including_emulation),
                mem_get_info=lambda device=None: (gpu.total - gpu.reserved, gpu.total),
                memory_allocated=lambda device=None: gpu.allocated, max_memory_allocated=lambda device=None: gpu.peak,
                memory_reserved=lambda device=None: gpu.reserved,
                max_memory_reserved=lambda device=None: gpu.peak_reserved, reset_peak_memory_stats=reset_peaks,
                empty_cache=empty_cache, synchronize=synchronize, manual_seed=lambda seed: set_rng_state(
                    torch.Generator().manual_seed(int(seed)).get_state()), manual_seed_all=manual_seed_all,
                get_rng_state=get_rng_state, set_rng_state=set_rng_state,
                get_rng_state_all=lambda: [gpu.rng[i].clone() for i in range(gpu.count)],
                set_rng_state_all=lambda states: [set_rng_state(s, i) for i, s in enumerate(states)])


_GUARDS = []                           # the device guard registered for CUDA (kept alive for the process)


def register_cuda_guard():
    """Give a CPU-only build a device guard for CUDA: torch's `.to("cuda")` asks one for the current device index.
    Older torch registers a no-op guard itself (`_ensureCUDADeviceGuardSet`); newer torch only a Python one for
    PrivateUse1, which here says it is CUDA's and is moved into CUDA's slot of c10's guard registry."""
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
    registry = ctypes.c_void_p.in_dll(lib, "_ZN3c104impl26device_guard_impl_registryE")
    slots = (ctypes.c_void_p * 21).from_address(ctypes.addressof(registry))     # one per c10::DeviceType
    cuda, private = 1, 20                                                       # DeviceType::CUDA, ::PrivateUse1
    if slots[cuda]: return
    torch._C._ensureCUDADeviceGuardSet()
    if slots[cuda] or not hasattr(torch._C, "_acc"): return

    class CUDAGuard(torch._C._acc.DeviceGuard):
        def type_(self): return torch._C._autograd.DeviceType.CUDA
    kept = slots[private]
    _GUARDS.append(CUDAGuard())
    torch._C._acc.register_python_privateuseone_device_guard(_GUARDS[-1])
    slots[cuda], slots[private] = slots[private], kept


@contextlib.contextmanager
def stand_in_gpu(capability=(8, 0), count: int = 1):
    "Inside: a CUDA GPU of compute `capability` (`count` of them visible) that holds its tensors in host memory."
    global _GPU
    register_cuda_guard()
    for name in ("bitsandbytes", "peft"):            # imported as on a CPU: bitsandbytes' CUDA backend needs CUDA
        with contextlib.suppress(ImportError): __import__(name)
    gpu, saved = GPUState(capability, count), {}
    fake = _cuda_functions(gpu)
    for name, f in fake.items(): saved[name] = getattr(torch.cuda, name)
    lifted = torch._C._only_lift_cpu_tensors()
    previous, _GPU = _GPU, gpu
    try:
        for name, f in fake.items(): setattr(torch.cuda, name, f)
        torch.autocast = torch.amp.autocast = _MirroredAutocast
        torch._C._set_only_lift_cpu_tensors(True)   # torch.tensor(..., device="cuda") builds on the host, then moves
        with _OnGPUMode(): yield gpu
    finally:
        for name, f in saved.items(): setattr(torch.cuda, name, f)
        torch.autocast = torch.amp.autocast = _Autocast
        torch._C._set_only_lift_cpu_tensors(lifted)
        _GPU = previous
