"""``trace_onnx``: each recurrent node traced on what it received when onnxruntime ran.

The model is edited in memory (the file is never written): every LSTM/GRU/RNN node's
inputs X, initial_h, initial_c, sequence_lens and outputs Y, Y_h, Y_c go out as extra
graph outputs, through an Identity each. A node inside an If branch sends them out of its
branch and out of the If node; the other branch sends an empty tensor of the same type in
the same place, so a node whose branch did not run comes back empty and is left out. A
node inside a Loop or Scan body runs once per iteration, and a body's outputs are per
iteration too, so those nodes are not traced (``open_onnx`` still opens them; the reason is
in ``skipped``).

Each node that ran is traced by its module (``open_onnx``) on its own X and initial
state, and the trace is checked against that node's own outputs: every step of Y, and Y_h,
within 1e-5 (float32), Y_c by |Δc| / max(1, |c|); a larger difference raises CheckFailed.
A ``sequence_lens`` of unequal lengths (or shorter than X) is refused: the read-out traces
whole windows.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gatelens.errors import CheckFailed, GatelensError
from gatelens.families.records import nan_max
from gatelens.loaders.onnx_file import load_model, open_nodes
from gatelens.loaders.onnx_graph import Found, recurrent_nodes

#: The node's inputs and outputs that are exposed: (name, input or output, index).
PARTS = {"LSTM": [("X", "in", 0), ("sequence_lens", "in", 4), ("initial_h", "in", 5),
                  ("initial_c", "in", 6), ("Y", "out", 0), ("Y_h", "out", 1),
                  ("Y_c", "out", 2)],
         "GRU": [("X", "in", 0), ("sequence_lens", "in", 4), ("initial_h", "in", 5),
                 ("Y", "out", 0), ("Y_h", "out", 1)]}
PARTS["RNN"] = PARTS["GRU"]
TOL = 1e-5


def _dtype_of(found: Found, model: Any) -> int:
    """The node's float element type (its W's), for the empty stand-ins."""
    from onnx import helper

    from gatelens.loaders.onnx_file import opset
    from gatelens.loaders.onnx_graph import Constants

    w = Constants(*found.graphs, opset=opset(model)).value(found.node.input[1])
    return helper.np_dtype_to_tensor_dtype(w.dtype)


def _expose(model: Any) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """Edit ``model`` in place; {node: {part: graph output name}} and {node: why skipped}."""
    from onnx import TensorProto, helper

    exposed: dict[str, dict[str, str]] = {}
    skipped: dict[str, str] = {}
    for f in recurrent_nodes(model.graph):
        loops = [n for n, _ in f.scope if n.op_type != "If"]
        if loops:
            skipped[f.name] = (f"inside {loops[0].op_type} {loops[0].name!r}, whose body runs "
                               "once per iteration")
            continue
        elem = _dtype_of(f, model)
        node, graph, names = f.node, f.graphs[-1], {}
        n_out = 3 if node.op_type == "LSTM" else 2
        while len(node.output) < n_out:
            node.output.append("")
        for part, kind, k in PARTS[node.op_type]:
            seq = node.input if kind == "in" else node.output
            if kind == "out" and not seq[k]:
                seq[k] = f"gatelens::{f.name}::{part}::own"  # an output the node did not name
            if k >= len(seq) or not seq[k]:
                continue
            out = f"gatelens::{f.name}::{part}"
            graph.node.append(helper.make_node("Identity", [seq[k]], [out]))
            names[part] = (out, TensorProto.INT32 if part == "sequence_lens" else elem)
        # out of every If it is inside, innermost first
        for depth in range(len(f.scope) - 1, -1, -1):
            if_node, branch = f.scope[depth]
            for part, (inner, elem_type) in list(names.items()):
                lifted = inner + f"::{if_node.name or 'If'}{depth}"
                for attr in if_node.attribute:
                    g = attr.g
                    if attr.name == branch:
                        g.output.append(helper.make_tensor_value_info(inner, elem_type, None))
                    else:  # the branch without the node: an empty tensor of the same type
                        empty = inner + "::empty"
                        g.node.append(helper.make_node(
                            "Constant", [], [empty], value=helper.make_tensor(
                                empty, elem_type, [0], [])))
                        g.output.append(helper.make_tensor_value_info(empty, elem_type, None))
                if_node.output.append(lifted)
                names[part] = (lifted, elem_type)  # now a name of the enclosing graph
        for name, elem_type in names.values():
            model.graph.output.append(helper.make_tensor_value_info(name, elem_type, None))
        exposed[f.name] = {part: name for part, (name, _) in names.items()}
    return exposed, skipped


def _batch_first(a: np.ndarray, layout: int) -> Tensor:
    """X (T, B, F) (layout 0) or (B, T, F) (layout 1) -> (B, T, F)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.transpose(0, 1).contiguous() if layout == 0 else t


def _state(a: np.ndarray | None, layout: int) -> Tensor | None:
    """initial_h / initial_c, (D, B, H) (layout 0) or (B, D, H) (layout 1) -> (D, B, H)."""
    if a is None:
        return None
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.transpose(0, 1).contiguous() if layout == 1 else t


