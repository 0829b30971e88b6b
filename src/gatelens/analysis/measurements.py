"""The measurements ``measure`` runs, as one protocol, in one list.

A measurement is an accumulator: built once per analysis from a ``Setup`` (``build``
returns None when it does not apply: not asked, or no keep gate), handed every ``Chunk`` of
windows (``update``: the chunk's traces, PyTorch's own states and the dynamics are read
once and shared; ``windows_read``: how many, the first ones, it reads), and asked once at
the end for the ``Analysis`` fields it fills (``result``; its "text" entry, if any, joins
report.json's text block). Each names its stage (``stage``: timed and shown under it) and
the report.json sections it fills (``report``; the rendering is ``gatelens.report``'s).

Adding a measurement is its file (the pure function, in ``gatelens.analysis``), one class
here and one line in ``MEASUREMENTS``, and its rendering in ``gatelens.report``.

>>> [m.__name__ for m in MEASUREMENTS][:3]
['Divergence', 'Verification', 'Spectrum']
>>> sorted({m.stage for m in MEASUREMENTS})
['analyses', 'context', 'divergence', 'fixed_points', 'spectrum', 'verification']
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from gatelens.analysis.causal import (
    REFUSED,
    CausalMemory,
    StateAblation,
    ablates,
    ablation_plan,
    ablation_rows,
    cut_from_rows,
    cut_rows,
    cut_trace,
    cuts,
    why,
)
from gatelens.analysis.chunk import Accumulator, Chunk, Setup
from gatelens.analysis.context import MAX_CHARS, ContextAccumulator, chars_per_call
from gatelens.analysis.divergence import (
    DivergenceRate,
    start_vectors,
    summarize_rates,
    window_rates,
)
from gatelens.analysis.fixed_points import dynamics_fixed_points, held_inputs
from gatelens.analysis.perturbation import decay_from_rows, decay_rows
from gatelens.analysis.reach import kl_per_position, reach_from_rows
from gatelens.analysis.result import Baseline
from gatelens.analysis.saturation import SaturationAccumulator
from gatelens.analysis.spectrum import SpectrumAccumulator
from gatelens.analysis.stream import ClassStats, GateStats, UnitStats
from gatelens.cells.names import layer_name
from gatelens.cells.numerics import faithful_matmul
from gatelens.readout.merge import merge_results
from gatelens.readout.verify import VerifyResult, verify_call

#: bytes of the first chunk's split the analysis keeps for the page (its windows that fit)
SPLIT_KEPT = 256 * 2**20


class Divergence(Accumulator):
    """The divergence rate: how fast nearby states part (docs/methods.md)."""

    stage, report = "divergence", ("divergence",)

    def __init__(self, setup: Setup) -> None:
        self.setup, self.rates, self.starts = setup, {}, None

    def update(self, chunk: Chunk) -> None:
        dyn = chunk.dynamics
        if dyn is None:
            return
        if self.starts is None:
            self.starts = start_vectors(dyn, self.setup.windows, self.setup.seed)
        n = len(chunk.windows)
        rates = window_rates(dyn, self.setup.burn_in,
                             [s[chunk.start : chunk.start + n] for s in self.starts])
        for name, r in rates.items():
            self.rates.setdefault(name, []).append(r)

    def result(self, found: dict) -> dict:
        return {"divergence": None if not self.rates else summarize_rates(
            {k: np.concatenate(v) for k, v in self.rates.items()}, self.setup.burn_in)}


class Verification(Accumulator):
    """The one-step and free-running checks against the module's own states."""

    stage, report = "verification", ("verification",)

    def __init__(self, setup: Setup) -> None:
        self.setup, self.parts = setup, []

    def update(self, chunk: Chunk) -> None:
        res = verify_call(self.setup.fam, chunk.call, chunk.reference, trace=chunk.trace)
        depth = res.meta.get("float64_rejudge")
        if depth and depth.get("windows"):  # the chunk's window among all the windows
            depth["windows"] = [chunk.start + w for w in depth["windows"]]
        self.parts.append(res)

    def result(self, found: dict) -> dict:
        return {"verification": with_regime(merge_results(self.parts), found.get("divergence"))}


