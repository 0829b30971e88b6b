"""Stops by signal: SIGTERM and SIGHUP (what a scheduler, ``timeout``, a container stop or a
closed terminal send) end gatelens as Ctrl-C does.

Python raises KeyboardInterrupt on SIGINT, so every ``finally`` runs (temporary
directories removed, locks released); SIGTERM and SIGHUP kill the process where it stands.
Inside ``signals_raise`` they raise ``Stopped`` (a KeyboardInterrupt) instead, and the
command exits ``128 + signum`` (143 for SIGTERM, 129 for SIGHUP, 130 for Ctrl-C).
``train`` goes further: its loop takes all three as a request to stop at the step
(training.train's ``_StopFlag``). A library that catches the ``Stopped`` and raises a
plain KeyboardInterrupt in its place (Ray's ``ray.get``/``ray.wait`` do) does not lose the
signal: ``signals_raise`` raises it again, as a ``Stopped``, on its way out.
Libraries that install handlers of their own (``ray.init`` puts in a SIGTERM handler that
exits at once and a C one that prints a stack dump) are undone by ``kept_handlers``.

>>> exit_code(Stopped(15)), exit_code(KeyboardInterrupt()), signal_name(15)
(143, 130, 'SIGTERM')
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: The signals that stop gatelens cleanly (SIGHUP where the platform has one).
STOP_SIGNALS = tuple(s for s in (getattr(signal, n, None) for n in ("SIGINT", "SIGTERM",
                                                                    "SIGHUP")) if s is not None)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: raised where the process was, as Ctrl-C raises
    KeyboardInterrupt, so that everything unwinds cleanly. ``signum`` is the signal (SIGINT
    too, where a command stopped by Ctrl-C says ``note``: what stopped where)."""

    def __init__(self, signum: int, note: str | None = None) -> None:
        super().__init__(signal_name(signum))
        self.signum = int(signum)
        self.note = note  # what was stopped where, for the one line the command prints


def signal_name(signum: int) -> str:
    """"SIGTERM" for 15, and so on."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


_last: list[int] = []  # the signals _raise took, inside the current signals_raise


def exit_code(e: BaseException) -> int:
    """128 + the signal of a ``Stopped``; 130 (SIGINT's) for any other KeyboardInterrupt."""
    return 128 + (e.signum if isinstance(e, Stopped) else int(signal.SIGINT))


def _raise(signum: int, frame: object) -> None:
    _last.append(int(signum))
    raise Stopped(signum)


def may_take(signum: int) -> bool:
    """Whether a loop may take ``signum`` over as a request to stop: its handler is the
    default one, Python's Ctrl-C one, or ``signals_raise``'s; not one another program
    installed (Ray's in its workers) and not an ignored signal (``nohup``'s SIGHUP)."""
    h = signal.getsignal(signum)
    return h in (signal.SIG_DFL, signal.default_int_handler) or h is _raise


@contextmanager
def signals_raise() -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise ``Stopped`` (SIGINT keeps raising
    KeyboardInterrupt); the previous handlers are put back after. A signal someone else
    handles or ignores (``nohup`` ignores SIGHUP) is left as it is, and so is everything
    outside the main thread (where Python cannot set handlers). A KeyboardInterrupt that
    leaves the block after a SIGTERM or SIGHUP was taken (a library raised it in place of
    the ``Stopped``) leaves as that ``Stopped``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _last.clear()
    old = {s: signal.signal(s, _raise) for s in STOP_SIGNALS
           if s != signal.SIGINT and signal.getsignal(s) == signal.SIG_DFL}
    try:
        yield
    except KeyboardInterrupt as e:
        if isinstance(e, Stopped) or not _last:
            raise
        raise Stopped(_last[-1]) from e
    finally:
        _last.clear()
        for s, h in old.items():
            signal.signal(s, h)


@contextmanager
def kept_handlers() -> Iterator[None]:
    """The handlers of ``STOP_SIGNALS`` as they are on entry, put back on leaving: around
    a call that installs its own (``ray.init``: a SIGTERM that exits without unwinding and
    a C handler that prints a stack dump). Setting a handler from Python replaces the C
    one too. Outside the main thread nothing is done."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            if h is not None:  # None: a handler not set from Python, left as it is
                signal.signal(s, h)
