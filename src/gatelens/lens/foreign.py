"""Weights gatelens did not train: a tensor file and a vocabulary, opened for analysis.

A ``.safetensors`` file, or a state_dict saved with ``torch.save(model.state_dict())``
(``.pt``, ``.pth``, ``.bin``), plus the model's characters in index order, becomes a
:class:`ForeignModel`: the file's nn.LSTM / nn.GRU / nn.RNN with its tensors loaded under
PyTorch's own names, and the embedding and Linear head around it when asked for. Cell,
sizes, layers, direction, bias and projection are read from the tensors' names and shapes.
Every mismatch is a one-line GatelensError naming the file and the tensor. Nothing is
unpickled beyond what ``torch.load(weights_only=True)`` allows: plain tensors and containers.

>>> import json, tempfile
>>> from safetensors.torch import save_file
>>> d = Path(tempfile.mkdtemp())
>>> gru = nn.GRU(3, 4, num_layers=2, batch_first=True)
>>> save_file({f"enc.{k}": v for k, v in gru.state_dict().items()}, str(d / "w.safetensors"))
>>> _ = (d / "vocab.json").write_text(json.dumps(["a", "b", "c"]))
>>> m = load_foreign(d / "w.safetensors", vocab=d / "vocab.json")
>>> m.cell, m.hidden, m.layers, m.prefix, tuple(m(torch.zeros(2, 5, dtype=torch.long)).shape)
('gru', 4, 2, 'enc.', (2, 5, 4))
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gatelens.errors import GatelensError, positive_int
from gatelens.families.registry import cell_spec
from gatelens.lens.foreign_io import PathLike, extend_vocab, read_tensors, read_vocab, sniff
from gatelens.readout.select import count_or_list

#: PyTorch's recurrent modules, whose tensor names (weight_ih_l0 ...) these files use
CELLS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}
#: Row blocks stacked in weight_ih / weight_hh of each (its cell's spec)
GATES = {f: cell_spec("rnn_tanh" if f == "rnn" else f).n_chunks for f in CELLS}
M = TypeVar("M", bound=nn.Module)
# PyTorch's names for a recurrent module's tensors: weight_ih_l0, bias_hh_l1_reverse, ...
_RECURRENT = re.compile(r"^(weight|bias)_(ih|hh|hr)_l(\d+)(_reverse)?$")


class ForeignModel(nn.Module):
    """A recurrent module from a weights file, with its input encoding and optional head.

    ``embed`` (nn.Embedding or None: one-hot input), ``rnn`` (nn.LSTM/GRU/RNN, or a
    VariantLSTM/VariantGRU of an ONNX or Keras file; batch_first, eval mode), ``head``
    (nn.Linear or None), ``vocab`` (characters in index order, ``<unused k>`` for rows the
    vocabulary file does not name), ``notes`` (what a reader of report.md must know, such as
    those unused rows).
    """

    def __init__(self, rnn: nn.Module, vocab: list[str], *, embed: nn.Embedding | None = None,
                 head: nn.Linear | None = None, source: Path = Path(), prefix: str = "",
                 embed_name: str | None = None, head_prefix: str | None = None,
                 notes: list[str] | None = None, masked_id: int | None = None) -> None:
        super().__init__()
        self.masked_id = masked_id  # a Keras mask_zero embedding: the id its model skips
        self.embed, self.rnn, self.head, self.vocab = embed, rnn, head, list(vocab)
        self.source, self.prefix = source, prefix  # the file, and the rnn's name prefix in it
        self.embed_name, self.head_prefix = embed_name, head_prefix
        self.notes = list(notes or [])
        # nn.LSTM/GRU/RNN by class; a variant (cells/variants.py) says its kind
        self.cell = next((name for name, cls in CELLS.items() if type(rnn) is cls),
                         getattr(rnn, "kind", None))
        self.hidden, self.layers = rnn.hidden_size, rnn.num_layers
        # features a step out of the rnn: D * (proj_size or hidden)
        self.out_features = (1 + rnn.bidirectional) * (getattr(rnn, "proj_size", 0) or
                                                       self.hidden)
        self.eval()

    def encode(self, ids: Tensor) -> Tensor:
        """The recurrent module's input for character indices (B, T) -> (B, T, E or V)."""
        if self.masked_id is not None and bool((ids == self.masked_id).any()):
            n = int((ids == self.masked_id).sum())
            raise GatelensError(
                f"{self.source}: embedding '{self.embed_name}' masks id {self.masked_id} "
                f"({self.vocab[self.masked_id]!r}, mask_zero): Keras skips those steps and "
                f"the read-out would not; {n} positions of these windows hold it (analyse "
                "a text without it)")
        if self.embed is not None:
            return self.embed(ids)  # (B, T, E)
        return F.one_hot(ids, len(self.vocab)).to(self.rnn.weight_ih_l0.dtype)  # (B, T, V)

    def forward(self, ids: Tensor) -> Tensor:
        """Logits (B, T, V) with a head, else the recurrent output (B, T, D*H)."""
        out, _ = self.rnn(self.encode(ids))  # (B, T, D*H)
        return out if self.head is None else self.head(out)  # (B, T, V)

    def describe(self) -> str:
        """A short summary: where the weights came from and what was built from them."""
        r, V = self.rnn, len(self.vocab)
        parts = [self.cell, f"{self.layers} layer{'s' * (self.layers > 1)}",
                 f"hidden {self.hidden}"]
        proj = getattr(r, "proj_size", 0)
        for flag, text in ((r.bidirectional, "bidirectional"),
                           (not getattr(r, "bias", True), "no bias"),
                           (proj, f"projection {proj}"),
                           (self.cell == "rnn", getattr(r, "nonlinearity", "")),
                           (hasattr(r, "directions"), f"{type(r).__name__} {r.extra_repr()}")):
            parts += [text] if flag else []
        inp = (f"one-hot over {V} characters" if self.embed is None else
               f"embedding '{self.embed_name}' {tuple(self.embed.weight.shape)}")
        out = (f"no head: the {self.cell}'s output, {self.out_features} features a step"
               if self.head is None else
               f"head '{self.head_prefix}weight' {tuple(self.head.weight.shape)}"
               f"{' + bias' * (self.head.bias is not None)} -> logits over {V}")
        notes = "".join(f"\n  note: {n}" for n in self.notes)
        return (f"{self.source}: {', '.join(parts)}, {r.weight_ih_l0.dtype} "
                f"(tensors '{self.prefix}*')\n  input: {inp}\n  output: {out}{notes}")


