"""Context used (Khandelwal et al. 2018, by truncation): how many characters a prediction needs.

docs/methods.md, "Context used". For each position t with d ≤ t ≤ T − 2 of a window, the
loss of predicting x_{t+1} from only the last d characters x_{t−d+1} … x_t (the model run
from its zero/default state on those alone) minus its loss with the whole window from
position 0; the mean over positions and windows is the excess loss at d, for d = 1, 2,
4, …, T/2. The effective context is the smallest d whose excess is at most 0.01 nats
(None: more than the largest d). Losses are cross-entropies in nats, float64.

``logits_of(ids (N, d)) -> (N, d, V)`` runs the whole model (embedding or one-hot, the
recurrent module, the head) from its default state. The contexts of one start share a run:
each start s is run once, to the longest context it begins (every d ≤ it is read at its
position d − 1), the runs of one length together, in calls of at most ``max_chars``
characters and ``MAX_LOGITS`` logits (``MAX_PADDED`` padded ones for a model that pads
each run to a chunk). A model whose head can skip positions gives only those read
(``logits_at``).

>>> import torch
>>> V = 5
>>> memoryless = torch.nn.Embedding(V, V)  # logits from the current character only
>>> ids = torch.randint(0, V, (3, 16), generator=torch.Generator().manual_seed(0))
>>> c = context_used(lambda i: memoryless(i), ids)
>>> c.lengths, [round(v, 12) for v in c.excess_loss], c.effective_context
([1, 2, 4, 8], [0.0, 0.0, 0.0, 0.0], 1)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gatelens.errors import GatelensError

LogitsOf = Callable[[Tensor], Tensor]
LogitsAt = Callable[[Tensor, list[int]], Tensor | None]
THRESHOLD = 0.01  # nats: "the prediction no longer needs more context"
MAX_CHARS = 1 << 18  # characters per call of logits_of (bounds the logits' memory)
MAX_LOGITS = 1 << 25  # logits per call: with a 50k-token vocabulary, ~670 tokens (128 MB)
#: padded units per call of a model that pads each run to its chunk (transformers' Mamba-2
#: pads to 256: one unit then costs ~150 kB at mamba2-130m's width; 256 one-unit runs took
#: 10.5 GB in one call, 4,096 units 1.2 GB above the rest at 24 layers)
MAX_PADDED = 1 << 11


#: numbers of one layer's state a call may hold per token × unit above which ``chars_per_call``
#: bounds a call: a sequential scan (transformers' Mamba on the CPU) forms a few (tokens,
#: d_inner, d_state) tensors a layer, 1.2 GB for 95 runs of 65 tokens at mamba-130m's width
STATE_PER_CALL = 1 << 25
WIDE = 4096  # units a layer from which a call is bounded by its state


def chars_per_call(units: int) -> int:
    """Units (characters, tokens) one call of the model may read, given the units of one
    layer's carried state: ``MAX_CHARS``, or for a layer of ``WIDE`` units and more
    ``STATE_PER_CALL`` of its state numbers (at least 256 units).

    >>> chars_per_call(325) == MAX_CHARS, chars_per_call(24_576)
    (True, 1365)
    """
    return MAX_CHARS if units < WIDE else max(256, STATE_PER_CALL // units)


def context_lengths(length: int) -> list[int]:
    """d = 1, 2, 4, … up to T/2 (each leaves a position d ≤ t ≤ T − 2).

    >>> context_lengths(128)[-1], context_lengths(5)
    (64, [1, 2])
    """
    out, d = [], 1
    while d <= length // 2 and d <= length - 2:
        out.append(d)
        d *= 2
    return out


@dataclass
class ContextUsed:
    """Excess loss of a truncated context, by context length d."""

    lengths: list[int]  # d
    excess_loss: list[float]  # nats, mean over positions and windows
    positions: list[int]  # positions averaged over at each d

    @property
    def effective_context(self) -> int | None:
        """The smallest d with excess ≤ 0.01 nats; None when no d reaches it."""
        return next((d for d, e in zip(self.lengths, self.excess_loss, strict=True)
                     if e <= THRESHOLD), None)

    def describe(self) -> str:
        """One sentence for report.md.

        >>> ContextUsed([1, 2, 4], [0.9, 0.2, 0.004], [10, 9, 7]).describe()[-62:]
        'of context: cut to 4, its excess loss is 0.004 nats (0.9 at 1)'
        >>> ContextUsed([1, 2], [0.9, 0.2], [10, 9]).describe()[-46:]
        'context: cut to 2, its excess loss is 0.2 nats'
        """
        eff, first, top = self.effective_context, self.excess_loss[0], self.lengths[-1]
        if eff is None:
            return (f"the prediction uses more than {top} characters of context: cut to "
                    f"{top}, its excess loss is {self.excess_loss[-1]:.3g} nats")
        e = self.excess_loss[self.lengths.index(eff)]
        return (f"the prediction uses {eff} character{'s' if eff > 1 else ''} of context: cut "
                f"to {eff}, its excess loss is {e:.3g} nats ({first:.3g} at 1)")

    def to_dict(self) -> dict:
        """report.json's "context" (DESIGN, report.json version 3)."""
        return {"lengths": list(self.lengths), "excess_loss": [float(v) for v in self.excess_loss],
                "effective_context": self.effective_context}


