"""Causal memory (docs/methods.md "Interventions"): the return path cut and the state
ablation, each one or two ``Lens.run`` calls with Patch or Mean edits.

- **Return path cut.** Change the unit at p (as the perturbation decay does), and in that
  perturbed run patch every gate and write quantity of the module (``RETURN_PATH``) to its
  clean-run value from p + 1 on. Only the carried state then differs, and δs evolves by the
  clean keep gates alone: each layer's measured curve of the cut run equals that layer's
  forget-only curve of the perturbation split, to float tolerance. A causal check of the
  decomposition.
- **State ablation at p.** The carried state after step p (every part of it, every layer)
  is mean-ablated, carried forward; KL(p_clean ‖ p_ablated) of the next-unit distributions
  by lag from p, and its half-life as for the output-level reach.

The curves are the perturbation's and the reach's own (``analysis.perturbation``,
``analysis.reach``): the same ratios, lags and half-lives.

>>> import torch, gatelens
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> net = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.LSTM(4, 6, batch_first=True))
>>> ids = torch.randint(0, 5, (3, 12))
>>> cut = return_cut(gatelens.Lens(net), ids, p=4)
>>> cut.lags, cut.max_abs_diff < 1e-5
([1, 2, 4], True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from gatelens.analysis.common import finite_or_none
from gatelens.analysis.perturbation import (
    LAGS,
    decay_from_rows,
    decay_rows,
    decompose,
    perturb_windows,
    report_lags,
)
from gatelens.analysis.reach import OutputReach, kl_per_position, reach_from_rows
from gatelens.cells.names import layer_name
from gatelens.errors import GatelensError
from gatelens.interventions.edits import Mean, Patch
from gatelens.readout.trace_types import Trace

if TYPE_CHECKING:
    from gatelens.lens.lens import Lens

__all__ = ["CARRIED", "RETURN_PATH", "ReturnCut", "StateAblation", "return_cut",
           "state_ablation"]

#: what the perturbation re-enters the carried state through, per cell (its trace letters):
#: every gate and write quantity of one step. LSTM: i, f, g (c' = f c + i g) and o (h reads
#: it; the next step's gates, patched too, would read h); GRU: r, z and the candidate n;
#: minGRU / minLSTM: their gates, keep and candidate. A cell not listed is refused (sLSTM's
#: stabiliser m carries the state into its keep; Mamba's write B u and Gated DeltaNet's
#: k, v are not yet editable).
RETURN_PATH: dict[str, tuple[str, ...]] = {
    "lstm": ("i", "f", "g", "o"),
    "gru": ("r", "z", "n"),
    "mingru": ("z", "keep", "cand"),
    "minlstm": ("f", "i", "keep", "cand"),
}

#: the parts of the carried state each cell hands to its next step (what the ablation
#: replaces)
CARRIED: dict[str, tuple[str, ...]] = {
    "lstm": ("h", "c"), "gru": ("h",), "rnn_tanh": ("h",), "rnn_relu": ("h",),
    "mingru": ("h",), "minlstm": ("h",), "slstm": ("h", "c", "n", "m"),
}


def module_path(lens: Lens, path: str | None) -> str:
    """The recurrent module the figure is of: ``path``, or the model's only one."""
    if path is None:
        if len(lens.families) > 1:
            raise GatelensError(f"the model has {len(lens.families)} recurrent modules "
                                f"({', '.join(repr(p) for p in lens.families)}); name one "
                                "with path=")
        return next(iter(lens.families))
    if path not in lens.families:
        raise GatelensError(f"path={path!r} is not a recurrent module of the model; its "
                            f"modules are {', '.join(repr(p) for p in lens.families)}")
    return path


def _key(path: str, layer: int, letter: str) -> str:
    name = f"{layer_name(layer)}.{letter}"
    return f"{path}.{name}" if path else name


def _check_position(p: int, T: int, what: str) -> None:
    if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < T - 1:
        raise GatelensError(f"{what}: p must be a position in 0..{T - 2} (a lag after it in "
                            f"windows of {T}); got {p!r}")


def _trace(res, path: str) -> Trace:
    traces = res.trace.traces.get(path) or []
    if len(traces) != 1:
        raise GatelensError(f"{path or 'the model'} gave {len(traces)} trajectories in one "
                            "forward; the causal figures read one")
    return traces[0]


