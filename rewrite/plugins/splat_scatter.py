"""The ``legalize`` rule ``shared-splat-scatter``: ScatterElements into a splat that another op also reads, written
as a chain of Where.

iree-compile 3.13 miscompiles two ScatterElements whose ``data`` is one splat (``Expand`` of a scalar constant,
or ``ConstantOfShape``): both write into one buffer, so each output holds the other's updates too. Five nodes
reproduce it (``Expand(0, [T, 8])`` read by two ScatterElements along axis 1: both outputs wrong on llvm-cpu),
and exporters write it: transformers' JetMoE scatters the top-k gates of every layer's attention experts into one
shared zeros tensor, so from the second layer on IREE's results are wrong. One ScatterElements into the splat,
or two into a graph input, are right.

With ``k`` updates per row along ``axis`` (static, at most :data:`MAX_UPDATES`), the scatter is exactly::

    out = splat;  for j in 0 .. k-1:  out = Where(Equal(indices[.., j, ..] (negatives + E), iota_axis), updates[.., j, ..], out)

``iota_axis`` the positions 0 .. E-1 along ``axis``; a later update of the same position wins, as ScatterElements
applies them in order in ONNX Runtime (the ONNX spec leaves duplicates unspecified). Matched only where
``indices`` and ``updates`` have ``data``'s shape but along ``axis`` (proven symbolically), so every position
the scatter writes is one this formula writes.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from rewrite.core.rules import rule
from rewrite.plugins.expand import SymbolicEvaluator

MAX_UPDATES = 16  #: updates per row along the axis (the Where chain's length)


def _is_splat(graph, value: str) -> bool:
    """``value`` is Expand(scalar constant, shape) or ConstantOfShape(shape): one value everywhere."""
    n = graph.producer_node(value)
    if n is None or n.domain not in ("", "ai.onnx"):
        return False
    if n.op_type == "ConstantOfShape":
        return True
    if n.op_type == "Expand":
        c = graph.const(n.inputs[0])
        return c is not None and c.size == 1
    return False


@rule("shared-splat-scatter")
def shared_splat_scatter(op, data, indices, updates):
    """ScatterElements(splat read elsewhere too, indices, updates, axis) -> Where chain (module docstring)."""
    return op.ScatterElements(data, indices, updates, _name="scatter")


@shared_splat_scatter.check
def _(m):
    scatter, g = m.node("scatter"), m.graph
    if scatter.attr("reduction", "none") not in ("none", b"none"):
        return m.fail(f"reduction {scatter.attr('reduction')!r}, not none", scatter)
    if not _is_splat(g, m["data"]):
        return m.fail(f"data '{m['data']}' is not a splat (Expand of a scalar constant, ConstantOfShape)", scatter)
    if m.value("indices").dtype not in _INDEX:
        return m.fail(f"indices '{m['indices']}' are not int32/int64", scatter)
    if len(g.uses(m["data"])) < 2:
        return m.fail(f"data '{m['data']}' is read by this scatter only (IREE compiles that right)", scatter)
    ev = SymbolicEvaluator(g)
    ds, ins, us = ev.shape(m["data"]), ev.shape(m["indices"]), ev.shape(m["updates"])
    if ds is None or ins is None or us is None or not ds or len(ins) != len(ds) or ins != us:
        return m.fail("shapes of data, indices and updates unknown or different ranks", scatter)
    axis = scatter.attr("axis", 0) % len(ds)
    if any(a != b for k, (a, b) in enumerate(zip(ds, ins)) if k != axis):
        return m.fail("indices do not span data along the other axes (positions left untouched there)", scatter)
    k = ins[axis]
    if not isinstance(k, int) or not 1 <= k <= MAX_UPDATES or m.value("data").shape is None:
        return m.fail(f"{k} updates per row along axis {axis}; a static count of 1 to {MAX_UPDATES} expected", scatter)


@shared_splat_scatter.rewrite
def _(m, b):
    scatter, dv = m.node("scatter"), m.value("data")
    rank = len(dv.shape)
    axis = scatter.attr("axis", 0) % rank
    k = SymbolicEvaluator(m.graph).shape(m["indices"])[axis]
    itype = m.value("indices").dtype
    i64 = lambda v, name: b.const(np.asarray(v, np.int64), name)  # noqa: E731
    as_index = lambda v: v if itype == TensorProto.INT64 else b.op("Cast", [v], to=itype)  # noqa: E731
    ax = i64([axis], "axis")
    extent = b.op("Gather", [b.op("Shape", [m["data"]]), ax], axis=0)  # [1]: E
    view = [1] * rank
    view[axis] = -1
    iota = as_index(b.op("Reshape", [b.op("Range", [i64(0, "zero"), b.op("Squeeze", [extent, i64([0], "first")]), i64(1, "one")]),
                                     i64(view, "view")]))
    extent, zero = as_index(extent), b.const(np.zeros((), _INDEX[itype]), "zero_index")
    out = m["data"]
    for j in range(k):
        lo, hi = i64([j], "lo"), i64([j + 1], "hi")
        idx = b.op("Slice", [m["indices"], lo, hi, ax])
        idx = b.op("Where", [b.op("Less", [idx, zero]), b.op("Add", [idx, extent]), idx])  # negative: from the end
        upd = b.op("Slice", [m["updates"], lo, hi, ax])
        out = b.op("Where", [b.op("Equal", [idx, iota]), upd, out], dtype=dv.dtype, shape=dv.shape)
    return out


_INDEX = {TensorProto.INT64: np.int64, TensorProto.INT32: np.int32}
