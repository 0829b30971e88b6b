"""Errors a user can cause. The CLI prints them as one line and exits 2."""

from __future__ import annotations


class GatelensError(Exception):
    """Bad input or usage: the message says what is wrong and where.

    >>> str(GatelensError("corpus.txt: empty corpus"))
    'corpus.txt: empty corpus'
    """

    exit_code = 2


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
