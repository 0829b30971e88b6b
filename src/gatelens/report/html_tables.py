"""report.json as HTML: the tables of ``tables.py`` (the same ones report.md lays out),
then the whole report.json in a collapsed block.

>>> html = report_tables({"version": 1, "model": {"cell": "lstm", "hidden": 4}})
>>> "lstm" in html and "<details" in html
True
"""

from __future__ import annotations

import json
from html import escape

from gatelens.report.tables import all_tables


def report_tables(report: dict) -> str:
    """Every table that applies to ``report``, and the raw report.json."""
    body = "".join(f'<div class="tbl">{t.html()}</div>' for t in all_tables(report))
    raw = escape(json.dumps(report, indent=1, allow_nan=True, default=str))
    return (f'<div class="tables">{body}</div>'
            f"<details><summary>report.json</summary><pre>{raw}</pre></details>")