def _prefix(tensors: dict[str, Tensor], path: Path, prefix: str | None) -> str:
    found = sorted(k[: -len("weight_ih_l0")] for k in tensors
                   if k == "weight_ih_l0" or k.endswith(".weight_ih_l0"))
    listed = ", ".join(repr(f) for f in found)
    if prefix is not None:
        prefix = prefix if prefix == "" or prefix.endswith(".") else prefix + "."
        if prefix + "weight_ih_l0" not in tensors:
            raise GatelensError(f"{path}: no tensor '{prefix}weight_ih_l0' (--prefix); "
                                f"recurrent modules here: {listed or 'none'}")
        return prefix
    if not found:
        raise GatelensError(f"{path}: no recurrent module (no tensor named '*weight_ih_l0'); "
                            "gatelens opens nn.LSTM, nn.GRU and nn.RNN weights")
    if len(found) > 1:
        raise GatelensError(f"{path}: {len(found)} recurrent modules ({listed}); "
                            "pass --prefix to choose one")
    return found[0]


def _matrix(tensors: dict[str, Tensor], key: str, path: Path, what: str) -> Tensor:
    if key not in tensors:
        raise GatelensError(f"{path}: no tensor '{key}' ({what})")
    t = tensors[key]
    if t.dim() != 2 or 0 in t.shape:
        raise GatelensError(f"{path}: tensor '{key}' has shape {tuple(t.shape)}, "
                            "expected a non-empty matrix")
    return t


