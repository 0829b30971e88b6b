"""The one timing rule of the benchmarks: the shortest of n calls (a shared machine's load
only ever adds), on the clock a script asks for (wall time by default; ``time.process_time``
where a figure is CPU seconds). Scripts run as ``python benchmarks/NAME.py`` import it from
beside them.

>>> best_of(3, lambda: None) >= 0.0
True
>>> sorted(interleaved({"a": lambda: None, "b": lambda: None}, 3))
['a', 'b']
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def best_of(n: int, run: Callable[[], Any], clock: Callable[[], float] = time.perf_counter
            ) -> float:
    """The shortest of ``n`` timed calls of ``run``, in ``clock``'s seconds."""
    best = float("inf")
    for _ in range(n):
        t0 = clock()
        run()
        best = min(best, clock() - t0)
    return best


def best_cpu(run: Callable[[], Any], n: int) -> float:
    """``best_of`` in CPU seconds of this process (``time.process_time``)."""
    return best_of(n, run, time.process_time)


def interleaved(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """The median wall seconds of each of ``runs``, timed round by round in turn (one call of
    each a round), so a change of load or of the allocator's state falls on all of them."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in times.items()}
