"""Parity: the functional cell equations against PyTorch's own cells, float32 and float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gatelens.cells.equations import cell_weights, gru_step, lstm_step, rnn_step, step

TOL = {torch.float32: 1e-6, torch.float64: 1e-14}
DTYPES = [torch.float32, torch.float64]
# oneDNN has no projected LSTM and warns once before using PyTorch's own path.
pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections:UserWarning")


def _cell_from(module: nn.RNNBase, cell_cls: type, layer: int, reverse: bool, **kw) -> nn.Module:
    """An nn.*Cell holding one layer and direction of ``module``'s weights."""
    w = cell_weights(module, layer, reverse)
    ref = cell_cls(w.w_ih.shape[1], w.hidden_size, **kw).to(w.w_ih.dtype)
    with torch.no_grad():
        ref.weight_ih.copy_(w.w_ih)
        ref.weight_hh.copy_(w.w_hh)
        ref.bias_ih.copy_(w.b_ih)
        ref.bias_hh.copy_(w.b_hh)
    return ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer,reverse", [(0, False), (1, True)])
def test_lstm_matches_lstmcell(dtype: torch.dtype, layer: int, reverse: bool) -> None:
    torch.manual_seed(0)
    m = nn.LSTM(5, 7, num_layers=2, bidirectional=True).to(dtype)
    ref = _cell_from(m, nn.LSTMCell, layer, reverse)
    F = 5 if layer == 0 else 14
    x, h, c = torch.randn(6, F, dtype=dtype), torch.randn(6, 7, dtype=dtype), \
        torch.randn(6, 7, dtype=dtype) * 3
    sig = lstm_step(cell_weights(m, layer, reverse), x, h, c)
    with torch.no_grad():
        h_ref, c_ref = ref(x, (h, c))
    assert list(sig) == ["i", "f", "g", "o", "c", "h"]
    assert (sig["h"] - h_ref).abs().max() <= TOL[dtype]
    assert (sig["c"] - c_ref).abs().max() <= 3 * TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gru_matches_grucell(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    m = nn.GRU(5, 7).to(dtype)
    ref = _cell_from(m, nn.GRUCell, 0, False)
    x, h = torch.randn(6, 5, dtype=dtype), torch.randn(6, 7, dtype=dtype)
    sig = gru_step(cell_weights(m), x, h)
    with torch.no_grad():
        h_ref = ref(x, h)
    assert list(sig) == ["r", "z", "n", "h"]
    assert (sig["h"] - h_ref).abs().max() <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_rnn_matches_rnncell(dtype: torch.dtype, nonlinearity: str) -> None:
    torch.manual_seed(2)
    m = nn.RNN(5, 7, nonlinearity=nonlinearity).to(dtype)
    ref = _cell_from(m, nn.RNNCell, 0, False, nonlinearity=nonlinearity)
    x, h = torch.randn(6, 5, dtype=dtype), torch.randn(6, 7, dtype=dtype)
    sig = rnn_step(cell_weights(m), x, h)
    with torch.no_grad():
        h_ref = ref(x, h)
    assert list(sig) == ["pre", "h"]
    assert (sig["h"] - h_ref).abs().max() <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_projected_lstm_matches_module_step(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    m = nn.LSTM(5, 7, proj_size=3, batch_first=True).to(dtype)
    x = torch.randn(4, 1, 5, dtype=dtype)
    h, c = torch.randn(1, 4, 3, dtype=dtype), torch.randn(1, 4, 7, dtype=dtype)
    with torch.no_grad():
        out, (h_n, c_n) = m(x, (h, c))
    sig = lstm_step(cell_weights(m), x[:, 0], h[0], c[0])
    assert list(sig) == ["i", "f", "g", "o", "c", "m", "h"]
    assert sig["h"].shape == (4, 3) and sig["m"].shape == (4, 7)
    assert (sig["h"] - h_n[0]).abs().max() <= TOL[dtype]
    assert (sig["c"] - c_n[0]).abs().max() <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_all_steps_at_once_equals_module_run(dtype: torch.dtype, kind: str) -> None:
    """Fed PyTorch's own states, one call over (B, T) reproduces every step of the module."""
    torch.manual_seed(4)
    cls = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind]
    m = cls(5, 7, batch_first=True).to(dtype)
    x = torch.randn(3, 9, 5, dtype=dtype)
    h_seq, c_seq, state = [], [], None
    with torch.no_grad():
        for t in range(9):
            out, state = m(x[:, t : t + 1], state)
            h_seq.append(out[:, 0])
            if kind == "lstm":
                c_seq.append(state[1][0])
    h = torch.stack(h_seq, 1)  # (B, T, H)
    h_prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)  # (B, T, H)
    c_prev = None
    if kind == "lstm":
        c = torch.stack(c_seq, 1)
        c_prev = torch.cat([torch.zeros_like(c[:, :1]), c[:, :-1]], 1)
    sig = step(cell_weights(m), x, h_prev, c_prev)
    assert sig["h"].shape == (3, 9, 7)
    assert (sig["h"] - h).abs().max() <= TOL[dtype]
    if kind == "lstm":
        assert (sig["c"] - c).abs().max() <= 3 * TOL[dtype]


# PyTorch's own forward-AD decompositions warn once, on first use, that torch.jit is deprecated.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_step_is_jvp_friendly() -> None:
    """torch.func.jvp through a step equals the explicit Jacobian (jacfwd) times v."""
    torch.manual_seed(5)
    w = cell_weights(nn.LSTM(3, 4), dtype=torch.float64)
    x, h, c = (torch.randn(n, dtype=torch.float64) for n in (3, 4, 4))
    vh, vc = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)

    def f(h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = lstm_step(w, x, h, c)
        return s["h"], s["c"]

    _, (th, tc) = torch.func.jvp(f, (h, c), (vh, vc))
    jac = torch.func.jacfwd(lambda s: torch.cat(f(s[:4], s[4:])))(torch.cat([h, c]))  # (8, 8)
    assert torch.allclose(torch.cat([th, tc]), jac @ torch.cat([vh, vc]), atol=1e-14)


def test_no_bias_and_errors() -> None:
    m = nn.GRU(3, 4, bias=False)
    w = cell_weights(m)
    assert w.b_ih is None and w.b_hh is None
    assert step(w, torch.randn(3), torch.zeros(4))["h"].shape == (4,)
    with pytest.raises(ValueError, match="cell state"):
        step(cell_weights(nn.LSTM(3, 4)), torch.randn(3), torch.zeros(4))
    with pytest.raises(ValueError, match="no cell state"):
        step(w, torch.randn(3), torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match="reverse=True"):
        cell_weights(m, reverse=True)
    with pytest.raises(ValueError, match="outside"):
        cell_weights(m, layer=1)
    with pytest.raises(TypeError, match="nn.LSTM"):
        cell_weights(nn.Linear(3, 4))  # type: ignore[arg-type]


def test_dtype_cast_leaves_module_alone() -> None:
    m = nn.LSTM(3, 4)
    w = cell_weights(m, dtype=torch.float64)
    assert w.w_ih.dtype == torch.float64 and m.weight_ih_l0.dtype == torch.float32
    assert not w.w_ih.requires_grad
