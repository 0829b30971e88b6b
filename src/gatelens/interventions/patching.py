"""Activation patching and attribution patching over trace keys × positions
(``gatelens.patch_sweep``; docs/interventions.md, "Activation patching").

For each swept key (or group of keys patched together) and position t, the corrupted run
receives the clean run's value at t, carried forward (``Lens.run`` with a Set of the clean
value: the family's step with the value inside it at t, the module's kernel after it,
starting at t from the corrupted run's own state and output before it, which the sweep read
once), and the metric m is read from its output. The effect is reported
normalised, (m(patched) − m(corrupt)) / (m(clean) − m(corrupt)): 0 where patching changes
nothing, 1 where it restores the clean metric.

Attribution patching is the first-order estimate of the same change from one backward
pass: (a_clean − a_corrupt) · ∂m/∂a at the corrupted run, summed over the batch and the
edited units (a group: its keys' terms summed, each key differentiated with the others of
its step free), normalised the same way. The gradient is taken through the whole model:
a zero tensor that requires grad is added to each swept key at the swept positions, and
the families run their edited steps with autograd on (every family gatelens opens). A
family whose edited step gives no gradient is a one-line error (``attribution=False``
skips it).

>>> import torch, gatelens
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<...>
>>> net = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.GRU(4, 6, batch_first=True))
>>> class LM(torch.nn.Module):
...     def __init__(self):
...         super().__init__(); self.net, self.head = net, torch.nn.Linear(6, 5)
...     def forward(self, ids): return self.head(self.net(ids)[0])
>>> clean = torch.tensor([[1, 2, 3, 4, 0, 1]]); corrupt = torch.tensor([[1, 2, 0, 4, 0, 1]])
>>> res = gatelens.patch_sweep(gatelens.Lens(LM()), clean, corrupt, metric="kl")
>>> res.names, res.effect.shape
(['net.1.layer0.h'], (1, 6))
>>> [round(float(e), 4) + 0.0 for e in res.effect[0]]  # the one-layer GRU's h is its whole state
[0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from gatelens.errors import GatelensError
from gatelens.interventions.edits import Add, Set
from gatelens.interventions.metrics import Metric, metric_of, metric_value, spearman
from gatelens.interventions.run import run_edits
from gatelens.lens.device import on

if TYPE_CHECKING:
    from gatelens.lens.lens import Lens

__all__ = ["PatchResult", "patch_sweep", "state_keys"]

#: |m(clean) − m(corrupt)| at or below this × max(1, |m(clean)|, |m(corrupt)|): equal
#: within float32 rounding, the normalisation undefined
EQUAL = 1e-6


@dataclass
class PatchResult:
    """A sweep's figures. ``names``: the row labels (a group: its keys joined by " + "),
    ``positions``: the columns; ``effect`` (rows × columns) the normalised effect,
    ``patched`` the raw m of each patched run, ``m_clean`` and ``m_corrupt`` the two
    unpatched runs'; ``attribution`` the normalised attribution patching (None when not
    computed) and ``spearman`` its rank correlation with ``effect`` over every cell (None
    when undefined: a constant matrix)."""

    metric: str
    names: list[str]
    positions: list[int]
    effect: np.ndarray
    patched: np.ndarray
    m_clean: float
    m_corrupt: float
    attribution: np.ndarray | None = None
    spearman: float | None = None
    batch: int = 1
    length: int = 0

    def to_dict(self) -> dict:
        """The sweep as JSON-ready lists (what ``gatelens patch`` writes as patch.json)."""
        def rows(a: np.ndarray | None) -> list | None:
            return None if a is None else [[float(v) if np.isfinite(v) else None for v in r]
                                           for r in a]

        return {"metric": self.metric, "names": self.names, "positions": self.positions,
                "batch": self.batch, "length": self.length, "m_clean": self.m_clean,
                "m_corrupt": self.m_corrupt, "effect": rows(self.effect),
                "patched": rows(self.patched), "attribution": rows(self.attribution),
                "spearman": self.spearman}


def state_keys(lens: Lens) -> list[str]:
    """Every layer's carried state and hidden state h (the default rows of a sweep), in
    the model's order: an LSTM's c and h, a GRU's or RNN's h, sLSTM's c and h ..."""
    out = []
    for path, fam in lens.families.items():
        letters = {fam.spec.state, "h"}
        out += [f"{path}.{n}" if path else n for n in fam.names()
                if n.rpartition(".")[2] in letters]
    return out


