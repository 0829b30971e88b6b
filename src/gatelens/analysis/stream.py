"""Streaming: the per-window measurements accumulated chunk by chunk of windows.

docs/methods.md "Streaming analysis": every figure over windows is a sum, a mean, a count
or a percentile. The accumulators here keep what each needs and nothing more:

- ``GateStats``: the values of every gate while they fit (``EXACT_LIMIT`` values a gate:
  the percentiles are then numpy's own, exactly as one shot), else a histogram of
  ``BINS`` bins over the gate's range, whose percentiles lie within one bin (1.5e-5 on a
  sigmoid, 3.1e-5 on a tanh) of the exact ones; the mean is always exact;
- ``UnitStats``: per-unit sums of the keep gate;
- ``ClassStats``: the mean keep gate of every position, by class of its character.

The perturbation curves, the output reach and the divergence rate keep a few floats a
window (their ``*_rows`` functions), so their figures equal the one-shot computation.

>>> import torch
>>> from gatelens.readout.trace_types import Trace
>>> z = torch.linspace(0, 1, 101).view(1, 101, 1)
>>> tr = Trace("gru", 1, False, {"layer0.r": z, "layer0.z": z, "layer0.n": z})
>>> g = GateStats(tr.spec, total=101, exact_limit=10)
>>> g.update(tr); d = g.result()
>>> g.method.startswith("histogram"), abs(d.stats["z"]["p25"] - 0.25) < 2e-5
(True, True)
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from gatelens.analysis.classes import CharClasses, classing
from gatelens.analysis.common import PERCENTILES, as_numpy64, by_layer, pooled
from gatelens.analysis.gates import GateDistributions, distribution
from gatelens.analysis.units import UnitTimescales, summarize_units
from gatelens.families.spec import CellSpec
from gatelens.readout.trace_types import Trace

#: values of one gate kept exactly (32 MB of float32); more go to a histogram
EXACT_LIMIT = 2**23
#: histogram bins over a gate's range (docs/methods.md: at least 2^16)
BINS = 2**16


def hist_percentile(counts: np.ndarray, lo: float, hi: float, q: float) -> float:
    """numpy's linear percentile of the values a histogram counts, each value placed at the
    middle of its share of its bin: within one bin width of the exact figure.

    >>> c = np.zeros(100, dtype=np.int64); c[[10, 20, 30]] = 1
    >>> round(hist_percentile(c, 0.0, 1.0, 50), 3), float(np.percentile([.105, .205, .305], 50))
    (0.205, 0.205)
    """
    cum = np.cumsum(counts)
    n = int(cum[-1])
    width = (hi - lo) / counts.size

    def value(r: int) -> float:  # the r-th smallest, 0-based
        b = int(np.searchsorted(cum, r, side="right"))
        before = int(cum[b - 1]) if b else 0
        return float(lo + (b + (r - before + 0.5) / counts[b]) * width)

    h = (n - 1) * q / 100.0
    j = int(math.floor(h))
    lo_v = value(j)
    return lo_v if j + 1 >= n else lo_v + (h - j) * (value(j + 1) - lo_v)


class GateStats:
    """Every gate's mean and percentiles over chunks of traces."""

    def __init__(self, spec: CellSpec, total: int, exact_limit: int | None = None) -> None:
        exact_limit = EXACT_LIMIT if exact_limit is None else exact_limit
        self.gates = spec.gates
        self.bounds = {g: spec.bounds.get(g) for g in self.gates}
        self.exact = total <= exact_limit or any(b is None for b in self.bounds.values())
        self.values: dict[str, list[np.ndarray]] = {g: [] for g in self.gates}
        self.counts = {g: np.zeros(BINS, dtype=np.int64) for g in self.gates}
        self.sums = {g: 0.0 for g in self.gates}
        self.cell = spec.name

    @property
    def method(self) -> str:
        """How the percentiles were computed, in words (report.json "text")."""
        if self.exact:
            return "exact (numpy.percentile, linear)"
        return (f"histogram of {BINS} bins over each gate's range (within one bin of the exact "
                "value: 1.5e-5 for a sigmoid gate, 3.1e-5 for tanh)")

    def update(self, trace: Trace) -> None:
        for g in self.gates:
            if self.exact:
                x = pooled(trace, g).detach()  # (B, T, U): at most EXACT_LIMIT values
                if x.dtype not in (torch.float32, torch.float64):  # float16 / bfloat16
                    x = x.float()
                self.values[g].append(x.to("cpu").numpy().ravel().copy())  # its own dtype
                continue
            lo, hi = self.bounds[g]
            for y in by_layer(trace, g):  # one layer's copies at a time
                y = y.detach().double()
                self.sums[g] += float(y.sum())
                idx = ((y - lo) * (BINS / (hi - lo))).long().clamp_(0, BINS - 1)
                self.counts[g] += torch.bincount(idx.flatten().cpu(), minlength=BINS).numpy()

    def result(self) -> GateDistributions:
        stats: dict[str, dict[str, float]] = {}
        for g in self.gates:
            if self.exact:
                stats[g] = distribution(np.concatenate(self.values[g]).astype(np.float64))
                continue
            lo, hi = self.bounds[g]
            n = int(self.counts[g].sum())
            stats[g] = {"mean": self.sums[g] / n, **{
                f"p{q}": hist_percentile(self.counts[g], lo, hi, q) for q in PERCENTILES}}
        n_values = None
        if self.gates:
            n_values = int(sum(v.size for v in self.values[self.gates[0]])) if self.exact \
                else int(self.counts[self.gates[0]].sum())
        return GateDistributions(self.cell, n_values, stats)


