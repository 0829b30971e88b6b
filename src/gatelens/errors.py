"""Errors a user can cause, and the argparse types that catch them first. The CLI prints
an error as one line and exits 2."""

from __future__ import annotations

import errno as _errno
import math
import os
import re

#: The seeds PyTorch's ``manual_seed`` takes (inclusive); gatelens seeds everything from one.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class GatelensError(Exception):
    """Bad input or usage: the message says what is wrong and where.

    >>> str(GatelensError("corpus.txt: empty corpus"))
    'corpus.txt: empty corpus'
    """

    exit_code = 2


class WriteError(GatelensError, OSError):
    """A file or directory could not be written (disk full, read-only, no permission, a
    file where a directory should be): one line naming the path, exit 2. It is an OSError
    too, so code that catches OSError still does.

    >>> e = write_error("runs/a/config.json", OSError(_errno.ENOSPC, "No space left on device"))
    >>> str(e), isinstance(e, OSError)
    ('runs/a/config.json: cannot write: No space left on device [ENOSPC]', True)
    """


def write_error(path: object, e: OSError) -> WriteError:
    """The WriteError for an OSError ``e`` met while writing ``path`` (kept as is if it is
    one already). Its ``path`` is ``path`` and its ``reason`` the OSError's.

    >>> e = write_error("a/b.json", OSError(_errno.EROFS, "Read-only file system"))
    >>> e.path, e.reason
    ('a/b.json', 'Read-only file system [EROFS]')
    """
    if isinstance(e, WriteError):
        return e
    reason = os_reason(e)
    err = WriteError(f"{path}: cannot write: {reason}")
    err.path, err.reason = str(path), reason
    return err


def one_line(text: str) -> str:
    """A message as the one line the CLI prints: its whitespace and line breaks (a wrapped
    library error's, e.g. a C++ stack) collapsed to single spaces.

    >>> one_line("shape overflow\\nframe #0: ...\\n  frame #1")
    'shape overflow frame #0: ... frame #1'
    """
    return " ".join(text.split())


def wrapped_os_error(e: BaseException) -> OSError | None:
    """The OSError a library reported inside its own error, or None. safetensors' Rust
    writer turns a full disk into ``SafetensorError("... I/O error: No space left on device
    (os error 28)")``, which is no OSError, so without this it escaped the one-line rule.

    >>> e = wrapped_os_error(RuntimeError("Error while serializing: I/O error: No space left "
    ...                                   "on device (os error 28)"))
    >>> e.errno == _errno.ENOSPC, e.strerror
    (True, 'No space left on device')
    >>> wrapped_os_error(RuntimeError("header too large")) is None
    True
    """
    if isinstance(e, OSError):
        return e
    found = re.search(r"\(os error (\d+)\)", str(e))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def os_reason(e: OSError) -> str:
    """An OSError's reason in a few words: its strerror and errno name.

    >>> os_reason(PermissionError(_errno.EACCES, "Permission denied"))
    'Permission denied [EACCES]'
    """
    name = _errno.errorcode.get(e.errno or 0)
    text = e.strerror or (" ".join(str(e).split()) or type(e).__name__)
    return f"{text} [{name}]" if name else text


class CheckFailed(Exception):
    """A check ran and failed (e.g. verification above tolerance): exit code 1."""

    exit_code = 1


def positive_int(text: str) -> int:
    """An argparse type: a positive integer, with a one-line error otherwise.

    >>> positive_int("3")
    3
    """
    import argparse

    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


def seed_int(text: str) -> int:
    """An argparse type: an integer PyTorch can seed from, -2**63 … 2**64 − 1.

    >>> seed_int("-3"), seed_int(str(2**64 - 1)) == 2**64 - 1
    (-3, True)
    >>> seed_int(str(2**70))
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be an integer from -2**63 to 2**64 - 1 (...), got 1180...
    """
    import argparse

    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not SEED_MIN <= v <= SEED_MAX:
        raise argparse.ArgumentTypeError(
            f"must be an integer from -2**63 to 2**64 - 1 (what PyTorch seeds from), got {v}")
    return v


def _float(text: str) -> float:
    import argparse

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return v


def finite_float(text: str) -> float:
    """An argparse type: a finite number (no nan, no inf).

    >>> finite_float("-1.5")
    -1.5
    >>> finite_float("nan")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a finite number, got nan
    """
    return _float(text)


def positive_float(text: str) -> float:
    """An argparse type: a finite number above zero.

    >>> positive_float("2e-3")
    0.002
    """
    import argparse

    v = _float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def nonnegative_float(text: str) -> float:
    """An argparse type: a finite number, zero or above.

    >>> nonnegative_float("0")
    0.0
    """
    import argparse

    v = _float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be zero or positive, got {text}")
    return v


def windows_count(text: str) -> int | str:
    """An argparse type for --windows: a positive integer, or "all" (every whole window).

    >>> windows_count("all"), windows_count("8")
    ('all', 8)
    """
    return "all" if text == "all" else positive_int(text)


def exponents_count(text: str) -> int | str:
    """An argparse type for --exponents: a count ≥ 0 (0: none), "all", or "auto".

    >>> exponents_count("all"), exponents_count("0"), exponents_count("8"), exponents_count("auto")
    ('all', 0, 8, 'auto')
    """
    if text in ("all", "auto"):
        return text
    return 0 if text.strip() == "0" else positive_int(text)


#: what each source of a model is called in a message (``refuse_other_sources``)
SOURCE_WORDS = {"run": "a run directory", "weights": "--weights FILE", "model": "--model DIR"}
#: the flags that belong to a run directory and to ``--model DIR`` (attribute, flag)
RUN_FLAGS = (("checkpoint", "--checkpoint"),)
MODEL_FLAGS = (("modules", "--modules"), ("trust_remote_code", "--trust-remote-code"))


def refuse_other_sources(command: str, args: object, given: str,
                         flags: dict[str, tuple[tuple[str, str], ...]]) -> None:
    """One line for a flag (``flags``: source -> (attribute, flag) pairs) of another source
    of a model than ``given`` ("run", "weights", "model"): it would be left unread.

    >>> import argparse
    >>> try:
    ...     refuse_other_sources("verify", argparse.Namespace(checkpoint="3"), "model",
    ...                          {"run": RUN_FLAGS, "model": MODEL_FLAGS})
    ... except GatelensError as e:
    ...     print(e)
    verify: --checkpoint applies to a run directory, not to --model DIR; leave it out
    """
    for source, pairs in flags.items():
        for attr, flag in pairs if source != given else ():
            if getattr(args, attr, None) not in (None, False):
                raise GatelensError(f"{command}: {flag} applies to {SOURCE_WORDS[source]}, "
                                    f"not to {SOURCE_WORDS[given]}; leave it out")


def run_or_model(command: str, args: object) -> str:
    """"run" or "model": which of a run directory (``args.run``) and ``--model DIR`` a
    command that takes either was given (exactly one, else one line), a flag of the other
    refused (``refuse_other_sources``)."""
    run, model = getattr(args, "run", None), getattr(args, "model", None)
    if (run is None) == (model is None):
        raise GatelensError(f"{command}: give a run directory or --model DIR; one of them")
    given = "run" if model is None else "model"
    refuse_other_sources(command, args, given, {"run": RUN_FLAGS, "model": MODEL_FLAGS})
    return given
