"""A study's SPEC.toml: sections, keys, types and the grid of trials, all checked before any
work starts.

    [grid]       lists expand into a cartesian grid; scalars apply to every trial
                 (keys: cell, seed, init and any TrainConfig field)
    [train]      any `gatelens train` setting, one value for every trial
    [analysis]   windows, length, perturb_pos (`gatelens analyze`'s settings)

``init`` is "none", "forget_bias:B" or "chrono:TMAX". A condition is a setting of
everything but the seed.

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
import re

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from .analyze import check_perturb_pos
from .config import TrainConfig
from .errors import GatelensError

SECTIONS = ("grid", "train", "analysis")
ANALYSIS_DEFAULTS = {"windows": 32, "length": 128, "perturb_pos": 32}
PRESETS = ("dynamics", "forget-bias", "cells", "long-memory")
_FIELD_TYPES = {f.name: str(f.type).split("|")[0].strip() for f in fields(TrainConfig)}
TRAIN_KEYS = (*_FIELD_TYPES, "init")


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
    text = Path(value).name if isinstance(value, str) and "/" in value else str(value)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "x"


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
    for section, table in (("grid", grid), ("train", train)):
        for key, value in table.items():
            at = f"{where}: [{section}]"
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
    if "init" in values and ({"forget_bias", "chrono"} & set(values)):
        raise GatelensError(f"{where}: init and forget_bias/chrono are exclusive; give init")
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
    return StudySpec(doc, _expand(values, analysis, where), where)


def _expand(values: dict, analysis: dict, where: str) -> list[Trial]:
    axes = [k for k, v in values.items() if isinstance(v, list) and k != "seed"]
    seeds = values.get("seed", 0)
    seeds = seeds if isinstance(seeds, list) else [seeds]
    trials = []
    for combo in itertools.product(*(values[k] for k in axes)):
        condition = dict(zip(axes, combo, strict=True))
        for seed in seeds:
            setting = {**values, **condition, "seed": seed}
            if "init" in setting:
                setting["forget_bias"], setting["chrono"] = parse_init(setting.pop("init"), "")
            name = "_".join(f"{k}-{_slug(v)}" for k, v in (*condition.items(), ("seed", seed)))
            cfg = TrainConfig(**setting)
            try:
                cfg.validate()
            except GatelensError as e:
                raise GatelensError(f"{where}: trial {name}: {e}") from None
            trials.append(Trial(name, condition, seed, cfg.to_dict(), dict(analysis)))
    ids = [t.id for t in trials]
    if len(set(ids)) < len(ids):  # two values with one slug (corpora of one name in two dirs)
        trials = [Trial(f"{t.id}-{_digest(t)}", t.condition, t.seed, t.train, t.analysis)
                  for t in trials]
    return trials


def _digest(t: Trial) -> str:
    return hashlib.sha256(json.dumps(t.settings(), sort_keys=True).encode()).hexdigest()[:6]


def load_spec(path: str | Path) -> StudySpec:
    """Read and check SPEC.toml."""
    p = Path(path)
    if not p.is_file():
        raise GatelensError(f"{p}: no such spec file")
    try:
        doc = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise GatelensError(f"{p}: not valid TOML ({e})") from None
    return parse_spec(doc, str(p))


def preset_text(name: str) -> str:
    """A built-in preset's TOML (src/gatelens/presets/NAME.toml).

    >>> preset_text("cells").splitlines()[0].startswith("#")
    True
    """
    if name not in PRESETS:
        raise GatelensError(f"--preset must be one of {', '.join(PRESETS)}, got {name!r}")
    return resources.files("gatelens").joinpath("presets", f"{name}.toml").read_text("utf-8")


def load_preset(name: str) -> StudySpec:
    """A built-in preset, parsed and checked.

    >>> len(load_preset("forget-bias").trials), len(load_preset("forget-bias").conditions())
    (30, 10)
    """
    return parse_spec(tomllib.loads(preset_text(name)), f"preset {name}")
