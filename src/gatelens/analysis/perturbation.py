"""Perturbation decay: change one character and watch the difference in the state fade.

At position p of every window x_p is replaced by a different character; both texts run
from position 0. With s the carried state (LSTM c; GRU, RNN h) and δs_t = s'_t − s_t:

- measured r(k) = mean over windows of ‖δs_{p+k}‖ / ‖δs_p‖;
- forget-gate alone a(k) = mean of ‖(∏_{j=p+1..p+k} f_j) ⊙ δs_p‖ / ‖δs_p‖ (GRU: z), with
  the unperturbed run's gates;
- the exact split δs_{p+k} = forget path + return path of docs/methods.md, computed in float64
  from the two traces.

Layers are pooled: s is every layer's state concatenated, each multiplied by its own
layer's keep gate. Windows whose δs_p is exactly zero are left out (``n`` counts the rest).

>>> import torch
>>> from gatelens.readout.trace_types import Trace
>>> B, T, H, a = 2, 6, 3, 0.5
>>> f = torch.full((B, T, H), a); i = torch.ones(B, T, H); o = torch.ones(B, T, H)
>>> g = torch.zeros(B, T, H); g2 = g.clone(); g2[:, 1] = 1.0  # the perturbation at p = 1
>>> def run(g):
...     c = torch.zeros(B, T, H); prev = torch.zeros(B, H)
...     for t in range(T):
...         prev = f[:, t] * prev + i[:, t] * g[:, t]; c[:, t] = prev
...     return Trace("lstm", 1, False, dict(i=i, f=f, g=g, o=o, c=c, h=c.tanh()))
>>> def named(tr): return Trace("lstm", 1, False, {f"layer0.{k}": v for k, v in tr.items()})
>>> d = perturbation_decay(named(run(g)), named(run(g2)), position=1)
>>> d.lags, d.measured, d.forget_only
([1, 2, 4], [0.5, 0.25, 0.0625], [0.5, 0.25, 0.0625])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from gatelens.analysis.common import finite_or_none, pooled
from gatelens.analysis.split import (  # noqa: F401 - decompose, keep_at re-exported
    Split,
    add_squares,
    as_split,
    decompose,
    keep_at,
)
from gatelens.analysis.units import half_life
from gatelens.families.records import nan_max
from gatelens.families.spec import layer_name
from gatelens.readout.trace_types import Trace

LAGS = (1, 2, 4, 8, 16, 32)


def perturb_windows(windows: Tensor, position: int, vocab_size: int, seed: int,
                    among: Tensor | None = None) -> Tensor:
    """Copy of ``windows`` (B, T) with x_p replaced by a different character in each window.

    Replacements are uniform over the other V − 1 characters, drawn with ``seed``; with
    ``among`` (the distinct ids of the analysis windows: a model read in tokens), uniform
    over the other ids of ``among``, never x_p itself (docs/methods.md "Tokens and depth").

    >>> w = torch.zeros(4, 3, dtype=torch.long)
    >>> p = perturb_windows(w, 1, 2, seed=0)
    >>> p[:, 1].tolist(), bool((p[:, [0, 2]] == 0).all())
    ([1, 1, 1, 1], True)
    >>> w = torch.tensor([[7, 7, 9], [9, 3, 7]])
    >>> perturb_windows(w, 1, 50_000, 0, among=torch.unique(w))[:, 1].tolist()
    [3, 9]
    """
    if not 0 <= position < windows.shape[1]:
        raise ValueError(f"position {position} is outside windows of length {windows.shape[1]}")
    gen = torch.Generator().manual_seed(int(seed))
    orig = windows[:, position]  # (B,)
    out = windows.clone()
    if among is None:
        if vocab_size < 2:
            raise ValueError("a perturbation needs at least two characters in the vocabulary")
        draw = torch.randint(0, vocab_size - 1, orig.shape, generator=gen  # (B,) in [0, V−2]
                             ).to(windows.device)  # drawn on the CPU: the same on any device
        out[:, position] = draw + (draw >= orig).long()  # skip the original: never unchanged
        return out
    among = torch.unique(among.to(windows.device))  # (K,) sorted
    if len(among) < 2:
        raise ValueError("a token perturbation needs at least two distinct tokens in the "
                         "windows")
    where = torch.searchsorted(among, orig.contiguous())  # (B,): x_p's index in among
    draw = torch.randint(0, len(among) - 1, orig.shape, generator=gen  # (B,) in [0, K−2]
                         ).to(windows.device)
    out[:, position] = among[draw + (draw >= where).long()]
    return out


def report_lags(position: int, length: int, lags: tuple[int, ...] = LAGS) -> list[int]:
    """The lags k with p + k < T.

    >>> report_lags(32, 128), report_lags(120, 128)
    ([1, 2, 4, 8, 16, 32], [1, 2, 4])
    """
    return [k for k in lags if position + k < length]


def ratio_rows(delta: Tensor, position: int, keep: Tensor,
               base: Tensor | None = None) -> Tensor:
    """‖δ_{p+k}‖ / ‖base‖ for k = 0 … T−1−p of every kept window, float64 (n, T − p).

    ``base`` (B, S) defaults to δ_p; the two paths are measured against the measured δs_p.
    """
    norms = delta[:, position:].double().norm(dim=-1)  # (B, T−p)
    base = (delta[:, position] if base is None else base).double().norm(dim=-1)  # (B,)
    return norms[keep] / base[keep, None]  # (n, T−p)


def decay_rows(trace: Trace, perturbed: Trace, position: int,
               decomposition: Split | dict[str, Tensor] | None = None) -> dict:
    """The per-window part of the decay: each kept window's ratio curves ("measured",
    "measured_h", and with a keep gate "forget_path", "return_path"), (n, T − p) each, the
    largest |measured − forget path − return path| and the state letter. Windows whose δs_p
    is exactly zero are left out. Rows of several chunks concatenate (``decay_from_rows``).
    ``decomposition``: the split already made (a ``Split``, or ``decompose``'s dict); it is
    read one layer at a time, each pooled norm the root of the layers' sums of squares.
    """
    name = trace.state_name
    for k in range(trace.num_layers):
        a, b = (t[f"{layer_name(k)}.{name}"] for t in (trace, perturbed))
        if a.shape != b.shape:
            raise ValueError(f"traces differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    T = trace[f"layer0.{name}"].shape[1]
    if not 0 <= position < T - 1:
        raise ValueError(f"perturbation position {position} leaves no lag in windows of {T}")
    split = as_split(decomposition, trace, perturbed, position)
    sq: dict[str, Tensor] = {}  # name -> (B, T − p): Σ over layers of ‖·‖² at each lag
    residual = None
    for k in range(trace.num_layers):
        if split is None:
            n = f"{layer_name(k)}.{name}"
            add_squares(sq, "measured", perturbed[n].double() - trace[n].double(), position)
            continue
        for part in split.parts(k):  # block by block of coordinates (Split.blocks)
            gap = (part["measured"] - (part["forget_path"] + part["return_path"])).abs().max()
            residual = nan_max(float(gap), 0.0 if residual is None else residual)
            for key, v in part.items():
                add_squares(sq, key, v, position)
    norms = {key: v.sqrt() for key, v in sq.items()}
    base = norms["measured"][:, 0]  # (B,): ‖δs_p‖ is the unit of every curve
    keep = base > 0
    # the layer's output: h, or y where the cell's output is not its state (Mamba, RWKV)
    h, h2 = (pooled(t, trace.spec.output) for t in (trace, perturbed))  # (B, T, H_out)
    rows = {"measured": norms["measured"][keep] / base[keep, None],
            "measured_h": ratio_rows(h2.double() - h.double(), position, keep)}
    for key in ("forget_path", "return_path"):
        if key in norms:
            rows[key] = norms[key][keep] / base[keep, None]
    return {"rows": rows, "residual": residual, "state": name}


def decay_from_rows(parts: list[dict], position: int, length: int,
                    lags: tuple[int, ...] = LAGS) -> PerturbationDecay:
    """The decay from the per-window rows of one or more chunks (``decay_rows``): every
    curve is the mean over all kept windows, the residual the largest."""
    ks = report_lags(position, length, lags)
    if not 0 <= position or not ks:
        raise ValueError(f"perturbation position {position} leaves no lag in windows of "
                         f"{length}")
    names = list(parts[0]["rows"])
    rows = {n: torch.cat([p["rows"][n] for p in parts]) for n in names}  # (n, T − p)
    n = int(rows["measured"].shape[0])
    curves = {k: (v.mean(dim=0).cpu().numpy() if n else np.full(length - position, np.nan))
              for k, v in rows.items()}
    measured_h = curves.pop("measured_h")
    at = lambda name: [float(curves[name][k]) for k in ks]  # noqa: E731
    has_paths = "forget_path" in curves
    residuals = [p["residual"] for p in parts if p["residual"] is not None]
    return PerturbationDecay(
        position=position, n=n, state=parts[0]["state"], lags=ks, measured=at("measured"),
        forget_only=at("forget_path") if has_paths else None,
        return_path=at("return_path") if has_paths else None,
        measured_h=[float(measured_h[k]) for k in ks], curves=curves,
        max_abs_residual=nan_max(*residuals) if residuals else None)


@dataclass
class PerturbationDecay:
    """Decay of a one-character perturbation.

    Attributes:
        position: p. n: windows measured (those with δs_p ≠ 0). state: "c" or "h".
        lags: reported lags (p + k < T). measured / forget_only / return_path: r(k), a(k)
            and the return path's ‖·‖ ratio at those lags (the last two None for an RNN).
        measured_h: the same ratio for δh (equal to ``measured`` for GRU and RNN).
        curves: "measured", "forget_path", "return_path" at every lag 0 … T−1−p (plots).
        max_abs_residual: max |measured − forget path − return path| (None for an RNN).
    """

    position: int
    n: int
    state: str
    lags: list[int]
    measured: list[float]
    forget_only: list[float] | None
    return_path: list[float] | None
    measured_h: list[float]
    curves: dict[str, np.ndarray] = field(repr=False)
    max_abs_residual: float | None = None

    def __post_init__(self) -> None:
        if not self.lags:
            raise ValueError(f"no lag k with p + k < T at position {self.position}")
        for name in ("measured", "forget_only", "return_path", "measured_h"):
            v = getattr(self, name)
            if v is not None and len(v) != len(self.lags):
                raise ValueError(f"{name} has {len(v)} values for {len(self.lags)} lags")
        if (self.forget_only is None) != (self.return_path is None):
            raise ValueError("forget_only and return_path come together")

    @property
    def max_lag(self) -> int:
        return self.lags[-1]

    @property
    def half_life_measured(self) -> float:
        """t½ = K · ln 0.5 / ln r(K), in characters."""
        return self.max_lag * half_life(self.measured[-1])

    @property
    def half_life_forget_only(self) -> float | None:
        if self.forget_only is None:
            return None
        return self.max_lag * half_life(self.forget_only[-1])

    @property
    def ratio_at_max_lag(self) -> float | None:
        """r(K) / a(K): how much longer the difference survives than the forget gate alone."""
        if self.forget_only is None:
            return None
        a = self.forget_only[-1]
        return math.inf if a == 0 else self.measured[-1] / a

    def to_dict(self) -> dict:
        """report.json's "perturbation" (plus return_path, measured_h and state)."""
        return {"position": self.position, "n": self.n, "lags": list(self.lags),
                "measured": [finite_or_none(v) for v in self.measured],
                "forget_only": None if self.forget_only is None else
                [finite_or_none(v) for v in self.forget_only],
                "half_life_measured": finite_or_none(self.half_life_measured),
                "half_life_forget_only": finite_or_none(self.half_life_forget_only),
                "ratio_at_max_lag": finite_or_none(self.ratio_at_max_lag),
                "return_path": None if self.return_path is None else
                [finite_or_none(v) for v in self.return_path],
                "measured_h": [finite_or_none(v) for v in self.measured_h],
                "state": self.state}


def perturbation_decay(trace: Trace, perturbed: Trace, position: int,
                       lags: tuple[int, ...] = LAGS,
                       decomposition: dict[str, Tensor] | None = None) -> PerturbationDecay:
    """Measured and forget-only decay of the perturbation at ``position``.

    ``decomposition`` may pass a :func:`decompose` result already computed.
    """
    rows = decay_rows(trace, perturbed, position, decomposition)
    return decay_from_rows([rows], position, trace[next(iter(trace))].shape[1], lags)
