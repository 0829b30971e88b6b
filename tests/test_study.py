"""gatelens study: a tiny grid through one local Ray (started once for the module), the
merge, reuse, resume, failures, bad specs and presets."""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gatelens.cli import main
from gatelens.errors import GatelensError
from gatelens.studies.merge import merge, report_figures
from gatelens.studies.spec import PRESETS, load_preset, load_spec, parse_spec
from gatelens.studies.study import ray_session, run_study, run_trial

# Ray clusters and sessions of their own: these tests run on one xdist worker, in turn
pytestmark = pytest.mark.xdist_group("ray")

WORDS = "the quick brown fox jumps over a lazy dog and then runs home to sleep".split()
TRAIN = {"hidden": 8, "steps": 4, "eval_every": 2, "batch": 4, "seq": 24, "val_windows": 4}
ANALYSIS = {"windows": 2, "length": 24, "perturb_pos": 8}


def make_text(n_lines: int, seed: int = 1) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(n_lines))


def write_spec(path: Path, grid: dict, train: dict, analysis: dict = ANALYSIS) -> Path:
    def value(v):
        return json.dumps(v)  # TOML and JSON agree on strings, numbers and lists

    lines = ["[grid]", *(f"{k} = {value(v)}" for k, v in grid.items()),
             "[train]", *(f"{k} = {value(v)}" for k, v in train.items()),
             "[analysis]", *(f"{k} = {value(v)}" for k, v in analysis.items())]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray with 2 CPUs for the module (its start takes seconds)."""
    with ray_session(workers=2):
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "tiny.txt"
    path.write_text(make_text(n_lines=200), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def study(ray_local, corpus, tmp_path_factory):
    """The 2 x 2 study (cell x seed), run once."""
    d = tmp_path_factory.mktemp("study")
    spec = write_spec(d / "spec.toml", {"cell": ["lstm", "gru"], "seed": [0, 1]},
                      {"corpus": str(corpus), **TRAIN})
    res = run_study(spec, d / "out", workers=2, progress=False)
    return spec, res


def _final_report(out: Path, trial: dict) -> dict:
    return json.loads((out / trial["checkpoints"][-1]["report"]).read_text(encoding="utf-8"))


def _nulls(figs: dict) -> dict:
    return {k: (v if math.isfinite(v) else None) for k, v in figs.items()}


def test_two_by_two_study_runs_and_its_figures_are_the_trials_reports(study):
    _, res = study
    s = json.loads((res.out / "study.json").read_text(encoding="utf-8"))
    assert (res.ran, res.reused, res.failed) == (4, 0, 0)
    assert s["version"] == 1 and s["engine"] == "ray"
    assert [t["id"] for t in s["trials"]] == ["cell-lstm_seed-0", "cell-lstm_seed-1",
                                              "cell-gru_seed-0", "cell-gru_seed-1"]
    for t in s["trials"]:
        assert t["status"] == "done" and t["error"] is None
        assert [c["step"] for c in t["checkpoints"]] == [0, 2, 4]
        for c in t["checkpoints"]:
            rep = json.loads((res.out / c["report"]).read_text(encoding="utf-8"))
            assert {k: v for k, v in c["figures"].items() if k != "val_loss"} == \
                _nulls(report_figures(rep))
        figs = t["figures"]
        assert {k: v for k, v in figs.items()
                if k not in ("val_loss", "best_val_loss", "best_step")} == \
            _nulls(report_figures(_final_report(res.out, t)))
        assert figs["best_val_loss"] == min(c["val_loss"] for c in t["checkpoints"])
        assert figs["best_step"] == min(t["checkpoints"], key=lambda c: c["val_loss"])["step"]
        assert (res.out / t["run"] / "checkpoints" / "step-000002.safetensors").exists()
    lstm = s["conditions"][0]
    assert lstm["condition"] == {"cell": "lstm"} and lstm["n"] == 2
    vals = [t["figures"]["forget_gate_mean"] for t in s["trials"][:2]]
    got = lstm["figures"]["forget_gate_mean"]
    assert got["mean"] == pytest.approx(statistics.fmean(vals))
    assert got["sd"] == pytest.approx(statistics.stdev(vals))
    assert [o["step"] for o in lstm["over_training"]] == [0, 2, 4]
    html = (res.out / "study.html").read_text(encoding="utf-8")
    assert html.count("data:image/png;base64,") == 7 and "http" not in html
    keeps = [k for t in s["trials"][:2] for k in _final_report(res.out, t)["units"]["per_unit"]]
    assert lstm["unit_half_lives"] == sorted(
        float(f"{math.log(0.5) / math.log(a):.4g}") for a in keeps)
    assert "cell=gru" in (res.out / "study.md").read_text(encoding="utf-8")


def test_second_call_trains_nothing(study):
    spec, res = study
    out = res.out
    files = sorted(out.glob("trials/*/trial.json")) + sorted(out.glob("trials/*/run/*.json"))
    before = {p: p.stat().st_mtime_ns for p in files}
    again = run_study(spec, out, workers=2, progress=False)
    assert (again.ran, again.reused) == (0, 4)
    assert {p: p.stat().st_mtime_ns for p in files} == before
    assert {t["how"] for t in again.study["trials"]} == {"reused"}
    assert again.study["conditions"] == res.study["conditions"]


def test_trial_equals_train_and_analyze_outside_ray(study, corpus, tmp_path, one_thread):
    _, res = study
    run, ana = tmp_path / "run", tmp_path / "analysis"
    flags = [x for k, v in TRAIN.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    assert main(["train", "--corpus", str(corpus), "--cell", "gru", "--seed", "1", *flags,
                 "--out", str(run), "--quiet"]) == 0
    assert main(["analyze", str(run), "--checkpoint", "4", "--windows", "2", "--length", "24",
                 "--perturb-pos", "8", "--out", str(ana), "--quiet"]) == 0
    mine = json.loads((ana / "report.json").read_text(encoding="utf-8"))
    trial = res.study["trials"][3]
    assert trial["id"] == "cell-gru_seed-1"
    theirs = _final_report(res.out, trial)
    assert report_figures(mine) == report_figures(theirs)
    assert mine["gates"] == theirs["gates"] and mine["perturbation"] == theirs["perturbation"]


def test_interrupted_trial_resumes_to_the_same_weights(study, tmp_path, one_thread):
    from gatelens.training.train import train

    spec_path, res = study
    trial = load_spec(spec_path).trials[0]
    train(trial.config(), tmp_path / "trials" / trial.id / "run", progress=False, stop_at=3)
    rec = run_trial(trial, tmp_path)
    assert rec["status"] == "done" and rec["how"] == "resumed"
    assert [c["step"] for c in rec["checkpoints"]] == [0, 2, 4]
    ours = (tmp_path / rec["run"] / "model.safetensors").read_bytes()
    assert ours == (res.out / rec["run"] / "model.safetensors").read_bytes()


def test_failing_trial_is_recorded_while_the_others_finish(ray_local, corpus, tmp_path,
                                                           capsys):
    latin = tmp_path / "latin1.txt"  # exists and opens (checked before Ray); fails to decode
    latin.write_bytes("caf\u00e9 ".encode("latin-1") * 100)
    spec = write_spec(tmp_path / "spec.toml",
                      {"corpus": [str(corpus), str(latin)], "seed": [0]},
                      {**TRAIN, "steps": 2})
    assert main(["study", str(spec), "--out", str(tmp_path / "out"), "--quiet"]) == 1
    s = json.loads((tmp_path / "out" / "study.json").read_text(encoding="utf-8"))
    ok, bad = s["trials"]
    assert ok["status"] == "done" and [c["step"] for c in ok["checkpoints"]] == [0, 2]
    assert bad["status"] == "failed" and "latin1.txt: not UTF-8" in bad["error"]
    assert [c["n"] for c in s["conditions"]] == [1, 0]
    assert "latin1.txt: not UTF-8" in (tmp_path / "out" / "study.md").read_text("utf-8")
    assert "1 of 2 trials failed" in capsys.readouterr().err


def test_a_corpus_that_cannot_be_read_stops_the_study_before_ray(corpus, tmp_path, capsys,
                                                                 monkeypatch):
    import gatelens.studies.study as study

    monkeypatch.setattr(study, "_import_ray", lambda: pytest.fail("Ray was started"))
    for bad, says in ((tmp_path / "missing.txt", "missing.txt: no such file"),
                      (tmp_path, "is a directory"), ("recall:gap=9-2", "recall")):
        spec = write_spec(tmp_path / "spec.toml", {"corpus": [str(corpus), str(bad)]}, TRAIN)
        assert main(["study", str(spec), "--out", str(tmp_path / "out"), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("grid, train, analysis, says", [
    ({"cell": ["lstm"]}, {"hidden": 8}, {"windows": 2, "colour": 1}, "[analysis] colour"),
    ({"cell": ["lstm"], "hiden": 8}, {}, {}, "[grid] hiden: unknown key"),
    ({"cell": []}, {}, {}, "[grid] cell: an empty list"),
    ({"cell": ["lstm"]}, {"hidden": 0}, {}, "--hidden must be a positive integer"),
    ({"cell": ["lstm", "rnn"], "init": ["forget_bias:2"]}, {}, {}, "--forget-bias needs"),
    ({"init": ["forget:2"]}, {}, {}, "init: expected none"),
    ({"seed": [0]}, {"lr": "fast"}, {}, "[train] lr: expected a number"),
    ({"seed": [0]}, {}, {"length": 24, "perturb_pos": 30}, "perturb_pos"),
])
def test_bad_spec_exits_2_before_any_work(tmp_path, capsys, grid, train, analysis, says):
    spec = write_spec(tmp_path / "spec.toml", grid, train, analysis)
    assert main(["study", str(spec), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_spec_or_preset_one_of_them(tmp_path, capsys):
    assert main(["study", "--out", str(tmp_path / "out")]) == 2
    assert main(["study", "s.toml", "--preset", "cells", "--out", str(tmp_path / "out")]) == 2
    assert main(["study", "--preset", "colours", "--out", str(tmp_path / "out")]) == 2
    assert main(["study", str(tmp_path / "none.toml"), "--out", str(tmp_path / "out")]) == 2
    assert "none.toml: no such spec file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_unknown_section_and_changed_settings_are_refused(study, tmp_path):
    with pytest.raises(GatelensError, match=r"unknown section \[model\]"):
        parse_spec({"grid": {"seed": [0]}, "model": {}})
    spec_path, res = study
    changed = spec_path.read_text(encoding="utf-8").replace("steps = 4", "steps = 6")
    (tmp_path / "spec.toml").write_text(changed, encoding="utf-8")
    with pytest.raises(GatelensError, match="other settings"):
        run_study(tmp_path / "spec.toml", res.out, progress=False)


def test_without_ray_the_study_asks_for_the_extra(tmp_path, monkeypatch, corpus):
    spec = write_spec(tmp_path / "spec.toml", {"seed": [0]}, {"corpus": str(corpus), **TRAIN})
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(GatelensError, match=r"gatelens\[study\]"):
        run_study(spec, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    code = ("import sys; sys.modules['ray'] = None; import torch, gatelens, "
            "gatelens.studies.study, gatelens.studies.merge; "
            "gatelens.trace(torch.nn.GRU(2, 3), torch.randn(4, 1, 2))")
    subprocess.run([sys.executable, "-c", code], check=True)


def _report(f: float, unit_median: float | None, pert: float | None) -> dict:
    return {"units": {"gate": "f", "half_life": {"median": unit_median}, "half_life_ge_10": 1,
                      "per_unit": [f, 1.0]},
            "gates": {"f": {"mean": f}},
            "perturbation": {"lags": [1, 2], "half_life_measured": pert},
            "output_reach": None}


def test_merge_statistics_on_hand_made_reports(tmp_path):
    spec = parse_spec({"grid": {"seed": [0, 1, 2]}})
    figures = [(0.5, 1.0, 2.0), (0.6, 2.0, 4.0), (0.7, None, None)]  # None: never halves
    records = []
    for t, (f, unit, pert) in zip(spec.trials, figures, strict=True):
        path = tmp_path / t.id / "report.json"
        path.parent.mkdir()
        path.write_text(json.dumps(_report(f, unit, pert)), encoding="utf-8")
        records.append({"id": t.id, "condition": t.condition, "seed": t.seed, "status": "done",
                        "checkpoints": [{"step": 4, "val_loss": 1.0 + f,
                                         "report": f"{t.id}/report.json"}]})
    s = merge(spec, records, tmp_path)
    c = s["conditions"][0]["figures"]
    assert c["perturbation_half_life"] == {"mean": 3.0, "sd": pytest.approx(math.sqrt(2)),
                                           "min": 2.0, "max": 4.0, "n_infinite": 1}
    assert c["unit_half_life_median"]["mean"] == 1.5 and c["unit_half_life_median"]["sd"] == \
        pytest.approx(math.sqrt(0.5))
    assert c["forget_gate_mean"]["mean"] == pytest.approx(0.6)
    assert c["forget_gate_mean"]["sd"] == pytest.approx(0.1)
    assert c["best_val_loss"]["min"] == 1.5 and c["units_half_life_ge_10"]["sd"] == 0.0
    assert "output_reach_half_life" not in c  # no logits: the figure does not apply
    assert s["trials"][2]["figures"]["perturbation_half_life"] is None  # infinite
    assert s["conditions"][0]["unit_half_lives"] == [1.0, 1.357, 1.943, None, None, None]
    one = merge(parse_spec({"grid": {"seed": [0]}}), records[:1], tmp_path)
    assert one["conditions"][0]["figures"]["forget_gate_mean"]["sd"] is None  # n = 1


def test_presets_parse_and_say_their_question(monkeypatch):
    from gatelens.studies import spec as study_spec

    sizes = {"dynamics": (3, 1), "forget-bias": (30, 10), "cells": (9, 3),
             "long-memory": (18, 6), "modern": (18, 6), "barely-moved": (54, 18),
             "modern-official": (18, 6), "modern-2026": (10, 5)}
    monkeypatch.setitem(study_spec._VOCAB, "shakespeare", 84)  # modern matches parameters
    for name in PRESETS:
        spec = load_preset(name)
        assert (len(spec.trials), len(spec.conditions())) == sizes[name]
    dyn = load_preset("dynamics").trials[0].config()
    assert (dyn.cell, dyn.hidden, dyn.steps, dyn.eval_every) == ("lstm", 325, 3200, 100)


def test_reuse_copies_a_finished_trial_of_equal_settings(study, corpus, tmp_path, capsys):
    _, res = study
    # gru seed 1 under another name (init "none" is PyTorch's init: the same settings)
    spec = write_spec(tmp_path / "spec.toml", {"init": ["none"], "cell": ["gru"], "seed": [1]},
                      {"corpus": str(corpus), **TRAIN})
    out = tmp_path / "out"
    got = run_study(spec, out, reuse=[res.out], progress=False)
    assert (got.ran, got.reused, got.failed) == (0, 1, 0)
    (t,) = got.study["trials"]
    assert t["id"] == "init-none_cell-gru_seed-1" and t["how"] == "copied"
    assert t["copied_from"] == str((res.out / "trials" / "cell-gru_seed-1").resolve())
    src = next(s for s in res.study["trials"] if s["id"] == "cell-gru_seed-1")
    assert t["figures"] == src["figures"]
    for c in t["checkpoints"]:
        assert c["report"].startswith(f"trials/{t['id']}/") and (out / c["report"]).exists()
    assert (out / t["run"] / "model.safetensors").exists()
    assert not list((out / "trials").glob(".*"))  # no half-copied directory left
    again = run_study(spec, out, reuse=[res.out], progress=False)
    assert again.study["trials"][0]["how"] == "reused"
    assert again.study["trials"][0]["copied_from"] == t["copied_from"]
    assert main(["study", str(spec), "--out", str(tmp_path / "o2"), "--reuse",
                 str(tmp_path)]) == 2
    assert "not a study directory" in capsys.readouterr().err


def test_table_axis_sets_several_keys_per_condition():
    spec = parse_spec({"grid": {"seed": [0, 1], "model": [
        {"cell": "lstm"}, {"cell": "mingru", "layers": 2}]}, "train": {"hidden": 8}})
    assert [t.id for t in spec.trials] == ["cell-lstm_seed-0", "cell-lstm_seed-1",
                                           "cell-mingru_layers-2_seed-0",
                                           "cell-mingru_layers-2_seed-1"]
    assert spec.conditions() == [{"cell": "lstm"}, {"cell": "mingru", "layers": 2}]
    lstm, mingru = spec.trials[0].config(), spec.trials[2].config()
    assert (lstm.layers, mingru.layers, mingru.hidden) == (1, 2, 8)  # the table overrides


def test_match_params_picks_the_nearest_hidden(corpus):
    from gatelens.studies.spec import vocab_size
    from gatelens.training.model import matched_hidden, parameter_count
    from gatelens.training.train import model_config

    spec = parse_spec({"grid": {"seed": [0], "model": [
        {"cell": "lstm"}, {"cell": "gru"}, {"cell": "slstm", "heads": 3}]},
        "train": {"corpus": str(corpus), "hidden": 20, "match_params": "lstm"}})
    vocab = vocab_size(str(corpus))
    assert vocab == len(set(corpus.read_text(encoding="utf-8")))
    count = {t.condition["cell"]: parameter_count(model_config(t.config()), vocab)
             for t in spec.trials}
    target = count["lstm"]
    assert spec.trials[0].config().hidden == 20
    for t in spec.trials[1:]:
        cfg = t.config()
        step = cfg.heads
        assert cfg.hidden % step == 0
        near = [parameter_count({**model_config(cfg), "hidden": cfg.hidden + d}, vocab)
                for d in (-step, step)]
        assert all(abs(n - target) >= abs(count[cfg.cell] - target) for n in near)
        assert matched_hidden(model_config(cfg), target, vocab) == cfg.hidden


@pytest.mark.parametrize("grid, train, says", [
    ({"cell": [{"layers": 2}]}, {}, "a list of tables needs a name of its own"),
    ({"m": [{"cell": "lstm", "colour": 1}]}, {}, "m[0] colour: unknown key"),
    ({"m": [{"cell": "lstm", "seed": 1}]}, {}, "m[0] seed: unknown key"),
    ({"m": [{"cell": "lstm"}, {"cell": "lstm"}]}, {}, "a table is listed twice"),
    ({"m": [{}]}, {}, "an empty table"),
    ({"m": [{"layers": [1, 2]}]}, {}, "expected one value"),
    ({"m": [{"layers": 2}], "layers": [1, 3]}, {}, "both a list and a key of a table axis"),
    ({"m": [{"init": "none"}]}, {"forget_bias": 1.0}, "exclusive"),
    ({"seed": [0]}, {"match_params": "transformer"}, "match_params: expected a cell"),
    ({"m": [{"cell": "gru", "hidden": 9}]}, {"match_params": "lstm"}, "sets every trial's"),
    ({"m": [{"cell": "slstm", "heads": 2}]}, {"hidden": 9}, "--heads 2 must divide"),
])
def test_bad_table_axes_and_match_params(grid, train, says):
    with pytest.raises(GatelensError, match=re.escape(says)):
        parse_spec({"grid": grid, "train": train})


def test_modern_preset_matches_the_lstm_parameter_count(monkeypatch):
    from gatelens.studies import spec as study_spec
    from gatelens.studies.merge import model_size

    monkeypatch.setitem(study_spec._VOCAB, "shakespeare", 84)  # its 84 characters
    spec = load_preset("modern")
    sizes = {t.condition["cell"]: model_size(t.train, 84) for t in spec.trials}
    assert sizes["lstm"] == {"hidden": 325, "layers": 1, "parameters": 561684}
    assert {c: (s["hidden"], s["layers"]) for c, s in sizes.items()} == {
        "lstm": (325, 1), "gru": (379, 1), "rnn": (669, 1), "mingru": (224, 2),
        "minlstm": (210, 2), "slstm": (296, 1)}
    for s in sizes.values():
        assert abs(s["parameters"] / 561684 - 1) < 0.007


# --address: a real Ray cluster begun by `ray start --head` (one node, on a free port, token
# authentication as Ray starts it), joined from another process; and the one-line error
# when the address cannot be joined.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """A one-node cluster of 2 CPUs; its address; stopped (the whole process group) after."""
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    ray = Path(sys.executable).with_name("ray")
    head = subprocess.Popen([str(ray), "start", "--head", "--port", str(port), "--num-cpus",
                             "2", "--include-dashboard", "false", "--block"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        for _ in range(120):  # until its GCS answers (seconds on a quiet machine)
            up = subprocess.run([str(ray), "status", "--address", address], env=env,
                                capture_output=True)
            if up.returncode == 0:
                break
            assert head.poll() is None, "ray start --head exited"
            time.sleep(1)
        yield address, env
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        finally:
            try:
                os.killpg(head.pid, signal.SIGKILL)  # anything of it still there
            except ProcessLookupError:
                pass
            _forget_cluster(port)


def _forget_cluster(port: int) -> None:
    """Remove Ray's note of the latest `ray start` cluster if it is ours (`ray stop` would,
    but it stops every Ray on the machine)."""
    note = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    if note.exists() and note.read_text().strip().endswith(f":{port}"):
        note.unlink()


def test_the_default_local_ray_is_new_even_beside_a_started_cluster(cluster):
    """ray.init() with no address would join the cluster `ray start` began; the study's
    default is a Ray of its own, with its --workers CPUs."""
    code = ("import sys, ray; from gatelens.studies.study import ray_session\n"
            "with ray_session(workers=1):\n"
            "    print(ray.cluster_resources()['CPU'], ray.get_runtime_context().gcs_address)")
    got = subprocess.run([sys.executable, "-c", code], env=cluster[1], capture_output=True,
                         text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    cpus, gcs = got.stdout.split()
    assert float(cpus) == 1.0 and not gcs.endswith(cluster[0].split(":")[1])


def test_address_runs_the_trials_on_a_running_cluster(cluster, tmp_path):
    address, env = cluster
    corpus = tmp_path / "tiny.txt"
    corpus.write_text(make_text(n_lines=200), encoding="utf-8")
    spec = write_spec(tmp_path / "spec.toml", {"cell": ["lstm"], "seed": [0, 1]},
                      {"corpus": str(corpus), **TRAIN}, ANALYSIS)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", "import sys; from gatelens.cli import main; "
                           "sys.exit(main(sys.argv[1:]))", "study", str(spec), "--out",
                           str(out), "--address", address, "--quiet"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    study = json.loads((out / "study.json").read_text(encoding="utf-8"))
    assert [t["status"] for t in study["trials"]] == ["done", "done"]
    assert all(t["how"] == "trained" for t in study["trials"])
    assert study["conditions"][0]["n"] == 2


def test_an_address_it_cannot_join_is_one_line(tmp_path, monkeypatch):
    import ray

    def refuse(**kw):
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.9:6379\nmore")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    spec = write_spec(tmp_path / "spec.toml", {"seed": [0]}, {**TRAIN, "corpus": "recall"})
    with pytest.raises(GatelensError) as e:
        run_study(spec, tmp_path / "out", address="10.0.0.9:6379", progress=False)
    msg = str(e.value)
    assert msg.startswith("--address 10.0.0.9:6379: could not join the Ray cluster (")
    assert "RAY_AUTH_MODE=token" in msg and "\n" not in msg


def test_a_synthetic_corpus_places_the_loss_between_its_bounds(tmp_path):
    spec = parse_spec({"grid": {"seed": [0]}})
    (t,) = spec.trials
    rep = {**_report(0.5, 1.0, 2.0), "control_losses": {"memoryless_loss": 2.4,
                                                        "best_loss": 1.8}}
    (tmp_path / "r.json").write_text(json.dumps(rep), encoding="utf-8")
    rec = {"id": t.id, "condition": t.condition, "seed": 0, "status": "done",
           "checkpoints": [{"step": 2, "val_loss": 2.3, "report": "r.json"},
                           {"step": 4, "val_loss": 2.25, "report": "r.json"}]}
    figs = merge(spec, [rec], tmp_path)["trials"][0]["figures"]
    assert (figs["memoryless_loss"], figs["best_possible_loss"]) == (2.4, 1.8)
    assert figs["memory_gap_closed"] == pytest.approx((2.4 - 2.25) / (2.4 - 1.8))


STUDIES = Path(__file__).resolve().parents[1] / "studies"


@pytest.mark.parametrize("name", ["cells", "dynamics", "dynamics-gru", "forget-bias",
                                  "long-memory", "modern", "barely-moved",
                                  "modern-official"])
def test_committed_studies_render_as_committed(name):
    """studies/NAME: study.md and the plots' names are what today's renderer makes of the
    committed study.json, so the README's tables and the files cannot drift apart. (The
    PNGs' bytes depend on matplotlib's version, so they are only checked to be images.)"""
    from gatelens.report.study import render_markdown, study_plots

    d = STUDIES / name
    study = json.loads((d / "study.json").read_text())
    plots = study_plots(study)
    assert sorted(plots) == sorted(p.name for p in (d / "plots").iterdir())
    assert render_markdown(study, list(plots)) == (d / "study.md").read_text()
    for file in plots:
        assert (d / "plots" / file).read_bytes().startswith(b"\x89PNG"), file


def test_many_conditions_put_the_legend_beside_the_axes():
    """Ten conditions (forget-bias) would cover the lines; the legend goes to the right."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from gatelens.report.study import plot_over_training

    for name, outside in (("forget-bias", True), ("cells", False)):
        study = json.loads((STUDIES / name / "study.json").read_text())
        fig = plot_over_training(study, "perturbation_half_life")
        FigureCanvasAgg(fig).draw()
        ax = fig.axes[0]
        right_of_axes = ax.get_legend().get_window_extent().x0 > ax.get_window_extent().x1
        assert right_of_axes == outside, name


