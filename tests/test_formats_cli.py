"""`gatelens analyze --weights FILE` for ONNX graphs, Keras files and sniffed state_dicts.

Each model is made here, read through the command line end to end (exit 0, report.json,
the verification passed), and its assembled model checked against the file's own runtime
(onnxruntime, Keras 3 on its torch backend).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import numpy as np
import onnx  # the onnx extra, which make installs: a missing one fails, never skips
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from safetensors.torch import save_file
from torch import nn

from gatelens.cli import main
from gatelens.errors import GatelensError
from gatelens.lens.foreign import file_kind, load_foreign
from gatelens.lens.foreign_io import sniff

CHARS = list("abcdefgh \n")
V = len(CHARS)
RNG = np.random.default_rng(1)


@pytest.fixture()
def files(tmp_path):
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps(CHARS), encoding="utf-8")
    text = tmp_path / "text.txt"
    text.write_text(("abc defg\nhab " * 40)[:400], encoding="utf-8")
    return tmp_path, vocab, text


def _analyze(weights, vocab, text, out, *extra):
    assert main(["analyze", "--weights", str(weights), "--vocab", str(vocab), "--text",
                 str(text), "--windows", "2", "--length", "40", "--perturb-pos", "8", "--out",
                 str(out), "--quiet", *extra]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["verification"]["passed"] and (out / "report.md").is_file()
    return rep


def _trained_lstm():
    torch.manual_seed(0)
    lstm, head = nn.LSTM(V, 8, batch_first=True), nn.Linear(8, V)
    opt = torch.optim.Adam([*lstm.parameters(), *head.parameters()], lr=0.05)
    ids = torch.tensor([[CHARS.index(c) for c in "abc defg\nh" * 3]])
    x = nn.functional.one_hot(ids, V).float()
    for _ in range(20):
        loss = nn.functional.cross_entropy(head(lstm(x[:, :-1])[0])[0], ids[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return lstm


def test_onnx_export_of_a_trained_lstm_also_without_extension(files, capsys):
    tmp, vocab, text = files
    lstm = _trained_lstm()
    p = tmp / "lstm.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript-based exporter's notes
        torch.onnx.export(lstm, (torch.zeros(2, 5, V),), str(p), input_names=["x"],
                          dynamo=False)
    rep = _analyze(p, vocab, text, tmp / "out")
    assert rep["model"]["cell"] == "lstm" and rep["model"]["path"] == "/LSTM"
    bare = tmp / "model"
    shutil.copy(p, bare)
    assert sniff(bare) == "onnx" and file_kind(bare) == "onnx"
    m = load_foreign(bare, vocab=vocab)
    x = torch.randn(2, 5, V)  # the exported graph's fixed shape
    want = ort.InferenceSession(str(p)).run(None, {"x": x.numpy()})[0]  # (B, T, H) batch first
    got = m.rnn(x)[0].detach().numpy()
    assert np.abs(got - want).max() < 1e-5


def _vi(name, elem=TensorProto.FLOAT, rank=3):
    return helper.make_tensor_value_info(name, elem, [None] * rank)


def _node(op, H, prefix, I=V, **attrs):
    G = {"LSTM": 4, "GRU": 3}[op] * H
    inits = [numpy_helper.from_array(RNG.uniform(-0.5, 0.5, s).astype(np.float32), prefix + n)
             for n, s in (("W", (1, G, I)), ("R", (1, G, H)), ("B", (1, 2 * G)))]
    ins = ["X", prefix + "W", prefix + "R", prefix + "B"]
    if op == "LSTM":
        inits.append(numpy_helper.from_array(RNG.uniform(-0.5, 0.5, (1, 3 * H))
                                             .astype(np.float32), prefix + "P"))
        ins += ["", "", "", prefix + "P"]
    node = helper.make_node(op, ins, [prefix + "Y"], name=prefix + op.lower(), hidden_size=H,
                            **attrs)
    return node, inits


def test_onnx_if_branches_peephole_lstm_and_gru_reset_before(files):
    tmp, vocab, text = files
    lstm, li = _node("LSTM", 6, "p_")
    gru, gi = _node("GRU", 5, "g_", linear_before_reset=0)
    then_g = helper.make_graph([lstm], "then", [], [_vi("p_Y", rank=4)], li)
    else_g = helper.make_graph([gru], "else", [], [_vi("g_Y", rank=4)], gi)
    iff = helper.make_node("If", ["cond"], ["Y"], then_branch=then_g, else_branch=else_g,
                           name="pick")
    g = helper.make_graph([iff], "g", [_vi("X"), _vi("cond", TensorProto.BOOL, 0)],
                          [_vi("Y", rank=4)])
    p = tmp / "branches.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(p))
    with pytest.raises(GatelensError, match="2 recurrent nodes .* pass --prefix"):
        load_foreign(p, vocab=vocab)
    for name, cond, cell in (("p_lstm", True, "lstm"), ("g_gru", False, "gru")):
        rep = _analyze(p, vocab, text, tmp / name, "--prefix", name)
        assert rep["model"]["cell"] == cell and rep["model"]["path"] == name
        m = load_foreign(p, vocab=vocab, prefix=name)
        x = RNG.normal(size=(7, 2, V)).astype(np.float32)  # (T, B, I): layout 0
        want = ort.InferenceSession(str(p)).run(None, {"X": x, "cond": np.array(cond)})[0]
        got = m.rnn(torch.from_numpy(x).transpose(0, 1))[0].detach().numpy()  # (B, T, H)
        assert np.abs(got - want[:, 0].transpose(1, 0, 2)).max() < 1e-5
        assert f"ONNX node '{name}' read as Variant" in (tmp / name / "report.md").read_text()


def test_torchscript_is_refused_without_loading_it(files, monkeypatch):
    tmp, vocab, _ = files
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's own deprecation notes
        scripted = torch.jit.script(nn.GRU(V, 4))
        torch.jit.save(scripted, str(tmp / "m.pt"))
    shutil.copy(tmp / "m.pt", tmp / "m")

    def never(*a, **k):
        raise AssertionError("the archive was loaded")

    monkeypatch.setattr(torch.jit, "load", never)
    monkeypatch.setattr(torch, "load", never)
    for p in (tmp / "m.pt", tmp / "m"):
        assert sniff(p) == "torchscript"
        with pytest.raises(GatelensError) as e:
            load_foreign(p, vocab=vocab)
        msg = str(e.value)
        assert "TorchScript archive" in msg and "state_dict()" in msg and "\n" not in msg


def test_state_dicts_without_extension_and_a_short_vocabulary(files):
    tmp, vocab, text = files
    torch.manual_seed(0)
    emb, gru, head = nn.Embedding(V + 2, 5), nn.GRU(5, 6, batch_first=True), nn.Linear(6, V + 2)
    sd = {"emb.weight": emb.weight.detach(), "head.weight": head.weight.detach(),
          "head.bias": head.bias.detach(),
          **{f"rnn.{k}": v for k, v in gru.state_dict().items()}}
    torch.save(sd, tmp / "torch_weights")
    save_file(sd, str(tmp / "st_weights"))
    assert sniff(tmp / "torch_weights") == "torch" and sniff(tmp / "st_weights") == "safetensors"
    ids = torch.randint(0, V, (2, 9))
    for p in (tmp / "torch_weights", tmp / "st_weights"):
        m = load_foreign(p, vocab=vocab, embed="emb.weight", head="head.")
        assert m.vocab[V:] == [f"<unused {V}>", f"<unused {V + 1}>"]
        with torch.no_grad():
            assert torch.equal(m(ids), head(gru(emb(ids))[0]))
    rep = _analyze(tmp / "st_weights", vocab, text, tmp / "out", "--embed-tensor", "emb.weight",
                   "--head", "head.")
    assert rep["output_reach"] is not None
    assert any("never occur in the text" in n for n in rep["model"]["notes"])
    assert "never occur in the text" in (tmp / "out" / "report.md").read_text()


# ---- Keras ---------------------------------------------------------------------------------

def _keras():
    os.environ["KERAS_BACKEND"] = "torch"  # before keras is imported: no TensorFlow
    import keras

    return keras


@pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
def test_keras_files_end_to_end(files):
    keras = _keras()
    L = keras.layers
    tmp, vocab, text = files
    model = keras.Sequential([keras.Input((None,), dtype="int32"),
                              L.Embedding(V + 2, 5, name="emb"),
                              L.LSTM(6, recurrent_activation="hard_sigmoid",
                                     return_sequences=True, name="enc"),
                              L.Dense(V + 2, name="out")])
    for layer in model.layers:
        layer.set_weights([RNG.uniform(-0.6, 0.6, w.shape).astype(np.float32)
                           for w in layer.get_weights()])
    model.save(tmp / "lm.keras")
    ids = RNG.integers(0, V, (2, 9))
    want = model(ids.astype(np.int32)).detach().numpy()
    m = load_foreign(tmp / "lm.keras", vocab=vocab, embed="emb", head="out")
    with torch.no_grad():
        assert np.abs(m(torch.from_numpy(ids)).numpy() - want).max() < 1e-5
    rep = _analyze(tmp / "lm.keras", vocab, text, tmp / "lm", "--embed-tensor", "emb",
                   "--head", "out")
    md = (tmp / "lm" / "report.md").read_text()
    assert "hard_sigmoid = clip(x/6 + 0.5, 0, 1) (Keras 3)" in md and "<unused 10>" in md
    assert rep["model"]["cell"] == "lstm" and rep["output_reach"] is not None
    gru = keras.Sequential([keras.Input((None, V)),
                            L.GRU(5, reset_after=False, return_sequences=True, name="g")])
    gru.save(tmp / "gru.h5")
    shutil.copy(tmp / "gru.h5", tmp / "gru_noext")
    assert file_kind(tmp / "gru_noext") == "keras"
    rep = _analyze(tmp / "gru_noext", vocab, text, tmp / "gru")
    assert rep["model"]["cell"] == "gru" and rep["model"]["path"] == "g"


def test_keras2_style_file_end_to_end(files):
    import h5py

    tmp, vocab, text = files
    H = 4
    ws = [RNG.uniform(-0.6, 0.6, s).astype(np.float32) for s in ((V, 4 * H), (H, 4 * H),
                                                                 (4 * H,))]
    with h5py.File(tmp / "k2.h5", "w") as f:
        f.attrs["keras_version"], f.attrs["backend"] = b"2.1.6", b"tensorflow"
        cfg = {"class_name": "Sequential", "config": [{"class_name": "LSTM", "config": {
            "name": "lstm_1", "units": H, "recurrent_activation": "hard_sigmoid",
            "activation": "tanh"}}]}  # Keras 2.0-2.1: a Sequential's config is its list
        f.attrs["model_config"] = json.dumps(cfg).encode()
        root = f.create_group("model_weights")
        root.attrs["layer_names"] = [b"lstm_1"]
        g = root.create_group("lstm_1")
        names = [f"lstm_1/{k}:0" for k in ("kernel", "recurrent_kernel", "bias")]
        g.attrs["weight_names"] = [n.encode() for n in names]
        for n, w in zip(names, ws, strict=True):
            g.create_dataset(n, data=w)
    rep = _analyze(tmp / "k2.h5", vocab, text, tmp / "k2")
    assert rep["model"]["path"] == "lstm_1"
    assert "clip(0.2·x + 0.5, 0, 1) (Keras 1-2), from the file's Keras version 2.1.6" in \
        (tmp / "k2" / "report.md").read_text()


@pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
def test_keras_masks_are_applied_or_refused(files, capsys):
    """A mask_zero embedding: Keras skips the steps of id 0 (state carried), which the LSTM
    alone does not; windows holding id 0 are refused, others analysed; a Masking layer (or
    the masking embedding not given) is refused at the start."""
    from gatelens.loaders.keras_file import open_keras

    keras = _keras()
    L = keras.layers
    tmp, vocab, text = files  # CHARS[0] = "a" occurs in the text
    model = keras.Sequential([keras.Input((None,), dtype="int32"),
                              L.Embedding(V, 5, mask_zero=True, name="emb"),
                              L.LSTM(6, return_sequences=True, name="enc"),
                              L.Dense(V, name="out")])
    for layer in model.layers:
        layer.set_weights([RNG.uniform(-0.6, 0.6, w.shape).astype(np.float32)
                           for w in layer.get_weights()])
    model.save(tmp / "masked.keras")
    assert open_keras(tmp / "masked.keras")["enc"].keras_layer["mask"] == {
        "layer": "emb", "how": "mask_zero"}
    ids = np.array([[3, 0, 4, 5], [3, 1, 4, 5]])
    want = model(ids.astype(np.int32)).detach().numpy()
    m = load_foreign(tmp / "masked.keras", vocab=vocab, embed="emb", head="out")
    with torch.no_grad():  # without id 0 the file's model and the read-out agree exactly
        assert np.abs(m(torch.from_numpy(ids[1:])).numpy() - want[1:]).max() < 1e-5
        m.masked_id = None  # the read-out of the LSTM alone, were id 0 not refused:
        assert np.abs(m(torch.from_numpy(ids[:1])).numpy() - want[:1]).max() > 1e-3
    args = ["analyze", "--weights", tmp / "masked.keras", "--vocab", vocab, "--windows", "2",
            "--length", "40", "--perturb-pos", "8", "--quiet"]
    for extra, says in ((["--embed-tensor", "emb", "--head", "out", "--text", text],
                         "embedding 'emb' masks id 0 ('a', mask_zero): Keras skips those"),
                        (["--text", text], "Keras layer 'emb' (mask_zero) masks the steps")):
        got = main([str(a) for a in [*args, *extra, "--out", tmp / "m"]])
        err = capsys.readouterr().err.strip().splitlines()
        assert got == 2 and len(err) == 1 and says in err[0], err
        assert not (tmp / "m").exists()
    no_a = tmp / "no_a.txt"  # the windows without id 0 still meet it where the perturbation
    no_a.write_text(("bcd efgh\nhbc " * 40)[:400], encoding="utf-8")  # draws it
    got = main([str(a) for a in [*args, "--embed-tensor", "emb", "--head", "out", "--text",
                                 no_a, "--out", tmp / "m"]])
    err = capsys.readouterr().err
    assert got == 2 and "1 positions of these windows hold it" in err, err
