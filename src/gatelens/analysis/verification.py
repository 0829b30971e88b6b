"""Verification: the hand-run cells against PyTorch's own output (METHODS.md).

Wraps :func:`gatelens.verify.verify` and reduces its per-layer figures to the two numbers
report.json keeps: the max |h_hand − h_torch| and |c_hand − c_torch| over every window,
position, unit and layer (c is None for GRU and RNN).

>>> Verification(max_abs_diff_h=6.85e-07, max_abs_diff_c=None).passed
True
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor, nn

from ..verify import VERIFY_TOL, passes, verify

TOLERANCE = VERIFY_TOL  # above this the read-out is wrong (METHODS.md)


def _max(x) -> float | None:
    """The largest of a figure that may be a number, a sequence, a dict or a tensor.

    >>> _max([1e-7, 3e-7]), _max({"layer0": 2e-8}), _max(None)
    (3e-07, 2e-08, None)
    """
    if x is None:
        return None
    if isinstance(x, Tensor):
        return float(x.max()) if x.numel() else None
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, Iterable) and not isinstance(x, str):
        vals = [v for v in (_max(e) for e in x) if v is not None]
        return max(vals) if vals else None
    return float(x)


@dataclass
class Verification:
    """Max read-out differences from PyTorch; ``max_abs_diff_c`` None without a cell state."""

    max_abs_diff_h: float
    max_abs_diff_c: float | None
    tolerance: float = TOLERANCE
    max_scaled_diff_c: float | None = None  # max |Δc| / max(1, |c|): what c is judged by

    def __post_init__(self) -> None:
        for v in (self.max_abs_diff_h, self.max_abs_diff_c, self.max_scaled_diff_c):
            if v is not None and not v >= 0:
                raise ValueError(f"a difference must be non-negative, got {v}")

    @property
    def passed(self) -> bool:
        """h within the tolerance; c within it scaled by max(1, |c|) (see gatelens.verify).
        Without a scaled figure, the absolute c difference is judged."""
        c = self.max_scaled_diff_c if self.max_scaled_diff_c is not None else self.max_abs_diff_c
        return passes(self.max_abs_diff_h, c, self.tolerance)

    def to_dict(self) -> dict:
        """report.json's "verification" (plus the scaled c figure, tolerance and passed)."""
        return {"max_abs_diff_h": self.max_abs_diff_h, "max_abs_diff_c": self.max_abs_diff_c,
                "max_scaled_diff_c": self.max_scaled_diff_c, "tolerance": self.tolerance,
                "passed": self.passed}


def from_verify_result(result) -> Verification:
    """Reduce a :func:`gatelens.verify.verify` result (or its ``to_dict()``) to the maxima."""
    d = result if isinstance(result, dict) else result.to_dict() if hasattr(
        result, "to_dict") else vars(result)
    h = _max(d.get("max_abs_diff_h"))
    if h is None:
        raise ValueError(f"verify() gave no max_abs_diff_h: {d}")
    return Verification(h, _max(d.get("max_abs_diff_c")),
                        max_scaled_diff_c=_max(d.get("max_scaled_diff_c")))


def verification(module: nn.Module, inputs: Tensor, trace=None) -> Verification:
    """Compare the opened cells (``trace``, computed if None) with PyTorch on ``inputs``.

    >>> import torch
    >>> v = verification(torch.nn.LSTM(3, 4, batch_first=True), torch.randn(2, 5, 3))
    >>> v.passed, v.max_abs_diff_c is not None
    (True, True)
    """
    return from_verify_result(verify(module, inputs, trace=trace))
