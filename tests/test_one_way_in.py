"""One way in: ``gatelens analyze RUN``, ``Lens(gatelens.load_run(RUN))`` and ``analyze
--weights`` are one path to ``measure`` and give the same figures for the same model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import gatelens
from gatelens.cli import main
from gatelens.training.config import TrainConfig
from gatelens.training.train import train

pytestmark = pytest.mark.usefixtures("one_thread")
PROVENANCE = {("model", "path"), ("model", "class"), ("model", "weights"), ("model", "notes"),
              ("text", "source"), ("model", "checkpoint")}


def make_text(n_lines: int, seed: int = 1) -> str:
    import random

    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog and runs home".split()
    return "\n".join(" ".join(rng.choice(words) for _ in range(8)) for _ in range(n_lines))


def figures(report: dict, path: tuple = ()):
    """(key path, value) of every leaf but the provenance."""
    if isinstance(report, dict):
        for k, v in report.items():
            if (path + (k,))[:2] in PROVENANCE or k in ("explanation", "description"):
                continue
            yield from figures(v, path + (k,))
    elif isinstance(report, list):
        for i, v in enumerate(report):
            yield from figures(v, path + (i,))
    else:
        yield path, report


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("oneway")
    corpus = d / "corpus.txt"
    corpus.write_text(make_text(300), encoding="utf-8")
    out = {}
    # seed 0 for the LSTM: a weights file's analysis draws its perturbation with seed 0 too
    for name, kw in {"lstm-fb2": {"cell": "lstm", "forget_bias": 2.0, "seed": 0},
                     "mingru": {"cell": "mingru", "layers": 2, "seed": 3}}.items():
        cfg = TrainConfig(corpus=str(corpus), hidden=12, steps=6, batch=4, seq=32,
                          eval_every=3, val_windows=2, **kw)
        train(cfg, d / name, progress=False)
        out[name] = d / name
    (d / "text.txt").write_text(make_text(40, seed=5), encoding="utf-8")
    out["text"] = d / "text.txt"
    return out


@pytest.mark.parametrize("name", ["lstm-fb2", "mingru"])
def test_analyze_run_and_lens_on_load_run_agree(runs, tmp_path, name) -> None:
    run, text = runs[name], runs["text"]
    assert main(["analyze", str(run), "--text", str(text), "--windows", "4", "--length", "40",
                 "--perturb-pos", "6", "--out", str(tmp_path / "cli"), "--quiet"]) == 0
    cli = json.loads((tmp_path / "cli" / "report.json").read_text())
    lens = gatelens.Lens(gatelens.load_run(run))
    result = lens.analyze(str(text), windows=4, length=40, perturb_pos=6)
    mine = result.reports["rnn"]
    a, b = dict(figures(cli)), dict(figures(mine))
    assert set(a) == set(b)
    differ = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    assert not differ, differ
    assert cli["baseline"] is not None and cli["baseline"]["step"] == 0
    if name == "lstm-fb2":  # the keep gate's starting value is σ(2), not 0.5
        assert cli["units"]["init_value"] == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert mine["model"]["path"] == "rnn" and cli["model"]["path"] == ""


def test_weights_file_takes_the_same_path(runs, tmp_path) -> None:
    """The run's weights as a plain state_dict file: the same figures but the baseline's
    (a weights file has no step 0) and the run's own facts."""
    run, text = runs["lstm-fb2"], runs["text"]
    weights = tmp_path / "w.safetensors"
    save_file(load_file(str(run / "model.safetensors")), str(weights))
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps(json.loads((run / "config.json").read_text())["vocab"]))
    assert main(["analyze", "--weights", str(weights), "--vocab", str(vocab), "--text",
                 str(text), "--head", "head.", "--prefix", "rnn.", "--windows", "4",
                 "--length", "40", "--perturb-pos", "6", "--out", str(tmp_path / "w")]) == 0
    assert main(["analyze", str(run), "--text", str(text), "--windows", "4", "--length", "40",
                 "--perturb-pos", "6", "--out", str(tmp_path / "cli"), "--quiet"]) == 0
    w, cli = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("w", "cli"))
    for key in ("gates", "units", "perturbation", "char_classes", "divergence",
                "output_reach", "verification"):
        got, want = dict(figures(w[key])), dict(figures(cli[key]))
        if key == "units":  # a file knows no forget bias: init 0.5
            got.pop(("below_init",)), want.pop(("below_init",))
            got.pop(("init_value",)), want.pop(("init_value",))
        assert got == want, key
    assert w["baseline"] is None


def test_a_run_is_an_explicit_context_lens_takes(runs) -> None:
    info = gatelens.load_run(runs["mingru"], checkpoint="final")
    model = info.model
    assert info.step == 6 and info.baseline().step == 0
    assert len(info.vocab) == model.vocab_size and info.seed == 3
    assert gatelens.Lens(info).vocab == info.vocab
    # the context is an argument, never an attribute stuck on the module
    assert not hasattr(model, "gatelens_run") and gatelens.Lens(model).run_info is None
    assert gatelens.Lens(model, run=info).vocab == info.vocab
