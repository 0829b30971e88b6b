"""Synthetic long-memory control corpora, ``recall`` and ``brackets`` (docs/methods.md).

A spec is a name with optional parameters, ``recall:gap=10-200,seed=0``. The text is a pure
function of the parameters: numpy's PCG64 seeded with ``seed`` draws uniform doubles u, and
an integer below n is ``min(floor(u * n), n - 1)``. Same spec, same text and sha256; a
shorter ``chars`` gives a prefix of a longer one.

- ``recall`` (gap=LO-HI, seed, chars, keys=K, fill=F): records ``k f_1 … f_{d-1} k \\n``,
  each drawn independently: key k uniform over the first K capital letters, lag d uniform
  on the integers LO…HI, d − 1 filler letters uniform over the first F small letters. The
  copy of k comes exactly d characters after k. Every character but the copy is as
  predictable with memory as without; the copy costs ln K without memory, nothing with it.
- ``brackets`` (depth=D, types=B, seed, chars, fill=F): a walk on the nesting depth k.
  Inside (0 < k < D) the next character opens one of B bracket types (probability 0.4,
  type uniform), closes the innermost open bracket (0.4) or is a filler letter (0.2,
  uniform over F). At k = 0 the closing mass goes to filler (0.4 open, 0.6 filler); at
  k = D the opening mass goes to closing (0.8 close, 0.2 filler). Each closing bracket
  must recall its opener's type across the nested content: ln B without memory.

The ideal predictor knows the generator and its position in it (record offset, or depth);
``memoryless`` has forgotten only the character to be recalled and guesses it uniformly.

>>> d = describe_corpus("recall:gap=3-5,chars=100")
>>> d["name"], d["gap"]["mean"], round(d["memoryless_loss"] - d["best_loss"], 4)
('recall:gap=3-5,seed=0,chars=100,keys=8,fill=4', 4.0, 0.3466)
>>> synthetic_text("recall:gap=2-4,keys=2,fill=2,chars=24")
'BaB\\nAbA\\nBabbB\\nBbaaB\\nBaab'
>>> synthetic_text("brackets:depth=3,types=2,fill=1,chars=24")
'a(a)aaaaa(())aaa[]aaaa[['
>>> describe_corpus("shakespeare") is None
True
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gatelens.errors import GatelensError

KINDS = ("recall", "brackets")
KEYS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
FILLERS = "abcdefghijklmnopqrstuvwxyz"
OPENS, CLOSES = "([{<", ")]}>"
P_OPEN, P_CLOSE, P_FILL = 0.4, 0.4, 0.2  # brackets, inside the depth range
MAX_CHARS = 100_000_000
RECALL_CHUNK = 1024  # records drawn per block (fixed, so a shorter text is a prefix)
DEFAULTS: dict[str, dict[str, object]] = {
    "recall": {"gap": (10, 200), "seed": 0, "chars": 1_000_000, "keys": 8, "fill": 4},
    "brackets": {"depth": 16, "types": 4, "seed": 0, "chars": 1_000_000, "fill": 4},
}
LIMITS = {"seed": (0, 2**63 - 1), "chars": (1, MAX_CHARS), "keys": (2, 26), "fill": (1, 26),
          "depth": (1, 10_000), "types": (1, 4), "gap": (1, 10_000_000)}


@dataclass(frozen=True)
class SyntheticSpec:
    """A parsed spec: the corpus kind and every parameter (defaults filled in)."""

    kind: str
    params: dict = field(hash=False)

    @property
    def name(self) -> str:
        """The canonical spec, every parameter written out."""
        parts = [f"{k}={'-'.join(map(str, v)) if isinstance(v, tuple) else v}"
                 for k, v in self.params.items()]
        return f"{self.kind}:{','.join(parts)}"


def is_synthetic(name: str) -> bool:
    """Whether ``name`` names a synthetic corpus (an existing file of that name wins).

    >>> is_synthetic("recall:seed=3"), is_synthetic("brackets"), is_synthetic("notes.txt")
    (True, True, False)
    """
    return name.split(":", 1)[0] in KINDS and not Path(name).exists()


def _int(spec: str, key: str, text: str, value: str) -> int:
    """``text`` as an integer within LIMITS[key]; errors name ``key=value``."""
    try:
        v = int(text, 10)
    except ValueError:
        raise GatelensError(f"{spec}: {key}={value}: not an integer") from None
    lo, hi = LIMITS[key]
    if not lo <= v <= hi:
        raise GatelensError(f"{spec}: {key}={value}: must be between {lo} and {hi}")
    return v


def parse_spec(spec: str) -> SyntheticSpec:
    """Parse ``kind[:key=value,...]``; a bad part is a one-line GatelensError naming it.

    >>> parse_spec("recall:gap=5-20,chars=9").name
    'recall:gap=5-20,seed=0,chars=9,keys=8,fill=4'
    >>> parse_spec("recall:gap=300-10")
    Traceback (most recent call last):
    gatelens.errors.GatelensError: recall:gap=300-10: gap LO must be <= HI
    """
    kind, _, rest = spec.partition(":")
    if kind not in KINDS:
        raise GatelensError(f"{spec}: not a synthetic corpus (known: {', '.join(KINDS)})")
    params = dict(DEFAULTS[kind])
    seen: set[str] = set()
    for part in rest.split(",") if rest else []:
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not value.strip():
            raise GatelensError(f"{spec}: {part!r}: expected key=value")
        if key not in params:
            raise GatelensError(f"{spec}: unknown parameter {key!r} (known: "
                                f"{', '.join(params)})")
        if key in seen:
            raise GatelensError(f"{spec}: parameter {key!r} given twice")
        seen.add(key)
        value = value.strip()
        if key == "gap":
            lo_s, dash, hi_s = value.partition("-")
            lo = _int(spec, key, lo_s, value)
            hi = _int(spec, key, hi_s, value) if dash else lo
            if lo > hi:
                raise GatelensError(f"{spec}: gap LO must be <= HI")
            params[key] = (lo, hi)
        else:
            params[key] = _int(spec, key, value, value)
    return SyntheticSpec(kind, params)


def _below(u: np.ndarray, n: int) -> np.ndarray:
    """Integers below n from uniform doubles: min(floor(u n), n − 1)."""
    return np.minimum(np.floor(u * n).astype(np.int64), n - 1)


def _recall_text(p: dict) -> str:
    lo, hi = p["gap"]
    rng = np.random.Generator(np.random.PCG64(p["seed"]))
    keys = np.frombuffer(KEYS[:p["keys"]].encode(), np.uint8)
    fill = np.frombuffer(FILLERS[:p["fill"]].encode(), np.uint8)
    blocks, total = [], 0
    while total < p["chars"]:
        w = rng.random(2 * RECALL_CHUNK)
        k = keys[_below(w[0::2], p["keys"])]
        d = lo + _below(w[1::2], hi - lo + 1)  # lag from the key to its copy
        starts = np.concatenate([[0], np.cumsum(d + 2)[:-1]])  # record = d + 2 chars
        out = np.empty(int((d + 2).sum()), np.uint8)
        filler = np.ones(len(out), bool)
        for pos, ch in ((starts, k), (starts + d, k), (starts + d + 1, ord("\n"))):
            out[pos], filler[pos] = ch, False
        out[filler] = fill[_below(rng.random(int(filler.sum())), p["fill"])]
        blocks.append(out)
        total += len(out)
    return np.concatenate(blocks)[:p["chars"]].tobytes().decode("ascii")


def bracket_probs(depth: int) -> np.ndarray:
    """(depth + 1, 3): P(open), P(close), P(filler) at each nesting depth 0…depth.

    >>> bracket_probs(2).round(6).tolist()
    [[0.4, 0.0, 0.6], [0.4, 0.4, 0.2], [0.0, 0.8, 0.2]]
    """
    p = np.tile([P_OPEN, P_CLOSE, P_FILL], (depth + 1, 1))
    p[0] = [P_OPEN, 0.0, P_CLOSE + P_FILL]
    p[depth] = [0.0, P_OPEN + P_CLOSE, P_FILL]
    return p


def _brackets_text(p: dict) -> str:
    n, b, f = p["chars"], p["types"], p["fill"]
    rng = np.random.Generator(np.random.PCG64(p["seed"]))
    w = rng.random(2 * n)
    u, v = w[0::2].tolist(), w[1::2]
    typ, letter = _below(v, b).tolist(), _below(v, f).tolist()
    probs = bracket_probs(p["depth"])
    a, ac = probs[:, 0].tolist(), (probs[:, 0] + probs[:, 1]).tolist()
    opens, closes, fills = OPENS[:b], CLOSES[:b], FILLERS[:f]
    out, stack = [], []
    for t in range(n):
        k = len(stack)
        if u[t] < a[k]:
            stack.append(typ[t])
            out.append(opens[typ[t]])
        elif u[t] < ac[k]:
            out.append(closes[stack.pop()])
        else:
            out.append(fills[letter[t]])
    return "".join(out)


@functools.lru_cache(maxsize=4)
def synthetic_text(spec: str) -> str:
    """The text of a synthetic corpus spec (deterministic; cached for a few specs)."""
    s = parse_spec(spec)
    return _recall_text(s.params) if s.kind == "recall" else _brackets_text(s.params)


def _xlogx(p: np.ndarray) -> np.ndarray:
    return np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)


def bracket_stationary(depth: int) -> np.ndarray:
    """The stationary distribution of the nesting depth: pi_{k+1} = pi_k P_open(k) /
    P_close(k + 1), normalised.

    >>> bracket_stationary(2).tolist()
    [0.4, 0.4, 0.2]
    """
    probs = bracket_probs(depth)
    pi = np.ones(depth + 1)
    for k in range(depth):
        pi[k + 1] = pi[k] * probs[k, 0] / probs[k + 1, 1]
    return pi / pi.sum()


def _exact_losses(s: SyntheticSpec) -> tuple[float, float]:
    """(memoryless, best) in nats per character: per-position entropies weighted by their
    expected frequency (docs/methods.md)."""
    p = s.params
    if s.kind == "recall":
        lo, hi = p["gap"]
        j = np.arange(hi)  # fillers read so far in the record; n = d − 1 is uniform
        alive = np.clip((hi - j) / (hi - lo + 1), 0.0, 1.0)  # P(n >= j)
        h = np.where(j >= lo - 1, 1.0 / (hi - j), 0.0)  # P(n = j | n >= j): copy next
        per_pos = -_xlogx(h) - _xlogx(1 - h) + (1 - h) * math.log(p["fill"])
        best = math.log(p["keys"]) + float((alive * per_pos).sum())  # the key, then the rest
        length = (lo + hi) / 2 + 2  # E[d + 2]
        return (best + math.log(p["keys"])) / length, best / length
    probs, pi = bracket_probs(p["depth"]), bracket_stationary(p["depth"])
    a, c, f = probs.T
    per_depth = -_xlogx(a) - _xlogx(c) - _xlogx(f) + a * math.log(p["types"]) \
        + f * math.log(p["fill"])
    best = float((pi * per_depth).sum())
    return best + float((pi * c).sum()) * math.log(p["types"]), best


def bracket_gap_pmf(depth: int, tol: float = 1e-12) -> np.ndarray:
    """P(d = t) for t = 0, 1, …: the distance from an opening bracket to its match, over all
    opening brackets of the stationary text (first passage from depth k + 1 back to k,
    weighted by pi_k P_open(k)); computed until the missing mass is below ``tol``.

    >>> pmf = bracket_gap_pmf(1)
    >>> pmf[:3].round(6).tolist(), round(float((pmf * range(len(pmf))).sum()), 6)
    ([0.0, 0.8, 0.16], 1.25)
    """
    probs, pi = bracket_probs(depth), bracket_stationary(depth)
    move = np.diag(probs[:, 2]) + np.diag(probs[:-1, 0], 1) + np.diag(probs[1:, 1], -1)
    w = pi[:-1] * probs[:-1, 0]
    w = w / w.sum()  # opening brackets: from depth k, k = 0 … depth − 1
    state = np.zeros((depth, depth + 1))
    state[np.arange(depth), np.arange(1, depth + 1)] = w  # just opened: at k + 1
    pmf = [0.0]
    while state.sum() > tol and len(pmf) < 10_000_000:
        state = state @ move
        home = state[np.arange(depth), np.arange(depth)].copy()  # back at k: matched
        state[np.arange(depth), np.arange(depth)] = 0.0
        pmf.append(float(home.sum()))
    return np.array(pmf)


def bracket_mean_gap(depth: int) -> float:
    """Exact mean distance from an opening bracket to its match: m_j, the mean first
    passage from depth j to j − 1, obeys m_j = (1 + P_open(j) m_{j+1}) / P_close(j).

    >>> bracket_mean_gap(1), bracket_mean_gap(2)
    (1.25, 2.5)
    """
    probs, pi = bracket_probs(depth), bracket_stationary(depth)
    m = np.zeros(depth + 2)
    for j in range(depth, 0, -1):
        m[j] = (1 + probs[j, 0] * m[j + 1]) / probs[j, 1]
    w = pi[:-1] * probs[:-1, 0]
    return float((w * m[1:depth + 1]).sum() / w.sum())


def _gap(s: SyntheticSpec) -> dict:
    if s.kind == "recall":
        lo, hi = s.params["gap"]
        return {"distribution": f"uniform on the integers {lo}..{hi}", "min": lo, "max": hi,
                "mean": (lo + hi) / 2}
    pmf = np.cumsum(bracket_gap_pmf(s.params["depth"]))
    quantile = {f"p{q}": int(np.searchsorted(pmf, q / 100)) for q in (50, 90, 99)}
    return {"distribution": "first passage of the depth walk back to the opener's depth",
            "min": 1, "max": None, "mean": bracket_mean_gap(s.params["depth"]), **quantile}


def describe_corpus(name: str) -> dict | None:
    """A synthetic corpus's description, or None for any other corpus.

    Keys: name (canonical spec), kind, parameters, generator (one paragraph), gap (the
    distribution of the distance d over which a character must be remembered),
    memoryless_loss and best_loss (exact, nats per character).
    """
    if not is_synthetic(name):
        return None
    s = parse_spec(name)
    p = s.params
    if s.kind == "recall":
        lo, hi = p["gap"]
        text = (f"Records 'k f_1..f_(d-1) k\\n' drawn independently from PCG64(seed={p['seed']})"
                f": key k uniform over {KEYS[:p['keys']]}, lag d uniform on {lo}..{hi}, d - 1 "
                f"filler letters uniform over {FILLERS[:p['fill']]}; the copy of k comes d "
                f"characters after it and costs ln {p['keys']} nats without memory. Cut to "
                f"{p['chars']} characters.")
    else:
        text = (f"A walk on the nesting depth k in 0..{p['depth']} driven by PCG64(seed="
                f"{p['seed']}): open one of {OPENS[:p['types']]} (0.4, type uniform), close "
                f"the innermost (0.4), or a filler letter of {FILLERS[:p['fill']]} (0.2); at "
                f"k = 0 closing becomes filler, at k = {p['depth']} opening becomes closing. "
                f"A closing bracket costs ln {p['types']} nats without memory of its opener's "
                f"type. {p['chars']} characters from depth 0.")
    memoryless, best = _exact_losses(s)
    return {"name": s.name, "kind": s.kind,
            "parameters": {k: list(v) if isinstance(v, tuple) else v for k, v in p.items()},
            "generator": text, "gap": _gap(s), "memoryless_loss": memoryless,
            "best_loss": best, "units": "nats per character"}

