"""A CPU stand-in for a run on another device: which tensors would be left on the CPU.

No GPU is lent to this project's test machines, so ``Lens(..., device="cuda")`` cannot run
in CI. What breaks first on a GPU is a tensor made on the CPU (``torch.zeros(n)`` with no
device, ``.cpu()``, ``torch.from_numpy``) meeting one on the device in an operation:
CUDA refuses it ("Expected all tensors to be on the same device"), the CPU never can.

``DeviceAudit`` runs code on the CPU and keeps, for every tensor, whether it would lie on
the CPU on such a run: a tensor is *on the CPU* when a factory made it with no device (or
with "cpu"), when ``.cpu()``, ``.to("cpu")`` or ``torch.from_numpy`` made it, or when it was
computed from such a tensor only; everything else (the model's parameters, what they compute,
a tensor made with ``device=`` a tensor's ``.device`` or the Lens's ``device``) is *on the
device*. An operation that reads both, each with at least one dimension (a 0-dimensional
CPU tensor is a scalar to CUDA), is what CUDA would refuse: ``mixes`` lists each, with the
line that made the CPU tensor and the line that mixed it. Indexing and copies (``x[i]``,
``x[i] = y``, ``copy_``) cross devices on CUDA too, and are not mixes; ``.numpy()`` of a tensor
on the device is one (CUDA memory has no numpy view), and so is a draw on the device with
a CPU ``torch.Generator`` (CUDA needs one of its own).

The device is ``DeviceAudit.device``: a ``torch.device("cpu")`` told apart from every other
CPU device by identity. ``.device`` of a tensor on the device returns it, so code that
writes ``device=x.device`` places what it makes beside x, as it would on CUDA.

>>> import torch
>>> w = torch.randn(3, 3)
>>> with DeviceAudit() as audit:
...     ok = w @ torch.ones(3, device=w.device)
...     bad = w @ torch.ones(3)
>>> [m.op for m in audit.mixes]
['matmul']
"""

from __future__ import annotations

import os
import traceback
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

#: functions that make a tensor where ``device`` says (the CPU without one)
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.linspace,
              torch.logspace, torch.eye, torch.tensor, torch.as_tensor, torch.rand,
              torch.randn, torch.randint, torch.randperm, torch.empty_strided,
              torch.tril_indices, torch.triu_indices, torch.scalar_tensor}
#: functions that make a tensor beside their first argument unless ``device`` says otherwise
_BESIDE = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
           torch.rand_like, torch.randn_like, torch.randint_like,
           torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty,
           torch.Tensor.new_full, torch.Tensor.new_tensor}
#: what reads a tensor as a numpy array (only a CPU tensor can be)
_TO_NUMPY = {torch.Tensor.numpy, torch.Tensor.__array__}
_NUMPY, _GENERATOR = "(numpy)", "(generator)"
#: the moves between devices
_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}
#: the descriptor of ``Tensor.device``
_DEVICE = torch.Tensor.device
#: operations that cross devices on CUDA as well
_CROSSING = {torch.Tensor.copy_, torch.Tensor.__setitem__, torch.Tensor.__getitem__}


@dataclass(frozen=True)
class Mix:
    """An operation that reads a CPU tensor and a device tensor: its name, where it ran, and
    where the CPU tensor was made (file:line, the innermost frame of gatelens's own code,
    else of the caller)."""

    op: str
    at: str
    made_at: str

    def __str__(self) -> str:
        if self.made_at == _NUMPY:
            return f"{self.op} at {self.at} reads a tensor on the device as a numpy array"
        if self.made_at == _GENERATOR:
            return f"{self.op} at {self.at} draws on the device with a CPU generator"
        return f"{self.op} at {self.at} reads a CPU tensor made at {self.made_at}"


def _site() -> str:
    """The innermost frame in gatelens's source (else the innermost outside torch and this
    file), as file:line."""
    frames = traceback.extract_stack()[:-2]
    for f in reversed(frames):
        if f.filename.startswith(_SRC):
            return f"{os.path.relpath(f.filename, _SRC)}:{f.lineno}"
    for f in reversed(frames):
        if "/torch/" not in f.filename and f.filename != __file__:
            return f"{os.path.basename(f.filename)}:{f.lineno}"
    return "?"


