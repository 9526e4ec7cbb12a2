"""Conformance cases of the ``rope`` plugin: rotary embedding as exporters write it (rotate_half by Split or by two
Slices; cos/sin of [1, 1, T, D] and [B, 1, T, D]; f32 and f16), with Qwen3's per-head RMSNorm before it (float32
inside, Casts around it in f16), and forms it must leave alone (a rotation of the wrong halves, a norm in float16)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rewrite.core.cases import negative, positive

_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def rope_graph(*, dtype: int = TensorProto.FLOAT, b: int = 1, h: int = 4, t="T", d: int = 32, slices: bool = False,
               norm: bool = False, norm_f16: bool = False, per_batch: bool = False, swapped: bool = False,
               reciprocal: bool = False) -> onnx.ModelProto:
    """X (an input [b, h, t, d], or [b, t, h, d] through the norm and a Transpose when ``norm``), cos and sin (inputs
    [1 or b, 1, t, d]) -> ``X * cos + rotate_half(X) * sin`` -> Y.

    ``slices``: the halves by two Slice ops (else one Split); ``norm``: Qwen3's RMSNorm over D first (Cast to
    float32 and back in f16, ``Div`` or with ``reciprocal`` ``Mul(Reciprocal)``); ``norm_f16``: that norm without
    the Casts in an f16 model (computed in f16); ``swapped``: Concat(Neg(X1), X2), not a rotation by half."""
    npd = _NP[dtype]
    rng = np.random.default_rng(3)
    nodes, inits = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    x = "X"
    x_shape = [b, t, h, d] if norm else [b, h, t, d]
    if norm:
        f32 = TensorProto.FLOAT
        wide = dtype == TensorProto.FLOAT16 and not norm_f16
        xf = "X"
        if wide:
            nodes.append(helper.make_node("Cast", ["X"], ["Xf"], to=f32))
            xf = "Xf"
        ft = np.float32 if (wide or dtype == TensorProto.FLOAT) else npd
        nodes += [helper.make_node("Pow", [xf, const("two", np.array(2.0, ft))], ["sq"]),
                  helper.make_node("ReduceMean", ["sq", const("axes", np.array([-1], np.int64))], ["mean"], keepdims=1),
                  helper.make_node("Add", ["mean", const("eps", np.array(1e-6, ft))], ["var"]),
                  helper.make_node("Sqrt", ["var"], ["root"])]
        if reciprocal:
            nodes += [helper.make_node("Reciprocal", ["root"], ["inv"]), helper.make_node("Mul", [xf, "inv"], ["normed"])]
        else:
            nodes.append(helper.make_node("Div", [xf, "root"], ["normed"]))
        last = "normed"
        if wide:
            nodes.append(helper.make_node("Cast", ["normed"], ["normed16"], to=dtype))
            last = "normed16"
        nodes += [helper.make_node("Mul", [last, const("w", (1 + 0.1 * rng.standard_normal(d)).astype(npd))], ["xw"]),
                  helper.make_node("Transpose", ["xw"], ["Xt"], perm=[0, 2, 1, 3])]
        x = "Xt"
    if slices:
        nodes += [helper.make_node("Slice", [x, const("s0", np.array([0], np.int64)), const("e0", np.array([d // 2], np.int64)),
                                             const("a0", np.array([-1], np.int64))], ["X1"]),
                  helper.make_node("Slice", [x, const("s1", np.array([d // 2], np.int64)),
                                             const("e1", np.array([np.iinfo(np.int64).max], np.int64)),
                                             const("a1", np.array([3], np.int64))], ["X2"])]
    else:
        nodes.append(helper.make_node("Split", [x], ["X1", "X2"], axis=3, num_outputs=2))
    first, second = ("X1", "X2") if swapped else ("X2", "X1")
    nodes += [helper.make_node("Neg", [first], ["neg"]),
              helper.make_node("Concat", ["neg", second], ["rot"], axis=-1),
              helper.make_node("Mul", [x, "cos"], ["xc"]), helper.make_node("Mul", ["rot", "sin"], ["rs"]),
              helper.make_node("Add", ["xc", "rs"], ["Y"])]
    cb = b if per_batch else 1
    graph = helper.make_graph(nodes, "rope", [helper.make_tensor_value_info("X", dtype, x_shape),
                                              helper.make_tensor_value_info("cos", dtype, [cb, 1, t, d]),
                                              helper.make_tensor_value_info("sin", dtype, [cb, 1, t, d])],
                              [helper.make_tensor_value_info("Y", dtype, [b, h, t, d])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """X random; cos and sin of real angles (positions up to 4,096, base 1e6): values in [-1, 1] as a model's."""
    rng = np.random.default_rng(0)
    specs = {i.name: i.type.tensor_type for i in model.graph.input}
    dt = _NP[specs["X"].elem_type]
    dims = lambda name: [d.dim_value if d.HasField("dim_value") else 3 for d in specs[name].shape.dim]  # noqa: E731
    cb, _, t, d = dims("cos")
    pos = rng.integers(0, 4096, size=(cb, t)).astype(np.float32)
    inv = 1e6 ** (-np.arange(0, d, 2, dtype=np.float32) / d)
    ang = pos[..., None] * np.concatenate([inv, inv])
    return {"X": (rng.standard_normal(dims("X")) * 3).astype(dt), "cos": np.cos(ang)[:, None].astype(dt),
            "sin": np.sin(ang)[:, None].astype(dt)}


def rope_cases():
    f16 = TensorProto.FLOAT16
    return [
        positive("split-f32", lambda: rope_graph(), feeds=_feeds),
        positive("slices-f32-per-batch-cos", lambda: rope_graph(slices=True, b=2, per_batch=True), feeds=_feeds),
        positive("split-f16-decode", lambda: rope_graph(dtype=f16, t=1, d=128, h=16), feeds=_feeds),
        positive("qwen3-norm-f16", lambda: rope_graph(dtype=f16, norm=True, t=1, d=128, h=8), feeds=_feeds),
        positive("qwen3-norm-f32-reciprocal", lambda: rope_graph(norm=True, reciprocal=True, t=4, d=64), feeds=_feeds),
        # the norm computed in float16: not the contract's norm, the rotation alone is taken
        positive("norm-in-f16-left-out", lambda: rope_graph(dtype=f16, norm=True, norm_f16=True, t=1, d=64), feeds=_feeds),
        negative("not-a-rotation", lambda: rope_graph(swapped=True), feeds=_feeds),
    ]
