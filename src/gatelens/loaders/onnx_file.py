"""ONNX files: every LSTM, GRU and RNN node as a module (docs/formats.md).

``open_onnx(path)`` reads the file with ``onnx`` (the ``onnx`` extra), finds every
recurrent node of the main graph and of every If/Loop/Scan subgraph, folds its weights to
their values, and builds:

- an exact ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` (batch first) where one exists: LSTM with
  the default activations and no peepholes (gate order i, o, f, c reordered to PyTorch's
  i, f, g, o; B = [Wb, Rb] as b_ih, b_hh), GRU with ``linear_before_reset = 1`` (z, r, h
  reordered to r, z, n), RNN with Tanh or Relu; direction forward or bidirectional;
- a ``VariantLSTM`` / ``VariantGRU`` (cells/variants.py) where none does: an LSTM with
  peepholes P = [p_i, p_o, p_f] (an all-zero P is no peephole), a GRU with
  ``linear_before_reset = 0`` (the ONNX default), and a reverse-only LSTM or GRU (PyTorch
  has no reverse-only module; the variant holds one direction named ``reverse``, traced as
  ``layer0.reverse.*``).

Every module is batch first whatever the node's ``layout``; ``module.onnx_node`` records
the node's op, layout, direction and the subgraphs it is inside. Anything else (``clip``,
``input_forget = 1``, non-default activations, ``activation_alpha``/``beta``, an unknown
attribute, a reverse-only RNN, weights that are not constants, a dtype other than float32
or float64) is a one-line GatelensError naming the node and what it has.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gatelens.cells.variants import VariantGRU, VariantLSTM
from gatelens.errors import GatelensError
from gatelens.loaders.onnx_graph import Constants, Found, recurrent_nodes

#: ONNX gate blocks in PyTorch's chunk order: LSTM i, o, f, c -> i, f, g(=c), o;
#: GRU z, r, h -> r, z, n; RNN one block.
ORDER = {"LSTM": (0, 2, 3, 1), "GRU": (1, 0, 2), "RNN": (0,)}
DEFAULT_ACTIVATIONS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"),
                       "RNN": ("Tanh",)}
KNOWN = {"LSTM": {"hidden_size", "direction", "layout", "activations", "clip",
                  "input_forget", "activation_alpha", "activation_beta"},
         "GRU": {"hidden_size", "direction", "layout", "activations", "clip",
                 "linear_before_reset", "activation_alpha", "activation_beta"},
         "RNN": {"hidden_size", "direction", "layout", "activations", "clip",
                 "activation_alpha", "activation_beta"}}
DIRECTIONS = {"forward": ("forward",), "reverse": ("reverse",),
              "bidirectional": ("forward", "reverse")}


def _need_onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise GatelensError("reading ONNX files needs the onnx extra: "
                            "pip install 'gatelens[onnx]'") from None
    return onnx


def load_model(path: str | os.PathLike) -> Any:
    """The ModelProto of an ONNX file; a one-line GatelensError for an unreadable one."""
    onnx = _need_onnx()
    p = Path(path)
    if not p.is_file():
        raise GatelensError(f"{p}: no such file")
    try:
        return onnx.load(str(p))
    except Exception as e:  # protobuf's DecodeError and onnx's own errors
        raise GatelensError(f"{p}: not a readable ONNX file ({type(e).__name__})") from None


def opset(model: Any) -> int:
    """The model's default-domain opset."""
    return next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)