def _tensors(x, out: list) -> list:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _tensors(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _tensors(v, out)
    return out


class DeviceAudit(TorchFunctionMode):
    """A torch function mode that marks tensors the CPU would hold (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.device = torch.device("cpu")
        self.mixes: list[Mix] = []
        self._cpu: dict[int, tuple[weakref.ref, str]] = {}
        self._from_numpy = torch.from_numpy

    # ---- the marks -------------------------------------------------------------------
    def on_cpu(self, t: torch.Tensor) -> str | None:
        """Where ``t`` was made if it would lie on the CPU; None if on the device."""
        entry = self._cpu.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _mark(self, result, site: str | None) -> None:
        for t in _tensors(result, []):
            if site is None:
                self._cpu.pop(id(t), None)
            else:
                self._cpu[id(t)] = (weakref.ref(t), site)

    def _is_cpu(self, device) -> bool | None:
        """What a ``device`` argument says: True the CPU, False the device, None nothing."""
        if device is None:
            return None
        if device is self.device:
            return False
        if isinstance(device, (str, torch.device)):
            return torch.device(device).type == "cpu"
        return None

    # ---- the mode ------------------------------------------------------------------
    def __enter__(self):
        def from_numpy(a: np.ndarray) -> torch.Tensor:
            t = self._from_numpy(a)
            self._mark(t, _site())
            return t

        torch.from_numpy = from_numpy
        return super().__enter__()

    def __exit__(self, *exc):
        torch.from_numpy = self._from_numpy
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DEVICE:  # ``t.device``
            return self._device_of(args[0])
        if func in _TO_NUMPY and self.on_cpu(args[0]) is None and not kwargs.get("force"):
            # CUDA memory has no numpy view (``numpy(force=True)`` copies it to the CPU)
            self.mixes.append(Mix(func.__name__, _site(), _NUMPY))
        result = func(*args, **kwargs)
        if not isinstance(result, (torch.Tensor, tuple, list)):
            return result
        site = self._placed(func, args, kwargs)
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator) and gen.device.type == "cpu" and site is None and \
                any(t.dim() > 0 for t in _tensors(result, [])):  # drew on the device
            self.mixes.append(Mix(getattr(func, "__name__", str(func)), _site(), _GENERATOR))
        if func in _MOVES and result is args[0] and site != self.on_cpu(result):
            # on the CPU a move to where a tensor already is returns the tensor itself; on
            # the GPU it is a copy elsewhere, and the tensor stays where it was
            result = result[...]
        self._mark(result, site)
        return result

    def _device_of(self, t: torch.Tensor):
        real = _DEVICE.__get__(t)
        if real.type != "cpu" or self.on_cpu(t) is not None:
            return real
        return self.device

    def _placed(self, func, args, kwargs) -> str | None:
        """Where the result lies: the site that made it on the CPU, or None (the device)."""
        said = self._is_cpu(kwargs.get("device"))
        if func in (torch.as_tensor, torch.tensor) and said is None and isinstance(
                args[0], torch.Tensor):  # a tensor stays where it is
            return self.on_cpu(args[0])
        if func in _FACTORIES:
            return _site() if said in (None, True) else None
        if func in _BESIDE:
            if said is not None:
                return _site() if said else None
            return self.on_cpu(args[0])
        if func is torch.Tensor.cpu:
            return _site()
        if func is torch.Tensor.to:
            return self._moved(args, kwargs)
        if func is torch.Tensor.cuda:
            return None
        inputs = [t for t in _tensors((args, kwargs), [])]
        cpu = [(t, self.on_cpu(t)) for t in inputs]
        made = [s for t, s in cpu if s is not None and t.dim() > 0]
        dev = [t for t, s in cpu if s is None and t.dim() > 0]
        if made and dev and func not in _CROSSING:
            name = getattr(func, "__name__", str(func))
            self.mixes.append(Mix(name, _site(), made[0]))
            return None
        if func in _CROSSING:  # the result lies where the tensor indexed or written does
            return self.on_cpu(args[0])
        if made and not dev:
            return made[0]
        if not dev and any(s is not None for _, s in cpu):  # 0-dimensional CPU tensors only
            return next(s for _, s in cpu if s is not None)
        return None

    def _moved(self, args, kwargs) -> str | None:
        """``Tensor.to``'s result: where its device or tensor argument says, else where the
        tensor was."""
        for a in list(args[1:]) + [kwargs.get("device"), kwargs.get("other")]:
            if isinstance(a, torch.Tensor):
                return self.on_cpu(a)
            said = self._is_cpu(a)
            if said is not None:
                return _site() if said else None
        return self.on_cpu(args[0])
