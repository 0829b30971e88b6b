"""The Lyapunov spectrum of a recurrence, by the QR method, and its slow modes.

docs/methods.md, "Lyapunov spectrum and slow modes". Along each window's own trajectory
(a ``Dynamics``: the whole stack's step s_t = F(s_{t−1}, x_t) over the whole carried
state, LSTM h and c together, float64), k orthonormal tangent vectors Q are pushed through
each step's Jacobian and re-orthonormalised every step:

    J_t Q_{t−1} = Q_t R_t;   λ_i = (1 / n) Σ_{counted t} ln |R_t,ii|   (per window)

n the steps after the burn-in (``Dynamics.offset`` steps of the window count towards it),
then λ_i is averaged over windows, in nats per character. J_t Q is k forward-mode JVPs
(``torch.func.jvp`` under ``vmap``); with every exponent (k = dim s), mean ln |det J_t|
comes beside Σ λ_i from the LU of J_t Q_{t−1} (|det Q| = 1): the same number in exact
arithmetic, by another factorisation. (The tests hold Σ λ_i against det J_t of PyTorch's
own cells, which is what can catch a wrong Jacobian.) The first start vector of each window is
the divergence rate's own seeded unit vector, so λ_1 *is* the divergence rate
(``divergence_of``); the others come from the run's seed and are orthonormalised against it.

The Lyapunov vectors are the columns of Q at a window's last step; a unit's loading pools
its coordinates (``Dynamics.units``; LSTM v_h,u² + v_c,u²). ``SlowMode`` reads them.

>>> import torch
>>> from gatelens.families.base import Dynamics
>>> A = torch.diag(torch.tensor([0.5, 0.25], dtype=torch.float64))
>>> z = torch.zeros(3, 60, 2, dtype=torch.float64)
>>> d = Dynamics(step=lambda x, s: [s[0] @ A + x], inputs=z, trajectory=[z], initial=[z[:, 0]],
...              order=list(range(60)), units=torch.tensor([0, 1]))
>>> sp = lyapunov_spectrum([d], k="all", burn_in=40, hidden=2)  # Q aligns like 2^−t
>>> [round(float(v), 9) for v in sp.exponents], round(sp.mean_log_abs_det - sp.sum, 12)
([-0.693147181, -1.386294361], 0.0)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from gatelens.analysis.common import finite_or_none, give_back
from gatelens.analysis.divergence import DivergenceRate
from gatelens.analysis.qr import orthonormalise, orthonormalise_held  # noqa: F401 - re-exported
from gatelens.analysis.slow_modes import SLOW_EXPONENT, SlowMode, describe_slow, slow_modes
from gatelens.analysis.spectrum_plan import (  # noqa: F401 - re-exported
    AUTO,
    DEFAULT_K,
    SIZE_AT,
    SIZE_WINDOWS,
    TANGENT_BUDGET,
    k_of,
    spectrum_plan,
)
from gatelens.errors import GatelensError
from gatelens.families.base import Dynamics
from gatelens.progress import Progress

TANGENT_CHUNK = 128  # tangent vectors per vmap call: bounds the JVP's memory, as does
TANGENT_NUMBERS = 1 << 24  # state numbers a call (2^22 made 24 Mamba layers' spectrum 2.3×)
@dataclass
class LyapunovSpectrum:
    """The k largest exponents of one direction (the one with the larger λ_1), per window."""

    exponents: np.ndarray  # (k,) nats per character, mean over windows
    per_window: np.ndarray = field(repr=False)  # (B, k)
    burn_in: int
    size: int  # S, the dimension of the carried state
    hidden: int  # units per layer (names a pooled unit u as [u // hidden, u % hidden])
    participation: np.ndarray = field(repr=False)  # (k,) PR of each vector, mean over windows
    loadings: np.ndarray = field(repr=False)  # (k, units) pooled v_u², mean over windows
    direction: str = "forward"
    log_det_per_window: np.ndarray | None = field(default=None, repr=False)  # (B,) k = S
    per_direction: dict[str, LyapunovSpectrum] = field(default_factory=dict, repr=False)
    rule: str | None = None  # the cost rule's sentence when it capped k or the windows

    @property
    def k(self) -> int:
        return int(self.exponents.shape[0])

    @property
    def windows(self) -> int:
        """The windows the spectrum was measured on."""
        return int(self.per_window.shape[0])

    @property
    def sum(self) -> float:
        """Σ λ_i over the computed exponents (with all of them: mean ln |det J_t|)."""
        return float(np.sum(self.exponents))

    @property
    def mean_log_abs_det(self) -> float | None:
        """mean ln |det J_t| over the same steps and windows, by LU of J_t Q_{t−1} (k = S)."""
        return None if self.log_det_per_window is None else float(np.mean(self.log_det_per_window))

    @property
    def slow_modes(self) -> list[SlowMode]:
        """The exponents with half-life ≥ 10 characters (λ ≥ ln 0.5 / 10), in order."""
        return slow_modes(self.exponents, self.participation, self.loadings, self.hidden)

    def describe(self) -> str:
        """One sentence for report.md: does any direction hold a long memory?

        >>> e = np.array([-0.01, -0.5])
        >>> sp = LyapunovSpectrum(e, e[None], 16, 4, 2, np.array([3.2, 1.0]),
        ...                       np.array([[0.3, 0.3, 0.2, 0.2], [1, 0, 0, 0]]))
        >>> sp.describe()[:78]
        '1 direction of the state holds a change for 10 characters or more (of the 2 co'
        """
        return describe_slow(self.slow_modes, self.exponents, self.size)

    def to_dict(self) -> dict:
        """report.json's "lyapunov" (DESIGN, report.json version 3)."""
        return {"exponents": [finite_or_none(v) for v in self.exponents],
                "burn_in": self.burn_in, "sum": finite_or_none(self.sum),
                "mean_log_abs_det": finite_or_none(self.mean_log_abs_det),
                "slow_modes": [m.to_dict() for m in self.slow_modes]}


