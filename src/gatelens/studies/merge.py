"""A study's merge: the figures of every trial, their statistics per condition (and per
checkpoint step, for the plots over training), and study.json; study.md, study.html and the
plots are rendered by ``gatelens.report.study``.

Figures per trial are read from the report.json of its checkpoints (docs/methods.md
"Studies"). The per-condition figures are those at the FINAL checkpoint of each trial,
except ``best_val_loss`` (the lowest validation loss over its checkpoints). Over seeds:
mean, sample sd (n − 1; null for one value), min and max of the finite values; an
infinite half-life (null in report.json) is left out of them and counted in n_infinite.

>>> summarize([1.0, 3.0, math.inf])
{'mean': 2.0, 'sd': 1.4142135623730951, 'min': 1.0, 'max': 3.0, 'n_infinite': 1}
>>> summarize([2.0])["sd"] is None
True
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from gatelens.analysis.units import half_life
from gatelens.io import atomic_write_many, path_inside
from gatelens.report.json_report import read_report
from gatelens.report.study import FIGURES, render_html, render_markdown, study_plots
from gatelens.studies.spec import StudySpec, condition_label
from gatelens.studies.trial import TRIALS


def _life(x: float | None) -> float:
    return math.inf if x is None else float(x)  # report.json: null half-life = never halves


def report_figures(report: dict) -> dict[str, float]:
    """A checkpoint's figures from its report.json; a figure that does not apply (a plain
    RNN has no forget gate) is absent, an infinite half-life is ``math.inf``.

    >>> report_figures({"units": {"gate": "f", "half_life": {"median": None},
    ...                           "half_life_ge_10": 3}, "gates": {"f": {"mean": 0.6}},
    ...                 "perturbation": {"lags": [1], "half_life_measured": 2.5}})
    {'forget_gate_mean': 0.6, 'unit_half_life_median': inf, 'units_half_life_ge_10': 3, \
'perturbation_half_life': 2.5}
    """
    out: dict[str, float] = {}
    units = report.get("units") or {}
    gate = units.get("gate")
    if gate:
        out["forget_gate_mean"] = report["gates"][gate]["mean"]
        out["unit_half_life_median"] = _life((units.get("half_life") or {}).get("median"))
        out["units_half_life_ge_10"] = units["half_life_ge_10"]
    p = report.get("perturbation") or {}
    if p.get("lags"):
        out["perturbation_half_life"] = _life(p.get("half_life_measured"))
        if p.get("forget_only") is not None:  # a cell with a keep gate
            out["forget_only_half_life"] = _life(p.get("half_life_forget_only"))
        if p.get("ratio_at_max_lag") is not None:
            out["ratio_at_max_lag"] = float(p["ratio_at_max_lag"])
    r = report.get("output_reach")
    if isinstance(r, dict) and (r.get("half_life") is not None or (r.get("kl") or [0])[0] > 0):
        out["output_reach_half_life"] = _life(r.get("half_life"))  # null with KL(1) > 0: grows
    return out


def summarize(values: list[float]) -> dict:
    """mean, sample sd, min, max over the finite values; infinities counted apart."""
    finite = [float(v) for v in values if math.isfinite(v)]
    return {"mean": statistics.fmean(finite) if finite else None,
            "sd": statistics.stdev(finite) if len(finite) > 1 else None,
            "min": min(finite) if finite else None, "max": max(finite) if finite else None,
            "n_infinite": len(values) - len(finite)}


def _json_figs(figs: dict[str, float]) -> dict:
    return {k: (v if math.isfinite(v) else None) for k, v in figs.items()}


def trial_figures(record: dict, out: Path) -> dict:
    """A done trial's study.json entry: each checkpoint with its figures, and the trial's
    figures (the final checkpoint's, with best_val_loss)."""
    cks, vocab, per_unit, control = [], None, None, None
    for k, ck in enumerate(record["checkpoints"]):
        where = f"{out / TRIALS / str(record['id']) / 'trial.json'}: checkpoints[{k}].report"
        path = path_inside(out, ck.get("report"), where)  # never out of the study
        report = read_report(path)  # checked: a hand-edited trial's report is one line
        vocab = (report.get("model") or {}).get("vocab_size", vocab)
        per_unit = (report.get("units") or {}).get("per_unit")  # the last one stays
        control = report.get("control_losses")
        figs = report_figures(report)
        if ck.get("val_loss") is not None:
            figs = {"val_loss": ck["val_loss"], **figs}
        cks.append({**ck, "figures": figs})
    final = dict(cks[-1]["figures"]) if cks else {}
    losses = [(c["val_loss"], c["step"]) for c in cks if c.get("val_loss") is not None]
    if losses:
        best = min(losses)  # the earlier step on a tie
        final = {"best_val_loss": best[0], "best_step": best[1], **final}
        losses = [v for v, _ in losses]
    if control and losses:  # a synthetic corpus: where the loss sits between its bounds
        m, b = control["memoryless_loss"], control["best_loss"]
        final.update(memoryless_loss=m, best_possible_loss=b,
                     memory_gap_closed=(m - min(losses)) / (m - b))
    return {"checkpoints": cks, "figures": final, "vocab_size": vocab,
            "unit_keep": per_unit}


def unit_half_lives(keeps: list[float]) -> list[float | None]:
    """Per-unit half-lives (chars) from per-unit mean keep gates, sorted, 4 significant
    digits; null for a unit that never halves (mean keep gate 1).

    >>> unit_half_lives([0.5, 1.0, 0.25, 0.9])
    [0.5, 1.0, 6.579, None]
    """
    lives = sorted(float(half_life(a)) for a in keeps)
    return [float(f"{v:.4g}") if math.isfinite(v) else None for v in lives]


def model_size(train: dict, vocab_size: int | None) -> dict:
    """A trial's model: hidden, layers and (with the vocabulary's size) its parameters.

    >>> model_size({"cell": "lstm", "hidden": 325, "layers": 1}, 84)
    {'hidden': 325, 'layers': 1, 'parameters': 561684}
    """
    from gatelens.training.config import TrainConfig
    from gatelens.training.model import parameter_count
    from gatelens.training.train import model_config

    cfg = TrainConfig.from_dict(train)
    return {"hidden": cfg.hidden, "layers": cfg.layers,
            "parameters": None if vocab_size is None else
            parameter_count(model_config(cfg), vocab_size)}


def _stats(figs: list[dict[str, float]]) -> dict:
    names = [n for n in FIGURES if any(n in f for f in figs)]
    return {n: summarize([f[n] for f in figs if n in f]) for n in names}


def merge(spec: StudySpec, records: list[dict], out: Path) -> dict:
    """study.json's content from the trials' records (in spec order)."""
    trials, per_trial, sizes = [], {}, {}
    train_of = {t.id: t.train for t in spec.trials}
    for rec in records:
        entry = {k: rec.get(k) for k in ("id", "condition", "seed", "run", "status", "error",
                                         "how", "seconds")}
        if rec.get("copied_from"):
            entry["copied_from"] = rec["copied_from"]
        if rec["status"] == "done":
            got = trial_figures(rec, out)
            per_trial[rec["id"]] = got
            entry["checkpoints"] = [{**c, "figures": _json_figs(c["figures"])}
                                    for c in got["checkpoints"]]
            entry["figures"] = _json_figs(got["figures"])
            entry["model"] = sizes[rec["id"]] = model_size(train_of[rec["id"]],
                                                           got["vocab_size"])
        else:
            entry["checkpoints"], entry["figures"] = [], {}
        trials.append(entry)
    conditions = []
    for cond in spec.conditions():
        mine = [r for r in records if r["condition"] == cond]
        done = [per_trial[r["id"]] for r in mine if r["id"] in per_trial]
        steps = sorted({c["step"] for t in done for c in t["checkpoints"]})
        over = []
        for s in steps:
            at = [c["figures"] for t in done for c in t["checkpoints"] if c["step"] == s]
            over.append({"step": s, "n": len(at), "figures": _stats(at)})
        model = next((sizes[r["id"]] for r in mine if r["id"] in sizes), None)
        keeps = [k for t in done for k in (t["unit_keep"] or [])]
        conditions.append({"condition": cond, "label": condition_label(cond), "n": len(done),
                           "n_failed": len(mine) - len(done), "model": model,
                           "figures": _stats([t["figures"] for t in done]),
                           "over_training": over,
                           "unit_half_lives": unit_half_lives(keeps) if keeps else None})
    return {"version": 1, "engine": "ray", "figures_at": "final checkpoint (val loss: best)",
            "spec": spec.doc, "trials": trials, "conditions": conditions}


def write_study(spec: StudySpec, records: list[dict], out: str | Path) -> dict:
    """Merge and write OUT/study.json, OUT/study.md, OUT/plots/*.png and OUT/study.html."""
    out = Path(out)
    study = merge(spec, records, out)
    plots = study_plots(study)
    md, html = render_markdown(study, list(plots)), render_html(study, plots)
    text = json.dumps(study, indent=2, allow_nan=False) + "\n"
    writes = {out / "plots" / name: (lambda tmp, png=png: tmp.write_bytes(png))
              for name, png in plots.items()}
    writes[out / "study.json"] = lambda tmp: tmp.write_text(text, encoding="utf-8")
    writes[out / "study.md"] = lambda tmp: tmp.write_text(md, encoding="utf-8")
    writes[out / "study.html"] = lambda tmp: tmp.write_text(html, encoding="utf-8")
    atomic_write_many(writes)  # all written before any is renamed in
    return study
