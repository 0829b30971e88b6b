"""The scripts kept beside the studies (studies/*/*.py) compute what they say."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

STUDIES = Path(__file__).resolve().parents[1] / "studies"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _one_hot(ids, n):
    return torch.nn.functional.one_hot(ids, n).double()


def test_long_unit_figures_gru_shuts_long_units_lstm_does_not():
    """Units given a keep bias of 12 (z or f ≈ 1, half-life ≫ 10): the GRU's admit
    (1 − z) ≈ 6e-6 of their candidate and so hold none of the perturbation at k = 0; the
    LSTM's still admit i (≈ σ(0)) and hold a share of it from the start."""
    mod = _load(STUDIES / "forget-bias" / "perturbation_in_long_units.py")
    torch.manual_seed(0)
    V, H, B, T, P = 7, 8, 6, 48, 10
    ids = torch.randint(0, V, (B, T))
    pert = ids.clone()
    pert[:, P] = (ids[:, P] + 1) % V
    x, xp = _one_hot(ids, V), _one_hot(pert, V)
    long = torch.arange(H) < 3
    gru = torch.nn.GRU(V, H, batch_first=True).double()
    lstm = torch.nn.LSTM(V, H, batch_first=True).double()
    with torch.no_grad():
        gru.bias_ih_l0[H:2 * H][long] = 12.0  # z: chunk order r, z, n
        lstm.bias_ih_l0[H:2 * H][long] = 12.0  # f: chunk order i, f, g, o
        lstm.bias_ih_l0[:H].zero_()
        lstm.bias_hh_l0[:H].zero_()
    g = mod.long_unit_figures(gru, x, xp, position=P, lags=(0, 1, 8))
    ell = mod.long_unit_figures(lstm, x, xp, position=P, lags=(0, 1, 8))
    assert g["n_long"] == 3 and ell["n_long"] == 3 and g["n_units"] == H
    assert g["admitted_long"] < 1e-4 < 0.2 < g["admitted_other"]
    assert g["shares"][0] < 1e-6
    assert 0.2 < ell["admitted_long"] < 0.8
    assert ell["shares"][0] > 0.05
    # by hand: c from the LSTM's equations, the share at k = 0 and 8 averaged over windows
    def cells(inp):
        W, U = lstm.weight_ih_l0, lstm.weight_hh_l0
        b = lstm.bias_ih_l0 + lstm.bias_hh_l0
        h, c, out = torch.zeros(B, H, dtype=torch.float64), torch.zeros(B, H,
                                                                        dtype=torch.float64), []
        for t in range(T):
            i, f, gg, o = (inp[:, t] @ W.T + h @ U.T + b).chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(gg)
            h = torch.sigmoid(o) * torch.tanh(c)
            out.append(c)
        return torch.stack(out, 1)

    with torch.no_grad():
        d2 = (cells(xp) - cells(x)) ** 2  # (B, T, H)
    for j, k in ((0, 0), (2, 8)):
        want = float((d2[:, P + k, long].sum(1) / d2[:, P + k].sum(1)).mean())
        assert abs(ell["shares"][j] - want) < 1e-9
