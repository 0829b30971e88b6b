"""Every per-token state from the module's own whole-sequence forward, at the cost of one
forward (issue 27: "trace of every per-token state ≤ 1.2× the forward").

A selective scan is linear in its state, s_t = a_t ⊙ s_{t−1} + b_t, with a_t and b_t
computed from the layer's input alone (Mamba-1's exp(Δ A) and Δ B x, Mamba-2's per-head
decay). Stepping the module one token at a time through its cache (its decode path) shows
every state but costs T calls of Python per layer. Instead, the module runs its own
whole-sequence forward once, with forward hooks on the submodules that compute a_t and b_t
(the mixer's projections); a_t and b_t are formed from what they returned with the
package's own operations, in its own layout, and the recurrence is replayed with the
package's own element-wise operations in its order (one multiply, then one add), so:

- where the package scans sequentially (transformers' Mamba-1 on the CPU) the states are the
  ones its scan held, bit for bit (tested: its output and its final cache, exactly);
- where it computes the prompt in parallel or in chunks (mambapy's pscan, Mamba-2's SSD), the
  per-token states never exist in its computation; the replay is its step path's
  arithmetic (the recurrence its decode step applies), on the inputs its forward computed,
  and how far the forward's output lies from the replay's is reported
  (``step_vs_forward``), as METHODS asks for chunked paths.

Where the package's own loop holds every state (transformers' Mamba-1 on the CPU), nothing
needs replaying: ``SequentialScanStates`` is active during the mixer's forward (a
TorchFunctionMode, families/records.py's ``Recorder(steps=...)``) and copies each state its
loop hands its read-out, and the keep, as the loop forms them.

>>> a = torch.full((3, 2), 0.5)  # (T, N)
>>> b = torch.ones(3, 2)
>>> linear_scan(a, b)[:, 0].tolist()  # s = 1, 1.5, 1.75
[1.0, 1.5, 1.75]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from gatelens.families.buffers import state_empty

__all__ = ["SequentialScanStates", "linear_scan"]


class SequentialScanStates(TorchFunctionMode):
    """While active, keeps what a sequential selective scan formed (transformers' Mamba-1
    ``mamba_selective_scan``, its loop): the keep exp(Δ A), the 4-dimensional result of
    ``torch.exp`` ((B, D, T, N)), copied time-major as ``keep`` (B, T, D, N), and each state
    s_t its loop hands its read-out (the first operand of each ``torch.matmul`` whose first
    operand has 3 dimensions, (B, D, N)), copied as it comes into ``states`` (B, T, D, N).
    The package's own tensors are not held, so they are freed, and their memory reused, as in
    its own run. ``scan()`` gives (states, keep) where exactly T states of that shape and the
    keep's dtype came, else None (the caller replays instead). Nothing the package computes
    is changed.

    >>> cap = SequentialScanStates()
    >>> with cap:
    ...     a = torch.exp(torch.zeros(1, 2, 1, 3))
    ...     _ = torch.matmul(torch.ones(1, 2, 3), torch.ones(1, 3, 1))
    >>> [tuple(t.shape) for t in cap.scan()]
    [(1, 1, 2, 3), (1, 1, 2, 3)]
    """

    def __init__(self, keep: bool = True) -> None:
        super().__init__()
        self.states: Tensor | None = None
        self.keep: Tensor | None = None
        self.wants_keep = keep  # False: the keep's shape only (a trace that skips it)
        self.like: Tensor | None = None  # (B, T, D, N): the keep's shape, dtype, device
        self.count = 0
        self.fits = True

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.matmul and isinstance(args[0], Tensor) and args[0].dim() == 3:
            self._state(args[0])
        elif func is torch.exp and isinstance(out, Tensor) and out.dim() == 4:
            keep = out.detach().transpose(1, 2)  # no graph: a read-out
            self.like = keep.new_empty(()).expand(keep.shape)  # its shape, one number held
            self.keep = state_empty(keep.shape, keep.dtype, keep.device).copy_(keep) \
                if self.wants_keep else None
            self.states, self.count = None, 0
        return out

    def _state(self, s: Tensor) -> None:
        like = self.like
        if like is None or s.shape != (like.shape[0], like.shape[2], like.shape[3]) or \
                s.dtype != like.dtype or self.count >= like.shape[1]:
            self.fits = False
            return
        if self.states is None:
            self.states = state_empty(like.shape, like.dtype, like.device)
        self.states[:, self.count].copy_(s.detach())
        self.count += 1

    def scan(self) -> tuple[Tensor, Tensor | None] | None:
        """(s, keep), (B, T, D, N) each (keep None where it was not kept), where the scan
        handed over one state of the keep's shape and dtype for each of its T steps, and
        nothing else; else None."""
        if not self.fits or self.like is None or self.states is None or \
                self.count != self.like.shape[1]:
            return None
        return self.states, self.keep


@torch.no_grad()
def linear_scan(a: Tensor, b: Tensor, overwrite: bool = False) -> Tensor:
    """s_t = a_t ⊙ s_{t−1} + b_t along dim 0 from s_{−1} = 0: (T, ...) each -> (T, ...).

    Each step is one multiply and one add, as the packages compute it (never fused, so
    every element is rounded exactly as in their loop whatever the memory layout); the
    first step multiplies the zero state too, so a non-finite a_0 gives what theirs gives.
    ``a`` and ``b`` are made contiguous along time (their slices are then contiguous,
    which is what makes the loop fast). A read-out: no gradient flows through it.
    The states are written over a copy of ``b`` (b_t + a_t ⊙ s_{t−1} rounds as
    a_t ⊙ s_{t−1} + b_t does, bit for bit); with ``overwrite`` over ``b`` itself (made
    contiguous), which the caller no longer needs, so no second (T, ...) tensor is made (a
    layer of 24 Mamba-2 heads of 64 × 128 is 200 MB a window in float64)."""
    a, s = a.contiguous(), b
    if not (overwrite and b.is_contiguous()):  # b is the caller's: the states go in a copy
        s = state_empty(b.shape, b.dtype, b.device).copy_(b)
    step = torch.empty_like(s[0])
    torch.mul(a[0], torch.zeros_like(s[0]), out=step)
    s[0].add_(step)
    for t in range(1, a.shape[0]):
        torch.mul(a[t], s[t - 1], out=step)
        s[t].add_(step)
    return s
