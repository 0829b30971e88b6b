"""benchmarks/gpu_check.py, the script a lent CUDA machine runs, exercised on the CPU.

``--device cpu`` compares the CPU with itself through the whole script (read-out and
verification of every cell, a short training run, report.json, the verdicts), so a broken
script is caught here and not on the device; without CUDA the default prints one line.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_cuda_it_says_so_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load().main([]) == 0
    assert capsys.readouterr().out == "no CUDA device\n"


def test_the_whole_script_on_the_cpu_against_itself(capsys, tmp_path):
    out = tmp_path / "rows.json"
    assert load().main(["--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    checks = [r["check"] for r in rows]
    assert checks[:7] == ["read-out lstm", "read-out lstm 2-layer", "read-out gru", "read-out rnn",
                          "read-out mingru", "read-out minlstm", "read-out slstm"]
    assert checks[7:] == ["train 4 steps on cpu", "report.json cpu vs cpu",
                          "mamba 2 x 32 top states cpu vs cpu", "mamba 2 x 32 verify on cpu",
                          "mamba 2 x 32 trace / forward on cpu",
                          "lstm 2 x 24 (PTB-large) report cpu vs cpu"]
    assert all(r["ok"] for r in rows)
    # the same device twice: the same numbers and words
    for r in (rows[8], rows[9], rows[-1]):
        assert r["value"] == 0.0, r
    assert "none" in rows[8]["note"] and "none" in rows[-1]["note"]
    assert "ok   read-out lstm" in capsys.readouterr().out


def test_only_runs_the_parts_named_and_refuses_others(capsys, tmp_path):
    out = tmp_path / "rows.json"
    assert load().main(["--device", "cpu", "--only", "real", "--json", str(out)]) == 0
    assert [r["check"].split()[0] for r in json.loads(out.read_text())] == [
        "mamba", "mamba", "mamba", "lstm"]
    with pytest.raises(SystemExit) as e:
        load().main(["--device", "cpu", "--only", "real,gpu"])
    assert e.value.code == 2 and "--only: gpu is not one of" in capsys.readouterr().err


def test_reports_compare_figures_and_verdicts_but_not_rounding():
    """Two devices round differently: a read-out's error or a split's residual differs by its
    own size, so it is left out; any other figure off by more than 1e-3, or a verdict that
    differs, fails the row."""
    gc = load()
    base = {"verification": {"one_step_max_abs_diff_h": 2e-8, "tolerance": 1e-5,
                             "passed": True},
            "decomposition": {"max_abs_residual": 1e-18}, "units": {"median": 0.5}}
    moved = {"verification": {"one_step_max_abs_diff_h": 9e-8, "tolerance": 1e-5,
                              "passed": True},
             "decomposition": {"max_abs_residual": 3e-17}, "units": {"median": 0.5}}
    assert gc.compare_reports("x", base, moved)["ok"]
    off = {**moved, "units": {"median": 0.5006}}
    row = gc.compare_reports("x", base, off)
    assert not row["ok"] and ".units.median" in row["note"]
    said = {**moved, "verification": {**moved["verification"], "passed": False}}
    assert not gc.compare_reports("x", base, said)["ok"]


def test_the_device_wheels_are_the_versions_gatelens_pins():
    """benchmarks/device_wheels.sh fetches transformers for the device machine: at the
    version pyproject.toml pins (a bumped pin without it would check another package)."""
    import re

    root = SCRIPT.parents[1]
    pins = dict(re.findall(r'"(transformers)==([\d.]+)', (root / "pyproject.toml").read_text()))
    fetched = dict(re.findall(r"(transformers)==([\d.]+)",
                              (root / "benchmarks" / "device_wheels.sh").read_text()))
    assert pins and pins == fetched
    from importlib.metadata import version

    assert version("transformers") == pins["transformers"]
