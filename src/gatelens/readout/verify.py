"""Verification: is the read-out PyTorch's own computation? (docs/methods.md)

Two figures, always together:

- **one-step error** (pass/fail): every step of the hand cell is fed PyTorch's own state
  at t − 1 (h, and the LSTM's c) and compared with PyTorch's state at t (its family).
  ~1e-7 in float32 on the CPU whatever the model; above 1e-5 the read-out is wrong.
- **free-running divergence** (a property of the model, never a failure by itself):
  max |h_hand − h_torch| when the hand cell runs from the initial state on its own
  outputs. On a contracting model it stays near the one-step error; on a chaotic one any
  two correct implementations part like e^{λt}, and the figure is large.

h lies in (−1, 1) and is judged absolutely; c is unbounded and is judged by
|Δc| / max(1, |c|) (absolute below 1, relative above); the absolute figure is reported too.
The modern cells' h (minGRU and minLSTM: a mix of linear candidates) and their blocks'
output y are unbounded like c; they are judged scaled by the unit's largest |value| in the
window (at least 1), which on h within (−1, 1) is the absolute rule (families/modern.py).
A trace handed to ``verify`` is checked against the module's own output as well: a trace
must describe the trajectory the module took.

>>> import torch
>>> res = verify(torch.nn.LSTM(3, 4, num_layers=2), torch.randn(5, 2, 3))
>>> res.passed, len(res.layers)
(True, 2)
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from gatelens.cells.numerics import faithful_matmul
from gatelens.families.base import Call, Family, LayerDiff, Readout, Reference
from gatelens.families.registry import open_family
from gatelens.families.torch_ops import as_computed
from gatelens.readout.depth import can_rejudge, rejudged, trace_within_rounding
from gatelens.readout.trace import State, through_hooks
from gatelens.readout.trace_types import Trace
from gatelens.readout.verify_figures import (  # noqa: F401 - re-exported
    VERIFY_TOL,
    as_readout,
    check_tol,
    finite_or_none,
    max_or_none,
    maxes,
    passes,
)
from gatelens.readout.verify_words import VerdictWords

__all__ = ["VERIFY_TOL", "LayerDiff", "VerifyResult", "check_tol", "passes",
           "verify", "verify_call"]

#: Half precision rounds every step at its own epsilon: its tolerance is this many of them.
HALF_EPS = 8  # half precision: the largest seen, 4.7 eps (bfloat16, an LSTM ×16), and margin


def tolerance_for(dtype: torch.dtype) -> float:
    """The verification tolerance of a dtype: 1e-5 for float32 and float64 (docs/methods.md),
    8 × the machine epsilon for float16 (7.8e-3) and bfloat16 (6.3e-2), which round every
    step at that scale: a correct read-out of saturated half-precision LSTMs sits at up to
    4.7 eps (tests/test_dtypes.py); a wrong gate is off by O(0.1-1).

    >>> tolerance_for(torch.float32), tolerance_for(torch.float16), tolerance_for(torch.bfloat16)
    (1e-05, 0.0078125, 0.0625)
    """
    if not dtype.is_floating_point:
        return VERIFY_TOL
    return max(VERIFY_TOL, HALF_EPS * torch.finfo(dtype).eps)


@dataclass(frozen=True)
class VerifyResult(VerdictWords):
    """Outcome of ``verify``: the one-step error (the verdict) and the free-running
    divergence, per layer and direction and overall."""

    cell: str
    layers: list[LayerDiff]  # one-step error per layer (free-running for packed input)
    one_step_max_abs_diff_h: float | None  # None: packed input (not defined there)
    one_step_max_abs_diff_c: float | None
    one_step_max_scaled_diff_c: float | None
    free_running_max_abs_diff_h: float
    free_running_layers: list[LayerDiff] = field(default_factory=list)
    trace_max_abs_diff_h: float | None = None  # a given trace against the module's h
    trace_max_scaled_diff_c: float | None = None
    tol: float = VERIFY_TOL
    meta: dict = field(default_factory=dict)
    #: Modern cells only (h and y unbounded): the one-step error scaled by each unit's
    #: largest |value| in the window, at least 1 (families/modern.py); what h is judged by.
    one_step_max_scaled_diff_h: float | None = None
    trace_max_scaled_diff_h: float | None = None  # a given trace, the same rule
    #: the divergence rate's regime ("contracting", "chaotic") when an analysis measured it:
    #: what "chaotic" means in the words, so they and report.json never disagree
    regime: str | None = None

    @property
    def nonfinite(self) -> bool:
        """A figure is NaN or infinite: the module's own output (its weights or input) is not
        finite, so there is nothing to verify."""
        vals = [self.one_step_max_abs_diff_h, self.one_step_max_scaled_diff_c,
                self.one_step_max_scaled_diff_h, self.free_running_max_abs_diff_h]
        return any(v is not None and not math.isfinite(v) for v in vals)

    @property
    def judged_diff_h(self) -> float:
        """What h is judged by: the scaled figure where h is unbounded, else absolute."""
        if self.one_step_max_scaled_diff_h is not None:
            return self.one_step_max_scaled_diff_h
        return self.max_abs_diff_h

    @property
    def max_abs_diff_h(self) -> float:
        """The read-out's error in h: the one-step figure (free-running for packed input)."""
        if self.one_step_max_abs_diff_h is None:
            return self.free_running_max_abs_diff_h
        return self.one_step_max_abs_diff_h

    @property
    def max_abs_diff_c(self) -> float | None:
        return self.one_step_max_abs_diff_c

    @property
    def max_scaled_diff_c(self) -> float | None:
        return self.one_step_max_scaled_diff_c

    @property
    def passed(self) -> bool:
        """The one-step error within ``tol`` (h absolutely, or on its scale for the modern
        cells; c scaled by max(1, |c|)), and a given trace on the module's trajectory by the
        same rule. Never when a figure is not finite."""
        if self.nonfinite:
            return False
        return passes(self.judged_diff_h, self.max_scaled_diff_c, self.tol) and self.trace_passes

    @property
    def trace_passes(self) -> bool:
        """A given trace is on the module's trajectory (True without one): within ``tol``,
        or within the module's own float32 rounding where float64 re-judged the step
        (``depth.trace_within_rounding``)."""
        if self.trace_max_abs_diff_h is None:
            return True
        if passes(self._trace_h, self.trace_max_scaled_diff_c, self.tol):
            return True
        depth = self.meta.get("float64_rejudge")
        return bool(depth) and self.passes_one_step and trace_within_rounding(
            self._trace_h, self.trace_max_scaled_diff_c, self.tol, depth)

    @property
    def _trace_h(self) -> float:
        """A given trace's h difference as judged (modern cells: the scaled figure)."""
        if self.trace_max_scaled_diff_h is not None:
            return self.trace_max_scaled_diff_h
        return self.trace_max_abs_diff_h

    @property
    def chaotic(self) -> bool:
        """The model is chaotic on this text: the divergence rate says so when it was
        measured, else the free-running re-run parted from PyTorch while each step is right."""
        if self.regime is not None:
            return self.regime == "chaotic"
        return self.free_running_max_abs_diff_h > self.tol

    @property
    def passes_one_step(self) -> bool:
        return passes(self.judged_diff_h, self.max_scaled_diff_c, self.tol)

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (``passed`` included)."""
        return {**asdict(self), "passed": self.passed}

    def to_report(self) -> dict:
        """report.json's "verification" (version 3: version 2's figures, the tolerance's
        rule, and which figures were not finite).

        >>> r = VerifyResult("gru", [], 6.85e-07, None, None, 1e-6).to_report()
        >>> r["one_step_max_abs_diff_h"], r["passed"], r["nonfinite"]
        (6.85e-07, True, False)
        """
        fin = finite_or_none
        return {"one_step_max_abs_diff_h": fin(self.one_step_max_abs_diff_h),
                "one_step_max_abs_diff_c": fin(self.one_step_max_abs_diff_c),
                "one_step_max_scaled_diff_c": fin(self.one_step_max_scaled_diff_c),
                "one_step_max_scaled_diff_h": fin(self.one_step_max_scaled_diff_h),
                "free_running_max_abs_diff_h": fin(self.free_running_max_abs_diff_h),
                "tolerance": self.tol, "passed": self.passed,
                "tolerance_rule": self.meta.get("tolerance_rule"),
                "nonfinite": self.nonfinite,
                **({"float64_rejudge": self.meta["float64_rejudge"]}
                   if "float64_rejudge" in self.meta else {})}




def verify_call(fam: Family, call: Call, ref: Reference, trace: Trace | Readout | None = None,
                tol: float | None = None) -> VerifyResult:
    """``verify`` on a call already checked and a reference already computed (compute once:
    ``gatelens.analysis.measure`` shares them with the read-out and the dynamics). ``tol``
    None: the module's dtype's (``tolerance_for``)."""
    dtype = next((p.dtype for p in fam.module.parameters()), call.inputs.dtype)
    given_tol = tol is not None  # a tolerance the user gave is judged as given
    rule = (f"given ({tol:g})" if tol is not None else
            "1e-5 (float32/float64)" if tolerance_for(dtype) == VERIFY_TOL else
            f"{HALF_EPS} × the machine epsilon of {dtype} (half precision)")
    tol = tolerance_for(dtype) if tol is None else tol
    check_tol(tol)
    packed = call.layout.get("packed") is not None
    with torch.no_grad(), faithful_matmul(call.inputs.device), warnings.catch_warnings():
        # the free-running figure is reported, not warned about
        warnings.filterwarnings("ignore", message="trace.method='step'. has left")
        free = fam.free_running(call, ref)
        one = None if packed else fam.one_step(call, ref)
        depth = None
        if (one is not None and not given_tol and not _rows_pass(one, tol)
                and can_rejudge(fam, call)):
            # float32 says no: re-judged against the module's own float64 forward (depth.py)
            # only the layers float32 rejects: the others keep their float32 rows
            rejected = sorted({r.layer for r in one if not _rows_pass([r], tol)})
            # on the window float32 judged worst where it can be named (depth.worst_window)
            again, window = rejudged(fam, call, [r for r in one if r.layer in rejected])
            depth = {"float32_one_step": maxes(one, "max_scaled_diff_h")
                     or maxes(one, "max_abs_diff_h"),
                     "float32_one_step_c": maxes(one, "max_scaled_diff_c"),
                     "layers": rejected, "windows": None if window is None else [window]}
            one = sorted([r for r in one if r.layer not in rejected] + again,
                         key=lambda r: (r.layer, r.reverse))
            rule += ("; re-judged in float64 on the layers where float32 rounding exceeded it"
                     + ("" if window is None else ", on the window where it was largest"))
        given = None
        if trace is not None:
            given = fam.judge(as_readout(trace, call), ref)
    rows = free if one is None else one
    w = next(fam.module.parameters(), None)
    res = VerifyResult(
        cell=fam.cell, layers=rows,
        one_step_max_abs_diff_h=None if one is None else maxes(one, "max_abs_diff_h"),
        one_step_max_abs_diff_c=None if one is None else maxes(one, "max_abs_diff_c"),
        one_step_max_scaled_diff_c=None if one is None else maxes(one, "max_scaled_diff_c"),
        free_running_max_abs_diff_h=maxes(free, "max_abs_diff_h"),
        free_running_layers=free,
        trace_max_abs_diff_h=None if given is None else maxes(given, "max_abs_diff_h"),
        trace_max_scaled_diff_c=None if given is None else maxes(given, "max_scaled_diff_c"),
        tol=tol, meta={"dtype": str(call.inputs.dtype if w is None else w.dtype),
                       "family": fam.name, "tolerance_rule": rule,
                       **({} if depth is None else {"float64_rejudge": depth})},
        one_step_max_scaled_diff_h=None if one is None else maxes(one, "max_scaled_diff_h"),
        trace_max_scaled_diff_h=None if given is None else maxes(given, "max_scaled_diff_h"))
    if res.nonfinite and isinstance(ref.output, Tensor):  # the read states, or the module's?
        res.meta["output_finite"] = bool(torch.isfinite(ref.output).all())
    return res


def _rows_pass(rows: list[LayerDiff], tol: float) -> bool:
    """Every layer's one-step figures within ``tol`` (the rule of ``passes``)."""
    return all(passes(r.max_abs_diff_h if r.max_scaled_diff_h is None else r.max_scaled_diff_h,
                      r.max_scaled_diff_c, tol) for r in rows)


