"""report.json, version 2 (docs/design.md; version 1 files are still read): assembling it,
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
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from gatelens.analysis.perturbation import PerturbationDecay
from gatelens.analysis.units import UnitTimescales, shift_from_init
from gatelens.io import atomic_write_json
from gatelens.training.runs import read_history  # noqa: F401 - report.json's history

if TYPE_CHECKING:
    from gatelens.analysis.measure import Analysis

VERSION = 2
POOLING = ("layers pooled: a unit of any layer counts as one unit; the carried state s is "
           "every layer's state concatenated, each scaled by its own layer's keep gate")


def schema() -> dict:
    """The JSON schema of report.json v2 (``gatelens/report/schema.json``).

    >>> schema()["properties"]["version"]
    {'enum': [1, 2]}
    """
    return json.loads(resources.files(__package__).joinpath("schema.json").read_text("utf-8"))


def null_units(n_units: int) -> dict:
    """The "units" table of a cell without a keep gate (plain RNN): every figure null."""
    return {"gate": None, "init_value": None, "n_units": n_units, "below_init": None,
            "half_life_ge_10": None, "forget_mean": None, "half_life": None, "per_unit": None}


def units_dict(units: UnitTimescales | None, n_units: int) -> dict:
    return null_units(n_units) if units is None else units.to_dict()


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
    base = shift = None
    if a.baseline is not None:
        b = a.baseline
        base = {"step": b.step, "gates": b.gates.to_dict(), "units": units_dict(b.units, n_units)}
        if a.units is not None and b.units is not None:
            shift = shift_from_init(a.units, b.units)
    report = {
        "version": VERSION,
        "model": {**a.model, "path": a.model.get("path", "")},
        "text": dict(a.text),
        "verification": {**a.verification.to_report(), "explanation": a.verification.explain()},
        "gates": a.gates.to_dict(),
        "units": units_dict(a.units, n_units),
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
    }
    check_report(report)
    return report


def check_report(report: dict) -> None:
    """Cheap structural check of docs/design.md's keys (the full schema is checked in tests)."""
    for key in schema()["required"]:
        if key not in report:
            raise ValueError(f"report.json lacks {key!r}")
    json.dumps(report, allow_nan=False)  # no inf / nan may slip through


def write_report_json(path: Path, report: dict) -> None:
    """Write report.json atomically (allow_nan=False: infinities must already be null)."""
    atomic_write_json(path, report)
