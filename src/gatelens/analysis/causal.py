"""Causal memory (docs/methods.md "Interventions"): the return path cut and the state
ablation, on one recurrent module, with the perturbation's and the reach's own curves.

- **Return path cut.** In the perturbed run, every gate and write quantity of the module
  (its cell spec's ``return_path``) takes its clean-run value from p + 1 on: only the carried
  state differs, δs evolves by the clean keep gates alone, and each layer's measured curve
  of the cut run equals that layer's forget-only curve of the split, to float tolerance.
- **State ablation at p.** The carried state after step p (every part, the spec's
  ``carried``; every layer) is replaced by its mean per unit over the windows (at p),
  carried forward; KL(p_clean ‖ p_ablated) of the next-unit distributions by
  lag from p, with the output-level reach's lags and half-life.

``gatelens.interventions.causal`` measures both on any model through ``Lens.run``; the
``Causal`` measurement of ``analyze`` (analysis/measurements.py) through the family's
``intervene``, chunk by chunk, from the rows below.

>>> import torch
>>> from gatelens.families.registry import family_of
>>> fam = family_of(torch.nn.LSTM(3, 4))
>>> cuts(fam), ablates(fam)
(('i', 'f', 'g', 'o'), ('h', 'c'))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gatelens.analysis.common import finite_or_none
from gatelens.analysis.perturbation import LAGS, report_lags
from gatelens.analysis.reach import OutputReach, kl_per_position
from gatelens.analysis.split import Split, add_squares, as_split
from gatelens.cells.names import layer_name
from gatelens.cells.numerics import faithful_matmul
from gatelens.errors import GatelensError
from gatelens.families.base import Call, Family, Readout
from gatelens.families.edit_plan import EditPlan, StepChange
from gatelens.families.official_edit import ENTRY, entry_at, entry_cut
from gatelens.families.records import nan_max
from gatelens.readout.hooks import family_calls, in_family_call
from gatelens.readout.trace import assemble
from gatelens.readout.trace_types import Trace

#: what an intervention on a module that cannot take one raises: analyze goes on, and its
#: ``causal`` note says why
REFUSED = (GatelensError, TypeError, ValueError, RuntimeError, NotImplementedError)


def why(e: Exception) -> str:
    """An exception as the one line a note holds.

    >>> why(ValueError("bad   layout"))
    'ValueError: bad layout'
    """
    text = " ".join(str(e).split())[:200]
    return text if isinstance(e, GatelensError) else f"{type(e).__name__}: {text}"


def cuts(fam: Family) -> tuple[str, ...] | None:
    """The letters ``fam``'s return path runs through (its cell's ``return_path``: every
    gate and write quantity of one step; an official family's every letter but its state
    and output, and its write ``entry``, families/official_edit.py); None when gatelens
    cannot cut it (a cell whose spec names none, a bidirectional module). gatelens's own
    sLSTM's stabiliser m carries the state into its keep, so patching its gates does not
    cut it."""
    if fam.bidirectional:
        return None
    return fam.spec.return_path or entry_cut(fam)


def ablates(fam: Family) -> tuple[str, ...] | None:
    """The carried parts the ablation replaces (the cell's ``carried``; an official
    family's state s, the memory its keep scales: its convolution buffers and token
    shifts, the layer's last inputs, are left); None when gatelens cannot ablate them."""
    if fam.bidirectional:
        return None
    return fam.spec.carried or ((fam.spec.state,) if entry_cut(fam) else None)


def has(fam: Family, k: int, letter: str) -> bool:
    """Whether layer k of ``fam`` has ``letter`` to edit (a mixed stack's layers differ;
    every layer whose step takes edits has its write ``entry``)."""
    own = fam.letters(k) if hasattr(fam, "letters") else fam.spec.signals
    return letter == ENTRY or letter in own


def _patch(values: Tensor) -> Callable[[int, Tensor], Tensor]:
    """An edit's apply: position t's value of ``values`` (B, T, W)."""
    return lambda t, v: values[:, t].to(v.dtype).clone()


def _held(mean: Tensor) -> Callable[[int, Tensor], Tensor]:
    """An edit's apply: ``mean`` (W,) in every window."""
    return lambda t, v: mean.to(v).expand_as(v).clone()


#: the cut run's states held at once: above it the cut runs once per group of consecutive
#: layers whose states fit, keeping that group's (a 24-layer Mamba-2 at mamba2-130m's width
#: holds 2.4 GB of states a window); each group's run stops at its top layer, so ten groups
#: cost about five whole runs
CUT_KEPT = 256 * 2**20


def cut_trace(fam: Family, perturbed: Call, clean: Trace, p: int,
              uncut: Trace | None = None) -> Trace:
    """The module on the perturbed call, every ``RETURN_PATH`` letter of every layer set to
    ``clean``'s value from p + 1 on (the family's own ``intervene``): the cut run's trace
    of its states (all that the cut's rows read; a family may skip its other signals).
    ``uncut``: the perturbed run's own trace, which it is up to p + 1 (a family may then
    leave those steps unread). Above ``CUT_KEPT`` of states the trace runs the cut once per
    group of layers as they are read (``_CutStates``); the write is patched step by step."""
    letters = cuts(fam) or ()
    T = perturbed.length

    def value(k: int, g: str) -> Callable[[int, Tensor], Tensor]:
        if g == ENTRY:  # e_t of one step at a time (official_edit.entry_at)
            return lambda t, v: entry_at(fam, clean, k, t).to(v.dtype)
        return _patch(clean[f"{layer_name(k)}.{g}"])

    def plan(keep: list[str]) -> EditPlan:
        return EditPlan((StepChange(layer_name(k), g, frozenset(range(p + 1, T)), True,
                                    value(k, g))
                         for k in range(fam.num_layers) for g in letters if has(fam, k, g)),
                        known=uncut is not None, keep=keep,  # the cut's rows read the states
                        output=False)  # and no layer above a group's is run

    states = [f"{layer_name(k)}.{clean.state_name}" for k in range(fam.num_layers)]
    groups: list[list[str]] = [[]]
    held = 0  # the bytes of the last group's states
    for name in states:
        size = clean[name].numel() * clean[name].element_size()
        if groups[-1] and held + size > CUT_KEPT:
            groups.append([])
            held = 0
        groups[-1].append(name)
        held += size
    cut = _CutStates(fam, perturbed, plan, groups, uncut)
    units = clean.meta.get("state_units")
    return assemble(fam, perturbed, Readout(dict(cut) if len(groups) == 1 else cut,
                                            meta={} if units is None else
                                            {"state_units": units}), states, edited=True)


class _CutStates(Mapping[str, Tensor]):
    """The cut run's states, one group of layers held: a group's run (``plan(keep)``) when
    one of its layers is read, the steps before the cut taken from the uncut run."""

    def __init__(self, fam: Family, call: Call, plan: Callable[[list[str]], EditPlan],
                 groups: list[list[str]], uncut: Trace | None) -> None:
        self.fam, self.call, self.plan, self.groups, self.uncut = fam, call, plan, groups, uncut
        self._held: dict[str, Tensor] = {}

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._held:
            group = next((g for g in self.groups if name in g), None)
            if group is None:
                raise KeyError(name)
            self._held = {}  # the group held before goes first
            _, got = self.fam.intervene(self.call, self.plan(group), None, 0)
            T = self.call.length
            for n in [n for n in got if n in group]:  # each layer padded as it is taken
                v = got.pop(n)
                self._held[n] = v if v.shape[1] == T else torch.cat(
                    [self.uncut[n][:, : T - v.shape[1]].to(v.dtype), v], dim=1)
                del v
        return self._held[name]

    def __iter__(self) -> Iterator[str]:
        return (n for g in self.groups for n in g)

    def __len__(self) -> int:
        return sum(len(g) for g in self.groups)


def cut_rows(clean: Trace, uncut: Trace, cut: Trace, p: int,
             split: Split | dict[str, Tensor] | None = None) -> dict:
    """One chunk's rows of the cut: per layer and pooled (None), each kept window's ratio
    curves (n, T − p): "measured" (the cut run), "forget_path" and "uncut" (the uncut
    perturbed run's split); and the largest |δs_cut − forget path| with the largest ‖δs_p‖
    it is measured against. ``split``: the uncut run's split where the caller has it
    already (a ``Split``, or ``decompose``'s dict). Every keep (element-wise, or a keep
    operator) acts within its layer, so the split is read one layer at a time, and the
    pooled rows come from the layers' sums of squares."""
    split = as_split(split, clean, uncut, p)
    out: dict[str, Any] = {"curves": {}}
    sq: dict[str, Tensor] = {}  # the pooled ‖·‖² at each lag, (B, T − p)
    residual = 0.0
    for k in range(clean.num_layers):
        name = f"{layer_name(k)}.{clean.state_name}"
        own: dict[str, Tensor] = {}  # layer k's ‖·‖² at each lag, its blocks' sums
        for block in split.blocks(k):
            part = split.layer(k, block)
            d = {"measured": cut[name][..., block].double() - clean[name][..., block].double(),
                 "uncut": part["measured"], "forget_path": part["forget_path"]}  # δs_cut
            residual = nan_max(residual, float((d["measured"] - d["forget_path"])[:, p:]
                                               .abs().max()))
            for key, v in d.items():
                add_squares(own, key, v, p)
        for key, v in own.items():
            sq[key] = v if key not in sq else sq[key] + v
        out["curves"][k] = _curves({key: v.sqrt() for key, v in own.items()})
    out["curves"][None] = _curves({key: v.sqrt() for key, v in sq.items()})
    out["residual"] = residual
    out["scale"] = float(sq["forget_path"][:, 0].sqrt().max())
    return out


def _curves(norms: dict[str, Tensor]) -> dict[str, Tensor]:
    """The cut's ratio curves of kept windows from the norms (B, T − p) at each lag."""
    kept = {n: norms[n][:, 0] > 0 for n in ("measured", "uncut")}
    base = norms["uncut"][:, 0]  # the forget path is measured against the uncut δs_p
    return {"measured": norms["measured"][kept["measured"]]
            / norms["measured"][kept["measured"], :1],
            "forget_path": norms["forget_path"][kept["uncut"]] / base[kept["uncut"], None],
            "uncut": norms["uncut"][kept["uncut"]] / base[kept["uncut"], None]}


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
    max |δs_cut − forget path| over windows, positions and units, over the largest ‖δs_p‖."""

    position: int
    lags: list[int]
    layers: list[CutLayer]
    pooled: CutLayer
    max_abs_residual: float
    gates: list[str] = field(default_factory=list)  # the letters patched

    @property
    def max_abs_diff(self) -> float:
        """The largest |cut curve − forget-only curve| of any layer or the pool, any lag."""
        return nan_max(*(c.max_abs_diff for c in [*self.layers, self.pooled]))

    def to_dict(self) -> dict:
        """report.json's ``causal.return_cut``."""
        return {"position": self.position, "lags": list(self.lags), "patched": self.gates,
                "layers": [c.to_dict() for c in self.layers], "pooled": self.pooled.to_dict(),
                "max_abs_diff": finite_or_none(self.max_abs_diff),
                "max_abs_residual": finite_or_none(self.max_abs_residual)}


def cut_from_rows(parts: list[dict], p: int, T: int, letters: tuple[str, ...],
                  lags: tuple[int, ...] = LAGS) -> ReturnCut:
    """The cut from the rows of one or more chunks (``cut_rows``): means over every kept
    window, the residual the largest."""
    ks = report_lags(p, T, lags)
    if not ks:
        raise ValueError(f"position {p} leaves no lag in windows of {T}")
    layers = []
    for k in parts[0]["curves"]:
        rows = {n: torch.cat([c["curves"][k][n] for c in parts]) for n in
                ("measured", "forget_path", "uncut")}
        n = int(rows["measured"].shape[0])
        mean = {name: (r.mean(0).cpu().numpy() if n else np.full(T - p, np.nan))
                for name, r in rows.items()}
        diff = np.abs(mean["measured"] - mean["forget_path"])
        at = {name: [float(v[j]) for j in ks] for name, v in mean.items()}
        layers.append(CutLayer(k, n, at["measured"], at["forget_path"], at["uncut"],
                               float(np.nanmax(diff)) if n else float("nan")))
    scale = nan_max(*(c["scale"] for c in parts)) or 1.0
    residual = nan_max(*(c["residual"] for c in parts)) / scale
    return ReturnCut(p, ks, layers[:-1], layers[-1], residual, list(letters))


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


def ablation_plan(fam: Family, means: dict[str, Tensor], p: int) -> EditPlan:
    """Every carried part of every layer set to ``means[name]`` (its (W,) mean per unit) at
    p, carried forward."""
    return EditPlan((StepChange(name.rpartition(".")[0], name.rpartition(".")[2],
                                frozenset({p}), True, _held(m))
                     for name, m in means.items()), signals=False)  # the output alone


def ablation_rows(fam: Family, runner: Callable[[Tensor], Any], windows: list[Tensor],
                  plan: EditPlan, p: int) -> list[Tensor]:
    """KL(p_clean ‖ p_ablated) rows (n, T − p) of each batch of ``windows``: ``runner`` (ids
    -> what the module received, with the model's logits) run as is and with the module's
    output replaced by its ``intervene`` under ``plan`` (a forward hook: everything
    downstream reads the ablated run). A module called one step at a time has its calls
    counted: call n is position n, and the state it hands back carries the edit on."""
    steps = [0]

    def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        if in_family_call():  # the family running its module itself (its reference)
            return None
        inputs, state = fam.split_call(args, kwargs)
        offset = steps[0] if fam.step_call(inputs) else 0
        steps[0] += fam.step_call(inputs)
        call = fam.check(inputs, state)
        with faithful_matmul(call.inputs.device), family_calls():
            return fam.intervene(call, plan, output, offset)[0]

    rows = []
    for w in windows:
        clean = runner(w).logits
        steps[0] = 0
        handle = fam.module.register_forward_hook(hook, with_kwargs=True)
        try:
            ablated = runner(w).logits
        finally:
            handle.remove()
        rows.append(kl_per_position(clean, ablated)[:, p:])
    return rows


@dataclass
class CausalMemory:
    """report.json's ``causal``: the return path cut and the state ablation at the
    perturbation's position (either None where it does not apply, ``note`` says why)."""

    return_cut: ReturnCut | None
    state_ablation: StateAblation | None
    note: str | None = None

    def to_dict(self) -> dict:
        return {"return_cut": None if self.return_cut is None else self.return_cut.to_dict(),
                "state_ablation": None if self.state_ablation is None else
                self.state_ablation.to_dict(), "note": self.note}
