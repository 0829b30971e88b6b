"""``gatelens analyze`` end to end on tiny runs of each cell, and its bad-input errors."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from gatelens import cli
from gatelens.analysis.measure import Analysis
from gatelens.errors import GatelensError
from gatelens.lens.analyze import analyze
from gatelens.report.json_report import schema
from gatelens.training.config import TrainConfig
from gatelens.training.train import train

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away"]


def make_text(n_lines: int = 300, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
                     for _ in range(n_lines)) + "\n"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("runs")
    corpus = root / "corpus.txt"
    corpus.write_text(make_text(), encoding="utf-8")
    out = {}
    for cell in ("lstm", "gru", "rnn"):
        cfg = TrainConfig(corpus=str(corpus), cell=cell, hidden=10, steps=20, batch=8, seq=32,
                          eval_every=10, val_windows=4, layers=2 if cell == "gru" else 1)
        train(cfg, root / cell, progress=False)
        out[cell] = root / cell
    return out


def run_cli(argv: list[str]) -> int:
    return cli.main(["analyze", *argv])


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn"])
def test_analyze_each_cell(runs, cell, tmp_path, capsys):
    out = tmp_path / "a"
    assert run_cli([str(runs[cell]), "--windows", "3", "--length", "40", "--perturb-pos", "5",
                    "--out", str(out), "--quiet"]) == 0
    rep = json.loads((out / "report.json").read_text())
    jsonschema.validate(rep, schema())
    assert rep["model"]["cell"] == cell and rep["text"] == {
        "windows": 3, "length": 40, "source": rep["text"]["source"], "chars": 120,
        "chunks": 1, "percentiles": "exact (numpy.percentile, linear)", "memory_windows": 3}
    # report.json version 3: memory by direction, context used, saturation
    ly = rep["lyapunov"]
    assert rep["version"] == 4 and ly["k"] == min(64, ly["size"]) and ly["windows"] == 3
    assert ly["exponents"][0] == pytest.approx(rep["divergence"]["lyapunov_per_char"],
                                               abs=1e-12)  # λ_1 is the divergence rate
    assert rep["context"]["lengths"][0] == 1 and len(rep["context"]["excess_loss"]) > 1
    sat = rep["saturation"]
    assert (sat["keep_right_majority"] is None) == (cell == "rnn")
    assert rep["fixed_points"] is None  # only with --fixed-points
    assert "## Memory by direction" in (out / "report.md").read_text()
    assert rep["verification"]["one_step_max_abs_diff_h"] < 1e-5 and rep["verification"]["passed"]
    assert rep["perturbation"]["lags"] == [1, 2, 4, 8, 16, 32]
    assert sum(v["positions"] for v in rep["char_classes"].values()) == 3 * 40
    md = (out / "report.md").read_text()
    assert "## Perturbation decay" in md and "| lag k |" in md
    plots = sorted(p.name for p in (out / "plots").iterdir())
    assert "perturbation_decay.png" in plots and "validation_loss.png" in plots
    if cell == "rnn":
        assert rep["perturbation"]["forget_only"] is None
        assert rep["units"]["forget_mean"] is None and rep["gates"] == {"n_values": None}
        assert rep["decomposition"] is None
    else:
        gate = "f" if cell == "lstm" else "z"
        assert rep["units"]["gate"] == gate
        assert rep["units"]["n_units"] == 10 * (2 if cell == "gru" else 1)
        assert rep["baseline"]["step"] == 0 and rep["baseline"]["units"]["gate"] == gate
        assert abs(rep["decomposition"]["max_abs_residual"]) < 1e-5
        assert len(plots) == 8  # and the spectrum, context used, saturation (version 3)
        assert {"lyapunov_spectrum.png", "context_used.png", "gate_saturation.png"} <= set(plots)


def test_analysis_object(runs, tmp_path):
    a = analyze(runs["lstm"], windows=2, length=36, perturb_pos=3, out=tmp_path, progress=False,
                checkpoint=0)
    assert isinstance(a, Analysis) and a.out == tmp_path and a.perturb_pos == 3
    assert a.windows.shape == a.perturbed.shape == (2, 36) and a.windows.dtype == torch.int64
    assert (a.windows[:, 3] != a.perturbed[:, 3]).all()
    assert torch.equal(a.windows[:, :3], a.perturbed[:, :3])
    assert a.report["model"]["step"] == 0
    # at step 0 the trained model is the baseline: zero shift from init
    assert a.report["shift_from_init"]["mean_abs"] == 0.0
    dec = a.decomposition
    assert set(dec) == {"measured", "forget_path", "return_path"}
    assert dec["measured"].shape == (2, 36, 10) and dec["measured"].dtype == torch.float64
    assert torch.allclose(dec["forget_path"] + dec["return_path"], dec["measured"], atol=1e-6)
    assert len(a.chars) == a.report["model"]["vocab_size"] and all(p.exists() for p in a.plots)
    again = analyze(runs["lstm"], windows=2, length=36, perturb_pos=3, out=tmp_path / "b",
                    progress=False, checkpoint=0)
    assert again.report == a.report  # deterministic


def test_text_file(runs, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(make_text(50, seed=3), encoding="utf-8")
    a = analyze(runs["gru"], text=text, windows=2, length=50, out=tmp_path / "o",
                progress=False)
    assert a.report["text"]["source"] == str(text)
    assert a.chars[int(a.windows[1, 0])] == text.read_text()[50]


@pytest.mark.parametrize("argv_tail, message", [
    (["--checkpoint", "7"], "no checkpoint at step 7; steps available: 0, 10, 20"),
    (["--perturb-pos", "39"], "--perturb-pos 39 leaves no lag"),
    (["--perturb-pos", "-1"], "--perturb-pos -1 leaves no lag"),
    (["--windows", "1000"], "too short for 1000 windows"),
    (["--perturb-pos", "40"], "leaves no lag in windows of 40 characters (0..38)"),
    # a flag of another source is refused, not left unread
    (["--hidden", "7"], "analyze: --hidden applies to --weights FILE, not to a run directory"),
    (["--modules", "0"], "analyze: --modules applies to --model DIR, not to a run directory"),
    (["--trust-remote-code"], "--trust-remote-code applies to --model DIR"),
])
def test_bad_input_exit_2(runs, tmp_path, capsys, argv_tail, message):
    code = run_cli([str(runs["lstm"]), "--length", "40", "--out", str(tmp_path), "--quiet",
                    *argv_tail] + (["--text", str(runs["lstm"].parent / "corpus.txt")]
                                   if "--windows" in argv_tail else []))
    assert code == 2
    err = capsys.readouterr()
    line = (err.err + err.out).strip().splitlines()[-1]
    assert message in line and "Traceback" not in err.err


def test_bad_text_and_run(runs, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("the cat\nsat Z on" * 40, encoding="utf-8")
    with pytest.raises(GatelensError, match=r"'Z' at position 12"):
        analyze(runs["lstm"], text=bad, windows=2, length=40, out=tmp_path, progress=False)
    with pytest.raises(GatelensError, match="no such run directory"):
        analyze(tmp_path / "nope", out=tmp_path, progress=False)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((runs["lstm"] / "config.json").read_text())
    with pytest.raises(GatelensError, match="missing model.safetensors"):
        analyze(broken, out=tmp_path, progress=False)
    cfg = json.loads((runs["lstm"] / "config.json").read_text())
    cfg["model"]["hidden"] = 11
    (broken / "config.json").write_text(json.dumps(cfg))
    (broken / "model.safetensors").write_bytes((runs["lstm"] / "model.safetensors").read_bytes())
    with pytest.raises(GatelensError, match="weight_ih_l0 has shape"):
        analyze(broken, out=tmp_path, progress=False)


def test_report_command_rebuilds_html(runs, tmp_path, capsys):
    out = runs["gru"] / "analysis"
    assert run_cli([str(runs["gru"]), "--windows", "2", "--length", "36", "--perturb-pos", "3",
                    "--quiet"]) == 0
    page = (out / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" in page
    (out / "report.html").unlink()
    assert cli.main(["report", str(runs["gru"])]) == 0
    assert (out / "report.html").read_text() == page
    assert cli.main(["report", str(tmp_path)]) == 2  # no analysis there
    err = capsys.readouterr().err
    assert "page_data.json is missing" in err and "Traceback" not in err


def test_synthetic_corpus_report_reads_loss_against_its_bounds(tmp_path):
    """A run on `recall` gets the corpus's memoryless and best losses beside its own."""
    from gatelens.training.synthetic import describe_corpus

    spec = "recall:gap=5-20,chars=20000"
    run = tmp_path / "run"
    assert cli.main(["train", "--corpus", spec, "--hidden", "8", "--steps", "4", "--batch", "4",
                 "--seq", "64", "--eval-every", "2", "--val-windows", "2", "--out", str(run),
                 "--quiet"]) == 0
    a = analyze(run, windows=2, length=64, perturb_pos=8, out=tmp_path / "a", progress=False)
    ctl, desc = a.report["control_losses"], describe_corpus(spec)
    assert ctl["memoryless_loss"] == desc["memoryless_loss"] > ctl["best_loss"] == desc[
        "best_loss"]
    best = json.loads((run / "config.json").read_text())["best"]["val_loss"]
    assert ctl["best_val_loss"] == best
    assert "## Against the corpus's own bounds" in (tmp_path / "a" / "report.md").read_text()
