"""Keras 2 files in the layouts Keras 2 itself wrote, made here with h5py from chosen weights.

Two real files fail on open_keras's Keras 3-tested reader (issue 26): textgenrnn's shipped
``textgenrnn_weights.hdf5`` (``save_weights`` of Keras 2: no model_config; layers input,
embedding, rnn_1 and rnn_2 (CuDNNLSTM, return_sequences), rnn_concat, attention, output) and
shakkala's ``simple_model.h5`` (``model.save`` of Keras 2.0.8 with a GRU, in a Bidirectional).
The builders below write those layouts: root attributes ``keras_version`` and ``backend``,
``layer_names`` (also split into ``layer_names0``, ``layer_names1`` as Keras does past 64 KB),
one group per layer with its ``weight_names`` (``rnn_1/kernel:0``; a Bidirectional's as
``forward_gru_1`` path components, as TensorFlow's uniquified ``kernel_1:0``, or as
``param_N``). The opened modules are checked against float64 re-computations, written
here from the raw arrays (no Keras involved), of the CuDNN LSTM (each gate block read as
cuDNN reads the buffer Keras hands it) and of Keras 2.0's GRU (reset gate before the
recurrent matmul, hard_sigmoid = clip(0.2·x + 0.5, 0, 1)).
"""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import gatelens
from gatelens.cells.variants import VariantGRU
from gatelens.cli import main
from gatelens.errors import GatelensError
from gatelens.loaders.keras_file import open_keras

RNG = np.random.default_rng(7)
V, E, H, T, B = 10, 5, 4, 7, 2


def _arr(*shape):
    return RNG.uniform(-0.7, 0.7, shape).astype(np.float32)


def _sig(z):
    return 1 / (1 + np.exp(-z))


def cudnn_lstm(x, k, r, b):
    """Keras 2's CuDNNLSTM as cuDNN computes it, float64: each gate's (I, H) kernel block and
    (H, H) recurrent block reach cuDNN flattened row-major as its (H, I) and (H, H) matrices
    W, R (``_canonical_to_params``); gates i, f, c, o; g = W x + R h + b_W + b_R."""
    x, k, r, b = (np.asarray(a, np.float64) for a in (x, k, r, b))
    n, n_in = r.shape[0], k.shape[0]
    W = [k[:, g * n : (g + 1) * n].reshape(-1).reshape(n, n_in) for g in range(4)]
    R = [r[:, g * n : (g + 1) * n].reshape(-1).reshape(n, n) for g in range(4)]
    h, c, out = np.zeros((x.shape[0], n)), np.zeros((x.shape[0], n)), {"h": [], "c": []}
    for t in range(x.shape[1]):
        z = [x[:, t] @ W[g].T + h @ R[g].T + b[g * n : (g + 1) * n]
             + b[(4 + g) * n : (5 + g) * n] for g in range(4)]
        i, f, gg, o = _sig(z[0]), _sig(z[1]), np.tanh(z[2]), _sig(z[3])
        c = f * c + i * gg
        h = o * np.tanh(c)
        out["h"].append(h)
        out["c"].append(c)
    return {key: np.stack(v, 1) for key, v in out.items()}


def keras20_gru(x, k, r, b):
    """Keras 2.0's GRU (gates z, r, h; r applied to h before the recurrent matmul;
    hard_sigmoid = clip(0.2·x + 0.5, 0, 1)), float64, (B, T, H)."""
    x, k, r, b = (np.asarray(a, np.float64) for a in (x, k, r, b))
    n = r.shape[0]

    def hs(v):
        return np.clip(0.2 * v + 0.5, 0, 1)

    h, out = np.zeros((x.shape[0], n)), []
    for t in range(x.shape[1]):
        xw = x[:, t] @ k + b
        z = hs(xw[:, :n] + h @ r[:, :n])
        rr = hs(xw[:, n : 2 * n] + h @ r[:, n : 2 * n])
        hh = np.tanh(xw[:, 2 * n :] + (rr * h) @ r[:, 2 * n :])
        h = z * h + (1 - z) * hh
        out.append(h)
    return np.stack(out, 1)


def _group(root, layer, named):
    """One Keras 2 layer group: ``weight_names`` as Keras wrote it, then the datasets."""
    g = root.create_group(layer)
    g.attrs["weight_names"] = np.array([n.encode() for n, _ in named], dtype="S")
    for n, a in named:
        g.create_dataset(n, data=a)


