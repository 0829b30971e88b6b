"""report.md: the tables of report.json laid out for a reader, each with a one-line reading.

Built from the report dict alone, so a saved report.json can be re-rendered.

>>> fmt(None), fmt(0.0069), fmt(6.48e-4), fmt(1331200), fmt(2.5)
('—', '0.0069', '6.48e-04', '1,331,200', '2.5')
"""

from __future__ import annotations

from ..analysis.units import HALF_LIFE_LONG

GATE_NAMES = {"i": "input", "f": "forget", "g": "candidate", "o": "output", "r": "reset",
              "z": "update (keep)", "n": "new"}
STATS = ("mean", "p5", "p25", "p50", "p75", "p95")


def fmt(x, digits: int = 3) -> str:
    """A number for a table: integers with separators, tiny values in scientific form."""
    if x is None:
        return "—"
    if isinstance(x, str | bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if x != 0 and abs(x) < 1e-3:
        return f"{x:.2e}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _gates(rep: dict) -> list[str]:
    gates = rep["gates"]
    base = (rep.get("baseline") or {}).get("gates") or {}
    letters = [g for g in gates if g != "n_values"]
    if not letters:
        return ["A plain RNN has no gates; its state is rewritten through tanh/relu at every "
                "step."]
    rows = []
    for g in letters:
        name = f"{g} ({GATE_NAMES.get(g, g)})"
        rows.append([name, "trained"] + [fmt(gates[g][s]) for s in STATS])
        if g in base:
            rows.append(["", "step 0"] + [fmt(base[g][s]) for s in STATS])
    out = _table(["gate", "model", "mean", "5 %", "25 %", "50 %", "75 %", "95 %"], rows)
    keep = rep["units"]["gate"]
    reading = f"Over {fmt(gates['n_values'])} values per gate."
    if keep in gates and keep in base:
        reading += (f" Training moved the {GATE_NAMES[keep]} gate's median from "
                    f"{fmt(base[keep]['p50'])} to {fmt(gates[keep]['p50'])} and widened its "
                    f"middle half from {fmt(base[keep]['p75'] - base[keep]['p25'])} to "
                    f"{fmt(gates[keep]['p75'] - gates[keep]['p25'])}.")
    return out + ["", f"Reading: {reading}"]


def _units(rep: dict) -> list[str]:
    u = rep["units"]
    if u["gate"] is None:
        return ["A plain RNN has no keep gate, so no per-unit timescale is defined."]
    b = (rep.get("baseline") or {}).get("units") or {}
    shift = rep.get("shift_from_init") or {}

    def pair(label, get):
        return [label, fmt(get(u)), fmt(get(b)) if b else "—"]

    rows = [pair("units", lambda d: d["n_units"]),
            pair(f"below start ({fmt(u['init_value'])})", lambda d: d["below_init"]),
            pair(f"half-life ≥ {HALF_LIFE_LONG:g} characters", lambda d: d["half_life_ge_10"])]
    for k in ("min", "p5", "median", "p95", "max"):
        rows.append(pair(f"mean {u['gate']}: {k}", lambda d, k=k: d["forget_mean"][k]))
    for k in ("min", "median", "max"):
        rows.append(pair(f"half-life (characters): {k}",
                         lambda d, k=k: "∞" if d["half_life"][k] is None else d["half_life"][k]))
    out = _table(["per unit", "trained", "step 0"], rows)
    reading = (f"{u['below_init']} of {u['n_units']} units keep less than their starting "
               f"{fmt(u['init_value'])}; the median unit halves its memory in "
               f"{fmt(u['half_life']['median'], 2)} characters, and {u['half_life_ge_10']} "
               f"reach {HALF_LIFE_LONG:g} or more.")
    if shift:
        reading += (f" Training moved a unit's mean {u['gate']} by {fmt(shift['mean_abs'])} on "
                    f"average (from {fmt(shift['min'])} to {fmt(shift['max'])}).")
    return out + ["", f"Reading: {reading}"]


def _perturbation(rep: dict) -> list[str]:
    p = rep["perturbation"]
    rows = []
    for j, k in enumerate(p["lags"]):
        rows.append([str(k), fmt(p["measured"][j]),
                     fmt(p["forget_only"][j]) if p["forget_only"] else "—",
                     fmt(p["return_path"][j]) if p.get("return_path") else "—"])
    out = _table(["lag k", "measured r(k)", "forget gate alone a(k)", "return path"], rows)
    K = p["lags"][-1]
    reading = (f"{K} characters after the change at position {p['position']} "
               f"({p['n']} windows), the difference in {p.get('state', 's')} is "
               f"{fmt(p['measured'][-1])} of its size (half-life "
               f"{fmt(p['half_life_measured'], 2)} characters)")
    if p["forget_only"] is not None:
        reading += (f"; the forget gate alone would leave {fmt(p['forget_only'][-1])} (half-life "
                    f"{fmt(p['half_life_forget_only'], 2)}), so the gates re-admitting it keep "
                    f"{fmt(p['ratio_at_max_lag'], 2)}× more.")
    else:
        reading += "; a plain RNN has no forget gate to compare with."
    out += ["", f"Reading: {reading}"]
    dec = rep.get("decomposition")
    if dec is not None:
        out += ["", f"The forget path and the return path add up to the measured difference "
                    f"(max |residual| {fmt(dec['max_abs_residual'])}, float64 from the traces)."]
    return out


def _classes(rep: dict) -> list[str]:
    c = rep["char_classes"]
    gate = rep["units"]["gate"]
    rows = [[name, fmt(v["positions"]), fmt(v["forget_mean"], 4)] for name, v in c.items()]
    out = _table(["input character", "positions", f"mean {gate or 'keep gate'}"], rows)
    known = {k: v["forget_mean"] for k, v in c.items() if v["forget_mean"] is not None}
    if not known:
        return out + ["", "Reading: no keep gate to compare (plain RNN); the counts remain."]
    lo = min(known, key=known.get)
    hi = max(known, key=known.get)
    return out + ["", f"Reading: the {gate} gate is lowest after {lo} ({fmt(known[lo], 4)}) "
                      f"and highest after {hi} ({fmt(known[hi], 4)})."]


def render_markdown(rep: dict, plots: list[str] | None = None) -> str:
    """report.md from a report.json dict; ``plots`` are paths relative to report.md."""
    m, t, v = rep["model"], rep["text"], rep["verification"]
    lines = [f"# gatelens analysis: {m['cell'].upper()}, {m['hidden']} units × {m['layers']} "
             f"layer(s), step {m['step']}", "",
             f"Text: {t['windows']} windows × {t['length']} characters from {t['source']}.",
             f"Multi-layer rule: {rep.get('pooling', 'layers pooled')}.", "",
             "## Verification", ""]
    if v["max_abs_diff_h"] is None:
        lines.append("Not run (the opened cells were unavailable).")
    else:
        lines.append(f"Max |h_hand − h_torch| = {v['max_abs_diff_h']:.3g}" +
                     (f", max |c_hand − c_torch| = {v['max_abs_diff_c']:.3g}"
                      if v["max_abs_diff_c"] is not None else "") +
                     f" ({'pass' if v.get('passed', True) else 'FAIL'}, tolerance 1e-5).")
    lines += ["", "## Gate distributions", "", *_gates(rep), "",
              "## Per-unit timescales", "", *_units(rep), "",
              "## Perturbation decay", "", *_perturbation(rep), "",
              "## Gates by input character", "", *_classes(rep), ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)
