"""One verdict over several chunks of windows (``gatelens.analysis.measure`` verifies each
chunk): every figure the largest of the chunks', so it equals the verdict on all windows at
once.
"""

from __future__ import annotations

from gatelens.families.base import LayerDiff
from gatelens.readout.verify import VerifyResult
from gatelens.readout.verify_figures import max_or_none


def _merge_rows(rows: list[list[LayerDiff]]) -> list[LayerDiff]:
    """Layer rows of several chunks of windows: each figure the largest."""
    out = []
    for same in zip(*rows, strict=True):
        out.append(LayerDiff(same[0].layer, same[0].reverse, *(
            max_or_none([getattr(r, f) for r in same]) for f in (
                "max_abs_diff_h", "max_abs_diff_c", "max_scaled_diff_c", "max_scaled_diff_h"))))
    return out


def merge_results(results: list[VerifyResult]) -> VerifyResult:
    """One verdict over several chunks of windows: every figure the largest of the chunks'
    (each is a max over windows), so it equals the verdict on all windows at once.

    >>> a = VerifyResult("gru", [], 1e-7, None, None, 1e-6)
    >>> merge_results([a, VerifyResult("gru", [], 3e-7, None, None, 2e-7)]).max_abs_diff_h
    3e-07
    """
    first = results[0]
    fields = {f: max_or_none([getattr(r, f) for r in results]) for f in (
        "one_step_max_abs_diff_h", "one_step_max_abs_diff_c", "one_step_max_scaled_diff_c",
        "free_running_max_abs_diff_h", "trace_max_abs_diff_h", "trace_max_scaled_diff_c",
        "one_step_max_scaled_diff_h", "trace_max_scaled_diff_h")}
    return VerifyResult(cell=first.cell, layers=_merge_rows([r.layers for r in results]),
                        free_running_layers=_merge_rows([r.free_running_layers
                                                         for r in results]),
                        tol=first.tol, meta=_merged_meta(results), **fields)


def _merged_meta(results: list[VerifyResult]) -> dict:
    """The first chunk's facts; a float64 re-judge of any chunk (the largest float32 figure,
    and the layers any chunk re-judged)."""
    meta = dict(results[0].meta)
    seen = [r.meta["float64_rejudge"] for r in results if "float64_rejudge" in r.meta]
    if seen:
        worst = dict(max(seen, key=lambda d: d["float32_one_step"]))
        if all("layers" in d for d in seen):  # every layer any chunk re-judged
            worst["layers"] = sorted({k for d in seen for k in d["layers"]})
        if "windows" in worst:  # each chunk's re-judged window; None: some chunk's every one
            wins = [d.get("windows") for d in seen]
            worst["windows"] = None if None in wins else sorted({w for ws in wins for w in ws})
        meta["float64_rejudge"] = worst
        meta["tolerance_rule"] = next(r.meta["tolerance_rule"] for r in results
                                      if "float64_rejudge" in r.meta)
    return meta