def write_textgenrnn(path, rnn1, rnn2, drop=None, split=False):
    """textgenrnn_weights.hdf5's layout: model.save_weights of Keras 2, CuDNNLSTM layers."""
    names = ["input", "embedding", "rnn_1", "rnn_2", "rnn_concat", "attention", "output"]
    with h5py.File(path, "w") as f:
        f.attrs["backend"], f.attrs["keras_version"] = b"tensorflow", b"2.1.5"
        enc = np.array([n.encode() for n in names], dtype="S")
        if split:  # Keras' save_attributes_to_hdf5_group past HDF5's header limit
            f.attrs["layer_names0"], f.attrs["layer_names1"] = enc[:3], enc[3:]
        else:
            f.attrs["layer_names"] = enc
        _group(f, "input", [])
        _group(f, "embedding", [("embedding/embeddings:0", _arr(V, E))])
        for name, ws in (("rnn_1", rnn1), ("rnn_2", rnn2)):
            named = [(f"{name}/{k}:0", w) for k, w in zip(
                ("kernel", "recurrent_kernel", "bias"), ws, strict=True) if k != drop]
            _group(f, name, named)
        _group(f, "rnn_concat", [])
        _group(f, "attention", [("attention/attention_W:0", _arr(E + 2 * H, 1))])
        _group(f, "output", [("output/kernel:0", _arr(E + 2 * H, V)),
                             ("output/bias:0", _arr(V))])


def _gru_cfg(name, units):
    return {"name": name, "trainable": True, "return_sequences": True, "return_state": False,
            "go_backwards": False, "stateful": False, "unroll": False, "implementation": 0,
            "units": units, "activation": "tanh", "recurrent_activation": "hard_sigmoid",
            "use_bias": True, "dropout": 0.0, "recurrent_dropout": 0.0}


def write_shakkala(path, fw, bw, gru2, naming="scoped"):
    """simple_model.h5's layout: model.save of Keras 2.0.8 (a functional Model: Embedding,
    Bidirectional(GRU), GRU, TimeDistributed(Dense)); the Bidirectional's weights named by
    ``naming``: "scoped" (forward_gru_1/…), "unique" (kernel_1:0) or "param" (param_N)."""
    layers = [
        {"name": "input_1", "class_name": "InputLayer", "config": {"name": "input_1"}},
        {"name": "embedding_1", "class_name": "Embedding",
         "config": {"name": "embedding_1", "input_dim": V, "output_dim": E,
                    "mask_zero": False}},
        {"name": "bidirectional_1", "class_name": "Bidirectional",
         "config": {"name": "bidirectional_1", "merge_mode": "concat",
                    "layer": {"class_name": "GRU", "config": _gru_cfg("gru_1", H)}}},
        {"name": "gru_2", "class_name": "GRU", "config": _gru_cfg("gru_2", H)},
        {"name": "time_distributed_1", "class_name": "TimeDistributed",
         "config": {"name": "time_distributed_1", "layer": {
             "class_name": "Dense", "config": {"name": "dense_1", "units": V}}}}]
    cfg = {"class_name": "Model", "config": {"name": "model_1", "layers": layers,
                                             "input_layers": [["input_1", 0, 0]],
                                             "output_layers": [["time_distributed_1", 0, 0]]}}
    kinds = ("kernel", "recurrent_kernel", "bias")
    with h5py.File(path, "w") as f:
        f.attrs["keras_version"], f.attrs["backend"] = b"2.0.8", b"tensorflow"
        f.attrs["model_config"] = json.dumps(cfg).encode()
        f.attrs["training_config"] = b"{}"
        root = f.create_group("model_weights")
        root.attrs["keras_version"], root.attrs["backend"] = b"2.0.8", b"tensorflow"
        root.attrs["layer_names"] = np.array([c["name"].encode() for c in layers], dtype="S")
        _group(root, "input_1", [])
        _group(root, "embedding_1", [("embedding_1/embeddings:0", _arr(V, E))])
        if naming == "scoped":
            bi = [f"bidirectional_1/{d}_gru_1/{k}:0" for d in ("forward", "backward")
                  for k in kinds]
        elif naming == "unique":
            bi = [f"bidirectional_1/{k}{s}:0" for s in ("", "_1") for k in kinds]
        else:
            bi = [f"param_{i}" for i in range(6)]
        _group(root, "bidirectional_1", list(zip(bi, [*fw, *bw], strict=True)))
        _group(root, "gru_2", [(f"gru_2/{k}:0", w) for k, w in zip(kinds, gru2, strict=True)])
        _group(root, "time_distributed_1", [("time_distributed_1/kernel:0", _arr(H, V)),
                                            ("time_distributed_1/bias:0", _arr(V))])


