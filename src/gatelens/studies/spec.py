"""A study's SPEC.toml: sections, keys, types and the grid of trials, all checked before any
work starts.

    [grid]       lists expand into a cartesian grid; scalars apply to every trial
                 (keys: cell, seed, init and any TrainConfig field). A list of tables
                 under any other name is one axis whose values set several keys
                 together, e.g. model = [{cell = "lstm"}, {cell = "mingru", layers = 2}];
                 a table's keys override [train]'s.
    [train]      any `gatelens train` setting, one value for every trial, and
                 match_params = CELL: each trial's hidden size is the one whose parameter
                 count is nearest that of a CELL model with [train]'s settings (its
                 hidden, layers, corpus), so cells are compared at matched size
    [analysis]   windows, length, perturb_pos (`gatelens analyze`'s settings)

``init`` is "none", "forget_bias:B" or "chrono:TMAX". A condition is a setting of
everything but the seed.

A trial's id names its condition's values and its seed (``cell-lstm_seed-0``); a negative
number is written with an ``m`` (seed −3: ``seed-m3``). The id of a value depends on that
value and the ones listed before it on its axis only, so extending a grid (a value added
at the end of an axis, or a new axis value anywhere that names differently) keeps every
existing trial's id: of two values with one name (two corpus files called tiny.txt in
two directories) the first keeps the name and the later one gets a digest of itself.

>>> spec = parse_spec({"grid": {"cell": ["lstm", "gru"], "seed": [0, 1]},
...                    "train": {"hidden": 8}})
>>> [t.id for t in spec.trials]
['cell-lstm_seed-0', 'cell-lstm_seed-1', 'cell-gru_seed-0', 'cell-gru_seed-1']
>>> spec.trials[2].condition, spec.trials[2].config().hidden
({'cell': 'gru'}, 8)
>>> parse_spec({"grid": {"cell": ["lstm"], "hiden": 8}})
Traceback (most recent call last):
...
gatelens.errors.GatelensError: SPEC: [grid] hiden: unknown key (cell, seed, init or a train setting)
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from gatelens.analysis.measure import check_perturb_pos
from gatelens.errors import GatelensError
from gatelens.io import SMALL_CAP, read_utf8
from gatelens.training.config import TrainConfig

SECTIONS = ("grid", "train", "analysis")
ANALYSIS_DEFAULTS = {"windows": 32, "length": 128, "perturb_pos": 32}
PRESETS = ("dynamics", "forget-bias", "cells", "long-memory", "modern")
_FIELD_TYPES = {f.name: str(f.type).split("|")[0].strip() for f in fields(TrainConfig)}
TRAIN_KEYS = (*_FIELD_TYPES, "init")
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


@dataclass
class StudySpec:
    """A parsed, validated SPEC: the document as given and the trials it expands into."""

    doc: dict  # the TOML as parsed (study.json's "spec")
    trials: list[Trial]
    where: str  # the file or preset it came from, for messages

    def conditions(self) -> list[dict]:
        """Distinct conditions in trial order."""
        out: list[dict] = []
        for t in self.trials:
            if t.condition not in out:
                out.append(t.condition)
        return out


def condition_label(condition: dict) -> str:
    """A condition as one short line.

    >>> condition_label({"cell": "lstm", "init": "chrono:128"}), condition_label({})
    ('cell=lstm init=chrono:128', 'all trials')
    """
    return " ".join(f"{k}={v}" for k, v in condition.items()) or "all trials"


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


def _check_type(where: str, key: str, value: Any) -> Any:
    if key == "init":
        parse_init(value, where)
        return value
    want = _FIELD_TYPES[key]
    ok = {"int": isinstance(value, int), "float": isinstance(value, int | float),
          "str": isinstance(value, str)}.get(want, True) and not isinstance(value, bool)
    if not ok:
        raise GatelensError(f"{where} {key}: expected {'a number' if want == 'float' else want}"
                            f", got {value!r}")
    if key == "corpus" and Path(value).exists():  # a file: absolute, so any worker finds it
        return str(Path(value).resolve())
    return float(value) if want == "float" else value


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


def _table(doc: dict, section: str, where: str) -> dict:
    value = doc.get(section, {})
    if not isinstance(value, dict):
        raise GatelensError(f"{where}: [{section}] must be a table, got {value!r}")
    return {k.replace("-", "_"): v for k, v in value.items()}


def parse_spec(doc: dict, where: str = "SPEC") -> StudySpec:
    """Check a SPEC document and expand it into trials; GatelensError names the bad key."""
    for section in doc:
        if section not in SECTIONS:
            raise GatelensError(f"{where}: unknown section [{section}] (sections: "
                                f"{', '.join(f'[{s}]' for s in SECTIONS)})")
    grid, train, ana = (_table(doc, s, where) for s in SECTIONS)
    if not grid:
        raise GatelensError(f"{where}: [grid] is empty; a study needs at least one list, "
                            "e.g. seed = [0, 1, 2]")
    values: dict[str, Any] = {}
    tables: dict[str, list[dict]] = {}  # [grid] axes whose values are tables of settings
    match = train.pop(MATCH, None)
    for section, table in (("grid", grid), ("train", train)):
        for key, value in table.items():
            at = f"{where}: [{section}]"
            if section == "grid" and isinstance(value, list) and value and all(
                    isinstance(v, dict) for v in value):
                tables[key] = _check_tables(at, key, value)
                continue
            if key not in TRAIN_KEYS:
                raise GatelensError(f"{at} {key}: unknown key (cell, seed, init or a train "
                                    "setting)")
            if key in values:
                raise GatelensError(f"{at} {key}: given in both [grid] and [train]")
            if isinstance(value, list):
                if section == "train":
                    raise GatelensError(f"{at} {key}: a list; lists belong in [grid]")
                if not value:
                    raise GatelensError(f"{at} {key}: an empty list gives no trials")
                if len({json.dumps(v) for v in value}) < len(value):
                    raise GatelensError(f"{at} {key}: a value is listed twice")
                values[key] = [_check_type(at, key, v) for v in value]
            else:
                values[key] = _check_type(at, key, value)
    in_tables = {k for axis in tables.values() for t in axis for k in t}
    for key in in_tables & {k for k, v in values.items() if isinstance(v, list)}:
        raise GatelensError(f"{where}: [grid] {key}: both a list and a key of a table axis")
    keys = set(values) | in_tables
    if "init" in keys and ({"forget_bias", "chrono"} & keys):
        raise GatelensError(f"{where}: init and forget_bias/chrono are exclusive; give init")
    if match is not None:
        from gatelens.families.spec import FAMILIES

        if match not in FAMILIES:
            raise GatelensError(f"{where}: [train] {MATCH}: expected a cell "
                                f"({', '.join(FAMILIES)}), got {match!r}")
        if "hidden" in in_tables or "hidden" in grid:
            raise GatelensError(f"{where}: [train] {MATCH}: sets every trial's hidden; give "
                                "the reference's hidden in [train] only")
    analysis = dict(ANALYSIS_DEFAULTS)
    for key, value in ana.items():
        if key not in ANALYSIS_DEFAULTS:
            raise GatelensError(f"{where}: [analysis] {key}: unknown key (windows, length, "
                                "perturb_pos)")
        if not isinstance(value, int) or isinstance(value, bool) or value < (key != "perturb_pos"):
            raise GatelensError(f"{where}: [analysis] {key}: expected a positive integer, "
                                f"got {value!r}")
        analysis[key] = value
    try:
        check_perturb_pos(analysis["perturb_pos"], analysis["length"])
    except GatelensError as e:
        raise GatelensError(f"{where}: [analysis] perturb_pos: {e}") from None
    return StudySpec(doc, _expand(values, tables, analysis, where, match), where)


def _check_tables(at: str, axis: str, value: list[dict]) -> list[dict]:
    """A table axis's values, each key a train setting with a scalar of its type."""
    if axis in TRAIN_KEYS or axis == "seed":
        raise GatelensError(f"{at} {axis}: a list of tables needs a name of its own (e.g. "
                            f"model), not a setting's")
    if len({json.dumps(v, sort_keys=True) for v in value}) < len(value):
        raise GatelensError(f"{at} {axis}: a table is listed twice")
    out = []
    for n, table in enumerate(value):
        row = {}
        for key, v in table.items():
            key = key.replace("-", "_")
            where = f"{at} {axis}[{n}]"
            if key not in TRAIN_KEYS or key == "seed":
                raise GatelensError(f"{where} {key}: unknown key (cell, init or a train "
                                    "setting other than seed)")
            if isinstance(v, list | dict):
                raise GatelensError(f"{where} {key}: expected one value, got {v!r}")
            row[key] = _check_type(where, key, v)
        if not row:
            raise GatelensError(f"{at} {axis}[{n}]: an empty table")
        out.append(row)
    return out


