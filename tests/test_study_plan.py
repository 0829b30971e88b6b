"""A study's plan before Ray: stable trial ids, settings of older trials still recognised,
and the start-up estimate of time (training and analyses) and disk."""

from __future__ import annotations

import json
import shutil

import pytest

from gatelens.errors import GatelensError
from gatelens.studies.estimate import TrialCost, duration, estimate, measure_trial, size
from gatelens.studies.spec import parse_spec
from gatelens.studies.study import new_record, plan, run_trial

TRAIN = {"hidden": 8, "steps": 4, "eval_every": 2, "batch": 4, "seq": 24, "val_windows": 4}
ANALYSIS = {"windows": 2, "length": 24, "perturb_pos": 8}


def test_a_negative_seed_is_named_apart_from_its_positive():
    ids = [t.id for t in parse_spec({"grid": {"seed": [3, -3, 0]}}).trials]
    assert ids == ["seed-3", "seed-m3", "seed-0"]


def test_extending_a_grid_keeps_every_trial_id(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "t.txt").write_text("x"), (b / "t.txt").write_text("y")
    small = {"grid": {"cell": ["lstm"], "init": ["none", "forget_bias:1"], "seed": [0, 1],
                      "corpus": [str(a / "t.txt")],
                      "model": [{"layers": 1}]}}
    big = {"grid": {"cell": ["lstm", "gru"], "init": ["none", "forget_bias:1", "chrono:8"],
                    "seed": [0, 1, -1, 7], "corpus": [str(a / "t.txt"), str(b / "t.txt")],
                    "model": [{"layers": 1}, {"layers": 2}]}}
    before = {t.id: t.settings() for t in parse_spec(small).trials}
    after = {t.id: t.settings() for t in parse_spec(big).trials}
    assert len(after) == 2 * 3 * 4 * 2 * 2
    assert all(after.get(i) == s for i, s in before.items())  # same names, same settings
    named = [i for i in after if "corpus-t.txt-" in i]  # the second t.txt: a digest of itself
    assert len(named) == len(after) // 2


def test_a_trial_run_before_new_settings_existed_is_still_reused(tiny_text, tmp_path):
    spec = parse_spec({"grid": {"seed": [0]}, "train": {"corpus": str(tiny_text), **TRAIN},
                       "analysis": ANALYSIS})
    old = {**new_record(spec.trials[0]), "status": "done"}
    for key in ("optimizer", "bias_init"):  # as trial.json was written before they existed
        del old["spec"]["train"][key]
    path = tmp_path / "trials" / old["id"] / "trial.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(old))
    reused, todo = plan(spec, tmp_path)
    assert [r["id"] for r in reused] == [old["id"]] and todo == []
    changed = parse_spec({"grid": {"seed": [0]}, "analysis": ANALYSIS,
                          "train": {"corpus": str(tiny_text), **TRAIN, "optimizer": "sgd"}})
    with pytest.raises(GatelensError, match="other settings"):
        plan(changed, tmp_path)


def test_the_estimate_counts_analyses_and_disk_and_matches_a_real_trial(tiny_text, tmp_path,
                                                                        one_thread, monkeypatch):
    spec = parse_spec({"grid": {"seed": list(range(10_000))}, "analysis": ANALYSIS,
                       "train": {"corpus": str(tiny_text), **TRAIN}})
    cost = measure_trial(spec.trials[0])
    assert cost.analysis_s > 0 and cost.analysis_bytes > 0 and cost.checkpoint_bytes > 0
    est = estimate(spec.trials, workers=2, cost=cost)
    n = 3  # checkpoints a trial: steps 0, 2, 4
    assert est.analysis_s == pytest.approx(10_000 * (n * cost.analysis_s + cost.plots_s))
    assert est.seconds == pytest.approx((est.train_s + est.analysis_s) / 2, rel=1e-3)
    line = est.line(workers=2, free=10**6)
    assert "analyses" in line and "on disk" in line and "WARNING: only 1 MB free" in line
    import gatelens.studies.study as study

    monkeypatch.setattr(study, "measure_trial", lambda trial, full=True: cost)
    start = study._estimate(spec.trials, 2, tmp_path)  # what the start-up line says
    assert start.startswith(f"about {duration(est.seconds)} on 2 workers (training ")
    assert f"{cost.analysis_s:.2f} s an analysis x 3 checkpoints" in start
    assert f"and about {size(est.bytes)} on disk" in start
    rec = run_trial(spec.trials[1], tmp_path)  # what one trial really takes on disk
    real = sum(p.stat().st_size for p in (tmp_path / "trials" / rec["id"]).rglob("*")
               if p.is_file())
    assert 0.5 < est.per_trial_bytes / real < 2, (est.per_trial_bytes, real)
    assert est.analysis_s / 10_000 > 0.3 * rec["timings"]["analyze"]
    shutil.rmtree(tmp_path / "trials")


