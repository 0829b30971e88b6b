"""A study's merge: the figures of every trial, their statistics per condition (and per
checkpoint step, for the plots over training), and study.json, study.md, study.html.

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

import base64
import io
import json
import math
import statistics
from html import escape
from pathlib import Path

from matplotlib.figure import Figure

from .analysis.units import half_life
from .io import atomic_write, atomic_write_json, atomic_write_text
from .report.tables import Table, fmt
from .study_spec import StudySpec, condition_label

#: figure name -> its label; the order of tables and plots.
FIGURES = {
    "best_val_loss": "best validation loss (nats/char)",
    "best_step": "step of the best validation loss",
    "val_loss": "validation loss (nats/char)",
    "memoryless_loss": "memoryless loss of the corpus (nats/char)",
    "best_possible_loss": "best achievable loss of the corpus (nats/char)",
    "memory_gap_closed": "share of the memoryless − best gap closed",
    "forget_gate_mean": "mean keep gate",
    "unit_half_life_median": "median unit half-life (chars)",
    "perturbation_half_life": "perturbation half-life (chars)",
    "forget_only_half_life": "forget-only half-life (chars)",
    "ratio_at_max_lag": "measured / forget-only at the longest lag",
    "units_half_life_ge_10": "units with half-life ≥ 10",
    "output_reach_half_life": "output-reach half-life (chars)",
}
#: the figures plotted over training steps
OVER_TRAINING = ("val_loss", "forget_gate_mean", "unit_half_life_median",
                 "perturbation_half_life", "units_half_life_ge_10")


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
    for ck in record["checkpoints"]:
        report = json.loads((out / ck["report"]).read_text(encoding="utf-8"))
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
    from .config import TrainConfig
    from .model import parameter_count
    from .train import model_config

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


def _mean_sd(s: dict | None, n: int | None = None, sd_digits: int = 3) -> str:
    """'mean ± sd', then with ``n`` the count of finite values in brackets, else a count of
    infinite ones; '∞' when every value is infinite, '—' when the figure does not apply."""
    if not s:
        return "—"
    if s["mean"] is None:
        return "∞" if s["n_infinite"] else "—"
    text = fmt(s["mean"]) + ("" if s["sd"] is None else f" ± {fmt(s['sd'], sd_digits)}")
    if n is not None:
        return f"{text} ({n - s['n_infinite']})"
    return text + (f" ({s['n_infinite']} ∞)" if s["n_infinite"] else "")


def size_words(m: dict | None) -> str:
    """', hidden H × L layers, P parameters' (empty without a finished trial).

    >>> size_words({"hidden": 224, "layers": 2, "parameters": 561876})
    ', hidden 224 × 2 layers, 561,876 parameters'
    """
    if not m:
        return ""
    words = f", hidden {m['hidden']} × {m['layers']} layer{'s' if m['layers'] > 1 else ''}"
    return words + (f", {m['parameters']:,} parameters" if m.get("parameters") else "")


def condition_table(cond: dict) -> Table:
    """One condition's figures: mean ± sd (n of finite values), min, max, infinite."""
    rows = [[FIGURES[name], _mean_sd(s, cond["n"]), s["min"], s["max"], s["n_infinite"]]
            for name, s in cond["figures"].items()]
    return Table(["figure", "mean ± sd (n)", "min", "max", "infinite"], rows,
                 f"{cond['label']}: {cond['n']} trials{size_words(cond.get('model'))}" + (
                     f", {cond['n_failed']} failed" if cond["n_failed"] else ""))


def side_by_side_table(study: dict) -> Table:
    """Figures as rows, conditions as columns: mean ± sd over seeds at the final checkpoint
    (validation loss: the best), with each condition's model size first.

    >>> t = side_by_side_table({"conditions": [
    ...     {"label": "cell=lstm", "n": 2, "model": {"hidden": 4, "layers": 1,
    ...      "parameters": 120}, "figures": {"best_val_loss": {"mean": 2.0, "sd": 0.1,
    ...      "min": 1.9, "max": 2.1, "n_infinite": 0}}}]})
    >>> for line in t.markdown()[2:]:
    ...     print(line)
    | trials | 2 |
    | hidden × layers | 4 × 1 |
    | parameters | 120 |
    | best validation loss (nats/char) | 2 ± 0.1 |
    """
    conds = study["conditions"]
    names = [n for n in FIGURES if n != "val_loss" and any(n in c["figures"] for c in conds)]
    size = [c.get("model") or {} for c in conds]
    rows = [["trials", *(c["n"] for c in conds)],
            ["hidden × layers", *(f"{m['hidden']} × {m['layers']}" if m else "—" for m in size)],
            ["parameters", *(m.get("parameters") for m in size)]]
    rows += [[FIGURES[n], *(_mean_sd(c["figures"].get(n), sd_digits=2) for c in conds)]
             for n in names]
    return Table(["", *(c["label"] for c in conds)], rows,
                 "Side by side: mean ± sd over seeds")