def verify(module: nn.Module, inputs: Tensor | PackedSequence, state: State = None,
           trace: Trace | None = None, tol: float | None = None) -> VerifyResult:
    """The one-step error and the free-running divergence of ``module`` on ``inputs`` (what
    the module takes); with ``trace``, also that trace against the module's own states.
    A module with hooks is verified on its own call, hooks included (readout/own_call.py):
    on what its forward received, and a given trace also against what the call returned;
    a hook that changes the output is refused in one line naming it.
    ``tol`` None: 1e-5, or 8 × the machine epsilon for float16/bfloat16 (``tolerance_for``).

    >>> import torch
    >>> gru = torch.nn.GRU(2, 3, batch_first=True)
    >>> r = verify(gru, torch.randn(2, 4, 2))
    >>> r.max_abs_diff_c is None, r.to_dict()["passed"], r.chaotic
    (True, True, False)
    >>> from gatelens.cells.modern import MinGRU
    >>> verify(MinGRU(3, 4, num_layers=2), torch.randn(2, 6, 3)).passed
    True
    """
    fam = open_family(module, "verify()")
    own = through_hooks(fam, inputs, state, "verify()")
    call = fam.check(own.inputs, own.state)
    with torch.no_grad(), faithful_matmul(call.inputs.device), as_computed(module):
        ref = fam.reference(call)
        res = verify_call(fam, call, ref, trace, tol)
    if not own.hooks:
        return res
    meta = {**res.meta, **own.meta()}
    if trace is None or own.output is None:
        return replace(res, meta=meta)
    # the trace against what the module's own call returned, hooks included
    gap = fam.output_diff(as_readout(trace, call), own.output)
    return replace(res, meta=meta, trace_max_abs_diff_h=max_or_none(
        [res.trace_max_abs_diff_h, gap]))