def trace_node(name: str, module: nn.Module, got: dict[str, np.ndarray], where: str):
    """The Trace of one node on what it received, checked against its own outputs."""
    import gatelens

    info = module.onnx_node
    layout = info["layout"]
    x = _batch_first(got["X"], layout)  # (B, T, F)
    B, T = x.shape[:2]
    lens = got.get("sequence_lens")
    if lens is not None and bool(np.any(lens != T)):
        raise GatelensError(f"{where}: ONNX node {name!r} received sequence_lens "
                            f"{lens.tolist()} for {T} steps; gatelens traces whole sequences "
                            "(give every sequence the same length, or leave sequence_lens out)")
    h0, c0 = _state(got.get("initial_h"), layout), _state(got.get("initial_c"), layout)
    D = len(module.directions) if hasattr(module, "directions") else 1 + module.bidirectional
    H = module.hidden_size
    zeros = x.new_zeros(D, B, H)
    h0 = zeros if h0 is None else h0
    lstm = info["op"] == "LSTM"
    state = (h0, zeros if c0 is None else c0) if lstm else h0
    tr = gatelens.trace(module, x, state)  # the node's module, through its family
    Y = torch.from_numpy(np.ascontiguousarray(got["Y"]))  # (T, D, B, H) or (B, T, D, H)
    Y = Y.permute(2, 1, 0, 3) if layout == 0 else Y.permute(0, 2, 1, 3)  # (B, D, T, H)
    dirs = getattr(module, "directions", ("forward", "reverse")[:D])
    diff_h = diff_c = 0.0
    for d, direction in enumerate(dirs):
        mine = tr[f"layer0{'.reverse' if direction == 'reverse' else ''}.h"]  # (B, T, H)
        diff_h = nan_max(diff_h, float((mine.double() - Y[:, d].double()).abs().max()))
    finals = {"Y_h": (tr.h_n, False)} | ({"Y_c": (tr.c_n, True)} if lstm else {})
    for part, (mine, scaled) in finals.items():
        ref = _state(got[part], layout).double()  # (D, B, H)
        d = (mine.double() - ref).abs()
        if scaled:
            diff_c = nan_max(diff_c, float((d / ref.abs().clamp(min=1.0)).max()))
        else:
            diff_h = nan_max(diff_h, float(d.max()))
    tr.meta.update({"onnx_node": name, "onnx_max_abs_diff_h": diff_h,
                    "onnx_max_scaled_diff_c": diff_c if lstm else None})
    if not (diff_h <= TOL and diff_c <= TOL):  # a NaN difference never passes
        raise CheckFailed(f"{where}: ONNX node {name!r}: the read-out differs from "
                          f"onnxruntime's own outputs by {nan_max(diff_h, diff_c):.3g} > {TOL:g}")
    return tr


def trace_onnx(path: str | os.PathLike, feeds: dict[str, Any]) -> dict[str, Any]:
    """{node name: Trace} of every recurrent node that ran when onnxruntime ran the file's
    graph on ``feeds`` (graph input name -> array), each on the inputs and initial state it
    received and checked against its own outputs (see the module docstring).

    >>> import tempfile, numpy as np, torch, warnings
    >>> lstm = torch.nn.LSTM(3, 4)
    >>> p = tempfile.mkdtemp() + "/lstm.onnx"
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     torch.onnx.export(lstm, (torch.randn(5, 2, 3),), p, input_names=["x"], dynamo=False)
    >>> traces = trace_onnx(p, {"x": np.random.randn(5, 2, 3).astype(np.float32)})
    >>> [(k, tr["layer0.f"].shape, tr.meta["onnx_max_abs_diff_h"] < 1e-5)
    ...  for k, tr in traces.items()]
    [('/LSTM', torch.Size([2, 5, 4]), True)]
    """
    try:
        import onnxruntime as ort
    except ImportError:
        raise GatelensError("trace_onnx needs the onnx extra: pip install 'gatelens[onnx]'"
                            ) from None
    where = str(path)
    model = load_model(path)
    _, modules = open_nodes(model, where)
    edited = type(model)()
    edited.CopyFrom(model)
    exposed, skipped = _expose(edited)
    try:
        sess = ort.InferenceSession(edited.SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        values = dict(zip(names, sess.run(None, {k: np.asarray(v) for k, v in feeds.items()}),
                          strict=True))
    except Exception as e:  # onnxruntime's errors carry no common type
        text = " ".join(str(e).split())[:200]
        raise GatelensError(f"{where}: onnxruntime could not run the graph on these feeds "
                            f"({type(e).__name__}: {text})") from None
    out = {}
    for name, parts in exposed.items():
        got = {part: values[n] for part, n in parts.items()}
        if got["X"].ndim != 3:  # the empty stand-in: this node's branch did not run
            continue
        out[name] = trace_node(name, modules[name], got, where)
    for name, why in skipped.items():
        for tr in out.values():
            tr.meta.setdefault("onnx_not_traced", {})[name] = why
    return out