def _check_dtype(t: Tensor, key: str, dtype: torch.dtype, prefix: str, path: Path) -> None:
    if not t.dtype.is_floating_point:
        raise GatelensError(f"{path}: tensor '{key}' is {t.dtype}, not floating point")
    if t.dtype != dtype:
        raise GatelensError(f"{path}: tensor '{key}' is {t.dtype}, but '{prefix}weight_ih_l0' "
                            f"is {dtype}; the model needs one dtype")


def _meta_load(module: M, tensors: dict[str, Tensor]) -> M:
    """Give a module built on the meta device (no init, no RNG drawn) the file's tensors."""
    module.load_state_dict({k: v.contiguous() for k, v in tensors.items()}, assign=True)
    return module


def _recurrent(tensors: dict[str, Tensor], path: Path, prefix: str, cell: str | None,
               hidden: int | None, layers: int | None, nonlinearity: str | None,
               n_in: int) -> tuple[nn.RNNBase, str]:
    """The recurrent module (meta device, unloaded) the tensors under ``prefix`` call for,
    every tensor checked against it, and a description of it for messages."""
    parsed = {k[len(prefix):]: m for k in tensors
              if k.startswith(prefix) and (m := _RECURRENT.match(k[len(prefix):]))}
    found_layers = 1 + max(int(m[3]) for m in parsed.values())
    n_layers = found_layers if layers is None else layers
    if n_layers < found_layers:
        raise GatelensError(f"{path}: tensors under '{prefix}' go up to layer "
                            f"{found_layers - 1}, more than --layers {layers}")
    w_hh = _matrix(tensors, prefix + "weight_hh_l0", path, f"layer 0 of {n_layers}")  # (G*H, H)
    w_hr = (_matrix(tensors, prefix + "weight_hr_l0", path, "projection")  # (P, H)
            if prefix + "weight_hr_l0" in tensors else None)
    by = prefix + ("weight_hr_l0" if w_hr is not None else "weight_hh_l0")
    H = tensors[by].shape[1]
    if hidden is not None and hidden != H:
        raise GatelensError(f"{path}: tensor '{by}' has shape {tuple(tensors[by].shape)}: "
                            f"hidden size {H}, not --hidden {hidden}")
    if cell is None:
        rows = {GATES[c] * H: c for c in GATES}
        if w_hr is None and w_hh.shape[0] not in rows:
            raise GatelensError(f"{path}: cannot tell the cell from '{prefix}weight_hh_l0' of "
                                f"shape {tuple(w_hh.shape)} (lstm, gru, rnn have 4H, 3H, H "
                                f"rows, H = {H}); pass --cell")
        cell = "lstm" if w_hr is not None else rows[w_hh.shape[0]]
    elif cell not in GATES:
        raise GatelensError(f"--cell must be lstm, gru or rnn, got {cell!r}")
    if nonlinearity is not None and (cell != "rnn" or nonlinearity not in ("tanh", "relu")):
        raise GatelensError(f"--nonlinearity {nonlinearity} does not apply to a {cell} "
                            "(a plain rnn takes tanh or relu)")
    bi = any(n.endswith("_reverse") for n in parsed)
    kwargs: dict = {"num_layers": n_layers, "bias": prefix + "bias_ih_l0" in tensors,
                    "batch_first": True, "bidirectional": bi, "device": "meta"}
    if cell == "lstm":
        kwargs["proj_size"] = 0 if w_hr is None else w_hr.shape[0]
    if cell == "rnn":
        kwargs["nonlinearity"] = nonlinearity or "tanh"
    rnn = CELLS[cell](n_in, H, **kwargs)
    proj = f", projection {kwargs['proj_size']}" if kwargs.get("proj_size") else ""
    desc = (f"a {n_layers}-layer {'bidirectional ' * bi}{cell} with hidden {H}{proj} and "
            f"{n_in} inputs")
    dtype = tensors[prefix + "weight_ih_l0"].dtype
    for name, want in rnn.state_dict().items():
        key = prefix + name
        if key not in tensors:
            m = _RECURRENT.match(name)
            assert m is not None
            raise GatelensError(f"{path}: no tensor '{key}' (layer {m[3]} of {n_layers}"
                                f"{', reverse direction' if m[4] else ''})")
        got = tensors[key]
        if got.shape != want.shape:
            raise GatelensError(f"{path}: tensor '{key}' has shape {tuple(got.shape)}, "
                                f"{desc} needs {tuple(want.shape)}")
        _check_dtype(got, key, dtype, prefix, path)
    extra = sorted(set(parsed) - set(rnn.state_dict()))
    if extra:
        raise GatelensError(f"{path}: unexpected tensor '{prefix}{extra[0]}' for {desc}")
    return rnn, desc


