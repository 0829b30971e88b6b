"""The data the HTML report embeds: a compact, JSON-ready picture of one analysis.

Everything here is a pure function of a ``gatelens.analysis.measure.Analysis``: the figures come
from its result objects (per-unit means, decay curves), never recomputed here. Trace
values travel as uint8 with a per-unit range, so a seed-sized analysis (32 windows x
128 characters x 325 units) fits a page of a few MB; the decoding rule is
``v = lo[u] + q / 255 * (hi[u] - lo[u])``, error at most ``(hi[u] - lo[u]) / 510``
(see ``dequantize``).

>>> import numpy as np
>>> x = np.array([[0.0, -1.0], [0.5, 1.0], [1.0, 0.0]])   # (N, H)
>>> enc = quantize(x)
>>> enc["lo"], enc["hi"], enc["shape"]
([0.0, -1.0], [1.0, 1.0], [3, 2])
>>> bool(np.abs(dequantize(enc) - x).max() <= 2 / 510)
True
"""

from __future__ import annotations

import base64
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gatelens.analysis.common import finite_or_none, pooled
from gatelens.analysis.units import half_life as analysis_half_life
from gatelens.analysis.units import unit_means
from gatelens.cells.names import layer_name
from gatelens.families.registry import cell_spec

if TYPE_CHECKING:
    from gatelens.analysis.measure import Analysis

#: Raw bytes of quantised traces the page may carry by default (base64 adds a third).
BYTE_BUDGET = 2_800_000
#: Most windows the character view ever draws.
MAX_WINDOWS = 16
#: Fewest units of each layer the page draws when a window of all of them is over budget.
MIN_UNITS = 64
#: The largest plot file a page embeds (the plots gatelens draws are ~100 kB).
MAX_PLOT_BYTES = 16 * 2**20
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _sig(v: float, digits: int = 6) -> float | None:
    """Round to ``digits`` significant digits; non-finite values become None (JSON null)."""
    v = float(v)
    if not math.isfinite(v):
        return None
    return float(f"{v:.{digits}g}")


def quantize(x: np.ndarray) -> dict[str, Any]:
    """Encode ``x`` (..., H) as uint8 with a per-unit (last axis) range, base64 in C order.

    >>> quantize(np.zeros((2, 1)))["q"]
    'AAA='
    """
    x = np.nan_to_num(np.asarray(x, dtype=np.float64))  # a stray NaN must not break the page
    flat = x.reshape(-1, x.shape[-1])  # (N, H)
    lo = np.array([_sig(v) for v in flat.min(axis=0)]) if flat.size else np.zeros(x.shape[-1])
    hi = np.array([_sig(v) for v in flat.max(axis=0)]) if flat.size else np.zeros(x.shape[-1])
    span = np.where(hi > lo, hi - lo, 1.0)
    q = np.clip(np.rint((flat - lo) / span * 255.0), 0, 255).astype(np.uint8)  # (N, H)
    return {"shape": list(x.shape), "lo": lo.tolist(), "hi": hi.tolist(),
            "q": base64.b64encode(q.tobytes()).decode("ascii")}


def dequantize(enc: dict[str, Any]) -> np.ndarray:
    """Decode what ``quantize`` wrote, as the page does, to float64 of the original shape.

    >>> dequantize(quantize(np.full((2, 3), 0.25))).tolist()
    [[0.25, 0.25, 0.25], [0.25, 0.25, 0.25]]
    """
    lo, hi = np.asarray(enc["lo"], dtype=np.float64), np.asarray(enc["hi"], dtype=np.float64)
    q = np.frombuffer(base64.b64decode(enc["q"]), dtype=np.uint8).astype(np.float64)
    return (lo + q.reshape(-1, lo.size) / 255.0 * (hi - lo)).reshape(enc["shape"])


def half_life(a: float) -> float | None:
    """t½ = ln 0.5 / ln a in characters (docs/methods.md), as the page stores it: None (JSON
    null) for the infinite half-life of a >= 1.

    >>> round(half_life(0.494), 2), half_life(1.0), half_life(0.0)
    (0.98, None, 0.0)
    """
    return finite_or_none(analysis_half_life(a))


def _np(t: Any) -> np.ndarray:
    """A tensor (or array) as float64 numpy."""
    return t.detach().cpu().double().numpy() if hasattr(t, "detach") else np.asarray(t, float)


def _signals(trace: Any, layer: int) -> list[str]:
    """Signal letters a trace holds for one forward layer, in storage order."""
    prefix = f"{layer_name(layer)}."
    return [n[len(prefix):] for n in trace if n.startswith(prefix) and "." not in n[len(prefix):]]


