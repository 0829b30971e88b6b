"""``measure``: one recurrent module and its windows in, an ``Analysis`` of result objects out.

``measure`` traces the trained, perturbed and untrained models and calls one pure function
a measurement (``gatelens.analysis``); the ``Analysis`` it returns holds every result
object, and report.json, report.md, the plots and the page are all read from it
(``gatelens.report.write``). ``analyze`` does the same for a run directory. Every number is
defined in docs/methods.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from gatelens.analysis import (
    CharClasses,
    GateDistributions,
    PerturbationDecay,
    UnitTimescales,
    decompose,
    perturb_windows,
)
from gatelens.analysis.context import ContextAccumulator, ContextUsed
from gatelens.analysis.divergence import (
    DivergenceRate,
    start_vectors,
    summarize_rates,
    window_rates,
)
from gatelens.analysis.fixed_points import FixedPoints, dynamics_fixed_points, held_inputs
from gatelens.analysis.perturbation import decay_from_rows, decay_rows
from gatelens.analysis.reach import OutputReach, kl_per_position, reach_from_rows
from gatelens.analysis.saturation import GateSaturation, SaturationAccumulator
from gatelens.analysis.settings import DEFAULTS
from gatelens.analysis.spectrum import LyapunovSpectrum, SpectrumAccumulator
from gatelens.analysis.stream import ClassStats, GateStats, UnitStats
from gatelens.cells.numerics import faithful_matmul
from gatelens.errors import GatelensError
from gatelens.families.base import Call, Dynamics, Family, Reference
from gatelens.families.registry import open_family
from gatelens.families.spec import CellSpec
from gatelens.families.stepped import Recorded
from gatelens.progress import Progress
from gatelens.readout.trace import State, read, trace
from gatelens.readout.trace_types import Trace
from gatelens.readout.verify import VerifyResult, merge_results, verify_call

BURN_IN = 16  # steps of burn-in before the divergence rate is summed


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
    reach_note: str | None = None  # why there is no output-level reach, or how it was read
    baseline: Baseline | None = None
    lyapunov: LyapunovSpectrum | None = None  # None: not asked (exponents=0) or packed input
    fixed_points: FixedPoints | None = None  # None: not asked (fixed_points=False)
    context: ContextUsed | None = None  # None: the model gives no per-step logits
    saturation: GateSaturation | None = None
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


#: the working memory an analysis aims at (docs/design.md "Streaming analysis")
MEMORY_BUDGET = 3 << 28  # 768 MiB
#: bytes a window costs, per character and unit of the carried state, in float32 units:
#: the clean, perturbed and untrained traces, PyTorch's own states, the float64 split
BYTES_PER_STATE = 4 * 80


def chunk_windows(fam: Family, length: int, budget: int = MEMORY_BUDGET) -> int:
    """Windows per chunk so that one chunk's working memory stays near ``budget``.

    >>> from gatelens.families.registry import family_of
    >>> chunk_windows(family_of(torch.nn.LSTM(84, 325)), 128)
    60
    """
    units = fam.num_layers * (2 if fam.bidirectional else 1) * fam.hidden_size
    return max(1, int(budget // (length * units * BYTES_PER_STATE)))


def measure(module: nn.Module, runner: Runner, ids: Tensor, chars: list[str], *,
            perturb_pos: int = DEFAULTS.perturb_pos, seed: int = 0, init_value: float = 0.5,
            baseline: tuple[int, nn.Module, Runner] | None = None,
            model: dict | None = None, text: dict | None = None,
            timings: dict | None = None, chunk: int | None = None,
            progress: bool = False, exponents: int | str = DEFAULTS.exponents,
            fixed_points: bool = DEFAULTS.fixed_points,
            memory_windows: int = DEFAULTS.memory_windows) -> Analysis:
    """Every measurement of one recurrent ``module`` on windows ``ids`` (B, T).

    ``runner(ids)`` returns what the module saw when the model read ``ids`` (its input and
    state, and the model's logits); ``baseline`` is (step, module, runner) of the untrained
    model; ``model`` and ``text`` are report.json's blocks of the same names. Windows go
    through in chunks of ``chunk`` (default: what ``MEMORY_BUDGET`` allows), every figure
    accumulated (analysis/stream.py); the traces kept for the page are the first chunk's.
    The Lyapunov spectrum (the ``exponents`` largest, "all", 0: none) and the context used
    are measured on the first ``memory_windows`` windows (they cost far more per window than
    the rest); the fixed points, when asked, under the first chunk's held inputs.

    >>> lstm = torch.nn.LSTM(3, 4, batch_first=True)
    >>> ids = torch.randint(0, 3, (2, 12))
    >>> a = measure(lstm, encoder_runner(lambda i: torch.nn.functional.one_hot(i, 3).float()),
    ...             ids, list("abc"), perturb_pos=4)
    >>> a.verification.passed, a.perturbation.lags, a.units.n_units
    (True, [1, 2, 4], 4)
    """
    clock = timings if timings is not None else {}
    for stage in ("trace", "verification", "divergence", "spectrum", "context",
                  "fixed_points", "analyses"):
        clock.setdefault(stage, 0.0)
    B, T = ids.shape
    check_perturb_pos(perturb_pos, T)
    if len(chars) < 2:
        raise GatelensError(f"a vocabulary of {len(chars)} character cannot be perturbed")
    perturbed = perturb_windows(ids, perturb_pos, len(chars), seed)  # (B, T)
    fam = open_family(module, "measure()")
    if all(n.split(".")[1] == "reverse" for n in fam.names()):  # an ONNX reverse-only node
        raise GatelensError("a reverse-only recurrent module cannot be measured (the "
                            "measurements follow the text forward); trace it instead")
    base_fam = None if baseline is None else open_family(baseline[1], "measure()")
    step = chunk or chunk_windows(fam, T)
    units = fam.num_layers * fam.hidden_size
    acc = _Accumulators(fam.spec, B * T * units, chars)
    base_acc = None if base_fam is None else _Accumulators(base_fam.spec, B * T * units, chars)
    kept: dict = {}
    n_mem = min(B, memory_windows)
    spectrum = None if exponents in (0, None) or not n_mem else SpectrumAccumulator(
        exponents, seed, min(BURN_IN, T // 2), hidden=fam.hidden_size, windows=n_mem)
    saturation = SaturationAccumulator()
    context = None
    found = None
    bar = Progress(B, "gatelens analyze", unit="window", enabled=progress and B > step)
    for b0 in range(0, B, step):
        w, wp = ids[b0 : b0 + step], perturbed[b0 : b0 + step]
        t0 = time.perf_counter()
        cap, cap2 = runner(w), runner(wp)
        call, ref, tr = _read(fam, cap)
        _, _, tr2 = _read(fam, cap2)
        base_tr = None if base_fam is None else _read(base_fam, baseline[2](w))[2]
        clock["trace"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        acc.verification.append(verify_call(fam, call, ref, trace=tr))
        clock["verification"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        if call.layout.get("packed") is None:
            dyn = fam.dynamics(call, ref)
            if acc.starts is None:
                acc.starts = start_vectors(dyn, B, seed)
            # docs/methods.md's burn-in of 16 steps; half the window when windows are shorter
            rates = window_rates(dyn, min(BURN_IN, T // 2),
                                 [s[b0 : b0 + len(w)] for s in acc.starts])
            for name, r in rates.items():
                acc.rates.setdefault(name, []).append(r)
            clock["divergence"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            if spectrum is not None and b0 < n_mem:
                spectrum.update([head(d, n_mem - b0) for d in dyn])
            clock["spectrum"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            if fixed_points and found is None:
                d = dyn[0]
                found = dynamics_fixed_points(d, held_inputs(d, w, chars), seed=seed)
            clock["fixed_points"] += time.perf_counter() - t0
            del dyn
        t0 = time.perf_counter()
        if cap.logits is not None and b0 < n_mem and n_mem and _reach_note(
                cap.logits, cap2.logits, w, len(chars)) is None:
            if context is None:
                context = ContextAccumulator(lambda i: runner(i).logits, T)
            context.update(w[: n_mem - b0])
        clock["context"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        dec = acc.update(tr, tr2, w, perturb_pos, cap, cap2, len(chars))
        saturation.update(tr)
        if base_acc is not None:
            base_acc.gates.update(base_tr)
            base_acc.units.update(base_tr)
        if not kept:
            kept = {"trace": tr, "trace_perturbed": tr2, "decomposition": dec,
                    "baseline": base_tr}
        del call, ref, cap, cap2
        clock["analyses"] += time.perf_counter() - t0
        bar.update(len(w))
    bar.close()
    t0 = time.perf_counter()
    base = None if base_acc is None else Baseline(
        baseline[0], kept["baseline"], base_acc.gates.result(),
        base_acc.units.result(init_value))
    info = dict(text or {"windows": B, "length": T, "source": "ids"})
    info.update(chars=B * T, chunks=-(-B // step), percentiles=acc.gates.method)
    divergence = None if not acc.rates else summarize_rates(
        {k: np.concatenate(v) for k, v in acc.rates.items()}, min(BURN_IN, T // 2))
    a = Analysis(
        model=dict(model or {**fam.describe(), "step": None}), text=info, chars=list(chars),
        windows=ids, perturbed=perturbed, perturb_pos=perturb_pos, trace=kept["trace"],
        trace_perturbed=kept["trace_perturbed"],
        verification=_with_regime(merge_results(acc.verification), divergence),
        gates=acc.gates.result(),
        units=acc.units.result(init_value),
        perturbation=decay_from_rows(acc.decay, perturb_pos, T),
        decomposition=kept["decomposition"], char_classes=acc.classes.result(),
        divergence=divergence,
        reach=None if acc.reach_note else reach_from_rows(acc.reach, perturb_pos, T),
        reach_note=acc.reach_note, baseline=base,
        lyapunov=None if spectrum is None or spectrum.starts is None else spectrum.result(),
        fixed_points=found, context=None if context is None else context.result(),
        saturation=saturation.result())
    a.text["memory_windows"] = n_mem
    clock["analyses"] += time.perf_counter() - t0
    return a


def _with_regime(ver: VerifyResult, div: DivergenceRate | None) -> VerifyResult:
    """The verdict told the divergence rate's regime, so its words say what report.json's
    divergence says (a contracting model whose re-run parts by rounding is not chaotic)."""
    if div is None:
        return ver
    return replace(ver, regime=div.regime if math.isfinite(div.lyapunov_per_char) else None)


def head(d: Dynamics, n: int) -> Dynamics:
    """A Dynamics of its first ``n`` windows (the step is the same for any batch)."""
    if n >= d.inputs.shape[0]:
        return d
    return replace(d, inputs=d.inputs[:n], trajectory=[p[:n] for p in d.trajectory],
                   initial=[p[:n] for p in d.initial])


class _Accumulators:
    """What ``measure`` keeps across chunks of windows."""

    def __init__(self, spec: CellSpec, total: int, chars: list[str]) -> None:
        self.gates = GateStats(spec, total)
        self.units = UnitStats(spec)
        self.classes = ClassStats(spec, chars)
        self.decay: list[dict] = []
        self.reach: list[Tensor] = []
        self.reach_note: str | None = None
        self.verification: list[VerifyResult] = []
        self.rates: dict[str, list[np.ndarray]] = {}
        self.starts: list[Tensor] | None = None

    def update(self, tr: Trace, tr2: Trace, w: Tensor, position: int, cap: Captured,
               cap2: Captured, vocab: int) -> dict[str, Tensor] | None:
        self.gates.update(tr)
        self.units.update(tr)
        self.classes.update(tr, w)
        dec = decompose(tr, tr2, position)
        self.decay.append(decay_rows(tr, tr2, position, dec))
        note = _reach_note(cap.logits, cap2.logits, w, vocab)
        if note is not None:
            self.reach_note = self.reach_note or note
        elif self.reach_note is None:
            self.reach.append(kl_per_position(cap.logits, cap2.logits)[:, position:])
        return dec


def _read(fam: Family, cap: Captured) -> tuple[Call, Reference, Trace]:
    """A captured call checked, its reference computed once, and its anchored trace."""
    call = fam.check(cap.inputs, cap.state)
    with torch.no_grad(), faithful_matmul(call.inputs.device):
        ref = fam.reference(call)
    return call, ref, read(fam, call, ref) if call.layout.get("packed") is None else \
        trace(fam.module, cap.inputs, cap.state, hooks=False)


def _reach_note(clean: Tensor | None, perturbed: Tensor | None, ids: Tensor,
                vocab: int) -> str | None:
    """Why there is no output-level reach (None: the output is next-token logits (B, T, V))."""
    B, T = ids.shape
    if clean is None or perturbed is None:
        return "the model gave no output to compare"
    if not isinstance(clean, Tensor) or tuple(clean.shape) != (B, T, vocab):
        shape = tuple(clean.shape) if isinstance(clean, Tensor) else type(clean).__name__
        return (f"the model's output {shape} is not next-token logits ({B}, {T}, {vocab}), "
                "so only the state measurements apply")
    return None
