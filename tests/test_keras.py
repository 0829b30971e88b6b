"""Keras files: open_keras's modules and their read-out against Keras 3 itself (torch backend).

Every file is written by the test: Keras 3 models saved as .keras and .h5 at every
recurrent activation of Keras' set (LSTM, GRU with reset_after True and False), a
Bidirectional, a nested model and weights-only files; a Keras 2-style hard-sigmoid LSTM
and CuDNN layers written with h5py in Keras 2's layout, checked against Keras 3 running
the same weights with Keras 2's definitions.
"""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
import torch
from torch import nn

import gatelens
from gatelens.cells.variants import ACTIVATIONS, VariantGRU, VariantLSTM
from gatelens.errors import GatelensError

os.environ["KERAS_BACKEND"] = "torch"  # before keras is imported, so no TensorFlow is needed
import h5py  # noqa: E402  (the keras extra; keras itself from the test extra)
import keras  # noqa: E402

from gatelens.loaders.keras_file import open_keras  # noqa: E402

L = keras.layers
# Keras 3's torch backend converts tensors to numpy in a way numpy 2 warns about: its own
# business (weights and outputs are still exact), not gatelens's
pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
RNG = np.random.default_rng(0)
T, F = 6, 3
KERAS_SET = sorted(set(ACTIVATIONS) - {"hard_sigmoid_v2"})


def _np(t):
    """A Keras (torch backend) output as numpy (keras.ops.convert_to_numpy warns on numpy 2)."""
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


def _randomise(model, scale=0.6, rng=None):
    rng = RNG if rng is None else rng
    for layer in model.layers:
        ws = layer.get_weights()
        if ws:
            layer.set_weights([rng.uniform(-scale, scale, w.shape).astype(w.dtype) for w in ws])


def _off(got, want):
    """max |got − want| / max(1, |want|): absolute where |want| <= 1 (verification's rule for
    an unbounded state, which a relu or exponential activation makes h)."""
    return float((np.abs(got - want) / np.maximum(1.0, np.abs(want))).max())


def _readout(module, x, state=None):
    """The read-out of a module: gatelens.trace, through the module's family."""
    return gatelens.trace(module, x, state)


def _h(tr):
    names = [n for n in ("layer0.h", "layer0.reverse.h") if n in tr]
    return torch.cat([tr[n] for n in names], dim=-1).detach().numpy()  # (B, T, D·H)


def _three(rec, act="tanh", rng=None):
    inp = keras.Input((T, F))
    out = [*L.LSTM(4, recurrent_activation=rec, activation=act, return_sequences=True,
                   return_state=True, name="lstm")(inp),
           L.GRU(3, recurrent_activation=rec, activation=act, return_sequences=True,
                 reset_after=True, name="gru_after")(inp),
           L.GRU(3, recurrent_activation=rec, activation=act, return_sequences=True,
                 reset_after=False, name="gru_before")(inp)]
    model = keras.Model(inp, out)
    # e^z gates grow c fast; selu's are unbounded too, and at 0.6 a rare draw amplified
    # float32 rounding past 1e-5 within 6 steps (2.97e-05: the two implementations' own
    # rounding, not an error; 3.6e-07 at most over 12 draws at 0.4)
    _randomise(model, {"exponential": 0.25, "selu": 0.4}.get(rec, 0.6), rng)
    return model


def test_activations_are_keras_own():
    x = np.linspace(-7, 7, 1001).astype(np.float32)
    for name in KERAS_SET:
        want = _np(keras.activations.get(name)(torch.from_numpy(x)))
        got = ACTIVATIONS[name](torch.from_numpy(x)).numpy()
        assert np.abs(got - want).max() < 1e-6, name
    k2 = ACTIVATIONS["hard_sigmoid_v2"](torch.tensor([-3.0, -1.0, 0.0, 1.0, 3.0]))
    assert k2.tolist() == pytest.approx([0.0, 0.3, 0.5, 0.7, 1.0])


