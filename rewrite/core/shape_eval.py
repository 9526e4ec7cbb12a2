"""Partial evaluation of shape computations.

onnx shape inference propagates data only through a few ops: ``Range(0, Gather(Shape(x), 1))`` stays
``[?]`` even when ``x`` is ``[1, 1, 2048]``, and so do the Reshape/Expand/Slice outputs fed by it (seed 000,
items A3/A6). This module evaluates, with numpy, every small integer tensor computable from constants and
static shapes (``Shape`` of a value whose shape is fully known, initializers, Constant nodes), following
the ONNX operator definitions. :func:`rewrite.core.shapes.infer_shapes` then re-runs inference on a copy of
the model where those tensors are constants, so the ops that consume them get static output shapes.

Only tensors of at most :data:`MAX_ELEMENTS` integer or boolean elements are evaluated; nothing here
changes the graph itself.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx

from rewrite.core.ir import Graph, Node

MAX_ELEMENTS = 1024

_Eval = Callable[[Node, list], list]


def _axes(node: Node, ins: list, k: int = 1):
    """Axes from the opset-13+ input ``k`` or the older attribute."""
    if len(ins) > k and ins[k] is not None:
        return [int(a) for a in np.asarray(ins[k]).ravel()]
    a = node.attr("axes")
    return None if a is None else [int(x) for x in a]


def _unsqueeze(n: Node, ins: list) -> list:
    x = np.asarray(ins[0])
    axes = _axes(n, ins)
    r = x.ndim + len(axes)
    out = x
    for a in sorted(a + r if a < 0 else a for a in axes):
        out = np.expand_dims(out, a)
    return [out]


def _squeeze(n: Node, ins: list) -> list:
    axes = _axes(n, ins)
    x = np.asarray(ins[0])
    return [np.squeeze(x, axis=tuple(axes)) if axes else np.squeeze(x)]


def _slice(n: Node, ins: list) -> list:
    x = np.asarray(ins[0])
    starts, ends = np.asarray(ins[1]).ravel(), np.asarray(ins[2]).ravel()
    axes = np.asarray(ins[3]).ravel() if len(ins) > 3 and ins[3] is not None else np.arange(len(starts))
    steps = np.asarray(ins[4]).ravel() if len(ins) > 4 and ins[4] is not None else np.ones(len(starts), np.int64)
    sl = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = int(a) + x.ndim if a < 0 else int(a)
        big = np.iinfo(np.int64).max
        sl[a] = slice(int(s), None if (st > 0 and e >= big) or (st < 0 and e <= -big) else int(e), int(st))
    return [x[tuple(sl)]]


def _shape(n: Node, ins: list) -> list:
    shape = np.asarray(ins[0], dtype=np.int64)
    start, end = n.attr("start", 0), n.attr("end", None)
    return [shape[start:end]]


def _gather(n: Node, ins: list) -> list:
    return [np.take(np.asarray(ins[0]), np.asarray(ins[1]), axis=n.attr("axis", 0))]


def _concat(n: Node, ins: list) -> list:
    return [np.concatenate([np.asarray(i) for i in ins], axis=n.attr("axis", 0))]


def _div(n: Node, ins: list) -> list:
    a, b = np.asarray(ins[0]), np.asarray(ins[1])
    if np.issubdtype(a.dtype, np.integer):
        return [(np.trunc(a / b)).astype(a.dtype)]  # ONNX integer Div truncates toward zero
    return [a / b]


def _range(n: Node, ins: list) -> list:
    s, l, d = (np.asarray(i).item() for i in ins)
    return [np.arange(s, l, d, dtype=np.asarray(ins[0]).dtype)]


def _reshape(n: Node, ins: list) -> list:
    x, shape = np.asarray(ins[0]), [int(s) for s in np.asarray(ins[1]).ravel()]
    if not n.attr("allowzero", 0):
        shape = [x.shape[k] if s == 0 else s for k, s in enumerate(shape)]
    return [x.reshape(shape)]


def _cast(n: Node, ins: list) -> list:
    from onnx import helper

    return [np.asarray(ins[0]).astype(helper.tensor_dtype_to_np_dtype(n.attr("to")))]


def _constant_of_shape(n: Node, ins: list) -> list:
    v = n.attr("value")
    v = np.zeros(1, np.float32) if v is None else np.asarray(v).ravel()
    return [np.full([int(s) for s in np.asarray(ins[0]).ravel()], v[0], dtype=v.dtype)]


def _binary(f) -> _Eval:
    return lambda n, ins: [np.asarray(f(np.asarray(ins[0]), np.asarray(ins[1])))]


EVALUATORS: dict[str, _Eval] = {
    "Shape": _shape,
    "Size": lambda n, ins: [np.asarray(np.asarray(ins[0], dtype=np.int64).prod(), np.int64)],
    "Gather": _gather,
    "Concat": _concat,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Slice": _slice,
    "Cast": _cast,
    "Identity": lambda n, ins: [np.asarray(ins[0])],
    "Add": _binary(np.add),
    "Sub": _binary(np.subtract),
    "Mul": _binary(np.multiply),
    "Div": _div,
    "Mod": _binary(np.mod),
    "Max": lambda n, ins: [np.asarray(np.maximum.reduce([np.asarray(i) for i in ins]))],
    "Min": lambda n, ins: [np.asarray(np.minimum.reduce([np.asarray(i) for i in ins]))],
    "Neg": lambda n, ins: [np.negative(np.asarray(ins[0]))],
    "Abs": lambda n, ins: [np.abs(np.asarray(ins[0]))],
    "Equal": _binary(np.equal),
    "Less": _binary(np.less),
    "LessOrEqual": _binary(np.less_equal),
    "Greater": _binary(np.greater),
    "GreaterOrEqual": _binary(np.greater_equal),
    "And": _binary(np.logical_and),
    "Or": _binary(np.logical_or),
    "Not": lambda n, ins: [np.logical_not(np.asarray(ins[0]))],
    "Where": lambda n, ins: [np.where(np.asarray(ins[0]), np.asarray(ins[1]), np.asarray(ins[2]))],
    "Range": _range,
    "Reshape": _reshape,
    "Expand": lambda n, ins: [np.broadcast_to(np.asarray(ins[0]), np.broadcast_shapes(np.asarray(ins[0]).shape, tuple(int(s) for s in np.asarray(ins[1]).ravel()))).copy()],
    "ConstantOfShape": _constant_of_shape,
    "Tile": lambda n, ins: [np.tile(np.asarray(ins[0]), [int(r) for r in np.asarray(ins[1]).ravel()])],
}


def _small_int(a) -> bool:
    a = np.asarray(a)
    return a.size <= MAX_ELEMENTS and (np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_)


#: ops that only select entries of their first input: evaluated on partly known shapes (see known_values)
_SELECTIONS = ("Gather", "Slice")
_UNKNOWN = np.iinfo(np.int64).min  # stands for a run-time dim while a selection runs


def known_value(graph: Graph, value: str, *, limit: int = 64) -> np.ndarray | None:
    """:func:`known_values` for one value, evaluating only the (at most ``limit``) nodes it depends on; None
    when it is not known (or depends on more nodes)."""
    c = graph.const(value)
    if c is not None:
        return np.asarray(c)
    seen: dict[int, Node] = {}
    stack = [value]
    while stack:
        node = graph.producer_node(stack.pop())
        if node is None or node.id in seen:
            continue
        if len(seen) == limit:
            return None
        seen[node.id] = node
        stack += [i for i in node.inputs if i and graph.const(i) is None]
    return known_values(graph, sorted(seen.values(), key=lambda n: n.order)).get(value)


def known_values(graph: Graph, nodes: list[Node] | None = None) -> dict[str, np.ndarray]:
    """Values of every small integer/bool tensor computable from constants and static shapes (of ``nodes``,
    in a topological order, when given; else of the whole graph).

    Keys are value names produced by nodes (initializers are not repeated). Unknown ops, ops in other
    domains, and evaluations that raise are skipped (their outputs stay unknown). ``Gather`` and ``Slice`` of a
    shape whose source has symbolic dims are known when they select static dims only (:func:`shape_elements`).
    """
    known: dict[str, np.ndarray] = {}

    def get(name: str):
        if not name:
            return None
        if name in known:
            return known[name]
        c = graph.const(name)
        return c if c is not None and _small_int(c) else None

    for n in graph.topo_nodes() if nodes is None else nodes:
        if n.domain not in ("", "ai.onnx") or n.op_type not in EVALUATORS:
            continue
        partial = False
        if n.op_type == "Shape":
            v = graph.values.get(n.inputs[0])
            if v is None or v.shape is None or not all(isinstance(d, int) for d in v.shape):
                continue
            ins = [np.asarray(v.shape, np.int64)]
        else:
            ins = [get(i) if i else None for i in n.inputs]
            if n.op_type in _SELECTIONS and ins[0] is None and all(i is not None for i, name in zip(ins[1:], n.inputs[1:]) if name):
                # a selection from a partly known shape (Gather(Shape(x), 2) of x [1, s, 2]): run it with the
                # unknown dims as a marker; a result free of the marker is known
                elems = shape_elements(graph, n.inputs[0])
                if elems is not None:
                    ins[0], partial = np.array([_UNKNOWN if e is None else e for e in elems], np.int64), True
            if any(i is None for i, name in zip(ins, n.inputs) if name):
                continue
        try:
            outs = EVALUATORS[n.op_type](n, ins)
        except (ValueError, TypeError, IndexError, ZeroDivisionError, OverflowError, MemoryError):
            continue
        for name, val in zip(n.outputs, outs):
            if name and _small_int(val) and not (partial and (np.asarray(val) == _UNKNOWN).any()):
                known[name] = np.asarray(val)
    return known


def shape_elements(graph: Graph, value: str, *, depth: int = 8) -> list[int | None] | None:
    """The entries of a 1-D int64 shape tensor, each an int where it is known and None where it depends on
    a run-time size; None when not even the length is known.

    Follows constants, ``Shape`` (with ``start``/``end``; dims of the source that are symbolic give None),
    ``Concat`` on axis 0, ``Identity`` and ``Cast`` to INT64. Exporters spell the same shape as a constant
    (``[-1, 4, 128]``) or as ``Concat(Shape(input_ids)[1:2], [4], [128])`` (onnxscript 0.7.0); patterns
    that need only some entries to be known read them here.
    """
    c = graph.const(value)
    if c is not None:
        c = np.asarray(c)
        return [int(x) for x in c.ravel()] if c.ndim == 1 and np.issubdtype(c.dtype, np.integer) else None
    node = graph.producer_node(value)
    if node is None or depth == 0 or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Identity" or (node.op_type == "Cast" and node.attr("to") == onnx.TensorProto.INT64):
        return shape_elements(graph, node.inputs[0], depth=depth - 1)  # (a Cast to another type is not a shape)
    if node.op_type == "Shape":
        src = graph.values.get(node.inputs[0])
        if src is None or src.shape is None:
            return None
        dims = [d if isinstance(d, int) else None for d in src.shape]
        rank = len(dims)
        start, end = node.attr("start", 0), node.attr("end", rank)
        start, end = (max(0, min(rank, s + rank if s < 0 else s)) for s in (start, end))
        return dims[start:end]
    if node.op_type == "Concat" and node.attr("axis") == 0:
        parts = [shape_elements(graph, i, depth=depth - 1) for i in node.inputs]
        return None if any(p is None for p in parts) else [x for p in parts for x in p]
    return None
