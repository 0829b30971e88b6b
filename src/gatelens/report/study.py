"""A study's pages: the tables, plots, study.md and study.html of a merged study.json
(``gatelens.studies.merge`` computes it). Everything here reads the study dict alone.

>>> size_words({"hidden": 4, "layers": 1})
', hidden 4 × 1 layer'
"""

from __future__ import annotations

import base64
import io
import math
from html import escape

from matplotlib.figure import Figure

from gatelens.families.registry import keep_words as family_keep_words
from gatelens.report.tables import Table, fmt

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


def _style(k: int) -> tuple[str, str, str]:
    """Condition k's colour, line style and marker: matplotlib's 10 colours, then the same
    colours dashed with triangles, dotted with squares, so more than 10 conditions stay
    apart.

    >>> _style(0), _style(11)
    (('C0', '-', 'o'), ('C1', '--', '^'))
    """
    return f"C{k % 10}", ("-", "--", ":")[k // 10 % 3], ("o", "^", "s")[k // 10 % 3]


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
        color, line, marker = _style(k)
        ax.plot(x, [p[1]["mean"] for p in pts], marker=marker, ls=line, ms=3, color=color,
                label=cond["label"])
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
        color, _, marker = _style(k)
        pts = [(t["figures"]["best_val_loss"], t["figures"]["perturbation_half_life"])
               for t in study["trials"] if t["condition"] == cond["condition"]
               and t["figures"].get("best_val_loss") is not None
               and t["figures"].get("perturbation_half_life") is not None]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, color=color, alpha=0.6,
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
        color, line, _ = _style(k)
        ax.step(xs, ys, where="post", color=color, ls=line,
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


def keep_words(study: dict) -> str:
    """The sentence that says what "keep gate" is for the cells of this study.

    >>> keep_words({"spec": {"train": {}}, "conditions": [
    ...     {"condition": {"cell": "rnn"}}, {"condition": {"cell": "hf-mamba"}}]})
    'The keep gate is the one that scales the carried state: Mamba exp(Δ·A).'
    >>> keep_words({"spec": {}, "conditions": [{"condition": {"seed": 0}}]})
    'The keep gate is the one that scales the carried state: LSTM f.'
    >>> keep_words({"spec": {"grid": {"cell": "gru"}}, "conditions": [{"condition": {}}]})
    'The keep gate is the one that scales the carried state: GRU z.'
    """
    spec = study.get("spec", {})
    grid_cell = spec.get("grid", {}).get("cell")  # a [grid] value that is not a list: fixed
    default = grid_cell if isinstance(grid_cell, str) else spec.get("train", {}).get("cell",
                                                                                  "lstm")
    cells = dict.fromkeys(c["condition"].get("cell", default) for c in study["conditions"])
    words = list(dict.fromkeys(w for w in map(family_keep_words, cells) if w))
    if not words:
        return "No cell here has a keep gate."
    return "The keep gate is the one that scales the carried state: " + ", ".join(words) + "."


def render_markdown(study: dict, plots: list[str]) -> str:
    """study.md: what ran, the failures, a table per condition, every trial, the plots."""
    n = len(study["trials"])
    bad = [t for t in study["trials"] if t["status"] != "done"]
    lines = ["# Study", "", f"{n} trials, {n - len(bad)} done, {len(bad)} failed; "
             f"{len(study['conditions'])} conditions. Figures at each trial's final checkpoint "
             "(validation loss: its best); mean ± sample sd (n finite values) over seeds; an "
             "infinite half-life is left out and counted under 'infinite'. "
             + keep_words(study), ""]
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
             "sample sd (n finite values) over seeds; infinite half-lives counted apart. "
             f"{escape(keep_words(study))}</p>"]
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
