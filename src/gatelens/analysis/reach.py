"""Output-level reach: how long a changed character still moves the prediction.

docs/methods.md, "Output-level reach". With p_t and p'_t the softmax of the clean and the
perturbed run's next-character logits at position t (one character changed at position
p), KL(k) = mean over windows of KL(p_{p+k} ‖ p'_{p+k}) in nats, computed in float64
from log_softmax. Reported at the lags k with p + k < T, and at every lag 0 … T − 1 − p
in ``curve`` for plots. Half-life from lag 1 to the largest reported lag K, to the letter:

    t½ = K · ln 0.5 / ln(KL(K) / KL(1))     (None when KL(1) = 0; inf when the ratio ≥ 1)

The state curves (perturbation.py) say what the model holds of the changed character;
this one says what it still uses to predict.

>>> import torch, math
>>> clean = torch.zeros(1, 3, 2)  # uniform predictions at every position
>>> pert = clean.clone(); pert[0, 1:] = torch.tensor([0.0, math.log(3.0)])  # p' = (1/4, 3/4)
>>> r = output_reach(clean, pert, position=1, lags=(1,))
>>> r.lags, [round(v, 6) for v in r.kl], round(0.5 * math.log(4 / 3), 6)
([1], [0.143841], 0.143841)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from gatelens.analysis.common import finite_or_none
from gatelens.analysis.perturbation import LAGS, report_lags
from gatelens.analysis.units import half_life as retention_half_life


def kl_per_position(logits_clean: Tensor, logits_perturbed: Tensor) -> Tensor:
    """KL(p_t ‖ p'_t) of every window and position, float64 nats, (B, T).

    Terms with p = 0 count 0; the few −1e-17 that rounding leaves are clamped to 0 (KL ≥ 0).

    >>> kl_per_position(torch.zeros(2, 3, 4), torch.randn(2, 3, 4)).shape
    torch.Size([2, 3])
    """
    logp = torch.log_softmax(logits_clean.detach().double(), dim=-1)  # (B, T, V)
    logq = torch.log_softmax(logits_perturbed.detach().double(), dim=-1)  # (B, T, V)
    p = logp.exp()
    terms = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))  # (B, T, V)
    return terms.sum(dim=-1).clamp(min=0.0)


@dataclass
class OutputReach:
    """KL between the clean and perturbed predictions, by lag after the changed character."""

    position: int  # p: where the character was changed
    n: int  # windows averaged over
    lags: list[int]  # reported lags, p + k < T
    kl: list[float]  # KL(k) at those lags, nats
    curve: np.ndarray = field(repr=False)  # (T − p,) KL at every lag 0 … T − 1 − p

    def __post_init__(self) -> None:
        if not self.lags:
            raise ValueError(f"no lag k with p + k < T at position {self.position}")
        if len(self.kl) != len(self.lags):
            raise ValueError(f"kl has {len(self.kl)} values for {len(self.lags)} lags")

    @property
    def max_lag(self) -> int:
        """K, the largest reported lag."""
        return self.lags[-1]

    @property
    def ratio(self) -> float | None:
        """KL(K) / KL(1); None when KL(1) = 0 (or lag 1 lies past the window)."""
        if self.curve.shape[0] < 2 or self.curve[1] == 0:
            return None
        return float(self.curve[self.max_lag] / self.curve[1])

    @property
    def half_life(self) -> float | None:
        """K · ln 0.5 / ln(KL(K) / KL(1)) characters; None when KL(1) = 0, inf when it grows.

        >>> OutputReach(0, 1, [1, 2], [1.0, 0.5], np.array([2.0, 1.0, 0.5])).half_life
        2.0
        """
        r = self.ratio
        return None if r is None else self.max_lag * retention_half_life(r)

    @property
    def grows(self) -> bool:
        """True when KL(K) ≥ KL(1) > 0: the change matters as much or more later on."""
        return self.ratio is not None and self.ratio >= 1.0

    def describe(self) -> str:
        """One English sentence.

        >>> OutputReach(0, 1, [1, 2], [1.0, 0.5], np.array([2.0, 1.0, 0.5])).describe()
        'the prediction forgets the changed character with a half-life of 2 characters'
        """
        if self.ratio is None:
            return "the changed character does not reach the prediction one character later"
        if self.grows:
            return (f"the changed character's effect on the prediction grows from lag 1 to "
                    f"lag {self.max_lag} (no half-life)")
        return (f"the prediction forgets the changed character with a half-life of "
                f"{self.half_life:.3g} characters")

    def to_dict(self) -> dict:
        """report.json's "output_reach": lags, KL at them, half-life (null: none or grows)."""
        return {"lags": list(self.lags), "kl": [float(v) for v in self.kl],
                "half_life": finite_or_none(self.half_life)}


def output_reach(logits_clean: Tensor, logits_perturbed: Tensor, position: int,
                 lags: tuple[int, ...] = LAGS) -> OutputReach:
    """KL(k) of the perturbed run's predictions from the clean run's, (B, T, V) each.

    >>> clean = torch.randn(4, 40, 5)
    >>> r = output_reach(clean, clean.clone(), position=32)
    >>> r.lags, r.kl[0], r.to_dict()["half_life"], r.curve.shape
    ([1, 2, 4], 0.0, None, (8,))
    """
    for name, t in (("logits_clean", logits_clean), ("logits_perturbed", logits_perturbed)):
        if not isinstance(t, Tensor) or t.ndim != 3 or 0 in t.shape:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a non-empty (B, T, V) tensor; got {got}")
    if logits_clean.shape != logits_perturbed.shape:
        raise ValueError(f"logits differ in shape: {tuple(logits_clean.shape)} vs "
                         f"{tuple(logits_perturbed.shape)}")
    B, T, _ = logits_clean.shape
    if not isinstance(position, int) or not 0 <= position < T:
        raise ValueError(f"position must be an int in [0, {T}); got {position!r}")
    if any(not isinstance(k, int) or k < 1 for k in lags):
        raise ValueError(f"lags must be positive ints; got {lags!r}")
    kl = kl_per_position(logits_clean, logits_perturbed)[:, position:]  # (B, T − p)
    return reach_from_rows([kl], position, T, lags)


def reach_from_rows(rows: list[Tensor], position: int, length: int,
                    lags: tuple[int, ...] = LAGS) -> OutputReach:
    """The reach from per-window KL rows (n, T − p) of one or more chunks of windows.

    >>> r = reach_from_rows([torch.ones(2, 3), torch.zeros(2, 3)], position=1, length=4)
    >>> r.n, r.kl
    (4, [0.5, 0.5])
    """
    ks = report_lags(position, length, tuple(sorted(lags)))
    kl = torch.cat(rows)  # (B, T − p)
    curve = kl.mean(dim=0).cpu().numpy()  # (T − p,)
    return OutputReach(position=position, n=int(kl.shape[0]), lags=ks,
                       kl=[float(curve[k]) for k in ks], curve=curve)
