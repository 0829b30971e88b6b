"""The analysis text: a character vocabulary, reading a text file, and the analysis windows
of docs/methods.md ("Analysis text"). Training reads its vocabulary from here too.

>>> v = Vocab.from_text("abca")
>>> v.chars, v.encode("cab").tolist(), v.decode([2, 0])
(['a', 'b', 'c'], [2, 0, 1], 'ca')
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from gatelens.errors import GatelensError
from gatelens.io import read_utf8


@dataclass(frozen=True)
class Vocab:
    """Characters in index order: the sorted set of the corpus's characters."""

    chars: list[str]

    @classmethod
    def from_text(cls, text: str) -> Vocab:
        return cls(sorted(set(text)))

    @property
    def size(self) -> int:
        return len(self.chars)

    @property
    def index(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str, where: str = "text") -> torch.Tensor:
        """Indices of ``text`` (int64); a character outside the vocabulary is an error.

        Vectorised over code points (about 12 bytes of memory a character), so a corpus of
        hundreds of MB encodes without a Python object per character.
        """
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")  # (N,)
        # a named entry (an embedding's "<unused k>" row) matches no character of a text
        table = np.array([ord(c) if len(c) == 1 else 0xFFFFFFFF for c in self.chars],
                         dtype=np.uint32)  # (V,)
        order = np.argsort(table, kind="stable")
        if not len(table):
            table, order = np.array([0xFFFFFFFF], dtype=np.uint32), np.array([0])
        pos = np.searchsorted(table[order], codes)  # (N,)
        pos[pos == len(table)] = 0
        found = (table[order][pos] == codes) & (pos < self.size)
        if not found.all():
            first = int(np.argmin(found))
            raise GatelensError(
                f"{where}: character {text[first]!r} at position {first} is not in the "
                f"model's vocabulary of {self.size} characters")
        return torch.from_numpy(order[pos].astype(np.int64))

    def decode(self, indices) -> str:
        return "".join(self.chars[int(i)] for i in indices)


def read_text_file(path: str | os.PathLike) -> str:
    """Read a UTF-8 file; errors name the file (and the byte offset of bad UTF-8). Only a
    regular file up to ``gatelens.io.TEXT_CAP`` (2 GiB) is read: a directory, a device, a
    FIFO or a larger file is a one-line GatelensError."""
    text = read_utf8(path)
    if not text:
        raise GatelensError(f"{path}: empty corpus")
    return text


def default_window_starts(n_chars: int, windows: int, length: int) -> list[int]:
    """Starts of ``windows`` windows evenly spaced over ``n_chars`` characters (first at 0,
    last ending at the end).

    >>> default_window_starts(100, 3, 10)
    [0, 45, 90]

    More than ``n_chars // length`` windows overlap (``overlap_note`` says so); more than
    ``n_chars - length + 1`` would repeat a window and are refused.
    """
    if n_chars < length:
        raise GatelensError(f"validation text has {n_chars} characters, fewer than one "
                            f"window of {length}")
    span = n_chars - length
    if windows > span + 1:  # more windows than places to start one: some would repeat
        raise GatelensError(f"validation text has {n_chars} characters: at most {span + 1} "
                            f"distinct windows of {length}, not {windows} (--windows all: "
                            f"the {n_chars // length} that do not overlap)")
    if windows == 1:
        return [0]
    return [round(k * span / (windows - 1)) for k in range(windows)]


def overlap_note(n_chars: int, windows: int | str, length: int) -> str | None:
    """Words for evenly spaced windows that overlap (None: they do not).

    >>> overlap_note(1000, 20, 100)
    'the windows overlap: 1000 characters hold 10 windows of 100 side by side'
    """
    if windows == "all" or int(windows) * length <= n_chars:
        return None
    return (f"the windows overlap: {n_chars} characters hold {n_chars // length} windows of "
            f"{length} side by side")


def analysis_windows(vocab: Vocab, windows: int | str, length: int, *,
                     val_text: str | None = None, text: str | None = None,
                     where: str = "--text") -> torch.Tensor:
    """The analysis windows of docs/methods.md as indices, (B, T) int64.

    With ``text`` (a --text FILE's contents): the first B consecutive, non-overlapping
    T-character slices. Otherwise B windows evenly spaced over ``val_text``. ``windows="all"``:
    every whole T-character window, consecutive and non-overlapping, from the start.

    >>> v = Vocab.from_text("ab")
    >>> analysis_windows(v, 2, 3, text="abbaab!").tolist()
    [[0, 1, 1], [0, 0, 1]]
    >>> analysis_windows(v, "all", 2, val_text="abbab").tolist()
    [[0, 1], [1, 0]]
    """
    if windows == "all":  # consecutive slices of whichever text it is
        if text is None:
            text, where = val_text, "validation text"
        assert text is not None
        if length <= 0 or len(text) < length:
            raise GatelensError(f"{where}: {len(text)} characters, not one window of {length}")
        windows = len(text) // length
    if not isinstance(windows, int) or windows <= 0 or length <= 0:
        raise GatelensError(f"windows and length must be positive (got {windows}, {length})")
    if text is not None:
        need = windows * length
        if len(text) < need:
            raise GatelensError(f"{where}: {len(text)} characters, too short for {windows} "
                                f"windows of {length} (needs {need})")
        ids = vocab.encode(text[:need], where=where)
        return ids.view(windows, length)  # (B, T)
    starts = default_window_starts(len(val_text), windows, length)
    ids = vocab.encode(val_text, where="validation text")
    return torch.stack([ids[s:s + length] for s in starts])  # (B, T)
