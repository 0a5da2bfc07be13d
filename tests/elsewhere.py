"""A second device on a CPU: `Elsewhere` tensors hold CPU data but say they live on the `meta` device, and inside
`OneDevice` an op that meets one of them and a plain CPU tensor (of at least one dimension) fails as CUDA fails when a
CPU tensor meets GPU log-probs. Factory functions and `.to()` aimed at that device make `Elsewhere` tensors, so code
that follows the policy's device runs; code that builds a tensor without a device, and uses it with the policy's
outputs, fails here as on a GPU."""
import contextlib
import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

AWAY = torch.device("meta")     # the device `Elsewhere` tensors report (a GPU stand-in: not "cpu", and no CUDA calls)


class Elsewhere(torch.Tensor):
    "A CPU tensor that says it lives on `AWAY`."
    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                   device=AWAY, requires_grad=inner.requires_grad)

    def __init__(self, inner): self.inner = inner
    def __repr__(self): return f"Elsewhere({self.inner!r})"
    def tolist(self): return self.inner.tolist()
    def numpy(self, *a, **k): raise TypeError("can't convert a tensor on another device to numpy: use .cpu() first")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with OneDevice(): return func(*args, **(kwargs or {}))


MOVES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)


def _from_data(make):
    """`torch.tensor`/`torch.as_tensor` that build on the CPU and wrap when asked for `AWAY` (they copy outside the
    dispatcher)."""
    def build(data, *a, device=None, **k):
        if device is None or torch.device(device) != AWAY: return make(data, *a, device=device, **k)
        return Elsewhere(make(data.inner if isinstance(data, Elsewhere) else data, *a, **k))
    return build


class OneDevice(TorchDispatchMode):
    "Run ops on `Elsewhere` tensors on the CPU; fail where a plain CPU tensor meets one, as CUDA does."
    def __enter__(self):
        self.made = torch.tensor, torch.as_tensor
        torch.tensor, torch.as_tensor = map(_from_data, self.made)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.tensor, torch.as_tensor = self.made
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        away = any(isinstance(a, Elsewhere) for a in tensors)
        if not away and kwargs.get("device") != AWAY: return func(*args, **kwargs)
        plain = [a for a in tensors if not isinstance(a, Elsewhere) and a.dim() > 0]
        if plain and away and func not in MOVES:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{AWAY} and cpu! ({func} met a cpu tensor of shape {tuple(plain[0].shape)})")
        unwrap = lambda a: a.inner if isinstance(a, Elsewhere) else torch.device("cpu") if a == AWAY else a
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        # .to("cpu"), .cpu(): a plain tensor
        if func is MOVES[0] and kwargs.get("device", AWAY) != AWAY: return out
        return tree_map(lambda o: Elsewhere(o) if isinstance(o, torch.Tensor) else o, out)


def send_away(module: torch.nn.Module) -> torch.nn.Module:
    "Move `module`'s parameters and buffers to `AWAY` (call inside `OneDevice`)."
    return module._apply(lambda t: t if isinstance(t, Elsewhere) else Elsewhere(t))


def no_autocast_away(monkeypatch):
    """torch keeps no autocast state for the stand-in device: asking says off, and turning it on or off there does
    nothing."""
    enabled, autocast = torch.is_autocast_enabled, torch.autocast
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: False if a and str(a[0]) == AWAY.type else enabled(*a))
    monkeypatch.setattr(torch, "autocast", lambda device_type, *a, **k:
                        contextlib.nullcontext() if device_type == AWAY.type else autocast(device_type, *a, **k))
