"""Slow modes: the directions of the state that hold a change for 10 characters or more.

docs/methods.md, "Lyapunov spectrum and slow modes". Exponent i's timescale is
t½ = ln 0.5 / λ_i (λ_i ≥ 0: infinite, counted as slow); a slow mode has t½ ≥ 10
characters, i.e. λ_i ≥ ln 0.5 / 10. Its Lyapunov vector's pooled unit loadings v_u²
(LSTM: v_h,u² + v_c,u²) give the participation ratio PR = (Σ_u v_u²)² / Σ_u v_u⁴ (1: one
unit; N: spread evenly over N; per window, then averaged) and the units it loads on most
(the 5 largest mean loadings). This asks the seed's question by direction: no unit holds a
long memory; does any direction?

>>> modes = slow_modes(np.array([0.0, -0.05, -0.2]), np.array([2.0, 1.0, 1.0]),
...                    np.array([[0.5, 0.5, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0]]), hidden=2)
>>> [(m.index, round(m.half_life, 6), m.top_units[:2]) for m in modes]
[(0, inf, [(0, 0), (0, 1)]), (1, 13.862944, [(1, 1), (0, 0)])]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gatelens.analysis.common import finite_or_none

SLOW_HALF_LIFE = 10.0  # characters
SLOW_EXPONENT = math.log(0.5) / SLOW_HALF_LIFE  # −0.0693: exponents at or above it are slow
TOP_UNITS = 5


def exponent_half_life(lam: float) -> float:
    """ln 0.5 / λ characters for λ < 0; infinite for λ ≥ 0.

    >>> exponent_half_life(math.log(0.5)), exponent_half_life(0.0)
    (1.0, inf)
    """
    return math.log(0.5) / lam if lam < 0 else math.inf


@dataclass
class SlowMode:
    """One slow exponent and the units its Lyapunov vector loads on."""

    index: int  # i − 1: its place in the spectrum (0 is λ_1)
    exponent: float  # nats per character
    participation_ratio: float  # 1 … units, mean over windows
    top_units: list[tuple[int, int]]  # [(layer, unit)] by mean loading, largest first
    loadings: np.ndarray = field(repr=False)  # (units,) mean pooled v_u² over windows

    @property
    def half_life(self) -> float:
        """ln 0.5 / λ in characters (inf for λ ≥ 0)."""
        return exponent_half_life(self.exponent)

    def to_dict(self) -> dict:
        """One entry of report.json's "lyapunov" "slow_modes" (half_life null: infinite)."""
        return {"exponent": float(self.exponent), "half_life": finite_or_none(self.half_life),
                "participation_ratio": float(self.participation_ratio),
                "top_units": [[int(a), int(b)] for a, b in self.top_units]}


def slow_modes(exponents: np.ndarray, participation: np.ndarray, loadings: np.ndarray,
               hidden: int) -> list[SlowMode]:
    """The slow modes of a spectrum: ``exponents`` (k,), the vectors' ``participation``
    ratios (k,) and mean pooled ``loadings`` (k, units); units name [u // hidden, u % hidden]."""
    out = []
    for i, lam in enumerate(exponents):
        if not lam >= SLOW_EXPONENT:  # NaN and −inf are not slow
            continue
        w = np.asarray(loadings[i], dtype=np.float64)
        top = np.argsort(-w, kind="stable")[:TOP_UNITS]
        out.append(SlowMode(i, float(lam), float(participation[i]),
                            [(int(u) // hidden, int(u) % hidden) for u in top], w))
    return out


def _spread(pr: float, units: int) -> str:
    if pr < 1.5:
        return "on about one unit"
    return f"spread over about {pr:.3g} of the {units} units"


def describe_slow(modes: list[SlowMode], exponents: np.ndarray, size: int) -> str:
    """The report.md sentence: whether any direction of the state holds a long memory.

    >>> describe_slow([], np.array([-0.3, -0.9]), 8)[-79:]
    'of the 2 computed exponents, λ_1 = -0.3, halves a difference in 2.31 characters'
    """
    k = len(exponents)
    if not modes:
        lam = float(exponents[0])
        return (f"no direction of the state holds a change for 10 characters: the slowest "
                f"of the {k} computed exponents, λ_1 = {lam:.3g}, halves a difference in "
                f"{exponent_half_life(lam):.3g} characters")
    units = len(modes[0].loadings)
    n = len(modes)
    at_least = "at least " if n == k and k < size else ""
    first = modes[0]
    slowest = ("does not decay (λ_1 ≥ 0)" if math.isinf(first.half_life)
               else f"has a half-life of {first.half_life:.3g} characters")
    prs = [m.participation_ratio for m in modes]
    return (f"{at_least}{n} direction{'s' if n > 1 else ''} of the state "
            f"hold{'s' if n == 1 else ''} a change for 10 characters or more (of the {k} "
            f"computed exponents); the slowest (λ_1 = {first.exponent:.3g}) {slowest} and "
            f"loads {_spread(first.participation_ratio, units)}; the slow modes' participation "
            f"ratios run from {min(prs):.3g} to {max(prs):.3g}")