def _text(windows: Any, chars: list[str], rows: list[int],
          unit: str = "characters") -> list[str] | list[list[str]]:
    """The characters of some windows, as strings."""
    idx = windows.detach().cpu().numpy() if hasattr(windows, "detach") else np.asarray(windows)
    if unit != "characters":  # a token is one position, whatever its length: a list
        return [[chars[int(c)] for c in idx[r]] for r in rows]
    return ["".join(chars[int(c)] for c in idx[r]) for r in rows]


def _layer_means(analysis: Analysis, trained: bool) -> list[np.ndarray]:
    """Per-unit mean keep gate of each layer, (H,) each, from the unit timescales (a plain
    RNN has none: its mean h is shown instead)."""
    units = analysis.units if trained else (analysis.baseline.units if analysis.baseline
                                            else None)
    tr = analysis.trace if trained else analysis.baseline_trace
    L = int(tr.num_layers)
    if units is not None:  # each layer's units (a mixed xLSTM stack's layers differ)
        if units.layer_sizes is None:  # not known: equal layers, or a loud error
            return np.split(units.forget_means, L)
        return np.split(units.forget_means, np.cumsum(units.layer_sizes)[:-1])
    if tr.keep_gate is None:
        return [unit_means(tr[f"{layer_name(k)}.h"]) for k in range(L)]
    return [np.full(tr["layer0.h"].shape[-1], np.nan)] * L


def _unit_tables(analysis: Analysis) -> dict[str, dict[str, list]]:
    """layer -> per-unit mean keep gate (or mean h), its shift from init, its half-life."""
    keep = analysis.trace.keep_gate
    trained = _layer_means(analysis, True)
    init = _layer_means(analysis, False) if analysis.baseline is not None else [
        np.full_like(m, np.nan) for m in trained]
    return {layer_name(k): {
        "signal": keep or "h", "mean": [_sig(v) for v in mean], "init": [_sig(v) for v in ini],
        "shift": [_sig(v) for v in mean - ini],
        "half_life": [_sig(half_life(v)) if keep and half_life(v) is not None else None
                      for v in mean]}
        for k, (mean, ini) in enumerate(zip(trained, init, strict=True))}


def _perturbation(analysis: Analysis, rows: list[int], cap: int | None = None
                  ) -> dict[str, Any]:
    """The changed character and the state difference after it, for the shown windows;
    the mean curves are the analysis's own (PerturbationDecay.curves).

    Unit u of layer k is column k*H + u of the (pooled) state difference; with ``cap``,
    each layer's first ``cap`` columns (H = cap), the norms still over the whole state.
    """
    p = int(analysis.perturb_pos)
    dec = analysis.decomposition
    width = sum(_state_widths(analysis.trace))
    if dec is not None and (dec["measured"].shape[0] < len(rows)
                            or dec["measured"].shape[-1] != width):
        dec = None  # the analysis kept the split of fewer windows or units: δs alone
    if dec is not None:
        paths = {k: _np(dec[k]) for k in ("measured", "forget_path", "return_path")}  # (B,T,S)
    else:
        s = analysis.trace.state_name
        clean, moved = (_np(pooled(t, s)) for t in (analysis.trace, analysis.trace_perturbed))
        paths = {"measured": moved - clean}
    norms = {k: [[_sig(x) for x in np.linalg.norm(v[r, p:, :], axis=-1)] for r in rows]
             for k, v in paths.items()}  # window -> ‖·‖ at lag 0 … T−1−p
    curves = analysis.perturbation.curves
    chars, unit = list(analysis.chars), analysis.model.get("unit", "characters")
    return {
        "pos": p,
        "texts": _text(analysis.perturbed, chars, rows, unit),
        "orig": [t[p] for t in _text(analysis.windows, chars, rows, unit)],
        "paths": {k: quantize(_first_units(analysis.trace, v[rows, p:, :], cap))
                  for k, v in paths.items()},  # (W, T-p, S)
        "norms": norms, "mean_ratio": {k: [_sig(x) for x in curves[k]] for k in paths},
        "has_paths": dec is not None,
    }


def _widths(analysis: Analysis, layers: list[str], signals: list[str]) -> list[list[int]]:
    """Per layer: each shown signal's width, then the carried state's."""
    tr = analysis.trace
    return [[int(tr[f"{ln}.{x}"].shape[-1]) for x in signals if f"{ln}.{x}" in tr] + [w]
            for ln, w in zip(layers, _state_widths(tr), strict=True)]


