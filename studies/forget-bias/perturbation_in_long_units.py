"""Where a one-character perturbation sits: in the long-lived units or in the rest?

Reads the trials of a `forget-bias` study (`gatelens study --preset forget-bias --out DIR`)
and prints, per trial, at its final checkpoint on the usual 32 × 128 validation windows:

- the units whose half-life (from the unit's mean keep gate, LSTM f, GRU z) is ≥ 10;
- how much input those units admit, against the other units: the mean of the LSTM's input
  gate i, or of the GRU's (1 − z), which scales its candidate;
- the share of ‖δs‖² (LSTM c, GRU h) that lies in the long-lived units k = 0, 1, 8 and 32
  characters after the perturbation at position 32 (seed 0, as `gatelens analyze`).

    python studies/forget-bias/perturbation_in_long_units.py DIR > out.txt

Output for this machine's study: perturbation_in_long_units.txt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from gatelens import trace
from gatelens.analysis import perturb_windows
from gatelens.analysis.units import half_life

POSITION, LAGS = 32, (0, 1, 8, 32)


def long_unit_figures(rnn: torch.nn.Module, x: torch.Tensor, x_perturbed: torch.Tensor,
                      position: int = POSITION, lags: tuple[int, ...] = LAGS) -> dict:
    """n long-lived units, input admitted (long, other) and the share of ‖δs‖² in long
    units at each lag, for a one-layer nn.LSTM or nn.GRU (batch first) on (B, T, F) inputs."""
    cell = type(rnn).__name__.lower()
    with torch.no_grad():
        tr, tp = trace(rnn, x), trace(rnn, x_perturbed)
    if cell == "lstm":
        keep, entry, s, sp = tr["layer0.f"], tr["layer0.i"], tr["layer0.c"], tp["layer0.c"]
    else:
        keep, s, sp = tr["layer0.z"], tr["layer0.h"], tp["layer0.h"]
        entry = 1 - keep
    long = torch.as_tensor(half_life(keep.double().mean((0, 1)).numpy())) >= 10  # (H,)
    d2 = (sp - s).double() ** 2  # (B, T, H)
    shares = []
    for k in lags:
        tot = d2[:, position + k].sum(1)
        ok = tot > 0
        shares.append(float((d2[:, position + k][:, long].sum(1)[ok] / tot[ok]).mean()))
    return {"n_long": int(long.sum()), "n_units": int(long.numel()),
            "admitted_long": float(entry[..., long].mean()) if long.any() else None,
            "admitted_other": float(entry[..., ~long].mean()), "shares": shares}


def main(study: Path) -> None:
    from gatelens import load_run

    torch.set_num_threads(1)
    print(f"share of |ds|^2 in the long-lived units at k = {', '.join(map(str, LAGS))}")
    for cell in ("lstm", "gru"):
        for init in ("none", "forget_bias-1", "forget_bias-2", "forget_bias-3", "chrono-128"):
            for seed in (0, 1, 2):
                model = load_run(study / "trials" / f"cell-{cell}_init-{init}_seed-{seed}"
                                 / "run", "final")
                ids, _ = model.gatelens_run.windows(32, 128)
                pert = perturb_windows(ids, POSITION, model.head.out_features, seed=0)
                f = long_unit_figures(model.rnn, model.encode(ids), model.encode(pert))
                long_in = "  —  " if f["admitted_long"] is None else f"{f['admitted_long']:.3f}"
                print(f"{cell} {init:14s} seed {seed}: long units {f['n_long']:3d}/{f['n_units']}"
                      f"; input admitted: long {long_in}, other {f['admitted_other']:.3f}; "
                      f"shares " + " ".join(f"{v:.2f}" for v in f["shares"]), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
