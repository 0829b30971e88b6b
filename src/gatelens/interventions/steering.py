"""Steering (docs/methods.md "Interventions"): a vector v, times a scale α, added to a
carried state at position t (an ``Add`` edit, carried forward), and the contrastive vector
v = mean of the state at the last position over texts A − the same over texts B.

Reported: KL(p_clean ‖ p_steered) of the next-unit distributions from unit t + 1 on (the
model's outputs at positions t, t + 1, …: the state after step t is what position t's
output reads), mean over windows, and the units whose probability rises and falls most at
unit t + 1.

>>> import torch, gatelens
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> net = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.LSTM(4, 6, batch_first=True))
>>> lens = gatelens.Lens(net, vocab="abcde")
>>> ids = torch.randint(0, 5, (2, 8))
>>> v = contrastive_vector(lens, ids[:1], ids[1:], "1.layer0.c")
>>> tuple(v.shape)
(6,)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gatelens.analysis.reach import kl_per_position
from gatelens.errors import GatelensError
from gatelens.interventions.edits import Add

if TYPE_CHECKING:
    from gatelens.lens.lens import Lens

__all__ = ["Steering", "contrastive_vector", "steer"]


@dataclass
class Steering:
    """What ``steer`` measured.

    ``kl[k]``: mean over windows of KL(p ‖ p') of the distribution of unit t + 1 + k (the
    output at position t + k), nats, k = 0 … T − 1 − t. ``rise`` / ``fall``: the units whose
    mean probability of being unit t + 1 rises / falls most, as (id, text or None, change
    of probability) rows, largest change first."""

    name: str
    at: int
    scale: float
    kl: list[float]
    rise: list[tuple[int, str | None, float]]
    fall: list[tuple[int, str | None, float]]

    def to_dict(self) -> dict:
        rows = lambda r: [{"id": i, "text": s, "change": d} for i, s, d in r]  # noqa: E731
        return {"name": self.name, "at": self.at, "scale": self.scale, "kl": list(self.kl),
                "rise": rows(self.rise), "fall": rows(self.fall)}


def _texts(lens: Lens, ids: list[int]) -> list[str | None]:
    """Each id as text, where the Lens has a vocabulary of characters or a tokenizer."""
    if lens.tokenizer is not None:
        from gatelens.lens.tokens import piece

        return [piece(lens.tokenizer, i) for i in ids]
    vocab = lens.vocab
    if vocab is None or isinstance(vocab, int):
        return [None] * len(ids)
    return [vocab[i] if i < len(vocab) else None for i in ids]


def _logits(lens: Lens, res, ids: Tensor, where: str) -> Tensor:
    from gatelens.lens.lens import output_logits

    out = output_logits(res.output)
    if out is None or out.ndim != 3 or tuple(out.shape[:2]) != tuple(ids.shape):
        raise GatelensError(f"{where}: {type(lens.model).__name__}'s output is not next-unit "
                            f"logits (B, T, V) on ids {tuple(ids.shape)}")
    return out


def _width(res, name: str, where: str) -> int:
    """The width of trace key ``name`` (its last axis) in a run's trace."""
    keys = list(res.trace)
    if not isinstance(name, str) or name not in keys:
        raise GatelensError(f"{where}: no trace key {name!r}; the model's keys are "
                            f"{', '.join(keys)}")
    return int(res.trace[name].shape[-1])


