"""Keras files: every LSTM and GRU layer as a module (docs/formats.md).

``open_keras(path)`` reads a ``.keras`` or ``.h5`` file of Keras 2 or 3 with h5py and
zipfile (``keras_read.py``) and builds, per recurrent layer (by layer name):

- an exact ``nn.LSTM`` for an LSTM with recurrent activation sigmoid and activation tanh,
  and for a CuDNNLSTM (bias 8H = [input half, recurrent half]); Keras' gate order i, f, c, o
  is PyTorch's i, f, g, o; kernel (I, 4H) and recurrent kernel (H, 4H) transposed (a CuDNN
  layer's gate blocks are cuDNN's own matrices, read as cuDNN reads them: ``_cudnn_rows``);
- an exact ``nn.GRU`` for a GRU with ``reset_after = True`` and sigmoid/tanh (bias (2, 3H):
  input and recurrent halves), and for a CuDNNGRU (bias 6H); Keras' z, r, h reordered to
  r, z, n (z keeps in both);
- a ``VariantLSTM`` / ``VariantGRU`` (cells/variants.py) for any other recurrent activation
  or activation of Keras' set, and for a GRU with ``reset_after = False`` (bias (3H,),
  the recurrent kernel applied to r ⊙ h).

``hard_sigmoid`` is read by the file's Keras version: Keras 1 and 2 clip(0.2·x + 0.5, 0, 1)
(``hard_sigmoid_v2``), Keras 3 clip(x/6 + 0.5, 0, 1); ``module.keras_layer`` records the
version and the definition used. A Bidirectional layer is one module under the wrapper's
name (``layer0.*`` forward, ``layer0.reverse.*`` backward). A weights-only file has no
configuration: an LSTM bias of 8H (GRU 6H) is CuDNN's; any other layer needs
``recurrent_activation=`` (its activation is taken as tanh), or it is refused.

A model with a mask (an Embedding with ``mask_zero``, a Masking layer) skips the masked
steps, state carried unchanged; a module alone computes every step. ``keras_layer["mask"]``
names the layer, and an analysis of the file (``file_parts``) refuses windows the mask
would change: with the masking Embedding as ``--embed-tensor``, any window holding id 0;
any other masking layer, in one line at the start.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import nn

from gatelens.cells.variants import ACTIVATIONS, VariantGRU, VariantLSTM
from gatelens.errors import GatelensError
from gatelens.loaders.keras_read import RECURRENT, KerasFile, masking_layer, read_keras

HARD_SIGMOID = {"hard_sigmoid": "clip(x/6 + 0.5, 0, 1) (Keras 3)",
                "hard_sigmoid_v2": "clip(0.2·x + 0.5, 0, 1) (Keras 1-2)"}


def _activation(name: Any, version: str | None, where: str, what: str) -> str:
    """The cells/variants.py name of a Keras activation, by the file's Keras version."""
    if isinstance(name, dict):  # a serialised activation: only a named built-in one
        name = name.get("config") if isinstance(name.get("config"), str) else name
    if not isinstance(name, str):
        raise GatelensError(f"{where}: {what} is {name!r}, not a named Keras activation")
    if name == "hard_sigmoid" and version is not None and version.split(".")[0] in ("1", "2"):
        return "hard_sigmoid_v2"
    if name not in ACTIVATIONS or name == "hard_sigmoid_v2":
        known = ", ".join(sorted(set(ACTIVATIONS) - {"hard_sigmoid_v2"}))
        raise GatelensError(f"{where}: {what} {name!r} is not an elementwise Keras activation "
                            f"gatelens computes ({known})")
    return name


