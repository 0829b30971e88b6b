"""Files in and out. Writes are atomic (a reader sees the old file or the new one, never
half of one; a directory of files is swapped in whole by ``replace_dir``); every OSError
on a write is a one-line ``WriteError`` naming the path. Reads take regular files only,
up to a size cap, so a device, a FIFO or a huge file is a one-line error, never a hang or
a machine out of memory.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

from gatelens.errors import GatelensError, os_reason, wrapped_os_error, write_error

#: The largest text file gatelens reads (a corpus, --text, --vocab): 2 GiB. A corpus of N
#: characters takes about 20·N bytes of memory while it is encoded and split.
TEXT_CAP = 2 * 1024**3
#: No size limit (weights files: a large model is legitimate; only non-regular files are
#: refused).
NO_CAP = 2**62
#: The largest small file gatelens reads: config.json, trial.json, SPEC.toml (64 MiB).
SMALL_CAP = 64 * 1024**2
#: Temporary names this module makes: ``.NAME.<random>.tmp`` (files and directories).
TMP_SUFFIX = ".tmp"


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, fsync it, then rename.

    An OSError (disk full, read-only, no permission; also one a library reports inside its
    own error, as safetensors does) becomes a ``WriteError`` naming ``path``; the old file
    is kept and the temporary file removed.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.txt"
    >>> atomic_write(p, lambda t: t.write_text("hi"))
    >>> p.read_text()
    'hi'
    """
    atomic_write_many({Path(path): write})


def atomic_write_many(writes: dict[Path, Callable[[Path], None]]) -> None:
    """Several files that must agree (study.json, study.md, study.html …): every one is
    written to a temporary file and fsync'ed first; only then are they renamed into place,
    one right after another. A failure while writing (disk full) leaves every old file as it
    was.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> atomic_write_many({d / "a.txt": lambda t: t.write_text("1"),
    ...                    d / "b" / "c.txt": lambda t: t.write_text("2")})
    >>> (d / "a.txt").read_text(), (d / "b" / "c.txt").read_text()
    ('1', '2')
    """
    temps: list[tuple[Path, Path]] = []
    path = None
    try:
        for path, write in writes.items():
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX,
                                       dir=path.parent)
            os.close(fd)
            temps.append((Path(tmp), path))
            os.chmod(tmp, 0o666 & ~_umask())
            write(Path(tmp))
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        for tmp, path in temps:
            os.replace(tmp, path)
    except BaseException as e:
        for tmp, _ in temps:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
        failed = wrapped_os_error(e)  # safetensors' "(os error 28)" is an OSError too
        if failed is not None:
            raise write_error(path, failed) from None
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


def temp_dir_beside(dest: str | os.PathLike) -> Path:
    """A new empty directory beside ``dest`` (same filesystem, so it renames into place):
    ``.NAME.<random>.tmp``; its parents are created. OSError is a WriteError."""
    dest = Path(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=TMP_SUFFIX,
                                     dir=dest.parent))
    except OSError as e:
        raise write_error(dest, e) from None


