"""report.json, version 3 (docs/design.md; version 1 and 2 files are still read): assembling it,
its schema, reading the history.

Keys that do not apply to a cell are null, never missing; infinities are null (JSON has
no inf). Extra keys beside docs/design.md's: "pooling", "baseline.step", "shift_from_init",
"decomposition", "history", "units.per_unit", "perturbation.return_path" and
"perturbation.measured_h".

>>> null_units(650)["n_units"], null_units(650)["forget_mean"]
(650, None)
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gatelens.analysis.perturbation import PerturbationDecay
from gatelens.analysis.units import UnitTimescales, shift_from_init
from gatelens.io import atomic_write_json
from gatelens.report.words import report_in_unit, unit_of

if TYPE_CHECKING:
    from gatelens.analysis.causal import CausalMemory
    from gatelens.analysis.measure import Analysis
    from gatelens.analysis.saturation import GateSaturation

VERSION = 4
POOLING = ("layers pooled: a unit of any layer counts as one unit; the carried state s is "
           "every layer's state concatenated, each scaled by its own layer's keep gate")


def schema() -> dict:
    """The JSON schema of report.json v4 (``gatelens/report/schema.json``), its keep-gate
    names (``units.gate``) those of every registered family (a family added by
    ``GATELENS_FAMILIES`` included), so the file's list is never the only word.

    >>> schema()["properties"]["version"]
    {'enum': [1, 2, 3, 4]}
    >>> "alpha" in schema()["$defs"]["units"]["properties"]["gate"]["enum"]
    True
    """
    from gatelens.families.registry import cell_specs

    out = json.loads(resources.files(__package__).joinpath("schema.json").read_text("utf-8"))
    gate = out["$defs"]["units"]["properties"]["gate"]
    names = {s.keep_gate for s in cell_specs().values() if s.keep_gate is not None}
    gate["enum"] = [*(g for g in gate["enum"] if g is not None),
                    *sorted(names - set(gate["enum"])), None]
    return out


def null_units(n_units: int) -> dict:
    """The "units" table of a cell without a keep gate (plain RNN): every figure null."""
    return {"gate": None, "init_value": None, "n_units": n_units, "below_init": None,
            "half_life_ge_10": None, "forget_mean": None, "half_life": None, "per_unit": None}


#: above this many units, report.json holds a summary of a per-unit array (its quantiles
#: and a histogram) and the array itself goes to ARRAYS, so the JSON stays readable
PER_UNIT_CAP = 4096
ARRAYS = "arrays.safetensors"
HIST_BINS = 50


def summarize_array(values: np.ndarray, key: str) -> dict:
    """Quantiles and a histogram of a per-unit array, and where the whole array is.

    >>> d = summarize_array(np.linspace(0, 1, 101), "units.per_unit")
    >>> d["quantiles"]["p50"], sum(d["histogram"]["counts"]), d["file"]
    (0.5, 101, 'arrays.safetensors')
    """
    v = np.asarray(values, dtype=np.float64)
    ok = v[np.isfinite(v)]
    qs = {"min": 0, "p1": 1, "p5": 5, "p25": 25, "p50": 50, "p75": 75, "p95": 95, "p99": 99,
          "max": 100}
    quant = {k: (float(np.percentile(ok, q)) if ok.size else None) for k, q in qs.items()}
    counts, edges = np.histogram(ok, bins=HIST_BINS) if ok.size else (np.zeros(0), [])
    return {"n": int(v.size), "mean": float(ok.mean()) if ok.size else None, "quantiles": quant,
            "histogram": {"edges": [float(e) for e in edges],
                          "counts": [int(c) for c in counts]},
            "file": ARRAYS, "key": key}


def units_dict(units: UnitTimescales | None, n_units: int, key: str = "units.per_unit",
               arrays: dict | None = None) -> dict:
    """report.json's "units"; where ``arrays`` (``report_arrays``) holds ``key``, the
    per-unit means are a summary (``per_unit_summary``) and the array is ``ARRAYS``'s."""
    if units is None:
        return null_units(n_units)
    out = units.to_dict()
    if key in (arrays or {}):
        out["per_unit"] = None
        out["per_unit_summary"] = summarize_array(arrays[key], key)
    return out


