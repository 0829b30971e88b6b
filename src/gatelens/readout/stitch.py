"""Stitching: the calls a module received in one forward, grouped into trajectories.

A model that steps an nn.LSTMCell / nn.GRUCell / nn.RNNCell in a Python loop, or calls an
nn.LSTM / nn.GRU / nn.RNN once per output step (a greedy decoder), runs each of its
trajectories as many calls. A ``Stitcher`` is fed every call as the module's forward hook
sees it (input, state received, output) and groups them:

- a call **continues** the trajectory of the call just before it when the state it
  received is that call's output state: the same tensor objects, not modified in place
  since (their version counter unchanged), or else, as the fallback, equal values
  (``torch.equal`` on every part: a ``.clone()``, ``.detach()`` or ``.contiguous()`` of the
  state handed back still continues);
- any other call **starts a new trajectory**: the first call, a state of None (zeros: a
  reset), a state that is not the previous output (a fresh zeros tensor, a beam reorder
  by ``index_select``, another sequence), or a change of batch size.

A trajectory is one ``Recorded`` (families/stepped.py): the step inputs (B, T, F), the
state its first call was given (None: zeros), and every state its calls returned, which
is the reference the read-out is verified against. Inputs and returned states are copied
as the hook sees them, so a buffer the model reuses or edits in place afterwards cannot
change the recording. Only calls of one step are stitched (a cell call, or an
nn.LSTM/GRU/RNN call with T = 1, batched or unbatched).

>>> import torch
>>> from gatelens.families.registry import family_of
>>> cell = torch.nn.GRUCell(3, 4)
>>> st, x = Stitcher(family_of(cell)), torch.randn(2, 6, 3)
>>> h = None
>>> for t in range(6):
...     if t == 4:
...         h = None  # a reset mid-forward
...     h_in = h; h = cell(x[:, t], h_in); st.add(x[:, t], h_in, h)
>>> [(r.length, r.why) for r in st.result()]
[(4, 'the first call'), (2, 'call 4 was given no state (zeros: a reset)')]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gatelens.families.base import Family
from gatelens.families.stepped import Recorded, Step, stack_steps


def is_step_call(fam: Family, inputs: Any) -> bool:
    """Whether a call of ``fam``'s module is one step (the family says: every cell call,
    and an nn.LSTM/GRU/RNN call with one step, T = 1, batched or unbatched, not packed).

    >>> from gatelens.families.registry import family_of
    >>> fam = family_of(torch.nn.LSTM(3, 4, batch_first=True))
    >>> is_step_call(fam, torch.zeros(2, 1, 3)), is_step_call(fam, torch.zeros(2, 5, 3))
    (True, False)
    """
    return fam.step_call(inputs)


@dataclass
class _Open:
    """A trajectory being stitched."""

    first: int
    why: str
    state: tuple[Tensor, ...] | None  # copies of the state the first call was given
    xs: list[Tensor] = field(default_factory=list)  # (B, F) each
    steps: list[tuple[Tensor, ...]] = field(default_factory=list)  # (L, B, ·) parts each
    last: tuple[tuple[Tensor, int], ...] = ()  # the last output's objects and versions
    unbatched: bool = True


class Stitcher:
    """The calls of one module, fed in order (``add``), grouped into trajectories."""

    def __init__(self, fam: Family) -> None:
        self.fam = fam
        self.calls = 0
        self.open: list[_Open] = []

    def add(self, inputs: Tensor, state: Any, output: Any) -> None:
        """One call of one step: its input, the state it received, what it returned."""
        if not is_step_call(self.fam, inputs):
            raise ValueError(f"only calls of one step are stitched; got inputs of shape "
                             f"{tuple(getattr(inputs, 'shape', ()))}")
        n, self.calls = self.calls, self.calls + 1
        step = self.fam.step_of(inputs, state, output)
        why = self._why_new(n, step)
        if why is not None:
            self.open.append(_Open(n, why, None if step.given is None else
                                   tuple(p.detach().clone() for p in step.given)))
        tr = self.open[-1]
        tr.xs.append(step.x.detach().clone())
        tr.steps.append(tuple(p.detach().clone() for p in step.out))
        tr.last = tuple((p, p._version) for p in step.returned)
        tr.unbatched = tr.unbatched and step.unbatched

    def _why_new(self, n: int, step: Step) -> str | None:
        """Why call ``n`` starts a new trajectory, or None when it continues the last."""
        if not self.open:
            return "the first call"
        given, batch, raw = step.given, step.x.shape[0], step.received
        if given is None:
            return f"call {n} was given no state (zeros: a reset)"
        tr = self.open[-1]
        before = tr.xs[-1].shape[0]
        if batch != before:
            return f"the batch size changed at call {n} ({before} -> {batch})"
        if len(raw) == len(tr.last) and all(
                p is q and p._version == v for p, (q, v) in zip(raw, tr.last, strict=True)):
            return None  # the very tensors the last call returned, untouched
        prev = tr.steps[-1]
        if all(a.shape == b.shape and torch.equal(a, b)
               for a, b in zip(given, prev, strict=True)):
            return None  # equal values: the same trajectory to the cell
        return (f"call {n}'s state is not call {n - 1}'s output (a reset, a beam reorder or "
                "another sequence)")

    def result(self) -> list[Recorded]:
        """Every trajectory, in the order they started."""
        return [Recorded(torch.stack(tr.xs, dim=1), tr.state, stack_steps(tr.steps),
                         calls=len(tr.xs), first=tr.first, why=tr.why,
                         unbatched=tr.unbatched) for tr in self.open]
