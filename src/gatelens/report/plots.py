"""The analysis plots: each function draws on a matplotlib ``ax``; ``write_plots`` saves PNGs.

Figures are made with ``matplotlib.figure.Figure`` (the Agg canvas, no pyplot state), so
plotting works headless and leaves no global figures behind.

>>> from matplotlib.figure import Figure
>>> ax = Figure().subplots()
>>> plot_char_classes(ax, {"space": {"forget_mean": 0.46, "positions": 865}})
>>> ax.get_ylabel()
'mean keep gate'
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FormatStrFormatter

from gatelens.analysis.units import half_life
from gatelens.report.words import in_unit, unit_of

COLORS = {"trained": "#1f77b4", "untrained": "#aaaaaa", "measured": "#1f77b4",
          "forget_path": "#d62728", "return_path": "#2ca02c"}
LABELS = {"measured": "measured r(k)", "forget_path": "forget gate alone a(k)",
          "return_path": "return path"}


def _retention(t):
    """Inverse of half_life: the retention factor whose half-life is t (for the 2nd axis)."""
    t = np.asarray(t, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.where(t > 0, np.power(0.5, 1.0 / np.where(t > 0, t, 1.0)), 0.0)


def _half_life_axis(a):
    with np.errstate(divide="ignore", invalid="ignore"):
        return half_life(np.clip(np.asarray(a, dtype=np.float64), 1e-9, 1 - 1e-9))


def plot_unit_histogram(ax: Axes, means: np.ndarray, baseline: np.ndarray | None = None,
                        init_value: float | None = None, gate: str = "f") -> None:
    """Histogram of per-unit mean keep gates, the untrained model overlaid, half-life on top."""
    bins = np.linspace(0.0, 1.0, 51)
    if baseline is not None:
        ax.hist(baseline, bins=bins, color=COLORS["untrained"], alpha=0.7,
                label="untrained (step 0)")
    ax.hist(means, bins=bins, color=COLORS["trained"], alpha=0.7, label="trained")
    if init_value is not None:
        ax.axvline(init_value, color="k", ls="--", lw=1, label=f"start {init_value:.3g}")
    ax.set_xlim(0, 1)
    ax.set_xlabel(f"mean {gate} per unit (retention per character)")
    ax.set_ylabel("units")
    top = ax.secondary_xaxis("top", functions=(_half_life_axis, _retention))
    top.set_xticks([0.25, 0.5, 1, 2, 4, 10])
    top.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    top.set_xlabel("half-life (characters)")
    ax.legend(loc="upper left", fontsize=8)


def plot_decay(ax: Axes, curves: dict[str, np.ndarray], lags: list[int] | None = None) -> None:
    """Decay curves ‖·‖/‖δs_p‖ against lag on a log scale (measured, forget, return path)."""
    for name in ("measured", "forget_path", "return_path"):
        if name not in curves:
            continue
        y = np.asarray(curves[name], dtype=np.float64)
        k = np.arange(len(y))
        ok = (k >= 1) & (y > 0) & np.isfinite(y)
        ax.plot(k[ok], y[ok], color=COLORS[name], label=LABELS[name])
        if lags:
            marks = [j for j in lags if j < len(y) and y[j] > 0]
            ax.plot(marks, y[marks], "o", color=COLORS[name], ms=3)
    ax.set_yscale("log")
    ax.set_xlabel("lag k (characters after the change)")
    ax.set_ylabel("‖δ‖ / ‖δs_p‖")
    ax.legend(fontsize=8)


def plot_reach(ax: Axes, curve: list[float] | np.ndarray, lags: list[int] | None = None) -> None:
    """Output-level reach: KL of the next-character predictions against lag, log scale."""
    y = np.asarray(curve, dtype=np.float64)
    k = np.arange(len(y))
    ok = (k >= 1) & (y > 0) & np.isfinite(y)
    ax.plot(k[ok], y[ok], color=COLORS["measured"], label="KL(p ‖ p′)")
    if lags:
        marks = [j for j in lags if j < len(y) and y[j] > 0]
        ax.plot(marks, y[marks], "o", color=COLORS["measured"], ms=3)
    ax.set_yscale("log")
    ax.set_xlabel("lag k (characters after the change)")
    ax.set_ylabel("KL of next-character predictions (nats)")
    ax.set_title("what the model uses", fontsize=9)
    ax.legend(fontsize=8)


def plot_gate_distributions(ax: Axes, gates: dict, baseline: dict | None = None) -> None:
    """Box summaries from the percentiles (whiskers 5–95 %, box 25–75 %), trained vs step 0."""
    letters = [g for g in gates if g != "n_values"]
    for j, g in enumerate(letters):
        for off, stats, color, label in ((-0.18, (baseline or {}).get(g), COLORS["untrained"],
                                          "untrained (step 0)"),
                                         (0.18, gates[g], COLORS["trained"], "trained")):
            if stats is None:
                continue
            x = j + off
            ax.plot([x, x], [stats["p5"], stats["p95"]], color=color, lw=1)
            ax.bar(x, stats["p75"] - stats["p25"], bottom=stats["p25"], width=0.3, color=color,
                   alpha=0.8, label=label if j == 0 else None)
            ax.plot([x - 0.15, x + 0.15], [stats["p50"]] * 2, color="k", lw=1.5)
            ax.plot(x, stats["mean"], "D", color="k", ms=3)
    ax.set_xticks(range(len(letters)), letters)
    ax.set_ylabel("gate value (box 25–75 %, whiskers 5–95 %, ◆ mean)")
    ax.legend(fontsize=8)


def plot_char_classes(ax: Axes, classes: dict) -> None:
    """Mean keep gate by input-character class, the count of positions over each bar."""
    names = [c for c, v in classes.items() if v["forget_mean"] is not None]
    vals = [classes[c]["forget_mean"] for c in names]
    bars = ax.bar(names, vals, color=COLORS["trained"])
    for b, c in zip(bars, names, strict=True):
        ax.annotate(f"n={classes[c]['positions']:,}", (b.get_x() + b.get_width() / 2,
                    b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("mean keep gate")


def plot_history(ax: Axes, history: dict, best_step: int | None = None) -> None:
    """Validation (and training) loss over training, the best step marked."""
    if history.get("train_step"):
        ax.plot(history["train_step"], history["train_loss"], color=COLORS["untrained"], lw=0.8,
                label="train loss")
    ax.plot(history["step"], history["val_loss"], "o-", color=COLORS["trained"], ms=3,
            label="validation loss")
    if best_step is not None and best_step in history["step"]:
        y = history["val_loss"][history["step"].index(best_step)]
        ax.plot([best_step], [y], "*", color="#d62728", ms=12, label=f"best (step {best_step})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / character)")
    ax.legend(fontsize=8)


def _save(fig: Figure, path: Path, unit: str = "characters") -> Path:
    """The figure as a PNG at ``path``, its words in the model's ``unit``."""
    from gatelens.io import atomic_write

    for ax in fig.axes:
        ax.set_xlabel(in_unit(ax.get_xlabel(), unit))
        ax.set_ylabel(in_unit(ax.get_ylabel(), unit))
        ax.set_title(in_unit(ax.get_title(), unit), fontsize=ax.title.get_fontsize())
        for text in [*ax.texts, *(ax.get_legend().get_texts() if ax.get_legend() else [])]:
            text.set_text(in_unit(text.get_text(), unit))
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100,
                                               metadata={"Software": None}))
    return path


