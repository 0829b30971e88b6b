"""``reproduce`` on a tiny corpus: trains, analyses, compares, and resumes."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from gatelens import half_life
from gatelens.errors import GatelensError
from gatelens.studies.reproduce import reproduce
from gatelens.studies.seed_compare import SEED_FIGURES, agrees

TINY = {"lstm": {"hidden": 8, "steps": 10, "batch": 4, "seq": 24, "eval_every": 5,
                 "val_windows": 2},
        "gru": {"hidden": 6, "steps": 6, "batch": 4, "seq": 24, "eval_every": 3,
                "val_windows": 2},
        "rnn": {"hidden": 6, "steps": 6, "batch": 4, "seq": 24, "eval_every": 3,
                "val_windows": 2}}


@pytest.fixture()
def corpus(tmp_path):
    rng = random.Random(1)
    words = ["to", "be", "or", "not", "that", "is", "the", "question"]
    p = tmp_path / "c.txt"
    p.write_text("\n".join(" ".join(rng.choice(words) for _ in range(6)) for _ in range(150)),
                 encoding="utf-8")
    return p


def test_reproduce_tiny_and_resume(tmp_path, corpus):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path / "rep"
        res = reproduce(out, corpus=str(corpus), sizes=TINY, windows=2, length=40,
                        perturb_pos=4, progress=False)
        again = reproduce(out, corpus=str(corpus), sizes=TINY, windows=2, length=40,
                          perturb_pos=4, progress=False)
        on_disk = json.loads((out / "reproduce.json").read_text())
        md = (out / "reproduce.md").read_text()
        longer = reproduce(out, corpus=str(corpus), sizes={"rnn": {**TINY["rnn"], "steps": 9}},
                           windows=2, length=40, perturb_pos=4, progress=False)
    finally:
        torch.set_num_threads(n)
    assert {c: r["how"] for c, r in res["runs"].items()} == {
        "lstm": "trained", "gru": "trained", "rnn": "trained"}
    assert {r["how"] for r in again["runs"].values()} == {"reused"}
    assert again["comparison"] == res["comparison"]
    assert longer["runs"]["rnn"]["how"] == "resumed" and longer["runs"]["rnn"]["steps_done"] == 9
    assert set(longer["runs"]) == {"rnn"}
    assert on_disk["seed"]["perturbation"]["ratio_at_max_lag"] == 10.6  # the seed's own text
    rows = {r["figure"]: r for r in on_disk["comparison"]}
    assert rows["f mean"]["seed"] == 0.495 and rows["f mean"]["lstm"] is not None
    assert rows["per-unit mean f: median"]["rnn"] is None  # a plain RNN has no forget gate
    assert rows["measured at lag 4"]["gru"] is not None
    assert "beside ours" in md and "| f mean | 0.495 |" in md
    # the verification row holds the one-step error of every cell, not a dash
    ver = rows["max |h_hand − h_torch|"]
    assert ver["seed"] == 6.85e-07 and all(0 <= ver[c] < 1e-5 for c in ("lstm", "gru", "rnn"))
    line = next(li for li in md.splitlines() if "h_hand" in li)
    cols = [c.strip() for c in re.split(r"(?<!\\)\|", line)][1:-1]  # figure, seed, 3 cells, …
    assert "—" not in cols[2:5] and float(cols[2]) < 1e-5, line
    for cell in ("lstm", "gru", "rnn"):  # every analysis has its page, linked from the summary
        assert (out / "analysis" / cell / "report.html").is_file()
        assert f"(analysis/{cell}/report.html)" in md
    assert [s["cell"] for s in on_disk["series"]] == ["lstm", "gru", "rnn"]
    with pytest.raises(GatelensError, match="other settings"):
        reproduce(out, corpus=str(corpus), sizes={"lstm": {**TINY["lstm"], "hidden": 9}},
                  windows=2, length=40, perturb_pos=4, progress=False)


def test_seed_figures_obey_the_half_life_formula():
    """The seed's half-lives follow from its own retention figures (docs/methods.md)."""
    u, p = SEED_FIGURES["units"], SEED_FIGURES["perturbation"]
    for k in ("min", "median", "max"):
        assert half_life(u["forget_mean"][k]) == pytest.approx(u["half_life"][k], abs=0.01)
    K = p["lags"][-1]
    assert K * half_life(p["measured"][-1]) == pytest.approx(p["half_life_measured"], abs=0.05)
    assert K * half_life(p["forget_only"][-1]) == pytest.approx(p["half_life_forget_only"],
                                                               abs=0.05)
    assert p["measured"][-1] / p["forget_only"][-1] == pytest.approx(p["ratio_at_max_lag"],
                                                                    abs=0.06)
    assert SEED_FIGURES["gates"]["n_values"] == 32 * 128 * 325