def trials_table(study: dict) -> Table:
    """Every trial: status and its final figures."""
    names = [n for n in FIGURES if n != "val_loss"
             and any(n in t["figures"] for t in study["trials"])]
    rows = [[t["id"], t["status"]] + [(math.inf if t["figures"].get(n, 0) is None
                                       else t["figures"].get(n)) for n in names]
            for t in study["trials"]]
    return Table(["trial", "status", *(FIGURES[n] for n in names)], rows, "Trials")


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90, metadata={"Software": None})
    return buf.getvalue()


def _legend(fig: Figure, ax, n: int) -> None:
    """Up to 5 conditions inside the axes; more to the right of them, where they cover no
    line (the figure widens to make room)."""
    if n <= 5:
        ax.legend(fontsize=7)
        return
    w, h = fig.get_size_inches()
    fig.set_size_inches(w + 2.6, h)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))


def plot_over_training(study: dict, name: str) -> Figure | None:
    """One figure over training steps: per condition the mean over seeds and a min–max band."""
    fig = Figure(figsize=(7, 3.6))
    ax = fig.subplots()
    drawn = False
    for k, cond in enumerate(study["conditions"]):
        pts = [(o["step"], o["figures"][name]) for o in cond["over_training"]
               if name in o["figures"] and o["figures"][name]["mean"] is not None]
        if not pts:
            continue
        x = [p[0] for p in pts]
        color = f"C{k % 10}"
        ax.plot(x, [p[1]["mean"] for p in pts], "o-", ms=3, color=color, label=cond["label"])
        ax.fill_between(x, [p[1]["min"] for p in pts], [p[1]["max"] for p in pts],
                        color=color, alpha=0.15, lw=0)
        drawn = True
    if not drawn:
        return None
    ax.set_xlabel("training step")
    ax.set_ylabel(FIGURES[name])
    ax.set_title(f"{FIGURES[name]}: mean over seeds, band min–max (finite values)", fontsize=9)
    _legend(fig, ax, len(study["conditions"]))
    return fig


def plot_scatter(study: dict) -> Figure | None:
    """Perturbation half-life against best validation loss, a point per trial, colour per
    condition, the condition's mean ± sd as a cross."""
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    drawn = False
    for k, cond in enumerate(study["conditions"]):
        color = f"C{k % 10}"
        pts = [(t["figures"]["best_val_loss"], t["figures"]["perturbation_half_life"])
               for t in study["trials"] if t["condition"] == cond["condition"]
               and t["figures"].get("best_val_loss") is not None
               and t["figures"].get("perturbation_half_life") is not None]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=color, alpha=0.6,
                label=cond["label"])
        fx, fy = cond["figures"]["best_val_loss"], cond["figures"]["perturbation_half_life"]
        if fx["mean"] is not None and fy["mean"] is not None:
            ax.errorbar(fx["mean"], fy["mean"], xerr=fx["sd"] or 0, yerr=fy["sd"] or 0,
                        color=color, marker="s", ms=6, capsize=3)
        drawn = True
    if not drawn:
        return None
    ax.set_xlabel(FIGURES["best_val_loss"])
    ax.set_ylabel(FIGURES["perturbation_half_life"] + " (final)")
    ax.set_title("a point per trial; squares: condition mean ± sd (infinite left out)",
                 fontsize=9)
    _legend(fig, ax, len(study["conditions"]))
    return fig