def _input_width(tensors: dict[str, Tensor], path: Path, prefix: str, embed: str | None,
                 V: int, vocab: PathLike) -> tuple[str | None, int]:
    """The embedding tensor's name (None: one-hot) and the recurrent module's input size
    (its rows, or the one-hot width, may exceed V: ``extend_vocab`` names the rest)."""
    w_ih = _matrix(tensors, prefix + "weight_ih_l0", path, "layer 0")  # (G*H, I)
    if embed is None:
        if w_ih.shape[1] < V:
            guess = [k for k, t in tensors.items() if tuple(t.shape) == (V, w_ih.shape[1])]
            hint = f"; if '{guess[0]}' is its embedding, pass --embed-tensor {guess[0]}" \
                if guess else ""
            raise GatelensError(f"{path}: tensor '{prefix}weight_ih_l0' has {w_ih.shape[1]} "
                                f"columns (inputs), but {vocab} has {V} characters (one-hot "
                                f"input){hint}")
        return None, w_ih.shape[1]
    if embed not in tensors and embed + ".weight" in tensors:
        embed += ".weight"  # the module's name given for its tensor's
    emb = _matrix(tensors, embed, path, "--embed-tensor")  # (V, E)
    _check_dtype(emb, embed, w_ih.dtype, prefix, path)
    if emb.shape[0] < V:
        raise GatelensError(f"{path}: embedding '{embed}' has {emb.shape[0]} rows, "
                            f"but {vocab} has {V} characters")
    if w_ih.shape[1] != emb.shape[1]:
        raise GatelensError(f"{path}: tensor '{prefix}weight_ih_l0' has {w_ih.shape[1]} "
                            f"columns (inputs), but embedding '{embed}' is {emb.shape[1]} wide")
    return embed, emb.shape[1]


def _head(tensors: dict[str, Tensor], path: Path, prefix: str, head: str, V: int,
          vocab: PathLike, d_out: int, desc: str) -> tuple[str, dict[str, Tensor]]:
    """The head's normalised prefix and its tensors (weight (V, D*H), bias (V,) if any)."""
    if head.endswith("weight") and head in tensors:
        head = head[: -len("weight")]  # the weight's name given for the prefix
    elif head and not head.endswith("."):
        head += "."
    found = {"weight": _matrix(tensors, head + "weight", path, "--head")}  # (V, D*H)
    if head + "bias" in tensors:
        found["bias"] = tensors[head + "bias"]  # (V,)
    for key, want in (("weight", (V, d_out)), ("bias", (V,))):
        if key in found and tuple(found[key].shape) != want:
            raise GatelensError(f"{path}: head '{head}{key}' has shape "
                                f"{tuple(found[key].shape)}, expected {want} ({V} characters "
                                f"in {vocab}, {d_out} features a step from {desc})")
        if key in found:
            _check_dtype(found[key], head + key, tensors[prefix + "weight_ih_l0"].dtype,
                         prefix, path)
    return head, found