def _lstm_weights(n_in):
    return _arr(n_in, 4 * H), _arr(H, 4 * H), _arr(8 * H)


def _gru_weights(n_in):
    return _arr(n_in, 3 * H), _arr(H, 3 * H), _arr(3 * H)


def _off(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max())


def test_textgenrnn_weights_only_cudnn_lstms(tmp_path):
    rnn1, rnn2 = _lstm_weights(E), _lstm_weights(H)
    for split in (False, True):
        path = tmp_path / f"textgenrnn_weights{int(split)}.hdf5"
        write_textgenrnn(path, rnn1, rnn2, split=split)
        mods = open_keras(path)
        assert sorted(mods) == ["rnn_1", "rnn_2"]  # embedding, attention, output left alone
        x = RNG.normal(size=(B, T, E)).astype(np.float32)
        want1 = cudnn_lstm(x, *rnn1)
        want2 = cudnn_lstm(want1["h"], *rnn2)
        for name, inp, want in (("rnn_1", x, want1), ("rnn_2", want1["h"], want2)):
            m = mods[name]
            assert type(m) is nn.LSTM and m.keras_layer["class"] == "CuDNNLSTM"
            tr = gatelens.trace(m, torch.from_numpy(inp.astype(np.float32)))
            assert _off(tr["layer0.h"].detach(), want["h"]) < 1e-5
            assert _off(tr["layer0.c"].detach(), want["c"]) < 1e-5
            assert _off(m(torch.from_numpy(inp.astype(np.float32)))[0].detach(),
                        want["h"]) < 1e-5
            said = m.keras_layer["inferred"]
            assert said.startswith(f"weights-only file (no model_config): layer {name!r} read "
                                   "by its group name as CuDNNLSTM")
            assert "attention (no recurrent kernel: attention_W)" in said
            assert "output (no recurrent kernel: bias, kernel)" in said
            assert set(m.keras_layer["left_alone"]) == {"embedding", "attention", "output"}


@pytest.mark.parametrize("naming", ["scoped", "unique", "param"])
def test_shakkala_keras208_bidirectional_gru(tmp_path, naming):
    fw, bw, gru2 = _gru_weights(E), _gru_weights(E), _gru_weights(2 * H)
    path = tmp_path / "simple_model.h5"
    write_shakkala(path, fw, bw, gru2, naming)
    mods = open_keras(path)
    assert sorted(mods) == ["bidirectional_1", "gru_2"]  # TimeDistributed(Dense) left alone
    x = RNG.normal(size=(B, T, E)).astype(np.float32)
    want_bi = np.concatenate([keras20_gru(x, *fw), keras20_gru(x[:, ::-1], *bw)[:, ::-1]], -1)
    want2 = keras20_gru(want_bi, *gru2)
    bi, g2 = mods["bidirectional_1"], mods["gru_2"]
    for m in (bi, g2):
        assert isinstance(m, VariantGRU) and not m.reset_after
        assert m.recurrent_activation == "hard_sigmoid_v2" and m.keras_layer["inferred"] is None
        assert m.keras_layer["keras_version"] == "2.0.8"
    assert bi.keras_layer["left_alone"] == {"embedding_1": "Embedding: embeddings",
                                            "time_distributed_1": "TimeDistributed: bias, kernel"}
    tr = gatelens.trace(bi, torch.from_numpy(x))
    got = torch.cat([tr["layer0.h"], tr["layer0.reverse.h"]], -1).detach()
    assert _off(got, want_bi) < 1e-5
    assert _off(bi(torch.from_numpy(x))[0].detach(), want_bi) < 1e-5
    inp = torch.from_numpy(want_bi.astype(np.float32))
    assert _off(gatelens.trace(g2, inp)["layer0.h"].detach(), want2) < 1e-5
    assert _off(g2(inp)[0].detach(), want2) < 1e-5


