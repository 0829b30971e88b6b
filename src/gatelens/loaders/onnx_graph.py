"""An ONNX graph's recurrent nodes, wherever they sit, and the constant values they read.

``recurrent_nodes`` walks the main graph and every subgraph (If branches, Loop and Scan
bodies, nested), so a node in a branch that a given input never takes is found too.
``Constants`` gives the value of any name that does not depend on a graph input: an
initializer, a Constant node, or a node of constant inputs folded to its value (the usual
ops numpy-side, any other through onnx's reference evaluator), looked up through the
enclosing graphs as ONNX scoping does.

>>> import numpy as np
>>> from onnx import helper, numpy_helper
>>> w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
>>> g = helper.make_graph([helper.make_node("Transpose", ["w"], ["wt"])], "g", [], [], [w])
>>> Constants(g).value("wt").shape
(3, 2)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gatelens.errors import GatelensError

RECURRENT_OPS = ("LSTM", "GRU", "RNN")
SUBGRAPH_ATTRS = {"If": ("then_branch", "else_branch"), "Loop": ("body",), "Scan": ("body",)}


@dataclass
class Found:
    """One recurrent node and where it sits: ``scope`` lists the (node, attribute) of each
    If/Loop/Scan it is inside, outermost first, and ``graphs`` the graphs from the main one
    to the node's own."""

    node: Any  # onnx.NodeProto
    name: str
    scope: list[tuple[Any, str]] = field(default_factory=list)
    graphs: list[Any] = field(default_factory=list)


def recurrent_nodes(graph: Any) -> list[Found]:
    """Every LSTM/GRU/RNN node of ``graph`` and its subgraphs, in graph order; an unnamed
    node is named ``<op>#<k>`` (its index among the found nodes).

    >>> from onnx import helper
    >>> body = helper.make_graph([helper.make_node("GRU", ["x", "w", "r"], ["y"])], "b", [], [])
    >>> loop = helper.make_node("Loop", ["n", "c"], ["o"], body=body, name="loop")
    >>> [(f.name, [n.name for n, _ in f.scope]) for f in
    ...  recurrent_nodes(helper.make_graph([loop], "g", [], []))]
    [('GRU#0', ['loop'])]
    """
    out: list[Found] = []

    def walk(g: Any, scope: list, graphs: list) -> None:
        for node in g.node:
            if node.op_type in RECURRENT_OPS and node.domain in ("", "ai.onnx"):
                out.append(Found(node, node.name or f"{node.op_type}#{len(out)}", list(scope),
                                 graphs + [g]))
            for attr in node.attribute:
                if attr.type == attr.GRAPH:
                    walk(attr.g, scope + [(node, attr.name)], graphs + [g])
                elif attr.type == attr.GRAPHS:
                    for sub in attr.graphs:
                        walk(sub, scope + [(node, attr.name)], graphs + [g])

    walk(graph, [], [])
    seen: dict[str, int] = {}
    for f in out:
        if f.name in seen:
            raise GatelensError(f"two recurrent nodes are named {f.name!r}; gatelens keys "
                                "nodes by name, so each needs its own")
        seen[f.name] = 1
    return out


def _ints(v: Any) -> list[int]:
    return [int(i) for i in np.asarray(v).reshape(-1)]


def _slice(x: np.ndarray, starts, ends, axes=None, steps=None) -> np.ndarray:
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    idx = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
        idx[a] = slice(s, e, st)
    return x[tuple(idx)]