class Spectrum(Accumulator):
    """The Lyapunov spectrum on the first ``memory_windows`` windows."""

    stage, report = "spectrum", ("lyapunov",)

    def __init__(self, setup: Setup) -> None:
        s = setup.settings
        self.acc = SpectrumAccumulator(s.exponents, setup.seed, setup.burn_in,
                                       hidden=setup.fam.hidden_size, windows=setup.memory_windows,
                                       progress=setup.progress)

    @classmethod
    def build(cls, setup: Setup) -> Spectrum | None:
        asked = setup.settings.exponents not in (0, None) and setup.memory_windows
        return cls(setup) if asked else None

    def update(self, chunk: Chunk) -> None:
        if chunk.memory and chunk.dynamics is not None:
            self.acc.update([d.first(chunk.memory) for d in chunk.dynamics])

    def windows_read(self, windows: int) -> int:  # the first memory_windows; the cost rule's
        limit = self.acc.limit if self.acc.starts is not None else windows
        return min(windows, self.acc.windows or windows, limit)

    def result(self, found: dict) -> dict:
        return {"lyapunov": None if self.acc.starts is None else self.acc.result()}


class FixedPointSearch(Accumulator):
    """Fixed points under the first chunk's held inputs (asked with ``fixed_points``)."""

    stage, report = "fixed_points", ("fixed_points",)

    def __init__(self, setup: Setup) -> None:
        self.setup, self.found = setup, None

    @classmethod
    def build(cls, setup: Setup) -> FixedPointSearch | None:
        return cls(setup) if setup.settings.fixed_points else None

    def windows_read(self, windows: int) -> int:
        return min(windows, 1)  # under the first chunk's held inputs only

    def update(self, chunk: Chunk) -> None:
        if self.found is None and chunk.dynamics is not None:
            d = chunk.dynamics[0]
            self.found = dynamics_fixed_points(d, held_inputs(d, chunk.windows, self.setup.chars),
                                               seed=self.setup.seed)

    def result(self, found: dict) -> dict:
        return {"fixed_points": self.found}


class Context(Accumulator):
    """The context used, by truncation, on the first ``memory_windows`` windows: the whole
    model's, so a runner's ``shared`` dict (Lens's, one an analysis) hands it on."""

    stage, report = "context", ("context",)

    def __init__(self, setup: Setup) -> None:
        self.setup, self.memo = setup, getattr(setup.runner, "shared", None)
        self.acc = None if self.memo is None else self.memo.get("context")
        self.reused = self.acc is not None

    @classmethod
    def build(cls, setup: Setup) -> Context | None:
        return cls(setup) if setup.memory_windows else None

    def windows_read(self, windows: int) -> int:
        return min(windows, self.setup.memory_windows)

    def update(self, chunk: Chunk) -> None:
        if chunk.memory and chunk.reach_note is None and not self.reused:
            if self.acc is None:
                runner = self.setup.runner
                pad = getattr(runner, "pad_to", None)  # a padded model has its own bound
                self.acc = ContextAccumulator(lambda i: runner(i).logits, self.setup.length,
                    max_chars=MAX_CHARS if pad else chars_per_call(self.setup.fam.hidden_size),
                    logits_at=getattr(runner, "logits_at", None), pad_to=pad)
            self.acc.update(chunk.windows[: chunk.memory])

    def result(self, found: dict) -> dict:
        if self.memo is not None and self.acc is not None:
            self.memo["context"] = self.acc
        return {"context": None if self.acc is None else self.acc.result()}


