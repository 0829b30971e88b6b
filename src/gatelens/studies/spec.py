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
two directories) the first keeps the name and the later one gets a digest of itself. An id
over 120 characters (a long file name) is cut, with a digest of the whole id.

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

import json
import os

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from gatelens.analysis.measure import check_perturb_pos
from gatelens.analysis.settings import DEFAULTS
from gatelens.errors import GatelensError
from gatelens.io import SMALL_CAP, read_utf8
from gatelens.studies.grid import (  # noqa: F401 - the grid's names are the spec's too
    _VOCAB,
    MATCH,
    MAX_TRIALS,
    Trial,
    _digest,
    _expand,
    _slug,
    parse_init,
    vocab_size,
)
from gatelens.training.config import TrainConfig

SECTIONS = ("grid", "train", "analysis")
#: What a study's analyses leave out unless its [analysis] asks: the spectrum and the
#: context used (every checkpoint is analysed, and they would multiply a trial's time)
STUDY_ANALYSIS = {"exponents": 0, "memory_windows": 0}
ANALYSIS_DEFAULTS = {k: DEFAULTS.to_dict()[k] for k in ("windows", "length", "perturb_pos")}
PRESETS = ("dynamics", "forget-bias", "cells", "long-memory", "modern", "barely-moved",
           "modern-official", "modern-2026")
_FIELD_TYPES = {f.name: str(f.type).split("|")[0].strip() for f in fields(TrainConfig)}
TRAIN_KEYS = (*_FIELD_TYPES, "init")


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
        from gatelens.families.registry import canonical as canonical_cell
        from gatelens.families.registry import cell_names, recipes

        if not isinstance(match, str) or canonical_cell(match) not in recipes():
            raise GatelensError(f"{where}: [train] {MATCH}: expected a cell "
                                f"({', '.join(cell_names())}), got {match!r}")
        if "hidden" in in_tables or "hidden" in grid:
            raise GatelensError(f"{where}: [train] {MATCH}: sets every trial's hidden; give "
                                "the reference's hidden in [train] only")
    analysis = dict(ANALYSIS_DEFAULTS)
    for key, value in ana.items():
        if key == "exponents":  # optional: a study measures no spectrum unless asked
            if value != "all" and (not isinstance(value, int) or isinstance(value, bool)
                                   or value < 0):
                raise GatelensError(f"{where}: [analysis] exponents: expected a count >= 0 "
                                    f"or \"all\", got {value!r}")
            analysis[key] = value
            if value != 0:  # asked for: on the windows an analysis measures it on
                analysis.setdefault("memory_windows", DEFAULTS.memory_windows)
            continue
        if key not in ANALYSIS_DEFAULTS:
            raise GatelensError(f"{where}: [analysis] {key}: unknown key (windows, length, "
                                "perturb_pos, exponents)")
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


def check_sizes(trials: list[Trial]) -> None:
    """Every trial fits in this machine's memory (training/fits.py: its parameters with
    their gradients and optimiser state, and one batch), checked on the meta device before
    Ray starts; the first that cannot is a one-line GatelensError naming it (before: each
    such trial failed alone, and the start-up estimate built the first one for real)."""
    from gatelens.training.model import check_fits
    from gatelens.training.train import model_config

    seen = set()
    for t in trials:
        cfg = t.config()
        key = json.dumps([model_config(cfg), cfg.corpus, cfg.batch, cfg.seq, cfg.optimizer],
                         sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        try:
            vocab = vocab_size(cfg.corpus)
        except GatelensError:  # a text that does not decode: that trial's own failure
            continue
        try:
            check_fits(cfg, model_config(cfg), vocab)
        except GatelensError as e:
            raise GatelensError(f"trial {t.id}: {e}") from None


def corpora_outside(spec: StudySpec, trials: list[Trial]) -> list[str]:
    """The corpus files of ``trials`` outside the directory of ``spec``'s SPEC.toml (none
    for a preset): allowed, and said on the study's start-up line, since every report
    publishes windows of its corpus."""
    home = Path(spec.where)
    if not home.is_file():
        return []
    home = home.resolve().parent
    files = (Path(t.train["corpus"]) for t in trials if Path(t.train["corpus"]).is_file())
    return [str(f) for f in dict.fromkeys(files) if not f.resolve().is_relative_to(home)]


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