def steer(lens: Lens, ids: Tensor, name: str, vector: Tensor, at: int,
          scale: float = 1.0, top: int = 5) -> Steering:
    """Add ``scale · vector`` (U,) to trace key ``name`` (a carried state: ``"rnn.layer0.c"``)
    at position ``at`` of every window of ids (B, T), carried forward; see ``Steering``."""
    where = f"steer({name!r})"
    if not isinstance(ids, Tensor):
        raise GatelensError(f"{where}: ids must be a (B, T) int64 tensor; got "
                            f"{type(ids).__name__}")
    ids = lens.windows(ids, 1, 1)[0]
    T = int(ids.shape[1])
    if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at < T:
        raise GatelensError(f"{where}: at must be a position in 0..{T - 1}; got {at!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise GatelensError(f"{where}: scale must be a number; got {type(scale).__name__}")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise GatelensError(f"{where}: top must be a positive int; got {top!r}")
    plain = lens.run(ids)
    U = _width(plain, name, where)
    if not isinstance(vector, Tensor) or tuple(vector.shape) != (U,) \
            or not vector.is_floating_point():
        got = (f"{vector.dtype} {tuple(vector.shape)}" if isinstance(vector, Tensor)
               else type(vector).__name__)
        raise GatelensError(f"{where}: vector must be a float tensor of shape ({U},), the "
                            f"width of {name}; got {got}")
    if not bool(torch.isfinite(vector).all()):
        raise GatelensError(f"{where}: vector holds a NaN or infinity")
    clean = _logits(lens, plain, ids, where)
    res = lens.run(ids, edits=[Add(name, float(scale) * vector.detach().double(), at=at)])
    steered = _logits(lens, res, ids, where)
    kl = kl_per_position(clean, steered)[:, at:].mean(dim=0)  # (T − t,)
    p, q = (torch.softmax(x[:, at].double(), dim=-1).mean(dim=0) for x in (clean, steered))
    change = q - p  # (V,)
    k = min(top, int(change.shape[0]))
    rows = []
    for order in (torch.argsort(change, descending=True), torch.argsort(change)):
        pick = [int(i) for i in order[:k]]
        rows.append(list(zip(pick, _texts(lens, pick), [float(change[i]) for i in pick],
                             strict=True)))
    return Steering(name, at, float(scale), [float(x) for x in kl], rows[0], rows[1])


def _batches(texts: Tensor | Sequence[Tensor], what: str) -> list[Tensor]:
    """Texts as (n, T_j) int64 batches: one (B, T) tensor, or a list of (T,) or (n, T)."""
    if isinstance(texts, Tensor):
        texts = [texts]
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence) or not texts:
        raise GatelensError(f"contrastive_vector: {what} must be ids (B, T) or a non-empty "
                            f"list of id tensors; got {type(texts).__name__}")
    out = []
    for j, t in enumerate(texts):
        if not isinstance(t, Tensor) or t.dtype != torch.long or t.ndim not in (1, 2) \
                or 0 in t.shape:
            raise GatelensError(f"contrastive_vector: {what}[{j}] must be a non-empty int64 "
                                f"tensor (T,) or (n, T); got "
                                f"{getattr(t, 'dtype', type(t).__name__)} "
                                f"{tuple(getattr(t, 'shape', ()))}")
        out.append(t.view(1, -1) if t.ndim == 1 else t)
    return out


def _last_mean(lens: Lens, texts: Tensor | Sequence[Tensor], name: str, what: str) -> Tensor:
    """The mean over texts of ``name`` at each text's last position, float64 (U,)."""
    total, n = None, 0
    for batch in _batches(texts, what):
        trace = lens.run(batch).trace
        if name not in list(trace):
            raise GatelensError(f"contrastive_vector: no trace key {name!r}; the model's keys "
                                f"are {', '.join(trace)}")
        last = trace[name][:, -1].double().sum(dim=0)  # (U,)
        total, n = (last if total is None else total + last), n + batch.shape[0]
    return total / n


def contrastive_vector(lens: Lens, texts_a: Tensor | Sequence[Tensor],
                       texts_b: Tensor | Sequence[Tensor], name: str) -> Tensor:
    """v = mean of trace key ``name`` at the last position over texts A − the same over
    texts B, float32 (U,). Texts are ids: one (B, T) tensor, or a list of (T,) / (n, T)
    tensors of any lengths (each text's own last position)."""
    a, b = (_last_mean(lens, t, name, w) for t, w in ((texts_a, "texts_a"),
                                                        (texts_b, "texts_b")))
    if a.shape != b.shape:
        raise GatelensError(f"contrastive_vector: {name} has widths {tuple(a.shape)} and "
                            f"{tuple(b.shape)} on the two sets")
    return (a - b).float()
