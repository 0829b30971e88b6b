"""What an activation-patching sweep measures (docs/interventions.md, "Activation
patching"): a metric m of a run's logits, and the Spearman rank correlation that says how
well attribution patching ranks the cells like the real patching.

A metric is computed in float64 from the run's logits (B, T, V), the clean run's logits
and the clean ids, averaged over the B sequences:

- ``logit_diff(a, b)``: logit of token a − logit of token b at the last position;
- ``loss``: the next-token cross-entropy against the CLEAN text (positions 0 … T − 2
  predict the clean tokens 1 … T − 1);
- ``kl``: KL(p_clean ‖ p_run) of the next-token distributions at the last position.

>>> import torch
>>> logits = torch.tensor([[[0.0, 2.0, 1.0]]])  # B = 1, T = 1, V = 3
>>> logit_diff(1, 2)(logits, logits, torch.zeros(1, 1, dtype=torch.long)).item()
1.0
>>> round(kl(logits, logits, torch.zeros(1, 1, dtype=torch.long)).item(), 12)
0.0
>>> spearman([1, 2, 3, 4], [10, 30, 20, 40])
0.8
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gatelens.errors import GatelensError

__all__ = ["Metric", "kl", "logit_diff", "loss", "metric_of", "metric_value", "spearman"]


@dataclass(frozen=True)
class Metric:
    """m(logits, clean_logits, clean_ids) -> a 0-d float64 tensor (differentiable in
    ``logits``). ``name`` is how reports and the command line spell it; ``check(V, T)``
    refuses a metric the model's vocabulary or the window cannot take."""

    name: str
    fn: Callable[[Tensor, Tensor, Tensor], Tensor]
    tokens: tuple[int, ...] = ()
    min_length: int = 1

    def __call__(self, logits: Tensor, clean_logits: Tensor, clean_ids: Tensor) -> Tensor:
        return self.fn(logits.double(), clean_logits.double(), clean_ids)

    def check(self, V: int, T: int) -> None:
        """One-line GatelensError when a token is outside the V logits or T is too short."""
        bad = [a for a in self.tokens if not 0 <= a < V]
        if bad:
            raise GatelensError(f"metric {self.name}: token {bad[0]} is outside the model's "
                                f"{V} logits (0..{V - 1})")
        if T < self.min_length:
            raise GatelensError(f"metric {self.name}: needs windows of at least "
                                f"{self.min_length} positions; got {T}")


def logit_diff(a: int, b: int) -> Metric:
    """The logit of token ``a`` minus that of token ``b`` at the last position."""
    for x in (a, b):
        if isinstance(x, bool) or not isinstance(x, int):
            raise GatelensError(f"logit_diff takes two token ids (ints); got {x!r}")
    if a == b:
        raise GatelensError(f"logit_diff({a}, {b}): the two tokens are the same; the "
                            "difference is 0 on every run")

    def fn(logits: Tensor, clean: Tensor, ids: Tensor) -> Tensor:
        return (logits[:, -1, a] - logits[:, -1, b]).mean()

    return Metric(f"logit_diff({a}, {b})", fn, (a, b))


def _loss(logits: Tensor, clean: Tensor, ids: Tensor) -> Tensor:
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))


def _kl(logits: Tensor, clean: Tensor, ids: Tensor) -> Tensor:
    p = F.log_softmax(clean[:, -1], dim=-1)
    q = F.log_softmax(logits[:, -1], dim=-1)
    return (p.exp() * (p - q)).sum(-1).mean()


#: the clean next-token loss (nats per position)
loss = Metric("loss", _loss, min_length=2)
#: KL(p_clean ‖ p_run) at the last position (nats)
kl = Metric("kl", _kl)


def metric_of(metric: Metric | str) -> Metric:
    """A Metric, or its name: ``"loss"``, ``"kl"``, ``"logit_diff:A,B"`` (token ids)."""
    if isinstance(metric, Metric):
        return metric
    if metric == "loss":
        return loss
    if metric == "kl":
        return kl
    if isinstance(metric, str) and metric.startswith("logit_diff:"):
        parts = metric.split(":", 1)[1].split(",")
        try:
            a, b = (int(p) for p in parts)
        except ValueError:
            raise GatelensError(f"metric {metric!r}: logit_diff:A,B takes two token ids") from None
        return logit_diff(a, b)
    raise GatelensError(f"metric must be gatelens.logit_diff(a, b), 'loss', 'kl' or "
                        f"'logit_diff:A,B'; got {metric!r}")


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1 … n, ties given the mean of the ranks they span."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=np.float64)
    xs = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float | None:
    """Spearman's rank correlation of x and y: Pearson's of their ranks (ties averaged).
    None when it is undefined: fewer than 2 values, a non-finite value, or one side
    constant."""
    x = np.asarray(x, dtype=np.float64).ravel()
    y = np.asarray(y, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"spearman: {x.shape} and {y.shape} values")
    if len(x) < 2 or not (np.isfinite(x).all() and np.isfinite(y).all()):
        return None
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float((rx * rx).sum()) * float((ry * ry).sum()))
    if den == 0:
        return None
    return float((rx * ry).sum() / den)


def metric_value(metric: Metric, logits: Tensor, clean_logits: Tensor, clean_ids: Tensor
                 ) -> float:
    """m as a float, no gradient."""
    with torch.no_grad():
        return float(metric(logits, clean_logits, clean_ids))
