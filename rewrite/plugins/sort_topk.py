"""The ``legalize`` rule ``full-sort-topk``: a TopK that keeps every element of its axis (a sort) of run-time
length, whose Values nobody reads, as a stable ranking that iree-compile lowers.

transformers' JetMoE sorts its attention experts' (token, expert) pairs by expert id (``torch.sort``, of which
it keeps the order only), which both exporters write as ``TopK(ids, K=Shape(ids)[0], axis=0, largest=0)`` with
the Values output unused. iree-compile 3.13 cannot compile that TopK ("'memref.alloca' op expected no unbounded
stack allocations"); the same TopK with its Values read, or with a static K, compiles, and is left alone.

With K the axis length, TopK is a stable sort (ONNX spec, TopK: of two equal elements the one with the lower
index comes first). The output position of element ``i`` along the axis is its rank::

    rank_i = #{j : x_j before x_i} + #{j < i : x_j == x_i}      "before": x_j < x_i (largest=0), > (largest=1)

and output position ``r`` holds the element whose rank is ``r``::

    Indices_r = sum_i i * [rank_i == r]        Values = GatherElements(X, Indices, axis)

Both take n x n comparisons along the axis, n its length: for JetMoE the token count times the experts per
token, 2 at decode and 10 at a 5-token prefill, but 16 M comparisons (each an int64 in the unfused graph) at a
2048-token prefill. Integer keys only: a float NaN has no place in this order, and ONNX leaves its place in
TopK's open. K is proven to be the axis length symbolically (:class:`rewrite.plugins.expand.SymbolicEvaluator`),
where dims of one ``dim_param`` name are one size, as the ONNX IR defines them.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from rewrite.core.ir import dtype_name
from rewrite.core.pattern import AttrVar
from rewrite.core.rules import rule
from rewrite.core.shape_eval import known_value
from rewrite.plugins.expand import Sym, SymbolicEvaluator

#: integer element types TopK takes (ONNX spec, TopK-11+: all numeric types)
_INTEGERS = (TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64,
             TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64)


@rule("full-sort-topk")
def full_sort_topk(op, x, k):
    """TopK(X, K = X's run-time length along axis) of integer X, Values unread -> a stable ranking by comparisons
    and sums (Values, Indices)."""
    return op.TopK(x, k, axis=AttrVar("axis", default=-1), largest=AttrVar("largest", default=1), _outputs=2,
                   _name="topk")


def _axis(m) -> int | None:
    rank = m.value("x").rank
    if rank is None:
        return None
    a = int(m.attr("axis"))
    a = a + rank if a < 0 else a
    return a if 0 <= a < rank else None


@full_sort_topk.check
def _(m):
    topk, xv = m.node("topk"), m.value("x")
    if xv.dtype not in _INTEGERS:
        return m.fail(f"'{m['x']}' is {dtype_name(xv.dtype) if xv.dtype else 'of unknown type'}, not an integer type "
                      "(a float NaN has no place in the ranking)", topk)
    axis = _axis(m)
    if axis is None:
        return m.fail(f"rank of '{m['x']}' is unknown or axis {m.attr('axis')} is out of range", topk)
    if known_value(m.graph, m["k"]) is not None:
        return m.fail(f"K '{m['k']}' is known before the run: iree-compile lowers a TopK of static K as it is", topk)
    values = topk.outputs[0]
    if values and (m.graph.uses(values) or m.graph.is_graph_output(values)):
        return m.fail(f"its Values '{values}' are read: iree-compile lowers such a TopK as it is", topk)
    ev = SymbolicEvaluator(m.graph)
    k, shape = ev.vector(m["k"]), ev.shape(m["x"])
    n = None if shape is None else shape[axis]
    if k is None or len(k) != 1 or n is None or k[0] != n:
        return m.fail(f"K '{m['k']}' is not provably the length of '{m['x']}' along axis {axis} "
                      f"(K is {_dims(k)}, the length {_dims([n])}): not a sort", topk)


def _dims(dims) -> str:
    """Evaluated dims for a message: ints as they are, run-time sizes by their dim_param or source."""
    if dims is None:
        return "not evaluated"
    def one(d):
        if isinstance(d, Sym):
            return d.name if d.name else f"dim {d.axis} of '{d.value}'"
        return "unknown" if d is None else str(d)
    return "[" + ", ".join(one(d) for d in dims) + "]"


@full_sort_topk.rewrite
def _(m, b):
    x, xv = m["x"], m.value("x")
    rank, axis = xv.rank, _axis(m)
    tail = [1] * (rank - 1 - axis)
    i64 = TensorProto.INT64

    def const(v, hint):
        return b.const(np.array(v, np.int64), hint)

    xi = b.op("Unsqueeze", [x, const([axis + 1], "axis_j")])  # [..., n_i, 1, ...]
    xj = b.op("Unsqueeze", [x, const([axis], "axis_i")])      # [..., 1, n_j, ...]
    before = b.op("Greater" if int(m.attr("largest")) else "Less", [xj, xi])
    n = b.op("Squeeze", [m["k"], const([0], "axis0")])  # K, proven the axis length (Shape's start/end need opset 15)
    iota = b.op("Range", [const(0, "zero"), n, const(1, "one")])
    rows = b.op("Reshape", [iota, const([-1, 1, *tail], "rows")])  # [n, 1, 1...]: i (or r) along axis
    cols = b.op("Reshape", [iota, const([1, -1, *tail], "cols")])  # [1, n, 1...]: j (or i) along axis + 1
    tie = b.op("And", [b.op("Equal", [xj, xi]), b.op("Less", [cols, rows])])
    ahead = b.op("Cast", [b.op("Or", [before, tie])], to=i64)
    ranks = b.op("ReduceSum", [ahead, const([axis + 1], "axis_j")], keepdims=0)  # X's shape
    at = b.op("Cast", [b.op("Equal", [b.op("Unsqueeze", [ranks, const([axis], "axis_i")]), rows])], to=i64)
    indices = b.op("ReduceSum", [b.op("Mul", [at, cols]), const([axis + 1], "axis_j")], keepdims=0,
                   dtype=i64, shape=xv.shape)
    values = b.op("GatherElements", [x, indices], axis=axis, dtype=xv.dtype, shape=xv.shape)
    return [values, indices]
