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
