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

from gatelens.report.html import HtmlReport, rebuild_html, render_html, write_html
from gatelens.report.html_data import dequantize, half_life, page_data, quantize
from gatelens.report.html_demo import demo_analysis
from gatelens.trace_types import Trace, gate_names


def _tol(enc: dict) -> np.ndarray:
    """The promised error bound of a quantised array, per unit."""
    lo, hi = np.asarray(enc["lo"]), np.asarray(enc["hi"])
    return (hi - lo) / 510 + 1e-6 * np.maximum(np.abs(lo), np.abs(hi)) + 1e-9


def _close(enc: dict, x: np.ndarray) -> None:
    err = np.abs(dequantize(enc) - x)  # (..., H)
    assert list(x.shape) == enc["shape"]
    assert (err <= _tol(enc)).all(), float(err.max())


@pytest.fixture(scope="module", params=["lstm", "gru", "rnn_tanh"])
def small(request: pytest.FixtureRequest) -> SimpleNamespace:
    return demo_analysis(request.param, windows=5, length=40, hidden=12, perturb_pos=8, seed=3)


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
    for label, tr in (("trained", small.trace), ("untrained", small.baseline)):
        for s in d["meta"]["signals"]:
            _close(d["models"][label]["layer0"][s], tr[f"layer0.{s}"][:3].double().numpy())


def test_units_match_trace_and_report(small: SimpleNamespace) -> None:
    u = page_data(small)["units"]["layer0"]
    keep = small.trace.keep_gate or "h"
    mean = small.trace[f"layer0.{keep}"].double().mean(dim=(0, 1)).numpy()  # (H,)
    init = small.baseline[f"layer0.{keep}"].double().mean(dim=(0, 1)).numpy()
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


def test_two_layers_pool_the_state() -> None:
    b, t, h, p = 3, 10, 4, 2
    g = torch.Generator().manual_seed(0)
    names = gate_names("gru", 2)
    tensors = {n: torch.rand(b, t, h, generator=g) for n in names}
    tr = Trace("gru", 2, False, tensors)
    d = torch.randn(b, t, 2 * h, generator=g, dtype=torch.float64)
    a = SimpleNamespace(report={}, out=Path("."), run=Path("r"), chars=list("abc"),
                        windows=torch.randint(0, 3, (b, t), generator=g),
                        perturbed=torch.randint(0, 3, (b, t), generator=g), perturb_pos=p,
                        trace=tr, baseline=tr, trace_perturbed=tr, plots=[],
                        decomposition={"measured": d, "forget_path": d / 2, "return_path": d / 2})
    data = page_data(a)
    assert data["meta"]["layers"] == ["layer0", "layer1"]
    _close(data["models"]["trained"]["layer1"]["n"], tensors["layer1.n"].double().numpy())
    assert data["perturb"]["paths"]["measured"]["shape"] == [b, t - p, 2 * h]
    assert render_html(data).count('class="ch"') == 0  # characters are drawn by the script


def test_seed_size_page_within_5_mb(tmp_path: Path) -> None:
    a = demo_analysis("lstm", out=tmp_path)  # B=32, T=128, H=325, V=85
    assert (a.windows.shape, len(a.chars)) == (torch.Size([32, 128]), 85)
    path = write_html(a)
    size = path.stat().st_size
    print(f"seed-size report.html: {size / 1e6:.2f} MB")
    assert size <= 4_500_000  # headroom for analyze's five plots (~0.2 MB in base64)
    data = json.loads((tmp_path / "page_data.json").read_text())
    assert 1 <= data["meta"]["shown"] < 32 and "report" not in data and "plots" not in data
    assert data["plot_files"] == ["plots/gates.png", "plots/state.png"]


def test_page_is_self_contained(tmp_path: Path) -> None:
    a = demo_analysis("lstm", windows=3, length=24, hidden=6, perturb_pos=4, out=tmp_path)
    a.report["text"]["source"] = "</script><script>alert(1)</script>"
    page = write_html(a).read_text()
    assert page.count("</script>") == 2  # the data block and the code, nothing injected
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert not re.search(r"@import|url\(\s*['\"]?(https?:)?//", page)
    assert page.count("data:image/png;base64,") == 2
    block = re.search(r'<script id="gl-data" type="application/json">(.*?)</script>', page, re.S)
    assert json.loads(block.group(1))["report"]["text"]["source"].startswith("</script>")


def test_rebuild_reproduces_the_page(tmp_path: Path) -> None:
    a = demo_analysis("gru", windows=3, length=24, hidden=6, perturb_pos=4, out=tmp_path)
    (tmp_path / "report.json").write_text(json.dumps(a.report))
    first = write_html(a).read_text()
    (tmp_path / "report.html").unlink()
    assert rebuild_html(tmp_path).read_text() == first
    shown = HtmlReport.from_dir(tmp_path)._repr_html_()
    assert shown.startswith("<iframe srcdoc=") and "&lt;!DOCTYPE html&gt;" in shown


def test_rebuild_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="page_data.json"):
        rebuild_html(tmp_path)
