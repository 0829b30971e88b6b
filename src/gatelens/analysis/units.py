"""Per-unit timescales: the mean forget gate of each unit (GRU: z) and its half-life.

f̄_u is unit u's keep gate averaged over all B·T positions; its half-life is
t½(a) = ln 0.5 / ln a characters (docs/methods.md, "Per-unit timescales").

>>> import torch
>>> from gatelens.readout.trace_types import Trace
>>> f = torch.full((2, 5, 3), 0.5)
>>> u = unit_timescales(Trace("lstm", 1, False, {"layer0.f": f}), init_value=0.5)
>>> u.n_units, u.below_init, u.half_life["median"]
(3, 0, 1.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from gatelens.analysis.common import as_numpy64, by_layer, finite_or_none, pooled
from gatelens.readout.trace_types import Trace

HALF_LIFE_LONG = 10.0  # "a long memory": half-life of 10 characters or more


def half_life(a):
    """Half-life in characters of a retention factor a: ln 0.5 / ln a.

    a ≥ 1 never halves (inf); a ≤ 0 forgets at once (0). Works on floats and arrays.

    >>> [round(half_life(a), 2) for a in (0.494, 0.793, 0.307)]
    [0.98, 2.99, 0.59]
    >>> half_life(1.0), half_life(0.0), half_life(0.5)
    (inf, 0.0, 1.0)
    >>> half_life(np.array([0.25, 1.5])).tolist()
    [0.5, inf]
    """
    if np.ndim(a) == 0 and not isinstance(a, np.ndarray):
        a = float(a)
        if a >= 1.0:
            return math.inf
        if a <= 0.0:
            return 0.0
        return math.log(0.5) / math.log(a)
    arr = np.asarray(a, dtype=np.float64)
    out = np.empty_like(arr)
    inside = (arr > 0.0) & (arr < 1.0)
    out[arr >= 1.0] = np.inf
    out[arr <= 0.0] = 0.0
    out[inside] = np.log(0.5) / np.log(arr[inside])
    out[np.isnan(arr)] = np.nan
    return out


@dataclass
class UnitTimescales:
    """Per-unit mean keep gate and its summary.

    Attributes:
        gate: "f" (LSTM) or "z" (GRU).
        init_value: the keep gate's starting value that ``below_init`` compares with.
        forget_means: f̄_u for every unit, (U,) float64, U = layers · H (layers pooled).
        n_units: U.
        below_init: units with f̄_u < init_value.
        half_life_ge_10: units whose half-life is 10 characters or more.
        forget_mean: min, p5, median, p95, max of f̄_u.
        half_life: min, median, max of the per-unit half-lives (inf allowed).
        layer_sizes: how many of the units each layer holds, bottom up (layers may differ:
            a mixed xLSTM stack's mLSTM heads beside its sLSTM units); None: not known.
    """

    gate: str
    init_value: float
    forget_means: np.ndarray
    n_units: int
    below_init: int
    half_life_ge_10: int
    forget_mean: dict[str, float]
    half_life: dict[str, float]
    layer_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.forget_means.shape != (self.n_units,):
            raise ValueError(f"forget_means has shape {self.forget_means.shape}, expected "
                             f"({self.n_units},)")
        if self.layer_sizes is not None and sum(self.layer_sizes) != self.n_units:
            raise ValueError(f"layer_sizes {self.layer_sizes} do not add up to {self.n_units}")
        if not 0 <= self.below_init <= self.n_units or not 0 <= self.half_life_ge_10 <= \
                self.n_units:
            raise ValueError("unit counts must lie between 0 and n_units")

    @property
    def half_lives(self) -> np.ndarray:
        """Per-unit half-lives in characters, (U,)."""
        return half_life(self.forget_means)

    def to_dict(self) -> dict:
        """report.json's "units" (infinite half-lives as null; per_unit: every f̄_u)."""
        return {"gate": self.gate, "init_value": self.init_value, "n_units": self.n_units,
                "below_init": self.below_init, "half_life_ge_10": self.half_life_ge_10,
                "forget_mean": dict(self.forget_mean),
                "half_life": {k: finite_or_none(v) for k, v in self.half_life.items()},
                "per_unit": [float(v) for v in self.forget_means]}


def unit_means(gate: Tensor) -> np.ndarray:
    """Mean over windows and positions of a (B, T, U) gate, per unit, float64 (U,)."""
    x = as_numpy64(gate)  # (B, T, U)
    return x.reshape(-1, x.shape[-1]).mean(axis=0)  # (U,)


def summarize_units(means: np.ndarray, gate: str, init_value: float,
                    layer_sizes: tuple[int, ...] | None = None) -> UnitTimescales:
    """The summary of per-unit means f̄_u (any source), as in docs/methods.md;
    ``layer_sizes``: each layer's count of them, bottom up (``UnitTimescales``).

    >>> u = summarize_units(np.array([0.307, 0.494, 0.793]), "f", 0.5)
    >>> u.below_init, [round(u.half_life[k], 2) for k in ("min", "median", "max")]
    (2, [0.59, 0.98, 2.99])
    """
    means = np.asarray(means, dtype=np.float64)
    if means.ndim != 1 or means.size == 0:
        raise ValueError(f"expected a non-empty vector of unit means, got shape {means.shape}")
    lives = half_life(means)  # (U,)
    p5, p95 = np.percentile(means, [5, 95], method="linear")
    return UnitTimescales(
        gate=gate, init_value=float(init_value), forget_means=means, n_units=int(means.size),
        below_init=int((means < init_value).sum()),
        half_life_ge_10=int((lives >= HALF_LIFE_LONG).sum()),
        forget_mean={"min": float(means.min()), "p5": float(p5),
                     "median": float(np.median(means)), "p95": float(p95),
                     "max": float(means.max())},
        half_life={"min": float(lives.min()), "median": float(np.median(lives)),
                   "max": float(lives.max())},
        layer_sizes=None if layer_sizes is None else tuple(int(n) for n in layer_sizes))


def unit_timescales(trace: Trace, init_value: float = 0.5) -> UnitTimescales | None:
    """Per-unit timescales of a trace's keep gate; None for a plain RNN (no keep gate).

    Layers are pooled: a unit of layer 1 is one more unit beside those of layer 0.
    """
    if trace.keep_gate is None:
        return None
    sizes = tuple(y.shape[-1] for y in by_layer(trace, trace.keep_gate))
    return summarize_units(unit_means(pooled(trace, trace.keep_gate)), trace.keep_gate,
                           init_value, sizes)


def shift_from_init(trained: UnitTimescales, untrained: UnitTimescales) -> dict:
    """How far training moved each unit's mean keep gate: trained f̄_u − untrained f̄_u.

    >>> a = summarize_units(np.array([0.4, 0.6]), "f", 0.5)
    >>> b = summarize_units(np.array([0.5, 0.5]), "f", 0.5)
    >>> {k: round(v, 3) for k, v in shift_from_init(a, b).items() if k != "per_unit"}
    {'mean': 0.0, 'mean_abs': 0.1, 'min': -0.1, 'median': 0.0, 'max': 0.1}
    """
    if trained.n_units != untrained.n_units:
        raise ValueError(f"unit counts differ: {trained.n_units} vs {untrained.n_units}")
    d = trained.forget_means - untrained.forget_means  # (U,)
    return {"mean": float(d.mean()), "mean_abs": float(np.abs(d).mean()),
            "min": float(d.min()), "median": float(np.median(d)), "max": float(d.max()),
            "per_unit": [float(v) for v in d]}
