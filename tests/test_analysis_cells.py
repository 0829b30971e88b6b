"""The measurements on real nn.LSTM / nn.GRU / nn.RNN modules with known answers.

The traces here come from a small independent re-run of PyTorch's equations in float64
(``ref_trace``), so the analysis is checked against numbers computed another way; where
``gatelens.trace`` exists, its traces must give the same results.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from gatelens.analysis import (
    decompose,
    perturb_windows,
    perturbation_decay,
    unit_timescales,
)
from gatelens.readout.trace import trace
from gatelens.readout.trace_types import Trace


def ref_trace(rnn: nn.RNNBase, x: torch.Tensor, dtype=torch.float64) -> Trace:
    """PyTorch's equations (docs/methods.md) step by step, batch-first input (B, T, I)."""
    cell = {nn.LSTM: "lstm", nn.GRU: "gru"}.get(type(rnn)) or f"rnn_{rnn.nonlinearity}"
    H, B, T = rnn.hidden_size, x.shape[0], x.shape[1]
    inp = x.to(dtype)
    out = {}
    for k in range(rnn.num_layers):
        W_ih, W_hh, b_ih, b_hh = (getattr(rnn, f"{n}_l{k}").detach().to(dtype)
                                  for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
        h = torch.zeros(B, H, dtype=dtype)
        c = torch.zeros(B, H, dtype=dtype)
        sig = {n: [] for n in {"lstm": "ifgoch", "gru": "rznh"}.get(cell, ["pre", "h"])}
        for t in range(T):
            gi = inp[:, t] @ W_ih.T + b_ih  # (B, G·H)
            gh = h @ W_hh.T + b_hh  # (B, G·H)
            if cell == "lstm":
                zi, zf, zg, zo = (gi + gh).chunk(4, dim=-1)
                i, f, g, o = zi.sigmoid(), zf.sigmoid(), zg.tanh(), zo.sigmoid()
                c = f * c + i * g
                h = o * c.tanh()
                vals = dict(i=i, f=f, g=g, o=o, c=c, h=h)
            elif cell == "gru":
                ir, iz, in_ = gi.chunk(3, dim=-1)
                hr, hz, hn = gh.chunk(3, dim=-1)
                r, z = (ir + hr).sigmoid(), (iz + hz).sigmoid()
                n = (in_ + r * hn).tanh()
                h = (1 - z) * n + z * h
                vals = dict(r=r, z=z, n=n, h=h)
            else:
                pre = gi + gh
                h = pre.tanh() if cell == "rnn_tanh" else pre.relu()
                vals = dict(pre=pre, h=h)
            for n, v in vals.items():
                sig[n].append(v)
        for n, vs in sig.items():
            out[f"layer{k}.{n}"] = torch.stack(vs, dim=1)  # (B, T, H)
        inp = out[f"layer{k}.h"]
    return Trace(cell, rnn.num_layers, False, out)


def module(cls, V=6, H=5, layers=1, seed=0):
    torch.manual_seed(seed)
    return cls(V, H, num_layers=layers, batch_first=True)


def onehot(ids, V):
    return torch.nn.functional.one_hot(ids, V).float()


def windows(B=4, T=24, V=6, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_reference_trace_matches_pytorch():
    for cls in (nn.LSTM, nn.GRU, nn.RNN):
        m = module(cls, layers=2).double()
        x = onehot(windows(), 6).double()
        out, _ = m(x)
        tr = ref_trace(m, x)
        assert torch.allclose(tr["layer1.h"], out, atol=1e-12)


@pytest.mark.parametrize("b", [-1.0, 0.0, 2.0])
def test_lstm_with_constant_forget_gate(b):
    m = module(nn.LSTM, H=4)
    with torch.no_grad():
        H = 4
        m.weight_hh_l0[H:2 * H].zero_()
        m.weight_ih_l0[H:2 * H].zero_()
        m.bias_ih_l0[H:2 * H].fill_(b)
        m.bias_hh_l0[H:2 * H].zero_()
    a = 1 / (1 + math.exp(-b))
    ids = windows(B=5, T=40)
    p = 3
    ids2 = perturb_windows(ids, p, 6, seed=0)
    # the float64 reference loop and gatelens's own read-out must give the same figures
    with torch.no_grad():
        traces = [(ref_trace(m, onehot(ids, 6)), ref_trace(m, onehot(ids2, 6))),
                  (trace(m, onehot(ids, 6)), trace(m, onehot(ids2, 6)))]
    for tr, tr2 in traces:
        u = unit_timescales(tr, init_value=0.5)
        np.testing.assert_allclose(u.forget_means, a, rtol=1e-6)
        assert u.half_life["median"] == pytest.approx(math.log(0.5) / math.log(a), rel=1e-5)
        d = perturbation_decay(tr, tr2, p)
        assert d.lags == [1, 2, 4, 8, 16, 32]
        assert d.forget_only == pytest.approx([a ** k for k in d.lags], rel=1e-5)
        assert d.half_life_forget_only == pytest.approx(math.log(0.5) / math.log(a), rel=1e-5)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("layers", [1, 2])
def test_decomposition_adds_up(cls, layers):
    m = module(cls, layers=layers, seed=layers)
    ids = windows(B=6, T=30)
    p = 5
    ids2 = perturb_windows(ids, p, 6, seed=3)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        tr, tr2 = ref_trace(m, onehot(ids, 6), dtype), ref_trace(m, onehot(ids2, 6), dtype)
        dec = decompose(tr, tr2, p)
        total = dec["forget_path"] + dec["return_path"]
        assert dec["measured"].dtype == torch.float64
        assert torch.allclose(total, dec["measured"], atol=tol, rtol=0)
        assert (dec["measured"][:, :p] == 0).all() and (dec["return_path"][:, p] == 0).all()
        # the return path is not negligible: the gates do re-admit the difference
        assert dec["return_path"][:, p + 1:p + 4].abs().max() > 1e-3
        d = perturbation_decay(tr, tr2, p, decomposition=dec)
        assert d.max_abs_residual < tol
        base = dec["measured"][:, p].norm(dim=-1)  # (B,)
        for j, k in enumerate(d.lags):
            fk = (dec["forget_path"][:, p + k].norm(dim=-1) / base).mean()
            rk = (dec["return_path"][:, p + k].norm(dim=-1) / base).mean()
            assert d.forget_only[j] == pytest.approx(float(fk), rel=1e-12)
            assert d.return_path[j] == pytest.approx(float(rk), rel=1e-12)
        assert d.to_dict()["return_path"] == d.return_path


def test_measured_decay_against_pytorch_outputs():
    """r(k) for a GRU (s = h) recomputed from nn.GRU's own outputs."""
    m = module(nn.GRU, H=7)
    ids = windows(B=8, T=40)
    p = 2
    ids2 = perturb_windows(ids, p, 6, seed=0)
    m64 = module(nn.GRU, H=7).double()
    with torch.no_grad():
        h = m64(onehot(ids, 6).double())[0]  # (B, T, H)
        h2 = m64(onehot(ids2, 6).double())[0]
    d = perturbation_decay(ref_trace(m, onehot(ids, 6)), ref_trace(m, onehot(ids2, 6)), p)
    delta = (h2 - h).norm(dim=-1)  # (B, T)
    expect = [float((delta[:, p + k] / delta[:, p]).mean()) for k in d.lags]
    assert d.measured == pytest.approx(expect, rel=1e-9)
    assert d.measured_h == pytest.approx(d.measured, rel=1e-12)
    assert d.n == 8


def test_rnn_measured_only():
    m = module(nn.RNN)
    ids = windows(T=20)
    ids2 = perturb_windows(ids, 10, 6, seed=0)
    tr, tr2 = ref_trace(m, onehot(ids, 6)), ref_trace(m, onehot(ids2, 6))
    assert decompose(tr, tr2, 10) is None
    d = perturbation_decay(tr, tr2, 10)
    assert d.lags == [1, 2, 4, 8] and d.forget_only is None and d.return_path is None
    out = d.to_dict()
    assert out["forget_only"] is None and out["ratio_at_max_lag"] is None
    assert out["half_life_forget_only"] is None and out["half_life_measured"] is not None
    with pytest.raises(ValueError, match="no lag"):
        perturbation_decay(tr, tr2, 19)


def test_perturb_windows_never_keeps_the_original():
    ids = windows(B=200, T=5, V=4)
    out = perturb_windows(ids, 2, 4, seed=7)
    assert (out[:, 2] != ids[:, 2]).all()
    assert torch.equal(out[:, [0, 1, 3, 4]], ids[:, [0, 1, 3, 4]])
    assert torch.equal(out, perturb_windows(ids, 2, 4, seed=7))
    assert set(out[:, 2].tolist()) == {0, 1, 2, 3}
    with pytest.raises(ValueError):
        perturb_windows(ids, 5, 4, seed=0)
