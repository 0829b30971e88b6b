"""What ``measure`` works with and returns: what a model gave for one of its recurrent
modules (``Captured``, from a ``Runner``), the untrained model's figures (``Baseline``) and
every result object of one analysis (``Analysis``; report.json is ``Analysis.report``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from gatelens.analysis.causal import CausalMemory
from gatelens.analysis.classes import CharClasses
from gatelens.analysis.context import ContextUsed
from gatelens.analysis.divergence import DivergenceRate
from gatelens.analysis.fixed_points import FixedPoints
from gatelens.analysis.gates import GateDistributions
from gatelens.analysis.perturbation import PerturbationDecay
from gatelens.analysis.reach import OutputReach
from gatelens.analysis.saturation import GateSaturation
from gatelens.analysis.spectrum import LyapunovSpectrum
from gatelens.analysis.units import UnitTimescales
from gatelens.families.stepped import Recorded
from gatelens.readout.trace import State
from gatelens.readout.trace_types import Trace
from gatelens.readout.verify import VerifyResult


@dataclass
class Captured:
    """What one forward pass of a model gave for one of its recurrent modules."""

    #: the module's input, as the module was called; or a trajectory stitched from calls of
    #: one step each (families/stepped.Recorded: a cell in a loop, a per-step decoder)
    inputs: Tensor | PackedSequence | Recorded
    state: State = None  # the initial state it was called with (None: zeros)
    logits: Tensor | None = None  # (B, T, V) the model's next-token logits, if it gives them


#: ids (B, T) -> what the recurrent module saw when the model read them.
Runner = Callable[[Tensor], Captured]

#: bytes of the first chunk's two traces an analysis keeps for its page (``kept_for_page``):
#: held through every later chunk, and many times what the page draws (``BYTE_BUDGET``,
#: 16 windows at most); 512 MiB set the peak of a 24-layer Mamba-2's second window
TRACES_KEPT = 128 * 2**20


def kept_for_page(tr: Trace, tr2: Trace, budget: int | None = None) -> dict[str, Trace]:
    """The first chunk's traces as the analysis keeps them for its page: whole within
    ``budget`` (``TRACES_KEPT``); else the first windows that fit; else the first window and
    each signal's first units that fit (``meta["kept_units"]``: one window of a 24-layer
    Mamba of mamba-130m's width is 1.2 GB for the two traces).

    >>> from gatelens.readout.trace_types import Trace
    >>> t = Trace("lstm", 1, False, {"layer0.f": torch.zeros(4, 8, 16)})
    >>> [tuple(k["trace"]["layer0.f"].shape) for k in (kept_for_page(t, t, b) for b in
    ...                                                (4096, 2048, 256))]
    [(4, 8, 16), (2, 8, 16), (1, 8, 4)]
    """
    budget = TRACES_KEPT if budget is None else budget
    one = sum(v[:1].numel() * v.element_size() for t in (tr, tr2) for v in t.values())
    windows = next(iter(tr.values())).shape[0]
    if one * windows <= budget:  # held whole (a trace read layer by layer, in full)
        return {k: t if isinstance(t.tensors, dict) else replace(t, tensors=dict(t.tensors))
                for k, t in (("trace", tr), ("trace_perturbed", tr2))}
    n = budget // max(one, 1)
    if n >= 1:
        # copies: a view would keep the whole chunk's tensors (or a replayed layer) alive
        return {k: replace(t, tensors={name: v[:n].clone() for name, v in t.items()}, h_n=None,
                           c_n=None, lengths=None if t.lengths is None else t.lengths[:n])
                for k, t in (("trace", tr), ("trace_perturbed", tr2))}
    column = sum(v[:1].numel() // max(v.shape[-1], 1) * v.element_size()
                 for t in (tr, tr2) for v in t.values())  # one window, one unit of each
    units = max(1, budget // max(column, 1))

    def cut(t: Trace) -> Trace:
        meta = {**t.meta, "kept_units": units}
        if meta.get("state_units") is not None:
            meta["state_units"] = [u[:units] for u in meta["state_units"]]
        return replace(t, tensors={name: v[:1, :, :units].clone() for name, v in t.items()},
                       h_n=None, c_n=None, lengths=None, meta=meta)
    return {"trace": cut(tr), "trace_perturbed": cut(tr2)}


def encoder_runner(encode: Callable[[Tensor], Tensor],
                   logits: Callable[[Tensor], Tensor] | None = None) -> Runner:
    """A runner for a module fed ``encode(ids)`` directly (a gatelens run: one-hot or an
    embedding), with the model's logits from ``logits(ids)`` when given."""
    def run(ids: Tensor) -> Captured:
        with torch.no_grad():
            return Captured(encode(ids), None, None if logits is None else logits(ids))
    return run


@dataclass
class Baseline:
    """The untrained model (the step-0 checkpoint) on the same windows."""

    step: int
    trace: Trace
    gates: GateDistributions
    units: UnitTimescales | None


@dataclass
class Analysis:
    """Everything one analysis measured, as result objects; ``report`` is report.json."""

    model: dict  # report.json's "model": cell, sizes, step, ...
    text: dict  # report.json's "text": windows, length, source
    chars: list[str]  # vocabulary in index order
    windows: Tensor  # (B, T) int64 character indices
    perturbed: Tensor  # (B, T) the windows with x_p replaced
    perturb_pos: int
    trace: Trace  # the model on the first chunk's windows, as kept for the page
    trace_perturbed: Trace  # ... on the perturbed windows: what the measurements read of it
    # (analysis/split.py ``perturbed_letters``: the state and output; LSTM f, i, g; GRU z, n)
    verification: VerifyResult
    gates: GateDistributions
    units: UnitTimescales | None  # None: no keep gate (plain RNN)
    perturbation: PerturbationDecay  # holds the decay curves at every lag
    decomposition: dict[str, Tensor] | None  # measured / forget_path / return_path (B, T, S)
    char_classes: CharClasses
    divergence: DivergenceRate | None = None  # None: not defined for this input (packed)
    reach: OutputReach | None = None  # None: the model gives no per-step logits
    reach_note: str | None = None  # why there is no output-level reach
    baseline: Baseline | None = None
    lyapunov: LyapunovSpectrum | None = None  # None: not asked (exponents=0) or packed input
    fixed_points: FixedPoints | None = None  # None: not asked (fixed_points=False)
    context: ContextUsed | None = None  # None: the model gives no per-step logits
    saturation: GateSaturation | None = None
    causal: CausalMemory | None = None  # None: the family is neither cut nor ablated
    history: dict | None = None  # validation loss over training (runs only)
    control: dict | None = None  # a synthetic corpus's memoryless and best losses (runs only)
    best_step: int | None = None
    out: Path | None = None  # where it was written
    plots: list[Path] = field(default_factory=list)

    @cached_property
    def report(self) -> dict:
        """report.json's content, assembled from the result objects."""
        from gatelens.report.json_report import build_report

        return build_report(self)

    @property
    def baseline_trace(self) -> Trace:
        """The untrained model's trace; the trained one when there is no step 0."""
        return self.trace if self.baseline is None else self.baseline.trace

    def _repr_html_(self) -> str:
        """Jupyter shows the same page as report.html."""
        from gatelens.report.html import HtmlReport

        return HtmlReport.from_analysis(self)._repr_html_()