def saturation_dict(sat: GateSaturation | None, arrays: dict | None = None) -> dict | None:
    """report.json's "saturation"; a gate whose shares ``arrays`` holds is summarised
    (``left_summary``, ``right_summary``), the arrays in ``ARRAYS``."""
    if sat is None:
        return None
    out, arrays = sat.to_dict(), arrays or {}
    for g in sat.gates:
        keys = {side: f"saturation.{g}.{side}" for side in ("left", "right")}
        if keys["left"] in arrays:
            out[g] = {"left": None, "right": None, **{
                f"{side}_summary": summarize_array(arrays[k], k) for side, k in keys.items()}}
    return out


def report_arrays(a: Analysis) -> dict[str, np.ndarray]:
    """The per-unit arrays (above ``PER_UNIT_CAP`` units) report.json summarises, whole, by
    their key (``ARRAYS``'s tensors, float32 there): the one rule of what is summarised."""
    out = {}
    for key, units in (("units.per_unit", a.units),
                       ("baseline.units.per_unit", None if a.baseline is None
                        else a.baseline.units)):
        if units is not None and units.n_units > PER_UNIT_CAP:
            out[key] = np.asarray(units.forget_means, dtype=np.float64)
    sat = a.saturation
    for g in [] if sat is None else sat.gates:
        for side in ("left", "right"):
            if len(getattr(sat, side)[g]) > PER_UNIT_CAP:
                out[f"saturation.{g}.{side}"] = np.asarray(getattr(sat, side)[g], np.float64)
    return out


def decomposition_summary(decay: PerturbationDecay) -> dict | None:
    """Forget path and return path (‖·‖ / ‖δs_p‖) at the reported lags, with the residual."""
    if decay.forget_only is None:
        return None
    return {"lags": list(decay.lags), "forget_path": list(decay.forget_only),
            "return_path": list(decay.return_path or []),
            "max_abs_residual": decay.max_abs_residual}


def build_report(a: Analysis) -> dict:
    """report.json from an analysis's result objects (``gatelens.analysis.measure.Analysis``)."""
    n_units = a.model["hidden"] * a.model["layers"]
    arrays = report_arrays(a)  # the per-unit arrays too large to hold here: summarised
    base = shift = None
    if a.baseline is not None:
        b = a.baseline
        base = {"step": b.step, "gates": b.gates.to_dict(),
                "units": units_dict(b.units, n_units, "baseline.units.per_unit", arrays)}
        if a.units is not None and b.units is not None:
            shift = shift_from_init(a.units, b.units)
    report = {
        "version": VERSION,
        "model": {**a.model, "path": a.model.get("path", "")},
        "text": dict(a.text),
        "verification": {**a.verification.to_report(), "explanation": a.verification.explain()},
        "gates": a.gates.to_dict(),
        "units": units_dict(a.units, n_units, arrays=arrays),
        "perturbation": a.perturbation.to_dict(),
        "char_classes": a.char_classes.to_dict(),
        "baseline": base,
        "shift_from_init": shift,
        "decomposition": decomposition_summary(a.perturbation),
        "history": a.history,
        "pooling": POOLING,
        "divergence": None if a.divergence is None else {
            **a.divergence.to_dict(), "description": a.divergence.describe()},
        "output_reach": None if a.reach is None else {
            **a.reach.to_dict(), "curve": [float(v) for v in a.reach.curve],
            "description": a.reach.describe()},
        "output_reach_note": a.reach_note,
        "control_losses": a.control,
        "lyapunov": None if a.lyapunov is None else {
            **a.lyapunov.to_dict(), "k": a.lyapunov.k, "size": a.lyapunov.size,
            "windows": a.lyapunov.windows, "rule": a.lyapunov.rule,
            "description": a.lyapunov.describe()},
        "fixed_points": None if a.fixed_points is None else {
            **a.fixed_points.to_dict(), "description": a.fixed_points.describe()},
        "context": None if a.context is None else {
            **a.context.to_dict(), "windows": a.text.get("memory_windows"),
            "description": a.context.describe()},
        "saturation": saturation_dict(a.saturation, arrays),
        "causal": causal_dict(getattr(a, "causal", None)),
        "arrays": {"file": ARRAYS, "keys": sorted(arrays)} if arrays else None,
    }
    report = report_in_unit(report, unit_of(report))  # gatelens's sentences, in the unit
    nonfinite = sanitize(report)
    report["nonfinite"] = None if not nonfinite else {
        "count": len(nonfinite), "paths": nonfinite[:20],
        "reason": "figures that are NaN or infinite where a number was due (the module's "
                  "states or weights are not finite on this text) are null here"}
    check_report(report)
    return report