def _counted(d: Dynamics, burn_in: int) -> int:
    """Steps that enter the sum: those of ``order`` from window step ``burn_in`` on."""
    if not isinstance(burn_in, int) or burn_in < 0:
        raise GatelensError(f"burn_in must be a non-negative int; got {burn_in!r}")
    n = len(d.order) - max(0, burn_in - d.offset)
    if n < 1:
        raise GatelensError(f"burn_in {burn_in} leaves no step of the {d.name} direction's "
                            f"{d.offset + len(d.order)}-step windows")
    return n


class StartFrames:
    """Each window's start vectors, the same however the windows are chunked.

    The first vector of every window and direction is drawn first, exactly as the
    divergence rate draws it (one randn (B, S) per direction from the seeded generator,
    normalised); the others then come window by window from a generator per direction
    seeded from the same stream, and are orthonormalised against the first.
    """

    def __init__(self, seed: int, windows: int, sizes: Sequence[int], k: int) -> None:
        gen = torch.Generator().manual_seed(int(seed))
        self.first = [torch.randn(windows, s, generator=gen, dtype=torch.float64)
                      for s in sizes]  # (B, S) each
        self.rest = [torch.Generator().manual_seed(int(torch.randint(
            0, 2**62, (1,), generator=gen))) for _ in sizes]
        self.k, self.windows, self.done = k, windows, [0] * len(sizes)

    def take(self, direction: int, n: int) -> Tensor:
        """The next ``n`` windows' orthonormal start frames of a direction, (n, S, k)."""
        a = self.done[direction]
        if a + n > self.windows:
            raise GatelensError(f"the spectrum was set up for {self.windows} windows; got {a + n}")
        self.done[direction] = a + n
        v = self.first[direction][a : a + n]  # (n, S)
        v = v / v.norm(dim=-1, keepdim=True)
        if self.k == 1:
            return v[:, :, None]
        S = v.shape[1]
        others = torch.stack([torch.randn(S, self.k - 1, generator=self.rest[direction],
                                          dtype=torch.float64) for _ in range(n)])
        Q, R = torch.linalg.qr(torch.cat([v[:, :, None], others], dim=2))  # (n, S, k)
        Q = Q * torch.sign(R.diagonal(dim1=-2, dim2=-1))[:, None, :]
        Q[:, :, 0] = v  # the first exactly the divergence rate's vector
        return Q


