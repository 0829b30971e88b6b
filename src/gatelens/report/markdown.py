"""report.md: the tables of report.json laid out for a reader, each with a one-line reading.

Built from the report dict alone (``tables.py`` builds the tables, for the page too), so a
saved report.json can be re-rendered.

>>> md = render_markdown({"model": {"cell": "gru", "hidden": 4, "layers": 1, "step": 0},
...     "text": {"windows": 1, "length": 8, "source": "x"}, "gates": {}, "units": {"gate": None},
...     "verification": {"max_abs_diff_h": 1e-7, "max_abs_diff_c": None},
...     "perturbation": {"lags": []}, "char_classes": {}})
>>> md.splitlines()[0]
'# gatelens analysis: GRU, 4 units × 1 layer(s), step 0'
"""

from __future__ import annotations

import math

from gatelens.analysis.units import HALF_LIFE_LONG
from gatelens.report.markdown_causal import causal_lines
from gatelens.report.tables import (
    GATE_NAMES,
    Table,
    classes_table,
    divergence_table,
    fmt,
    gates_table,
    half_lives_table,
    perturbation_table,
    reach_table,
    units_table,
    verification_table,
)
from gatelens.report.words import in_unit, unit_of


def _gates(rep: dict) -> list[str]:
    gates = rep["gates"]
    base = (rep.get("baseline") or {}).get("gates") or {}
    table = gates_table(rep)
    if table is None:
        return ["A plain RNN has no gates; its state is rewritten through tanh/relu at every "
                "step."]
    keep = rep["units"]["gate"]
    reading = f"Over {fmt(gates['n_values'])} values per gate."
    if keep in gates and keep in base:
        reading += (f" Training moved the {GATE_NAMES[keep]} gate's median from "
                    f"{fmt(base[keep]['p50'])} to {fmt(gates[keep]['p50'])} and widened its "
                    f"middle half from {fmt(base[keep]['p75'] - base[keep]['p25'])} to "
                    f"{fmt(gates[keep]['p75'] - gates[keep]['p25'])}.")
    return table.markdown() + ["", f"Reading: {reading}"]


def _units(rep: dict) -> list[str]:
    u = rep["units"]
    table = units_table(rep)
    if table is None:
        return ["A plain RNN has no keep gate, so no per-unit timescale is defined."]
    shift = rep.get("shift_from_init") or {}
    reading = (f"{u['below_init']} of {u['n_units']} units keep less than their starting "
               f"{fmt(u['init_value'])}; the median unit halves its memory in "
               f"{fmt(u['half_life']['median'], 2)} characters, and {u['half_life_ge_10']} "
               f"reach {HALF_LIFE_LONG:g} or more.")
    if shift:
        reading += (f" Training moved a unit's mean {u['gate']} by {fmt(shift['mean_abs'])} on "
                    f"average (from {fmt(shift['min'])} to {fmt(shift['max'])}).")
    return table.markdown() + ["", f"Reading: {reading}"]


def _perturbation(rep: dict) -> list[str]:
    p = rep["perturbation"]
    table = perturbation_table(rep)
    if table is None:
        return ["No lag fits inside the windows after the perturbation position."]
    out = table.markdown() + [""] + half_lives_table(rep).markdown()
    K = p["lags"][-1]
    grows = p["measured"][-1] is not None and p["measured"][-1] >= 1
    life = ("it grows instead of halving" if grows else
            f"half-life {fmt(p['half_life_measured'], 2)} characters")
    reading = (f"{K} characters after the change at position {p['position']} "
               f"({p['n']} windows), the difference in {p.get('state', 's')} is "
               f"{fmt(p['measured'][-1])} of its size ({life})")
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
    table = classes_table(rep)
    if table is None:
        return ["No positions to class."]
    out = table.markdown()
    known = {k: v["forget_mean"] for k, v in c.items() if v["forget_mean"] is not None}
    if not known:
        return out + ["", "Reading: no keep gate to compare (plain RNN); the counts remain."]
    lo = min(known, key=known.get)
    hi = max(known, key=known.get)
    return out + ["", f"Reading: the {gate} gate is lowest after {lo} ({fmt(known[lo], 4)}) "
                      f"and highest after {hi} ({fmt(known[hi], 4)})."]


