"""Small tensor helpers the PyTorch families share (differences, the state each step reads)."""

from __future__ import annotations

import torch
from torch import Tensor


def max_diff(a: Tensor, b: Tensor, scaled: bool = False) -> float:
    """max |a − b| in float64, or with ``scaled`` max |a − b| / max(1, |b|); 0 when empty.

    >>> max_diff(torch.tensor([30.0]), torch.tensor([30.0003]), scaled=True) < 1e-5
    True
    """
    if not a.numel():
        return 0.0
    diff = (a.double() - b.double()).abs()
    if scaled:
        diff = diff / b.double().abs().clamp(min=1.0)
    return float(diff.max())


def previous(seq: Tensor, init: Tensor, reverse: bool) -> Tensor:
    """The state each step reads, (B, T, ·): init, then the step before in processing order."""
    init = init.unsqueeze(1)  # (B, 1, ·)
    if reverse:
        return torch.cat([seq[:, 1:], init], dim=1)
    return torch.cat([init, seq[:, :-1]], dim=1)
