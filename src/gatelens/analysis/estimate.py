"""What an analysis will cost, said before it runs: its chunks and the working memory of
one (from the module's size), then, once the first chunk is timed, the time of all of them.

>>> print(plan_line(windows=64, length=128, step=16, units=650))
gatelens analyze: 64 windows × 128 in 4 chunks of 16; working memory ≈ 406 MiB a chunk
>>> print(time_line(first=2.0, windows=64, step=16))
gatelens analyze: the first chunk took 2.0 s; all 4 ≈ 8.0 s
>>> print(time_line(first=2.0, windows=64, step=16, peak=3 * 2**29))
gatelens analyze: the first chunk took 2.0 s; all 4 ≈ 8.0 s; peak resident memory so far 1.5 GiB

The working memory before the start is a rule of thumb counted per state coordinate
(calibrated on Mamba-1, whose every coordinate has its own keep; several times too high
for a state kept per head); the peak after the first chunk is the process's own, measured.
"""

from __future__ import annotations

import sys

__all__ = ["chunk_bytes", "peak_resident", "plan_line", "time_line"]

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


def _chunks(windows: int, step: int) -> int:
    return -(-windows // step)


def plan_line(*, windows: int, length: int, step: int, units: int, layers: int = 1) -> str:
    """The line printed before the first chunk."""
    n = _chunks(windows, step)
    mib = chunk_bytes(min(step, windows), length, units, layers) / 2**20
    return (f"gatelens analyze: {windows} windows × {length} in {n} chunk{'s' * (n > 1)} of "
            f"{min(step, windows)}; working memory ≈ {mib:.0f} MiB a chunk")


def time_line(*, first: float, windows: int, step: int, peak: int | None = None) -> str:
    """The line printed after the first chunk, when more follow; with ``peak`` (bytes,
    ``peak_resident``) the process's peak resident memory so far."""
    n = _chunks(windows, step)
    total = first * windows / min(step, windows)
    took = f"gatelens analyze: the first chunk took {first:.1f} s; all {n} ≈ "
    line = took + (f"{total:.1f} s" if total < 120 else f"{total / 60:.1f} min")
    return line if peak is None else f"{line}; peak resident memory so far {peak / 2**30:.1f} GiB"


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