def _layer_facts(name: str, kf: KerasFile, given: str | None, where: str) -> dict[str, Any]:
    """class, recurrent activation, activation, reset_after, use_bias of one layer."""
    weights = kf.weights[name]
    fw = weights["forward"]
    H = fw["recurrent_kernel"].shape[0]
    G = fw["recurrent_kernel"].shape[1] // max(H, 1)
    if G not in (3, 4) or fw["recurrent_kernel"].shape[1] != G * H:
        raise GatelensError(f"{where}: layer {name!r}: recurrent kernel of shape "
                            f"{fw['recurrent_kernel'].shape} is neither an LSTM's (H, 4H) nor a "
                            "GRU's (H, 3H)")
    kind = "LSTM" if G == 4 else "GRU"
    bias = fw.get("bias")
    cudnn = bias is not None and bias.ndim == 1 and bias.shape[0] == 2 * G * H
    if kf.configs is None:  # weights only: what the shapes tell, and what the caller says
        if cudnn:
            return {"class": "CuDNN" + kind, "kind": kind, "rec": "sigmoid", "act": "tanh",
                    "reset_after": True, "cudnn": True}
        if given is None:
            raise GatelensError(
                f"{where}: layer {name!r} ({kind}, bias {None if bias is None else bias.shape}) "
                "in a weights-only file: its recurrent activation cannot be known; pass "
                "recurrent_activation= (e.g. 'sigmoid' for Keras >= 2.3, 'hard_sigmoid' "
                "before)")
        return {"class": kind, "kind": kind, "act": "tanh", "cudnn": False,
                "rec": _activation(given, kf.version, where, "recurrent_activation"),
                "reset_after": kind == "GRU" and bias is not None and bias.ndim == 2}
    layer = kf.configs.get(name)
    if layer is None:
        raise GatelensError(f"{where}: weights of {name!r} have no layer of that name in the "
                            "model config")
    cls, cfg = layer.get("class_name"), layer.get("config", {})
    if cls == "Bidirectional":
        inner = cfg.get("layer", {})
        back = cfg.get("backward_layer")
        icfg = inner.get("config", {})
        if back is not None and any(back.get("config", {}).get(k) != icfg.get(k) for k in
                                    ("activation", "recurrent_activation", "reset_after")):
            raise GatelensError(f"{where}: Bidirectional {name!r}: its backward layer has other "
                                "activations than its forward layer; gatelens reads one set")
        cls, cfg = inner.get("class_name"), icfg
    if cls not in RECURRENT:
        raise GatelensError(f"{where}: layer {name!r} is a {cls}, not one of {RECURRENT}")
    if not cls.endswith(kind):
        raise GatelensError(f"{where}: layer {name!r} is a {cls} but its recurrent kernel "
                            f"{fw['recurrent_kernel'].shape} is a {kind}'s")
    if cfg.get("go_backwards") and layer.get("class_name") != "Bidirectional":
        raise GatelensError(f"{where}: layer {name!r} has go_backwards=True (it reads and returns "
                            "the sequence reversed); gatelens opens it inside a Bidirectional only")
    cudnn = cls.startswith("CuDNN")
    rec = "sigmoid" if cudnn else _activation(cfg.get("recurrent_activation", "sigmoid"),
                                              kf.version, where, f"layer {name!r}: "
                                              "recurrent_activation")
    act = "tanh" if cudnn else _activation(cfg.get("activation", "tanh"), kf.version, where,
                                           f"layer {name!r}: activation")
    if given is not None and _activation(given, kf.version, where, "recurrent_activation") != rec:
        raise GatelensError(f"{where}: layer {name!r} has recurrent_activation {rec!r} in its "
                            f"config, not {given!r}")
    reset_after = True if cudnn else bool(cfg.get("reset_after", False))
    return {"class": layer.get("class_name"), "kind": kind, "rec": rec, "act": act,
            "reset_after": reset_after, "cudnn": cudnn,
            "merge_mode": cfg.get("merge_mode") if layer.get("class_name") == "Bidirectional"
            else None}


def _biases(w: dict[str, np.ndarray], facts: dict, G: int, where: str, name: str
            ) -> tuple[np.ndarray, np.ndarray]:
    """(b_ih, b_hh) in Keras' gate order, (G,) each."""
    bias, dtype = w.get("bias"), w["kernel"].dtype
    if bias is None:
        return np.zeros(G, dtype), np.zeros(G, dtype)
    if facts["cudnn"] and bias.shape == (2 * G,):
        return bias[:G], bias[G:]
    if facts["kind"] == "GRU" and facts["reset_after"] and bias.shape == (2, G):
        return bias[0], bias[1]
    if bias.shape == (G,) and not (facts["kind"] == "GRU" and facts["reset_after"]):
        return bias, np.zeros(G, dtype)
    raise GatelensError(f"{where}: layer {name!r}: bias of shape {bias.shape} does not fit a "
                        f"{facts['class']} with {G // (4 if facts['kind'] == 'LSTM' else 3)} units"
                        f"{' and reset_after=True' if facts['reset_after'] else ''}")


