"""The keep gate by the class of the input character (space, newline, other).

The gate at position t is computed while reading x_t, so position t belongs to the class of
x_t. A class's mean is the mean of the keep gate (LSTM f, GRU z; layers pooled) over all
units at the positions of that class (docs/methods.md, "Gates by character class").

>>> import torch
>>> from gatelens.readout.trace_types import Trace
>>> f = torch.tensor([[[0.25], [0.5], [0.75]]])  # (B=1, T=3, H=1)
>>> r = char_classes(Trace("lstm", 1, False, {"layer0.f": f}), torch.tensor([[0, 1, 2]]),
...                  ["\\n", " ", "a"])
>>> r.to_dict()["space"]
{'forget_mean': 0.5, 'positions': 1}
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from gatelens.analysis.common import as_numpy64, pooled
from gatelens.readout.trace_types import Trace


def default_class(ch: str) -> str:
    """space, newline or other.

    >>> [default_class(c) for c in " \\na"]
    ['space', 'newline', 'other']
    """
    return "space" if ch == " " else "newline" if ch == "\n" else "other"


DEFAULT_CLASSES = ("space", "newline", "other")
#: token classes (a model read in tokens or bytes): "space" holds the tokens whose text
#: begins with whitespace (a word start), "newline" those holding a newline
TOKEN_CLASSES = ("space", "newline", "punctuation", "other")


def token_class(text: str) -> str:
    """The class of a token by its text: newline (holds one), space (begins with
    whitespace: a word start), punctuation (punctuation only) or other.

    >>> [token_class(t) for t in [" the", "\\n\\n", ".", "ing", ",\\"", "<7>"]]
    ['space', 'newline', 'punctuation', 'other', 'punctuation', 'other']
    """
    if "\n" in text:
        return "newline"
    if text[:1].isspace():
        return "space"
    if text and all(unicodedata.category(c).startswith("P") for c in text):
        return "punctuation"
    return "other"


def classing(unit: str) -> tuple:
    """(classify, classes) for a model's unit: characters keep the seed's three classes."""
    return (default_class, DEFAULT_CLASSES) if unit == "characters" else (token_class,
                                                                           TOKEN_CLASSES)


@dataclass
class CharClasses:
    """Mean keep gate per character class, with the count of positions in each.

    Attributes:
        gate: "f", "z", or None for a plain RNN (then every forget_mean is None).
        forget_mean: class -> mean keep gate (None when the class has no positions).
        positions: class -> positions (of B·T) whose input character is in the class.
    """

    gate: str | None
    forget_mean: dict[str, float | None]
    positions: dict[str, int]

    def __post_init__(self) -> None:
        if set(self.forget_mean) != set(self.positions):
            raise ValueError("forget_mean and positions must name the same classes")
        for c, n in self.positions.items():
            if (n == 0 or self.gate is None) != (self.forget_mean[c] is None):
                raise ValueError(f"class {c}: a mean is due exactly when it has positions")

    def to_dict(self) -> dict:
        """report.json's "char_classes": {class: {"forget_mean", "positions"}}."""
        return {c: {"forget_mean": self.forget_mean[c], "positions": self.positions[c]}
                for c in self.positions}


def char_classes(trace: Trace, windows: Tensor, chars: Sequence[str],
                 classify: Callable[[str], str] = default_class,
                 classes: Sequence[str] = DEFAULT_CLASSES) -> CharClasses:
    """Keep gate by input-character class. ``windows`` (B, T) are the traced indices.

    ``classify`` maps a character to a class name; ``classes`` lists the names reported
    (in order), so per-character or punctuation classings use the same rule.
    """
    ids = windows.detach().cpu().numpy()  # (B, T)
    label = np.array([classify(c) for c in chars])  # (V,)
    cls = label[ids]  # (B, T)
    unknown = sorted(set(np.unique(cls)) - set(classes))
    if unknown:
        raise ValueError(f"classify returned classes {unknown} not listed in {list(classes)}")
    positions = {c: int((cls == c).sum()) for c in classes}
    gate = trace.keep_gate
    if gate is None:
        return CharClasses(None, {c: None for c in classes}, positions)
    f = as_numpy64(pooled(trace, gate))  # (B, T, U)
    if f.shape[:2] != ids.shape:
        raise ValueError(f"windows {ids.shape} do not match the trace's (B, T) {f.shape[:2]}")
    pos_mean = f.mean(axis=-1)  # (B, T): equal unit counts, so this averages all values
    means = {c: (float(pos_mean[cls == c].mean()) if positions[c] else None) for c in classes}
    return CharClasses(gate, means, positions)
