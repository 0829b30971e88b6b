"""`gatelens patch RUN`: the sweep end to end on a tiny trained run (patch.json, patch.png,
patch.md), the same figures as ``gatelens.patch_sweep``, and every bad input one line,
exit 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import gatelens
from gatelens.cli import main
from gatelens.training.config import TrainConfig
from gatelens.training.train import train

pytestmark = pytest.mark.usefixtures("one_thread")

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (importlib mode)
from cli_helpers import one_line  # noqa: E402
from conftest import make_text  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("patch")
    (d / "c.txt").write_text(make_text(200), encoding="utf-8")
    cfg = TrainConfig(corpus=str(d / "c.txt"), hidden=12, layers=2, steps=30, batch=8, seq=32,
                      eval_every=30, val_windows=4, lr=0.01, device="cpu")
    train(cfg, d / "run", progress=False)
    return d / "run"


CLEAN, CORRUPT = "the quick brown fox jumps over", "the quick brown dog jumps over"


def test_patch_writes_the_matrix_heatmap_and_report(run, tmp_path, capsys) -> None:
    out = tmp_path / "p"
    assert main(["patch", str(run), "--clean", CLEAN, "--corrupt", CORRUPT, "--metric",
                 "logit-diff", "--pair", "re", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.split() == [str(out / f) for f in ("patch.json", "patch.png", "patch.md")]
    assert "attribution Spearman" in printed.err
    doc = json.loads((out / "patch.json").read_text())
    names = ["rnn.layer0.c", "rnn.layer0.h", "rnn.layer1.c", "rnn.layer1.h"]
    assert doc["names"] == names and doc["positions"] == list(range(len(CLEAN)))
    # the same figures as the Python call
    lens = gatelens.Lens(gatelens.load_run(run))
    r, e = lens.vocab.index("r"), lens.vocab.index("e")
    assert doc["inputs"]["clean"] == CLEAN and doc["metric"] == f"logit_diff({r}, {e})"
    res = gatelens.patch_sweep(lens, CLEAN, CORRUPT, metric=gatelens.logit_diff(r, e))
    assert np.allclose(np.array(doc["effect"]), res.effect, atol=1e-12)
    assert np.allclose(np.array(doc["attribution"]), res.attribution, atol=1e-12)
    assert doc["spearman"] == pytest.approx(res.spearman)
    first = CLEAN.index("quick brown ") + len("quick brown ")  # the first changed character
    assert np.abs(np.array(doc["effect"])[:, :first]).max() <= 1e-5  # identical prefix
    assert (out / "patch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "patch.md").read_text()
    assert md.startswith("# Activation patching: logit_diff(") and "![patching](patch.png)" in md
    assert "Spearman over the cells" in md and "| `rnn.layer" in md


def test_patch_on_the_runs_windows_names_and_positions(run, tmp_path, capsys) -> None:
    out = tmp_path / "w"
    assert main(["patch", str(run), "--windows", "3", "--length", "24", "--perturb-pos", "10",
                 "--names", "rnn.layer0.c+rnn.layer0.h,rnn.layer1.h", "--positions", "8:12,23",
                 "--metric", "loss", "--no-attribution", "--out", str(out), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    doc = json.loads((out / "patch.json").read_text())
    assert doc["names"] == ["rnn.layer0.c + rnn.layer0.h", "rnn.layer1.h"]
    assert doc["positions"] == [8, 9, 10, 11, 23] and doc["batch"] == 3 and doc["length"] == 24
    assert doc["attribution"] is None and doc["spearman"] is None
    assert "character 10 replaced" in doc["inputs"]["source"]
    before = np.array(doc["patched"])[:, :2]  # before the replaced character: nothing to
    assert np.abs(before - doc["m_corrupt"]).max() <= 1e-6 * max(1, doc["m_corrupt"])  # patch
    assert main(["patch", str(run), "--windows", "3", "--length", "24", "--perturb-pos", "10",
                 "--names", "rnn.layer0.h", "--positions", "4,12", "--metric", "loss",
                 "--quiet"]) == 0
    assert (run / "patch" / "patch.json").exists()  # the default --out: RUN/patch


BAD = [
    (["--clean", "abc"], "give --clean and --corrupt together"),
    (["--clean", "the fox", "--corrupt", "the dog!"], "must be equally long"),
    (["--clean", "the f#x", "--corrupt", "the fox"], "character '#' at position 5"),
    (["--clean", CLEAN, "--corrupt", CLEAN], "equal, so the normalised effect is undefined"),
    (["--names", "rnn.layer9.c"], "no trace key 'rnn.layer9.c'"),
    (["--names", "rnn.layer0.c,"], "an empty key"),
    (["--positions", "1,x"], "'x' is not a position"),
    (["--positions", "400"], "position 400 is outside the window"),
    (["--metric", "logit-diff"], "needs --pair AB"),
    (["--metric", "logit-diff", "--pair", "r#"], "character '#' is not in the model's"),
    (["--metric", "kl", "--pair", "re"], "--pair is for --metric logit-diff"),
    (["--metric", "bleu"], "invalid choice"),
    (["--perturb-pos", "99"], "--perturb-pos 99 is outside windows of 40"),
    (["--checkpoint", "77"], "77"),
]


@pytest.mark.parametrize("extra,words", BAD)
def test_bad_input_is_one_line_exit_2(run, tmp_path, capsys, extra, words) -> None:
    line = one_line(capsys, ["patch", run, "--windows", "2", "--length", "40",
                             "--out", tmp_path / "o", *extra])
    assert words in line, line


def test_bad_run_and_out_are_one_line(run, tmp_path, capsys) -> None:
    assert "no such run directory" in one_line(capsys, ["patch", tmp_path / "nope"])
    (tmp_path / "f").write_text("x")
    assert "is a file" in one_line(capsys, ["patch", run, "--out", tmp_path / "f" / "o"])