def _state_widths(trace: Any) -> list[int]:
    """The carried state's width in each layer (the pooled state's pieces)."""
    return [int(trace[f"{layer_name(k)}.{trace.state_name}"].shape[-1])
            for k in range(int(trace.num_layers))]


def _first_units(trace: Any, v: np.ndarray, cap: int | None) -> np.ndarray:
    """The pooled state's columns (…, S) the page draws: all, or each layer's first
    ``cap`` (zeros where a layer has fewer), side by side."""
    if cap is None:
        return v
    ends = np.cumsum([0, *_state_widths(trace)])
    out = np.zeros((*v.shape[:-1], cap * (len(ends) - 1)))
    for k in range(len(ends) - 1):
        w = min(cap, int(ends[k + 1] - ends[k]))
        out[..., k * cap : k * cap + w] = v[..., ends[k] : ends[k] + w]
    return out


def _window_bytes(analysis: Analysis, widths: list[list[int]], cap: int | None) -> int:
    """The raw bytes one window costs the page: every signal of both models, and the three
    perturbation paths of the state, each at most ``cap`` units wide."""
    t = int(analysis.trace[f"layer0.{analysis.trace.state_name}"].shape[1])
    k = t - int(analysis.perturb_pos)
    c = (lambda w: w) if cap is None else (lambda w: min(w, cap))  # noqa: E731
    return sum(2 * t * sum(c(w) for w in ws[:-1]) + 3 * k * c(ws[-1]) for ws in widths)


