"""The ``legalize`` rules ``shared-splat-scatter-elements`` and ``shared-splat-scatter-nd``: a scatter whose data is
a splat that other ops read too gets a splat of its own.

iree-compile 3.13 miscompiles scatters whose ``data`` is one splat (``Expand`` of a scalar constant, or
``ConstantOfShape``) read by more than one op: the scatters write into one buffer, so each output holds the
others' updates too. Five nodes reproduce it (``Expand(0, [T, n])`` read by two ScatterElements, or by two
``ScatterND(reduction="add")``: both outputs wrong on llvm-cpu), and exporters write it: transformers' JetMoE
scatters the top-k gates of every layer into one zeros tensor, and adds its attention experts' outputs into
another (``index_add``). One scatter into a splat, or two into a graph input, are right; two splats of the same
value are merged into one by the compiler, so a copy of the Expand does not help.

The rewrite gives each scatter a splat that is the same value but that the compiler cannot merge with the
others, because it is computed from this scatter's own indices::

    data' = Expand(Cast(Add(Mul(Cast(ReduceMin(indices), FLOAT), 0.0), c), data's type), Shape(data))

``ReduceMin`` of integer indices is a finite integer, times 0.0 is 0 or -0 (float products by zero are not folded:
they differ for inf and NaN), plus the splat's value ``c`` (as float32: exact for f16, bf16 and f32 values) is
``c`` (``-0 + 0 = +0``). Float data only: integer products by zero would fold.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from rewrite.core.rules import rule

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
_INDEX = (TensorProto.INT64, TensorProto.INT32)


def splat_value(graph, value: str) -> float | None:
    """The one value of ``value`` when it is Expand(constant of one element, shape) or ConstantOfShape(shape);
    else None."""
    n = graph.producer_node(value)
    if n is None or n.domain not in ("", "ai.onnx"):
        return None
    if n.op_type == "ConstantOfShape":
        t = n.attr("value")
        return 0.0 if t is None else float(numpy_helper.to_array(t).ravel()[0])
    if n.op_type == "Expand":
        c = graph.const(n.inputs[0])
        return float(c.ravel()[0]) if c is not None and c.size == 1 else None
    return None


@rule("shared-splat-scatter-elements")
def shared_splat_scatter_elements(op, data, indices, updates):
    """ScatterElements(splat read elsewhere too, indices, updates) -> the same into a splat of its own."""
    return op.ScatterElements(data, indices, updates, _name="scatter")


@rule("shared-splat-scatter-nd")
def shared_splat_scatter_nd(op, data, indices, updates):
    """ScatterND(splat read elsewhere too, indices, updates) -> the same into a splat of its own."""
    return op.ScatterND(data, indices, updates, _name="scatter")


def _check(m):
    scatter, g = m.node("scatter"), m.graph
    dv = m.value("data")
    if splat_value(g, m["data"]) is None:
        return m.fail(f"data '{m['data']}' is not a splat (Expand of a one-element constant, ConstantOfShape)", scatter)
    if len(g.uses(m["data"])) < 2 and not g.is_graph_output(m["data"]):
        return m.fail(f"data '{m['data']}' is read by this scatter only (IREE compiles that right)", scatter)
    if dv.dtype not in _FLOATS:
        return m.fail(f"data '{m['data']}' is not a float tensor (integer products by zero fold)", scatter)
    if m.value("indices").dtype not in _INDEX:
        return m.fail(f"indices '{m['indices']}' are not int32/int64", scatter)


def _rewrite(m, b):
    scatter, dv = m.node("scatter"), m.value("data")
    c = np.float32(splat_value(m.graph, m["data"]))
    low = b.op("Cast", [b.op("ReduceMin", [m["indices"]], keepdims=0)], to=TensorProto.FLOAT)
    value = b.op("Add", [b.op("Mul", [low, b.const(np.float32(0.0), "zero")]), b.const(c, "splat_value")])
    if dv.dtype != TensorProto.FLOAT:
        value = b.op("Cast", [value], to=dv.dtype)
    own = b.op("Expand", [value, b.op("Shape", [m["data"]])], dtype=dv.dtype, shape=dv.shape)
    attrs = {a: scatter.attr(a) for a in ("axis", "reduction") if scatter.attr(a) is not None}
    return b.op(scatter.op_type, [own, m["indices"], m["updates"]], dtype=dv.dtype,
                shape=m.graph.values[scatter.outputs[0]].shape, **attrs)


for _rule in (shared_splat_scatter_elements, shared_splat_scatter_nd):
    _rule.check(_check)
    _rule.rewrite(_rewrite)
