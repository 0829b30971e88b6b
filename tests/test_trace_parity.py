"""Parity: every traced h (and h_n, c_n) equals the module's own output, every configuration."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from gatelens.readout.trace import trace

# oneDNN has no projected LSTM and warns once before using PyTorch's own path.
pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections:UserWarning")

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def make(cell: str, F=3, H=4, L=1, bi=False, bf=True, bias=True, proj=0, dtype=torch.float32,
         seed=0) -> nn.RNNBase:
    torch.manual_seed(seed)
    kw = dict(num_layers=L, bidirectional=bi, batch_first=bf, bias=bias)
    if cell == "lstm":
        m = nn.LSTM(F, H, proj_size=proj, **kw)
    elif cell == "gru":
        m = nn.GRU(F, H, **kw)
    else:
        m = nn.RNN(F, H, nonlinearity=cell[4:], **kw)
    return m.to(dtype).eval()


def make_state(m: nn.RNNBase, B: int | None, gen: torch.Generator):
    D = 2 if m.bidirectional else 1
    H_out = getattr(m, "proj_size", 0) or m.hidden_size
    batch = () if B is None else (B,)
    dt = m.weight_ih_l0.dtype
    h0 = torch.randn((m.num_layers * D, *batch, H_out), generator=gen, dtype=dt)
    if isinstance(m, nn.LSTM):
        return h0, torch.randn((m.num_layers * D, *batch, m.hidden_size), generator=gen, dtype=dt)
    return h0


def max_diff(m: nn.RNNBase, inputs, state=None) -> float:
    """Max |trace − torch| over the last layer's sequence, h_n and c_n."""
    tr = trace(m, inputs, state)
    with torch.no_grad():
        out, hn = m(inputs, state)
    if isinstance(out, torch.Tensor) and out.ndim == 2:
        out = out.unsqueeze(0)
    elif isinstance(out, torch.Tensor) and not m.batch_first:
        out = out.transpose(0, 1)
    elif not isinstance(out, torch.Tensor):
        out, _ = pad_packed_sequence(out, batch_first=True)
    k = m.num_layers - 1
    h = tr[f"layer{k}.h"]
    if m.bidirectional:
        h = torch.cat([h, tr[f"layer{k}.reverse.h"]], dim=-1)
    diffs = [(h[:, : out.shape[1]] - out).abs().max()]
    h_n, c_n = hn if isinstance(hn, tuple) else (hn, None)
    diffs.append((tr.h_n - h_n).abs().max())
    assert tr.h_n.shape == h_n.shape
    if c_n is not None:
        assert tr.c_n.shape == c_n.shape
        diffs.append((tr.c_n - c_n).abs().max())
    return float(max(diffs))


def inputs_for(m: nn.RNNBase, B: int, T: int, gen: torch.Generator, packed: bool = False,
               lengths: list[int] | None = None):
    dt = m.weight_ih_l0.dtype
    shape = (B, T, m.input_size) if m.batch_first else (T, B, m.input_size)
    x = torch.randn(shape, generator=gen, dtype=dt)
    if not packed:
        return x
    return pack_padded_sequence(x, torch.tensor(lengths), batch_first=m.batch_first,
                                enforce_sorted=False)


CELLS = ["lstm", "gru", "rnn_tanh", "rnn_relu"]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    cell=st.sampled_from(CELLS), L=st.integers(1, 2), bi=st.booleans(), bf=st.booleans(),
    bias=st.booleans(), proj=st.sampled_from([0, 0, 2]), B=st.integers(1, 3),
    T=st.integers(1, 5), F=st.integers(1, 4), H=st.integers(1, 4), packed=st.booleans(),
    with_state=st.booleans(), f64=st.booleans(), data=st.data(),
)
def test_parity_grid(cell, L, bi, bf, bias, proj, B, T, F, H, packed, with_state, f64, data):
    dtype = torch.float64 if f64 else torch.float32
    proj = proj if cell == "lstm" and proj < H else 0
    m = make(cell, F, H, L, bi, bf, bias, proj, dtype)
    gen = torch.Generator().manual_seed(1)
    lengths = data.draw(st.lists(st.integers(1, T), min_size=B, max_size=B)) if packed else None
    x = inputs_for(m, B, T, gen, packed, lengths)
    state = make_state(m, B, gen) if with_state else None
    assert max_diff(m, x, state) <= TOL[dtype]


