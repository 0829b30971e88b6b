"""Causal memory (docs/methods.md "Interventions"): the return path cut and the state
ablation, each a few ``Lens.run`` calls with Patch or Set edits.

- **Return path cut.** Change the unit at p (as the perturbation decay does), and in that
  perturbed run patch every gate and write quantity of the module (its cell spec's
  ``return_path``) to its clean-run value from p + 1 on. Only the carried state then
  differs, and δs evolves by the clean keep gates alone: each layer's measured curve of
  the cut run equals that layer's forget-only curve of the perturbation split, to float
  tolerance. A causal check of the decomposition.
- **State ablation at p.** The carried state after step p (every part of it, the spec's
  ``carried``; every layer) is replaced by its mean per unit over the windows, carried
  forward; KL(p_clean ‖ p_ablated) of the next-unit distributions by lag from p, and its
  half-life as for the output-level reach.

The curves are the perturbation's and the reach's own (``analysis.perturbation``,
``analysis.reach``): the same ratios, lags and half-lives, through ``analysis.causal``,
which analyze's ``causal`` section shares.

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

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gatelens.analysis.causal import (
    ReturnCut,
    StateAblation,
    ablates,
    cut_from_rows,
    cut_rows,
    cuts,
    has,
)
from gatelens.analysis.perturbation import LAGS, perturb_windows
from gatelens.analysis.reach import kl_per_position, reach_from_rows
from gatelens.cells.names import layer_name
from gatelens.errors import GatelensError
from gatelens.interventions.edits import Patch, Set
from gatelens.readout.trace_types import Trace

if TYPE_CHECKING:
    from gatelens.families.base import Family
    from gatelens.lens.lens import Lens

__all__ = ["ReturnCut", "StateAblation", "return_cut", "state_ablation"]


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


def _setup(lens: Lens, ids: Tensor, p: int, path: str | None, what: str,
           found: Callable[[Family], tuple[str, ...] | None], lacks: str
           ) -> tuple[Tensor, str, Family, tuple[str, ...]]:
    """What ``return_cut`` and ``state_ablation`` both check first: ids (B, T), the module
    (default: the model's only one), the letters ``found`` gives its family (None: it
    ``lacks`` them, one line), and p inside the windows."""
    ids = lens.windows(ids, 1, 1)[0] if isinstance(ids, Tensor) else ids
    if not isinstance(ids, Tensor):
        raise GatelensError(f"{what} takes ids (B, T) int64; got {type(ids).__name__}")
    path = module_path(lens, path)
    fam = lens.families[path]
    letters = found(fam)
    if letters is None:
        raise GatelensError(f"{what}: the {fam.spec.name} cell of {path or 'the model'} "
                            f"({fam.name}) has {lacks}")
    _check_position(p, int(ids.shape[1]), what)
    return ids, path, fam, letters


def return_cut(lens: Lens, ids: Tensor, p: int, *, perturbed: Tensor | None = None,
               path: str | None = None, seed: int = 0,
               lags: tuple[int, ...] = LAGS) -> ReturnCut:
    """The return path cut of the module at ``path`` (default: the model's only one) on
    ids (B, T), the unit at p changed (``perturbed``: the changed ids; default drawn as
    analyze draws them, with ``seed``)."""
    ids, path, fam, letters = _setup(lens, ids, p, path, "return_cut", cuts,
                                     "no return path gatelens can cut (one direction of a "
                                     "cell whose spec names its return_path)")
    T = int(ids.shape[1])
    if perturbed is None:
        perturbed = perturbed_ids(lens, ids, p, seed)
    elif not isinstance(perturbed, Tensor) or perturbed.shape != ids.shape:
        raise GatelensError(f"return_cut: perturbed must be ids of the shape of ids "
                            f"{tuple(ids.shape)}; got {getattr(perturbed, 'shape', perturbed)}")
    edits = [Patch(_key(path, k, g), source=ids, at=slice(p + 1, None))
             for k in range(fam.num_layers) for g in letters if has(fam, k, g)]
    clean = _trace(lens.run(ids), path)
    uncut = _trace(lens.run(perturbed), path)
    cut = _trace(lens.run(perturbed, edits=edits), path)
    return cut_from_rows([cut_rows(clean, uncut, cut, p)], p, T, letters, lags)


def state_ablation(lens: Lens, ids: Tensor, p: int, *, path: str | None = None,
                   over: Tensor | None = None, lags: tuple[int, ...] = LAGS) -> StateAblation:
    """Mean-ablate every part of the carried state of every layer of the module at
    ``path`` after step p (replaced by its mean per unit over the windows of ``over`` at
    position p, default ids: a ``Set`` edit at p, carried forward), and measure KL of the
    next-unit distributions by lag."""
    from gatelens.lens.lens import output_logits

    ids, path, fam, parts = _setup(lens, ids, p, path, "state_ablation", ablates,
                                   "no carried state gatelens ablates (one direction of a "
                                   "cell whose spec names what it carries)")
    T = int(ids.shape[1])
    plain = lens.run(ids)
    if over is not None:
        if not isinstance(over, Tensor) or over.ndim != 2 or over.shape[1] <= p:
            raise GatelensError(f"state_ablation: over must be ids (B', T') with T' > {p}; "
                                f"got {tuple(getattr(over, 'shape', ())) or type(over).__name__}")
    source = plain if over is None else lens.run(over)
    keys = [_key(path, k, s) for k in range(fam.num_layers) for s in parts if has(fam, k, s)]
    edits = [Set(key, source.trace[key][:, p].double().mean(0), at=p) for key in keys]
    clean, ablated = (output_logits(r.output) for r in (plain, lens.run(ids, edits=edits)))
    if clean is None or clean.ndim != 3 or clean.shape[:2] != ids.shape:
        raise GatelensError(f"state_ablation: {type(lens.model).__name__}'s output is not "
                            f"next-unit logits (B, T, V) on ids {tuple(ids.shape)}")
    rows = kl_per_position(clean, ablated)[:, p:]  # (B, T − p)
    return StateAblation(p, list(parts), reach_from_rows([rows], p, T, tuple(lags)))
