"""Weights gatelens did not train: load_foreign against the user's own modules, bit for bit,
and one exact one-line GatelensError for every kind of bad file."""

from __future__ import annotations

import argparse
import json
import pickle
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from gatelens.errors import GatelensError
from gatelens.lens.analyze_cli import add_analyze_arguments
from gatelens.lens.foreign import (
    ForeignModel,
    add_foreign_arguments,
    foreign_from_args,
    load_foreign,
)
from gatelens.lens.foreign_io import PICKLED, read_tensors, read_vocab
from gatelens.readout.verify import verify

CHARS = list("\n abcdefgh")
V = len(CHARS)
PROJ_WARNING = "ignore:LSTM with projections is not supported with oneDNN"


class EmbedLSTM(nn.Module):
    """A user's model: embedding, 2-layer LSTM, Linear head, names gatelens never chose."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 6)
        self.lstm = nn.LSTM(6, 8, num_layers=2, batch_first=True)
        self.out = nn.Linear(8, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.lstm(self.emb(ids))[0])  # (B, T, V)


class OneHot(nn.Module):
    """One-hot input into any recurrent module, with or without a head."""

    def __init__(self, rnn: nn.RNNBase, head: bool = True) -> None:
        super().__init__()
        self.rnn = rnn
        width = (1 + rnn.bidirectional) * (getattr(rnn, "proj_size", 0) or rnn.hidden_size)
        self.head = nn.Linear(width, V) if head else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.one_hot(ids, V).to(self.rnn.weight_ih_l0.dtype)  # (B, T, V)
        out = self.rnn(x)[0]  # (B, T, D*H)
        return out if self.head is None else self.head(out)


@dataclass
class Point:  # a plain class: torch.load(weights_only=True) refuses to rebuild it
    x: int


def _models() -> dict[str, tuple[nn.Module, dict, tuple[str, int, int]]]:
    """name -> (model, load_foreign keywords, expected (cell, hidden, layers))."""
    torch.manual_seed(0)
    return {
        "embed_lstm": (EmbedLSTM(), {"embed": "emb.weight", "head": "out."}, ("lstm", 8, 2)),
        "gru_onehot": (OneHot(nn.GRU(V, 8, batch_first=True)), {"head": "head"}, ("gru", 8, 1)),
        "rnn_nobias": (OneHot(nn.RNN(V, 5, num_layers=2, bias=False, batch_first=True),
                              head=False), {}, ("rnn", 5, 2)),
        "rnn_relu": (OneHot(nn.RNN(V, 5, nonlinearity="relu", batch_first=True)),
                     {"head": "head.", "nonlinearity": "relu"}, ("rnn", 5, 1)),
        "bi_lstm": (OneHot(nn.LSTM(V, 6, num_layers=2, bidirectional=True, batch_first=True)),
                    {"head": "head."}, ("lstm", 6, 2)),
        "proj_lstm": (OneHot(nn.LSTM(V, 8, proj_size=3, batch_first=True)), {"head": "head."},
                      ("lstm", 8, 1)),
        "gru_float64": (OneHot(nn.GRU(V, 4, batch_first=True)).double(), {"head": "head."},
                        ("gru", 4, 1)),
    }


def _save(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    if path.suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    else:
        torch.save(tensors, path)
    return path


@pytest.fixture
def vocab(tmp_path: Path) -> Path:
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(CHARS), encoding="utf-8")
    return path


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, V, (3, 11), generator=torch.Generator().manual_seed(1))  # (B, T)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.filterwarnings(PROJ_WARNING))
                                  if n == "proj_lstm" else n for n in _models()])
def test_forward_bit_equal(name: str, suffix: str, tmp_path: Path, vocab: Path,
                           ids: torch.Tensor) -> None:
    model, kwargs, (cell, hidden, layers) = _models()[name]
    model.eval()
    path = _save(model.state_dict(), tmp_path / f"w{suffix}")
    m = load_foreign(path, vocab=vocab, **kwargs)
    assert (m.cell, m.hidden, m.layers) == (cell, hidden, layers)
    assert not m.training and m.rnn.batch_first and m.vocab == CHARS
    with torch.no_grad():
        want = model(ids)  # (B, T, V) or (B, T, D*H)
        got = m(ids)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert (m.head is None) == ("head" not in kwargs)
    assert set(m.rnn.state_dict()) == {k[len(m.prefix):] for k in model.state_dict()
                                       if k.startswith(m.prefix)}


def test_loaded_model_verifies_and_draws_no_random_numbers(tmp_path: Path, vocab: Path,
                                                           ids: torch.Tensor) -> None:
    model, kwargs, _ = _models()["embed_lstm"]
    path = _save(model.state_dict(), tmp_path / "w.safetensors")
    rng = torch.get_rng_state()
    m = load_foreign(path, vocab=vocab, **kwargs)
    assert torch.equal(rng, torch.get_rng_state())  # built on the meta device: no init
    with torch.no_grad():
        assert verify(m.rnn, m.encode(ids)).passed  # gatelens's read-out opens it


def test_describe(tmp_path: Path, vocab: Path) -> None:
    model, kwargs, _ = _models()["embed_lstm"]
    path = _save(model.state_dict(), tmp_path / "w.safetensors")
    assert load_foreign(path, vocab=vocab, **kwargs).describe() == (
        f"{path}: lstm, 2 layers, hidden 8, torch.float32 (tensors 'lstm.*')\n"
        "  input: embedding 'emb.weight' (10, 6)\n"
        "  output: head 'out.weight' (10, 8) + bias -> logits over 10")
    model, _, _ = _models()["bi_lstm"]
    path = _save(model.state_dict(), tmp_path / "b.pt")
    assert load_foreign(path, vocab=vocab).describe().splitlines()[1:] == [
        "  input: one-hot over 10 characters",
        "  output: no head: the lstm's output, 12 features a step"]
    for name, fact in (("proj_lstm", "lstm, 1 layer, hidden 8, projection 3, torch.float32"),
                       ("rnn_nobias", "rnn, 2 layers, hidden 5, no bias, tanh, torch.float32")):
        path = _save(_models()[name][0].state_dict(), tmp_path / f"{name}.pt")
        assert load_foreign(path, vocab=vocab).describe().startswith(f"{path}: {fact} ")


@pytest.mark.parametrize("key", ["state_dict", "model"])
def test_nested_checkpoint_and_other_suffixes(key: str, tmp_path: Path, vocab: Path,
                                              ids: torch.Tensor) -> None:
    model, kwargs, _ = _models()["gru_onehot"]
    for suffix in (".pth", ".bin"):
        path = tmp_path / f"ckpt{suffix}"
        torch.save({"epoch": 7, key: model.state_dict(), "note": "best"}, path)
        with torch.no_grad():
            assert torch.equal(load_foreign(path, vocab=vocab, **kwargs)(ids), model(ids))


def test_prefix_detection(tmp_path: Path, vocab: Path) -> None:
    gru = nn.GRU(V, 4, batch_first=True)
    sd = {f"encoder.rnn.{k}": v for k, v in gru.state_dict().items()}
    assert load_foreign(_save(sd, tmp_path / "a.pt"), vocab=vocab).prefix == "encoder.rnn."
    bare = _save(gru.state_dict(), tmp_path / "bare.safetensors")  # a plain nn.GRU's own names
    assert load_foreign(bare, vocab=vocab).prefix == ""
    two = sd | {f"decoder.rnn.{k}": v for k, v in nn.LSTM(V, 3).state_dict().items()}
    path = _save(two, tmp_path / "two.pt")
    with pytest.raises(GatelensError) as e:
        load_foreign(path, vocab=vocab)
    assert str(e.value) == (f"{path}: 2 recurrent modules ('decoder.rnn.', 'encoder.rnn.'); "
                            "pass --prefix to choose one")
    assert load_foreign(path, vocab=vocab, prefix="decoder.rnn").cell == "lstm"
    assert load_foreign(path, vocab=vocab, prefix="encoder.rnn.").cell == "gru"
    with pytest.raises(GatelensError) as e:
        load_foreign(path, vocab=vocab, prefix="rnn.")
    assert str(e.value) == (f"{path}: no tensor 'rnn.weight_ih_l0' (--prefix); recurrent "
                            "modules here: 'decoder.rnn.', 'encoder.rnn.'")


def test_vocab_formats(tmp_path: Path) -> None:
    files = {"list.json": json.dumps(CHARS), "chars.json": json.dumps({"chars": CHARS}),
             "config.json": json.dumps({"model": {"cell": "gru"}, "vocab": CHARS}),
             "corpus.txt": "hag\nfed cab\nbade"}  # sorted set of its characters
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        assert read_vocab(tmp_path / name) == CHARS, name


def _error(call) -> str:
    with pytest.raises(GatelensError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("text, message", [
    ("", "empty file, expected a vocabulary"),
    ("[a, b]", "not valid JSON (Expecting value: line 1 column 2 (char 1))"),
    ('["a", "b", "c", "a"]', "character 'a' appears twice (entries 0 and 3)"),
    ('["a", "bc"]', "entry 1 is 'bc', not a single character"),
    ('["a", 1]', "entry 1 is 1, not a single character"),
    ("[]", "expected a non-empty JSON list of characters"),
    ('{"tokens": ["a"]}', 'a JSON object needs a "chars" or "vocab" list'),
])
def test_bad_vocab(text: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "v.json"
    path.write_text(text, encoding="utf-8")
    assert _error(lambda: read_vocab(path)) == f"{path}: {message}"


def test_bad_vocab_bytes_and_missing(tmp_path: Path) -> None:
    path = tmp_path / "v.txt"
    path.write_bytes(b"ab\xffc")
    assert _error(lambda: read_vocab(path)) == \
        f"{path}: not UTF-8 (invalid byte 0xff at byte offset 2)"
    assert _error(lambda: read_vocab(tmp_path / "nope.json")) == \
        f"{tmp_path / 'nope.json'}: no such file"


@pytest.mark.parametrize("make", [
    lambda p: torch.save(Point(3), p),  # an instance of a user's class
    lambda p: torch.save([(1, Point(2)), (2, Fraction(1, 3))], p),  # objects inside a list
    lambda p: torch.save(nn.GRU(V, 4), p),  # torch.save(model): the whole module pickled
    lambda p: p.write_bytes(pickle.dumps({"w": Fraction(1, 2)})),  # a bare pickle
], ids=["class-instance", "list-of-tuples", "whole-module", "bare-pickle"])
def test_pickled_objects_refused(make, tmp_path: Path, vocab: Path) -> None:
    path = tmp_path / "w.pt"
    make(path)
    assert _error(lambda: load_foreign(path, vocab=vocab)) == f"{path}: {PICKLED}"


@pytest.mark.parametrize("name, make, message", [
    ("w.safetensors", lambda p: p.write_bytes(b""), "empty file, expected a weights file"),
    ("w.pt", lambda p: p.write_bytes(b""), "empty file, expected a weights file"),
    ("w.ckpt", lambda p: p.write_bytes(b"x"),
     "unknown weights format '.ckpt'; gatelens reads .safetensors, .pt, .pth, .bin, .onnx, "
     ".h5, .keras"),
    ("w.pt", lambda p: torch.save([torch.zeros(2)], p),
     "holds an object of type list, not a dict of tensors (a state_dict)"),
    ("w.pt", lambda p: torch.save({"w": torch.zeros(2), "step": 3}, p),
     "entry 'step' is of type int, not a tensor; expected a state_dict (names to tensors)"),
    ("w.pt", lambda p: torch.save({}, p), "holds no tensors"),
    ("w.safetensors", lambda p: save_file({"w": torch.zeros(2, 2)}, str(p)),
     "no recurrent module (no tensor named '*weight_ih_l0'); gatelens opens nn.LSTM, "
     "nn.GRU and nn.RNN weights"),
])
def test_bad_weights_file(name: str, make, message: str, tmp_path: Path, vocab: Path) -> None:
    path = tmp_path / name
    make(path)
    assert _error(lambda: load_foreign(path, vocab=vocab)) == f"{path}: {message}"


def test_unreadable_or_missing_weights(tmp_path: Path, vocab: Path) -> None:
    for name, kind in (("w.pt", "PyTorch"), ("w.safetensors", "safetensors")):
        path = tmp_path / name
        path.write_bytes(b"hello, not weights at all")
        assert _error(lambda p=path: load_foreign(p, vocab=vocab)).startswith(
            f"{path}: not a readable {kind} file (")
    assert _error(lambda: load_foreign(tmp_path / "none.pt", vocab=vocab)) == \
        f"{tmp_path / 'none.pt'}: no such file"
    assert _error(lambda: read_tensors(tmp_path)) == \
        f"{tmp_path}: is a directory, expected a weights file"
    junk = tmp_path / "weights"
    junk.write_bytes(b"hello, not weights at all")
    assert _error(lambda: read_tensors(junk)) == (
        f"{junk}: no extension, and its first bytes are not those of a safetensors or "
        "torch.save file (unknown)")


def _edited(name: str, tmp_path: Path, drop: tuple[str, ...] = (), **put: torch.Tensor) -> Path:
    sd = {k: v for k, v in _models()[name][0].state_dict().items() if k not in drop}
    return _save(sd | {k.replace("__", "."): v for k, v in put.items()}, tmp_path / "w.pt")


def test_missing_tensors(tmp_path: Path, vocab: Path) -> None:
    p = _edited("embed_lstm", tmp_path, drop=("lstm.weight_hh_l1",))
    assert _error(lambda: load_foreign(p, vocab=vocab, embed="emb.weight")) == \
        f"{p}: no tensor 'lstm.weight_hh_l1' (layer 1 of 2)"
    p = _edited("bi_lstm", tmp_path, drop=("rnn.bias_hh_l0_reverse",))
    assert _error(lambda: load_foreign(p, vocab=vocab)) == \
        f"{p}: no tensor 'rnn.bias_hh_l0_reverse' (layer 0 of 2, reverse direction)"
    p = _edited("gru_onehot", tmp_path)
    assert _error(lambda: load_foreign(p, vocab=vocab, layers=2)) == \
        f"{p}: no tensor 'rnn.weight_ih_l1' (layer 1 of 2)"
    assert _error(lambda: load_foreign(p, vocab=vocab, embed="embed")) == \
        f"{p}: no tensor 'embed' (--embed-tensor)"
    assert _error(lambda: load_foreign(p, vocab=vocab, head="decoder")) == \
        f"{p}: no tensor 'decoder.weight' (--head)"
    p = _edited("rnn_nobias", tmp_path)
    assert _error(lambda: load_foreign(p, vocab=vocab, layers=1)) == \
        f"{p}: tensors under 'rnn.' go up to layer 1, more than --layers 1"


def test_shapes_that_do_not_fit(tmp_path: Path, vocab: Path) -> None:
    p = _edited("gru_onehot", tmp_path, rnn__weight_hh_l0=torch.zeros(16, 8))
    assert _error(lambda: load_foreign(p, vocab=vocab)) == (
        f"{p}: cannot tell the cell from 'rnn.weight_hh_l0' of shape (16, 8) (lstm, gru, rnn "
        "have 4H, 3H, H rows, H = 8); pass --cell")
    p = _edited("gru_onehot", tmp_path)
    assert _error(lambda: load_foreign(p, vocab=vocab, cell="lstm")) == (
        f"{p}: tensor 'rnn.weight_ih_l0' has shape (24, 10), a 1-layer lstm with hidden 8 and "
        "10 inputs needs (32, 10)")
    assert _error(lambda: load_foreign(p, vocab=vocab, hidden=9)) == \
        f"{p}: tensor 'rnn.weight_hh_l0' has shape (24, 8): hidden size 8, not --hidden 9"
    assert _error(lambda: load_foreign(p, vocab=vocab, nonlinearity="relu")) == \
        "--nonlinearity relu does not apply to a gru (a plain rnn takes tanh or relu)"
    p = _edited("rnn_nobias", tmp_path, rnn__weight_hh_l1=torch.zeros(5, 4))
    assert _error(lambda: load_foreign(p, vocab=vocab)) == (
        f"{p}: tensor 'rnn.weight_hh_l1' has shape (5, 4), a 2-layer rnn with hidden 5 and "
        "10 inputs needs (5, 5)")
    p = _edited("gru_onehot", tmp_path, rnn__weight_hr_l0=torch.zeros(2, 8))
    assert _error(lambda: load_foreign(p, vocab=vocab, cell="gru")) == \
        f"{p}: unexpected tensor 'rnn.weight_hr_l0' for a 1-layer gru with hidden 8 and 10 inputs"
    p = _edited("rnn_nobias", tmp_path, rnn__bias_ih_l1=torch.zeros(5))
    assert _error(lambda: load_foreign(p, vocab=vocab)) == \
        f"{p}: unexpected tensor 'rnn.bias_ih_l1' for a 2-layer rnn with hidden 5 and 10 inputs"


def test_input_and_head_mismatches(tmp_path: Path, vocab: Path) -> None:
    small = tmp_path / "small.json"
    small.write_text(json.dumps(CHARS[:-1]), encoding="utf-8")
    big = tmp_path / "big.json"
    big.write_text(json.dumps(CHARS + ["~"]), encoding="utf-8")
    p = _edited("gru_onehot", tmp_path)
    assert _error(lambda: load_foreign(p, vocab=big)) == (
        f"{p}: tensor 'rnn.weight_ih_l0' has 10 columns (inputs), but {big} has 11 characters "
        "(one-hot input)")
    m = load_foreign(p, vocab=small)  # a vocabulary shorter than the input: a named unused row
    assert m.vocab == CHARS[:-1] + ["<unused 9>"] and "rows 9..9 are named" in m.notes[0]
    p = _edited("embed_lstm", tmp_path)
    assert _error(lambda: load_foreign(p, vocab=vocab)) == (
        f"{p}: tensor 'lstm.weight_ih_l0' has 6 columns (inputs), but {vocab} has 10 characters"
        " (one-hot input); if 'emb.weight' is its embedding, pass --embed-tensor emb.weight")
    assert _error(lambda: load_foreign(p, vocab=big, embed="emb")) == \
        f"{p}: embedding 'emb.weight' has 10 rows, but {big} has 11 characters"
    m = load_foreign(p, vocab=small, embed="emb", head="out")
    assert m.vocab[-1] == "<unused 9>" and "embedding 'emb.weight' has 10 rows" in m.notes[0]
    p = _edited("embed_lstm", tmp_path, emb__weight=torch.zeros(V, 7))
    assert _error(lambda: load_foreign(p, vocab=vocab, embed="emb.weight")) == (
        f"{p}: tensor 'lstm.weight_ih_l0' has 6 columns (inputs), but embedding 'emb.weight' "
        "is 7 wide")
    p = _edited("embed_lstm", tmp_path, emb__weight=torch.zeros(V, 6, dtype=torch.float64))
    assert _error(lambda: load_foreign(p, vocab=vocab, embed="emb.weight")) == (
        f"{p}: tensor 'emb.weight' is torch.float64, but 'lstm.weight_ih_l0' is torch.float32; "
        "the model needs one dtype")
    p = _edited("embed_lstm", tmp_path, out__weight=torch.zeros(V + 1, 8))
    assert _error(lambda: load_foreign(p, vocab=vocab, embed="emb.weight", head="out")) == (
        f"{p}: head 'out.weight' has shape (11, 8), expected (10, 8) (10 characters in {vocab},"
        " 8 features a step from a 2-layer lstm with hidden 8 and 6 inputs)")
    p = _edited("bi_lstm", tmp_path, head__bias=torch.zeros(V, 1))
    assert _error(lambda: load_foreign(p, vocab=vocab, head="head.weight")) == (
        f"{p}: head 'head.bias' has shape (10, 1), expected (10,) (10 characters in {vocab}, "
        "12 features a step from a 2-layer bidirectional lstm with hidden 6 and 10 inputs)")


def test_cli_arguments(tmp_path: Path, vocab: Path, ids: torch.Tensor) -> None:
    model, _, _ = _models()["embed_lstm"]
    path = _save(model.state_dict(), tmp_path / "w.safetensors")
    parser = argparse.ArgumentParser()
    add_analyze_arguments(parser)  # analyze's own flags, the foreign ones among them
    args = parser.parse_args(["RUN", "--weights", str(path), "--vocab", str(vocab), "--cell",
                              "lstm", "--prefix", "lstm.", "--hidden", "8", "--layers", "2",
                              "--embed-tensor", "emb.weight", "--head", "out."])
    m = foreign_from_args(args)
    assert isinstance(m, ForeignModel) and m.cell == "lstm"
    with torch.no_grad():
        assert torch.equal(m(ids), model(ids))
    bare = argparse.ArgumentParser()
    add_foreign_arguments(bare)
    assert vars(bare.parse_args(["--weights", "w.pt", "--nonlinearity", "relu"])) == {
        "weights": "w.pt", "vocab": None, "cell": None, "prefix": None, "hidden": None,
        "layers": None, "embed_tensor": None, "head": None, "nonlinearity": "relu",
        "recurrent_activation": None}
    assert _error(lambda: foreign_from_args(bare.parse_args([]))) == \
        "--weights FILE is needed for a model gatelens did not train"
    assert _error(lambda: foreign_from_args(bare.parse_args(["--weights", "w.pt"]))) == \
        "w.pt: --weights needs --vocab FILE (characters in index order)"


def test_analyze_foreign_weights_end_to_end(tmp_path, capsys):
    """`gatelens analyze --weights --vocab --text --out`: a page from weights alone."""
    from gatelens.cli import main

    torch.manual_seed(0)
    model = EmbedLSTM()
    weights = _save(model.state_dict(), tmp_path / "w.safetensors")
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps(CHARS), encoding="utf-8")
    text = tmp_path / "text.txt"
    text.write_text(("abc defg\nhab " * 40)[:400], encoding="utf-8")
    out = tmp_path / "out"
    args = ["analyze", "--weights", str(weights), "--vocab", str(vocab), "--text", str(text),
            "--windows", "2", "--length", "40", "--perturb-pos", "8", "--out", str(out),
            "--prefix", "lstm.", "--embed-tensor", "emb.weight", "--head", "out.", "--quiet"]
    assert main(args) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["version"] == 4 and rep["model"]["path"] == "lstm"
    assert rep["model"]["cell"] == "lstm" and rep["model"]["layers"] == 2
    assert rep["verification"]["passed"] and rep["output_reach"]["kl"][0] > 0
    assert (out / "report.html").is_file() and (out / "report.md").is_file()
    pickled = tmp_path / "bad.pt"
    torch.save({"model": EmbedLSTM()}, pickled)  # a pickled module, not tensors
    capsys.readouterr()
    assert main(["analyze", "--weights", str(pickled), "--vocab", str(vocab), "--text",
                 str(text), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pickled Python objects" in err and "Traceback" not in err and len(err.splitlines()) == 1
