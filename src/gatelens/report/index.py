"""The index page of a Lens analysis: one row per recurrent module, linking to its page.

>>> dirname(""), dirname("encoder.rnn"), dirname("/abs/path/x")
('model', 'encoder.rnn', '_abs_path_x-cce31c56')
"""

from __future__ import annotations

import hashlib
import re
from html import escape
from typing import TYPE_CHECKING, Any

from gatelens.report.words import unit_of

if TYPE_CHECKING:
    from gatelens.lens.lens import LensResult


#: Characters a module's directory name keeps; any other becomes "_".
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
#: The longest directory name kept whole (a file system allows 255 bytes).
MAX_NAME = 100


def dirname(path: str) -> str:
    """The directory of a module's analysis, one plain name inside OUT: its path, or
    "model" for the model itself. A path with a character outside [A-Za-z0-9_.-] (a
    module registered as "/abs/x" or "a/../b"), a leading dot or over ``MAX_NAME``
    characters is made one: "_" for each such character, no leading dot, cut to
    ``MAX_NAME``, and 8 hex digits of its SHA-1 so two such paths never share a directory.
    """
    if not path:
        return "model"
    safe = _UNSAFE.sub("_", path)
    if safe == path and not path.startswith(".") and len(path) <= MAX_NAME:
        return path
    digest = hashlib.sha1(path.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{safe.lstrip('.')[:MAX_NAME]}-{digest}"


def _fmt(x: Any) -> str:
    if x is None:
        return "∞"
    return f"{x:.3g}" if isinstance(x, float) else escape(str(x))


def index_page(result: LensResult) -> str:
    """A small self-contained page: one row per module, linking to its report.html when
    written (inline CSS, no external request)."""
    rows = []
    for path, a in result.analyses.items():
        rep = a.report
        m, ver, pert = rep["model"], rep["verification"], rep["perturbation"]
        label = escape(path or "(model)")
        if result.out is not None:
            label = f'<a href="{escape(dirname(path))}/report.html">{label}</a>'
        verdict = "passed" if ver.get("passed") else "FAILED"
        note = escape(result.notes.get(path, "") + (" " + m["directions"]
                                                    if "directions" in m else ""))
        rows.append(f"<tr><td>{label}</td><td>{escape(m['cell'])}</td><td>{m['hidden']}</td>"
                    f"<td>{m['layers']}</td><td>{verdict}</td>"
                    f"<td>{_fmt(pert.get('half_life_measured'))}</td><td>{note}</td></tr>")
    title = f"gatelens: {escape(type_name(result))}"
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
            f"<title>{title}</title><style>body{{font:14px sans-serif;margin:1.5em}}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.3em .6em;"
            "text-align:left}</style></head><body>"
            f"<h1>{title}</h1>{_left_alone(result)}<table><tr><th>module</th><th>cell</th>"
            "<th>hidden</th>"
            "<th>layers</th><th>verification</th><th>perturbation half-life "
            f"({escape(_unit(result))})</th><th>notes</th></tr>{''.join(rows)}"
            "</table></body></html>")


def _left_alone(result: LensResult) -> str:
    """A paragraph naming what in the model is not a recurrence gatelens opened (a hybrid's
    attention, MLP and MoE layers: report.json ``model.left_alone``), once; else nothing."""
    said = {a.report["model"].get("left_alone") for a in result.analyses.values()}
    said = sorted(s for s in said if isinstance(s, str))
    return "".join(f"<p>Left alone: {escape(s, quote=False)}.</p>" for s in said)


def _unit(result: LensResult) -> str:
    """The unit the analysed model reads (characters, tokens, bytes; the first report's)."""
    first = next(iter(result.analyses.values()), None)
    return "characters" if first is None else unit_of(first.report)


def type_name(result: LensResult) -> str:
    """The analysed model's class name (from the first report)."""
    first = next(iter(result.analyses.values()), None)
    return "" if first is None else str(first.model.get("class", ""))