def one_layer(trace: Trace, k: int) -> Trace:
    """Layer k of ``trace`` as a one-layer trace (``layer0.*``), its per-layer meta kept."""
    tensors = {f"layer0.{n}": v for n, v in trace.layer(k).items()}
    meta = dict(trace.meta)
    if meta.get("state_units") is not None:
        meta["state_units"] = [meta["state_units"][k]]
    return Trace(trace.cell, 1, False, tensors, meta=meta)


@dataclass
class CutLayer:
    """One layer's figures (``layer`` None: every layer pooled, as analyze's perturbation)."""

    layer: int | None
    n: int  # windows measured (δs_p ≠ 0)
    measured: list[float]  # r(k) of the cut run at the lags
    forget_only: list[float]  # a(k) of the uncut run's split at the lags
    uncut: list[float]  # r(k) of the uncut perturbed run (what the return path adds)
    max_abs_diff: float  # max |measured − forget_only| over every lag 0 … T − 1 − p

    def to_dict(self) -> dict:
        clean = lambda v: [finite_or_none(x) for x in v]  # noqa: E731
        return {"layer": self.layer, "n": self.n, "measured": clean(self.measured),
                "forget_only": clean(self.forget_only), "uncut": clean(self.uncut),
                "max_abs_diff": finite_or_none(self.max_abs_diff)}


@dataclass
class ReturnCut:
    """The return path cut at ``position``: per layer and pooled, the cut run's measured
    curve beside the forget-only curve, at the perturbation's lags. ``max_abs_residual``:
    max |δs_cut − forget path| over windows, positions and units, relative to max ‖δs_p‖."""

    position: int
    lags: list[int]
    layers: list[CutLayer]
    pooled: CutLayer
    max_abs_residual: float
    gates: list[str] = field(default_factory=list)  # the letters patched

    @property
    def max_abs_diff(self) -> float:
        """The largest |cut curve − forget-only curve| of any layer or the pool, any lag."""
        return max(c.max_abs_diff for c in [*self.layers, self.pooled])

    def to_dict(self) -> dict:
        """report.json's ``causal.return_cut``."""
        return {"position": self.position, "lags": list(self.lags), "patched": self.gates,
                "layers": [c.to_dict() for c in self.layers], "pooled": self.pooled.to_dict(),
                "max_abs_diff": finite_or_none(self.max_abs_diff),
                "max_abs_residual": finite_or_none(self.max_abs_residual)}


def _vocab_size(lens: Lens, ids: Tensor) -> int:
    return len(lens.windows(ids, 1, int(ids.shape[1]))[1])


def perturbed_ids(lens: Lens, ids: Tensor, p: int, seed: int = 0) -> Tensor:
    """ids with the unit at p changed as analyze changes it (a model read in tokens or
    bytes: among the ids occurring in the windows)."""
    among = None if lens.unit == "characters" else torch.unique(ids)
    try:
        return perturb_windows(ids, p, _vocab_size(lens, ids), seed, among=among)
    except ValueError as e:
        raise GatelensError(f"return_cut: {e}") from None


def _cut_layer(layer: int | None, clean: Trace, uncut: Trace, cut: Trace, p: int, T: int,
               lags: tuple[int, ...]) -> CutLayer:
    dec = decompose(clean, uncut, p)
    split = decay_from_rows([decay_rows(clean, uncut, p, dec)], p, T, lags)
    rows = decay_from_rows([decay_rows(clean, cut, p)], p, T, lags)
    diff = np.abs(rows.curves["measured"] - split.curves["forget_path"])
    return CutLayer(layer, rows.n, rows.measured, split.forget_only, split.measured,
                    float(np.nanmax(diff)) if diff.size else 0.0)