def _attrs(found: Found, where: str) -> dict[str, Any]:
    from onnx import helper

    node, op = found.node, found.node.op_type
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    for key, v in attrs.items():
        if isinstance(v, bytes):
            attrs[key] = v.decode()
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            attrs[key] = [s.decode() for s in v]
    bad = sorted(set(attrs) - KNOWN[op])
    refuse = f"{where}: ONNX node {found.name!r} ({op}): attribute"
    if bad:
        raise GatelensError(f"{refuse} {bad[0]!r} is not one gatelens knows")
    if "clip" in attrs:
        raise GatelensError(f"{refuse} clip = {attrs['clip']:g} is not supported (gatelens "
                            "reads cells without cell clipping)")
    if attrs.get("input_forget", 0):
        raise GatelensError(f"{refuse} input_forget = 1 is not supported (coupled input and "
                            "forget gates)")
    for key in ("activation_alpha", "activation_beta"):
        if key in attrs:
            raise GatelensError(f"{refuse} {key} = {attrs[key]} is not supported (only the "
                                "default activations are)")
    direction = attrs.get("direction", "forward")
    if direction not in DIRECTIONS:
        raise GatelensError(f"{refuse} direction = {direction!r} is not forward, reverse or "
                            "bidirectional")
    acts = tuple(attrs.get("activations", ()))
    per = len(DEFAULT_ACTIVATIONS[op])
    if op == "RNN" and acts:
        ok = acts in (("Tanh",) * len(acts), ("Relu",) * len(acts)) and len(acts) in (1, 2)
    else:
        ok = not acts or acts == DEFAULT_ACTIVATIONS[op] * (len(acts) // per)
    if not ok:
        raise GatelensError(f"{refuse} activations = {list(acts)} is not supported (gatelens "
                            f"reads {op} with {list(DEFAULT_ACTIVATIONS[op])}"
                            + (" or Relu" if op == "RNN" else "") + ")")
    if "hidden_size" not in attrs:
        raise GatelensError(f"{refuse} hidden_size is missing")
    return attrs


def _weight(consts: Constants, found: Found, index: int, what: str, where: str,
            shape: tuple[int, ...] | None) -> np.ndarray | None:
    """Input ``index`` of the node folded to its value (None when absent), shape checked."""
    node = found.node
    if index >= len(node.input) or not node.input[index]:
        return None
    try:
        v = consts.value(node.input[index])
    except GatelensError as e:
        raise GatelensError(f"{where}: ONNX node {found.name!r}: {what} {e}") from None
    if v.dtype not in (np.float32, np.float64):
        raise GatelensError(f"{where}: ONNX node {found.name!r}: {what} is {v.dtype}; gatelens "
                            "reads float32 and float64 models")
    if shape is not None and tuple(v.shape) != shape:
        raise GatelensError(f"{where}: ONNX node {found.name!r}: {what} has shape "
                            f"{tuple(v.shape)}, expected {shape}")
    return v


def _check_lengths(found: Found, consts: Constants, where: str) -> None:
    """A constant ``sequence_lens`` is refused: onnxruntime runs each sequence only that
    many steps (and a batch of that size only), while a module of the node reads whole
    windows of any batch, so an analysis would read steps the runtime never runs (it was
    "passed" for [2, 2] on windows of 24). One a graph input gives is the caller's, checked
    where it runs (``trace_onnx``); an analysis feeds whole windows."""
    node = found.node
    if len(node.input) <= 4 or not node.input[4]:
        return
    try:
        lens = consts.value(node.input[4])
    except GatelensError:  # from a graph input
        return
    shown = np.asarray(lens).reshape(-1).tolist()
    raise GatelensError(f"{where}: ONNX node {found.name!r}: sequence_lens is the constant "
                        f"{shown[:8]}{' ...' if len(shown) > 8 else ''}: onnxruntime runs each "
                        "sequence that many steps (a batch of that size only), gatelens reads "
                        "whole windows; export the node without a constant sequence_lens")


def _blocks(a: np.ndarray, op: str, H: int) -> np.ndarray:
    """Rows of (D, G·H, ·) (or (D, G·H)) in PyTorch's chunk order."""
    return np.concatenate([a[:, k * H : (k + 1) * H] for k in ORDER[op]], axis=1)


def build_module(found: Found, consts: Constants, where: str = "") -> nn.Module:
    """The module of one recurrent node (see the module docstring)."""
    op = found.node.op_type
    attrs = _attrs(found, where)
    H, dirs = int(attrs["hidden_size"]), DIRECTIONS[attrs.get("direction", "forward")]
    D, G = len(dirs), len(ORDER[op]) * int(attrs["hidden_size"])
    W = _weight(consts, found, 1, "W", where, None)
    if W is None or W.ndim != 3 or W.shape[:2] != (D, G):
        got = None if W is None else tuple(W.shape)
        raise GatelensError(f"{where}: ONNX node {found.name!r}: W has shape {got}, expected "
                            f"({D}, {G}, input size)")
    R = _weight(consts, found, 2, "R", where, (D, G, H))
    B = _weight(consts, found, 3, "B", where, (D, 2 * G))
    P = _weight(consts, found, 7, "P", where, (D, 3 * H)) if op == "LSTM" else None
    _check_lengths(found, consts, where)
    if B is None:
        B = np.zeros((D, 2 * G), W.dtype)
    if len({a.dtype for a in (W, R, B) if a is not None} | ({P.dtype} if P is not None
                                                             else set())) > 1:
        raise GatelensError(f"{where}: ONNX node {found.name!r}: W, R, B (and P) differ in dtype")
    w_ih, w_hh = _blocks(W, op, H), _blocks(R, op, H)
    b_ih, b_hh = _blocks(B[:, :G], op, H), _blocks(B[:, G:], op, H)
    peep = P is not None and bool(np.any(P != 0))
    lbr = bool(attrs.get("linear_before_reset", 0))
    I = W.shape[2]
    if op == "RNN":
        if dirs == ("reverse",):
            raise GatelensError(f"{where}: ONNX node {found.name!r} (RNN): a reverse-only RNN "
                                "node is not supported (PyTorch has no reverse-only RNN)")
        acts = attrs.get("activations", ["Tanh"])
        mod: nn.Module = nn.RNN(I, H, nonlinearity=acts[0].lower(), batch_first=True,
                                bidirectional=D == 2)
    elif dirs != ("reverse",) and not peep and (op == "LSTM" or lbr):
        mod = (nn.LSTM if op == "LSTM" else nn.GRU)(I, H, batch_first=True, bidirectional=D == 2)
    elif op == "LSTM":
        mod = VariantLSTM(I, H, directions=dirs, peepholes=peep)
    else:
        mod = VariantGRU(I, H, directions=dirs, reset_after=lbr)
    _assign(mod, w_ih, w_hh, b_ih, b_hh, P[:, _peephole_order(H)] if peep else None)
    mod.eval()
    mod.onnx_node = {"op": op, "layout": int(attrs.get("layout", 0)), "direction":
                     attrs.get("direction", "forward"), "peepholes": peep,
                     "linear_before_reset": lbr if op == "GRU" else None,
                     "inside": [f"{n.op_type} {n.name!r} ({a})" for n, a in found.scope]}
    return mod


def _peephole_order(H: int) -> list[int]:
    """P = [p_i, p_o, p_f] -> VariantLSTM's (p_i, p_f, p_o)."""
    return [k * H + j for k in (0, 2, 1) for j in range(H)]


def _assign(mod: nn.Module, w_ih, w_hh, b_ih, b_hh, peep) -> None:
    dtype = torch.float64 if w_ih.dtype == np.float64 else torch.float32
    mod.to(dtype)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dtype)  # noqa: E731
    with torch.no_grad():
        if isinstance(mod, nn.RNNBase):
            for d, sfx in enumerate(["_l0", "_l0_reverse"][: w_ih.shape[0]]):
                for name, a in (("weight_ih", w_ih), ("weight_hh", w_hh), ("bias_ih", b_ih),
                                ("bias_hh", b_hh)):
                    getattr(mod, name + sfx).copy_(t(a[d]))
            return
        for name, a in (("weight_ih", w_ih), ("weight_hh", w_hh), ("bias_ih", b_ih),
                        ("bias_hh", b_hh)):
            getattr(mod, name).copy_(t(a))
        if peep is not None:
            mod.peephole.copy_(t(peep))