def test_the_new_training_settings_are_study_keys():
    spec = parse_spec({"grid": {"optimizer": ["adam", "rmsprop"], "bias_init": ["zero"]},
                       "train": {"hidden": 8}})
    assert [t.id for t in spec.trials] == ["optimizer-adam_bias_init-zero_seed-0",
                                           "optimizer-rmsprop_bias_init-zero_seed-0"]
    assert [(t.train["optimizer"], t.train["bias_init"]) for t in spec.trials] == [
        ("adam", "zero"), ("rmsprop", "zero")]
    with pytest.raises(GatelensError, match="--optimizer must be one of adam, sgd, rmsprop"):
        parse_spec({"grid": {"optimizer": ["lbfgs"]}})


def test_trials_run_seed_by_seed_so_a_study_stopped_early_has_every_condition(tmp_path):
    spec = parse_spec({"grid": {"cell": ["lstm", "gru", "rnn"], "seed": [2, 0]}})
    assert [t.id for t in spec.trials][:2] == ["cell-lstm_seed-2", "cell-lstm_seed-0"]
    done = spec.trials[2]  # gru seed 2, finished: reused, not run
    path = tmp_path / "trials" / done.id / "trial.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**new_record(done), "status": "done"}))
    reused, todo = plan(spec, tmp_path)
    assert [r["id"] for r in reused] == [done.id]
    assert [t.id for t in todo] == ["cell-lstm_seed-2", "cell-rnn_seed-2", "cell-lstm_seed-0",
                                    "cell-gru_seed-0", "cell-rnn_seed-0"]


def test_the_estimate_times_each_cell_on_its_own_trial(monkeypatch, tmp_path):
    # an sLSTM steps 5x slower than an LSTM of its size: scaling the LSTM's step by
    # parameter count would promise a fifth of its training time
    spec = parse_spec({"grid": {"cell": ["lstm", "gru"], "seed": [0, 1]},
                       "train": {**TRAIN, "steps": 1000}, "analysis": ANALYSIS})
    first = {}
    for t in spec.trials:
        first.setdefault(t.train["cell"], t)

    def cost(trial, step_s, plots_s):
        return TrialCost(trial, step_s, eval_s=0.0, setup_s=0.0, analysis_s=0.0,
                         plots_s=plots_s, checkpoint_bytes=1, resume_bytes=1,
                         analysis_bytes=1, plots_bytes=0)

    lstm, gru = cost(first["lstm"], 0.01, 2.0), cost(first["gru"], 0.05, 0.0)
    est = estimate(spec.trials, 1, lstm, {"gru": gru})
    # 2 LSTM trials at 10 s of training and 2 GRU trials at 50 s (the same sizes); every
    # trial's final checkpoint pays the first trial's plots
    assert est.train_s == pytest.approx(2 * 10 + 2 * 50)
    assert est.analysis_s == pytest.approx(4 * 2.0)
    assert est.cells == 2 and "1 other cells measured on a trial each" in est.line(1)
    # from the LSTM's trial alone the GRU (fewer parameters) would look faster, not slower
    assert estimate(spec.trials, 1, lstm).train_s < 4 * 10
    import gatelens.studies.study as study

    calls = []

    def measured(trial, full=True):
        calls.append((trial.id, full))
        return lstm if trial.train["cell"] == "lstm" else gru

    monkeypatch.setattr(study, "measure_trial", measured)
    todo = study.seed_by_seed(spec.trials)
    start = study._estimate(todo, 1, tmp_path)
    assert calls == [("cell-lstm_seed-0", True), ("cell-gru_seed-0", False)]
    assert start.startswith(f"about {duration(est.seconds)} on 1 worker (training 2:00")


def test_a_long_value_makes_an_id_a_directory_can_have(tmp_path):
    """A 240-character corpus file name made a 258-character trial id: no directory can
    have that name (255 bytes), so the trial failed on its own directory."""
    long = tmp_path / ("c" * 240 + ".txt")
    long.write_text("abc abc\n" * 50, encoding="utf-8")
    spec = parse_spec({"grid": {"seed": [0], "corpus": [str(long), "brackets"]},
                       "train": {"hidden": 4}})
    ids = [t.id for t in spec.trials]
    assert len(ids[0]) == 120 and ids[0].startswith("corpus-ccc") and ids[1] == \
        "corpus-brackets_seed-0"
    (tmp_path / "trials" / ids[0]).mkdir(parents=True)  # a name the file system takes