def _verification(rep: dict) -> list[str]:
    v = rep["verification"]
    out = verification_table(rep).markdown()
    return out + ([] if not v.get("explanation") else ["", f"Reading: {v['explanation']}"])


def _divergence(rep: dict) -> list[str]:
    d, table = rep.get("divergence"), divergence_table(rep)
    if table is None:
        return ["Not measured (packed input, or a version 1 report)."]
    return table.markdown() + ["", f"Reading: {d.get('description') or d['regime']}."]


def _reach(rep: dict) -> list[str]:
    r, table = rep.get("output_reach"), reach_table(rep)
    if table is None:
        note = rep.get("output_reach_note") or "not measured (a version 1 report)"
        return [f"No output-level reach: {note}."]
    note = rep.get("output_reach_note")  # how the output was read (probabilities)
    return table.markdown() + [
        "", f"Reading: {r.get('description', '')} The state curves say what the model holds "
        "of the changed character; this one says what it still uses to predict."] + (
        ["", f"Note: {note}."] if note else [])


def _memory(rep: dict) -> list[str]:
    """The state's memory by direction: the Lyapunov spectrum and its slow modes."""
    ly = rep.get("lyapunov")
    if not ly:
        return ["Not measured (`--exponents 0`, packed input, or a report before version 3)."]
    ex = ly["exponents"]
    rows = [[i + 1, v, None if v is None or v >= 0 else math.log(0.5) / v]
            for i, v in enumerate(ex[:8])]
    out = Table(["exponent", "λ (nats/character)", "half-life (characters)"], rows,
                f"The {len(ex)} largest of {ly.get('size')} exponents over the whole carried "
                f"state ({ly.get('windows')} windows; the first 8 shown)").markdown()
    modes = ly.get("slow_modes") or []
    if modes:
        out += ["", *Table(["λ", "half-life", "participation ratio", "top units [layer, unit]"],
                           [[m["exponent"], m["half_life"], m["participation_ratio"],
                             ", ".join(f"[{a}, {b}]" for a, b in m["top_units"])]
                            for m in modes], "Slow modes (half-life ≥ 10)").markdown()]
    rule = [f"Cost rule: {ly['rule']}."] if ly.get("rule") else []
    return out + ["", *rule, f"Reading: {ly.get('description', '')}."]


def _context(rep: dict) -> list[str]:
    c = rep.get("context")
    if not c:
        return ["Not measured: the model gives no next-character logits."]
    return Table(["context d (characters)", "excess loss (nats)"],
                 list(zip(c["lengths"], c["excess_loss"], strict=True)),
                 f"Loss with only the last d characters minus the loss with the whole window "
                 f"({c.get('windows')} windows)").markdown() + [
        "", f"Reading: {c.get('description', '')}; effective context "
            f"{c['effective_context'] if c['effective_context'] is not None else '> T/2'} "
            "(the smallest d within 0.01 nats)."]


def _saturation(rep: dict) -> list[str]:
    s = rep.get("saturation")
    if not s:
        return ["Not measured (a report before version 3)."]
    gates = [g for g in s if g != "keep_right_majority"]

    def mean(g: str, side: str) -> float | None:  # a list, or its summary at size
        v = s[g][side]
        return sum(v) / len(v) if v is not None else s[g][f"{side}_summary"]["mean"]

    def count(g: str) -> int:
        v = s[g]["right"]
        return len(v) if v is not None else s[g]["right_summary"]["n"]

    rows = [[g, mean(g, "left"), mean(g, "right")] for g in gates]
    n, keep = s.get("keep_right_majority"), rep.get("units", {}).get("gate")
    reading = ("the cell has no keep gate" if n is None or keep not in s else
               f"{n} of {count(keep)} units keep their keep gate {keep} above 0.9 in "
               "more than half the positions (integrators)")
    return Table(["gate", "mean share below 0.1", "mean share above 0.9"], rows,
                 "Gate saturation (per unit, averaged over units)").markdown() + [
        "", f"Reading: {reading}."]


