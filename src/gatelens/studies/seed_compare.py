"""The seed's published figures, and ours set beside them.

``SEED_FIGURES`` are the seed study's numbers (docs/methods.md, "Reading the seed's
figures"); ``compare`` matches our report.json figures to them one by one, ``series``
lines the cells up, ``forget_bias_study`` states the seed's forget-bias claim as figures.
Rendering is apart, in ``gatelens.report.reproduce_md``.

>>> _figure({"perturbation": {"lags": [1, 8], "measured": [0.7, 0.2]}},
...         ("perturbation", "measured", 8))
0.2
"""

from __future__ import annotations

from gatelens.families.registry import builtin_recipes

#: The seed's published figures (LSTM, 325 units, 800 steps, 32 × 128 validation characters;
#: corpus, optimiser and learning rate unknown). Half-lives and ratio as docs/methods.md gives them.
SEED_FIGURES: dict = {
    "cell": "lstm", "hidden": 325, "steps": 800, "windows": 32, "length": 128,
    # the seed matched PyTorch's h to 6.85e-07; ours is the one-step error (docs/methods.md)
    "verification": {"one_step_max_abs_diff_h": 6.85e-07},
    "gates": {"n_values": 1_331_200,
              "i": {"mean": 0.661, "p5": 0.294, "p25": 0.515, "p50": 0.684, "p75": 0.828,
                    "p95": 0.946},
              "f": {"mean": 0.495, "p5": 0.081, "p25": 0.258, "p50": 0.491, "p75": 0.730,
                    "p95": 0.922},
              "o": {"mean": 0.587, "p5": 0.178, "p25": 0.392, "p50": 0.597, "p75": 0.798,
                    "p95": 0.947}},
    "units": {"n_units": 325, "below_init": 172, "half_life_ge_10": 0,
              "forget_mean": {"min": 0.307, "p5": 0.377, "median": 0.494, "p95": 0.622,
                              "max": 0.793},
              "half_life": {"min": 0.59, "median": 0.98, "max": 2.99}},
    "perturbation": {"lags": [1, 4, 8, 16, 32],
                     "measured": [0.711, 0.337, 0.144, 0.041, 0.0069],
                     "forget_only": [0.574, 0.124, 0.022, 0.003, 6.48e-04],
                     "half_life_measured": 4.5, "half_life_forget_only": 3.0,
                     "ratio_at_max_lag": 10.6},
    "char_classes": {"space": {"forget_mean": 0.4623, "positions": 865},
                     "newline": {"forget_mean": 0.4597, "positions": 105},
                     "other": {"forget_mean": 0.5057, "positions": 3126}},
    "series": ["GRU and RNN forgot at nearly the LSTM's rate",
               "800 steps was the bottom of validation loss",
               "a larger forget bias reached the whole context while loss got worse"],
}
AGREE_REL = 0.10  # a figure "agrees" when within 10 % of the seed's (verification: both pass)

#: Every cell a reproduction may train, in the order tables show them: gatelens's own
#: families that carry their state (PyTorch's cells and gatelens's), not the official ones.
CELLS: tuple[str, ...] = tuple(n for n, r in builtin_recipes().items() if not r.official)


def _figure(report: dict | None, path: tuple) -> float | None:
    """A figure of a report.json by path; ("perturbation", "measured", 8) looks up lag 8."""
    if report is None:
        return None
    if path[0] == "perturbation" and len(path) == 3:
        p = report["perturbation"]
        if p[path[1]] is None or path[2] not in p["lags"]:
            return None
        return p[path[1]][p["lags"].index(path[2])]
    node = report
    for key in path:
        if not isinstance(node, dict) or node.get(key) is None:
            return None
        node = node[key]
    return node


def _figure_paths() -> list[tuple[str, tuple]]:
    """(label, path) of every seed figure, in the order the seed gave them."""
    out: list[tuple[str, tuple]] = [
        ("max |h_hand − h_torch|", ("verification", "one_step_max_abs_diff_h")),
        ("gate values", ("gates", "n_values"))]
    for g in ("i", "f", "o"):
        for k in SEED_FIGURES["gates"][g]:
            out.append((f"{g} {k}", ("gates", g, k)))
    for k in ("min", "p5", "median", "p95", "max"):
        out.append((f"per-unit mean f: {k}", ("units", "forget_mean", k)))
    for k in ("min", "median", "max"):
        out.append((f"per-unit half-life: {k}", ("units", "half_life", k)))
    out += [("units below start", ("units", "below_init")),
            ("units with half-life ≥ 10", ("units", "half_life_ge_10"))]
    for name in ("measured", "forget_only"):
        for k in SEED_FIGURES["perturbation"]["lags"]:
            out.append((f"{name} at lag {k}", ("perturbation", name, k)))
    out += [(k.replace("_", " "), ("perturbation", k)) for k in
            ("half_life_measured", "half_life_forget_only", "ratio_at_max_lag")]
    for c in ("space", "newline", "other"):
        out += [(f"f on {c}", ("char_classes", c, "forget_mean")),
                (f"{c} positions", ("char_classes", c, "positions"))]
    return out


