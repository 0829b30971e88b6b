"""The empirical side of the synthetic corpora: the ideal predictors scored on a text, and
the distances d read back from it (docs/methods.md, "Long-memory control corpora").

Scoring a generated text must agree with the exact losses of :mod:`gatelens.training.synthetic`:

>>> from gatelens.training.synthetic import describe_corpus
>>> spec = "recall:gap=2-6,chars=50000"
>>> m, b = empirical_losses(spec)
>>> d = describe_corpus(spec)
>>> abs(m - d["memoryless_loss"]) < 0.02 and abs(b - d["best_loss"]) < 0.02
True
"""

from __future__ import annotations

import math

import numpy as np

from gatelens.training.synthetic import (
    CLOSES,
    FILLERS,
    KEYS,
    OPENS,
    bracket_probs,
    parse_spec,
    synthetic_text,
)


def _codes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8)


def _lookup(chars: str) -> np.ndarray:
    """Byte → index in ``chars`` (−1 elsewhere)."""
    table = np.full(256, -1, np.int64)
    table[list(chars.encode())] = np.arange(len(chars))
    return table


def _record_starts(x: np.ndarray) -> np.ndarray:
    """For each position of a recall text, where its record (line) starts."""
    start = np.ones(len(x), bool)
    start[1:] = x[:-1] == ord("\n")
    return np.maximum.accumulate(np.where(start, np.arange(len(x)), 0))


def _bracket_depths(x: np.ndarray, types: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Type of each opening (≥ 0) / closing (≥ 0) bracket, and the depth before each char."""
    op, cl = _lookup(OPENS[:types])[x], _lookup(CLOSES[:types])[x]
    delta = (op >= 0).astype(np.int64) - (cl >= 0)
    return op, cl, np.cumsum(delta) - delta


def _bracket_pairs(x: np.ndarray, types: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions (opening, closing) of the matched pairs, in closing order: sorted by the
    level a bracket sits at and then position, each closing bracket's match is the element
    just before it, when that is an opening bracket of the same type and level."""
    op, cl, before = _bracket_depths(x, types)
    pos = np.flatnonzero((op >= 0) | (cl >= 0))
    level = np.where(op[pos] >= 0, before[pos], before[pos] - 1)
    sp, sl = pos[np.lexsort((pos, level))], level[np.lexsort((pos, level))]
    ok = (cl[sp[1:]] >= 0) & (sl[1:] == sl[:-1]) & (op[sp[:-1]] == cl[sp[1:]])
    opened, closed = sp[:-1][ok], sp[1:][ok]
    order = np.argsort(closed)
    return opened[order], closed[order]


def gaps(spec: str, text: str | None = None) -> np.ndarray:
    """The distances d read back from a text (default: the spec's own): recall, from each
    complete record's key to its copy; brackets, from each matched opening bracket to its
    closing one (in closing order).

    >>> gaps("recall:gap=2-4,keys=2,fill=2,chars=24").tolist()
    [2, 2, 4, 4]
    >>> gaps("brackets:types=2", "(a[])[(").tolist()
    [1, 4]
    """
    s = parse_spec(spec)
    x = _codes(synthetic_text(spec) if text is None else text)
    if s.kind == "recall":
        ends = np.flatnonzero(x == ord("\n"))
        return ends - 1 - _record_starts(x)[ends]
    opened, closed = _bracket_pairs(x, s.params["types"])
    return closed - opened


def char_losses(spec: str, text: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The ideal predictors scored on a text (default: the spec's own): per character, the
    loss in nats of the memoryless one and of the one with perfect memory, (N,) each. A
    character the generator could not have produced there costs inf.

    >>> m, b = char_losses("recall:gap=1-2,keys=2,fill=1", "AaA\\nBB\\n")
    >>> m.round(3).tolist()
    [0.693, 0.693, 0.693, 0.0, 0.693, 1.386, 0.0]
    >>> b.round(3).tolist()
    [0.693, 0.693, 0.0, 0.0, 0.693, 0.693, 0.0]
    """
    s = parse_spec(spec)
    p = s.params
    x = _codes(synthetic_text(spec) if text is None else text)
    idx = np.arange(len(x))
    inf = np.full(len(x), np.inf)
    with np.errstate(divide="ignore"):
        if s.kind == "recall":
            lo, hi = p["gap"]
            key, fill = _lookup(KEYS[:p["keys"]])[x] >= 0, _lookup(FILLERS[:p["fill"]])[x] >= 0
            first = _record_starts(x)
            o = idx - first
            j = o - 1  # fillers read so far
            h = np.where(j >= hi - 1, 1.0, np.where(j >= lo - 1, 1 / np.maximum(hi - j, 1), 0.0))
            inner = o >= 1
            nl = (x == ord("\n")) & (o >= 2) & np.r_[False, key[:-1]]
            best = np.where(key & (o == 0), math.log(p["keys"]), inf)
            best = np.where(inner & fill, np.log(p["fill"] / (1 - h)), best)
            best = np.where(nl, 0.0, best)
            memoryless = np.where(inner & key, np.log(p["keys"] / h), best)
            best = np.where(inner & key & (x == x[first]), np.log(1 / h), best)
            return memoryless, best
        b, f, depth = p["types"], p["fill"], p["depth"]
        op, cl, before = _bracket_depths(x, b)
        probs = bracket_probs(depth)[np.clip(before, 0, depth)]  # (N, 3)
        fill = _lookup(FILLERS[:f])[x] >= 0
        best = np.where(fill, np.log(f / probs[:, 2]), inf)
        best = np.where(op >= 0, np.log(b / probs[:, 0]), best)
        memoryless = np.where(cl >= 0, np.log(b / probs[:, 1]), best)
        matched = np.zeros(len(x), bool)
        matched[_bracket_pairs(x, b)[1]] = True
        best = np.where(matched, np.log(1 / probs[:, 1]), best)
        bad = np.maximum.accumulate((before < 0) | (before > depth))
        return np.where(bad, np.inf, memoryless), np.where(bad, np.inf, best)


def empirical_losses(spec: str, text: str | None = None) -> tuple[float, float]:
    """(memoryless, best): the mean over every character of :func:`char_losses`."""
    memoryless, best = char_losses(spec, text)
    return float(memoryless.mean()), float(best.mean())