@pytest.mark.parametrize("rec", KERAS_SET)
def test_every_recurrent_activation_both_reset_after_h5_and_keras(tmp_path, rec):
    act = {"relu": "softsign", "elu": "relu"}.get(rec, "tanh")  # other activations too
    # each case its own draw, whatever ran before it in this worker (pytest-xdist's order)
    rng = np.random.default_rng(zlib.crc32(rec.encode()))
    model = _three(rec, act, rng)
    x = rng.normal(size=(2, T, F)).astype(np.float32)
    y, h_n, c_n, g_after, g_before = (_np(t) for t in model(x))
    for ext in ("keras", "h5"):
        path = tmp_path / f"m.{ext}"
        model.save(path)
        mods = open_keras(path)
        assert sorted(mods) == ["gru_after", "gru_before", "lstm"]
        exact = rec == "sigmoid" and act == "tanh"
        assert (type(mods["lstm"]) is nn.LSTM) == exact
        assert (type(mods["gru_after"]) is nn.GRU) == exact
        assert isinstance(mods["gru_before"], VariantGRU)
        xt = torch.from_numpy(x)
        tr = _readout(mods["lstm"], xt)
        assert np.isfinite(y).all() and _off(_h(tr), y) < 1e-5, (ext, rec)
        assert _off(tr.h_n[0].numpy(), h_n) < 1e-5 and _off(tr.c_n[0].numpy(), c_n) < 1e-5
        for key, want in (("gru_after", g_after), ("gru_before", g_before)):
            assert _off(_h(_readout(mods[key], xt)), want) < 1e-5, (ext, rec, key)
        alias = {"swish": "silu", "hard_swish": "hard_silu"}.get(rec, rec)  # Keras saves these
        assert mods["lstm"].keras_layer["recurrent_activation"] == alias


def test_bidirectional_and_nested_model(tmp_path):
    inp = keras.Input((T, F))
    mid = L.Bidirectional(L.LSTM(4, return_sequences=True, recurrent_activation="hard_sigmoid"),
                          name="bi")(inp)
    sub = keras.Sequential([keras.Input((T, 8)), L.GRU(3, return_sequences=True, name="inner")],
                           name="sub")
    out = L.Bidirectional(L.GRU(2, return_sequences=True), name="bigru")(inp)
    model = keras.Model(inp, [mid, sub(mid), out])
    _randomise(model)
    for layer in sub.layers:
        layer.set_weights([RNG.uniform(-0.6, 0.6, w.shape).astype(w.dtype)
                           for w in layer.get_weights()])
    x = RNG.normal(size=(2, T, F)).astype(np.float32)
    y_bi, y_inner, y_gru = (_np(t) for t in model(x))
    for ext in ("keras", "h5"):
        model.save(tmp_path / f"b.{ext}")
        mods = open_keras(tmp_path / f"b.{ext}")
        assert sorted(mods) == ["bi", "bigru", "inner"]
        bi = mods["bi"]
        assert isinstance(bi, VariantLSTM) and bi.directions == ("forward", "reverse")
        tr = _readout(bi, torch.from_numpy(x))
        assert [n for n in tr if n.endswith(".f")] == ["layer0.f", "layer0.reverse.f"]
        assert np.abs(_h(tr) - y_bi).max() < 1e-5
        assert bi.keras_layer["definition"] == "clip(x/6 + 0.5, 0, 1) (Keras 3)"
        assert type(mods["bigru"]) is nn.GRU and mods["bigru"].bidirectional
        assert np.abs(_h(_readout(mods["bigru"], torch.from_numpy(x))) - y_gru).max() < 1e-5
        inner = _readout(mods["inner"], torch.from_numpy(y_bi))
        assert np.abs(_h(inner) - y_inner).max() < 1e-5


def _keras2_h5(path, layers, weights, cls="LSTM", version="2.2.4", config=True):
    """A Keras 2 file written with h5py: root attrs, model_config, layer_names/weight_names."""
    with h5py.File(path, "w") as f:
        f.attrs["keras_version"], f.attrs["backend"] = version.encode(), b"tensorflow"
        root = f
        if config:
            cfg = {"class_name": "Sequential", "config": {"name": "sequential_1", "layers": [
                {"class_name": cls, "config": c} for c in layers]}}
            f.attrs["model_config"] = json.dumps(cfg).encode()
            root = f.create_group("model_weights")
            root.attrs["keras_version"] = version.encode()
        root.attrs["layer_names"] = [c["name"].encode() for c in layers]
        for c, ws in zip(layers, weights, strict=True):
            g = root.create_group(c["name"])
            names = [f"{c['name']}/{k}:0" for k in ("kernel", "recurrent_kernel", "bias")]
            g.attrs["weight_names"] = [n.encode() for n in names]
            for n, w in zip(names, ws, strict=True):
                g.create_dataset(n, data=w)


def _keras3_lstm(rec, units=4, **kw):
    m = keras.Sequential([keras.Input((T, F)), L.LSTM(units, return_sequences=True,
                                                      recurrent_activation=rec, **kw)])
    _randomise(m)
    return m