def _losses(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy in nats, float64, of logits (..., V) at targets (...)."""
    logp = torch.log_softmax(logits.detach().double(), dim=-1)
    return -logp.gather(-1, targets[..., None]).squeeze(-1)


def _logits(logits_of: LogitsOf, ids: Tensor) -> Tensor:
    with torch.no_grad():
        out = logits_of(ids)
    if not isinstance(out, Tensor) or out.ndim != 3 or tuple(out.shape[:2]) != tuple(ids.shape):
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise GatelensError(f"logits_of must return (N, d, V) logits for ids {tuple(ids.shape)}; "
                            f"got {got}")
    return out


class ContextAccumulator:
    """The truncation curve over windows that arrive in chunks of (B, T) ids.

    >>> import torch
    >>> m = torch.nn.Embedding(4, 4)
    >>> acc = ContextAccumulator(lambda i: m(i), length=12)
    >>> acc.update(torch.randint(0, 4, (2, 12))); acc.update(torch.randint(0, 4, (3, 12)))
    >>> acc.result().positions  # (T − 1 − d) positions a window, 5 windows
    [50, 45, 35]
    """

    def __init__(self, logits_of: LogitsOf, length: int, lengths: Sequence[int] | None = None,
                 max_chars: int = MAX_CHARS, logits_at: LogitsAt | None = None,
                 pad_to: int | None = None) -> None:
        self.lengths = list(lengths) if lengths is not None else context_lengths(length)
        bad = [d for d in self.lengths if not isinstance(d, int) or not 1 <= d <= length - 2]
        if not self.lengths or bad:
            raise GatelensError(f"context lengths must be ints in [1, T − 2 = {length - 2}]; "
                                f"got {self.lengths}")
        self.logits_of, self.length, self.max_chars = logits_of, length, max_chars
        #: (ids (N, d), positions) -> the logits at those positions only (N, P, V), for a
        #: model whose head can skip the others; None, or None returned: logits_of's
        self.logits_at = logits_at
        #: the length a model pads each run to a multiple of (a chunked scan's chunk): a
        #: call then holds at most MAX_PADDED padded tokens
        self.pad_to = pad_to
        self.sums = [0.0] * len(self.lengths)
        self.counts = [0] * len(self.lengths)

    def update(self, ids: Tensor) -> None:
        """Add the windows ``ids`` (B, T) int64.

        A truncated context of d units ending at t is a run from the zero state over
        x_{t−d+1} … x_t, so every d of one start s = t − d + 1 is read off ONE run from s,
        at its positions d − 1: each start is run once, to the largest d it needs (the
        positions and the figures are those of running each (t, d) alone)."""
        if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.shape[1] != self.length:
            got = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
            raise GatelensError(f"ids must be (B, {self.length}) windows; got {got}")
        B, T = ids.shape
        whole = _logits(self.logits_of, ids)
        full = _losses(whole[:, :-1], ids[:, 1:])  # (B, T − 1), at t
        V = int(whole.shape[-1])
        del whole
        ds = sorted(self.lengths)
        for g, top in enumerate(ds):
            # starts s whose longest context is ``top``: T − 1 − s in [top, the next d − 1]
            lo = 1 if g == len(ds) - 1 else T - ds[g + 1]
            hi = T - 1 - top  # inclusive
            if hi < lo:
                continue
            keep = ds[: g + 1]  # every d ≤ top is read off the same runs
            # x_s … x_{s+top}: the run, then the unit its longest context predicts
            seqs = ids.unfold(1, top + 1, 1)[:, lo : hi + 1].reshape(-1, top + 1)
            n = self._per_call(top, len(keep), V)
            cut = torch.cat([self._cut(seqs[a : a + n], keep)
                             for a in range(0, seqs.shape[0], n)])  # (B·S, P)
            cut = cut.reshape(B, hi - lo + 1, len(keep))
            starts = torch.arange(lo, hi + 1)
            for j, d in enumerate(keep):
                # the context of d units ending at t = s + d − 1, against the whole window's
                excess = cut[:, :, j] - full[:, starts + d - 1]
                i = self.lengths.index(d)
                self.sums[i] += float(excess.sum())
                self.counts[i] += int(excess.numel())

    def _per_call(self, top: int, read: int, vocab: int) -> int:
        """Runs of ``top`` units a call: within max_chars units (MAX_PADDED padded ones for a
        model that pads), and MAX_LOGITS logits of the positions read."""
        padded = top if not self.pad_to else -(-top // self.pad_to) * self.pad_to
        units = min(self.max_chars, MAX_PADDED) if self.pad_to else self.max_chars
        at = read if self.logits_at is not None else top
        return max(1, min(units // padded, MAX_LOGITS // (at * vocab)))

    def _cut(self, seqs: Tensor, keep: list[int]) -> Tensor:
        """The losses of the truncated contexts (N, P): ``seqs`` (N, top + 1) a run and the
        unit after it; the context of d units is the run's first d, its target the unit at
        position d."""
        runs, pos = seqs[:, :-1], [d - 1 for d in keep]
        logits = None
        if self.logits_at is not None:
            with torch.no_grad():
                logits = self.logits_at(runs, pos)
            if not (isinstance(logits, Tensor) and tuple(logits.shape[:2]) == (runs.shape[0],
                                                                                len(pos))):
                self.logits_at, logits = None, None  # the model did not give them
        if logits is None:
            logits = _logits(self.logits_of, runs)[:, pos]  # (N, P, V)
        return _losses(logits, seqs[:, keep])  # (N, P)

    def result(self) -> ContextUsed:
        if not any(self.counts):
            raise GatelensError("no windows were measured")
        return ContextUsed(self.lengths, [s / n for s, n in zip(self.sums, self.counts,
                                                                 strict=True)], self.counts)


def context_used(logits_of: LogitsOf, ids: Tensor, lengths: Sequence[int] | None = None,
                 max_chars: int = MAX_CHARS) -> ContextUsed:
    """The truncation curve of the model ``logits_of`` on the windows ``ids`` (B, T)."""
    if not isinstance(ids, Tensor) or ids.ndim != 2:
        raise GatelensError(f"ids must be (B, T) windows; got "
                            f"{tuple(ids.shape) if isinstance(ids, Tensor) else ids!r}")
    acc = ContextAccumulator(logits_of, int(ids.shape[1]), lengths, max_chars)
    acc.update(ids)
    return acc.result()
