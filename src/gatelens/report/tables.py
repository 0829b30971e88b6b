"""The report's tables, built once from report.json and laid out as Markdown or HTML.

``fmt`` is the one number format of report.md, report.html and reproduce.md; each
``*_table`` function takes a report dict (any cell, any version: a key that does not apply
is null or missing) and returns a ``Table`` or None when there is nothing to show.

>>> t = Table(["gate", "mean"], [["f", 0.4946]], caption="gates")
>>> t.markdown()
['| gate | mean |', '|---|---|', '| f | 0.495 |']
>>> fmt(None), fmt(0.0069), fmt(6.48e-4), fmt(1331200), fmt(2.5), fmt(float("inf")), fmt(True)
('—', '0.0069', '6.48e-04', '1,331,200', '2.5', '∞', 'yes')
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import Any

from gatelens.families.registry import cell_specs

STATS = ("mean", "p5", "p25", "p50", "p75", "p95")
STAT_LABELS = ("mean", "5 %", "25 %", "50 %", "75 %", "95 %")
#: A reader's name for every gate letter of every cell (the first cell naming a letter wins).
GATE_NAMES: dict[str, str] = {}
for _spec in cell_specs().values():
    for _k, _v in _spec.display.items():
        GATE_NAMES.setdefault(_k, _v)


def fmt(x: Any, digits: int = 3) -> str:
    """A figure as a reader wants it: separators on integers, tiny values in scientific
    form, None as an em dash, infinity as ∞."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, str):
        return x
    if isinstance(x, int):
        return f"{x:,}"
    x = float(x)
    if not math.isfinite(x):
        return "∞" if x > 0 else "−∞" if x < 0 else "—"
    if x != 0 and abs(x) < 1e-3:
        return f"{x:.2e}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


@dataclass
class Table:
    """A header, rows of cells (figures or text) and an optional caption."""

    header: list[str]
    rows: list[list[Any]]
    caption: str = ""
    digits: int = 3

    def cells(self) -> list[list[str]]:
        return [[fmt(c, self.digits) for c in row] for row in self.rows]

    def markdown(self) -> list[str]:
        """The table as Markdown lines (a bare | in a cell is escaped)."""
        def line(cells: list[str]) -> str:
            return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
        return ([line(self.header), "|" + "|".join("---" for _ in self.header) + "|"]
                + [line(r) for r in self.cells()])

    def html(self) -> str:
        """The table as one HTML element; the first column is a row header."""
        cap = f"<caption>{escape(self.caption)}</caption>" if self.caption else ""
        th = "".join(f"<th>{escape(h)}</th>" for h in self.header)
        body = "".join("<tr>" + f"<th>{escape(r[0])}</th>"
                       + "".join(f"<td>{escape(c)}</td>" for c in r[1:]) + "</tr>"
                       for r in self.cells())
        return f'<table class="num">{cap}<thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _d(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def gates_table(report: dict) -> Table | None:
    """Each gate's distribution, the untrained model's beside the trained one."""
    gates, base = _d(report.get("gates")), _d(_d(report.get("baseline")).get("gates"))
    rows = []
    for g, s in gates.items():
        if g == "n_values" or not isinstance(s, dict):
            continue
        rows.append([f"{g} ({GATE_NAMES.get(g, g)})", "trained"] + [s.get(k) for k in STATS])
        if isinstance(base.get(g), dict):
            rows.append(["", "step 0"] + [base[g].get(k) for k in STATS])
    if not rows:
        return None
    return Table(["gate", "model", *STAT_LABELS], rows,
                 f"Gate distributions over {fmt(gates.get('n_values'))} values per gate")


def units_table(report: dict) -> Table | None:
    """Per-unit timescales of the keep gate, trained beside step 0."""
    u, b = _d(report.get("units")), _d(_d(report.get("baseline")).get("units"))
    if u.get("gate") is None:
        return None

    def row(label: str, get) -> list[Any]:
        return [label, get(u), get(b) if b.get("gate") is not None else None]

    rows = [row("units", lambda d: d.get("n_units")),
            row(f"below start ({fmt(u.get('init_value'))})", lambda d: d.get("below_init")),
            row("half-life ≥ 10 characters", lambda d: d.get("half_life_ge_10"))]
    for k in ("min", "p5", "median", "p95", "max"):
        rows.append(row(f"mean {u['gate']}: {k}", lambda d, k=k: _d(d.get("forget_mean")).get(k)))
    def life(d: dict, k: str) -> float:
        v = _d(d.get("half_life")).get(k)
        return math.inf if v is None else v  # JSON null: the unit never halves

    for k in ("min", "median", "max"):
        rows.append(row(f"half-life (characters): {k}", lambda d, k=k: life(d, k)))
    return Table(["per unit", "trained", "step 0"], rows, "Per-unit timescales")


def perturbation_table(report: dict) -> Table | None:
    """Measured decay, forget gate alone and return path at the reported lags."""
    p = _d(report.get("perturbation"))
    lags = p.get("lags") or []
    if not lags:
        return None

    def at(key: str, j: int) -> Any:
        seq = p.get(key)
        return seq[j] if isinstance(seq, list) and j < len(seq) else None

    rows = [[k, at("measured", j), at("forget_only", j), at("return_path", j)]
            for j, k in enumerate(lags)]
    cap = f"Perturbation at position {fmt(p.get('position'))} over {fmt(p.get('n'))} windows"
    return Table(["lag k", "measured r(k)", "forget gate alone a(k)", "return path"], rows, cap)


