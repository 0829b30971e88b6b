"""What an analysis will cost, said before it runs: its chunks and the working memory of
one (from the widths of the first chunk's trace), then, once the first chunk is timed, the
time of all of them and the peak resident memory measured.

>>> print(plan_line(windows=64, length=128, step=16, per_token=10_000, module=2**20))
gatelens analyze: 64 windows × 128 in 4 chunks of 16; working memory ≈ 255 MiB a chunk
>>> print(time_line(first=2.0, windows=64, step=16))
gatelens analyze: the first chunk took 2.0 s; all 4 ≈ 8.0 s
>>> print(time_line(first=2.0, windows=64, step=16, peak=3 * 2**29))
gatelens analyze: the first chunk took 2.0 s; all 4 ≈ 8.0 s; peak resident memory so far 1.5 GiB

A stage that reads only the first windows (the spectrum under its cost rule, the context
used) counts its first chunk's time once for each chunk holding them, not for every chunk
(``fewer``: {stage: (its seconds in the first chunk, the windows it reads)}):

>>> print(time_line(first=2.0, windows=64, step=16, fewer={"spectrum": (1.0, 16)}))
gatelens analyze: the first chunk took 2.0 s; all 4 ≈ 5.0 s

Several modules (a hybrid's recurrent layers) are measured one after another
(``each_module``): a line names each before it starts, and once it is done, the time it
took and what the modules left will take at that rate.

>>> import io
>>> log = io.StringIO()
>>> for path in each_module(["a", "b"], True, stream=log, clock=iter([0, 3, 3, 6]).__next__):
...     pass
>>> print(log.getvalue().strip())
gatelens analyze: a (module 1 of 2)
gatelens analyze: a took 3.0 s; the 1 module left ≈ 3.0 s
gatelens analyze: b (module 2 of 2)
gatelens analyze: b took 3.0 s; all 2 took 6.0 s

Two counts, for two purposes. The chunk size (``chunk_bytes``) is a rule of thumb counted
per coordinate of the carried state, known before anything runs; it over-counts a state
kept per head, so it never puts more windows in a chunk than the state allows. The line
printed once the first chunk's trace is read, before any measurement runs
(``working_bytes``), counts what a chunk really holds: the bytes a token of the clean trace
takes (every signal of every layer) times ``HELD_PER_TRACE``, one layer's share of it times
``HELD_PER_LAYER``, and the float64 copy of the module the verification makes. The peak
after the first chunk is the process's own, measured.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TextIO

__all__ = ["HELD_PER_LAYER", "HELD_PER_TRACE", "chunk_bytes", "each_module", "peak_resident",
           "plan_line", "stage_line", "time_line", "working_bytes"]

#: bytes a window costs, per character and unit of the carried state, in float32 units:
#: the clean, perturbed and untrained traces, PyTorch's own states, the float64 split
BYTES_PER_STATE = 4 * 80
#: of which what the whole stack holds at once (the traces, the module's own states, the
#: dynamics' tangents); the rest is held one layer at a time (the split, the one-step
#: checks): measured at 24 layers of mamba-130m's shape, one window, ~60 bytes
HELD_PER_STATE = 4 * 16


def chunk_bytes(step: int, length: int, units: int, layers: int = 1) -> int:
    """The working memory one chunk of ``step`` windows aims at (``measure``'s rule):
    ``units`` of the carried state over ``layers`` layers.

    >>> chunk_bytes(1, 128, 590_000, 24) / 2**30 < chunk_bytes(1, 128, 590_000) / 2**30 / 4
    True
    """
    per = HELD_PER_STATE + (BYTES_PER_STATE - HELD_PER_STATE) / max(1, layers)
    return int(step * length * units * per)


#: what a chunk holds at its peak over its clean trace's bytes, for the whole stack (the
#: perturbed run's states and outputs, PyTorch's own states, the dynamics' tangents) and for
#: one layer's share (its float64 split and checks, held a layer at a time); fitted on
#: measured peaks less the resident memory before and the float64 copy (an LSTM of 325
#: units in chunks of 60 windows, 12 times its trace; 24 Mamba-1 layers, 3.7; 24 Mamba-2
#: layers, 1.8: docs/report.md "Streaming")
HELD_PER_TRACE, HELD_PER_LAYER = 3.0, 10.0


def working_bytes(step: int, length: int, per_token: int, module: int = 0,
                  layers: int = 1) -> int:
    """The working memory of one chunk of ``step`` windows × ``length`` tokens whose clean
    trace over ``layers`` layers takes ``per_token`` bytes a token, with ``module`` bytes
    of float64 weights.

    >>> working_bytes(2, 128, 1000) == 2 * working_bytes(1, 128, 1000)
    True
    >>> working_bytes(1, 100, 1000, layers=24) < working_bytes(1, 100, 1000) / 3
    True
    """
    held = HELD_PER_TRACE + HELD_PER_LAYER / max(1, layers)
    return int(step * length * per_token * held) + module


def _chunks(windows: int, step: int) -> int:
    return -(-windows // step)


def plan_line(*, windows: int, length: int, step: int, per_token: int, module: int = 0,
              layers: int = 1) -> str:
    """The line printed before the first chunk is measured (``working_bytes``'s count)."""
    n = _chunks(windows, step)
    size = working_bytes(min(step, windows), length, per_token, module, layers)
    said = f"{size / 2**20:.0f} MiB" if size < 2**30 else f"{size / 2**30:.1f} GiB"
    return (f"gatelens analyze: {windows} windows × {length} in {n} chunk{'s' * (n > 1)} of "
            f"{min(step, windows)}; working memory ≈ {said} a chunk")


def time_line(*, first: float, windows: int, step: int, peak: int | None = None,
              fewer: Mapping[str, tuple[float, int]] | None = None) -> str:
    """The line printed after the first chunk, when more follow; with ``peak`` (bytes,
    ``peak_resident``) the process's peak resident memory so far. ``fewer``: the stages that
    read only the first windows, {stage: (seconds in the first chunk, windows read)}; the
    rest of the first chunk's time is counted for every chunk."""
    n = _chunks(windows, step)
    some = (fewer or {}).values()
    total = (first - sum(took for took, _ in some)) * windows / min(step, windows) + sum(
        took * _chunks(min(read, windows), step) for took, read in some)
    took = f"gatelens analyze: the first chunk took {first:.1f} s; all {n} ≈ "
    line = took + (f"{total:.1f} s" if total < 120 else f"{total / 60:.1f} min")
    return line if peak is None else f"{line}; peak resident memory so far {peak / 2**30:.1f} GiB"


def _took(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def each_module(paths: Sequence[str], progress: bool, *, stream: TextIO | None = None,
                clock: Callable[[], float] = time.perf_counter) -> Iterator[str]:
    """``paths`` one by one, the modules an analysis measures; with ``progress`` and more
    than one, a line before each (its path, its place) and one after it (its time, and the
    modules left at the mean time a module has taken so far)."""
    n = len(paths)
    if not progress or n < 2:
        yield from paths
        return
    out = sys.stderr if stream is None else stream
    spent = 0.0  # the modules measured so far
    for i, path in enumerate(paths, 1):
        print(f"gatelens analyze: {path} (module {i} of {n})", file=out, flush=True)
        t0 = clock()
        yield path
        took = clock() - t0
        spent += took
        left = n - i
        rest = (f"the {left} module{'s' * (left > 1)} left ≈ {_took(spent / i * left)}"
                if left else f"all {n} took {_took(spent)}")
        print(f"gatelens analyze: {path} took {_took(took)}; {rest}", file=out, flush=True)


def stage_line(stage: str, took: float, started: float,
               clock: Callable[[], float] = time.perf_counter) -> str:
    """The line a stage of a one-chunk analysis prints when it is done: its time and the
    analysis's so far (``started``: when it began, on ``clock``).

    >>> stage_line("verification", 16.04, 0.0, clock=lambda: 30.2)
    'gatelens analyze: verification took 16.0 s (30.2 s so far)'
    """
    said = STAGE_WORDS.get(stage, stage.replace("_", " "))
    return f"gatelens analyze: {said} took {_took(took)} ({_took(clock() - started)} so far)"


#: the stages (``measure.STAGES``) as a stage line says them
STAGE_WORDS = {"divergence": "divergence rate", "spectrum": "Lyapunov spectrum",
               "fixed_points": "fixed points", "context": "context used",
               "analyses": "gate, unit and perturbation figures"}


def peak_resident() -> int | None:
    """The process's peak resident memory so far, in bytes; None where the system does not
    say (``resource`` is POSIX's).

    >>> peak = peak_resident()
    >>> peak is None or peak > 2**20
    True
    """
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(peak if sys.platform == "darwin" else peak * 1024)