def agrees(label: str, seed: float | None, ours: float | None) -> bool | None:
    """Whether our figure is within AGREE_REL of the seed's (None: nothing to compare).

    >>> agrees("f mean", 0.495, 0.52), agrees("f mean", 0.495, 0.6), agrees("x", 1.0, None)
    (True, False, None)
    >>> agrees("max |h_hand − h_torch|", 6.85e-07, 2e-07)
    True
    """
    if seed is None or ours is None:
        return None
    if label.startswith("max |h_hand"):
        return ours <= 1e-5 and seed <= 1e-5
    if seed == 0:
        return ours == 0
    return abs(ours - seed) <= AGREE_REL * abs(seed)


def compare(reports: dict[str, dict], runs: dict[str, dict]) -> dict:
    """The seed's figures beside ours (LSTM, with GRU and RNN alongside) and the series."""
    rows = []
    for label, path in _figure_paths():
        seed = _figure(SEED_FIGURES, path)
        row = {"figure": label, "seed": seed,
               **{cell: _figure(reports.get(cell), path) for cell in CELLS}}
        row["agrees"] = agrees(label, seed, row["lstm"])
        rows.append(row)
    series = []
    for cell, rep in reports.items():
        hist = rep.get("history") or {}
        vals = hist.get("val_loss") or []
        best = (runs[cell].get("best") or {})
        series.append({
            "cell": cell, "hidden": rep["model"]["hidden"],
            "steps": runs[cell]["config"]["steps"], "best_step": best.get("step"),
            "best_val_loss": best.get("val_loss"),
            "final_val_loss": vals[-1] if vals else None,
            "best_is_last": bool(vals) and best.get("step") == hist["step"][-1],
            "units_median_half_life": _figure(rep, ("units", "half_life", "median")),
            "half_life_measured": rep["perturbation"]["half_life_measured"],
            "half_life_forget_only": rep["perturbation"]["half_life_forget_only"],
            "ratio_at_max_lag": rep["perturbation"]["ratio_at_max_lag"]})
    return {"agree_rel": AGREE_REL, "comparison": rows, "series": series}


def forget_bias_study(bias: float, plain: dict, biased: dict, plain_best: dict | None,
                      biased_best: dict | None, how: str = "trained") -> dict:
    """The seed's third series claim, as figures: does a larger forget bias keep the
    perturbation across the whole window, and at what cost in validation loss?

    >>> rep = lambda hl, a32, med: {"perturbation": {"half_life_measured": hl,
    ...     "measured": [a32], "lags": [32]}, "units": {"half_life": {"median": med}},
    ...     "text": {"length": 128}}
    >>> s = forget_bias_study(3.0, rep(8.8, 0.08, 1.7), rep(40.0, 0.6, 9.0),
    ...                       {"val_loss": 1.94}, {"val_loss": 2.01})
    >>> s["reaches_window"], s["loss_worse"]
    (False, True)
    """
    def fig(rep: dict) -> dict:
        p = rep["perturbation"]
        return {"half_life_measured": p["half_life_measured"],
                "measured_at_max_lag": p["measured"][-1], "max_lag": p["lags"][-1],
                "median_unit_half_life": rep["units"]["half_life"]["median"]}
    after = fig(biased)
    length = biased["text"]["length"]
    hl = after["half_life_measured"]  # None: infinite (the difference never shrank)
    return {"forget_bias": bias, "how": how, "plain": fig(plain), "biased": after,
            "window_length": length,
            "reaches_window": hl is None or hl >= length,
            "best_val_loss_plain": (plain_best or {}).get("val_loss"),
            "best_val_loss_biased": (biased_best or {}).get("val_loss"),
            "loss_worse": None if not (plain_best and biased_best) else
            biased_best["val_loss"] > plain_best["val_loss"]}