def half_lives_table(report: dict) -> Table | None:
    """The perturbation's half-lives and the ratio at the largest lag."""
    p = _d(report.get("perturbation"))
    if not p.get("lags"):
        return None
    rows = [["half-life, measured", p.get("half_life_measured")],
            ["half-life, forget gate alone", p.get("half_life_forget_only")],
            ["ratio r(K) / a(K)", p.get("ratio_at_max_lag")]]
    return Table(["summary", "value"], rows)


def classes_table(report: dict) -> Table | None:
    """Mean keep gate by input-character class, with the count of positions."""
    c = _d(report.get("char_classes"))
    gate = _d(report.get("units")).get("gate")
    rows = [[k, _d(v).get("positions"), _d(v).get("forget_mean")] for k, v in c.items()]
    if not rows:
        return None
    return Table(["input character", "positions", f"mean {gate or 'keep gate'}"], rows,
                 "Keep gate by input character", digits=4)


def verification_table(report: dict) -> Table | None:
    """The one-step error (the verdict) beside the free-running divergence."""
    v = _d(report.get("verification"))
    if not v:
        return None
    if "one_step_max_abs_diff_h" not in v:  # a version 1 report
        rows = [["max |h_hand − h_torch|", v.get("max_abs_diff_h")],
                ["max |c_hand − c_torch|", v.get("max_abs_diff_c")],
                ["passed", v.get("passed")]]
        return Table(["figure", "value"], rows, "Verification")
    rows = [["one-step error, h (pass/fail)", v.get("one_step_max_abs_diff_h")],
            ["one-step error, c", v.get("one_step_max_abs_diff_c")],
            ["one-step error, c / max(1, |c|)", v.get("one_step_max_scaled_diff_c")],
            ["one-step error, h and y scaled (modern cells)",
             v.get("one_step_max_scaled_diff_h")],
            ["free-running divergence, h (the model's)", v.get("free_running_max_abs_diff_h")],
            ["tolerance", v.get("tolerance")], ["passed", v.get("passed")]]
    return Table(["figure", "value"], rows, "Verification")


def divergence_table(report: dict) -> Table | None:
    """The divergence rate λ and its regime."""
    d = report.get("divergence")
    if not isinstance(d, dict):
        return None
    rows = [["λ (nats per character)", d.get("lyapunov_per_char")],
            ["sd over windows", d.get("sd_over_windows")], ["burn-in (steps)", d.get("burn_in")],
            ["regime", d.get("regime")]]
    return Table(["figure", "value"], rows, "Divergence rate")


def reach_table(report: dict) -> Table | None:
    """KL of the next-character predictions by lag after the change, and its half-life."""
    r = report.get("output_reach")
    if not isinstance(r, dict):
        return None
    kl = r.get("kl") or []
    rows = [[k, v] for k, v in zip(r.get("lags") or [], kl, strict=False)]
    grows = r.get("half_life") is None and len(kl) > 1 and kl[0] and kl[-1] >= kl[0]
    rows.append(["half-life (characters)", "grows" if grows else r.get("half_life")])
    return Table(["lag k", "KL(p ‖ p′) (nats)"], rows, "Output-level reach")


def summary_table(report: dict) -> Table | None:
    """Model, text and verification in one small table."""
    rows = [[f"{grp} {k}", v] for grp in ("model", "text")
            for k, v in _d(report.get(grp)).items() if not isinstance(v, dict | list)]
    return Table(["", "value"], rows, "Run") if rows else None


def causal_tables(rep: dict) -> list[Table]:
    """The return path cut beside the forget-only curve; the state ablation's KL by lag."""
    c = rep.get("causal") or {}
    out = []
    cut = c.get("return_cut")
    if cut:
        p = cut["pooled"]
        out.append(Table(
            ["lag", "cut run |δs|", "forget-only |δs|", "uncut |δs|"],
            [list(r) for r in zip(cut["lags"], p["measured"], p["forget_only"], p["uncut"],
                                  strict=True)],
            f"Return path cut at position {cut['position']}: from the next step on "
            f"{', '.join(cut['patched'])} take their clean values"))
    ab = c.get("state_ablation")
    if ab:
        out.append(Table(["lag", "KL(clean ‖ ablated) (nats)"],
                         [list(r) for r in zip(ab["lags"], ab["kl"], strict=True)],
                         f"State ablation at position {ab['position']}: "
                         f"{', '.join(ab['ablated'])} replaced by their mean over the "
                         "windows, carried forward"))
    return out


def all_tables(report: dict) -> list[Table]:
    """Every table that applies, in the page's order."""
    tables = (summary_table(report), verification_table(report), divergence_table(report),
              gates_table(report), units_table(report), perturbation_table(report),
              half_lives_table(report), classes_table(report), reach_table(report))
    return [t for t in tables if t is not None] + causal_tables(report)