class Gates(Accumulator):
    """Gate distributions, pooled over layers and every position."""

    stage, report = "analyses", ("gates",)

    def __init__(self, setup: Setup) -> None:
        self.acc = GateStats(setup.fam.spec, setup.gate_values)

    def update(self, chunk: Chunk) -> None:
        self.acc.update(chunk.trace)

    def result(self, found: dict) -> dict:
        return {"gates": self.acc.result(), "text": {"percentiles": self.acc.method}}


class Units(Accumulator):
    """Per-unit keep-gate timescales (None: the module has no keep gate)."""

    stage, report = "analyses", ("units",)

    def __init__(self, setup: Setup) -> None:
        self.setup, self.acc = setup, UnitStats(setup.fam.spec)

    def update(self, chunk: Chunk) -> None:
        self.acc.update(chunk.trace)

    def result(self, found: dict) -> dict:
        return {"units": self.acc.result(self.setup.init_value)}


class Classes(Accumulator):
    """Gates by the class of the token read (space, newline, punctuation, ...)."""

    stage, report = "analyses", ("char_classes",)

    def __init__(self, setup: Setup) -> None:
        self.acc = ClassStats(setup.fam.spec, setup.chars, setup.unit)

    def update(self, chunk: Chunk) -> None:
        self.acc.update(chunk.trace, chunk.windows)

    def result(self, found: dict) -> dict:
        return {"char_classes": self.acc.result()}


