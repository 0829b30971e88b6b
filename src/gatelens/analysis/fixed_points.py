"""Fixed points of a recurrence under a held input, their stability and slowest timescale.

docs/methods.md, "Fixed points". For a constant input x* (each of the n most frequent
characters of the analysis windows held, and the zero input, labelled "zero"), the states
with F(s*, x*) = s*: from starting states drawn from the analysis trajectory, in float64,
F(s) − s = 0 is solved by Anderson-accelerated iteration (a multisecant quasi-Newton
method, one forward a step, batched over the starts; ``analysis.roots``), and q(s) =
½ ‖F(s, x*) − s‖² is minimised by L-BFGS for the starts it leaves above 1e-12 (trained
LSTMs' slow c directions make q too flat for L-BFGS alone: hundreds of steps where
Anderson takes ~100). Those with q < 1e-12 are kept, polished by Newton steps
s ← s − (J − I)⁻¹ (F(s) − s) until a step is below 1e-10, and merged when closer than
1e-6. At each point the eigenvalues μ of J = ∂F/∂s: stable when max |μ| < 1, and its
slowest half-life ln 0.5 / ln max |μ| (stable points; unstable ones report max |μ|).

Works on any step F(x, [s_i]) -> [s_i'] (a family's ``Dynamics.step``: LSTM h and c
together, GRU, RNN, gatelens's cells). ``fixed_points`` is the generic search;
``dynamics_fixed_points`` draws the starts from a Dynamics' trajectory.

>>> import torch
>>> step = lambda x, s: [torch.tanh(2.0 * s[0]) + x]  # 1 unit: 0 and ±0.9575
>>> fp = fixed_points(step, torch.linspace(-1, 1, 9, dtype=torch.float64)[:, None],
...                   {"zero": torch.zeros(1, dtype=torch.float64)})
>>> [(round(float(p.state[0]), 4), p.stable) for p in fp.inputs[0].points]
[(-0.9575, True), (0.0, False), (0.9575, True)]
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from gatelens.analysis.common import finite_or_none
from gatelens.analysis.roots import anderson, jacobians, lbfgs, merge, newton
from gatelens.errors import GatelensError
from gatelens.families.base import Dynamics

Step = Callable[[Tensor, Sequence[Tensor]], list[Tensor]]
Q_TOL, MERGE_TOL = 1e-12, 1e-6
STARTS = 256  # starting states per held input
HELD = 5  # the most frequent characters held (besides the zero input)


@dataclass
class FixedPoint:
    """One fixed point s* under a held input."""

    state: np.ndarray = field(repr=False)  # (S,) the carried state's parts side by side
    q: float  # ½ ‖F(s*) − s*‖²
    eigenvalues: np.ndarray = field(repr=False)  # (S,) complex, of ∂F/∂s at s*

    @property
    def max_abs_eig(self) -> float:
        return float(np.abs(self.eigenvalues).max())

    @property
    def stable(self) -> bool:
        return self.max_abs_eig < 1.0

    @property
    def slowest_half_life(self) -> float | None:
        """ln 0.5 / ln max |μ| characters (a stable point; 0 when J = 0), else None."""
        m = self.max_abs_eig
        if not m < 1.0:
            return None
        return 0.0 if m == 0 else math.log(0.5) / math.log(m)

    def to_dict(self, state: bool = False) -> dict:
        d = {"q": float(self.q), "stable": self.stable, "max_abs_eig": self.max_abs_eig,
             "slowest_half_life": finite_or_none(self.slowest_half_life)}
        if state:
            d["state"] = [float(v) for v in self.state]
        return d


@dataclass
class HeldInput:
    """The fixed points found under one held input."""

    input: str  # the character held, or "zero"
    points: list[FixedPoint]
    starts: int  # starting states tried
    converged: int  # of them, those that reached q < 1e-12

    def to_dict(self, state: bool = False) -> dict:
        return {"input": self.input, "points": [p.to_dict(state) for p in self.points]}


@dataclass
class FixedPoints:
    """Every held input's fixed points (report.json's "fixed_points")."""

    inputs: list[HeldInput]

    def to_dict(self, state: bool = False) -> dict:
        """report.json's "fixed_points"; ``state=True`` adds each point's coordinates."""
        return {"inputs": [h.to_dict(state) for h in self.inputs]}

    def describe(self) -> str:
        """One sentence for report.md.

        >>> p = FixedPoint(np.zeros(2), 0.0, np.array([0.5, 0.1]))
        >>> FixedPoints([HeldInput("zero", [p], 8, 8)]).describe()
        'under the zero input: 1 fixed point, 1 stable (slowest half-life 1 characters)'
        """
        parts = []
        for h in self.inputs:
            stable = [p for p in h.points if p.stable]
            n = len(h.points)
            s = f"{n} fixed point{'s' if n != 1 else ''}, {len(stable)} stable"
            if stable:
                slowest = max(p.slowest_half_life for p in stable)
                s += f" (slowest half-life {slowest:.3g} characters)"
            name = "the zero input" if h.input == "zero" else f"{h.input!r} held"
            parts.append(f"under {name}: {s}")
        return "; ".join(parts)


def _flat(step: Step, x: Tensor, sizes: list[int]) -> Callable[[Tensor], Tensor]:
    """F(s) on flat states (N, S), the input x (F,) held."""
    def F(s: Tensor) -> Tensor:
        return torch.cat(step(x.expand(s.shape[0], -1), list(s.split(sizes, dim=-1))), dim=-1)
    return F


def fixed_points(step: Step, states: Tensor, inputs: Mapping[str, Tensor],
                 sizes: Sequence[int] | None = None, max_iter: int = 300) -> FixedPoints:
    """The fixed points of ``step`` under each held input of ``inputs`` (label -> x (F,)),
    searched from the starting states ``states`` (N, S) (``sizes``: the state's parts,
    default one part)."""
    if not isinstance(states, Tensor) or states.ndim != 2 or 0 in states.shape:
        raise GatelensError(f"starting states must be a non-empty (N, S) tensor; got "
                            f"{tuple(states.shape) if isinstance(states, Tensor) else states!r}")
    sizes = list(sizes) if sizes is not None else [states.shape[1]]
    if sum(sizes) != states.shape[1]:
        raise GatelensError(f"the state's parts {sizes} do not add up to S = {states.shape[1]}")
    s0 = states.detach().to(torch.float64)
    out = []
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated",
                                category=DeprecationWarning)
        for label, x in inputs.items():
            F = _flat(step, x.detach().to(s0), sizes)
            s, q = anderson(F, s0.clone(), max_iter)
            rest = (~(q < Q_TOL)).nonzero()[:, 0]
            if rest.numel():
                s[rest], q[rest] = lbfgs(F, s[rest].clone(), max_iter)
            keep = (q < Q_TOL).nonzero()[:, 0]
            s, q = s[keep], q[keep]
            pre = merge(s, q, MERGE_TOL)
            s = newton(F, s[pre].clone())
            r = F(s) - s
            q = 0.5 * (r * r).sum(-1)
            ok = (q < Q_TOL) & torch.isfinite(q)
            s, q = s[ok], q[ok]
            final = merge(s, q, MERGE_TOL)
            s, q = s[final], q[final]
            eig = torch.linalg.eigvals(jacobians(F, s)) if len(final) else None
            points = [FixedPoint(s[i].cpu().numpy(), float(q[i]), eig[i].cpu().numpy())
                      for i in range(len(final))]
            points.sort(key=lambda p: tuple(p.state))
            out.append(HeldInput(str(label), points, int(s0.shape[0]), int(keep.numel())))
    return FixedPoints(out)


def held_inputs(d: Dynamics, ids: Tensor | None = None, chars: Sequence[str] | None = None,
                n: int = HELD) -> dict[str, Tensor]:
    """The inputs of the ``n`` most frequent characters of the windows ``ids`` (B, T) (what
    step t reads at a position holding that character), then the zero input "zero".
    Without ``ids``: the ``n`` most frequent distinct inputs of ``d.inputs`` (one-hot or
    embedded text: its characters), each labelled by where it first occurs, ``x[b, t]``.

    >>> import torch
    >>> x = torch.eye(3, dtype=torch.float64)[torch.tensor([[0, 2, 2, 1]])]  # (1, 4, 3)
    >>> d = Dynamics(lambda x, s: s, x, [x], [x[:, 0]], [0, 1, 2, 3], torch.arange(3))
    >>> list(held_inputs(d, n=2)), list(held_inputs(d, torch.tensor([[0, 2, 2, 1]]), "abc", 1))
    (['x[0, 1]', 'x[0, 0]', 'zero'], ['c', 'zero'])
    """
    B, T, F = d.inputs.shape
    out = {}
    if ids is None:
        flat = d.inputs.reshape(B * T, F)
        _, inverse, counts = torch.unique(flat, dim=0, return_inverse=True, return_counts=True)
        first = torch.full((counts.numel(),), B * T, dtype=torch.long, device=flat.device)
        first.scatter_reduce_(0, inverse, torch.arange(B * T, device=flat.device), "amin")
        for u in sorted(range(counts.numel()), key=lambda u: (-int(counts[u]), int(first[u])))[:n]:
            b, t = divmod(int(first[u]), T)
            out[f"x[{b}, {t}]"] = d.inputs[b, t]
    else:
        if chars is None or tuple(ids.shape) != (B, T):
            raise GatelensError(f"held_inputs needs the windows' ids ({B}, {T}) and the "
                                f"vocabulary; got ids {tuple(ids.shape)}")
        counts = torch.bincount(ids.reshape(-1), minlength=len(chars))
        for c in sorted(range(len(chars)), key=lambda c: (-int(counts[c]), c))[:n]:
            if counts[c] == 0:
                break
            b, t = (ids == c).nonzero()[0].tolist()
            out[chars[c]] = d.inputs[b, t]
    out["zero"] = torch.zeros_like(d.inputs[0, 0])
    return out


def dynamics_fixed_points(d: Dynamics, held: Mapping[str, Tensor], starts: int = STARTS,
                          seed: int = 0, max_iter: int = 300) -> FixedPoints:
    """``fixed_points`` of a Dynamics' step, from ``starts`` states drawn (with ``seed``)
    from its trajectory, under each held input (``held_inputs``)."""
    B, T = d.trajectory[0].shape[:2]
    flat = torch.cat(d.trajectory, dim=-1).double().reshape(B * T, -1)  # (B·T, S)
    gen = torch.Generator().manual_seed(int(seed))
    pick = torch.randperm(B * T, generator=gen)[:starts]
    if starts > B * T:  # fewer positions than starts: draw with replacement
        pick = torch.randint(0, B * T, (starts,), generator=gen)
    return fixed_points(d.step, flat[pick.to(flat.device)], held,
                        [p.shape[-1] for p in d.trajectory], max_iter)


def module_fixed_points(module, inputs: Tensor, state=None, *, held: int = HELD,
                        starts: int = STARTS, seed: int = 0) -> FixedPoints:
    """``gatelens.fixed_points(module, inputs)``: the fixed points of any module gatelens
    opens, under each of the ``held`` most frequent distinct inputs of ``inputs`` (what the
    module takes) and the zero input, from ``starts`` states of its own trajectory on them.
    Each point carries its coordinates (``to_dict(state=True)``).

    >>> import torch
    >>> rnn = torch.nn.RNN(1, 3, bias=False, batch_first=True).double()
    >>> with torch.no_grad():
    ...     _ = rnn.weight_hh_l0.copy_(0.5 * torch.eye(3, dtype=torch.float64))
    ...     _ = rnn.weight_ih_l0.zero_()
    >>> x = torch.zeros(4, 30, 1, dtype=torch.float64)
    >>> fp = module_fixed_points(rnn, x, torch.randn(1, 4, 3, dtype=torch.float64), held=1)
    >>> [(len(h.points), h.points[0].stable, round(h.points[0].max_abs_eig, 9))
    ...  for h in fp.inputs]
    [(1, True, 0.5), (1, True, 0.5)]
    """
    from gatelens.cells.numerics import faithful_matmul
    from gatelens.families.registry import open_family

    fam = open_family(module, "fixed_points()")
    call = fam.check(inputs, state)
    with torch.no_grad(), faithful_matmul(call.inputs.device):
        ref = fam.reference(call)
    d = fam.dynamics(call, ref)[0]  # the forward direction
    return dynamics_fixed_points(d, held_inputs(d, n=held), starts=starts, seed=seed)