_VOCAB: dict[str, int] = {}


def vocab_size(corpus: str) -> int:
    """Characters in a corpus's vocabulary (what `gatelens train` builds), cached.

    >>> from gatelens.training.corpus import load_corpus
    >>> vocab_size("brackets"), len(set(load_corpus("brackets").text))
    (12, 12)
    """
    if corpus not in _VOCAB:
        from gatelens.training.corpus import Vocab, load_corpus

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
            name = "_".join(f"{k}-{names[(k, json.dumps(v, sort_keys=True))]}"
                            for k, v in (*condition.items(), ("seed", seed)))
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


def _digest(t: Trial) -> str:
    return hashlib.sha256(json.dumps(t.settings(), sort_keys=True).encode()).hexdigest()[:6]


def load_spec(path: str | Path) -> StudySpec:
    """Read and check SPEC.toml (a regular file of at most ``io.SMALL_CAP`` bytes)."""
    p = Path(path)
    if not os.path.lexists(p):
        raise GatelensError(f"{p}: no such spec file")
    text = read_utf8(p, "a SPEC.toml", SMALL_CAP)
    try:
        doc = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as e:
        raise GatelensError(f"{p}: not valid TOML ({' '.join(str(e).split())[:160]})") from None
    return parse_spec(doc, str(p))