def test_keras2_hard_sigmoid_lstm_written_with_h5py(tmp_path):
    ref = _keras3_lstm(lambda x: keras.ops.clip(0.2 * x + 0.5, 0.0, 1.0))  # Keras 2's definition
    x = RNG.normal(size=(2, T, F)).astype(np.float32) * 3  # wide enough to reach the clip
    want = _np(ref(x))
    weights = ref.layers[0].get_weights()
    cfg = {"name": "lstm_1", "units": 4, "activation": "tanh",
           "recurrent_activation": "hard_sigmoid", "use_bias": True, "implementation": 1}
    _keras2_h5(tmp_path / "k2.h5", [cfg], [weights])
    m = open_keras(tmp_path / "k2.h5")["lstm_1"]
    assert isinstance(m, VariantLSTM) and m.recurrent_activation == "hard_sigmoid_v2"
    assert m.keras_layer["definition"] == "clip(0.2·x + 0.5, 0, 1) (Keras 1-2)"
    assert np.abs(_h(_readout(m, torch.from_numpy(x))) - want).max() < 1e-5
    # the same file claiming Keras 3 reads hard_sigmoid as x/6 + 1/2: a different model
    _keras2_h5(tmp_path / "k3.h5", [cfg], [weights], version="3.0.0")
    m3 = open_keras(tmp_path / "k3.h5")["lstm_1"]
    assert np.abs(_h(_readout(m3, torch.from_numpy(x))) - want).max() > 1e-3


def _to_cudnn(k, r, gates):
    """A Keras LSTM's/GRU's kernels in a CuDNN layer's layout: Keras 2's own conversion
    (``preprocess_weights_for_loading``, to CuDNN): per gate ``k.T.reshape(k.shape)``, ``r.T``."""
    n = r.shape[0]
    blocks = [(k[:, g * n : (g + 1) * n], r[:, g * n : (g + 1) * n]) for g in range(gates)]
    return (np.concatenate([a.T.reshape(a.shape) for a, _ in blocks], 1),
            np.concatenate([c.T for _, c in blocks], 1), None)


def test_cudnn_layouts_and_weights_only_files(tmp_path):
    x = RNG.normal(size=(2, T, F)).astype(np.float32)
    lstm, gru = _keras3_lstm("sigmoid"), keras.Sequential(
        [keras.Input((T, F)), L.GRU(3, return_sequences=True, reset_after=True)])
    _randomise(gru)
    want_lstm, want_gru = _np(lstm(x)), _np(gru(x))
    k, r, b = _to_cudnn(*lstm.layers[0].get_weights()[:2], 4)
    b = lstm.layers[0].get_weights()[2]
    half = RNG.uniform(-1, 1, b.shape).astype(np.float32)  # two halves that add up to b
    gk, gr, gb = gru.layers[0].get_weights()  # gb (2, 3H): input and recurrent halves
    gk, gr = _to_cudnn(gk, gr, 3)[:2]
    for config in (True, False):
        path = tmp_path / f"cudnn{int(config)}.h5"
        _keras2_h5(path, [{"name": "cu"}], [(k, r, np.concatenate([half, b - half]))],
                   cls="CuDNNLSTM", config=config)
        m = open_keras(path)["cu"]
        assert type(m) is nn.LSTM and m.keras_layer["class"] == "CuDNNLSTM"
        assert np.abs(_h(_readout(m, torch.from_numpy(x))) - want_lstm).max() < 1e-5
        path = tmp_path / f"cugru{int(config)}.h5"
        _keras2_h5(path, [{"name": "cg"}], [(gk, gr, gb.reshape(-1))], cls="CuDNNGRU",
                   config=config)
        m = open_keras(path)["cg"]
        assert type(m) is nn.GRU
        assert np.abs(_h(_readout(m, torch.from_numpy(x))) - want_gru).max() < 1e-5
    lstm.save_weights(tmp_path / "w.weights.h5")  # Keras 3 weights only: bias 4H
    with pytest.raises(GatelensError, match="recurrent activation cannot be known"):
        open_keras(tmp_path / "w.weights.h5")
    (m,) = open_keras(tmp_path / "w.weights.h5", recurrent_activation="sigmoid").values()
    assert np.abs(_h(_readout(m, torch.from_numpy(x))) - want_lstm).max() < 1e-5


def test_refusals(tmp_path):
    m = keras.Sequential([keras.Input((T, F)), L.LSTM(2, go_backwards=True, name="back")])
    m.save(tmp_path / "back.keras")
    with pytest.raises(GatelensError, match="'back' has go_backwards=True"):
        open_keras(tmp_path / "back.keras")
    m = keras.Sequential([keras.Input((T, F)), L.GRU(2, recurrent_activation="softmax",
                                                     name="sm")])
    m.save(tmp_path / "sm.keras")
    with pytest.raises(GatelensError, match="recurrent_activation 'softmax' is not an "):
        open_keras(tmp_path / "sm.keras")
    m = keras.Sequential([keras.Input((T, F)), L.Dense(2)])
    m.save(tmp_path / "dense.keras")
    with pytest.raises(GatelensError, match="no LSTM or GRU layer"):
        open_keras(tmp_path / "dense.keras")
    (tmp_path / "x.h5").write_bytes(b"not hdf5")
    with pytest.raises(GatelensError, match="not a readable Keras file"):
        open_keras(tmp_path / "x.h5")