def _fold(op: str, ins: list[np.ndarray | None], attrs: dict[str, Any]) -> list[np.ndarray]:
    """The usual ops between a weight initializer and an RNN node, numpy-side (any opset)."""
    x = ins[0] if ins else None
    if op == "Identity":
        return [x]
    if op == "Cast":
        from onnx import helper

        return [x.astype(helper.tensor_dtype_to_np_dtype(attrs["to"]))]
    if op == "Reshape":
        shape = _ints(ins[1])
        shape = [x.shape[i] if s == 0 and not attrs.get("allowzero") else s
                 for i, s in enumerate(shape)]
        return [x.reshape(shape)]
    if op == "Transpose":
        return [np.transpose(x, attrs.get("perm"))]
    if op in ("Unsqueeze", "Squeeze"):
        axes = attrs.get("axes", None if len(ins) < 2 or ins[1] is None else _ints(ins[1]))
        if op == "Squeeze":
            return [np.squeeze(x, tuple(a % x.ndim for a in axes) if axes else None)]
        for a in sorted(a % (x.ndim + len(axes)) for a in axes):
            x = np.expand_dims(x, a)
        return [x]
    if op == "Concat":
        return [np.concatenate(ins, axis=attrs["axis"])]
    if op == "Slice":
        if "starts" in attrs:  # opset < 10
            return [_slice(x, attrs["starts"], attrs["ends"], attrs.get("axes"))]
        opt = [None if i >= len(ins) or ins[i] is None else _ints(ins[i]) for i in (3, 4)]
        return [_slice(x, _ints(ins[1]), _ints(ins[2]), *opt)]
    if op == "Gather":
        return [np.take(x, ins[1], axis=attrs.get("axis", 0))]
    if op == "Split":
        axis = attrs.get("axis", 0)
        sizes = attrs.get("split", None if len(ins) < 2 or ins[1] is None else _ints(ins[1]))
        n = attrs.get("num_outputs", len(sizes) if sizes else None)
        sizes = sizes or [x.shape[axis] // n] * n
        return np.split(x, np.cumsum(sizes)[:-1], axis=axis)
    ops = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}
    if op in ops:
        return [ops[op](ins[0], ins[1]).astype(np.result_type(ins[0], ins[1]))]
    if op == "Neg":
        return [-x]
    raise KeyError(op)


class Constants:
    """Values of the names of ``graphs`` (outermost first) that no graph input reaches."""

    def __init__(self, *graphs: Any, opset: int = 17) -> None:
        self.graphs, self.opset = graphs or (), opset
        self.cache: dict[str, np.ndarray] = {}

    def _producer(self, name: str) -> tuple[str, Any]:
        """("init", tensor) or ("node", node) or ("input", None), innermost scope first."""
        for g in reversed(self.graphs):
            for t in g.initializer:
                if t.name == name:
                    return "init", t
            for node in g.node:
                if name in node.output:
                    return "node", node
            if any(i.name == name for i in g.input):
                return "input", None
        return "input", None

    def value(self, name: str) -> np.ndarray:
        """The constant value of ``name``; GatelensError when a graph input reaches it."""
        if name in self.cache:
            return self.cache[name]
        from onnx import helper, numpy_helper

        kind, src = self._producer(name)
        if kind == "init":
            self.cache[name] = numpy_helper.to_array(src)
            return self.cache[name]
        if kind == "input":
            raise GatelensError(f"{name!r} is computed from a graph input, not a constant")
        attrs = {a.name: helper.get_attribute_value(a) for a in src.attribute}
        if src.op_type == "Constant":
            (key, v), = attrs.items()
            outs = [numpy_helper.to_array(v) if key == "value" else np.asarray(v)]
        else:
            ins = [self.value(i) if i else None for i in src.input]
            try:
                outs = _fold(src.op_type, ins, attrs)
            except KeyError:
                outs = self._evaluate(src, ins)
        for out_name, v in zip(src.output, outs, strict=False):
            self.cache[out_name] = np.asarray(v)
        return self.cache[name]

    def _evaluate(self, node: Any, ins: list) -> list[np.ndarray]:
        """Any other op of constant inputs, by onnx's reference evaluator."""
        from onnx.reference import ReferenceEvaluator

        try:
            ev = ReferenceEvaluator(node, opsets={"": self.opset})
            return ev.run(None, {n: v for n, v in zip(node.input, ins, strict=True) if n})
        except Exception as e:  # the evaluator's errors are of many types
            raise GatelensError(f"cannot fold node {node.name or node.op_type!r} "
                                f"({node.op_type}) to a constant: {type(e).__name__}") from None
