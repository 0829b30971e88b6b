"""The one timing rule of the benchmarks: the shortest of n calls (a shared machine's load
only ever adds), on the clock a script asks for (wall time by default; ``time.process_time``
where a figure is CPU seconds). Scripts run as ``python benchmarks/NAME.py`` import it from
beside them.

>>> best_of(3, lambda: None) >= 0.0
True
"""

from __future__ import annotations

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
