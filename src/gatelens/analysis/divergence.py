"""Divergence rate: the largest finite-time Lyapunov exponent λ of the recurrence.

docs/methods.md, "Divergence rate". The carried state s is every layer's state side by side,
layer by layer h then c (LSTM; GRU and RNN: h). One step s_{t−1} → s_t is the whole stack's
step: layer k > 0 reads layer k − 1's new h of the same step, so its Jacobian is the
stack's. A unit tangent v per window is pushed through each step's Jacobian with
``torch.func.jvp`` (forward mode, float64, the cell equations of equations.py), at the
trajectory the module itself took (``anchored.module_states``: PyTorch's own h and c, not
a re-run that may have parted from it):

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

import copy
import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from gatelens.analysis.common import finite_or_none
from gatelens.cells.equations import CellWeights, cell_weights, step
from gatelens.families.anchored import State, check_inputs, module_states
from gatelens.families.reference import faithful_matmul


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
    if getattr(module, "gatelens_modern", False):
        return _modern_rate(module, inputs, seed, burn_in, state)
    cell, h0, c0 = check_inputs(module, inputs, state)
    T = inputs.shape[1]
    if not isinstance(burn_in, int) or not 0 <= burn_in < T:
        raise ValueError(f"burn_in must be an int in [0, T) = [0, {T}); got {burn_in!r}")
    st = module_states(module, inputs, state)
    gen = torch.Generator().manual_seed(int(seed))
    D = 2 if module.bidirectional else 1
    L = module.num_layers
    x = inputs.detach().double()  # (B, T, F)
    rates = {}
    for d, direction in enumerate(("forward", "reverse")[:D]):
        sfx = ".reverse" if d else ""
        ws = [cell_weights(module, k, bool(d), dtype=torch.float64) for k in range(L)]
        traj, init = [], []
        for k in range(L):
            j = k * D + d
            traj.append(st[f"layer{k}{sfx}.h"].double())  # (B, T, H_out)
            init.append(h0[j].double())
            if cell == "lstm":
                traj.append(st[f"layer{k}{sfx}.c"].double())  # (B, T, H)
                init.append(c0[j].double())
        if D == 1:  # the whole stack's step: layer k reads layer k − 1's new h
            xs = [x]
        else:  # each layer's input fixed to the module's own lower-layer output
            xs = [x] + [torch.cat([st[f"layer{k}.h"], st[f"layer{k}.reverse.h"]], -1).double()
                        for k in range(L - 1)]  # (B, T, 2·H_out)
        order = range(T - 1, -1, -1) if d else range(T)
        rates[direction] = _rate(ws, xs, traj, init, list(order), burn_in, gen)
    worst = max(rates, key=lambda k: float(np.mean(rates[k])))
    per_window = rates[worst]
    sd = float(np.std(per_window, ddof=1)) if per_window.size > 1 else 0.0
    return DivergenceRate(float(np.mean(per_window)), sd, burn_in, per_window,
                          {k: float(np.mean(v)) for k, v in rates.items()} if D == 2 else {})


def _rate(ws: list[CellWeights], xs: list[Tensor], traj: list[Tensor], init: list[Tensor],
          order: list[int], burn_in: int, gen: torch.Generator) -> np.ndarray:
    """Per-window λ of one direction: ``traj`` holds the carried state's parts (B, T, ·) in
    layer order (h, then c for the LSTM); ``xs`` the input of layer 0 only (coupled stack)
    or of every layer (fixed)."""
    B = traj[0].shape[0]
    sizes = [t.shape[-1] for t in traj]
    dev = traj[0].device
    v = torch.randn(B, sum(sizes), generator=gen, dtype=torch.float64).to(dev)  # (B, S)
    v = list((v / v.norm(dim=-1, keepdim=True)).split(sizes, dim=-1))
    per = len(traj) // len(ws)  # parts per layer: 2 (h, c) or 1 (h)
    total = torch.zeros(B, dtype=torch.float64, device=dev)
    prev = list(init)  # the state each step reads, (B, ·) per part
    with warnings.catch_warnings(), faithful_matmul(dev):
        # PyTorch's forward-AD decompositions warn, when first loaded, that torch.jit is
        # deprecated: their own business, not the caller's.
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated",
                                category=DeprecationWarning)
        for j, t in enumerate(order):
            inp = [x[:, t] for x in xs]  # (B, F_k)

            def stack(*s: Tensor, inp: list[Tensor] = inp) -> tuple[Tensor, ...]:
                out: list[Tensor] = []
                below = inp[0]
                for k, w in enumerate(ws):
                    sig = step(w, inp[k] if len(inp) > 1 else below, *s[per * k : per * (k + 1)])
                    out += [sig["h"], sig["c"]] if per == 2 else [sig["h"]]
                    below = sig["h"]
                return tuple(out)

            _, v = torch.func.jvp(stack, tuple(prev), tuple(v))
            growth = torch.sqrt(sum((p * p).sum(dim=-1) for p in v))  # (B,)
            if j >= burn_in:
                total = total + torch.log(growth)
            v = [p / growth[:, None] for p in v]
            prev = [s[:, t] for s in traj]
    return (total / (len(order) - burn_in)).cpu().numpy()


def _modern_rate(module: nn.Module, inputs: Tensor, seed: int, burn_in: int,
                 state: State) -> DivergenceRate:
    """λ of a gatelens cell (modern.py) along its own float64 trajectory, on its
    ``stack_step`` state. Step 0 sets the state from the initial one; the sum runs over
    t ≥ max(1, burn_in), the unit start vector sits at t = 0."""
    T = inputs.shape[1]
    if not isinstance(burn_in, int) or not 0 <= burn_in < T:
        raise ValueError(f"burn_in must be an int in [0, T) = [0, {T}); got {burn_in!r}")
    m64 = copy.deepcopy(module).double().eval()
    x = inputs.detach().double()  # (B, T, F)
    st = None if state is None else (state.double() if isinstance(state, Tensor)
                                     else tuple(p.double() for p in state))
    traj = [p.detach() for p in m64.free_states(m64.trace(x, st))]  # (B, T, H) each
    gen = torch.Generator().manual_seed(int(seed))
    B, sizes = x.shape[0], [p.shape[-1] for p in traj]
    v = torch.randn(B, sum(sizes), generator=gen, dtype=torch.float64).to(x.device)  # (B, S)
    v = list((v / v.norm(dim=-1, keepdim=True)).split(sizes, dim=-1))
    total = torch.zeros(B, dtype=torch.float64, device=x.device)
    start = max(1, burn_in)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated",
                                category=DeprecationWarning)
        for t in range(1, T):
            prev = tuple(p[:, t - 1] for p in traj)
            _, v = torch.func.jvp(lambda *s, t=t: tuple(m64.stack_step(x[:, t], list(s))),
                                  prev, tuple(v))
            growth = torch.sqrt(sum((p * p).sum(dim=-1) for p in v))  # (B,)
            if t >= start:
                total = total + torch.log(growth)
            v = [p / growth[:, None] for p in v]
    per_window = (total / (T - start)).cpu().numpy()
    sd = float(np.std(per_window, ddof=1)) if per_window.size > 1 else 0.0
    return DivergenceRate(float(np.mean(per_window)), sd, burn_in, per_window)
