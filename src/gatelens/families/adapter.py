"""Trace, verification and divergence rate of any family, from the family interface alone.

``measure`` still calls ``trace``/``verify``/``divergence_rate``, written for nn.RNNBase and
gatelens's own cells. A module that only a family opens (the ONNX / Keras variants of
cells/variants.py) goes through these three instead, each written once against
``gatelens.families.base.Family``: the same Trace names, the same VerifyResult figures
(docs/methods.md "Verification": the one-step error is the verdict; h judged by
|Δh| / max(1, |h|), c by |Δc| / max(1, |c|)), and the same divergence rate (a unit tangent
vector pushed through each step's JVP in float64, renormalised, ln growth summed after the
burn-in, averaged over windows). The lead's family-based ``measure`` replaces this file.

>>> import torch
>>> from gatelens.cells.variants import VariantLSTM
>>> m = VariantLSTM(3, 4, peepholes=True, recurrent_activation="hard_sigmoid")
>>> fam = family_only(m)
>>> x = torch.randn(2, 20, 3)
>>> tr = family_trace(fam, x)
>>> res = family_verify(fam, x, trace=tr)
>>> tr.cell, res.passed, family_divergence(fam, x, burn_in=4).regime
('lstm_variant', True, 'contracting')
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gatelens.families.base import Family, LayerDiff, Readout


def family_only(module: nn.Module) -> Family | None:
    """The family of a module that only a family opens (cells/variants.py), else None."""
    from gatelens.families.variants import VariantGRUFamily, VariantLSTMFamily

    for cls in (VariantLSTMFamily, VariantGRUFamily):
        if cls.opens(module):
            return cls(module)
    return None


def family_trace(fam: Family, inputs: Tensor, state: Any = None):
    """The anchored read-out as a ``Trace`` (names of ``fam.names()``)."""
    from gatelens.readout.trace_types import Trace

    call = fam.check(inputs, state)
    ro = fam.read(call, fam.reference(call))
    return Trace(cell=fam.cell, num_layers=fam.num_layers, bidirectional=fam.bidirectional,
                 tensors=ro.signals, h_n=ro.h_n, c_n=ro.c_n,
                 meta={"method": "anchored", "dtype": str(inputs.dtype),
                       "device": str(inputs.device), "batch_first": True, "unbatched": False,
                       "family": fam.name})


def _worst(rows: list[LayerDiff], key: str) -> float | None:
    vals = [getattr(r, key) for r in rows if getattr(r, key) is not None]
    return max(vals) if vals else None


def family_verify(fam: Family, inputs: Tensor, state: Any = None, trace=None,
                  tol: float | None = None):
    """``verify``'s VerifyResult from the family: one-step error, free-running divergence,
    and a given trace judged against the module's own trajectory."""
    from gatelens.readout.trace_types import Trace
    from gatelens.readout.verify import VERIFY_TOL, VerifyResult

    tol = VERIFY_TOL if tol is None else tol
    call = fam.check(inputs, state)
    ref = fam.reference(call)
    one = fam.one_step(call, ref)
    free = fam.judge(fam.rerun(call), ref)
    given = None
    if trace is not None:
        if not isinstance(trace, Trace):
            raise TypeError(f"trace must be a Trace; got {type(trace).__name__}")
        given = fam.judge(Readout(trace.tensors), ref)
    lstm = fam.spec.state == "c"
    bounded = getattr(fam, "bounded_h", True)
    return VerifyResult(
        cell=fam.cell, layers=one,
        one_step_max_abs_diff_h=_worst(one, "max_abs_diff_h"),
        one_step_max_abs_diff_c=_worst(one, "max_abs_diff_c") if lstm else None,
        one_step_max_scaled_diff_c=_worst(one, "max_scaled_diff_c") if lstm else None,
        free_running_max_abs_diff_h=_worst(free, "max_abs_diff_h"),
        free_running_layers=free,
        trace_max_abs_diff_h=None if given is None else _worst(given, "max_abs_diff_h"),
        trace_max_scaled_diff_c=_worst(given, "max_scaled_diff_c") if given and lstm else None,
        tol=tol, meta={"dtype": str(inputs.dtype), "family": fam.name},
        # h bounded by its activations: judged absolutely, as nn.LSTM's; else on its scale
        one_step_max_scaled_diff_h=None if bounded else _worst(one, "max_scaled_diff_h"),
        trace_max_scaled_diff_h=None if given is None or bounded
        else _worst(given, "max_scaled_diff_h"))


def _direction_rate(dyn, burn_in: int, gen: torch.Generator) -> np.ndarray:
    """Per-window λ of one Dynamics along its own trajectory (docs/methods.md)."""
    B, sizes = dyn.inputs.shape[0], [p.shape[-1] for p in dyn.initial]
    v = torch.randn(B, sum(sizes), generator=gen, dtype=torch.float64)  # (B, S)
    v = list((v / v.norm(dim=-1, keepdim=True)).split(sizes, dim=-1))
    total = torch.zeros(B, dtype=torch.float64)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated",
                                category=DeprecationWarning)
        for j, t in enumerate(dyn.order):
            x_t = dyn.inputs[:, t]  # (B, F)
            _, v = torch.func.jvp(lambda *s, x_t=x_t: tuple(dyn.step(x_t, list(s))),
                                  tuple(dyn.previous(j)), tuple(v))
            growth = torch.sqrt(sum((p * p).sum(dim=-1) for p in v))  # (B,)
            if j >= burn_in:
                total = total + torch.log(growth)
            v = [p / growth[:, None] for p in v]
    return (total / (len(dyn.order) - burn_in)).numpy()


def family_divergence(fam: Family, inputs: Tensor, seed: int = 0, burn_in: int = 16,
                      state: Any = None):
    """``divergence_rate``'s DivergenceRate from the family's dynamics (the worse direction
    when there are two, as for a bidirectional nn.RNNBase)."""
    from gatelens.analysis.divergence import DivergenceRate

    T = inputs.shape[1]
    if not isinstance(burn_in, int) or not 0 <= burn_in < T:
        raise ValueError(f"burn_in must be an int in [0, T) = [0, {T}); got {burn_in!r}")
    call = fam.check(inputs, state)
    gen = torch.Generator().manual_seed(int(seed))
    rates = {d.name: _direction_rate(d, burn_in, gen)
             for d in fam.dynamics(call, fam.reference(call))}
    worst = max(rates, key=lambda k: float(np.mean(rates[k])))
    per = rates[worst]
    sd = float(np.std(per, ddof=1)) if per.size > 1 else 0.0
    return DivergenceRate(float(np.mean(per)), sd, burn_in, per,
                          {k: float(np.mean(v)) for k, v in rates.items()}
                          if len(rates) > 1 else {})
