"""Gate distributions: mean and 5/25/50/75/95 % percentiles of every gate.

Over all B·T·H values of a gate (layers pooled), in float64, percentiles with linear
interpolation exactly as ``numpy.percentile`` (docs/methods.md, "Gate distributions").

>>> import torch
>>> from gatelens.readout.trace_types import Trace
>>> z = torch.linspace(0, 1, 101).view(1, 101, 1)
>>> tr = Trace("gru", 1, False, {"layer0.r": z, "layer0.z": z, "layer0.n": z})
>>> d = gate_distributions(tr)
>>> d.n_values, round(d.stats["z"]["p25"], 3), round(d.stats["z"]["mean"], 3)
(101, 0.25, 0.5)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gatelens.analysis.common import PERCENTILES, as_numpy64, pooled
from gatelens.readout.trace_types import Trace

STAT_KEYS = ("mean",) + tuple(f"p{q}" for q in PERCENTILES)


@dataclass
class GateDistributions:
    """Per-gate statistics.

    Attributes:
        cell: the trace's cell.
        n_values: values per gate (B·T·H·layers); None for a plain RNN, which has no gates.
        stats: gate letter -> {"mean", "p5", "p25", "p50", "p75", "p95"}.
    """

    cell: str
    n_values: int | None
    stats: dict[str, dict[str, float]]

    def __post_init__(self) -> None:
        for g, s in self.stats.items():
            if tuple(s) != STAT_KEYS:
                raise ValueError(f"gate {g}: statistics {tuple(s)}, expected {STAT_KEYS}")
            q = [s[k] for k in STAT_KEYS[1:]]
            if any(b < a for a, b in zip(q, q[1:], strict=False)):
                raise ValueError(f"gate {g}: percentiles are not ordered: {q}")
        if (self.n_values is None) != (not self.stats):
            raise ValueError("n_values must be given exactly when there are gates")

    def to_dict(self) -> dict:
        """report.json's "gates": {"n_values", "<gate>": {...}, ...}."""
        return {"n_values": self.n_values, **{g: dict(s) for g, s in self.stats.items()}}


def distribution(values: np.ndarray) -> dict[str, float]:
    """Mean and the METHODS percentiles of a flat float array.

    >>> distribution(np.arange(5.0))
    {'mean': 2.0, 'p5': 0.2, 'p25': 1.0, 'p50': 2.0, 'p75': 3.0, 'p95': 3.8}
    """
    qs = np.percentile(values, PERCENTILES, method="linear")
    return {"mean": float(values.mean()),
            **{f"p{q}": float(v) for q, v in zip(PERCENTILES, qs, strict=True)}}


def gate_distributions(trace: Trace) -> GateDistributions:
    """The distribution of every gate of a trace (i, f, g, o / r, z, n / none for an RNN)."""
    stats: dict[str, dict[str, float]] = {}
    n_values = None
    for g in trace.gates:
        x = as_numpy64(pooled(trace, g)).ravel()  # (B·T·U,)
        stats[g] = distribution(x)
        n_values = int(x.size)
    return GateDistributions(trace.cell, n_values, stats)