def write_plots(report: dict, out: Path, curves: dict[str, np.ndarray] | None = None,
                best_step: int | None = None,
                arrays: dict[str, np.ndarray] | None = None) -> list[Path]:
    """Every plot that applies to this report, as PNGs under ``out`` (created); ``arrays``
    are the per-unit arrays report.json summarises (json_report.report_arrays)."""
    out, unit = Path(out), unit_of(report)
    paths = []
    units, base, arrays = report["units"], (report.get("baseline") or {}), arrays or {}
    per_unit = units.get("per_unit") or arrays.get("units.per_unit")
    if per_unit is not None and len(per_unit):
        fig = Figure(figsize=(7, 4))
        b = (base.get("units") or {}).get("per_unit")
        if b is None:
            b = arrays.get("baseline.units.per_unit")
        plot_unit_histogram(fig.subplots(), np.array(per_unit),
                            None if b is None else np.array(b), units["init_value"],
                            units["gate"])
        paths.append(_save(fig, out / "units_forget_mean.png", unit))
    if curves:
        reach = report.get("output_reach")
        lags = report["perturbation"]["lags"]
        if reach and reach.get("curve"):  # what the state holds, beside what the model uses
            fig = Figure(figsize=(12, 4))
            left, right = fig.subplots(1, 2)
            plot_decay(left, curves, lags)
            left.set_title("what the state holds", fontsize=9)
            plot_reach(right, reach["curve"], lags)
        else:
            fig = Figure(figsize=(7, 4))
            plot_decay(fig.subplots(), curves, lags)
        paths.append(_save(fig, out / "perturbation_decay.png", unit))
    if len(report["gates"]) > 1:
        fig = Figure(figsize=(7, 4))
        plot_gate_distributions(fig.subplots(), report["gates"], base.get("gates"))
        paths.append(_save(fig, out / "gate_distributions.png", unit))
    if any(v["forget_mean"] is not None for v in report["char_classes"].values()):
        fig = Figure(figsize=(5, 4))
        plot_char_classes(fig.subplots(), report["char_classes"])
        paths.append(_save(fig, out / "char_classes.png", unit))
    hist = report.get("history")
    if hist and hist.get("step"):
        fig = Figure(figsize=(7, 4))
        plot_history(fig.subplots(), hist, best_step)
        paths.append(_save(fig, out / "validation_loss.png", unit))
    return paths