def _pusher(d: Dynamics, x: Tensor, prev: list[Tensor], k: int):
    """v ↦ J_t v for a frame (B, S, k), by forward-mode JVPs at the state ``prev``."""
    # ``prev``: tensors of their own (Dynamics.previous); jvp on a view tangents its base
    prev = tuple(prev)
    sizes = [p.shape[-1] for p in prev]

    def f(*s: Tensor) -> tuple[Tensor, ...]:
        return tuple(d.step(x, list(s)))

    if k == 1:  # the divergence rate's own arithmetic
        def push1(held: list[Tensor]) -> Tensor:
            _, out = torch.func.jvp(f, prev, tuple(held.pop()[:, :, 0].split(sizes, dim=-1)))
            return torch.cat(out, dim=-1)[:, :, None]
        return push1

    def one(*tv: Tensor) -> tuple[Tensor, ...]:
        out = torch.func.jvp(f, prev, tv)[1]
        # a part no tangent reaches (RWKV's first token shift) comes back unbatched, which
        # vmap (2.13) cannot place at out_dims=2: an exact zero from the tangents batches it
        zero = 0.0 * tv[0].sum()
        return tuple(o + zero for o in out)
    chunk = max(1, min(TANGENT_CHUNK, TANGENT_NUMBERS // max(1, len(prev[0]) * sum(sizes))))
    batched = torch.func.vmap(one, in_dims=2, out_dims=2, chunk_size=chunk)

    def push(held: list[Tensor]) -> Tensor:
        parts = batched(*held.pop().split(sizes, dim=1))  # the frame goes before the cat
        return torch.cat(parts, dim=1)  # (B, S, k)
    return push


def _direction(d: Dynamics, start: list[Tensor], burn_in: int, n_units: int,
               bar: Progress | None = None) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """One direction on its windows from the frames Q (B, S, k) that ``start`` hands over
    (the list is emptied): per-window exponents (B, k), ln |det J_t| (B,) when k = S, and
    the last frame's PR (B, k) and pooled loadings summed over the windows (units, k).
    ``bar``: told of each step (its rate and ETA in a log every eighth of them, once it
    has run 5 s)."""
    Q = start.pop()
    B, S, k = Q.shape
    n = _counted(d, burn_in)
    total = torch.zeros(B, k, dtype=torch.float64, device=Q.device)
    logdet = torch.zeros(B, dtype=torch.float64, device=Q.device) if k == S else None
    for j, t in enumerate(d.order):
        push = _pusher(d, d.inputs[:, t], d.previous(j), k)
        counted = j + d.offset >= burn_in
        held = [Q]  # each frame is handed over and goes as soon as it is read
        del Q  # (24 Mamba-2 layers: 113 MB a frame)
        V = push(held)  # (B, S, k) = J_t Q_{t−1}
        if logdet is not None and counted:  # |det Q_{t−1}| = 1: ln |det V| = ln |det J_t|
            logdet += torch.linalg.slogdet(V).logabsdet
        if k == 1:
            r = torch.sqrt((V * V).sum(dim=1))  # (B, 1)
            Q = V / r[:, None, :]
        else:
            held = [V]
            del V
            Q, r = orthonormalise_held(held)  # (B, S, k), (B, k)
        if counted:
            total += torch.log(r)
        if j % 16 == 15:
            give_back()  # the steps' freed blocks, before the heap fragments (common.py)
        if bar is not None:
            bar.update(1)
            if bar.done % max(1, bar.total // 8) == 0 and bar.elapsed > 5:
                bar.milestone()  # a short spectrum says nothing
    w = torch.zeros(B, n_units, k, dtype=torch.float64, device=Q.device)
    keep = d.units >= 0  # a projected h belongs to no unit
    w.index_add_(1, d.units[keep].to(Q.device), Q[:, keep] ** 2)  # (B, units, k)
    pr = w.sum(1) ** 2 / (w * w).sum(1)  # (B, k)
    return total / n, None if logdet is None else logdet / n, pr, w.sum(0)


class SpectrumAccumulator:
    """The spectrum over windows that arrive in chunks (each chunk's list of Dynamics).

    ``windows``: all windows that will arrive (the start vectors are drawn for all of
    them at the first chunk, so chunking does not change a figure); None: the first
    chunk is all of them.

    >>> import torch
    >>> from gatelens.families.base import Dynamics
    >>> def chunk(n):
    ...     z = torch.zeros(n, 9, 2, dtype=torch.float64)
    ...     return [Dynamics(step=lambda x, s: [0.5 * s[0] + x], inputs=z, trajectory=[z],
    ...                      initial=[z[:, 0]],
    ...                      order=list(range(9)), units=torch.tensor([0, 1]))]
    >>> acc = SpectrumAccumulator(k=2, burn_in=2, hidden=2, windows=5)
    >>> acc.update(chunk(3)); acc.update(chunk(2))
    >>> acc.result().per_window.shape
    (5, 2)
    """

    def __init__(self, k: int | str = DEFAULT_K, seed: int = 0, burn_in: int = 16,
                 hidden: int | None = None, windows: int | None = None,
                 progress: bool = False) -> None:
        self.k_asked, self.seed, self.burn_in, self.windows = k, seed, burn_in, windows
        self.progress = progress  # a bar over the steps (``Progress``: a line in a log)
        self.hidden = hidden
        self.starts: StartFrames | None = None
        self.names: list[str] = []
        self.parts: list[list[tuple]] = []  # per direction, each chunk's (B, k) rows
        self.loadings: list = []  # per direction, Σ over windows (units, k): one, not one a window
        self.limit, self.taken, self.rule = 0, 0, None  # the cost rule's windows

    def update(self, dynamics: Sequence[Dynamics]) -> None:
        """Measure one chunk of windows (one Dynamics per direction)."""
        if not dynamics:
            raise GatelensError("the spectrum needs at least one Dynamics")
        if self.starts is None:
            self.hidden = self.hidden or getattr(dynamics[0], "hidden", None)
            if not isinstance(self.hidden, int) or self.hidden < 1:
                raise GatelensError("lyapunov_spectrum needs hidden= (units per layer) to "
                                    "name the units the slow modes load on")
            B = self.windows or int(dynamics[0].inputs.shape[0])
            k, self.limit, self.rule = spectrum_plan(self.k_asked, max(d.size for d in dynamics),
                                                     B)
            self.ks = [min(k, d.size) for d in dynamics]
            self.n_units = [max(int(d.units.max()) + 1, 1) for d in dynamics]
            sizes = [d.size for d in dynamics]
            self.starts = StartFrames(self.seed, B, sizes, max(self.ks))
            self.names, self.parts = [d.name for d in dynamics], [[] for _ in dynamics]
            self.loadings = [0.0] * len(dynamics)
        if [d.name for d in dynamics] != self.names:
            raise GatelensError(f"directions changed between chunks: {self.names} then "
                                f"{[d.name for d in dynamics]}")
        if self.limit < self.starts.windows:  # the cost rule measures its first windows only
            n = min(int(dynamics[0].inputs.shape[0]), self.limit - self.taken)
            if n <= 0:
                return
            self.taken += n
            dynamics = [d.first(n) for d in dynamics]
        with warnings.catch_warnings(), torch.no_grad():
            # PyTorch's forward-AD decompositions warn, when first loaded, that torch.jit is
            # deprecated: their own business, not the caller's.
            warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated",
                                    category=DeprecationWarning)
            bar = Progress(sum(len(d.order) for d in dynamics),
                           f"gatelens analyze: Lyapunov spectrum ({max(self.ks)} exponents)",
                           enabled=self.progress)
            for i, d in enumerate(dynamics):
                B = int(d.inputs.shape[0])
                start = [self.starts.take(i, B)[:, :, : self.ks[i]].to(d.inputs.device)]
                out = _direction(d, start, self.burn_in, self.n_units[i],
                                 bar if self.progress else None)
                self.parts[i].append(tuple(None if t is None else t.cpu() for t in out[:3]))
                self.loadings[i] = self.loadings[i] + out[3].cpu()  # 24 Mamba layers: 90 MB
            bar.close()

    def result(self) -> LyapunovSpectrum:
        """The spectrum of the direction with the larger λ_1; both in ``per_direction``."""
        if self.starts is None:
            raise GatelensError("no windows were measured")
        per = {}
        for i, name in enumerate(self.names):
            ex, ld, pr = (None if p[0] is None else torch.cat(p) for p in
                          zip(*self.parts[i], strict=True))
            w = self.loadings[i] / ex.shape[0]  # (units, k) mean over windows
            per[name] = LyapunovSpectrum(
                exponents=ex.mean(0).numpy(), per_window=ex.numpy(), burn_in=self.burn_in,
                size=int(self.starts.first[i].shape[1]), hidden=self.hidden,
                participation=pr.mean(0).numpy(), loadings=w.T.numpy(),
                direction=name, log_det_per_window=None if ld is None else ld.numpy(),
                rule=self.rule)
        best = max(per.values(), key=lambda s: s.exponents[0])
        if len(per) > 1:
            best.per_direction = per
        return best


def lyapunov_spectrum(dynamics: Sequence[Dynamics], k: int | str = DEFAULT_K, seed: int = 0,
                      burn_in: int = 16, hidden: int | None = None) -> LyapunovSpectrum:
    """The k largest exponents (``k="all"``: every one) of the recurrence ``dynamics``
    (one Dynamics per direction), on all its windows at once; ``hidden``: units per layer."""
    acc = SpectrumAccumulator(k, seed, burn_in, hidden)
    acc.update(dynamics)
    return acc.result()


def divergence_of(dynamics: Sequence[Dynamics], seed: int = 0, burn_in: int = 16
                  ) -> DivergenceRate:
    """The divergence rate λ as the spectrum's k = 1: the same code, the same figures."""
    sp = lyapunov_spectrum(dynamics, k=1, seed=seed, burn_in=burn_in, hidden=1)
    pw = sp.per_window[:, 0]
    sd = float(np.std(pw, ddof=1)) if pw.size > 1 else 0.0
    per = {n: float(s.exponents[0]) for n, s in sp.per_direction.items()}
    return DivergenceRate(float(np.mean(pw)), sd, burn_in, pw, per)


__all__ = ["AUTO", "DEFAULT_K", "SLOW_EXPONENT", "LyapunovSpectrum", "SlowMode",
           "SpectrumAccumulator", "divergence_of", "lyapunov_spectrum", "spectrum_plan"]
