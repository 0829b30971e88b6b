"""What every measurement of ``MEASUREMENTS`` reads: the analysis's ``Setup`` (built once)
and each ``Chunk`` of windows (computed once, shared), and the ``Measurement`` protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar, Protocol

from torch import Tensor

from gatelens.analysis.result import Captured, Runner
from gatelens.analysis.settings import AnalysisSettings
from gatelens.analysis.split import Split
from gatelens.families.base import Call, Dynamics, Family, Reference
from gatelens.readout.trace_types import Trace

BURN_IN = 16  # steps of burn-in before the divergence rate is summed


@dataclass
class Setup:
    """What every measurement of one analysis is built from."""

    fam: Family  # the module's family
    runner: Runner  # ids -> what the module received (its logits: the context used)
    windows: int  # B
    length: int  # T
    settings: AnalysisSettings
    seed: int  # the settings' seed, or the run's
    chars: list[str]  # the vocabulary in index order
    init_value: float  # the keep gate's starting value
    baseline: tuple[int, Family] | None  # (step, family) of the untrained model
    unit: str = "characters"  # what the model reads: characters, tokens or bytes
    progress: bool = False  # the long stages' own bars (one chunk: no bar over the windows)

    @property
    def memory_windows(self) -> int:
        """Windows of the spectrum and the context used: the first ones, at most B."""
        return min(self.windows, self.settings.memory_windows)

    @property
    def gate_values(self) -> int:
        """How many values one gate takes over every window, position and unit."""
        return self.windows * self.length * self.fam.num_layers * self.fam.hidden_size

    @property
    def burn_in(self) -> int:
        """docs/methods.md's burn-in of 16 steps; half the window when windows are shorter."""
        return min(BURN_IN, self.length // 2)


@dataclass
class Chunk:
    """One chunk of windows as every measurement reads it, computed once."""

    setup: Setup
    start: int  # index of its first window among the B
    windows: Tensor  # (b, T) int64
    captured: Captured  # what the module received on the windows
    captured_perturbed: Captured  # ... and on the perturbed windows
    call: Call
    reference: Reference  # PyTorch's own states, once per chunk
    trace: Trace  # the anchored read-out of the windows
    trace_perturbed: Trace
    base_trace: Trace | None  # the untrained model's, when there is one

    @cached_property
    def dynamics(self) -> list[Dynamics] | None:
        """The float64 dynamics s_t = F(s_{t-1}, x_t) per layer; None for a packed input."""
        if self.call.layout.get("packed") is not None:
            return None
        return self.setup.fam.dynamics(self.call, self.reference)

    @cached_property
    def decomposition(self) -> Split | None:
        """The perturbation's split into forget and return paths, read one layer at a time
        (analysis/split.py): the perturbation's curves and the return path cut both read it.
        None for a cell with no keep gate."""
        return Split.of(self.trace, self.trace_perturbed, self.setup.settings.perturb_pos)

    @property
    def memory(self) -> int:
        """How many of this chunk's windows are among the first ``memory_windows``."""
        return max(0, min(len(self.windows), self.setup.memory_windows - self.start))

    @cached_property
    def reach_note(self) -> str | None:
        """Why this chunk's outputs give no output-level reach (None: they are logits)."""
        return reach_note(self.captured.logits, self.captured_perturbed.logits, self.windows,
                          len(self.setup.chars))


class Measurement(Protocol):
    """One accumulator of ``MEASUREMENTS``."""

    stage: ClassVar[str]  # the stage it is timed and shown under
    report: ClassVar[tuple[str, ...]]  # the report.json sections it fills

    def update(self, chunk: Chunk) -> None: ...

    def result(self, found: dict) -> dict: ...

    def windows_read(self, windows: int) -> int: ...


class Accumulator:
    """What the measurements share: built from the setup unless ``build`` says it does
    not apply (a measurement that is not asked or has nothing to read returns None), and
    reading every window unless ``windows_read`` says fewer."""

    @classmethod
    def build(cls, setup: Setup) -> Accumulator | None:
        return cls(setup)  # type: ignore[call-arg]

    def windows_read(self, windows: int) -> int:
        """How many of the analysis's ``windows`` it reads (the first ones): what the time
        estimate after the first chunk counts its time for (analysis/estimate.py)."""
        return windows


def reach_note(clean: Tensor | None, perturbed: Tensor | None, ids: Tensor,
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