def normal_settings(settings: object) -> object:
    """A trial's settings (trial.json's "spec") with the defaults of settings added since it
    was written filled in, so a trial run before a new TrainConfig field is still
    recognised as the same trial.

    >>> normal_settings({"train": {"hidden": 8}, "analysis": {}})["train"]["optimizer"]
    'adam'
    """
    if not (isinstance(settings, dict) and isinstance(settings.get("train"), dict)
            and isinstance(settings.get("analysis"), dict)):
        return settings
    return {**settings, "train": {**TrainConfig().to_dict(), **settings["train"]},
            "analysis": {**ANALYSIS_DEFAULTS, **settings["analysis"]}}


def check_corpora(trials: list[Trial]) -> None:
    """Every corpus the trials train on can be read (a built-in name, a valid synthetic
    spec, or a regular file within the size cap that opens): a one-line GatelensError
    naming the first that cannot, before any work starts. The text itself (UTF-8, length)
    is each trial's to check."""
    from gatelens.io import check_regular
    from gatelens.training.synthetic import is_synthetic
    from gatelens.training.synthetic import parse_spec as parse_synthetic

    for corpus in dict.fromkeys(t.train["corpus"] for t in trials):
        if is_synthetic(corpus):
            parse_synthetic(corpus)
        elif corpus == "shakespeare" and not Path(corpus).exists():
            continue  # built in (fetched once by the first trial that needs it)
        else:
            try:
                check_regular(corpus, "a UTF-8 corpus")
            except GatelensError as e:
                raise GatelensError(f"corpus {e}") from None


def preset_text(name: str) -> str:
    """A built-in preset's TOML (src/gatelens/studies/presets/NAME.toml).

    >>> preset_text("cells").splitlines()[0].startswith("#")
    True
    """
    if name not in PRESETS:
        raise GatelensError(f"--preset must be one of {', '.join(PRESETS)}, got {name!r}")
    presets = resources.files("gatelens.studies").joinpath("presets")
    return presets.joinpath(f"{name}.toml").read_text("utf-8")


def load_preset(name: str) -> StudySpec:
    """A built-in preset, parsed and checked.

    >>> len(load_preset("forget-bias").trials), len(load_preset("forget-bias").conditions())
    (30, 10)
    """
    return parse_spec(tomllib.loads(preset_text(name)), f"preset {name}")
