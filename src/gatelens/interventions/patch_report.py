"""What ``gatelens patch`` writes: patch.json (the sweep), patch.png (the heatmaps of the
real and the attribution patching) and patch.md (a short report), all atomically.

>>> import numpy as np
>>> from gatelens.interventions.patching import PatchResult
>>> res = PatchResult("kl", ["rnn.layer0.h"], [0, 1], np.array([[0.0, 1.0]]),
...                   np.array([[0.3, 0.0]]), 0.0, 0.3, np.array([[0.0, 0.8]]), 1.0, 1, 2)
>>> print(markdown(res, {"clean": "ab", "corrupt": "ba"}).splitlines()[0])
# Activation patching: kl
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gatelens.interventions.patching import PatchResult

__all__ = ["markdown", "plot_patching", "write_patch"]


def plot_patching(res: PatchResult):
    """A matplotlib Figure: the normalised effect (and the attribution beside it), rows the
    swept keys, columns the positions, one colour scale centred on 0."""
    from matplotlib.figure import Figure

    panels = [("activation patching", res.effect)]
    if res.attribution is not None:
        rho = "undefined" if res.spearman is None else f"{res.spearman:.3f}"
        panels.append((f"attribution patching (Spearman {rho})", res.attribution))
    rows, cols = res.effect.shape
    fig = Figure(figsize=(min(16.0, 3.0 + 0.08 * cols) * len(panels) / 1.4,
                          1.6 + 0.35 * rows))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    finite = [np.abs(a[np.isfinite(a)]).max() for _, a in panels if np.isfinite(a).any()]
    lim = max([1.0, *finite])
    for ax, (title, a) in zip(axes, panels, strict=True):
        im = ax.imshow(a, aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim,
                       interpolation="nearest")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("position")
        step = max(1, cols // 16)
        ax.set_xticks(range(0, cols, step), [str(p) for p in res.positions[::step]],
                      fontsize=7)
        ax.set_yticks(range(rows), res.names if ax is axes[0] else [""] * rows, fontsize=7)
    fig.colorbar(im, ax=list(axes), shrink=0.9,
                 label="(m(patched) − m(corrupt)) / (m(clean) − m(corrupt))")
    return fig


def _top(res: PatchResult, n: int = 10) -> list[tuple[str, int, float, float | None]]:
    flat = np.abs(np.nan_to_num(res.effect)).ravel()
    order = np.argsort(-flat, kind="stable")[:n]
    cols = res.effect.shape[1]
    return [(res.names[i // cols], res.positions[i % cols], float(res.effect.flat[i]),
             None if res.attribution is None else float(res.attribution.flat[i]))
            for i in order]


def markdown(res: PatchResult, inputs: dict) -> str:
    """The short report: what was patched, m on both runs, the largest cells, Spearman."""
    rho = ("not computed" if res.attribution is None else "undefined (a constant matrix)"
           if res.spearman is None else f"{res.spearman:.3f}")
    lines = [f"# Activation patching: {res.metric}", "",
             f"Clean and corrupt inputs: {res.batch} × {res.length} ({inputs.get('source', '')})."
             .replace(" ()", ""),
             "For each key and position the corrupted run receives the clean run's value "
             "there, carried forward; the effect is (m(patched) − m(corrupt)) / (m(clean) − "
             "m(corrupt)): 0 changes nothing, 1 restores the clean metric.", "",
             f"- metric: {res.metric}; m(clean) = {res.m_clean:.6g}, "
             f"m(corrupt) = {res.m_corrupt:.6g}",
             f"- swept: {len(res.names)} keys × {len(res.positions)} positions",
             f"- attribution patching ((a_clean − a_corrupt) · ∂m/∂a at the corrupted run) "
             f"against the real patching, Spearman over the cells: {rho}", "",
             "![patching](patch.png)", "",
             "| key | position | effect | attribution |", "|---|---|---|---|"]
    for name, t, e, a in _top(res):
        lines.append(f"| `{name}` | {t} | {e:.4f} | {'—' if a is None else f'{a:.4f}'} |")
    for what in ("clean", "corrupt"):
        if what in inputs:
            lines += ["", f"{what}: `{inputs[what]!r}`"]
    return "\n".join(lines) + "\n"


def write_patch(res: PatchResult, out: str | Path, inputs: dict) -> dict[str, Path]:
    """patch.json, patch.png and patch.md in ``out`` (made if missing), atomically."""
    import json

    from gatelens.io import atomic_write_many

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fig = plot_patching(res)
    paths = {"json": out / "patch.json", "png": out / "patch.png", "md": out / "patch.md"}
    doc = {**res.to_dict(), "inputs": inputs}
    text = json.dumps(doc, indent=1, allow_nan=False, default=lambda v: None)
    atomic_write_many({
        paths["json"]: lambda tmp: tmp.write_text(text + "\n", encoding="utf-8"),
        paths["png"]: lambda tmp: fig.savefig(tmp, format="png", dpi=100,
                                              metadata={"Software": None}),
        paths["md"]: lambda tmp: tmp.write_text(markdown(res, inputs), encoding="utf-8")})
    return paths
