"""ONNX files: open_onnx and trace_onnx against onnxruntime's own outputs (loaders/onnx_*.py).

Every model here is made by the test: a trained nn.LSTM exported with torch.onnx (the
TorchScript-based exporter: the dynamo one needs onnxscript), and graphs written with
onnx.helper (a GRU with linear_before_reset = 0, an LSTM with peepholes whose weights are
computed by Constant/Slice/Concat/Unsqueeze nodes, nodes inside If branches and a Loop).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx  # the onnx extra, which make installs: a missing one fails, never skips
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import gatelens
from gatelens.cells.variants import VariantGRU, VariantLSTM
from gatelens.errors import GatelensError
from gatelens.loaders.onnx_file import open_onnx
from gatelens.loaders.onnx_trace import trace_onnx

RNG = np.random.default_rng(0)
F32 = TensorProto.FLOAT


def _init(name: str, a: np.ndarray):
    return numpy_helper.from_array(np.asarray(a, np.float32), name)


def _save(tmp_path, nodes, inputs, outputs, inits=(), name="m.onnx", opset=17):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    p = tmp_path / name
    onnx.save(model, str(p))
    return p


def _vi(name, elem=F32, rank=None):
    """A value info of unknown dims (rank from the name: Y* 4, X/h0/c0/W 3, else 0)."""
    if rank is None:
        rank = 4 if name.split("_")[-1] == "Y" or name in ("Y", "ys", "out", "scan") else (
            3 if name[-1] in "X0hcx" or name.endswith(("Y_h", "Y_c")) else 0)
        rank = 1 if name == "lens" else rank
    return helper.make_tensor_value_info(name, elem, [None] * rank)


def _rnn_node(op, H, I, D=1, prefix="", inputs=("X",), **attrs):
    """A recurrent node with random W, R, B initializers; returns (node, initializers)."""
    G = {"LSTM": 4, "GRU": 3, "RNN": 1}[op] * H
    inits = [_init(prefix + "W", RNG.uniform(-0.6, 0.6, (D, G, I))),
             _init(prefix + "R", RNG.uniform(-0.6, 0.6, (D, G, H))),
             _init(prefix + "B", RNG.uniform(-0.4, 0.4, (D, 2 * G)))]
    ins = [inputs[0], prefix + "W", prefix + "R", prefix + "B", *inputs[1:]]
    node = helper.make_node(op, ins, [prefix + "Y", prefix + "Y_h"] + (
        [prefix + "Y_c"] if op == "LSTM" else []), name=prefix + op.lower(), hidden_size=H,
        **attrs)
    return node, inits


def _train_charlm(steps=30):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.embed, model.lstm, model.head = nn.Embedding(6, 5), nn.LSTM(5, 8, batch_first=True), \
        nn.Linear(8, 6)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    ids = torch.arange(6).repeat(4, 4)[:, :20]  # (4, 20) a cyclic text

    def forward(x):
        return model.head(model.lstm(model.embed(x))[0])

    for _ in range(steps):
        loss = nn.functional.cross_entropy(forward(ids[:, :-1]).reshape(-1, 6),
                                           ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, forward, ids


class _LM(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m.head(self.m.lstm(self.m.embed(x))[0])


def test_exported_trained_lstm_is_the_same_nn_lstm_and_traces_to_onnxruntime(tmp_path):
    model, forward, ids = _train_charlm()
    p = tmp_path / "lm.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on batch sizes and its age
        torch.onnx.export(_LM(model).eval(), (ids,), str(p), input_names=["ids"], dynamo=False)
    mods = open_onnx(p)
    (name, lstm), = mods.items()
    assert type(lstm) is nn.LSTM and lstm.hidden_size == 8 and lstm.batch_first
    for k, v in model.lstm.state_dict().items():  # i, o, f, c back to i, f, g, o: bitwise
        assert torch.equal(lstm.state_dict()[k], v), k
    traces = trace_onnx(p, {"ids": ids.numpy()})
    tr = traces[name]
    assert tr.meta["onnx_max_abs_diff_h"] < 1e-5 and tr.meta["onnx_max_scaled_diff_c"] < 1e-5
    mine = gatelens.trace(model.lstm, model.embed(ids).detach())
    for n in mine:
        assert (tr[n] - mine[n]).abs().max() < 1e-5, n


def test_gru_linear_before_reset_0_bidirectional(tmp_path):
    H, I, B, T = 5, 3, 2, 7
    node, inits = _rnn_node("GRU", H, I, D=2, inputs=("X", "", "h0"), direction="bidirectional")
    p = _save(tmp_path, [node], [_vi("X"), _vi("h0")], [_vi("Y"), _vi("Y_h")], inits)
    (gru,) = open_onnx(p).values()
    assert isinstance(gru, VariantGRU) and not gru.reset_after and gru.bidirectional
    feeds = {"X": RNG.normal(size=(T, B, I)).astype(np.float32),
             "h0": RNG.uniform(-0.5, 0.5, (2, B, H)).astype(np.float32)}
    tr = trace_onnx(p, feeds)["gru"]
    assert tr.meta["onnx_max_abs_diff_h"] < 1e-5
    assert list(tr) == gatelens.gate_names("gru", 1, bidirectional=True)
    # the same weights in nn.GRU (reset after) are a different model
    wrong = nn.GRU(I, H, batch_first=True, bidirectional=True)
    with torch.no_grad():
        for d, sfx in enumerate(("_l0", "_l0_reverse")):
            for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(wrong, n + sfx).copy_(getattr(gru, n)[d])
    x = torch.from_numpy(feeds["X"]).transpose(0, 1)  # (B, T, I)
    h0 = torch.from_numpy(feeds["h0"])
    assert (wrong(x, h0)[0][..., :H] - tr["layer0.h"]).abs().max() > 1e-3
    # the module in float64 is the same model
    y32 = gru(x, h0)[0]
    y64 = gru.double()(x.double(), h0.double())[0]
    assert (y32.double() - y64).abs().max() < 1e-5


def test_layout_1_against_the_onnx_reference_evaluator(tmp_path):
    """onnxruntime's CPU kernels refuse layout = 1; onnx's own reference runs it."""
    from onnx.reference import ReferenceEvaluator

    from gatelens.loaders.onnx_trace import trace_node

    H, I, B, T = 3, 2, 2, 5
    node, inits = _rnn_node("LSTM", H, I, inputs=("X", "", "h0", "c0"), layout=1)
    p = _save(tmp_path, [node], [_vi("X"), _vi("h0"), _vi("c0")],
              [_vi("Y"), _vi("Y_h"), _vi("Y_c")], inits)
    (lstm,) = open_onnx(p).values()
    assert type(lstm) is nn.LSTM and lstm.onnx_node["layout"] == 1
    got = {"X": RNG.normal(size=(B, T, I)).astype(np.float32),
           "initial_h": RNG.uniform(-0.5, 0.5, (B, 1, H)).astype(np.float32),
           "initial_c": RNG.uniform(-1, 1, (B, 1, H)).astype(np.float32)}
    ref = ReferenceEvaluator(str(p)).run(None, {"X": got["X"], "h0": got["initial_h"],
                                                "c0": got["initial_c"]})
    got.update(zip(("Y", "Y_h", "Y_c"), ref, strict=True))
    tr = trace_node("lstm", lstm, got, str(p))
    assert tr.meta["onnx_max_abs_diff_h"] < 1e-5 and tr.meta["onnx_max_scaled_diff_c"] < 1e-5
    got["Y"] = got["Y"] + 0.01  # a read-out that is not the node's is caught
    with pytest.raises(gatelens.errors.CheckFailed, match="differs from onnxruntime"):
        trace_node("lstm", lstm, got, str(p))
    got["Y"] = got["Y"] - 0.01
    got["Y"][-1, 0, -1, -1] = np.nan  # and a NaN difference, wherever it lies, never passes
    with pytest.raises(gatelens.errors.CheckFailed, match="by nan"):
        trace_node("lstm", lstm, got, str(p))


def _folded_peephole_lstm(tmp_path, H=4, I=3):
    """An LSTM whose W comes from Unsqueeze, B from Concat, P from Slice: all folded."""
    W = RNG.uniform(-0.6, 0.6, (4 * H, I))
    R = RNG.uniform(-0.6, 0.6, (1, 4 * H, H))
    Wb, Rb = RNG.uniform(-0.4, 0.4, (1, 4 * H)), RNG.uniform(-0.4, 0.4, (1, 4 * H))
    big = RNG.uniform(-0.8, 0.8, (1, 5 * H))
    const = lambda n, a: helper.make_node("Constant", [], [n], value=_init(n, a))  # noqa: E731
    nodes = [
        const("W2", W),
        helper.make_node("Unsqueeze", ["W2", "axi"], ["W"]),
        const("Wb", Wb), const("Rb", Rb),
        helper.make_node("Concat", ["Wb", "Rb"], ["B"], axis=1),
        const("big", big), helper.make_node("Slice", ["big", "s", "e", "a"], ["P"]),
        helper.make_node("LSTM", ["X", "W", "R", "B", "", "h0", "c0", "P"],
                         ["Y", "Y_h", "Y_c"], name="peep", hidden_size=H),
    ]
    inits = [_init("R", R), numpy_helper.from_array(np.array([0], np.int64), "axi"),
             numpy_helper.from_array(np.array([H], np.int64), "s"),
             numpy_helper.from_array(np.array([4 * H], np.int64), "e"),
             numpy_helper.from_array(np.array([1], np.int64), "a")]
    p = _save(tmp_path, nodes, [_vi("X"), _vi("h0"), _vi("c0")],
              [_vi("Y"), _vi("Y_h"), _vi("Y_c")], inits, name="peep.onnx")
    return p, big[0, H : 4 * H]


def test_peephole_lstm_with_folded_constant_weights(tmp_path):
    H, I, B, T = 4, 3, 3, 9
    p, P = _folded_peephole_lstm(tmp_path, H, I)
    (lstm,) = open_onnx(p).values()
    assert isinstance(lstm, VariantLSTM) and lstm.peephole is not None
    # P = [p_i, p_o, p_f] read into (p_i, p_f, p_o)
    want = np.concatenate([P[:H], P[2 * H :], P[H : 2 * H]])
    assert np.allclose(lstm.peephole[0].detach().numpy(), want)
    feeds = {"X": RNG.normal(size=(T, B, I)).astype(np.float32),
             "h0": RNG.uniform(-0.5, 0.5, (1, B, H)).astype(np.float32),
             "c0": RNG.uniform(-2, 2, (1, B, H)).astype(np.float32)}
    tr = trace_onnx(p, feeds)["peep"]
    assert tr.meta["onnx_max_abs_diff_h"] < 1e-5 and tr.meta["onnx_max_scaled_diff_c"] < 1e-5
    assert tr.cell == "lstm_variant" and list(tr) == [f"layer0.{s}" for s in "ifgoch"]


def test_nodes_inside_if_branches_trace_only_when_they_run(tmp_path):
    H, I = 3, 2
    lstm, li = _rnn_node("LSTM", H, I, prefix="a_")
    gru, gi = _rnn_node("GRU", H, I, prefix="b_", linear_before_reset=1)
    then_g = helper.make_graph([lstm], "then", [], [_vi("a_Y")], li)
    else_g = helper.make_graph([gru], "else", [], [_vi("b_Y")], gi)
    iff = helper.make_node("If", ["cond"], ["out"], then_branch=then_g, else_branch=else_g,
                           name="branch")
    p = _save(tmp_path, [iff], [_vi("X"), _vi("cond", TensorProto.BOOL)], [_vi("out")])
    mods = open_onnx(p)
    assert {k: type(m) for k, m in mods.items()} == {"a_lstm": nn.LSTM, "b_gru": nn.GRU}
    assert mods["a_lstm"].onnx_node["inside"] == ["If 'branch' (then_branch)"]
    x = RNG.normal(size=(6, 2, I)).astype(np.float32)
    ran = trace_onnx(p, {"X": x, "cond": np.array(True)})
    assert list(ran) == ["a_lstm"] and ran["a_lstm"].meta["onnx_max_abs_diff_h"] < 1e-5
    ran = trace_onnx(p, {"X": x, "cond": np.array(False)})
    assert list(ran) == ["b_gru"] and ran["b_gru"].meta["onnx_max_abs_diff_h"] < 1e-5


def test_reverse_only_lstm_and_bidirectional_relu_rnn(tmp_path):
    H, I = 3, 2
    lstm, li = _rnn_node("LSTM", H, I, prefix="r_", direction="reverse")
    rnn, ri = _rnn_node("RNN", H, I, D=2, prefix="n_", direction="bidirectional",
                        activations=["Relu", "Relu"])
    p = _save(tmp_path, [lstm, rnn], [_vi("X")], [_vi("r_Y"), _vi("n_Y")], li + ri)
    mods = open_onnx(p)
    assert isinstance(mods["r_lstm"], VariantLSTM) and mods["r_lstm"].directions == ("reverse",)
    assert type(mods["n_rnn"]) is nn.RNN and mods["n_rnn"].nonlinearity == "relu"
    traces = trace_onnx(p, {"X": RNG.normal(size=(5, 2, I)).astype(np.float32)})
    assert list(traces["r_lstm"]) == [f"layer0.reverse.{s}" for s in "ifgoch"]
    assert all(t.meta["onnx_max_abs_diff_h"] < 1e-5 for t in traces.values())


def test_loop_body_node_is_opened_not_traced(tmp_path):
    H, I = 2, 2
    node, inits = _rnn_node("GRU", H, I, prefix="l_", linear_before_reset=1, inputs=("X",))
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]), node,
         helper.make_node("Identity", ["l_Y"], ["scan"])], "body",
        [_vi("i", TensorProto.INT64), _vi("c_in", TensorProto.BOOL)],
        [_vi("c_out", TensorProto.BOOL), _vi("scan")], inits)
    loop = helper.make_node("Loop", ["n", "c"], ["ys"], body=body, name="loop")
    outer, oi = _rnn_node("RNN", H, I, prefix="o_")
    p = _save(tmp_path, [loop, outer], [_vi("X"), _vi("n", TensorProto.INT64),
                                        _vi("c", TensorProto.BOOL, 0)],
              [_vi("ys", rank=5), _vi("o_Y")], oi)
    assert set(open_onnx(p)) == {"l_gru", "o_rnn"}
    traces = trace_onnx(p, {"X": RNG.normal(size=(4, 1, I)).astype(np.float32),
                            "n": np.array(2), "c": np.array(True)})
    assert list(traces) == ["o_rnn"]
    assert "Loop 'loop'" in traces["o_rnn"].meta["onnx_not_traced"]["l_gru"]


@pytest.mark.parametrize("attrs, message", [
    ({"clip": 3.0}, "attribute clip = 3 is not supported"),
    ({"input_forget": 1}, "attribute input_forget = 1"),
    ({"activations": ["Sigmoid", "Relu", "Tanh"]}, "activations = ['Sigmoid', 'Relu', 'Tanh']"),
    ({"activation_alpha": [0.5]}, "attribute activation_alpha"),
    ({"frobnicate": 1}, "attribute 'frobnicate' is not one gatelens knows"),
])
def test_unsupported_attributes_are_one_line_errors(tmp_path, attrs, message):
    node = helper.make_node("LSTM", ["X", "W", "R"], ["Y"], name="enc", hidden_size=2)
    node.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())
    g = helper.make_graph([node], "g", [_vi("X")], [_vi("Y")],
                          [_init("W", np.zeros((1, 8, 2))), _init("R", np.zeros((1, 8, 2)))])
    p = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(g), str(p))  # not checked: onnx's checker refuses some too
    with pytest.raises(GatelensError) as e:
        open_onnx(p)
    assert "ONNX node 'enc' (LSTM)" in str(e.value) and message in str(e.value)
    assert "\n" not in str(e.value)


def test_refusals_reverse_rnn_weights_from_inputs_and_ragged_lengths(tmp_path):
    rnn, ri = _rnn_node("RNN", 2, 2, direction="reverse")
    p = _save(tmp_path, [rnn], [_vi("X")], [_vi("Y")], ri, name="rev.onnx")
    with pytest.raises(GatelensError, match="reverse-only RNN node is not supported"):
        open_onnx(p)
    node = helper.make_node("GRU", ["X", "Wx", "R"], ["Y"], name="g", hidden_size=2)
    p = _save(tmp_path, [node], [_vi("X"), _vi("Wx")], [_vi("Y")],
              [_init("R", np.zeros((1, 6, 2)))], name="win.onnx")
    with pytest.raises(GatelensError, match="W 'Wx' is computed from a graph input"):
        open_onnx(p)
    gru, gi = _rnn_node("GRU", 2, 2, inputs=("X", "lens"), linear_before_reset=1)
    p = _save(tmp_path, [gru], [_vi("X"), _vi("lens", TensorProto.INT32)], [_vi("Y")], gi,
              name="lens.onnx")
    x = RNG.normal(size=(4, 2, 2)).astype(np.float32)
    with pytest.raises(GatelensError, match=r"sequence_lens \[4, 2\] for 4 steps"):
        trace_onnx(p, {"X": x, "lens": np.array([4, 2], np.int32)})
    assert list(trace_onnx(p, {"X": x, "lens": np.array([4, 4], np.int32)})) == ["gru"]
    with pytest.raises(GatelensError, match="onnxruntime could not run"):
        trace_onnx(p, {"nope": x})
    (tmp_path / "junk.onnx").write_bytes(b"\x01\x02junk")
    with pytest.raises(GatelensError, match="not a readable ONNX file"):
        open_onnx(tmp_path / "junk.onnx")


def test_a_constant_sequence_lens_is_refused(tmp_path):
    """onnxruntime runs each sequence only sequence_lens steps (zeros after): a module of
    the node reading whole windows was analysed and "passed" on steps the runtime never
    runs. A sequence_lens a graph input gives stays the caller's (trace_onnx checks it)."""
    import onnxruntime

    lstm, li = _rnn_node("LSTM", 3, 2, inputs=("X", "slen"))
    slen = numpy_helper.from_array(np.array([2, 2], np.int32), "slen")
    p = _save(tmp_path, [lstm], [_vi("X")], [_vi("Y")], li + [slen], name="const.onnx")
    x = RNG.normal(size=(6, 2, 2)).astype(np.float32)  # (T, B, I)
    (y,) = onnxruntime.InferenceSession(str(p)).run(["Y"], {"X": x})
    assert np.abs(y[:2]).max() > 0.01 and np.abs(y[2:]).max() == 0  # what the runtime does
    with pytest.raises(GatelensError, match=r"ONNX node 'lstm': sequence_lens is the "
                                            r"constant \[2, 2\]: onnxruntime runs each"):
        open_onnx(p)
