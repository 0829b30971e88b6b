"""Divergence rate: the largest finite-time Lyapunov exponent λ of the recurrence.

docs/methods.md, "Divergence rate". The recurrence is the module family's ``Dynamics``: the
carried state s is every layer's state side by side, layer by layer (LSTM h then c; GRU and
RNN h; gatelens's cells their own coordinates), and one step s_{t−1} → s_t is the whole
stack's step (layer k > 0 reads layer k − 1's new h of the same step), so its Jacobian is
the stack's. A unit tangent v per window is pushed through each step's Jacobian with
``torch.func.jvp`` (forward mode, float64), at the trajectory the module itself took
(PyTorch's own h and c, not a re-run that may have parted from it):

    v_t = J_t v_{t−1};  growth_t = ‖v_t‖;  v_t ← v_t / growth_t
    λ = mean over windows of (1 / (T − t0)) Σ_{t ≥ t0} ln growth_t     (t0 = burn_in)

with each window's start vector drawn with a torch.Generator seeded by ``seed``.
λ < 0: contracting, a difference halves every ln 0.5 / λ characters; λ > 0: chaotic.

Bidirectional modules: the reverse direction reads the future, so no single causal
recurrence carries both. Each direction is measured on its own, in its own time order
(reverse: t = T − 1 … 0), with every layer's input fixed to the module's own lower-layer
output (both directions), so its carried state is that direction's layers; the larger λ
is reported and both are kept in ``per_direction``.

>>> import torch
>>> rnn = torch.nn.RNN(2, 3, nonlinearity="relu", batch_first=True).double()
>>> with torch.no_grad():
...     _ = rnn.weight_hh_l0.copy_(0.5 * torch.eye(3)); _ = rnn.bias_ih_l0.fill_(1.0)
...     _ = rnn.weight_ih_l0.zero_()
>>> d = divergence_rate(rnn, torch.rand(4, 40, 2, dtype=torch.float64), burn_in=8)
>>> round(d.lyapunov_per_char, 9), d.regime, round(d.halving_chars, 9)
(-0.693147181, 'contracting', 1.0)
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from gatelens.analysis.common import finite_or_none
from gatelens.cells.numerics import faithful_matmul
from gatelens.families.base import Dynamics
from gatelens.families.registry import open_family
from gatelens.families.torch_rnn import TorchRNNFamily

State = Tensor | tuple[Tensor, ...] | None


@dataclass
class DivergenceRate:
    """λ in nats per character, its spread over windows, and every window's own λ."""

    lyapunov_per_char: float  # mean over windows (of the direction with the larger λ)
    sd_over_windows: float  # sample sd (n − 1) over windows; 0 with one window
    burn_in: int  # t0: steps left out before the sum starts
    per_window: np.ndarray = field(repr=False)  # (B,) float64
    per_direction: dict[str, float] = field(default_factory=dict)  # bidirectional only

    @property
    def regime(self) -> str:
        """"contracting" (λ < 0) or "chaotic" (λ ≥ 0)."""
        return "contracting" if self.lyapunov_per_char < 0 else "chaotic"

    @property
    def halving_chars(self) -> float:
        """ln 0.5 / λ: characters for a difference to halve (inf when λ ≥ 0)."""
        lam = self.lyapunov_per_char
        return math.log(0.5) / lam if lam < 0 else math.inf

    @property
    def doubling_chars(self) -> float:
        """ln 2 / λ: characters for a difference to double (inf when λ ≤ 0)."""
        lam = self.lyapunov_per_char
        return math.log(2.0) / lam if lam > 0 else math.inf

    def describe(self) -> str:
        """One English sentence.

        >>> DivergenceRate(-0.25, 0.01, 16, np.zeros(2)).describe()
        'contracting: a difference halves every 2.77 characters (λ = -0.25 nats per character)'
        >>> DivergenceRate(0.5, 0.01, 16, np.zeros(2)).describe()
        'chaotic: nearby texts part like e^{0.5t} (doubling every 1.39 characters)'
        """
        lam = self.lyapunov_per_char
        if self.regime == "contracting":
            return (f"contracting: a difference halves every {self.halving_chars:.3g} "
                    f"characters (λ = {lam:.3g} nats per character)")
        return (f"chaotic: nearby texts part like e^{{{lam:.3g}t}} "
                f"(doubling every {self.doubling_chars:.3g} characters)")

    def to_dict(self) -> dict:
        """report.json's "divergence_rate"."""
        return {"lyapunov_per_char": finite_or_none(self.lyapunov_per_char),
                "sd_over_windows": finite_or_none(self.sd_over_windows),
                "burn_in": self.burn_in, "regime": self.regime}