def causal_dict(causal: CausalMemory | None) -> dict | None:
    """report.json's ``causal`` (null: the module's family is neither cut nor ablated)."""
    return None if causal is None else causal.to_dict()


def sanitize(node: object, path: str = "") -> list[str]:
    """Replace every NaN in ``node`` (in place) by None: JSON has no NaN, and a report must
    be valid JSON whatever the figures. Returns where they were. (Infinities are already
    null by the result objects' own rule: a half-life that never halves.)

    >>> rep = {"a": [1.0, float("nan")], "b": {"c": float("inf")}}
    >>> sanitize(rep), rep
    (['/a[1]', '/b/c'], {'a': [1.0, None], 'b': {'c': None}})
    """
    found: list[str] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else ()
    for k, v in list(items):
        where = f"{path}/{k}" if isinstance(node, dict) else f"{path}[{k}]"
        if isinstance(v, float) and not math.isfinite(v):
            node[k] = None
            found.append(where)
        elif isinstance(v, (dict, list)):
            found += sanitize(v, where)
    return found


def check_report(report: dict) -> None:
    """Cheap structural check of docs/design.md's keys (the full schema is checked in tests)."""
    for key in schema()["required"]:
        if key not in report:
            raise ValueError(f"report.json lacks {key!r}")
    json.dumps(report, allow_nan=False)  # no inf / nan may slip through


#: What readers of report.json use beyond its schema (merge.py): their kinds (schema_check)
_EXTRAS = {"control_losses": ("dict", None)}
_CONTROL = {"memoryless_loss": ("number",), "best_loss": ("number",)}


def read_report(path: Path) -> dict:
    """A report.json read back (a study's merge): a regular UTF-8 file of JSON, an object;
    one of this version held to its whole schema (``schema_check.check_schema``), the keys
    readers use besides typed too. Anything else is one GatelensError naming the file and
    the key."""
    from gatelens.errors import GatelensError
    from gatelens.io import SMALL_CAP, read_utf8
    from gatelens.schema_check import check_fields, check_schema

    try:
        report = json.loads(read_utf8(path, "a report.json", SMALL_CAP))
    except (json.JSONDecodeError, RecursionError) as e:
        raise GatelensError(f"{path}: not a gatelens report ({type(e).__name__})") from None
    if not isinstance(report, dict):
        raise GatelensError(f"{path}: not a gatelens report (not a JSON object)")
    if report.get("version") == VERSION:
        check_schema(report, schema(), path)
    check_fields(report, _EXTRAS, path)
    if isinstance(report.get("control_losses"), dict):
        check_fields(report["control_losses"], _CONTROL, path, "control_losses",
                     required=tuple(_CONTROL))
    for block, key, kinds in (("units", "per_unit", ("list", None)),
                              ("model", "vocab_size", ("int", None))):
        if isinstance(report.get(block), dict):
            check_fields(report[block], {key: kinds}, path, block)
    return report


def write_report_json(path: Path, report: dict) -> None:
    """Write report.json atomically (allow_nan=False: infinities must already be null)."""
    atomic_write_json(path, report)
