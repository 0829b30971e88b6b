"""A study's grid expanded into trials: every combination of the axes' values and the
seeds, each named by its values (stable: a value's name never depends on the others listed,
and adding a value to an axis keeps every existing trial's id), each TrainConfig checked.

>>> [t.id for t in _expand({"seed": [0, -1], "hidden": [4, 8]}, {}, {}, "SPEC")]
['hidden-4_seed-0', 'hidden-4_seed-m1', 'hidden-8_seed-0', 'hidden-8_seed-m1']
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gatelens.errors import GatelensError
from gatelens.training.config import TrainConfig

MAX_TRIALS = 100_000  # trials one study may hold (the grid's product is checked first)
MATCH = "match_params"  # [train] only: a cell whose parameter count every trial matches


@dataclass(frozen=True)
class Trial:
    """One training run of a study and the analysis settings of its checkpoints."""

    id: str  # directory name under DIR/trials
    condition: dict  # the grid's values but the seed, e.g. {"cell": "lstm"}
    seed: int
    train: dict  # every TrainConfig field
    analysis: dict  # windows, length, perturb_pos

    def config(self) -> TrainConfig:
        return TrainConfig.from_dict(self.train)

    def settings(self) -> dict:
        """What trial.json records as its "spec" (a finished trial is reused if it matches)."""
        return {"train": dict(self.train), "analysis": dict(self.analysis)}


def parse_init(value: Any, where: str) -> tuple[float | None, float | None]:
    """(forget_bias, chrono) from an init value.

    >>> parse_init("forget_bias:1", "x"), parse_init("none", "x"), parse_init("chrono:128", "x")
    ((1.0, None), (None, None), (None, 128.0))
    """
    if value == "none":
        return None, None
    kind, _, number = str(value).partition(":")
    try:
        x = float(number)
    except ValueError:
        x = None
    if kind not in ("forget_bias", "chrono") or x is None:
        raise GatelensError(f"{where} init: expected none, forget_bias:B or chrono:TMAX, "
                            f"got {value!r}")
    return (x, None) if kind == "forget_bias" else (None, x)


def _slug(value: Any) -> str:
    """A value as a piece of a directory name.

    >>> _slug(-3), _slug(3), _slug(-0.5), _slug("/data/tiny.txt"), _slug("recall:gap=5-9")
    ('m3', '3', 'm0.5', 'tiny.txt', 'recall-gap-5-9')
    """
    if isinstance(value, int | float) and not isinstance(value, bool):
        text = str(value)
        return "m" + text[1:] if text.startswith("-") else text
    text = Path(value).name if isinstance(value, str) and "/" in value else str(value)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "x"


def _value_names(conditions: list[dict]) -> dict[tuple[str, str], str]:
    """(key, JSON of a value) -> its name in ids: its slug, or for a value whose slug an
    earlier value of the same key already has, the slug and a digest of the value."""
    names: dict[tuple[str, str], str] = {}
    taken: dict[str, set[str]] = {}
    for cond in conditions:
        for k, v in cond.items():
            key = (k, json.dumps(v, sort_keys=True))
            if key in names:
                continue
            name = _slug(v)
            if name in taken.setdefault(k, set()):
                name = f"{name}-{hashlib.sha256(key[1].encode()).hexdigest()[:6]}"
            taken[k].add(name)
            names[key] = name
    return names


_VOCAB: dict[str, int] = {}


def vocab_size(corpus: str) -> int:
    """Characters in a corpus's vocabulary (what `gatelens train` builds), cached.

    >>> from gatelens.training.corpus import load_corpus
    >>> vocab_size("brackets"), len(set(load_corpus("brackets").text))
    (12, 12)
    """
    if corpus not in _VOCAB:
        from gatelens.analysis.text import Vocab
        from gatelens.training.corpus import load_corpus

        _VOCAB[corpus] = Vocab.from_text(load_corpus(corpus).text).size
    return _VOCAB[corpus]


def _matched(setting: dict, base: dict, match: str) -> int:
    """The trial's hidden at the parameter count of a ``match`` model with ``base``'s
    settings (``base`` is the trial's setting before its table axes)."""
    from gatelens.training.model import matched_hidden, parameter_count
    from gatelens.training.train import model_config

    vocab = vocab_size(setting["corpus"])
    ref = TrainConfig.from_dict({**base, "cell": match, "heads": 1})
    target = parameter_count(model_config(ref), vocab)
    return matched_hidden(model_config(TrainConfig.from_dict(setting)), target, vocab)


def _expand(values: dict, tables: dict, analysis: dict, where: str,
            match: str | None = None) -> list[Trial]:
    axes = [k for k, v in values.items() if isinstance(v, list) and k != "seed"]
    seeds = values.get("seed", 0)
    seeds = seeds if isinstance(seeds, list) else [seeds]
    n = math.prod(len(values[k]) for k in axes) * math.prod(map(len, tables.values())) * len(seeds)
    if n > MAX_TRIALS:
        raise GatelensError(f"{where}: the grid expands to {n} trials, more than gatelens runs "
                            f"in one study ({MAX_TRIALS}); split it")
    trials = []
    combos = []
    for combo in itertools.product(*(values[k] for k in axes), *tables.values()):
        plain = dict(zip(axes, combo[: len(axes)], strict=True))
        condition = dict(plain)
        for row in combo[len(axes):]:
            condition.update(row)
        combos.append((plain, condition))
    # names in each axis's own order (not the grid's), so a value's name never depends on
    # the values listed after it
    axis_order = [{k: v} for k in axes for v in values[k]]
    axis_order += [row for axis in tables.values() for row in axis]
    names = _value_names([*axis_order, *({"seed": s} for s in seeds)])
    for plain, condition in combos:
        for seed in seeds:
            base = {**TrainConfig().to_dict(), **values, **plain, "seed": seed}
            setting = {**base, **condition}
            if match is not None:
                base.pop("init", None)
                try:
                    setting["hidden"] = _matched(setting, base, match)
                except GatelensError as e:
                    raise GatelensError(f"{where}: [train] {MATCH}: {e}") from None
            if "init" in setting:
                setting["forget_bias"], setting["chrono"] = parse_init(setting.pop("init"), "")
            name = _short("_".join(f"{k}-{names[(k, json.dumps(v, sort_keys=True))]}"
                                   for k, v in (*condition.items(), ("seed", seed))))
            cfg = TrainConfig(**setting)
            try:
                cfg.validate()
            except GatelensError as e:
                raise GatelensError(f"{where}: trial {name}: {e}") from None
            trials.append(Trial(name, condition, seed, cfg.to_dict(), dict(analysis)))
    seen: set[str] = set()
    for k, t in enumerate(trials):  # what names alone cannot tell apart (rare): a digest
        if t.id in seen:
            trials[k] = Trial(f"{t.id}-{_digest(t)}", t.condition, t.seed, t.train, t.analysis)
        seen.add(trials[k].id)
    return trials


#: The longest trial id kept whole: it names a directory (255 bytes at most), and a
#: 240-character corpus file name made one of 258 that no directory could have.
MAX_ID = 120


def _short(name: str) -> str:
    """A trial id cut to ``MAX_ID`` characters, with 8 hex digits of the whole id so two
    long ids never share a directory; a shorter one as it is.

    >>> _short("seed-0"), len(_short("corpus-" + "c" * 300 + "_seed-0"))
    ('seed-0', 120)
    """
    if len(name) <= MAX_ID:
        return name
    return f"{name[:MAX_ID - 9]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def _digest(t: Trial) -> str:
    return hashlib.sha256(json.dumps(t.settings(), sort_keys=True).encode()).hexdigest()[:6]
