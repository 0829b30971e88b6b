"""The data report.html embeds: values match the Trace and report.json within the
quantisation error, sizes stay within budget, and the page is self-contained."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gatelens.analysis.measure import encoder_runner, measure
from gatelens.readout.trace_types import gate_names
from gatelens.report.html import HtmlReport, rebuild_html, render_html
from gatelens.report.html_data import dequantize, half_life, page_data, quantize
from gatelens.report.write import write_analysis


def _tol(enc: dict) -> np.ndarray:
    """The promised error bound of a quantised array, per unit."""
    lo, hi = np.asarray(enc["lo"]), np.asarray(enc["hi"])
    return (hi - lo) / 510 + 1e-6 * np.maximum(np.abs(lo), np.abs(hi)) + 1e-9


def _close(enc: dict, x: np.ndarray) -> None:
    err = np.abs(dequantize(enc) - x)  # (..., H)
    assert list(x.shape) == enc["shape"]
    assert (err <= _tol(enc)).all(), float(err.max())


@pytest.fixture(scope="module", params=["lstm", "gru", "rnn_tanh"])
def small(request: pytest.FixtureRequest, analysis_of) -> SimpleNamespace:
    return analysis_of(request.param, windows=5, length=40, hidden=12, perturb_pos=8, seed=3)


def test_quantize_round_trip_within_bound() -> None:
    x = np.random.default_rng(0).normal(size=(7, 9, 5)) * np.array([1, 10, 0.1, 100, 0])
    _close(quantize(x), x)


def test_half_life_matches_methods() -> None:
    assert round(half_life(0.494), 2) == 0.98
    assert round(half_life(0.793), 2) == 2.99
    assert round(half_life(0.307), 2) == 0.59
    assert half_life(1.0) is None


def test_signals_and_texts_match_the_trace(small: SimpleNamespace) -> None:
    d = page_data(small, max_windows=3)
    cell = small.trace.cell
    assert d["meta"]["signals"] == [n.split(".")[1] for n in gate_names(cell, 1)]
    assert d["meta"]["shown"] == 3 and d["meta"]["n_windows"] == 5
    rows = small.windows[:3].tolist()
    assert d["texts"] == ["".join(small.chars[c] for c in row) for row in rows]
    for label, tr in (("trained", small.trace), ("untrained", small.baseline.trace)):
        for s in d["meta"]["signals"]:
            _close(d["models"][label]["layer0"][s], tr[f"layer0.{s}"][:3].double().numpy())


def test_units_match_trace_and_report(small: SimpleNamespace) -> None:
    u = page_data(small)["units"]["layer0"]
    keep = small.trace.keep_gate or "h"
    mean = small.trace[f"layer0.{keep}"].double().mean(dim=(0, 1)).numpy()  # (H,)
    init = small.baseline.trace[f"layer0.{keep}"].double().mean(dim=(0, 1)).numpy()
    np.testing.assert_allclose(u["mean"], mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(u["init"], init, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(u["shift"], mean - init, rtol=1e-5, atol=1e-6)
    if small.trace.keep_gate is None:
        assert u["half_life"] == [None] * len(mean)
        return
    np.testing.assert_allclose(u["half_life"], [half_life(a) for a in mean], rtol=1e-5)
    summary = small.report["units"]["forget_mean"]
    assert min(u["mean"]) == pytest.approx(summary["min"], rel=1e-5)
    assert max(u["mean"]) == pytest.approx(summary["max"], rel=1e-5)
    assert float(np.median(u["mean"])) == pytest.approx(summary["median"], rel=1e-5)


def test_perturbation_matches_decomposition(small: SimpleNamespace) -> None:
    d = page_data(small, max_windows=2)
    pert, p = d["perturb"], small.perturb_pos
    assert pert["pos"] == p
    for w in range(2):
        assert pert["texts"][w][p] == small.chars[int(small.perturbed[w, p])]
        assert pert["orig"][w] == small.chars[int(small.windows[w, p])] != pert["texts"][w][p]
    dec = small.decomposition
    if dec is None:
        s = small.trace.state_name
        measured = (small.trace_perturbed[f"layer0.{s}"] - small.trace[f"layer0.{s}"]).double()
        assert set(pert["paths"]) == {"measured"} and not pert["has_paths"]
        dec = {"measured": measured}
    for k, v in dec.items():
        x = v[:2, p:].numpy()  # (W, T-p, S)
        _close(pert["paths"][k], x)
        np.testing.assert_allclose(pert["norms"][k], np.linalg.norm(x, axis=-1), rtol=1e-5,
                                   atol=1e-9)
    full = dec["measured"].numpy()
    ratio = np.linalg.norm(full[:, p:], axis=-1) / np.linalg.norm(full[:, p], axis=-1)[:, None]
    np.testing.assert_allclose(pert["mean_ratio"]["measured"], ratio.mean(0), rtol=1e-5)
    lags = small.report["perturbation"]["lags"]
    np.testing.assert_allclose([pert["mean_ratio"]["measured"][k] for k in lags],
                               small.report["perturbation"]["measured"], rtol=1e-5)


def test_two_layers_pool_the_state(analysis_of) -> None:
    a = analysis_of("gru", windows=3, length=10, hidden=4, perturb_pos=2, layers=2)
    b, t, h, p = 3, 10, 4, 2
    data = page_data(a)
    assert data["meta"]["layers"] == ["layer0", "layer1"]
    _close(data["models"]["trained"]["layer1"]["n"], a.trace["layer1.n"].double().numpy())
    assert data["perturb"]["paths"]["measured"]["shape"] == [b, t - p, 2 * h]
    # layer 1's units are the second half of the pooled per-unit means
    np.testing.assert_allclose(data["units"]["layer1"]["mean"], a.units.forget_means[h:],
                               rtol=1e-5)
    assert render_html(data).count('class="ch"') == 0  # characters are drawn by the script


def test_seed_size_page_within_5_mb(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    chars = [chr(32 + k) for k in range(84)] + ["\n"]  # V = 85
    lstm = torch.nn.LSTM(85, 325, batch_first=True)  # the seed's size
    ids = torch.randint(0, 85, (32, 128), generator=g)  # (B, T)
    # every section of the page, the spectrum and context used on 2 windows (their plots
    # are the same size on 32; the page's size is the per-character data's)
    a = measure(lstm, encoder_runner(lambda i: torch.nn.functional.one_hot(i, 85).float()),
                ids, chars, memory_windows=2)
    write_analysis(a, tmp_path)  # report.json, report.md, plots and the page
    size = (tmp_path / "report.html").stat().st_size
    print(f"seed-size report.html: {size / 1e6:.2f} MB")
    assert size <= 4_500_000
    data = json.loads((tmp_path / "page_data.json").read_text())
    assert 1 <= data["meta"]["shown"] < 32 and "report" not in data and "plots" not in data
    assert data["plot_files"] == [p.relative_to(tmp_path).as_posix() for p in a.plots]


def test_page_is_self_contained(tmp_path: Path, analysis_of) -> None:
    a = analysis_of("lstm", windows=3, length=24, hidden=6, perturb_pos=4)
    a.text["source"] = "</script><script>alert(1)</script>"
    page = write_analysis(a, tmp_path).out.joinpath("report.html").read_text()
    assert page.count("</script>") == 2  # the data block and the code, nothing injected
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert not re.search(r"@import|url\(\s*['\"]?(https?:)?//", page)
    assert page.count("data:image/png;base64,") == len(a.plots) >= 4
    block = re.search(r'<script id="gl-data" type="application/json">(.*?)</script>', page, re.S)
    assert json.loads(block.group(1))["report"]["text"]["source"].startswith("</script>")


def test_rebuild_reproduces_the_page(tmp_path: Path, analysis_of) -> None:
    a = analysis_of("gru", windows=3, length=24, hidden=6, perturb_pos=4)
    first = write_analysis(a, tmp_path).out.joinpath("report.html").read_text()
    (tmp_path / "report.html").unlink()
    assert rebuild_html(tmp_path).read_text() == first
    shown = HtmlReport.from_dir(tmp_path)._repr_html_()
    assert shown.startswith("<iframe srcdoc=") and "&lt;!DOCTYPE html&gt;" in shown


def test_rebuild_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="page_data.json"):
        rebuild_html(tmp_path)
