"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, fsync it, then rename.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.txt"
    >>> atomic_write(p, lambda t: t.write_text("hi"))
    >>> p.read_text()
    'hi'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual mode
    try:
        write(tmp_path)
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write text (UTF-8) atomically."""
    atomic_write(path, lambda t: t.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: object) -> None:
    """Write JSON (indented, keys in insertion order, trailing newline) atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def read_utf8(path: str | os.PathLike) -> str:
    """A file's bytes decoded as UTF-8; bad UTF-8 is a GatelensError naming the file and the
    byte offset.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.txt"
    >>> _ = p.write_bytes(b"ab\\xff")
    >>> read_utf8(p)
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: ...x.txt: not UTF-8 (invalid byte 0xff at byte offset 2)
    """
    from gatelens.errors import GatelensError

    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GatelensError(f"{path}: not UTF-8 (invalid byte 0x{data[e.start]:02x} at byte "
                            f"offset {e.start})") from None
