"""report.json as HTML tables: the same tables report.md lays out, for the page.

Every function takes the report dict and tolerates missing or null keys (a key that does
not apply to a cell is null), so a report from any cell, or an older one, renders.

>>> "<table" in gates_table({"gates": {"n_values": 8, "f": {"mean": 0.5, "p5": 0.1}}})
True
"""

from __future__ import annotations

import json
import math
from html import escape
from typing import Any

STATS = ("mean", "p5", "p25", "p50", "p75", "p95")


def fmt(v: Any) -> str:
    """A number as a reader wants it; None as an em dash.

    >>> fmt(None), fmt(1331200), fmt(0.49456), fmt(6.48e-4), fmt(True), fmt("x<y")
    ('—', '1,331,200', '0.4946', '0.000648', 'yes', 'x&lt;y')
    """
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "∞" if v > 0 else ("−∞" if v < 0 else "—")
        if v != 0 and abs(v) < 1e-3:
            return f"{v:.3g}"
        return f"{v:.4g}"
    return escape(str(v))


def _table(head: list[str], rows: list[list[Any]], caption: str = "") -> str:
    """A plain table; the first column is a row header."""
    cap = f"<caption>{escape(caption)}</caption>" if caption else ""
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join(
        "<tr>" + f"<th>{fmt(r[0])}</th>" + "".join(f"<td>{fmt(c)}</td>" for c in r[1:]) + "</tr>"
        for r in rows)
    return f'<table class="num">{cap}<thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _d(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def gates_table(report: dict) -> str:
    """Gate x statistic, with the untrained model's mean beside the trained one."""
    gates, base = _d(report.get("gates")), _d(_d(report.get("baseline")).get("gates"))
    rows = [[g] + [_d(s).get(k) for k in STATS] + [_d(base.get(g)).get("mean")]
            for g, s in gates.items() if g != "n_values" and isinstance(s, dict)]
    if not rows:
        return ""
    cap = f"Gate distributions over {fmt(gates.get('n_values'))} values"
    return _table(["gate", *STATS, "mean at init"], rows, cap)


def units_table(report: dict) -> str:
    """Per-unit timescales, trained beside untrained."""
    u, b = _d(report.get("units")), _d(_d(report.get("baseline")).get("units"))
    if not u:
        return ""
    rows = [[k, u.get(k), b.get(k)] for k in
            ("gate", "init_value", "n_units", "below_init", "half_life_ge_10")]
    for group in ("forget_mean", "half_life"):
        for stat, v in _d(u.get(group)).items():
            rows.append([f"{group} {stat}", v, _d(b.get(group)).get(stat)])
    return _table(["per unit", "trained", "untrained"], rows, "Per-unit timescales")


def perturbation_table(report: dict) -> str:
    """Lags x measured / forget-only decay, then the half-lives and their ratio."""
    p = _d(report.get("perturbation"))
    lags = p.get("lags") or []
    if not lags:
        return ""

    def at(key: str, i: int) -> Any:
        seq = p.get(key)
        return seq[i] if isinstance(seq, list) and i < len(seq) else None

    rows = [[lag, at("measured", i), at("forget_only", i)] for i, lag in enumerate(lags)]
    cap = (f"Perturbation at position {fmt(p.get('position'))} over {fmt(p.get('n'))} windows")
    extra = [["half-life measured", p.get("half_life_measured")],
             ["half-life forget only", p.get("half_life_forget_only")],
             ["ratio at max lag", p.get("ratio_at_max_lag")]]
    return (_table(["lag", "measured r(k)", "forget only a(k)"], rows, cap)
            + _table(["summary", "value"], extra))


def classes_table(report: dict) -> str:
    """Mean keep gate by input-character class, with counts."""
    c = _d(report.get("char_classes"))
    rows = [[k, _d(v).get("forget_mean"), _d(v).get("positions")] for k, v in c.items()]
    return _table(["class", "mean forget gate", "positions"], rows,
                  "Forget gate by input character") if rows else ""


def summary_table(report: dict) -> str:
    """Model, text and verification in one small table."""
    m, t, v = (_d(report.get(k)) for k in ("model", "text", "verification"))
    rows = [[f"{grp} {k}", val] for grp, d in (("model", m), ("text", t), ("verification", v))
            for k, val in d.items() if not isinstance(val, (dict, list))]
    return _table(["", "value"], rows, "Run") if rows else ""


def report_tables(report: dict) -> str:
    """All tables, then the whole report.json in a collapsed block.

    >>> html = report_tables({"version": 1, "model": {"cell": "lstm", "hidden": 4}})
    >>> "lstm" in html and "<details" in html
    True
    """
    parts = [summary_table(report), gates_table(report), units_table(report),
             perturbation_table(report), classes_table(report)]
    raw = escape(json.dumps(report, indent=1, allow_nan=True, default=str))
    body = "".join(f'<div class="tbl">{p}</div>' for p in parts if p)
    return (f'<div class="tables">{body}</div>'
            f"<details><summary>report.json</summary><pre>{raw}</pre></details>")