def plot_unit_half_lives(study: dict) -> Figure | None:
    """Each condition's per-unit half-lives at the final checkpoint, pooled over seeds, as
    the fraction of units whose half-life is at least x (log x; a line at 10 characters)."""
    conds = [(k, c) for k, c in enumerate(study["conditions"]) if c.get("unit_half_lives")]
    if not conds:
        return None
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    for k, cond in conds:
        lives = [math.inf if v is None else v for v in cond["unit_half_lives"]]
        n = len(lives)
        xs = [max(v, 1e-2) for v in lives if math.isfinite(v)]
        ys = [1 - j / n for j in range(len(xs))]  # fraction with half-life ≥ x
        ax.step(xs, ys, where="post", color=f"C{k % 10}",
                label=f"{cond['label']} ({n} units)")
    ax.axvline(10, color="0.5", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("unit half-life (chars, from the unit's mean keep gate)")
    ax.set_ylabel("fraction of units with half-life ≥ x")
    ax.set_title("per-unit half-lives at the final checkpoint, pooled over seeds; dashed: 10",
                 fontsize=9)
    _legend(fig, ax, len(conds))
    return fig


def study_plots(study: dict) -> dict[str, bytes]:
    """PNG bytes by file name for every plot that has data."""
    figs = {f"over_training_{n}.png": plot_over_training(study, n) for n in OVER_TRAINING}
    figs["scatter_half_life_vs_loss.png"] = plot_scatter(study)
    figs["unit_half_lives.png"] = plot_unit_half_lives(study)
    return {name: _png(f) for name, f in figs.items() if f is not None}


def render_markdown(study: dict, plots: list[str]) -> str:
    """study.md: what ran, the failures, a table per condition, every trial, the plots."""
    n = len(study["trials"])
    bad = [t for t in study["trials"] if t["status"] != "done"]
    lines = ["# Study", "", f"{n} trials, {n - len(bad)} done, {len(bad)} failed; "
             f"{len(study['conditions'])} conditions. Figures at each trial's final checkpoint "
             "(validation loss: its best); mean ± sample sd (n finite values) over seeds; an "
             "infinite half-life is left out and counted under 'infinite'. The keep gate is "
             "the one that scales the carried state: LSTM f, GRU z, minGRU 1 − z, minLSTM "
             "f* = f/(f + i), sLSTM κ.", ""]
    if bad:
        lines += ["## Failed trials", ""] + [f"- `{t['id']}`: {t['error']}" for t in bad] + [""]
    lines += ["## Side by side", "", *side_by_side_table(study).markdown(), "",
              "## Conditions", ""]
    for cond in study["conditions"]:
        t = condition_table(cond)
        lines += [f"### {cond['label']}", "", f"{cond['n']} trials"
                  f"{size_words(cond.get('model'))}.", "", *t.markdown(), ""]
    lines += ["## Trials", "", *trials_table(study).markdown(), ""]
    lines += ["## Plots", ""] + [f"![{p}](plots/{p})" for p in plots] + [""]
    return "\n".join(lines)


CSS = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;"
       "color:#222}table{border-collapse:collapse;margin:1em 0;font-size:14px}"
       "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
       "th:first-child{text-align:left}caption{font-weight:600;text-align:left}"
       "img{max-width:100%}code{background:#f4f4f4}")


def render_html(study: dict, plots: dict[str, bytes]) -> str:
    """study.html: one self-contained page (inline CSS, PNGs as base64; no requests)."""
    n = len(study["trials"])
    bad = [t for t in study["trials"] if t["status"] != "done"]
    parts = ["<!doctype html><html lang='en'><head><meta charset='utf-8'>",
             "<title>gatelens study</title>", f"<style>{CSS}</style></head><body>",
             "<h1>Study</h1>", f"<p>{n} trials, {n - len(bad)} done, {len(bad)} failed. "
             "Figures at each trial's final checkpoint (validation loss: its best); mean ± "
             "sample sd (n finite values) over seeds; infinite half-lives counted apart. The "
             "keep gate is the one that scales the carried state: LSTM f, GRU z, minGRU "
             "1 − z, minLSTM f* = f/(f + i), sLSTM κ.</p>"]
    if bad:
        parts.append("<h2>Failed trials</h2><ul>" + "".join(
            f"<li><code>{escape(t['id'])}</code>: {escape(str(t['error']))}</li>" for t in bad)
            + "</ul>")
    parts += ["<h2>Side by side</h2>", side_by_side_table(study).html(), "<h2>Conditions</h2>"]
    parts += [condition_table(c).html() for c in study["conditions"]]
    parts.append("<h2>Over training and across conditions</h2>")
    parts += [f"<figure><img alt='{escape(name)}' src='data:image/png;base64,"
              f"{base64.b64encode(png).decode('ascii')}'></figure>" for name, png in plots.items()]
    parts += ["<h2>Trials</h2>", trials_table(study).html(), "</body></html>"]
    return "\n".join(parts)


def write_study(spec: StudySpec, records: list[dict], out: str | Path) -> dict:
    """Merge and write OUT/study.json, OUT/study.md, OUT/plots/*.png and OUT/study.html."""
    out = Path(out)
    study = merge(spec, records, out)
    atomic_write_json(out / "study.json", study)
    plots = study_plots(study)
    for name, png in plots.items():
        atomic_write(out / "plots" / name, lambda tmp, png=png: tmp.write_bytes(png))
    atomic_write_text(out / "study.md", render_markdown(study, list(plots)))
    atomic_write_text(out / "study.html", render_html(study, plots))
    return study