def replace_dir(new: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Put the directory ``new`` in the place of ``dest`` (which may not exist yet): the old
    ``dest`` is moved aside, ``new`` renamed in, then the old one deleted. On any failure or
    Ctrl-C before ``new`` is in place, the old ``dest`` is put back.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> (d / "a").mkdir(); _ = (d / "a" / "x").write_text("old")
    >>> (d / "b").mkdir(); _ = (d / "b" / "x").write_text("new")
    >>> replace_dir(d / "b", d / "a")
    >>> (d / "a" / "x").read_text(), sorted(p.name for p in d.iterdir())
    ('new', ['a'])
    """
    new, dest = Path(new), Path(dest)
    old = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.old{TMP_SUFFIX}")
    try:
        if dest.exists():
            os.rename(dest, old)
        os.rename(new, dest)
    except BaseException as e:
        if old.exists() and not dest.exists():
            os.rename(old, dest)  # the old result stays
        if isinstance(e, OSError):
            raise write_error(dest, e) from None
        raise
    _fsync_dir(dest.parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_leftovers(directory: str | os.PathLike) -> list[str]:
    """Delete the temporary files and directories (``.NAME.<random>.tmp``) a killed writer
    left directly in ``directory``; returns their names. Call it only while holding the
    directory's lock (``gatelens.lock``), so no live writer's temporary is touched."""
    d = Path(directory)
    gone = []
    if not d.is_dir():
        return gone
    for p in d.iterdir():
        if p.name.startswith(".") and p.name.endswith(TMP_SUFFIX):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            gone.append(p.name)
    return gone


def check_out_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Check, before any long work, that ``path`` can be an output directory: an existing
    directory gatelens can write in, or a path whose nearest existing parent is one. Nothing
    is left behind (a probe file is made and removed). Returns ``path`` as a Path.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "f").write_text("x")
    >>> check_out_dir(d / "new" / "run") == d / "new" / "run"
    True
    >>> check_out_dir(d / "f" / "run")
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: --out .../f/run: .../f is a file, not a directory
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise GatelensError(f"{flag} {p}: exists and is not a directory")
    anc = p
    while not os.path.lexists(anc) and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise GatelensError(f"{flag} {p}: {anc} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".gatelens-probe.", suffix=TMP_SUFFIX, dir=anc)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise GatelensError(f"{flag} {p}: cannot write in {anc}: {os_reason(e)}") from None
    return p


def path_inside(root: str | os.PathLike, rel: object, where: str) -> Path:
    """``root / rel`` resolved, when ``rel`` is a relative path (a string) that stays inside
    ``root`` with symbolic links followed; else a GatelensError naming ``where`` (the file
    and key that held ``rel``). A path read from a file is never followed out of the
    directory it belongs to.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> path_inside(d, "a/b.json", "x.json: report").name
    'b.json'
    >>> path_inside(d, "../../etc/hostname", "x.json: report")
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: x.json: report '../../etc/hostname' is not a path inside ...
    """
    base = Path(root).resolve()
    try:
        path = None if not isinstance(rel, str) or Path(rel).is_absolute() else (
            base / rel).resolve()
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a symbolic link loop
        path = None
    if path is None or not path.is_relative_to(base):
        raise GatelensError(f"{where} {rel!r} is not a path inside {root}")
    return path


def _size(n: int) -> str:
    """Bytes in words.

    >>> _size(3 * 1024**3), _size(2048)
    ('3 GiB', '2 KiB')
    """
    for unit, k in (("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if n >= 1024**k:
            return f"{n / 1024**k:.3g} {unit}"
    return f"{n} bytes"


def open_regular(path: str | os.PathLike, what: str = "a text file",
                 cap: int | None = None) -> int:
    """An open file descriptor of ``path`` if it is a regular file of at most ``cap`` bytes
    (default ``TEXT_CAP``); otherwise a one-line GatelensError. Opened non-blocking, so a
    FIFO never hangs."""
    cap = TEXT_CAP if cap is None else cap
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise GatelensError(f"{path}: no such file") from None
    except NotADirectoryError:
        raise GatelensError(f"{path}: no such file (a part of the path is a file)") from None
    except OSError as e:
        raise GatelensError(f"{path}: cannot read: {os_reason(e)}") from None
    except ValueError:  # a NUL character (a path read from a file: a spec, a config.json)
        raise GatelensError(f"{str(path)!r}: not a path (it holds a NUL character)") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise GatelensError(f"{path}: is a directory, expected {what}")
        if not stat.S_ISREG(st.st_mode):
            raise GatelensError(f"{path}: not a regular file (a device, FIFO or socket), "
                                f"expected {what}")
        if st.st_size > cap:
            raise GatelensError(f"{path}: {_size(st.st_size)}, above gatelens's limit of "
                                f"{_size(cap)} for {what}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_regular(path: str | os.PathLike, what: str = "a file", cap: int | None = None) -> None:
    """Raise GatelensError unless ``path`` is a regular file of at most ``cap`` bytes (for
    files another library opens itself, e.g. safetensors)."""
    os.close(open_regular(path, what, cap))


def read_bytes(path: str | os.PathLike, what: str = "a text file",
               cap: int | None = None) -> bytes:
    """The bytes of a regular file of at most ``cap`` bytes (``open_regular``'s checks).

    >>> read_bytes("/dev/zero")
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: /dev/zero: not a regular file (a device, FIFO or socket), ...
    """
    cap = TEXT_CAP if cap is None else cap
    fd = open_regular(path, what, cap)
    try:
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(cap + 1)  # a file that grew past the cap since fstat
    except OSError as e:
        raise GatelensError(f"{path}: cannot read: {os_reason(e)}") from None
    if len(data) > cap:
        raise GatelensError(f"{path}: above gatelens's limit of {_size(cap)} for {what}")
    return data


def read_utf8(path: str | os.PathLike, what: str = "a UTF-8 text file",
              cap: int | None = None) -> str:
    """A regular file's bytes decoded as UTF-8; bad UTF-8 is a GatelensError naming the file
    and the byte offset.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.txt"
    >>> _ = p.write_bytes(b"ab\\xff")
    >>> read_utf8(p)
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: ...x.txt: not UTF-8 (invalid byte 0xff at byte offset 2)
    """
    data = read_bytes(path, what, cap)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GatelensError(f"{path}: not UTF-8 (invalid byte 0x{data[e.start]:02x} at byte "
                            f"offset {e.start})") from None