def _fixed_points(rep: dict) -> list[str]:
    fp = rep.get("fixed_points")
    rows = [[h["input"], len(h["points"]), sum(p["stable"] for p in h["points"]),
             max((p["slowest_half_life"] or 0 for p in h["points"] if p["stable"]), default=None)]
            for h in fp["inputs"]]
    return Table(["held input", "points", "stable", "slowest half-life (characters)"], rows,
                 "Fixed points of the step with one input held").markdown() + [
        "", f"Reading: {fp.get('description', '')}."]


def _control_reading(ctl: dict) -> str:
    """Where the model's loss sits between the memoryless and the best achievable loss.

    >>> _control_reading({"memoryless_loss": 1.4, "best_loss": 1.2, "best_val_loss": 1.3})
    'the model recovers 50 % of what memory can buy (0 % = memoryless, 100 % = best).'
    """
    lo, hi, v = ctl["best_loss"], ctl["memoryless_loss"], ctl["best_val_loss"]
    if v is None or hi <= lo:
        return "no validation loss to compare."
    return (f"the model recovers {100 * (hi - v) / (hi - lo):.0f} % of what memory can buy "
            "(0 % = memoryless, 100 % = best).")


def render_markdown(rep: dict, plots: list[str] | None = None) -> str:
    """report.md from a report.json dict; ``plots`` are paths relative to report.md."""
    m, t, unit = rep["model"], rep["text"], unit_of(rep)
    where = f" `{m['path']}`" if m.get("path") else ""
    head = [f"# gatelens analysis{where}: {m['cell'].upper()}, {m['hidden']} units × "
            f"{m['layers']} layer(s), step {m['step']}", "",
            f"Text: {t['windows']} windows × {t['length']} {unit} from {t['source']}.",
            f"Multi-layer rule: {rep.get('pooling', 'layers pooled')}.",
            *([f"Left alone: {m['left_alone']}."] if isinstance(m.get("left_alone"), str)
              else []), "",
            *[f"Note: {n}" for n in m.get("notes") or []], *([""] if m.get("notes") else [])]
    lines = ["## Verification", "", *_verification(rep)]
    lines += ["", "## Gate distributions", "", *_gates(rep), "",
              "## Per-unit timescales", "", *_units(rep), "",
              "## Perturbation decay", "", *_perturbation(rep), "",
              "## Gates by input character", "", *_classes(rep), "",
              "## Divergence rate", "", *_divergence(rep), "",
              "## Output-level reach", "", *_reach(rep), "",
              "## Causal memory", "", *causal_lines(rep), "",
              "## Context used", "", *_context(rep), "",
              "## Memory by direction", "", *_memory(rep), "",
              "## Gate saturation", "", *_saturation(rep), ""]
    if rep.get("fixed_points"):
        lines += ["## Fixed points", "", *_fixed_points(rep), ""]
    ctl = rep.get("control_losses")
    if ctl:
        lines += ["## Against the corpus's own bounds", "",
                  *Table(["loss (nats per character)", "value"],
                         [["memoryless (forgets the character to recall)", ctl["memoryless_loss"]],
                          ["best achievable (perfect memory)", ctl["best_loss"]],
                          ["this model's best validation loss", ctl["best_val_loss"]]]).markdown(),
                  "", f"Reading: {_control_reading(ctl)}", ""]
    lines = head + [in_unit(line, unit) for line in lines]  # gatelens's words, in the unit
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)