def unit_cap(analysis: Analysis, widths: list[list[int]]) -> int | None:
    """How many units of each layer the page draws: None (all) when one window of all of
    them fits ``BYTE_BUDGET``; else the first ones that fit, at least ``MIN_UNITS`` (a
    24-layer Mamba of mamba-130m's width has 24,576 (channel, state) units a layer)."""
    if _window_bytes(analysis, widths, None) <= BYTE_BUDGET:
        return None
    per_unit = _window_bytes(analysis, [[1] * len(ws) for ws in widths], None)
    return max(MIN_UNITS, BYTE_BUDGET // max(per_unit, 1))


def _window_count(analysis: Analysis, widths: list[list[int]], cap: int | None,
                  max_windows: int | None) -> int:
    """How many windows the character view draws: max_windows, or what fits the budget."""
    b = int(analysis.trace[f"layer0.{analysis.trace.state_name}"].shape[0])
    if max_windows is not None:
        return max(1, min(b, int(max_windows)))
    per = _window_bytes(analysis, widths, cap)
    return max(1, min(b, MAX_WINDOWS, BYTE_BUDGET // max(per, 1)))


def encode_plot(path: str | Path) -> dict[str, str]:
    """A PNG file as ``{"name", "uri"}`` with a base64 data URI.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.png"
    >>> _ = p.write_bytes(b"\\x89PNG")
    >>> encode_plot(p)["uri"]
    'data:image/png;base64,iVBORw=='
    """
    path = Path(path)
    with path.open("rb") as f:
        raw = f.read(MAX_PLOT_BYTES + 1)
    if len(raw) > MAX_PLOT_BYTES:
        raise ValueError(f"{path}: over {MAX_PLOT_BYTES // 2**20} MiB, not a plot gatelens drew")
    b64 = base64.b64encode(raw).decode("ascii")
    return {"name": path.name, "uri": f"data:image/png;base64,{b64}"}


def plots_inside(out: str | Path, names: Any) -> tuple[list[Path], list[str]]:
    """The plots of page_data.json's ``plot_files`` (paths relative to the analysis
    directory ``out``) that a page may embed, and one note per name refused: only PNG
    files (by suffix and signature) of at most ``MAX_PLOT_BYTES`` inside ``out`` (symbolic
    links resolved), never an absolute or ``..`` path. A ``names`` that is not a list of
    strings is a ValueError naming page_data.json.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "a.png").write_bytes(PNG_SIGNATURE)
    >>> files, notes = plots_inside(d, ["a.png", "/etc/hostname", "../x.png"])
    >>> [f.name for f in files], len(notes), notes[1].endswith("outside the analysis directory")
    (['a.png'], 2, True)
    """
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{Path(out) / 'page_data.json'}: plot_files must be a list of "
                         f"paths (strings), got {type(names).__name__}")
    root, files, notes = Path(out).resolve(), [], []
    for name in names:
        try:
            path = (root / name).resolve()
        except (OSError, ValueError, RuntimeError) as e:  # a NUL byte, a symlink loop
            notes.append(f"plot {name!r} left out of the page: {e}")
            continue
        why = ("an absolute path" if Path(name).is_absolute() else
               "outside the analysis directory" if not path.is_relative_to(root) else
               "not a .png file" if path.suffix.lower() != ".png" else
               "missing" if not path.is_file() else
               f"over {MAX_PLOT_BYTES // 2**20} MiB" if path.stat().st_size > MAX_PLOT_BYTES
               else None)
        if why is None:
            with path.open("rb") as f:
                why = None if f.read(len(PNG_SIGNATURE)) == PNG_SIGNATURE else "not a PNG"
        if why is None:
            files.append(path)
        else:
            notes.append(f"plot {name!r} left out of the page: {why}")
    return files, notes


def page_data(analysis: Analysis, max_windows: int | None = None) -> dict[str, Any]:
    """Everything report.html embeds, as a JSON-ready dict.

    ``max_windows`` caps the windows drawn character by character; by default as
    many as fit ``BYTE_BUDGET``. Keys: ``meta`` (cell, sizes, signals, counts), ``texts``,
    ``models`` (trained / untrained -> layer -> signal -> quantised (W, T, H)),
    ``units`` (layer -> per-unit table), ``perturb``, ``report``, ``plots``.

    >>> import torch
    >>> from gatelens.analysis.measure import encoder_runner, measure
    >>> a = measure(torch.nn.LSTM(3, 4, batch_first=True),
    ...             encoder_runner(lambda i: torch.nn.functional.one_hot(i, 3).float()),
    ...             torch.randint(0, 3, (3, 12)), list("ab "), perturb_pos=4)
    >>> d = page_data(a)
    >>> d["meta"]["signals"], d["meta"]["shown"], d["models"]["trained"]["layer0"]["f"]["shape"]
    (['i', 'f', 'g', 'o', 'c', 'h'], 3, [3, 12, 4])
    """
    trace, base = analysis.trace, analysis.baseline_trace
    layers = [layer_name(k) for k in range(int(trace.num_layers))]
    signals = _signals(trace, 0)
    widths = _widths(analysis, layers, signals)
    cap = unit_cap(analysis, widths)
    kept = trace.meta.get("kept_units")  # the analysis kept only these units (kept_for_page)
    cap = kept if cap is None else cap if kept is None else min(cap, kept)
    n = _window_count(analysis, widths, cap, max_windows)
    rows = list(range(n))
    b, t, h = (int(d) for d in trace[f"layer0.{signals[0]}"].shape)
    models: dict[str, dict] = {}
    for label, tr in (("trained", trace), ("untrained", base)):
        models[label] = {ln: {s: quantize(_np(tr[f"{ln}.{s}"][rows, :, :cap]))
                              for s in signals if f"{ln}.{s}" in tr} for ln in layers}
    report = analysis.report
    model = report.get("model", {})
    bounds = cell_spec(trace.cell).bounds
    meta = {
        "cell": trace.cell, "layers": layers, "hidden": h, "signals": signals,
        "keep_gate": trace.keep_gate, "state": trace.state_name,
        "n_windows": b, "length": t, "shown": n, "step": model.get("step"),
        "source": (report.get("text") or {}).get("source"),
        "unit": model.get("unit") or "characters",
        "ranges": {s: list(bounds[s]) if s in bounds else None for s in signals},
        "units_shown": cap,
    }
    return {
        "format": 1,
        "title": f"gatelens · {trace.cell} · {h} units" + (
            f" · step {meta['step']}" if meta["step"] is not None else "") + (
            "" if cap is None else f" · the first {cap} units of each layer drawn"),
        "meta": meta,
        "chars": list(analysis.chars),
        "texts": _text(analysis.windows, list(analysis.chars), rows, meta["unit"]),
        "models": models,
        "units": {ln: {k: v[:cap] if isinstance(v, list) else v for k, v in tab.items()}
                  for ln, tab in _unit_tables(analysis).items()},
        "perturb": _perturbation(analysis, rows, cap),
        "report": report,
        "plots": [encode_plot(p) for p in analysis.plots if Path(p).is_file()],
        "plot_files": [_relative(p, analysis.out) for p in analysis.plots],
    }


def _relative(path: str | Path, out: str | Path) -> str:
    """``path`` relative to ``out`` when inside it (so a moved analysis still rebuilds)."""
    try:
        return Path(path).resolve().relative_to(Path(out).resolve()).as_posix()
    except ValueError:
        return str(path)