def _ids(lens: Lens, x: Tensor | str, what: str) -> Tensor:
    """ids (B, T) int64 from ids or a text (the whole text: one window)."""
    if isinstance(x, str):
        from gatelens.analysis.text import Vocab
        from gatelens.lens.tokens import encode_text

        if lens.tokenizer is not None:
            return torch.tensor([encode_text(lens.tokenizer, x)], dtype=torch.long)
        if lens.vocab is None or isinstance(lens.vocab, int):
            raise GatelensError(f"{what}: a text needs the Lens's vocab (the model's "
                                "characters in index order); or give ids")
        if not x:
            raise GatelensError(f"{what}: the text is empty")
        return Vocab(list(lens.vocab)).encode(x, what).unsqueeze(0)
    if not isinstance(x, Tensor) or x.ndim != 2 or x.dtype != torch.long or 0 in x.shape:
        raise GatelensError(f"{what} must be ids (B, T) int64 or a text; got "
                            f"{getattr(x, 'dtype', type(x).__name__)} "
                            f"{tuple(getattr(x, 'shape', ()))}")
    return x


def _groups(lens: Lens, names: Sequence[str | Sequence[str]] | None) -> list[tuple[str, ...]]:
    from gatelens.interventions.run import _keys

    keys = _keys(lens)
    if names is None:
        return [(k,) for k in state_keys(lens)]
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        raise GatelensError(f"names must be a non-empty list of trace keys; got {names!r}")
    out = []
    for item in names:
        group = (item,) if isinstance(item, str) else tuple(item)
        for k in group:
            if not isinstance(k, str) or k not in keys:
                raise GatelensError(f"patch: no trace key {k!r}; the model's keys are "
                                    f"{', '.join(keys)}")
        if not group or len(set(group)) != len(group):
            raise GatelensError(f"patch: the group {list(group)} is empty or repeats a key")
        out.append(group)
    if len(set(out)) != len(out):
        raise GatelensError("patch: names repeat a key (or group)")
    return out


def _positions(positions: Sequence[int] | None, T: int) -> list[int]:
    if positions is None:
        return list(range(T))
    if isinstance(positions, int):
        positions = [positions]
    out = []
    for t in positions:
        if isinstance(t, bool) or not isinstance(t, int) or not -T <= t < T:
            raise GatelensError(f"patch: position {t!r} is outside the window of {T} "
                                f"positions (0..{T - 1})")
        out.append(t % T)
    if not out or len(set(out)) != len(out):
        raise GatelensError(f"patch: positions {list(positions)!r} are empty or repeat one")
    return sorted(out)


def _logits(output: object, what: str) -> Tensor:
    from gatelens.lens.lens import output_logits

    logits = output_logits(output)
    if logits is None or logits.ndim != 3:
        raise GatelensError(f"patch: the model's output on the {what} ids has no logits "
                            "(B, T, V) for the metric")
    return logits


