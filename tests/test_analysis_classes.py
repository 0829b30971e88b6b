"""Gates by character class: counts and means against a direct recomputation."""

from __future__ import annotations

import pytest
import torch

from gatelens.analysis import char_classes
from gatelens.analysis.text import Vocab
from gatelens.readout.trace_types import Trace


def test_class_counts_and_means():
    text = "ab c\nd ef\n\n  ghi"  # 16 characters: 4 spaces, 3 newlines, 9 other
    vocab = Vocab.from_text(text)
    windows = vocab.encode(text).view(2, 8)  # (B, T)
    z = torch.rand(2, 8, 5, generator=torch.Generator().manual_seed(0))
    tr = Trace("gru", 1, False, {"layer0.r": z, "layer0.z": z, "layer0.n": z, "layer0.h": z})
    r = char_classes(tr, windows, vocab.chars).to_dict()
    assert {k: v["positions"] for k, v in r.items()} == {"space": 4, "newline": 3, "other": 9}
    flat = list(text)
    for cls, pred in (("space", lambda c: c == " "), ("newline", lambda c: c == "\n"),
                      ("other", lambda c: c not in " \n")):
        rows = [z.view(16, 5)[j].double() for j, c in enumerate(flat) if pred(c)]
        assert r[cls]["forget_mean"] == pytest.approx(float(torch.stack(rows).mean()),
                                                      rel=1e-12)


def test_empty_class_is_null_and_rnn_has_counts_only():
    vocab = Vocab.from_text("ab")
    w = vocab.encode("abba").view(1, 4)
    h = torch.zeros(1, 4, 2)
    r = char_classes(Trace("rnn_tanh", 1, False, {"layer0.pre": h, "layer0.h": h}), w,
                     vocab.chars).to_dict()
    assert r == {"space": {"forget_mean": None, "positions": 0},
                 "newline": {"forget_mean": None, "positions": 0},
                 "other": {"forget_mean": None, "positions": 4}}
    f = torch.full((1, 4, 2), 0.25)
    r = char_classes(Trace("lstm", 1, False, {"layer0.f": f}), w, vocab.chars).to_dict()
    assert r["space"]["forget_mean"] is None and r["other"]["forget_mean"] == 0.25


def test_custom_classing():
    vocab = Vocab.from_text("aAb")
    w = vocab.encode("aAbA").view(1, 4)
    f = torch.tensor([[[0.0], [1.0], [0.5], [1.0]]])
    r = char_classes(Trace("lstm", 1, False, {"layer0.f": f}), vocab.encode("aAbA").view(1, 4),
                     vocab.chars, classify=lambda c: "upper" if c.isupper() else "lower",
                     classes=("upper", "lower")).to_dict()
    assert r == {"upper": {"forget_mean": 1.0, "positions": 2},
                 "lower": {"forget_mean": 0.25, "positions": 2}}
    with pytest.raises(ValueError):
        char_classes(Trace("lstm", 1, False, {"layer0.f": f}), w, vocab.chars,
                     classes=("space",))