def divergence_rate(module: nn.Module, inputs: Tensor, seed: int = 0, burn_in: int = 16,
                    state: State = None) -> DivergenceRate:
    """λ of ``module`` on the windows ``inputs`` (B, T, F), batch first whatever the module's
    ``batch_first``, from ``state`` (zeros if None).

    >>> d = divergence_rate(torch.nn.LSTM(3, 8), torch.randn(2, 24, 3), burn_in=4)
    >>> d.regime, d.per_window.shape, sorted(d.to_dict())
    ('contracting', (2,), ['burn_in', 'lyapunov_per_char', 'regime', 'sd_over_windows'])
    """
    fam = open_family(module, "divergence_rate()")
    x = inputs if getattr(module, "batch_first", True) or not isinstance(
        fam, TorchRNNFamily) else inputs.transpose(0, 1)
    call = fam.check(x, state)
    with torch.no_grad(), faithful_matmul(call.inputs.device):
        ref = fam.reference(call)
    return rate_of(fam.dynamics(call, ref), seed=seed, burn_in=burn_in)


def start_vectors(dynamics: list[Dynamics], windows: int, seed: int = 0) -> list[Tensor]:
    """Each direction's start vectors for ``windows`` windows, (windows, S) float64, drawn in
    direction order with one generator seeded by ``seed`` (before normalisation). Drawn once
    for all windows, so a chunk of windows gets the same vectors as the whole batch."""
    gen = torch.Generator().manual_seed(int(seed))
    return [torch.randn(windows, d.size, generator=gen, dtype=torch.float64) for d in dynamics]


def rate_of(dynamics: list[Dynamics], seed: int = 0, burn_in: int = 16,
            start: list[Tensor] | None = None) -> DivergenceRate:
    """λ of each causal direction (``Family.dynamics``); the larger is reported. ``start``:
    the directions' start vectors (``start_vectors``), drawn from ``seed`` when None."""
    T = dynamics[0].inputs.shape[1]
    if not isinstance(burn_in, int) or isinstance(burn_in, bool) or not 0 <= burn_in < T:
        raise ValueError(f"burn_in must be an int in [0, T) = [0, {T}); got {burn_in!r}")
    B = dynamics[0].trajectory[0].shape[0]
    start = start_vectors(dynamics, B, seed) if start is None else start
    return summarize_rates(window_rates(dynamics, burn_in, start), burn_in)


def summarize_rates(rates: dict[str, np.ndarray], burn_in: int) -> DivergenceRate:
    """Per-window λ of each direction (``rates``) as a DivergenceRate: the larger direction's
    mean and spread; every direction's mean when there are two."""
    worst = max(rates, key=lambda k: float(np.mean(rates[k])))
    per_window = rates[worst]
    sd = float(np.std(per_window, ddof=1)) if per_window.size > 1 else 0.0
    return DivergenceRate(float(np.mean(per_window)), sd, burn_in, per_window,
                          {k: float(np.mean(v)) for k, v in rates.items()}
                          if len(rates) > 1 else {})


def window_rates(dynamics: list[Dynamics], burn_in: int,
                 start: list[Tensor]) -> dict[str, np.ndarray]:
    """Per-window λ of each direction, (B,) each (chunks concatenate)."""
    return {d.name: _rate(d, burn_in, v) for d, v in zip(dynamics, start, strict=True)}


def _rate(dyn: Dynamics, burn_in: int, start: Tensor) -> np.ndarray:
    """Per-window λ of one direction: a unit tangent pushed through each step's Jacobian
    (``torch.func.jvp`` of ``dyn.step``), renormalised every step, ln growth summed over the
    window's steps from ``burn_in`` on."""
    B = dyn.trajectory[0].shape[0]
    sizes = [t.shape[-1] for t in dyn.trajectory]
    dev = dyn.trajectory[0].device
    v = start.to(dev)  # (B, S)
    v = v / v.norm(dim=-1, keepdim=True)
    total = torch.zeros(B, dtype=torch.float64, device=dev)
    counted = 0
    with warnings.catch_warnings(), torch.no_grad(), faithful_matmul(dev):
        # PyTorch's forward-AD decompositions warn, when first loaded, that torch.jit is
        # deprecated: their own business, not the caller's.
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated",
                                category=DeprecationWarning)
        logs = None if dyn.sweep is None else dyn.sweep(v)  # the whole window at once
        if logs is not None:
            first = max(0, burn_in - dyn.offset)
            return (logs[:, first:].sum(dim=1) / (len(dyn.order) - first)).cpu().numpy()
        v = list(v.split(sizes, dim=-1))
        for j, t in enumerate(dyn.order):
            x_t = dyn.inputs[:, t]  # (B, F)
            _, v = torch.func.jvp(lambda *s, x_t=x_t: tuple(dyn.step(x_t, list(s))),
                                  tuple(dyn.previous(j)), tuple(v))
            growth = torch.sqrt(sum((p * p).sum(dim=-1) for p in v))  # (B,)
            if j + dyn.offset >= burn_in:
                total = total + torch.log(growth)
                counted += 1
            v = [p / growth[:, None] for p in v]
    return (total / counted).cpu().numpy()
