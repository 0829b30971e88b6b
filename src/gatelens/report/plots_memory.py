"""Plots of memory by direction: the Lyapunov spectrum, the slow modes' unit loadings, the
context used beside the output-level reach, and gate saturation per gate.

Each function draws on a matplotlib ``ax`` from report.json's version-3 blocks (the slow
modes' loadings from the ``LyapunovSpectrum`` itself); ``write_memory_plots`` saves PNGs.

>>> from matplotlib.figure import Figure
>>> ax = Figure().subplots()
>>> plot_spectrum(ax, [-0.01, -0.2, -0.9])
>>> ax.get_xlabel(), len(ax.lines)
('exponent index i', 3)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from gatelens.analysis.slow_modes import SLOW_EXPONENT, SLOW_HALF_LIFE
from gatelens.report.plots import COLORS, _save, plot_reach
from gatelens.report.words import unit_of

DIRECTION_COLORS = {"forward": COLORS["trained"], "reverse": "#ff7f0e"}


def _finite(values) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


def plot_spectrum(ax: Axes, exponents, per_direction: dict | None = None) -> None:
    """λ_i against i, with the slow-mode line λ = ln 0.5 / 10 (half-life 10 characters)
    and 0; ``per_direction``: {name: exponents} to draw each direction of a bidirectional
    module."""
    curves = per_direction or {"forward": exponents}
    for name, ex in curves.items():
        y = _finite(ex)
        ax.plot(np.arange(1, len(y) + 1), y, ".-", ms=3, lw=0.8, label=name,
                color=DIRECTION_COLORS.get(name, COLORS["trained"]))
    ax.axhline(SLOW_EXPONENT, color=COLORS["forget_path"], ls="--", lw=1,
               label=f"half-life {SLOW_HALF_LIFE:g} characters")
    ax.axhline(0.0, color="k", lw=0.6)
    ax.set_xlabel("exponent index i")
    ax.set_ylabel("λ_i (nats per character)")
    ax.set_title("Lyapunov spectrum (above the dashed line: slow modes)", fontsize=9)
    ax.legend(fontsize=8)


def plot_slow_modes(ax: Axes, loadings: np.ndarray, exponents, hidden: int) -> None:
    """Heat map of the slow modes' pooled unit loadings v_u² (modes × units), layer
    boundaries marked.

    >>> ax = Figure().subplots()
    >>> plot_slow_modes(ax, np.array([[0.5, 0.5, 0, 0]]), [-0.01], hidden=2)
    >>> ax.get_ylabel()
    'slowest directions (λ_i)'
    """
    w = np.atleast_2d(np.asarray(loadings, dtype=np.float64))
    if w.shape[0] == 0:
        ax.text(0.5, 0.5, "no slow mode (every half-life < 10 characters)", ha="center",
                va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    im = ax.imshow(w, aspect="auto", interpolation="nearest", cmap="viridis",
                   vmin=0.0, vmax=max(float(w.max()), 1e-12))
    for b in range(hidden, w.shape[1], hidden):
        ax.axvline(b - 0.5, color="w", lw=1)
    ax.set_yticks(range(w.shape[0]), [f"{float(e):.3g}" for e in exponents])
    ax.set_xlabel("unit (layers pooled; white lines: layer boundaries)")
    ax.set_ylabel("slowest directions (λ_i)")
    ax.figure.colorbar(im, ax=ax, label="loading v_u²")


def plot_context(ax: Axes, context: dict) -> None:
    """Excess loss of a truncated context against its length d (log₂ axis), 0.01 nats and
    the effective context marked (report.json's "context").

    >>> ax = Figure().subplots()
    >>> plot_context(ax, {"lengths": [1, 2, 4], "excess_loss": [0.5, 0.05, 0.001],
    ...                   "effective_context": 4})
    >>> ax.get_xscale()
    'log'
    """
    d = np.asarray(context["lengths"], dtype=np.float64)
    e = _finite(context["excess_loss"])
    ax.plot(d, np.clip(e, 1e-6, None), "o-", color=COLORS["trained"], ms=4,
            label="loss(last d characters) − loss(whole window)")
    ax.axhline(0.01, color="k", ls=":", lw=1, label="0.01 nats")
    eff = context.get("effective_context")
    if eff is not None:
        ax.axvline(eff, color=COLORS["forget_path"], ls="--", lw=1,
                   label=f"effective context {eff}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length d (characters)")
    ax.set_ylabel("excess loss (nats per character)")
    ax.set_title("context used (truncation)", fontsize=9)
    ax.legend(fontsize=8)


def plot_saturation(ax: Axes, left, right, gate: str) -> None:
    """One dot a unit: the fraction of positions its gate is right-saturated (> 0.9)
    against left-saturated (< 0.1); the diagonal left + right = 1 bounds them.

    >>> ax = Figure().subplots()
    >>> plot_saturation(ax, [0.1, 0.0], [0.2, 0.9], "f")
    >>> ax.get_title()
    'f: 2 units'
    """
    lo, hi = np.asarray(left, dtype=np.float64), np.asarray(right, dtype=np.float64)
    ax.plot([0, 1], [1, 0], color="#cccccc", lw=1)
    ax.scatter(lo, hi, s=8, alpha=0.6, color=COLORS["trained"])
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.set_aspect("equal")
    ax.set_xlabel("fraction left-saturated (< 0.1)")
    ax.set_ylabel("fraction right-saturated (> 0.9)")
    ax.set_title(f"{gate}: {len(lo)} units", fontsize=9)


def write_memory_plots(report: dict, out: Path, spectrum=None,
                       arrays: dict | None = None) -> list[Path]:
    """The memory plots that apply to report.json as PNGs under ``out``; ``spectrum`` (a
    ``LyapunovSpectrum``) adds the slow modes' loadings; ``arrays`` are the per-unit arrays
    report.json summarises at size (json_report.report_arrays)."""
    out, paths, unit = Path(out), [], unit_of(report)
    lyap = report.get("lyapunov")
    if lyap and lyap.get("exponents"):
        fig = Figure(figsize=(12 if spectrum is not None else 7, 4))
        axes = fig.subplots(1, 2 if spectrum is not None else 1)
        axes = np.atleast_1d(axes)
        per = None
        if spectrum is not None and spectrum.per_direction:
            per = {n: s.exponents for n, s in spectrum.per_direction.items()}
        plot_spectrum(axes[0], lyap["exponents"], per)
        if spectrum is not None:
            # the slow modes, and at least the 4 slowest directions, so the page always shows
            # where the state's longest memory sits
            n = max(len(spectrum.slow_modes), min(4, spectrum.k))
            plot_slow_modes(axes[1], spectrum.loadings[:n], spectrum.exponents[:n],
                            spectrum.hidden)
        paths.append(_save(fig, out / "lyapunov_spectrum.png", unit))
    ctx = report.get("context")
    if ctx:
        reach = (report.get("output_reach") or {}).get("curve")
        fig = Figure(figsize=(12 if reach else 7, 4))
        axes = np.atleast_1d(fig.subplots(1, 2 if reach else 1))
        plot_context(axes[0], ctx)
        if reach:
            plot_reach(axes[1], reach, report.get("perturbation", {}).get("lags"))
        paths.append(_save(fig, out / "context_used.png", unit))
    sat = report.get("saturation") or {}
    gates = [g for g in sat if g != "keep_right_majority"]
    if gates:
        fig = Figure(figsize=(3.2 * len(gates), 3.4))
        for ax, g in zip(np.atleast_1d(fig.subplots(1, len(gates))), gates, strict=True):
            left, right = (sat[g][k] if sat[g][k] is not None else
                           (arrays or {}).get(f"saturation.{g}.{k}", []) for k in ("left", "right"))
            plot_saturation(ax, left, right, g)
        paths.append(_save(fig, out / "gate_saturation.png", unit))
    return paths


__all__ = ["plot_context", "plot_saturation", "plot_slow_modes", "plot_spectrum",
           "write_memory_plots"]