class UnitStats:
    """Per-unit sums of the keep gate over chunks (layers pooled)."""

    def __init__(self, spec: CellSpec) -> None:
        self.gate = spec.keep_gate
        self.sum: np.ndarray | None = None
        self.n = 0
        self.sizes: tuple[int, ...] | None = None  # each layer's units

    def update(self, trace: Trace) -> None:
        if self.gate is None:
            return
        parts = []
        for y in by_layer(trace, self.gate):  # (B, T, H_k): the same sums, a layer at a time
            y = as_numpy64(y)
            parts.append(y.reshape(-1, y.shape[-1]).sum(axis=0))
        part = np.concatenate(parts)  # (U,)
        self.sizes = tuple(p.size for p in parts)
        self.sum = part if self.sum is None else self.sum + part
        self.n += int(np.prod(trace[f"layer0.{self.gate}"].shape[:2]))

    def result(self, init_value: float) -> UnitTimescales | None:
        if self.gate is None or self.sum is None:
            return None
        return summarize_units(self.sum / self.n, self.gate, init_value, self.sizes)


class ClassStats:
    """The keep gate's mean over the units at every position, by the class of the input
    (characters: space, newline, other; tokens and bytes: ``TOKEN_CLASSES``)."""

    def __init__(self, spec: CellSpec, chars: list[str], unit: str = "characters") -> None:
        classify, self.classes = classing(unit)
        self.gate = spec.keep_gate
        self.label = np.array([classify(c) for c in chars])  # (V,)
        self.means: dict[str, list[np.ndarray]] = {c: [] for c in self.classes}
        self.positions = {c: 0 for c in self.classes}

    def update(self, trace: Trace, windows: Tensor) -> None:
        cls = self.label[windows.detach().cpu().numpy()]  # (B, T)
        for c in self.classes:
            self.positions[c] += int((cls == c).sum())
        if self.gate is None:
            return
        layers = by_layer(trace, self.gate)
        if len(layers) == 1:
            pos_mean = as_numpy64(layers[0]).mean(axis=-1)  # (B, T)
        else:  # the mean over every layer's units, summed a layer at a time
            pos_mean = sum(as_numpy64(y).sum(axis=-1) for y in layers) / sum(
                y.shape[-1] for y in layers)
        for c in self.classes:
            self.means[c].append(pos_mean[cls == c])

    def result(self) -> CharClasses:
        if self.gate is None:
            return CharClasses(None, {c: None for c in self.classes}, self.positions)
        means = {c: float(np.concatenate(v).mean()) if self.positions[c] else None
                 for c, v in self.means.items()}
        return CharClasses(self.gate, means, self.positions)