class Perturbation(Accumulator):
    """The perturbation decay and its split into forget and return paths."""

    stage, report = "analyses", ("perturbation", "decomposition")

    def __init__(self, setup: Setup) -> None:
        self.setup, self.rows, self.first = setup, [], None

    def update(self, chunk: Chunk) -> None:
        p = self.setup.settings.perturb_pos
        dec = chunk.decomposition
        self.rows.append(decay_rows(chunk.trace, chunk.trace_perturbed, p, dec))
        if not self.rows[1:] and dec is not None:
            # the page shows the first chunk's split: of the windows that fit SPLIT_KEPT
            n = min(dec.windows, SPLIT_KEPT * dec.windows // max(dec.nbytes(), 1))
            self.first = dec.whole(n) if n else None

    def result(self, found: dict) -> dict:
        p, T = self.setup.settings.perturb_pos, self.setup.length
        return {"perturbation": decay_from_rows(self.rows, p, T), "decomposition": self.first}


class Reach(Accumulator):
    """The output-level reach: KL of the next-token distribution by lag."""

    stage, report = "analyses", ("output_reach", "output_reach_note")

    def __init__(self, setup: Setup) -> None:
        self.setup, self.curves, self.note = setup, [], None

    def update(self, chunk: Chunk) -> None:
        if chunk.reach_note is not None:
            self.note = self.note or chunk.reach_note
        elif self.note is None:
            self.curves.append(kl_per_position(chunk.captured.logits,
                                               chunk.captured_perturbed.logits)
                               [:, self.setup.settings.perturb_pos:])

    def result(self, found: dict) -> dict:
        p, T = self.setup.settings.perturb_pos, self.setup.length
        return {"reach": None if self.note else reach_from_rows(self.curves, p, T),
                "reach_note": self.note}


class Causal(Accumulator):
    """The causal memory at the perturbation's position: the return path cut on every
    window, the state ablation on the first ``memory_windows`` (the mean state at p is
    every window's, so the ablation runs once all chunks are in)."""

    stage, report = "analyses", ("causal",)

    def __init__(self, setup: Setup) -> None:
        self.setup, self.rows, self.note = setup, [], None
        self.letters, self.parts = cuts(setup.fam), ablates(setup.fam)
        self.sums: dict[str, torch.Tensor] = {}
        self.count, self.kept = 0, []

    @classmethod
    def build(cls, setup: Setup) -> Causal | None:
        fam = setup.fam
        return None if fam.stepped or (cuts(fam) is None and ablates(fam) is None) else cls(setup)

    def update(self, chunk: Chunk) -> None:
        fam, p = self.setup.fam, self.setup.settings.perturb_pos
        if chunk.call.layout.get("packed") is not None:
            self.note = "a packed input is not intervened on"
            return
        if self.letters and self.note is None:
            cap = chunk.captured_perturbed
            try:
                with torch.no_grad(), faithful_matmul(chunk.call.inputs.device):
                    cut = cut_trace(fam, fam.check(cap.inputs, cap.state), chunk.trace, p,
                                    chunk.trace_perturbed)
            except REFUSED as e:
                self.note = why(e)
            else:
                self.rows.append(cut_rows(chunk.trace, chunk.trace_perturbed, cut, p,
                                          chunk.decomposition))
        if self.parts:
            for k in range(fam.num_layers):
                for s in self.parts:
                    name = f"{layer_name(k)}.{s}"
                    v = chunk.trace[name][:, p].double().sum(dim=0)  # (W,): at p
                    self.sums[name] = v if name not in self.sums else self.sums[name] + v
            self.count += len(chunk.windows)
            if chunk.memory and chunk.reach_note is None:
                self.kept.append(chunk.windows[: chunk.memory])

    def _ablation(self) -> StateAblation | None:
        if not self.kept or self.note is not None:
            return None
        fam, p = self.setup.fam, self.setup.settings.perturb_pos
        plan = ablation_plan(fam, {n: v / self.count for n, v in self.sums.items()}, p)
        rows = ablation_rows(fam, self.setup.runner, self.kept, plan, p)
        return StateAblation(p, list(self.parts), reach_from_rows(rows, p, self.setup.length))

    def result(self, found: dict) -> dict:
        p, T = self.setup.settings.perturb_pos, self.setup.length
        cut = cut_from_rows(self.rows, p, T, self.letters) if self.rows and self.note is None \
            else None
        try:
            ablation = self._ablation()
        except REFUSED as e:
            self.note, ablation = self.note or why(e), None
        return {"causal": CausalMemory(cut, ablation, self.note)}


class Saturation(Accumulator):
    """Gate saturation: how often each gate sits near its bounds."""

    stage, report = "analyses", ("saturation",)

    def __init__(self, setup: Setup) -> None:
        self.acc = SaturationAccumulator()

    def update(self, chunk: Chunk) -> None:
        self.acc.update(chunk.trace)

    def result(self, found: dict) -> dict:
        return {"saturation": self.acc.result()}


class Untrained(Accumulator):
    """The untrained model's (step 0) gates and timescales on the same windows."""

    stage, report = "analyses", ("baseline", "shift_from_init")

    def __init__(self, setup: Setup) -> None:
        step, fam = setup.baseline
        self.setup, self.step, self.first = setup, step, None
        self.gates = GateStats(fam.spec, setup.gate_values)
        self.units = UnitStats(fam.spec)

    @classmethod
    def build(cls, setup: Setup) -> Untrained | None:
        return None if setup.baseline is None else cls(setup)

    def update(self, chunk: Chunk) -> None:
        self.gates.update(chunk.base_trace)
        self.units.update(chunk.base_trace)
        if self.first is None:
            self.first = chunk.base_trace  # the page's untrained trace: the first chunk's

    def result(self, found: dict) -> dict:
        return {"baseline": Baseline(self.step, self.first, self.gates.result(),
                                     self.units.result(self.setup.init_value))}


#: every measurement, in the order each chunk is handed to them
MEASUREMENTS: tuple[type, ...] = (Divergence, Verification, Spectrum, FixedPointSearch, Context,
                                  Gates, Units, Classes, Perturbation, Reach, Causal,
                                  Saturation, Untrained)


def with_regime(ver: VerifyResult, div: DivergenceRate | None) -> VerifyResult:
    """The verdict told the divergence rate's regime, so its words say what report.json's
    divergence says (a contracting model whose re-run parts by rounding is not chaotic)."""
    if div is None:
        return ver
    return replace(ver, regime=div.regime if math.isfinite(div.lyapunov_per_char) else None)