def patch_sweep(lens: Lens, clean: Tensor | str, corrupt: Tensor | str,
                names: Sequence[str | Sequence[str]] | None = None,
                positions: Sequence[int] | None = None, metric: Metric | str = "kl", *,
                units: Sequence[int] | None = None, attribution: bool = True) -> PatchResult:
    """Activation patching of ``names`` × ``positions`` from ``clean`` into ``corrupt``.

    ``clean``, ``corrupt``: ids (B, T) int64 of the same shape, or two texts of the same
    length (with the Lens's vocab or tokenizer). ``names``: trace keys (``"rnn.layer0.c"``;
    a tuple of keys is one row, patched together); default ``state_keys(lens)``.
    ``positions``: window positions (default all). ``metric``: ``gatelens.logit_diff(a,
    b)``, ``gatelens.loss``, ``gatelens.kl`` (or "loss", "kl", "logit_diff:A,B").
    ``units``: the unit indices patched in every key (default all). ``attribution``: also
    the first-order estimate and its Spearman correlation with the real patching.
    Returns a ``PatchResult``; bad input is a one-line GatelensError.
    """
    metric = metric_of(metric)
    clean, corrupt = (on(_ids(lens, x, w), lens.device) for x, w in ((clean, "clean"),
                                                                   (corrupt, "corrupt")))
    if clean.shape != corrupt.shape:
        raise GatelensError(f"patch: clean ids {tuple(clean.shape)} and corrupt ids "
                            f"{tuple(corrupt.shape)} differ in shape; patching needs inputs "
                            "of equal length (and batch)")
    groups = _groups(lens, names)
    B, T = clean.shape
    pos = _positions(positions, T)
    base = run_edits(lens, clean, [])
    clean_logits = _logits(base.output, "clean")
    metric.check(int(clean_logits.shape[-1]), T)
    bad = run_edits(lens, corrupt, [])
    a_clean = {k: base.trace[k] for g in groups for k in g}
    a_corrupt = {k: bad.trace[k] for g in groups for k in g}
    if units is not None:
        from gatelens.interventions.resolve import check_units

        units = check_units(Set(groups[0][0], 0.0, at=0, units=units))
        W = min(a_clean[k].shape[-1] for k in a_clean)
        if max(units) >= W:
            raise GatelensError(f"patch: units {[u for u in units if u >= W]} are outside "
                                f"the {W} units of the narrowest swept key (0..{W - 1})")

    def m_of(output: object, what: str) -> float:
        return metric_value(metric, _logits(output, what), clean_logits, clean)

    m_clean, m_corrupt = m_of(base.output, "clean"), m_of(bad.output, "corrupt")
    if not np.isfinite([m_clean, m_corrupt]).all():
        raise GatelensError(f"patch: metric {metric.name} is {m_clean:.6g} on the clean run "
                            f"and {m_corrupt:.6g} on the corrupt one; both must be finite")
    span = m_clean - m_corrupt
    if abs(span) <= EQUAL * max(1.0, abs(m_clean), abs(m_corrupt)):
        raise GatelensError(f"patch: metric {metric.name} is {m_clean:.6g} on the clean run "
                            f"and {m_corrupt:.6g} on the corrupt one; equal, so the "
                            "normalised effect is undefined (choose another metric or inputs)")

    def value(k: str, t: int) -> Tensor:
        v = a_clean[k][:, t]
        return v if units is None else v[:, units]

    patched = np.empty((len(groups), len(pos)))
    for i, g in enumerate(groups):
        for j, t in enumerate(pos):
            edits = [Set(k, value(k, t), at=t, units=units) for k in g]
            patched[i, j] = m_of(run_edits(lens, corrupt, edits, trace=False,
                                           start=bad.trace).output, "patched")
    effect = (patched - m_corrupt) / span
    attr = rho = None
    if attribution:
        raw = _attribution(lens, corrupt, clean, clean_logits, metric, groups, pos, a_clean,
                           a_corrupt, units, bad.trace)
        attr = raw / span
        rho = spearman(effect, attr)
    return PatchResult(metric.name, [" + ".join(g) for g in groups], pos, effect, patched,
                       m_clean, m_corrupt, attr, rho, int(B), int(T))


def _attribution(lens: Lens, corrupt: Tensor, clean: Tensor, clean_logits: Tensor,
                 metric: Metric, groups: list[tuple[str, ...]], pos: list[int],
                 a_clean: dict[str, Tensor], a_corrupt: dict[str, Tensor],
                 units: list[int] | None, start: Any = None) -> np.ndarray:
    """(a_clean − a_corrupt) · ∂m/∂a at the corrupted run, per group and position, from one
    backward pass through the whole model (``start``: the corrupted run's trace, where the
    modules may start at the first swept position)."""
    from gatelens.interventions.run import _keys

    lo, hi = pos[0], pos[-1] + 1
    deltas = {}
    for k, a in a_corrupt.items():
        W = a.shape[-1] if units is None else len(units)
        deltas[k] = torch.zeros(a.shape[0], hi - lo, W, dtype=a.dtype, device=a.device,
                                requires_grad=True)
    edits = [Add(k, d, at=slice(lo, hi), units=units) for k, d in deltas.items()]
    res = run_edits(lens, corrupt, edits, trace=False, grad=True, start=start)
    m = metric(_logits(res.output, "corrupt"), clean_logits.detach(), clean)
    keys = _keys(lens)

    def refuse(k: str) -> GatelensError:
        fam = lens.families[keys[k][0]]
        return GatelensError(f"attribution patching: the {fam.name} family "
                             f"({type(fam.module).__name__}) gives no gradient through its "
                             f"edited steps ({k}); pass attribution=False (--no-attribution)")

    if not m.requires_grad:
        raise refuse(next(iter(deltas)))
    grads = torch.autograd.grad(m, list(deltas.values()), allow_unused=True)
    grad = dict(zip(deltas, grads, strict=True))
    for k, g in grad.items():
        if g is None:
            raise refuse(k)
    out = np.zeros((len(groups), len(pos)))
    cols = [t - lo for t in pos]
    for i, g in enumerate(groups):
        for k in g:
            diff = (a_clean[k] - a_corrupt[k])[:, pos]
            diff = diff if units is None else diff[..., units]  # (B, P, U)
            out[i] += (diff.double() * grad[k][:, cols].double()).sum((0, 2)).cpu().numpy()
    return out