def test_missing_and_misshapen_weights_fail_in_one_line(tmp_path):
    rnn1, rnn2 = _lstm_weights(E), _lstm_weights(H)
    write_textgenrnn(tmp_path / "nok.hdf5", rnn1, rnn2, drop="kernel")
    with pytest.raises(GatelensError, match=r"layer 'rnn_1' \(recurrent layer\): no weight "
                                            r"'kernel' among its weights rnn_1/recurrent"):
        open_keras(tmp_path / "nok.hdf5")
    write_textgenrnn(tmp_path / "nor.hdf5", rnn1, rnn2, drop="recurrent_kernel")
    with pytest.raises(GatelensError, match=r"layer 'rnn_1': kernel \(5, 16\) and bias \(32,\) "
                                            r"are a CuDNN layer's but there is no weight "
                                            r"'recurrent_kernel'"):
        open_keras(tmp_path / "nor.hdf5")
    fw, bw, gru2 = _gru_weights(E), _gru_weights(E), _gru_weights(2 * H)
    write_shakkala(tmp_path / "nob.h5", fw, bw, gru2)
    with h5py.File(tmp_path / "nob.h5", "a") as f:  # named in weight_names, not in the group
        del f["model_weights/gru_2/gru_2/bias:0"]
    with pytest.raises(GatelensError, match="'gru_2': weight 'gru_2/bias:0' is in weight_names "
                                            "but not in the file"):
        open_keras(tmp_path / "nob.h5")
    write_shakkala(tmp_path / "nor.h5", fw, bw, gru2)
    with h5py.File(tmp_path / "nor.h5", "a") as f:  # no recurrent kernel at all
        g = f["model_weights/gru_2"]
        del g["gru_2/recurrent_kernel:0"]
        g.attrs["weight_names"] = [b"gru_2/kernel:0", b"gru_2/bias:0"]
    with pytest.raises(GatelensError, match=r"layer 'gru_2' \(GRU\): no weight "
                                            r"'recurrent_kernel' among its weights "
                                            r"gru_2/kernel:0, gru_2/bias:0$"):
        open_keras(tmp_path / "nor.h5")
    write_shakkala(tmp_path / "shape.h5", fw, bw, (_arr(2 * H, 3 * H + 1), *gru2[1:]))
    with pytest.raises(GatelensError, match=r"layer 'gru_2' \(forward\): kernel \(8, 13\) and "
                                            r"recurrent kernel \(4, 12\) do not fit"):
        open_keras(tmp_path / "shape.h5")
    write_shakkala(tmp_path / "k1.h5", fw, bw, gru2)
    with h5py.File(tmp_path / "k1.h5", "a") as f:  # Keras 1: 9 arrays, W_z, U_z, b_z, …
        g = f["model_weights/gru_2"]
        for n in list(g.attrs["weight_names"]):
            del g[n.decode()]
        k1 = [f"gru_2_{m}_{gate}" for gate in "zrh" for m in "WUb"]
        for n in k1:
            g.create_dataset(n, data=_arr(H))
        g.attrs["weight_names"] = [n.encode() for n in k1]
    with pytest.raises(GatelensError, match=r"layer 'gru_2' \(GRU\) holds 9 arrays per "
                                            r"direction, Keras 1's layout"):
        open_keras(tmp_path / "k1.h5")
    write_shakkala(tmp_path / "cfg.h5", fw, bw, gru2)
    with h5py.File(tmp_path / "cfg.h5", "a") as f:  # gru_2's config renamed away
        f.attrs["model_config"] = str(f.attrs["model_config"]).replace('"gru_2"', '"gru_9"')
    with pytest.raises(GatelensError, match="weights of 'gru_2' .* have no layer of that name"):
        open_keras(tmp_path / "cfg.h5")
    write_shakkala(tmp_path / "bias.h5", fw, bw, (*gru2[:2], _arr(2 * H)))
    with pytest.raises(GatelensError, match=r"layer 'gru_2': bias of shape \(8,\)"):
        open_keras(tmp_path / "bias.h5")


def test_cli_opens_the_weights_only_file_and_refuses_a_broken_one(tmp_path, capsys):
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps(list("abcdefgh \n")), encoding="utf-8")
    text = tmp_path / "text.txt"
    text.write_text(("abc defg\nhab " * 40)[:400], encoding="utf-8")
    write_textgenrnn(tmp_path / "w.hdf5", _lstm_weights(E), _lstm_weights(H))
    args = ["analyze", "--vocab", str(vocab), "--text", str(text), "--windows", "1",
            "--length", "16", "--perturb-pos", "4", "--quiet", "--prefix", "rnn_1",
            "--embed-tensor", "embedding"]
    assert main([*args, "--weights", str(tmp_path / "w.hdf5"), "--out",
                 str(tmp_path / "out")]) == 0
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["verification"]["passed"] and rep["model"]["path"] == "rnn_1"
    md = (tmp_path / "out" / "report.md").read_text()
    assert "read by its group name as CuDNNLSTM" in md
    assert "no mask applied (an Embedding's mask_zero or a Masking layer is not in" in md
    write_textgenrnn(tmp_path / "bad.hdf5", _lstm_weights(E), _lstm_weights(H),
                     drop="recurrent_kernel")
    capsys.readouterr()
    assert main([*args, "--weights", str(tmp_path / "bad.hdf5"), "--out",
                 str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no weight 'recurrent_kernel'" in err
