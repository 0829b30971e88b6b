"""report.json: built from hand-made results, validated against schema.json, nulls for RNN."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest

from gatelens.analysis import (
    CharClasses,
    GateDistributions,
    PerturbationDecay,
    summarize_units,
)
from gatelens.analysis.measure import Baseline
from gatelens.io import atomic_write_json
from gatelens.readout.verify import VerifyResult
from gatelens.report.json_report import build_report, schema
from gatelens.report.markdown import render_markdown
from gatelens.report.plots import write_plots
from gatelens.training.runs import read_history

STATS = {"mean": 0.5, "p5": 0.1, "p25": 0.3, "p50": 0.5, "p75": 0.7, "p95": 0.9}


def decay(rnn: bool = False, measured_last: float = 0.01) -> PerturbationDecay:
    lags = [1, 2, 4]
    return PerturbationDecay(
        position=3, n=4, state="h" if rnn else "c", lags=lags,
        measured=[0.5, 0.2, measured_last], forget_only=None if rnn else [0.4, 0.1, 0.0],
        return_path=None if rnn else [0.1, 0.1, 0.01], measured_h=[0.5, 0.2, 0.02],
        curves={"measured": np.array([1.0, 0.5, 0.2, 0.1, 0.01])},
        max_abs_residual=None if rnn else 1e-8)


def report(cell: str = "lstm") -> dict:
    rnn = cell == "rnn"
    letters = {"lstm": "ifgo", "gru": "rzn", "rnn": ""}[cell]
    gates = GateDistributions(cell, None if rnn else 96, {g: dict(STATS) for g in letters})
    units = None if rnn else summarize_units(np.array([0.3, 0.5, 1.0]), "f", 0.5)
    base_units = None if rnn else summarize_units(np.array([0.5, 0.5, 0.5]), "f", 0.5)
    classes = CharClasses(None if rnn else "f",
                          {"space": None, "newline": None, "other": None if rnn else 0.5},
                          {"space": 0, "newline": 0, "other": 32})
    c = None if cell != "lstm" else 2e-7
    return build_report(SimpleNamespace(
        model={"cell": cell, "hidden": 3, "layers": 1, "step": 40},
        text={"windows": 4, "length": 8, "source": "test"},
        verification=VerifyResult(cell, [], 1e-7, c, c, 2e-7), gates=gates,
        divergence=None, reach=None, reach_note="no logits", control=None,
        units=units, perturbation=decay(rnn), char_classes=classes,
        baseline=Baseline(0, None, gates, base_units), lyapunov=None, fixed_points=None,
        context=None, saturation=None,
        history={"step": [0, 20, 40], "val_loss": [4.0, 3.0, 3.1], "train_step": [1, 2],
                 "train_loss": [4.1, 3.9]}))


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn"])
def test_report_validates_and_writes(cell, tmp_path):
    rep = report(cell)
    jsonschema.validate(rep, schema())
    atomic_write_json(tmp_path / "report.json", rep)  # allow_nan=False: no inf slipped in
    assert json.loads((tmp_path / "report.json").read_text()) == rep
    top = ["version", "model", "text", "verification", "gates", "units", "perturbation",
           "char_classes", "baseline"]
    assert list(rep)[:len(top)] == top and rep["version"] == 4


def test_rnn_keys_are_null_not_missing():
    rep = report("rnn")
    p = rep["perturbation"]
    assert p["forget_only"] is None and p["half_life_forget_only"] is None
    assert p["ratio_at_max_lag"] is None and rep["decomposition"] is None
    assert rep["units"]["forget_mean"] is None and rep["units"]["n_units"] == 3
    assert set(rep["units"]) >= {"gate", "init_value", "below_init", "half_life_ge_10",
                                 "half_life"}
    assert rep["verification"]["one_step_max_abs_diff_c"] is None


def test_infinities_become_null():
    rep = report("lstm")
    assert rep["units"]["half_life"]["max"] is None  # f̄ = 1.0 never halves
    assert rep["perturbation"]["ratio_at_max_lag"] is None  # a(K) = 0
    d = decay(measured_last=1.0)
    assert d.half_life_measured == math.inf and d.to_dict()["half_life_measured"] is None


def test_schema_rejects_missing_and_wrong_keys():
    rep = report("gru")
    for path in (("perturbation", "forget_only"), ("units", "below_init"), ("baseline",)):
        bad = copy.deepcopy(rep)
        node = bad
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema())
    bad = copy.deepcopy(rep)
    bad["gates"]["z"]["p50"] = "x"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema())


def test_markdown_and_plots(tmp_path):
    for cell in ("lstm", "rnn"):
        rep = report(cell)
        paths = write_plots(rep, tmp_path / cell, {"measured": np.array([1.0, 0.5, 0.1]),
                                                   **({} if cell == "rnn" else {
                                                       "forget_path": np.array([1, .4, .1]),
                                                       "return_path": np.array([0, .1, .0])})},
                            best_step=20)
        assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
        names = {p.name for p in paths}
        assert "validation_loss.png" in names and "perturbation_decay.png" in names
        assert ("units_forget_mean.png" in names) == (cell == "lstm")
        md = render_markdown(rep, [f"plots/{n}" for n in sorted(names)])
        for title in ("## Gate distributions", "## Per-unit timescales",
                      "## Perturbation decay", "## Gates by input character"):
            assert title in md
        assert md.count("Reading:") >= (4 if cell == "lstm" else 2)
        assert "| lag k | measured r(k) |" in md and "layers pooled" in md


def test_read_history(tmp_path):
    (tmp_path / "history.csv").write_text(
        "step,train_loss,val_loss,seconds\n0,,4.4,0\n1,4.3,,0.1\n2,4.1,4.0,0.2\n")
    h = read_history(tmp_path)
    assert h == {"step": [0, 2], "val_loss": [4.4, 4.0], "train_step": [1, 2],
                 "train_loss": [4.3, 4.1]}
    assert read_history(tmp_path / "none") is None


def test_results_check_their_shapes():
    with pytest.raises(ValueError):
        GateDistributions("lstm", 10, {"f": {**STATS, "p5": 0.95}})  # unordered percentiles
    with pytest.raises(ValueError):
        PerturbationDecay(3, 1, "c", [1, 2], [0.5], None, None, [0.5, 0.2], {})


def test_reach_is_plotted_beside_the_state_curves(tmp_path, analysis_of):
    """A model with logits gets the KL curve as a second panel of the decay plot."""
    import matplotlib.image as mpimg

    from gatelens.report.write import write_analysis

    a = analysis_of("gru", windows=3, length=24, hidden=6, perturb_pos=4)
    assert a.reach is not None
    write_analysis(a, tmp_path)
    wide = mpimg.imread(tmp_path / "plots" / "perturbation_decay.png")  # (H, W, 4)
    a.reach = None
    a.__dict__.pop("report", None)  # the cached report.json content, rebuilt without reach
    write_analysis(a, tmp_path / "no_reach")
    narrow = mpimg.imread(tmp_path / "no_reach" / "plots" / "perturbation_decay.png")
    assert wide.shape[1] > 1.5 * narrow.shape[1]


def test_schema_keep_gate_names_are_the_registrys(monkeypatch):
    """units.gate's names come from the registered families, one added later included."""
    from types import SimpleNamespace

    from gatelens.families import registry
    from gatelens.report.json_report import schema as load_schema

    specs = registry.cell_specs()
    enum = load_schema()["$defs"]["units"]["properties"]["gate"]["enum"]
    assert {s.keep_gate for s in specs.values()} <= set(enum) and enum[-1] is None
    leaky = SimpleNamespace(keep_gate="lam")  # the one field schema() reads
    monkeypatch.setattr(registry, "cell_specs", lambda: {**specs, "leaky": leaky})
    assert "lam" in load_schema()["$defs"]["units"]["properties"]["gate"]["enum"]