def return_cut(lens: Lens, ids: Tensor, p: int, *, perturbed: Tensor | None = None,
               path: str | None = None, seed: int = 0,
               lags: tuple[int, ...] = LAGS) -> ReturnCut:
    """The return path cut of the module at ``path`` (default: the model's only one) on
    ids (B, T), the unit at p changed (``perturbed``: the changed ids; default drawn as
    analyze draws them, with ``seed``)."""
    ids = lens.windows(ids, 1, 1)[0] if isinstance(ids, Tensor) else ids
    if not isinstance(ids, Tensor):
        raise GatelensError(f"return_cut takes ids (B, T) int64; got {type(ids).__name__}")
    path = module_path(lens, path)
    fam = lens.families[path]
    letters = RETURN_PATH.get(fam.spec.name)
    if letters is None or fam.bidirectional:
        raise GatelensError(f"return_cut: the {fam.spec.name} cell of {path or 'the model'} "
                            f"({fam.name}) has no return path gatelens can cut; it cuts "
                            f"{', '.join(RETURN_PATH)} (one direction)")
    T = int(ids.shape[1])
    _check_position(p, T, "return_cut")
    if perturbed is None:
        perturbed = perturbed_ids(lens, ids, p, seed)
    elif not isinstance(perturbed, Tensor) or perturbed.shape != ids.shape:
        raise GatelensError(f"return_cut: perturbed must be ids of the shape of ids "
                            f"{tuple(ids.shape)}; got {getattr(perturbed, 'shape', perturbed)}")
    edits = [Patch(_key(path, k, g), source=ids, at=slice(p + 1, None))
             for k in range(fam.num_layers) for g in letters]
    clean = _trace(lens.run(ids), path)
    uncut = _trace(lens.run(perturbed), path)
    cut = _trace(lens.run(perturbed, edits=edits), path)
    L = clean.num_layers
    layers = [_cut_layer(k, *(one_layer(t, k) for t in (clean, uncut, cut)), p, T, lags)
              for k in range(L)]
    pooled = _cut_layer(None, clean, uncut, cut, p, T, lags)
    forget = decompose(clean, uncut, p)["forget_path"]  # (B, T, S)
    delta = decompose(clean, cut, p)["measured"]
    scale = float(forget[:, p].norm(dim=-1).max()) or 1.0
    residual = float((delta - forget)[:, p:].abs().max()) / scale
    return ReturnCut(p, report_lags(p, T, lags), layers, pooled, residual, list(letters))


@dataclass
class StateAblation:
    """KL(p_clean ‖ p_ablated) by lag from p after the carried state at p is mean-ablated.

    ``reach``: the curve, lags and half-life exactly as the output-level reach has them
    (lag 0 is position p itself, whose output reads the ablated state)."""

    position: int
    parts: list[str]  # the state letters ablated, every layer
    reach: OutputReach

    @property
    def lags(self) -> list[int]:
        return self.reach.lags

    @property
    def kl(self) -> list[float]:
        return self.reach.kl

    @property
    def kl_at_p(self) -> float:
        """KL at lag 0: position p's own prediction, read from the ablated state."""
        return float(self.reach.curve[0])

    @property
    def half_life(self) -> float | None:
        return self.reach.half_life

    def to_dict(self) -> dict:
        """report.json's ``causal.state_ablation``."""
        return {"position": self.position, "ablated": self.parts, "n": self.reach.n,
                "kl_at_p": finite_or_none(self.kl_at_p), **self.reach.to_dict()}


def state_ablation(lens: Lens, ids: Tensor, p: int, *, path: str | None = None,
                   over: Tensor | None = None, lags: tuple[int, ...] = LAGS) -> StateAblation:
    """Mean-ablate every part of the carried state of every layer of the module at
    ``path`` after step p (the mean per unit over the windows and positions of ``over``;
    default ids), carried forward, and measure KL of the next-unit distributions by lag."""
    from gatelens.lens.lens import output_logits

    ids = lens.windows(ids, 1, 1)[0] if isinstance(ids, Tensor) else ids
    if not isinstance(ids, Tensor):
        raise GatelensError(f"state_ablation takes ids (B, T) int64; got "
                            f"{type(ids).__name__}")
    path = module_path(lens, path)
    fam = lens.families[path]
    parts = CARRIED.get(fam.spec.name)
    if parts is None or fam.bidirectional:
        raise GatelensError(f"state_ablation: the {fam.spec.name} cell of {path or 'the model'}"
                            f" ({fam.name}) has no carried state gatelens ablates; it ablates "
                            f"{', '.join(CARRIED)} (one direction)")
    T = int(ids.shape[1])
    _check_position(p, T, "state_ablation")
    edits = [Mean(_key(path, k, s), at=p, over=over)
             for k in range(fam.num_layers) for s in parts]
    clean, ablated = (output_logits(lens.run(ids, edits=e).output) for e in ([], edits))
    if clean is None or clean.ndim != 3 or clean.shape[:2] != ids.shape:
        raise GatelensError(f"state_ablation: {type(lens.model).__name__}'s output is not "
                            f"next-unit logits (B, T, V) on ids {tuple(ids.shape)}")
    rows = kl_per_position(clean, ablated)[:, p:]  # (B, T − p)
    return StateAblation(p, list(parts), reach_from_rows([rows], p, T, tuple(lags)))
