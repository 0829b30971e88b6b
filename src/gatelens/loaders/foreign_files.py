"""``gatelens analyze --weights`` for an ONNX graph or a Keras file: the parts of a
ForeignModel (lens/foreign.py), read from the file.

The recurrent module is the node (ONNX) or layer (Keras) named by ``--prefix``, or the
only one. The input is one-hot over the vocabulary, or ``--embed-tensor``: an ONNX
initializer (or folded constant) of shape (V, E), or a Keras Embedding layer by name. The
head, ``--head``: ONNX tensors ``{prefix}weight`` (V, D) and ``{prefix}bias`` (the names
torch.onnx gives an nn.Linear's parameters in a Gemm), or a Keras Dense layer by name (its
kernel (D, V) transposed). A vocabulary shorter than the input gets ``<unused k>`` rows and
a note; so does a Keras layer whose hard_sigmoid definition depends on the version.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gatelens.errors import GatelensError
from gatelens.lens.foreign_io import extend_vocab, read_vocab


def _choose(mods: dict[str, nn.Module], prefix: str | None, path: Path, what: str) -> str:
    listed = ", ".join(repr(n) for n in mods)
    if prefix is not None:
        name = prefix[:-1] if prefix.endswith(".") and prefix[:-1] in mods else prefix
        if name not in mods:
            raise GatelensError(f"{path}: no {what} {name!r} (--prefix); {what}s here: {listed}")
        return name
    if len(mods) > 1:
        raise GatelensError(f"{path}: {len(mods)} recurrent {what}s ({listed}); pass --prefix "
                            f"with the {what}'s name to choose one")
    return next(iter(mods))


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)


def _open(path: Path, kind: str, recurrent_activation: str | None) -> tuple[dict, Any]:
    """The file's recurrent modules, and a lookup of other arrays by name."""
    if kind == "onnx":
        from gatelens.loaders.onnx_file import load_model, open_nodes, opset
        from gatelens.loaders.onnx_graph import Constants

        model = load_model(path)
        consts = Constants(model.graph, opset=opset(model))

        def onnx_arrays(name: str, role: str) -> list[np.ndarray]:
            if role == "head":
                head = name if name.endswith(".") or not name else name + "."
                found = []
                for key in ("weight", "bias"):
                    try:
                        found.append(consts.value(head + key))
                    except GatelensError:
                        if key == "weight":
                            raise GatelensError(f"{path}: no constant '{head}weight' (--head)"
                                                ) from None
                return found
            try:
                return [consts.value(name)]
            except GatelensError:
                raise GatelensError(f"{path}: no constant {name!r} (--embed-tensor)") from None

        return open_nodes(model, str(path))[1], onnx_arrays
    from gatelens.loaders.keras_file import open_keras
    from gatelens.loaders.keras_read import layer_arrays

    def keras_arrays(name: str, role: str) -> list[np.ndarray]:
        arrays = layer_arrays(path, name)
        return [arrays[0].T] + arrays[1:2] if role == "head" else arrays[:1]

    return open_keras(path, recurrent_activation), keras_arrays


def _note(name: str, mod: nn.Module, kind: str) -> str:
    what = "ONNX node" if kind == "onnx" else "Keras layer"
    info = getattr(mod, "keras_layer", None) or getattr(mod, "onnx_node", {})
    text = f"{what} '{name}' read as {type(mod).__name__}"
    if hasattr(mod, "directions"):
        text += (f" (a gatelens cell: recurrent activation {mod.recurrent_activation}, "
                 f"activation {mod.activation})")
    else:
        text += " (exact)"
    if info.get("definition", "").startswith("clip"):
        text += (f"; hard_sigmoid = {info['definition']}, from the file's Keras version "
                 f"{info.get('keras_version')}")
    if info.get("inferred"):
        text += f"; {info['inferred']}"
    return text


def file_parts(path: Path, kind: str, *, vocab: Any, prefix: str | None = None,
               embed: str | None = None, head: str | None = None,
               recurrent_activation: str | None = None) -> dict[str, Any]:
    """ForeignModel's keyword arguments (but ``source``) for one node or layer of a file."""
    mods, arrays = _open(path, kind, recurrent_activation)
    name = _choose(mods, prefix, path, "node" if kind == "onnx" else "layer")
    rnn = mods[name]
    dtype, n_in = rnn.weight_ih_l0.dtype, rnn.input_size
    chars = read_vocab(vocab)
    mask = (getattr(rnn, "keras_layer", None) or {}).get("mask")
    if mask is not None and (mask["how"] != "mask_zero" or embed != mask["layer"]):
        raise GatelensError(
            f"{path}: Keras layer {mask['layer']!r} ({mask['how']}) masks the steps {name!r} "
            "reads, which the read-out of the layer alone does not apply"
            + ("" if mask["how"] != "mask_zero" else
               f"; pass --embed-tensor {mask['layer']} so windows holding id 0 are refused"))
    emb = None
    if embed is not None:
        (table,) = arrays(embed, "embed")
        if table.ndim != 2 or table.shape[1] != n_in or table.shape[0] < len(chars):
            raise GatelensError(f"{path}: embedding {embed!r} has shape {table.shape}; "
                                f"{name!r} reads {n_in} features and {vocab} has "
                                f"{len(chars)} characters")
        emb = nn.Embedding(*table.shape, dtype=dtype)
        with torch.no_grad():
            emb.weight.copy_(_tensor(table, dtype))
    elif n_in < len(chars):
        raise GatelensError(f"{path}: {name!r} reads {n_in} features, fewer than the "
                            f"{len(chars)} characters of {vocab} (one-hot input); pass "
                            "--embed-tensor if the model has an embedding")
    chars, notes = extend_vocab(chars, n_in if emb is None else emb.num_embeddings,
                                "the one-hot input" if emb is None else f"embedding {embed!r}")
    lin = None
    if head is not None:
        w, *b = arrays(head, "head")
        d_out = (1 + rnn.bidirectional) * rnn.hidden_size
        if w.shape != (len(chars), d_out) or (b and b[0].shape != (len(chars),)):
            raise GatelensError(f"{path}: head {head!r} has weight {w.shape}"
                                f"{f' and bias {b[0].shape}' if b else ''}; expected "
                                f"({len(chars)}, {d_out}) for {len(chars)} characters and "
                                f"{d_out} features a step from {name!r}")
        lin = nn.Linear(d_out, len(chars), bias=bool(b), dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(_tensor(w, dtype))
            if b:
                lin.bias.copy_(_tensor(b[0], dtype))
    return {"rnn": rnn, "vocab": chars, "embed": emb, "head": lin, "prefix": name,
            "embed_name": embed,
            "head_prefix": None if head is None else head.rstrip(".") + ("." if kind == "onnx"
                                                                         else "/"),
            "notes": [_note(name, rnn, kind), *notes],
            "masked_id": None if mask is None else 0}