def _rows(a: np.ndarray, kind: str, H: int) -> np.ndarray:
    """Gate blocks (first axis) in PyTorch's order: LSTM as is, GRU z, r, h -> r, z, n."""
    if kind == "LSTM":
        return a
    return np.concatenate([a[k * H : (k + 1) * H] for k in (1, 0, 2)], axis=0)


def _cudnn_rows(w: dict[str, np.ndarray], gates: int, I: int, H: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """(W_ih, W_hh) of a CuDNN layer, (gates·H, I) and (gates·H, H), Keras' gate order.

    Keras 2's CuDNNLSTM/CuDNNGRU hand each gate's (I, H) kernel block to cuDNN flattened in
    row-major order as cuDNN's (H, I) matrix: the gate computes ``k.reshape(H, I) @ x``, and
    its (H, H) recurrent block ``r @ h`` (Keras 2's ``preprocess_weights_for_loading``
    converts them for an LSTM as ``k.T.reshape(k.shape, order="F")`` and ``r.T``)."""
    k, r = w["kernel"], w["recurrent_kernel"]
    return (np.concatenate([k[:, g * H : (g + 1) * H].reshape(H, I) for g in range(gates)]),
            np.concatenate([r[:, g * H : (g + 1) * H] for g in range(gates)]))


def build_layer(name: str, kf: KerasFile, recurrent_activation: str | None = None) -> nn.Module:
    """The module of one recurrent layer of ``kf`` (see the module docstring)."""
    where = kf.path
    facts = _layer_facts(name, kf, recurrent_activation, where)
    dirs = [d for d in ("forward", "backward") if d in kf.weights[name]]
    fw = kf.weights[name]["forward"]
    I, H = fw["kernel"].shape[0], fw["recurrent_kernel"].shape[0]
    kind, G = facts["kind"], fw["recurrent_kernel"].shape[1]
    parts = {k: [] for k in ("w_ih", "w_hh", "b_ih", "b_hh")}
    for d in dirs:
        w = kf.weights[name][d]
        if set(w) < {"kernel", "recurrent_kernel"} or w["kernel"].shape != (I, G) or \
                w["recurrent_kernel"].shape != (H, G):
            raise GatelensError(f"{where}: layer {name!r} ({d}): kernel "
                                f"{w.get('kernel', np.empty(0)).shape} and recurrent kernel "
                                f"{w.get('recurrent_kernel', np.empty(0)).shape} do not fit "
                                f"({I}, {G}) and ({H}, {G})")
        if w["kernel"].dtype not in (np.float32, np.float64):
            raise GatelensError(f"{where}: layer {name!r} is {w['kernel'].dtype}; gatelens "
                                "reads float32 and float64 weights")
        b_ih, b_hh = _biases(w, facts, G, where, name)
        w_ih, w_hh = (_cudnn_rows(w, G // H, I, H) if facts["cudnn"] else
                      (w["kernel"].T, w["recurrent_kernel"].T))
        for key, a in (("w_ih", w_ih), ("w_hh", w_hh),
                       ("b_ih", b_ih), ("b_hh", b_hh)):
            parts[key].append(_rows(a, kind, H))
    exact = facts["rec"] == "sigmoid" and facts["act"] == "tanh" and (
        kind == "LSTM" or facts["reset_after"])
    directions = ("forward", "reverse")[: len(dirs)]
    if exact:
        mod: nn.Module = (nn.LSTM if kind == "LSTM" else nn.GRU)(
            I, H, batch_first=True, bidirectional=len(dirs) == 2)
    elif kind == "LSTM":
        mod = VariantLSTM(I, H, directions=directions, recurrent_activation=facts["rec"],
                          activation=facts["act"])
    else:
        mod = VariantGRU(I, H, directions=directions, recurrent_activation=facts["rec"],
                         activation=facts["act"], reset_after=facts["reset_after"])
    dtype = torch.float64 if fw["kernel"].dtype == np.float64 else torch.float32
    mod.to(dtype)
    with torch.no_grad():
        for key, name_pt in (("w_ih", "weight_ih"), ("w_hh", "weight_hh"), ("b_ih", "bias_ih"),
                             ("b_hh", "bias_hh")):
            for d, a in enumerate(parts[key]):
                t = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
                if exact:
                    getattr(mod, f"{name_pt}_l0{'_reverse' if d else ''}").copy_(t)
                else:
                    getattr(mod, name_pt)[d].copy_(t)
    mod.eval()
    mod.keras_layer = {
        "class": facts["class"], "keras_version": kf.version, "file_form": kf.form,
        "recurrent_activation": facts["rec"], "activation": facts["act"],
        "reset_after": facts["reset_after"] if kind == "GRU" else None,
        "merge_mode": facts.get("merge_mode"),
        "definition": HARD_SIGMOID.get(facts["rec"], facts["rec"])}
    return mod


def _inferred(name: str, mod: nn.Module, alone: str) -> str:
    """What a weights-only file's layer was read as, and from what (one line)."""
    info = mod.keras_layer
    if info["class"].startswith("CuDNN"):
        how = ("bias of 2 x 4H (GRU 2 x 3H): CuDNN's input and recurrent biases, both added; "
               "sigmoid and tanh, CuDNN's only activations")
    else:
        how = (f"recurrent activation {info['recurrent_activation']} as given, activation "
               "tanh assumed" + ("" if info["reset_after"] is None else
                                 f", reset_after={info['reset_after']} from the bias's shape"))
    return (f"weights-only file (no model_config): layer {name!r} read by its group name as "
            f"{info['class']} from its weights' shapes ({how}); no mask applied (an Embedding's"
            " mask_zero or a Masking layer is not in the weights: if the model had one, Keras "
            "skipped the masked steps this read-out reads)"
            + (f"; layers with weights, not recurrent, left alone: {alone}" if alone else ""))


def open_keras(path: str | os.PathLike, recurrent_activation: str | None = None
               ) -> dict[str, nn.Module]:
    """Every LSTM and GRU layer of a Keras file, by layer name, as a module.

    ``recurrent_activation`` names the recurrent activation of a weights-only file's
    layers (a file with a model config says it itself; given, it is checked against it).

    >>> import tempfile, h5py, numpy as np
    >>> p = tempfile.mkdtemp() + "/cudnn.h5"
    >>> with h5py.File(p, "w") as f:
    ...     f.attrs["layer_names"] = [b"lstm"]; f.attrs["keras_version"] = b"2.2.4"
    ...     g = f.create_group("lstm")
    ...     g.attrs["weight_names"] = [b"lstm/kernel:0", b"lstm/recurrent_kernel:0",
    ...                                b"lstm/bias:0"]
    ...     for n, s in (("kernel:0", (3, 8)), ("recurrent_kernel:0", (2, 8)), ("bias:0", (16,))):
    ...         _ = g.create_dataset("lstm/" + n, data=np.ones(s, np.float32))
    >>> m = open_keras(p)["lstm"]
    >>> type(m).__name__, m.keras_layer["class"], float(m.bias_hh_l0.detach().sum())
    ('LSTM', 'CuDNNLSTM', 8.0)
    """
    kf = read_keras(path)
    alone = "; ".join(f"{k} ({v})" for k, v in kf.skipped.items())
    if not kf.weights:
        raise GatelensError(f"{path}: no LSTM or GRU layer with weights in this Keras file"
                            + (f"; layers with weights, left alone: {alone}" if alone else ""))
    mods = {name: build_layer(name, kf, recurrent_activation) for name in kf.weights}
    for name, mod in mods.items():
        mod.keras_layer["left_alone"] = dict(kf.skipped)
        weights_only = kf.configs is None
        mod.keras_layer["inferred"] = _inferred(name, mod, alone) if weights_only else None
    mask = masking_layer(kf.configs)
    for mod in mods.values():  # Keras skips masked steps; the module alone does not
        mod.keras_layer["mask"] = None if mask is None else {"layer": mask[0], "how": mask[1]}
    return mods
