"""One writer per directory: ``DIR/.gatelens.lock``, locked with ``flock`` for as long as a
gatelens process writes DIR (a run, a study, a study's trial, a reproduction).

The lock file names its holder (pid, host, since when), so a second process is told who
has the directory: one line, exit 2. The kernel drops an flock when its holder dies, so a
lock left by a killed process (``kill -9``, a lost Ray node) is stale: the next writer
takes it over with a one-line note. A holder removes the file when it is done. Within
one process the lock is re-entrant (a study's trial holds its directory while ``train``
takes the run's inside it).

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> with locked(d):
...     holder(d)["pid"] == os.getpid()
True
>>> (d / LOCK).exists()
False
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gatelens.errors import GatelensError, write_error
from gatelens.io import check_out_dir

LOCK = ".gatelens.lock"
_HELD: dict[str, list] = {}  # realpath -> [fd, depth] for locks this process holds
_GUARD = threading.Lock()


def holder(directory: str | os.PathLike) -> dict:
    """What DIR's lock file says of its (last) holder: {"pid", "host", "since"}; {} if none
    or unreadable."""
    try:
        with open(Path(directory) / LOCK, encoding="utf-8") as fh:
            obj = json.loads(fh.read(4096) or "{}")
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _describe(h: dict) -> str:
    if not h:
        return "a process that has not written its name yet"
    return f"pid {h.get('pid', '?')} on host {h.get('host', '?')} since {h.get('since', '?')}"


def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _stale_note(directory: Path, h: dict) -> str:
    here = h.get("host") == socket.gethostname()
    why = ("which is no longer running" if here and not _pid_alive(h.get("pid"))
           else "which no longer holds it")
    return (f"gatelens: note: {directory}: taking over the lock of {_describe(h)}, {why} "
            "(it ended without releasing it)")


def _try_lock(directory: Path) -> tuple[int, dict] | None:
    """(fd, what the file said before) with the flock held, or None if another holds it."""
    path = directory / LOCK
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise write_error(path, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:  # no flock on this filesystem: the file alone must do
            pass
        try:  # the holder before us may have removed the file while we opened it
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    raw = os.pread(fd, 4096, 0)
    try:
        before = json.loads(raw or b"{}")
    except ValueError:
        before = {"pid": "?", "host": "?", "since": "?"}
    return fd, before if isinstance(before, dict) else {}


@contextmanager
def locked(directory: str | os.PathLike, wait: float = 0.0,
           quiet: bool = False) -> Iterator[Path]:
    """Hold DIR's lock (DIR must exist) for the ``with`` block.

    Another live holder: wait up to ``wait`` seconds for it, then a GatelensError naming
    its pid and host. A stale lock is taken over with a note on stderr (unless ``quiet``).
    """
    directory = Path(directory)
    key = os.path.realpath(directory)
    with _GUARD:
        if key in _HELD:
            _HELD[key][1] += 1
            mine = None
        else:
            mine = _acquire(directory, wait, quiet)
            _HELD[key] = [mine, 1]
    try:
        yield directory
    finally:
        with _GUARD:
            _HELD[key][1] -= 1
            if _HELD[key][1] == 0:
                fd = _HELD.pop(key)[0]
                try:
                    os.unlink(directory / LOCK)
                except OSError:
                    pass
                os.close(fd)


def _acquire(directory: Path, wait: float, quiet: bool) -> int:
    deadline = time.monotonic() + wait
    while True:
        got = _try_lock(directory)
        if got is not None:
            break
        if time.monotonic() >= deadline:
            raise GatelensError(
                f"{directory}: in use by another gatelens ({_describe(holder(directory))}); "
                "wait for it to finish, or stop it, or choose another --out")
        time.sleep(0.2)
    fd, before = got
    if before and not quiet:
        print(_stale_note(directory, before), file=sys.stderr)
    me = {"pid": os.getpid(), "host": socket.gethostname(),
          "since": _dt.datetime.now().astimezone().isoformat(timespec="seconds")}
    data = (json.dumps(me) + "\n").encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except OSError as e:  # a full disk: the file is ours (flock held), so it goes too
        try:
            os.unlink(directory / LOCK)
        except OSError:
            pass
        os.close(fd)
        raise write_error(directory / LOCK, e) from None
    return fd


def is_lock_or_leftover(name: str) -> bool:
    """Names a writer may leave in a directory that hold nothing of a result: the lock and
    temporary files (``gatelens.io``'s ``.NAME.<random>.tmp``).

    >>> is_lock_or_leftover(LOCK), is_lock_or_leftover(".config.json.x1.tmp"), \\
    ...     is_lock_or_leftover("config.json")
    (True, True, False)
    """
    return name == LOCK or (name.startswith(".") and name.endswith(".tmp"))


def clear_held(directory: str | os.PathLike) -> None:
    """Empty DIR but for its lock: only while this process holds it (a start that died
    before it saved anything, cleared for a new one).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "x").write_text("1")
    >>> with locked(d):
    ...     clear_held(d); sorted(p.name for p in d.iterdir())
    ['.gatelens.lock']
    """
    directory = Path(directory)
    if os.path.realpath(directory) not in _HELD:
        raise RuntimeError(f"{directory}: clear_held without holding its lock")
    for p in directory.iterdir():
        if p.name == LOCK:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


@contextmanager
def writing_dir(directory: str | os.PathLike, wait: float = 0.0, flag: str = "--out",
                quiet: bool = False) -> Iterator[Path]:
    """DIR checked (``check_out_dir``), created if need be and held with ``locked`` for the
    block; if this call created it and the block wrote nothing there, it is removed again,
    so a bad input leaves no stub directory behind."""
    directory = check_out_dir(directory, flag)
    created = not os.path.lexists(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_error(directory, e) from None
    try:
        with locked(directory, wait=wait, quiet=quiet):
            yield directory
    finally:
        if created:
            try:
                directory.rmdir()  # only if empty
            except OSError:
                pass
