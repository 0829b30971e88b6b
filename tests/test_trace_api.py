"""The trace API: exact names, shapes, errors, chunking, verify, module left untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from gatelens.readout.trace import trace, trace_chunked
from gatelens.readout.trace_types import gate_names
from gatelens.readout.verify import VERIFY_TOL, VerifyResult, verify

pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections:UserWarning")


def x_for(m: nn.RNNBase, B=2, T=5, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (B, T, m.input_size) if m.batch_first else (T, B, m.input_size)
    return torch.randn(shape, generator=g, dtype=dtype)


def test_exact_names_lstm_gru_rnn():
    torch.manual_seed(0)
    assert list(trace(nn.LSTM(2, 3), x_for(nn.LSTM(2, 3)))) == [
        "layer0.i", "layer0.f", "layer0.g", "layer0.o", "layer0.c", "layer0.h"]
    assert list(trace(nn.GRU(2, 3), x_for(nn.GRU(2, 3)))) == [
        "layer0.r", "layer0.z", "layer0.n", "layer0.h"]
    assert list(trace(nn.RNN(2, 3), x_for(nn.RNN(2, 3)))) == ["layer0.pre", "layer0.h"]
    relu = nn.RNN(2, 3, nonlinearity="relu")
    tr = trace(relu, x_for(relu))
    assert tr.cell == "rnn_relu" and list(tr) == ["layer0.pre", "layer0.h"]


def test_exact_names_two_layers_bidirectional():
    m = nn.LSTM(2, 3, num_layers=2, bidirectional=True)
    tr = trace(m, x_for(m))
    letters = ["i", "f", "g", "o", "c", "h"]
    want = [f"layer{k}{d}.{s}" for k in range(2) for d in ("", ".reverse") for s in letters]
    assert list(tr) == want == gate_names("lstm", 2, bidirectional=True)
    m = nn.GRU(2, 3, num_layers=2, bidirectional=True)
    assert list(trace(m, x_for(m))) == [
        "layer0.r", "layer0.z", "layer0.n", "layer0.h",
        "layer0.reverse.r", "layer0.reverse.z", "layer0.reverse.n", "layer0.reverse.h",
        "layer1.r", "layer1.z", "layer1.n", "layer1.h",
        "layer1.reverse.r", "layer1.reverse.z", "layer1.reverse.n", "layer1.reverse.h"]


def test_projected_lstm_names_and_shapes():
    m = nn.LSTM(2, 5, proj_size=3, batch_first=True)
    tr = trace(m, x_for(m, B=4, T=6))
    assert list(tr) == ["layer0.i", "layer0.f", "layer0.g", "layer0.o", "layer0.c", "layer0.m",
                        "layer0.h"]
    assert list(tr) == gate_names("lstm", 1, proj=True)
    assert tr["layer0.m"].shape == (4, 6, 5) and tr["layer0.h"].shape == (4, 6, 3)
    assert tr.proj_size == 3 and tr.h_n.shape == (1, 4, 3) and tr.c_n.shape == (1, 4, 5)
    assert "layer0.m" not in trace(nn.LSTM(2, 5), x_for(nn.LSTM(2, 5)))


def test_shapes_batch_first_either_way_and_trace_accessors():
    for bf in (True, False):
        m = nn.GRU(2, 3, num_layers=2, batch_first=bf)
        tr = trace(m, x_for(m, B=4, T=7))
        assert all(t.shape == (4, 7, 3) for t in tr.values())
        assert tr.num_layers == 2 and tr.keep_gate == "z" and tr.state_name == "h"
        assert set(tr.layer(1)) == {"r", "z", "n", "h"} and tr.gates == ("r", "z", "n")
        assert tr.h_n.shape == (2, 4, 3) and tr.c_n is None and tr.lengths is None


def test_unbatched_input():
    m = nn.LSTM(2, 3, num_layers=2)
    x = torch.randn(6, 2)
    tr = trace(m, x)
    _, (h_n, c_n) = m(x)
    assert tr["layer0.f"].shape == (1, 6, 3) and tr.meta["unbatched"]
    assert tr.h_n.shape == h_n.shape == (2, 3) and tr.c_n.shape == c_n.shape


def test_gates_in_range_and_no_grad():
    m = nn.LSTM(3, 4, batch_first=True)
    tr = trace(m, x_for(nn.LSTM(3, 4, batch_first=True), B=3, T=8).requires_grad_())
    for name in ("layer0.i", "layer0.f", "layer0.o"):
        assert 0 < tr[name].min() and tr[name].max() < 1
    assert not any(t.requires_grad for t in tr.values())


def _snapshot(m: nn.Module):
    return {n: (p.data_ptr(), p.clone(), p.requires_grad) for n, p in m.named_parameters()}


def test_module_left_untouched():
    m = nn.LSTM(3, 4, num_layers=2, bidirectional=True, proj_size=2).train()
    before = _snapshot(m)
    params = list(m.parameters())
    x = x_for(m)
    trace(m, x)
    verify(m, x)
    trace_chunked(nn.LSTM(3, 4), x, chunk=2)
    after = _snapshot(m)
    assert before.keys() == after.keys() and list(m.parameters()) == params
    for n in before:
        assert before[n][0] == after[n][0] and torch.equal(before[n][1], after[n][1]), n
        assert before[n][2] == after[n][2]
    assert m.training and not m._forward_hooks and not m._forward_pre_hooks


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN])
def test_chunked_equals_one_shot_exactly(cell):
    m = cell(3, 5, num_layers=2, batch_first=False)
    x = x_for(m, B=3, T=23)
    g = torch.Generator().manual_seed(5)
    h0 = torch.randn(2, 3, 5, generator=g)
    state = (h0, torch.randn(2, 3, 5, generator=g)) if cell is nn.LSTM else h0
    full = trace(m, x, state, method="step")  # chunks re-run steps; so does this
    for chunk in (1, 4, 7, 23, 100):
        part = trace_chunked(m, x, chunk=chunk, state=state)
        assert list(part) == list(full)
        for name in full:
            assert torch.equal(part[name], full[name]), (chunk, name)
        assert torch.equal(part.h_n, full.h_n)
        if cell is nn.LSTM:
            assert torch.equal(part.c_n, full.c_n)


def test_names_keep_only_some():
    m = nn.LSTM(3, 4, num_layers=2, batch_first=True)
    x = x_for(m, T=9)
    tr = trace(m, x, names=["layer1.f", "layer0.c"], method="step")
    assert list(tr) == ["layer1.f", "layer0.c"]
    part = trace_chunked(m, x, chunk=4, names=["layer1.f"])
    assert list(part) == ["layer1.f"] and torch.equal(part["layer1.f"], tr["layer1.f"])
    with pytest.raises(ValueError, match="layer0.zz"):
        trace(m, x, names=["layer0.zz"])


def test_chunked_refuses_bidirectional_and_packed():
    m = nn.GRU(3, 4, bidirectional=True)
    with pytest.raises(ValueError, match="bidirectional"):
        trace_chunked(m, x_for(m), chunk=2)
    m = nn.GRU(3, 4)
    packed = pack_padded_sequence(x_for(m), torch.tensor([5, 3]))
    with pytest.raises(ValueError, match="PackedSequence"):
        trace_chunked(m, packed, chunk=2)
    with pytest.raises(ValueError, match="chunk"):
        trace_chunked(m, x_for(m), chunk=0)


@pytest.mark.parametrize(
    "make_call, err, match",
    [
        (lambda: trace(nn.Linear(3, 4), torch.randn(2, 3)), TypeError, "Linear"),
        (lambda: trace(nn.LSTMCell(3, 4), torch.randn(2, 7)), ValueError, "LSTMCell.*F = 3"),
        (lambda: trace(nn.LSTM(3, 4), torch.randn(2, 5, 7)), ValueError, "F = 3.*7"),
        (lambda: trace(nn.LSTM(3, 4), torch.randn(1, 2, 5, 3)), ValueError, r"\(1, 2, 5, 3\)"),
        (lambda: trace(nn.LSTM(3, 4), torch.randn(3)), ValueError, "unbatched"),
        (lambda: trace(nn.LSTM(3, 4), torch.ones(2, 5, 3, dtype=torch.long)), TypeError,
         "float32.*int64"),
        (lambda: trace(nn.LSTM(3, 4), torch.randn(2, 5, 3).double()), TypeError, "float64"),
        (lambda: trace(nn.LSTM(3, 4), [[1.0, 2.0, 3.0]]), TypeError, "list"),
        (lambda: trace(nn.LSTM(3, 4), torch.randn(0, 2, 3)), ValueError, "T=0"),
        (lambda: trace(nn.LSTM(3, 4), torch.randn(5, 2, 3), torch.zeros(1, 2, 4)), TypeError,
         r"tuple \(h0, c0\)"),
        (lambda: trace(nn.LSTM(3, 4), torch.randn(5, 2, 3), (torch.zeros(1, 3, 4),
                                                              torch.zeros(1, 2, 4))),
         ValueError, r"h0 must have shape \(1, 2, 4\).*\(1, 3, 4\)"),
        (lambda: trace(nn.LSTM(3, 4), torch.randn(5, 2, 3), (torch.zeros(1, 2, 4),
                                                              torch.zeros(1, 2, 5))),
         ValueError, "c0 must have shape"),
        (lambda: trace(nn.GRU(3, 4, num_layers=2), torch.randn(5, 2, 3), torch.zeros(1, 2, 4)),
         ValueError, r"\(2, 2, 4\)"),
        (lambda: trace(nn.GRU(3, 4), torch.randn(5, 2, 3), (torch.zeros(1, 2, 4),)), TypeError,
         "Tensor h0"),
        (lambda: trace(nn.GRU(3, 4), torch.randn(5, 3), torch.zeros(1, 2, 4)), ValueError,
         r"\(1, 4\)"),
        (lambda: trace(nn.RNN(3, 4), torch.randn(5, 2, 3), torch.zeros(1, 2, 4).double()),
         TypeError, "h0 must have the module's dtype"),
    ],
)
def test_bad_input_errors(make_call, err, match):
    with pytest.raises(err, match=match):
        make_call()


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("bi", [False, True])
def test_verify_every_layer(cell, bi):
    m = cell(3, 4, num_layers=3, bidirectional=bi, batch_first=True)
    res = verify(m, x_for(m, B=3, T=6))
    assert isinstance(res, VerifyResult) and res.passed and res.tol == VERIFY_TOL
    D = 2 if bi else 1
    assert [(x.layer, x.reverse) for x in res.layers] == [
        (k, bool(d)) for k in range(3) for d in range(D)]
    assert res.max_abs_diff_h < 1e-5 and all(x.max_abs_diff_h < 1e-5 for x in res.layers)
    assert (res.max_abs_diff_c is None) == (cell is not nn.LSTM)
    d = res.to_dict()
    assert d["passed"] is True and len(d["layers"]) == 3 * D and "one_step_max_abs_diff_h" in d
    assert res.free_running_max_abs_diff_h < 1e-5 and not res.chaotic


def test_verify_catches_a_wrong_trace_in_a_middle_layer():
    m = nn.LSTM(3, 4, num_layers=3)
    x = x_for(m)
    tr = trace(m, x)
    tr["layer1.h"][0, 2, 1] += 0.01  # corrupt layer 1 only; the module never shows it
    res = verify(m, x, trace=tr)
    assert not res.passed and res.passes_one_step  # the read-out is right; this trace is not
    assert res.trace_max_abs_diff_h == pytest.approx(0.01, rel=1e-3)
    assert "not the module's trajectory" in res.explain()


def test_verify_packed_state_and_float64():
    m = nn.GRU(3, 4, num_layers=2, bidirectional=True).double()
    x = pack_padded_sequence(x_for(m, B=3, dtype=torch.float64), torch.tensor([5, 2, 4]),
                             enforce_sorted=False)
    res = verify(m, x, torch.randn(4, 3, 4, dtype=torch.float64))
    assert res.passed and res.max_abs_diff_h < 1e-12


@pytest.mark.parametrize("cell", ["lstm", "lstm_proj", "gru", "rnn_tanh", "rnn_relu"])
@pytest.mark.parametrize("bi", [False, True])
def test_anchored_method_agrees_with_step(cell, bi):
    """On a contracting model the anchored read-out and the step re-run agree."""
    kw = dict(num_layers=2, bidirectional=bi, batch_first=True)
    if cell.startswith("lstm"):
        m = nn.LSTM(3, 5, proj_size=2 if cell == "lstm_proj" else 0, **kw)
    elif cell == "gru":
        m = nn.GRU(3, 5, **kw)
    else:
        m = nn.RNN(3, 5, nonlinearity=cell[4:], **kw)
    x = x_for(m, B=3, T=8)
    D, H_out = (2 if bi else 1), (2 if cell == "lstm_proj" else 5)
    g = torch.Generator().manual_seed(4)
    h0 = torch.randn(2 * D, 3, H_out, generator=g)
    state = (h0, torch.randn(2 * D, 3, 5, generator=g)) if cell.startswith("lstm") else h0
    step, par = trace(m, x, state, method="step"), trace(m, x, state)
    assert list(step) == list(par) and par.meta["method"] == "anchored"
    assert trace(m, x, state, method="parallel").meta["method"] == "anchored"  # former name
    for name in step:
        assert step[name].shape == par[name].shape
        assert (step[name] - par[name]).abs().max() < 1e-5, name
    assert (step.h_n - par.h_n).abs().max() < 1e-5
    with pytest.raises(ValueError, match="method"):
        trace(m, x, method="fast")
