"""The linear recurrence h_t = a_t ⊙ h_{t−1} + b_t of minGRU and minLSTM, two ways.

``scan_sequential`` is the reference: one step at a time, exactly the cell's equation.
``scan`` computes the same sequence in parallel over time: the steps compose
associatively, (a₁, b₁) then (a₂, b₂) = (a₂a₁, a₂b₁ + b₂), so ⌈log₂ T⌉ rounds of a
Hillis–Steele scan, each one vectorised over all t, give every h_t. With b'_0 = a_0 h_0 + b_0
the initial state folds into the first step. It works on a and b themselves, not in log
space: products of keep gates may underflow to 0 (which they then are), and nothing
cancels, so float32 stays within a few ulps of the sequential step (a log-space scan
loses about 1e-5 over 128 steps: |log ∏ a| grows with T and e^x magnifies its rounding).

>>> import torch
>>> a = torch.rand(2, 50, 3, dtype=torch.float64)
>>> b, h0 = torch.randn(2, 50, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
>>> bool((scan(a, b, h0) - scan_sequential(a, b, h0)).abs().max() < 1e-12)
True
"""

from __future__ import annotations

import torch
from torch import Tensor


def scan_sequential(a: Tensor, b: Tensor, h0: Tensor) -> Tensor:
    """h_t = a_t ⊙ h_{t−1} + b_t, one step at a time: a, b (B, T, H), h0 (B, H) -> (B, T, H).

    >>> scan_sequential(torch.full((1, 3, 1), 0.5), torch.ones(1, 3, 1), torch.zeros(1, 1))
    tensor([[[1.0000],
             [1.5000],
             [1.7500]]])
    """
    h, out = h0, []
    for a_t, b_t in zip(a.unbind(1), b.unbind(1), strict=True):  # one backward per input
        h = a_t * h + b_t  # (B, H)
        out.append(h)
    return torch.stack(out, dim=1)  # (B, T, H)


def scan(a: Tensor, b: Tensor, h0: Tensor) -> Tensor:
    """h_t = a_t ⊙ h_{t−1} + b_t in ⌈log₂ T⌉ parallel rounds (differentiable).

    >>> scan(torch.full((1, 3, 1), 0.5), torch.ones(1, 3, 1), torch.zeros(1, 1))
    tensor([[[1.0000],
             [1.5000],
             [1.7500]]])
    """
    b = torch.cat([a[:, :1] * h0[:, None] + b[:, :1], b[:, 1:]], dim=1)  # (B, T, H)
    T, d = a.shape[1], 1
    while d < T:
        # after this round, (a_t, b_t) composes the steps t − 2d + 1 … t
        b = torch.cat([b[:, :d], a[:, d:] * b[:, :-d] + b[:, d:]], dim=1)  # (B, T, H)
        a = torch.cat([a[:, :d], a[:, d:] * a[:, :-d]], dim=1)  # (B, T, H)
        d *= 2
    return b  # (B, T, H): h_t