def load_foreign(weights: PathLike, *, vocab: PathLike, cell: str | None = None,
                 prefix: str | None = None, hidden: int | None = None,
                 layers: int | None = None, embed: str | None = None, head: str | None = None,
                 nonlinearity: str | None = None,
                 recurrent_activation: str | None = None) -> ForeignModel:
    """A :class:`ForeignModel` from a weights file that gatelens did not write.

    Args:
        weights: ``.safetensors``, or a state_dict saved with torch.save (.pt, .pth, .bin), or
            either of them with no extension (sniffed); ``.onnx``, ``.h5``/``.keras``: the
            recurrent node or layer named by ``prefix`` (``gatelens.loaders.foreign_files``).
        vocab: the characters in index order (see :func:`gatelens.lens.foreign_io.read_vocab`).
        cell: "lstm", "gru" or "rnn"; None: from weight_hh_l0's rows (4H, 3H, H), or an
            LSTM where there is a projection (weight_hr_l0).
        prefix: name prefix of the recurrent tensors (e.g. "encoder.rnn."); None: the only
            prefix that has a ``weight_ih_l0``.
        hidden, layers: None: read from the tensors; given: checked against them.
        embed: name of an embedding tensor (V, E); None: one-hot input of size V.
        head: prefix of a Linear head (``{head}weight`` (V, D*H), ``{head}bias``); None: no
            head, the model returns the recurrent output.
        nonlinearity: "tanh" (default) or "relu", for a plain RNN.
        recurrent_activation: a Keras weights-only file's recurrent activation.

    Bidirectional (``*_reverse``), bias and projection are read from the tensor names.
    """
    path = Path(weights)
    kind = file_kind(path)
    if kind != "tensors":  # an ONNX graph or a Keras file: its recurrent node or layer
        from gatelens.loaders.foreign_files import file_parts

        parts = file_parts(path, kind, vocab=vocab, prefix=prefix, embed=embed, head=head,
                           recurrent_activation=recurrent_activation)
        return ForeignModel(source=path, **parts)
    tensors = read_tensors(path)
    chars = read_vocab(vocab)
    prefix = _prefix(tensors, path, prefix)
    embed_name, n_in = _input_width(tensors, path, prefix, embed, len(chars), vocab)
    chars, notes = extend_vocab(chars, n_in if embed_name is None else
                                tensors[embed_name].shape[0],
                                "the one-hot input" if embed_name is None
                                else f"embedding '{embed_name}'")
    V = len(chars)
    rnn, desc = _recurrent(tensors, path, prefix, cell, hidden, layers, nonlinearity, n_in)
    d_out = (1 + rnn.bidirectional) * (rnn.proj_size or rnn.hidden_size)
    head_prefix, head_tensors = (None, {}) if head is None else \
        _head(tensors, path, prefix, head, V, vocab, d_out, desc)

    _meta_load(rnn, {n: tensors[prefix + n] for n in rnn.state_dict()})
    embed_mod = None if embed_name is None else _meta_load(
        nn.Embedding(V, n_in, device="meta"), {"weight": tensors[embed_name]})
    head_mod = None if head_prefix is None else _meta_load(
        nn.Linear(d_out, V, bias="bias" in head_tensors, device="meta"), head_tensors)
    return ForeignModel(rnn, chars, embed=embed_mod, head=head_mod, source=path, prefix=prefix,
                        embed_name=embed_name, head_prefix=head_prefix, notes=notes)


