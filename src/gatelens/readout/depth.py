"""Verdicts that stay true at depth (docs/methods.md "Verification", "Tokens and depth").

A correct read-out differs from a float32 module by the module's own rounding, and that
grows with depth, width and the reduction lengths (measured: 1.93e-05 scaled at 24 layers of
mamba-130m's shape, 9.1e-06 at 2), so a fixed 1e-5 would call a correct read-out wrong at
size. Where the float32 one-step check says no, the verdict is re-judged in float64: the
same module, copied to float64, runs its own forward on the same call (its own kernel, in
float64), and the read-out is judged against that. A correct read-out then agrees to
~1e-12 whatever the depth; a wrong one (a gate off by 1e-3 relative) stays off by its
error, so the tolerance keeps both properties: it is never loosened.

>>> import torch
>>> from gatelens.families.registry import open_family
>>> lstm = torch.nn.LSTM(3, 4, batch_first=True)
>>> fam = open_family(lstm)
>>> call = fam.check(torch.randn(2, 5, 3))
>>> rows = one_step_float64(fam, call)
>>> max(r.max_abs_diff_h for r in rows) < 1e-12
True
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from gatelens.cells.numerics import faithful_matmul
from gatelens.families.base import Call, Family, LayerDiff
from gatelens.families.official_layers import one_step_by_layer, streams


def _double(x: Any) -> Any:
    """Every floating tensor inside ``x`` (a tensor, tuple, list or dict) in float64."""
    if isinstance(x, Tensor):
        return x.double() if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_double(v) for v in x)
    if isinstance(x, dict):
        return {k: _double(v) for k, v in x.items()}
    return x


def can_rejudge(fam: Family, call: Call) -> bool:
    """A float32 module on an unpacked call (half precision keeps its own tolerance)."""
    w = next(fam.module.parameters(), None)
    return (w is not None and w.dtype == torch.float32
            and call.layout.get("packed") is None)


def trace_within_rounding(trace_h: float, trace_c: float | None, tol: float,
                          depth: dict) -> bool:
    """A given trace against the module's trajectory, where float32 said no to the step and
    float64 said it is right: an anchored trace's state at t is one float64 step from the
    module's own state at t − 1, so it differs from the module by exactly the module's
    float32 rounding of one step, measured on the same call (``depth``'s figures). It
    passes within that figure (never less than ``tol``) plus one float32 ulp (2^-23) for
    the trace's storage; a trace of another input or another read-out stays far above.

    >>> trace_within_rounding(1.09e-5, None, 1e-5, {"float32_one_step": 1.09e-5})
    True
    >>> trace_within_rounding(3e-5, None, 1e-5, {"float32_one_step": 1.09e-5})
    False
    """
    ulp = 2.0 ** -23
    ok_h = trace_h <= max(tol, depth["float32_one_step"]) + ulp
    c32 = depth.get("float32_one_step_c") or 0.0
    return ok_h and (trace_c is None or trace_c <= max(tol, c32) + ulp)


def worst_window(rows: list[LayerDiff], call: Call) -> int | None:
    """The window float32 judged worst among ``rows`` (the layers it rejected): where the
    largest figure of them all lies, if the family named its window and the call's windows
    can be taken apart (``window_call``); else None, and every window is re-judged. The
    float64 re-judgement of that one window shows the largest float32 figure anywhere to be
    the module's rounding (or not), and every other window's figure is at most that one.

    >>> rows = [LayerDiff(0, False, 2e-5, None, 2e-5, worst_window=1),
    ...         LayerDiff(1, False, 3e-5, None, 3e-5, worst_window=0)]
    >>> worst_window(rows, Call(torch.zeros(2, 4, 3)))
    0
    """
    if call.batch < 2 or window_call(call, 0) is None:
        return None
    judged = [r.max_abs_diff_h if r.max_scaled_diff_h is None else r.max_scaled_diff_h
              for r in rows]
    if not all(math.isfinite(v) for v in judged):
        return None
    return rows[judged.index(max(judged))].worst_window


def window_call(call: Call, w: int) -> Call | None:
    """Window ``w`` of ``call`` alone: its inputs' row and every layout entry that is one row
    a window; None where the call holds anything else a window (a state given, a packed or
    recorded layout), which cannot be told apart here.

    >>> c = window_call(Call(torch.zeros(3, 4, 2), layout={"ids": torch.arange(12).view(3, 4),
    ...                                                     "batch_first": True}), 2)
    >>> tuple(c.inputs.shape), c.layout["ids"].tolist(), c.layout["batch_first"]
    ((1, 4, 2), [[8, 9, 10, 11]], True)
    """
    if call.state is not None:
        return None
    layout = {}
    for key, v in call.layout.items():
        if isinstance(v, Tensor) and v.ndim and v.shape[0] == call.batch:
            layout[key] = v[w : w + 1]
        elif v is None or isinstance(v, (bool, int, float, str)):
            layout[key] = v
        else:
            return None
    return Call(call.inputs[w : w + 1], None, layout)


def rejudged(fam: Family, call: Call, rows: list[LayerDiff]) -> tuple[list[LayerDiff], int | None]:
    """The float64 rows of the layers of ``rows`` (those float32 rejected), on the window
    float32 judged worst (``worst_window``), or on every window where none can be named;
    and that window (None: every one)."""
    w = worst_window(rows, call)
    layers = sorted({r.layer for r in rows})
    if w is None:
        return one_step_float64(fam, call, layers), None
    again = one_step_float64(fam, window_call(call, w), layers)
    return [replace(r, worst_window=w) for r in again], w


def one_step_float64(fam: Family, call: Call, layers: Collection[int] | None = None
                     ) -> list[LayerDiff]:
    """The one-step rows of ``fam``'s read-out against the module's own float64 forward on
    ``call`` (a float64 copy of the module, ``Family.family64``; the module itself is left
    as it is); of ``layers`` only, if given (a family whose layers replay apart runs the
    hand cell of those layers only)."""
    fam64 = fam.family64()
    call64 = Call(_double(call.inputs), _double(call.state), dict(call.layout))
    with torch.no_grad(), faithful_matmul(call.inputs.device):
        if streams(fam64):  # one layer's float64 states at a time (families/official_layers.py)
            return one_step_by_layer(fam64, call64, layers)
        ref64 = fam64.reference(call64)
        rows = fam64.one_step(call64, ref64)
    return rows if layers is None else [r for r in rows if r.layer in layers]
