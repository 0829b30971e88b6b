"""Helpers shared by the measurements: pooling layers and float64 statistics.

Multi-layer rule (used by every measurement and stated in report.md): the units of all
layers are pooled, so a gate of a 2-layer model with H units has 2·H units, and the carried
state s is the concatenation of every layer's state, (B, T, L·H).

Bidirectional rule: ``pooled`` reads only the FORWARD direction (``layerK.<letter>``), so
a bidirectional module's state and keep-gate measurements are those of its forward
direction (perturbation decay runs forward in time); the reverse direction's gates stay in
the trace (``layerK.reverse.<letter>``). A forward layer above the first reads the layer
below's reverse output too, so its state can move before a perturbed position.

>>> import torch
>>> from gatelens.readout.trace_types import Trace
>>> tr = Trace("gru", 2, False, {"layer0.z": torch.zeros(1, 2, 3), "layer1.z": torch.ones(1, 2, 3)})
>>> tuple(pooled(tr, "z").shape)
(1, 2, 6)
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gatelens.cells.names import layer_name
from gatelens.readout.trace_types import Trace

PERCENTILES = (5, 25, 50, 75, 95)


def check_trace(trace: Trace) -> None:
    """Reject traces the measurements do not define (bidirectional, ragged)."""
    if trace.bidirectional:
        raise ValueError("the measurements are defined for unidirectional modules only")
    if trace.lengths is not None:
        raise ValueError("the measurements need equal-length windows, not a packed sequence")


def pooled(trace: Trace, letter: str) -> Tensor:
    """One signal of every layer, concatenated on the unit axis: (B, T, L·H).

    For a bidirectional trace, the forward direction's layers only (module docstring).

    >>> from gatelens.readout.trace_types import Trace
    >>> bi = Trace("gru", 1, True, {"layer0.z": torch.zeros(1, 2, 3),
    ...                             "layer0.reverse.z": torch.ones(1, 2, 3)})
    >>> float(pooled(bi, "z").sum()), tuple(pooled(bi, "z").shape)
    (0.0, (1, 2, 3))
    """
    return torch.cat(by_layer(trace, letter), dim=-1)


def by_layer(trace: Trace, letter: str) -> list[Tensor]:
    """``pooled``'s pieces, one layer each (B, T, H_k): what a figure pooled over the unit
    axis reads one layer at a time, without the stack's copy (302 MB of float32 for one
    window of a 24-layer Mamba's keep gate, 604 MB more in float64)."""
    if trace.lengths is not None:
        raise ValueError("the measurements need equal-length windows, not a packed sequence")
    return [trace[f"{layer_name(k)}.{letter}"] for k in range(trace.num_layers)]


def as_numpy64(x: Tensor) -> np.ndarray:
    """A tensor as a float64 numpy array (statistics are computed in float64)."""
    return x.detach().to("cpu", torch.float64).numpy()


def finite_or_none(x: float | None) -> float | None:
    """JSON has no infinity: inf and nan become None (null).

    >>> finite_or_none(float("inf")) is None, finite_or_none(2.5)
    (True, 2.5)
    """
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def none_to_inf(x: float | None) -> float:
    """The inverse of :func:`finite_or_none` for half-lives (null means infinite)."""
    return math.inf if x is None else float(x)


def give_back() -> None:
    """Hand freed memory back to the system: glibc keeps freed blocks below its mmap
    threshold (up to 32 MiB) in its heap, where the next stage's blocks do not always fit.
    ``measure`` calls it after each stage and each chunk (5 % off an 8-layer
    mamba-130m-shaped model's peak over 4 windows; 0.2 GB off a 24-layer Mamba-2 window's),
    the spectrum every 16 steps (whose resident memory grew by 0.4 GB over a window at 24
    Mamba-2 layers). Elsewhere than glibc a no-op.

    >>> give_back()
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, loaded once; None elsewhere (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