def test_committed_spec_files_are_what_their_studies_ran():
    """studies/*/spec.toml (a study that is not a preset) loads, and it is the study.json's
    own spec with the same trials; each preset's study ran the preset as it is today."""
    for d in sorted(p for p in STUDIES.iterdir() if (p / "study.json").exists()):
        study = json.loads((d / "study.json").read_text())
        spec = load_spec(d / "spec.toml") if (d / "spec.toml").exists() else load_preset(d.name)
        assert spec.doc == study["spec"], d.name
        assert [t.id for t in spec.trials] == [t["id"] for t in study["trials"]], d.name


def test_every_cell_with_a_keep_gate_is_named_in_the_study_pages():
    """study.md's sentence on the keep gate names what it is for each cell of the study
    (an RNN has none); a cell added to training without its words fails here."""
    from gatelens.families.registry import keep_words as family_keep_words
    from gatelens.report.study import keep_words
    from gatelens.training.config import CELL_NAMES

    assert {c for c in CELL_NAMES if family_keep_words(c)} == set(CELL_NAMES) - {"rnn"}
    study = json.loads((STUDIES / "modern" / "study.json").read_text())
    assert keep_words(study).endswith(": LSTM f, GRU z, minGRU 1 − z, minLSTM f* = f/(f + i), "
                                      "sLSTM κ.")
    only_rnn = {"spec": {"train": {"cell": "rnn"}}, "conditions": [{"condition": {}}]}
    assert keep_words(only_rnn) == "No cell here has a keep gate."
