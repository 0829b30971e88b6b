"""The causal memory figures (report.json ``causal``) as tables: report.md's "Causal
memory" section and the page's tables."""

from __future__ import annotations

from gatelens.report.tables import causal_tables

__all__ = ["causal_lines"]


def causal_lines(rep: dict) -> list[str]:
    """report.md's lines: each table under its caption, and its reading.

    >>> causal_lines({"causal": None})
    ['Not measured (the family is neither cut nor ablated, or a report before version 4).']
    """
    c = rep.get("causal")
    if not c:
        return ["Not measured (the family is neither cut nor ablated, or a report before "
                "version 4)."]
    tables, out = iter(causal_tables(rep)), []
    cut, ab = c.get("return_cut"), c.get("state_ablation")
    if cut:
        t = next(tables)
        out += [f"{t.caption}.", "", *t.markdown(), "",
                "Reading: with the return path cut, the perturbed state decays by the keep "
                f"gates alone; its curve equals the forget-only curve to "
                f"{cut['max_abs_diff']:.2g} (any layer or the pool), a causal check of the "
                "decomposition above.", ""]
    if ab:
        t, hl = next(tables), ab.get("half_life")
        out += [f"{t.caption}.", "", *t.markdown(), "",
                f"Reading: KL at the ablated step {ab['kl_at_p']:.3g} nats; "
                + (f"it halves in {hl:.3g} characters: how long the model uses what it held "
                   "there." if hl is not None else "it does not halve within the lags "
                   "measured."), ""]
    if c.get("note"):
        out += [f"Note: {c['note'].rstrip('.')}.", ""]
    return out[:-1] if out and out[-1] == "" else out