def open_nodes(model: Any, where: str = "") -> tuple[list[Found], dict[str, nn.Module]]:
    """The recurrent nodes of a ModelProto and their modules, by node name."""
    found = recurrent_nodes(model.graph)
    if not found:
        raise GatelensError(f"{where}: no LSTM, GRU or RNN node in the ONNX graph")
    mods = {}
    for f in found:
        consts = Constants(*f.graphs, opset=opset(model))
        mods[f.name] = build_module(f, consts, where)
    return found, mods


def open_onnx(path: str | os.PathLike) -> dict[str, nn.Module]:
    """Every LSTM, GRU and RNN node of an ONNX file, by node name, as a module.

    >>> import tempfile, numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper, save
    >>> W = numpy_helper.from_array(np.random.rand(1, 6, 2).astype(np.float32), "W")
    >>> R = numpy_helper.from_array(np.random.rand(1, 6, 2).astype(np.float32), "R")
    >>> node = helper.make_node("GRU", ["X", "W", "R"], ["Y"], name="gru", hidden_size=2)
    >>> g = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", 1, None)],
    ...                       [helper.make_tensor_value_info("Y", 1, None)], [W, R])
    >>> p = tempfile.mkdtemp() + "/m.onnx"; save(helper.make_model(g), p)
    >>> {k: type(m).__name__ for k, m in open_onnx(p).items()}
    {'gru': 'VariantGRU'}
    """
    return open_nodes(load_model(path), str(path))[1]