FEATURES = ["plain", "layers3", "seq_first", "no_bias", "bidirectional", "bi_2layers", "proj",
            "proj_bi_2layers", "state", "packed", "packed_bi_state", "unbatched",
            "unbatched_state", "long"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "cell,feature",
    # proj_size is an LSTM feature: GRU and RNN get every other case
    [(c, f) for c in CELLS for f in FEATURES if c == "lstm" or not f.startswith("proj")],
)
def test_parity_feature(cell, feature, dtype):
    kw = {
        "layers3": dict(L=3), "seq_first": dict(bf=False), "no_bias": dict(bias=False),
        "bidirectional": dict(bi=True), "bi_2layers": dict(bi=True, L=2), "proj": dict(proj=3),
        "proj_bi_2layers": dict(proj=2, bi=True, L=2), "packed_bi_state": dict(bi=True, L=2),
    }.get(feature, {})
    m = make(cell, F=5, H=6, dtype=dtype, **kw)
    gen = torch.Generator().manual_seed(2)
    B, T = 4, 60 if feature == "long" else 7
    state = make_state(m, B, gen) if "state" in feature else None
    if feature.startswith("packed"):
        x = inputs_for(m, B, T, gen, packed=True, lengths=[3, 7, 1, 5])
    elif feature.startswith("unbatched"):
        x = torch.randn(T, 5, generator=gen, dtype=dtype)
        state = make_state(m, None, gen) if "state" in feature else None
    else:
        x = inputs_for(m, B, T, gen)
    assert max_diff(m, x, state) <= TOL[dtype]


def test_float32_is_close_to_1e7():
    """docs/methods.md expects ~1e-7 on CPU float32; stay within a small factor of it."""
    m = make("lstm", F=20, H=32, L=2)
    x = torch.randn(8, 40, 20, generator=torch.Generator().manual_seed(0))
    assert max_diff(m, x) < 2e-6


def _sig(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _set(m: nn.RNNBase, **tensors: list[float]) -> None:
    with torch.no_grad():
        for name, values in tensors.items():
            p = getattr(m, name)
            p.copy_(torch.tensor(values, dtype=torch.float64).view_as(p))


def test_lstm_by_hand():
    m = nn.LSTM(1, 1, batch_first=True).double()
    _set(m, weight_ih_l0=[0.5, -1.0, 2.0, 0.25], weight_hh_l0=[0.3, 0.7, -0.4, 1.1],
         bias_ih_l0=[0.1, 0.2, -0.3, 0.0], bias_hh_l0=[0.0, 0.5, 0.1, -0.2])
    xs = [1.5, -0.5]
    h = c = 0.0
    want = []
    for x in xs:
        i = _sig(0.5 * x + 0.3 * h + 0.1)
        f = _sig(-1.0 * x + 0.7 * h + 0.7)
        g = math.tanh(2.0 * x - 0.4 * h - 0.2)
        o = _sig(0.25 * x + 1.1 * h - 0.2)
        c = f * c + i * g
        h = o * math.tanh(c)
        want.append((i, f, g, o, c, h))
    tr = trace(m, torch.tensor([[[v] for v in xs]], dtype=torch.float64))
    for t, values in enumerate(want):
        for letter, v in zip("ifgoch", values, strict=True):
            assert abs(tr[f"layer0.{letter}"][0, t, 0].item() - v) < 1e-14, (t, letter)


def test_gru_by_hand():
    m = nn.GRU(1, 1, batch_first=True).double()
    _set(m, weight_ih_l0=[0.5, -1.0, 2.0], weight_hh_l0=[0.3, 0.7, -0.4],
         bias_ih_l0=[0.1, 0.2, -0.3], bias_hh_l0=[0.0, 0.5, 0.1])
    h = 0.25
    x = 0.8
    r = _sig(0.5 * x + 0.1 + 0.3 * h)
    z = _sig(-1.0 * x + 0.2 + 0.7 * h + 0.5)
    n = math.tanh(2.0 * x - 0.3 + r * (-0.4 * h + 0.1))
    h1 = (1 - z) * n + z * h
    tr = trace(m, torch.tensor([[[x]]], dtype=torch.float64), torch.tensor([[[h]]]).double())
    for letter, v in zip("rznh", (r, z, n, h1), strict=True):
        assert abs(tr[f"layer0.{letter}"].item() - v) < 1e-14, letter


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_rnn_by_hand(nonlinearity):
    m = nn.RNN(1, 1, nonlinearity=nonlinearity, batch_first=True).double()
    _set(m, weight_ih_l0=[0.5], weight_hh_l0=[-0.9], bias_ih_l0=[0.1], bias_hh_l0=[0.05])
    act = math.tanh if nonlinearity == "tanh" else (lambda v: max(v, 0.0))
    h, pres, hs = 0.0, [], []
    for x in [1.0, -2.0, 0.5]:
        pres.append(0.5 * x + 0.1 - 0.9 * h + 0.05)
        h = act(pres[-1])
        hs.append(h)
    tr = trace(m, torch.tensor([[[1.0], [-2.0], [0.5]]], dtype=torch.float64))
    assert torch.allclose(tr["layer0.pre"].flatten(), torch.tensor(pres).double(), atol=1e-14)
    assert torch.allclose(tr["layer0.h"].flatten(), torch.tensor(hs).double(), atol=1e-14)


def test_packed_padding_is_zero_and_lengths_set():
    m = make("lstm", bi=True, L=2)
    gen = torch.Generator().manual_seed(3)
    x = inputs_for(m, 3, 6, gen, packed=True, lengths=[2, 6, 4])
    tr = trace(m, x)
    assert tr.lengths.tolist() == [2, 6, 4]
    for name, t in tr.items():
        assert t[0, 2:].abs().max() == 0 and t[2, 4:].abs().max() == 0, name
        assert t[1].abs().max() > 0, name
