"""report.html: one self-contained page with the gates drawn over the text.

The page is ``template.html`` with ``page.css``, ``page.js``, the report's tables, the
plots (base64 data URIs) and the data of ``html_data.page_data`` inlined, so it works
offline from file:// and makes no request to any host. ``write_html`` writes it beside
report.json (with page_data.json, from which ``rebuild_html`` rebuilds it);
``HtmlReport`` shows the same page inline in Jupyter.

>>> data = {"title": "demo", "report": {}, "plots": [], "meta": {}}
>>> page = render_html(data)
>>> page.startswith("<!DOCTYPE html>") and "<title>demo</title>" in page
True
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gatelens.errors import GatelensError
from gatelens.io import atomic_write_json, atomic_write_text
from gatelens.report.html_data import encode_plot, page_data, plots_inside
from gatelens.report.html_tables import report_tables
from gatelens.report.json_report import VERSION, schema
from gatelens.report.words import in_unit, unit_of
from gatelens.schema_check import check_fields, check_schema

if TYPE_CHECKING:
    from gatelens.analysis.measure import Analysis

__all__ = ["HtmlReport", "page_data", "render_html", "rebuild_html", "write_html"]

HERE = Path(__file__).resolve().parent
#: Keys of page_data that page_data.json leaves out: they are rebuilt from report.json
#: and the PNG files, so the two never disagree.
REBUILT = ("report", "plots")
#: page_data.json's keys as the page and ``rebuild_html`` read them (schema_check's kinds)
PAGE_FIELDS = {"format": ("int",), "title": ("str",), "meta": ("dict",), "chars": ("list",),
               "texts": ("list",), "models": ("dict",), "units": ("dict",),
               "perturb": ("dict", None)}  # plot_files: plots_inside's own check
#: report.json's top-level blocks the page's tables read
REPORT_FIELDS = {"version": ("int",), "model": ("dict",), "text": ("dict",),
                 "verification": ("dict", None), "gates": ("dict", None),
                 "units": ("dict", None)}


def _asset(name: str) -> str:
    return (HERE / name).read_text(encoding="utf-8")


def _script_json(obj: Any) -> str:
    """JSON safe inside <script>: no '<' can close the element (JSON.parse reads \\u003c).

    >>> _script_json({"t": "</script>"})
    '{"t":"\\\\u003c/script>"}'
    """
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")


def _plots_html(plots: list[dict[str, str]]) -> str:
    figs = "".join(
        f'<figure><img alt="{escape(p["name"])}" src="{p["uri"]}">'
        f'<figcaption>{escape(p["name"])}</figcaption></figure>' for p in plots)
    return figs or "<p class=\"muted\">No plots in this analysis.</p>"


def render_html(data: dict[str, Any]) -> str:
    """The whole page for ``data`` (what ``page_data`` returns), as one string."""
    unit = unit_of(data.get("report") or {})
    parts = {
        "TITLE": escape(str(data.get("title", "gatelens report"))),
        "CSS": _asset("page.css"),
        "JS": _asset("page.js").replace("</", "<\\/"),
        "TABLES": in_unit(report_tables(data.get("report") or {}), unit),
        "PLOTS": _plots_html(data.get("plots") or []),
        # Top-level keys sorted: a rebuilt page is byte-identical to the first one.
        "DATA": _script_json({k: data[k] for k in sorted(data) if k != "plots"}),
    }
    # One pass, so text inside one part is never read as a placeholder of another.
    page = in_unit(_asset("template.html"), unit)  # its own words, in the model's unit
    return re.sub(r"\{\{([A-Z]+)\}\}", lambda m: parts[m.group(1)], page)


@dataclass
class HtmlReport:
    """A rendered page; Jupyter displays it inline (isolated in an iframe).

    >>> r = HtmlReport("<!DOCTYPE html><p>hi</p>")
    >>> r._repr_html_().startswith("<iframe")
    True
    """

    html: str
    path: Path | None = None
    height: int = 900

    @classmethod
    def from_analysis(cls, analysis: Analysis, max_windows: int | None = None) -> HtmlReport:
        """Render an analysis without writing anything."""
        return cls(render_html(page_data(analysis, max_windows=max_windows)))

    @classmethod
    def from_dir(cls, out_dir: str | Path) -> HtmlReport:
        """Read (without rebuilding) the report.html of an analysis directory."""
        path = Path(out_dir) / "report.html"
        return cls(path.read_text(encoding="utf-8"), path)

    def save(self, path: str | Path) -> Path:
        """Write the page to ``path`` atomically."""
        atomic_write_text(path, self.html)
        return Path(path)

    def _repr_html_(self) -> str:
        # srcdoc keeps the page's CSS, ids and keyboard handler out of the notebook's own.
        return (f'<iframe srcdoc="{escape(self.html, quote=True)}" '
                f'style="width:100%;height:{self.height}px;border:1px solid #ddd" '
                'title="gatelens report"></iframe>')


def write_html(analysis: Analysis, max_windows: int | None = None) -> Path:
    """Write OUT/page_data.json and OUT/report.html for an analysis; return the page's path.

    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> from gatelens.analysis.measure import encoder_runner, measure
    >>> a = measure(torch.nn.GRU(3, 4, batch_first=True),
    ...             encoder_runner(lambda i: torch.nn.functional.one_hot(i, 3).float()),
    ...             torch.randint(0, 3, (2, 12)), list("ab "), perturb_pos=4)
    >>> a.out = Path(tempfile.mkdtemp())
    >>> write_html(a).name, sorted(p.name for p in a.out.iterdir())
    ('report.html', ['page_data.json', 'report.html'])
    """
    out = Path(analysis.out)
    data = page_data(analysis, max_windows=max_windows)
    atomic_write_json(out / "page_data.json", {k: v for k, v in data.items() if k not in REBUILT})
    path = out / "report.html"
    atomic_write_text(path, render_html(data))
    return path


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; a ValueError naming it when it is anything else."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def rebuild_html(out_dir: str | Path, notes: list[str] | None = None) -> Path:
    """Rebuild OUT/report.html from OUT/page_data.json, OUT/report.json and the plots.

    Raises FileNotFoundError naming the missing file when the directory is not an
    analysis written by ``write_html``, ValueError naming the file when one is not the
    JSON object it should be. Only PNG plots inside OUT are embedded (``plots_inside``);
    a line for each plot left out is appended to ``notes``.

    >>> import tempfile, torch
    >>> from gatelens.analysis.measure import encoder_runner, measure
    >>> from gatelens.report.write import write_analysis
    >>> a = measure(torch.nn.RNN(3, 4, batch_first=True),
    ...             encoder_runner(lambda i: torch.nn.functional.one_hot(i, 3).float()),
    ...             torch.randint(0, 3, (2, 12)), list("ab "), perturb_pos=4)
    >>> first = write_analysis(a, tempfile.mkdtemp()).out.joinpath("report.html").read_text()
    >>> rebuild_html(a.out).read_text() == first
    True
    """
    out = Path(out_dir)
    for name in ("page_data.json", "report.json"):
        if not (out / name).is_file():
            raise FileNotFoundError(f"{out / name} is missing; run `gatelens analyze` first")
    data, report = (_json_object(out / name) for name in ("page_data.json", "report.json"))
    try:
        check_fields(data, PAGE_FIELDS, out / "page_data.json",
                     required=("meta", "chars", "texts", "models"))
        check_fields(report, REPORT_FIELDS, out / "report.json", required=("model",))
        if report.get("version") == VERSION:  # what this gatelens writes: its whole schema
            check_schema(report, schema(), out / "report.json")
    except GatelensError as e:
        raise ValueError(str(e)) from None
    data["report"] = report
    names = data.get("plot_files") or [p.relative_to(out).as_posix()
                                       for p in sorted((out / "plots").glob("*.png"))]
    files, left_out = plots_inside(out, names)
    if notes is not None:
        notes.extend(left_out)
    data["plots"] = [encode_plot(p) for p in files]
    path = out / "report.html"
    try:  # an older report.json (no schema to hold it to) that does not render
        page = render_html(data)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
        raise ValueError(f"{out / 'report.json'}: not a report gatelens can render "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None
    atomic_write_text(path, page)
    return path
