"""``measure``: one recurrent module and its windows in, an ``Analysis`` of result objects out.

``measure`` traces the trained, perturbed and untrained models and calls one pure function
a measurement (``gatelens.analysis``); the ``Analysis`` it returns holds every result
object, and report.json, report.md, the plots and the page are all read from it
(``gatelens.report.write``). ``analyze`` does the same for a run directory. Every number is
defined in docs/methods.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from gatelens.analysis import (
    CharClasses,
    GateDistributions,
    PerturbationDecay,
    UnitTimescales,
    char_classes,
    decompose,
    gate_distributions,
    perturb_windows,
    perturbation_decay,
    unit_timescales,
)
from gatelens.analysis.divergence import DivergenceRate, rate_of
from gatelens.analysis.reach import OutputReach, output_reach
from gatelens.cells.numerics import faithful_matmul
from gatelens.errors import GatelensError
from gatelens.families.base import Call, Family, Reference
from gatelens.families.registry import open_family
from gatelens.readout.trace import State, read, trace
from gatelens.readout.trace_types import Trace
from gatelens.readout.verify import VerifyResult, verify_call

BURN_IN = 16  # steps of burn-in before the divergence rate is summed


@dataclass
class Captured:
    """What one forward pass of a model gave for one of its recurrent modules."""

    inputs: Tensor | PackedSequence  # the module's input, as the module was called
    state: State = None  # the initial state it was called with (None: zeros)
    logits: Tensor | None = None  # (B, T, V) the model's next-token logits, if it gives them


#: ids (B, T) -> what the recurrent module saw when the model read them.
Runner = Callable[[Tensor], Captured]


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
    trace: Trace  # the model on the windows
    trace_perturbed: Trace  # the model on the perturbed windows
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


def check_perturb_pos(position: int, length: int) -> None:
    """A perturbation position must leave at least lag 1 inside the window.

    >>> check_perturb_pos(127, 128)
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: --perturb-pos 127 leaves no lag in 128-character windows (0..126)
    """
    if position < 0 or position + 1 >= length:
        raise GatelensError(f"--perturb-pos {position} leaves no lag in {length}-character "
                            f"windows (0..{length - 2})")


def measure(module: nn.Module, runner: Runner, ids: Tensor, chars: list[str], *,
            perturb_pos: int = 32, seed: int = 0, init_value: float = 0.5,
            baseline: tuple[int, nn.Module, Runner] | None = None,
            model: dict | None = None, text: dict | None = None,
            timings: dict | None = None) -> Analysis:
    """Every measurement of one recurrent ``module`` on windows ``ids`` (B, T).

    ``runner(ids)`` returns what the module saw when the model read ``ids`` (its input and
    state, and the model's logits); ``baseline`` is (step, module, runner) of the untrained
    model; ``model`` and ``text`` are report.json's blocks of the same names.

    >>> lstm = torch.nn.LSTM(3, 4, batch_first=True)
    >>> ids = torch.randint(0, 3, (2, 12))
    >>> a = measure(lstm, encoder_runner(lambda i: torch.nn.functional.one_hot(i, 3).float()),
    ...             ids, list("abc"), perturb_pos=4)
    >>> a.verification.passed, a.perturbation.lags, a.units.n_units
    (True, [1, 2, 4], 4)
    """
    clock = timings if timings is not None else {}
    check_perturb_pos(perturb_pos, ids.shape[1])
    if len(chars) < 2:
        raise GatelensError(f"a vocabulary of {len(chars)} character cannot be perturbed")
    perturbed = perturb_windows(ids, perturb_pos, len(chars), seed)  # (B, T)
    fam = open_family(module, "measure()")
    t0 = time.perf_counter()
    cap, cap2 = runner(ids), runner(perturbed)
    call, ref, tr = _read(fam, cap)
    _, _, tr2 = _read(fam, cap2)
    base_tr = None
    if baseline is not None:
        _, _, base_tr = _read(open_family(baseline[1], "measure()"), baseline[2](ids))
    clock["trace"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ver = verify_call(fam, call, ref, trace=tr)
    clock["verification"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    div = None
    if call.layout.get("packed") is None:
        # docs/methods.md's burn-in of 16 steps; half the window when windows are shorter
        div = rate_of(fam.dynamics(call, ref), seed=seed,
                      burn_in=min(BURN_IN, ids.shape[1] // 2))
    clock["divergence"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    reach, note = _reach(cap.logits, cap2.logits, ids, perturb_pos, len(chars))
    dec = decompose(tr, tr2, perturb_pos)
    base = None if base_tr is None else Baseline(
        baseline[0], base_tr, gate_distributions(base_tr), unit_timescales(base_tr, init_value))
    a = Analysis(
        model=dict(model or {"cell": tr.cell, "hidden": module.hidden_size,
                             "layers": module.num_layers, "step": None}),
        text=dict(text or {"windows": ids.shape[0], "length": ids.shape[1], "source": "ids"}),
        chars=list(chars), windows=ids, perturbed=perturbed, perturb_pos=perturb_pos,
        trace=tr, trace_perturbed=tr2, verification=ver, gates=gate_distributions(tr),
        units=unit_timescales(tr, init_value),
        perturbation=perturbation_decay(tr, tr2, perturb_pos, decomposition=dec),
        decomposition=dec, char_classes=char_classes(tr, ids, chars), divergence=div,
        reach=reach, reach_note=note, baseline=base)
    clock["analyses"] = time.perf_counter() - t0
    return a


def _read(fam: Family, cap: Captured) -> tuple[Call, Reference, Trace]:
    """A captured call checked, its reference computed once, and its anchored trace."""
    call = fam.check(cap.inputs, cap.state)
    with torch.no_grad(), faithful_matmul(call.inputs.device):
        ref = fam.reference(call)
    return call, ref, read(fam, call, ref) if call.layout.get("packed") is None else \
        trace(fam.module, cap.inputs, cap.state)


def _reach(clean: Tensor | None, perturbed: Tensor | None, ids: Tensor, position: int,
           vocab: int) -> tuple[OutputReach | None, str | None]:
    """Output-level reach when the model's output is next-token logits (B, T, V)."""
    B, T = ids.shape
    if clean is None or perturbed is None:
        return None, "the model gave no output to compare"
    if not isinstance(clean, Tensor) or tuple(clean.shape) != (B, T, vocab):
        shape = tuple(clean.shape) if isinstance(clean, Tensor) else type(clean).__name__
        return None, (f"the model's output {shape} is not next-token logits ({B}, {T}, "
                      f"{vocab}), so only the state measurements apply")
    return output_reach(clean, perturbed, position), None
