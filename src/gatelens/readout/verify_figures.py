"""Small helpers of verify.py: the largest figure of rows, finite-or-None, a trace as a
family's Readout, the check of a tolerance."""

from __future__ import annotations

import math

from gatelens.families.base import Call, LayerDiff, Readout
from gatelens.families.records import nan_max
from gatelens.readout.trace_types import Trace

#: Largest max |hand − torch| that passes (docs/methods.md: ~1e-7 expected on CPU float32).
VERIFY_TOL = 1e-5


def passes(diff_h: float, diff_c: float | None, tol: float = VERIFY_TOL) -> bool:
    """The verification rule: h's difference ≤ tol (absolute, or scaled by the unit's
    largest |h| for the modern cells), and c's difference (scaled by max(1, |c|), see
    readout/verify.py; None without a cell state) ≤ tol.

    >>> passes(1e-7, None), passes(1e-7, 2e-5), passes(2e-5, None)
    (True, False, False)
    """
    return diff_h <= tol and (diff_c is None or diff_c <= tol)


def maxes(rows: list[LayerDiff], attr: str) -> float | None:
    """The largest ``attr`` of the rows that have one, None when none has; NaN where any is."""
    return max_or_none([getattr(r, attr) for r in rows])


def finite_or_none(x: float | None) -> float | None:
    """``x`` as a float when finite, else None (report.json holds no NaN)."""
    return None if x is None or not math.isfinite(x) else float(x)


def max_or_none(values: list) -> float | None:
    """The largest value, None without any; NaN wins (a NaN chunk is a NaN verdict)."""
    vals = [v for v in values if v is not None]
    return nan_max(*vals) if vals else None


def as_readout(trace: Trace | Readout, call: Call) -> Readout:
    """A given trace as a Readout in the family's batched layout."""
    ro = trace if isinstance(trace, Readout) else Readout(dict(trace), trace.h_n, trace.c_n)
    if call.layout.get("unbatched") and ro.h_n is not None and ro.h_n.ndim == 2:
        ro = Readout(ro.signals, ro.h_n.unsqueeze(1),
                     None if ro.c_n is None else ro.c_n.unsqueeze(1))
    return ro


def check_tol(tol: float) -> None:
    """A tolerance is a finite number ≥ 0.

    >>> check_tol(float("nan"))
    Traceback (most recent call last):
    ...
    ValueError: the tolerance must be a finite number >= 0; got nan
    """
    if not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol < 0:
        raise ValueError(f"the tolerance must be a finite number >= 0; got {tol!r}")


def hooks_sentence(meta: dict) -> str:
    """The sentence on a module read on its own call, hooks included (none without).

    >>> hooks_sentence({"hooks": ["forward pre-hook f"], "inputs": "as given"})
    " Read on the module's own call, its hooks run (forward pre-hook f): inputs as given."
    """
    hooks = meta.get("hooks")
    if not hooks:
        return ""
    return (f" Read on the module's own call, its hooks run ({', '.join(hooks)}): inputs "
            f"{meta.get('inputs', 'as its forward received them')}.")
