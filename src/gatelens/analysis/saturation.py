"""Gate saturation (Karpathy, Johnson & Fei-Fei 2015): how often each unit's gate is shut or open.

docs/methods.md, "Gate saturation". For every gate that lives in (0, 1) (the cell's
gates whose CellSpec bounds are the sigmoid's, and its keep gate: LSTM i, f, o; GRU r, z;
minGRU z, keep; minLSTM f, i, keep; sLSTM i, f, o, κ), per unit (layers pooled, as
everywhere): the fraction of positions where it is below 0.1 (left-saturated) and above
0.9 (right-saturated). A unit whose keep gate is right-saturated in strictly more than
half of the positions is an integrator; ``keep_right_majority`` counts them.

Counts are summed chunk by chunk (``SaturationAccumulator``), so streaming gives the
one-shot fractions exactly.

>>> import torch
>>> from gatelens.readout.trace_types import Trace
>>> f = torch.tensor([[[0.05, 0.95], [0.5, 0.99], [0.95, 0.2]]])  # (B, T, H) = (1, 3, 2)
>>> tr = Trace("gru", 1, False, {"layer0.r": f, "layer0.z": f})
>>> s = gate_saturation(tr)
>>> s.gates, s.left["z"].tolist(), s.right["z"].round(3).tolist(), s.keep_right_majority
(['r', 'z'], [0.3333333333333333, 0.0], [0.333, 0.667], 1)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gatelens.analysis.common import by_layer
from gatelens.errors import GatelensError
from gatelens.families.registry import cell_spec
from gatelens.families.spec import SIGMOID, CellSpec
from gatelens.readout.trace_types import Trace

LEFT, RIGHT = 0.1, 0.9


def saturating_gates(spec: CellSpec) -> list[str]:
    """The gates in (0, 1) of a cell, in its gate order, with its keep gate.

    >>> saturating_gates(cell_spec("lstm")), saturating_gates(cell_spec("slstm"))
    (['i', 'f', 'o'], ['i', 'f', 'o', 'kappa'])
    """
    out = [g for g in spec.gates if spec.bounds.get(g) == SIGMOID]
    if spec.keep_gate is not None and spec.keep_gate not in out:
        out.append(spec.keep_gate)
    return out


@dataclass
class GateSaturation:
    """Per unit and gate, the left (< 0.1) and right (> 0.9) saturation fractions."""

    gates: list[str]
    left: dict[str, np.ndarray] = field(repr=False)  # gate -> (units,) fractions
    right: dict[str, np.ndarray] = field(repr=False)
    positions: int  # B·T positions counted per unit
    keep_gate: str | None

    @property
    def keep_right_majority(self) -> int | None:
        """Units whose keep gate is above 0.9 in strictly more than half the positions."""
        if self.keep_gate is None:
            return None
        return int((self.right[self.keep_gate] > 0.5).sum())

    def describe(self) -> str:
        """One sentence for report.md.

        >>> GateSaturation(["f"], {"f": np.array([0.0, 0.1])}, {"f": np.array([0.7, 0.2])},
        ...                10, "f").describe()
        '1 of 2 units keep their keep gate f above 0.9 most of the time (integrators)'
        """
        n = self.keep_right_majority
        if n is None:
            return "the cell has no keep gate"
        units = len(self.right[self.keep_gate])
        verb = "keeps its" if n == 1 and units == 1 else "keep their"
        return (f"{n} of {units} units {verb} keep gate {self.keep_gate} above 0.9 most of "
                f"the time (integrators)")

    def to_dict(self) -> dict:
        """report.json's "saturation" (DESIGN, report.json version 3)."""
        out: dict = {g: {"left": [float(v) for v in self.left[g]],
                         "right": [float(v) for v in self.right[g]]} for g in self.gates}
        out["keep_right_majority"] = self.keep_right_majority
        return out


class SaturationAccumulator:
    """Saturation counts over traces of chunks of windows (same model, same cell).

    >>> import torch
    >>> from gatelens.readout.trace_types import Trace
    >>> acc = SaturationAccumulator()
    >>> for v in (0.95, 0.5):
    ...     acc.update(Trace("gru", 1, False, {"layer0.r": torch.full((2, 3, 1), v),
    ...                                        "layer0.z": torch.full((2, 3, 1), v)}))
    >>> acc.result().right["z"].tolist(), acc.result().keep_right_majority
    ([0.5], 0)
    """

    def __init__(self) -> None:
        self.spec: CellSpec | None = None
        self.left: dict[str, torch.Tensor] = {}
        self.right: dict[str, torch.Tensor] = {}
        self.positions = 0

    def update(self, trace: Trace) -> None:
        spec = cell_spec(trace.cell)
        if self.spec is None:
            self.spec = spec
        elif spec.name != self.spec.name:
            raise GatelensError(f"saturation: a {spec.name} trace after {self.spec.name} ones")
        for g in saturating_gates(spec):
            layers = [y.detach() for y in by_layer(trace, g)]  # (B, T, H_k) each
            lo = torch.cat([(y < LEFT).sum(dim=(0, 1)).cpu().to(torch.int64)
                            for y in layers])  # (L·H,)
            hi = torch.cat([(y > RIGHT).sum(dim=(0, 1)).cpu().to(torch.int64) for y in layers])
            self.left[g] = self.left.get(g, 0) + lo
            self.right[g] = self.right.get(g, 0) + hi
        B, T = next(iter(trace.values())).shape[:2]
        self.positions += B * T

    def result(self) -> GateSaturation:
        if self.spec is None:
            raise GatelensError("no traces were measured")
        gates = saturating_gates(self.spec)
        n = max(self.positions, 1)
        return GateSaturation(gates, {g: self.left[g].double().numpy() / n for g in gates},
                              {g: self.right[g].double().numpy() / n for g in gates},
                              self.positions, self.spec.keep_gate)


def gate_saturation(trace: Trace) -> GateSaturation:
    """Saturation fractions of one trace (every window at once)."""
    acc = SaturationAccumulator()
    acc.update(trace)
    return acc.result()