def file_kind(path: Path) -> str:
    """"onnx", "keras" (.h5, .hdf5, .keras) or "tensors" (a state_dict file), by the
    extension, or by the first bytes where there is none (foreign_io.sniff).

    >>> file_kind(Path("model.onnx")), file_kind(Path("m.keras")), file_kind(Path("w.pt"))
    ('onnx', 'keras', 'tensors')
    """
    suffix = path.suffix.lower()
    if suffix in (kinds := {".onnx": "onnx", ".h5": "keras", ".hdf5": "keras", ".keras": "keras"}):
        return kinds[suffix]
    if suffix or not path.is_file():
        return "tensors"
    return {"onnx": "onnx", "hdf5": "keras", "keras": "keras"}.get(sniff(path), "tensors")


def add_foreign_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags for analysing weights gatelens did not train (``--weights``, ``--vocab``...).

    >>> p = argparse.ArgumentParser(); add_foreign_arguments(p)
    >>> a = p.parse_args(["--weights", "w.pt", "--vocab", "v.json", "--embed-tensor", "emb"])
    >>> a.weights, a.vocab, a.embed_tensor, a.cell
    ('w.pt', 'v.json', 'emb', None)
    """
    g = parser.add_argument_group(
        "weights gatelens did not train",
        "a tensor file and its vocabulary; sizes and cell are read from the tensors")
    g.add_argument("--weights", metavar="FILE",
                   help=".safetensors, or a state_dict saved with torch.save (.pt .pth .bin, "
                        "or no extension), an ONNX graph (.onnx) or a Keras file (.h5 .keras)")
    g.add_argument("--vocab", metavar="FILE",
                   help='characters in index order: a JSON list, {"chars": [...]}, a '
                        "gatelens config.json, or a text file (its sorted characters)")
    g.add_argument("--cell", choices=sorted(GATES), help="default: from the tensor shapes")
    g.add_argument("--prefix", metavar="PREFIX",
                   help="name prefix of the recurrent tensors, e.g. encoder.rnn. "
                        "(default: the only one in the file)")
    g.add_argument("--hidden", type=positive_int, help="default: from weight_hh_l0")
    g.add_argument("--layers", type=count_or_list, metavar="LAYERS", help="default: from "
                   "the highest _lN (with --model DIR: which modules, as --modules)")
    g.add_argument("--embed-tensor", metavar="NAME", dest="embed_tensor",
                   help="embedding tensor (V, E), e.g. embed.weight (default: one-hot input)")
    g.add_argument("--head", metavar="PREFIX",
                   help="prefix of a Linear head, e.g. head. for head.weight/head.bias "
                        "(default: none, the recurrent output is analysed)")
    g.add_argument("--nonlinearity", choices=["tanh", "relu"], help="plain RNN (default tanh)")
    g.add_argument("--recurrent-activation", metavar="NAME", dest="recurrent_activation",
                   help="a Keras weights-only file's recurrent activation (e.g. sigmoid)")


# load_foreign's keyword -> the flag's attribute in the parsed arguments
_FLAGS = {"cell": "cell", "prefix": "prefix", "hidden": "hidden", "layers": "layers",
          "embed": "embed_tensor", "head": "head", "nonlinearity": "nonlinearity",
          "recurrent_activation": "recurrent_activation"}


def foreign_from_args(args: argparse.Namespace) -> ForeignModel:
    """:func:`load_foreign` with the flags of :func:`add_foreign_arguments`.

    >>> foreign_from_args(argparse.Namespace(weights="w.pt", vocab=None))
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: w.pt: --weights needs --vocab FILE (characters in index order)
    """
    if getattr(args, "weights", None) is None:
        raise GatelensError("--weights FILE is needed for a model gatelens did not train")
    if getattr(args, "vocab", None) is None:
        raise GatelensError(f"{args.weights}: --weights needs --vocab FILE "
                            "(characters in index order)")
    given = vars(args)
    if isinstance(given.get("layers"), list):  # a pick of modules: --layers with --model
        raise GatelensError(f"{args.weights}: --layers with --weights is how many layers, a "
                            f"positive integer; got {','.join(map(str, args.layers))}")
    return load_foreign(args.weights, vocab=args.vocab,
                        **{k: given.get(flag) for k, flag in _FLAGS.items()})