def test_agrees_rule():
    assert agrees("x", 100, 109) and not agrees("x", 100, 111)
    assert agrees("units with half-life ≥ 10", 0, 0) and not agrees("y", 0, 1)
    assert agrees("max |h_hand − h_torch|", 6.85e-07, 2e-5) is False


def test_forget_bias_study(tmp_path, corpus):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path / "rep"
        res = reproduce(out, corpus=str(corpus), sizes={"lstm": TINY["lstm"]}, windows=2,
                        length=40, perturb_pos=4, progress=False, forget_bias=2.5)
    finally:
        torch.set_num_threads(n)
    study = res["forget_bias"]
    assert study["forget_bias"] == 2.5 and study["how"] == "trained"
    run = json.loads((out / "runs" / "lstm-forget-bias" / "config.json").read_text())
    assert run["train"]["forget_bias"] == 2.5 and run["train"]["hidden"] == TINY["lstm"]["hidden"]
    biased = json.loads((out / "analysis" / "lstm-forget-bias" / "report.json").read_text())
    assert study["biased"]["half_life_measured"] == biased["perturbation"]["half_life_measured"]
    assert biased["units"]["init_value"] == pytest.approx(1 / (1 + 2.718281828459045 ** -2.5))
    plain_best = json.loads((out / "runs" / "lstm" / "config.json").read_text())["best"]
    assert study["best_val_loss_biased"] == run["best"]["val_loss"]
    assert study["best_val_loss_plain"] == plain_best["val_loss"]
    assert study["loss_worse"] is (run["best"]["val_loss"] > plain_best["val_loss"])
    md = (out / "reproduce.md").read_text()
    assert "## Forget bias 2.5" in md and "| best validation loss |" in md
    plain = reproduce(tmp_path / "p", corpus=str(corpus), sizes={"lstm": TINY["lstm"]},
                      windows=2, length=40, perturb_pos=4, progress=False)
    assert plain["forget_bias"] is None
    assert "--forget-bias 3" in (tmp_path / "p" / "reproduce.md").read_text()


def test_modern_cells_join_the_series(tmp_path, corpus, one_thread):
    """`--cells`: a minGRU trains and is compared beside the LSTM; an unknown cell is exit 2."""
    from gatelens.cli import main

    out = tmp_path / "rep"
    res = reproduce(out, corpus=str(corpus), windows=2, length=40, perturb_pos=4,
                    progress=False, sizes={"lstm": TINY["lstm"], "mingru": TINY["gru"]})
    assert [s["cell"] for s in res["series"]] == ["lstm", "mingru"]
    rows = {r["figure"]: r for r in res["comparison"]}
    assert rows["measured at lag 4"]["mingru"] is not None
    md = (out / "reproduce.md").read_text()
    assert "ours: mingru" in md and "(analysis/mingru/report.html)" in md
    rep = json.loads((out / "analysis" / "mingru" / "report.json").read_text())
    assert rep["units"]["gate"] == "keep" and rep["verification"]["passed"]
    assert main(["reproduce", "--cells", "lstm,nope", "--out", str(tmp_path / "x")]) == 2


def test_seeds_give_the_spread(tmp_path, corpus, one_thread):
    """`--seeds 3`: seeds 1 and 2 trained beside seed 0; the spread is over their reports."""
    import statistics

    out = tmp_path / "rep"
    res = reproduce(out, corpus=str(corpus), windows=2, length=40, perturb_pos=4,
                    progress=False, sizes={"rnn": TINY["rnn"]}, seeds=3)
    lives = [json.loads((out / "analysis" / d / "report.json").read_text())["perturbation"][
        "half_life_measured"] for d in ("rnn", "rnn-seed1", "rnn-seed2")]
    s = res["spread"]["rnn"]["perturbation_half_life"]
    finite = [v for v in lives if v is not None]
    assert s["n"] == 3 and s["n_infinite"] == 3 - len(finite)
    assert s["mean"] == pytest.approx(statistics.fmean(finite))
    assert s["sd"] == pytest.approx(statistics.stdev(finite))
    seeds = [json.loads((out / "runs" / d / "config.json").read_text())["train"]["seed"]
             for d in ("rnn", "rnn-seed1", "rnn-seed2")]
    assert seeds == [0, 1, 2]
    assert "## Over 3 seeds" in (out / "reproduce.md").read_text()
