"""Where a Lens runs: ``Lens(model, device=...)`` moves the model there, in place (as
``nn.Module.to`` moves it), and every window of ids the Lens reads is moved there before the
model sees it (``gatelens analyze --device``); the measurements then run where the
module's tensors are. A GPU may differ from the CPU by float32 rounding (cuBLAS and cuDNN
sum in another order; TF32 is kept off). benchmarks/gpu_check.py compares a
``Lens(..., device="cuda")`` analysis with the CPU's (figures within 1e-3 relative, the
verdicts word for word) on a machine with a GPU; none was lent to this project's sessions
so far (BENCHMARKS.md), so the CUDA path is not yet checked.

>>> import torch
>>> lstm = torch.nn.LSTM(3, 4)
>>> placed(lstm, "cpu"), placed(lstm, None)
(device(type='cpu'), None)
>>> placed(lstm, "tpu")
Traceback (most recent call last):
...
gatelens.errors.GatelensError: device 'tpu': not a device PyTorch knows (cpu, cuda, cuda:1, ...)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gatelens.errors import GatelensError

__all__ = ["DEVICES", "on", "placed", "resolve"]

#: ``--device``'s choices: auto is CUDA where there is a device, else the CPU
DEVICES = ("cpu", "cuda", "auto")


def resolve(device: str | torch.device | None) -> torch.device | None:
    """``device`` as a torch.device ("auto": CUDA where PyTorch sees a device, else the
    CPU); None stays None. A name PyTorch does not know, the meta device (no values) or
    CUDA on a machine without it is one line."""
    if device is None:
        return None
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise GatelensError(f"device {str(device)!r}: not a device PyTorch knows (cpu, cuda, "
                            "cuda:1, ...)") from None
    if dev.type == "meta":
        raise GatelensError("device 'meta': it holds no values; a Lens measures values")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GatelensError(f"device {str(device)!r}: this PyTorch ({torch.__version__}) sees "
                            "no CUDA device; use cpu (or auto)")
    return dev


def placed(model: nn.Module, device: str | torch.device | None) -> torch.device | None:
    """The device ``model`` was moved to (``resolve``), or None: left where it is. A model
    holding a recurrent module whose family computes on the CPU only (``Family.cpu_only``)
    is not moved to another device: one line names the module and why."""
    dev = resolve(device)
    if dev is not None and dev.type != "cpu":
        from gatelens.families.registry import family_of

        for path, m in model.named_modules():
            fam = family_of(m)
            if fam is not None and fam.cpu_only:
                raise GatelensError(f"{path or type(m).__name__} ({fam.name}) runs on the CPU "
                                    f"only: {fam.cpu_only}; use device cpu")
    if dev is not None:
        model.to(dev)
    return dev


def on(ids: Tensor, device: torch.device | None) -> Tensor:
    """``ids`` on ``device`` (None: where they are)."""
    return ids if device is None else ids.to(device)
