"""The measurements: one pure function a measurement, Trace in, result dataclass out.

docs/methods.md defines every figure. Layers are pooled throughout (``common.pooled``).

>>> round(half_life(0.793), 2)
2.99
"""

from __future__ import annotations

from gatelens.analysis.classes import CharClasses, char_classes, default_class
from gatelens.analysis.gates import GateDistributions, gate_distributions
from gatelens.analysis.perturbation import (
    LAGS,
    PerturbationDecay,
    decompose,
    perturb_windows,
    perturbation_decay,
    report_lags,
)
from gatelens.analysis.units import (
    UnitTimescales,
    half_life,
    shift_from_init,
    summarize_units,
    unit_timescales,
)

__all__ = [
    "LAGS", "CharClasses", "GateDistributions", "PerturbationDecay", "UnitTimescales",
    "char_classes", "decompose", "default_class", "gate_distributions",
    "half_life", "perturb_windows", "perturbation_decay", "report_lags", "shift_from_init",
    "summarize_units", "unit_timescales",
]
