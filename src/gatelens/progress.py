"""Progress that suits where it goes: a live bar on a terminal, a plain line per milestone
in a log.

On a terminal ``Progress`` is a tqdm bar with rate and ETA. Written to a file or a pipe
(``make reproduce > log``), a carriage-return bar would fill the log with thousands of
redrawn lines; there ``Progress`` stays silent on every ``update`` and prints one line per
``milestone`` (an evaluation) instead, with the same rate and ETA.

>>> import io
>>> log = io.StringIO()
>>> p = Progress(10, "train", stream=log)
>>> p.update(5); p.milestone("val 2.31")
>>> log.getvalue().startswith("train: 5/10 (50%)")
True
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


class Progress:
    """Counts work done out of ``total``; see the module docstring for where it prints."""

    def __init__(self, total: int, desc: str, *, initial: int = 0, unit: str = "step",
                 enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total, self.desc, self.unit, self.done = total, desc, unit, initial
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self._start, self._initial = time.perf_counter(), initial
        tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar = tqdm(total=total, initial=initial, unit=unit, desc=desc, dynamic_ncols=True,
                        file=self.stream) if tty else None

    def update(self, n: int = 1, **postfix: str) -> None:
        """``n`` more units done; ``postfix`` shows beside the bar (terminal only)."""
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def note(self, **postfix: str) -> None:
        """Show ``postfix`` beside the bar now (the stage under way; terminal only)."""
        if self.bar is not None:
            self.bar.set_postfix(postfix)

    def milestone(self, note: str = "") -> None:
        """A line in a log (off a terminal): done/total, rate, ETA and ``note``."""
        if self.bar is not None:
            self.bar.set_postfix_str(note)
        if not self.enabled or self.bar is not None:
            return
        elapsed = time.perf_counter() - self._start
        rate = (self.done - self._initial) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        pct = 100.0 * self.done / self.total if self.total else 100.0
        print(f"{self.desc}: {self.done}/{self.total} ({pct:.0f}%), {rate:.3g} {self.unit}/s, "
              f"ETA {_clock(eta)}" + (f", {note}" if note else ""), file=self.stream, flush=True)

    @property
    def elapsed(self) -> float:
        """Seconds since the bar was made."""
        return time.perf_counter() - self._start

    def write(self, line: str) -> None:
        """One line of its own (above the bar on a terminal), whether or not the bar shows."""
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _clock(seconds: float) -> str:
    """Seconds as m:ss (or h:mm:ss); '?' when unknown.

    >>> _clock(75), _clock(3725), _clock(float("nan"))
    ('1:15', '1:02:05', '?')
    """
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"
