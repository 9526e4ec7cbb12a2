"""Conformance cases of the ``norm`` plugin: transformers' RMSNorm as exporters write it (Pow or Mul for the
square, Div or Reciprocal and Mul, ReduceMean's axes as an input or, before opset 18, an attribute; f32, and f16
between Casts to float32 and back), and norms it must leave alone (computed in float16, over another axis)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rewrite.core.cases import negative, positive

_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def norm_graph(*, dtype: int = TensorProto.FLOAT, h: int = 64, lead=(1, "T"), square: str = "Pow", reciprocal: bool = False,
               opset: int = 18, in_f16: bool = False, axis: int = -1) -> onnx.ModelProto:
    """X [*lead, h] -> RMSNorm over ``axis`` -> Y. ``in_f16``: an f16 model's norm without the Casts (computed in f16)."""
    npd = _NP[dtype]
    rng = np.random.default_rng(5)
    inits = []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    wide = dtype == TensorProto.FLOAT16 and not in_f16
    ft = np.float32 if (wide or dtype == TensorProto.FLOAT) else npd
    nodes, xf = [], "X"
    if wide:
        nodes.append(helper.make_node("Cast", ["X"], ["Xf"], to=TensorProto.FLOAT))
        xf = "Xf"
    nodes.append(helper.make_node("Pow", [xf, const("two", np.array(2.0, ft))], ["sq"]) if square == "Pow"
                 else helper.make_node("Mul", [xf, xf], ["sq"]))
    if opset >= 18:
        nodes.append(helper.make_node("ReduceMean", ["sq", const("axes", np.array([axis], np.int64))], ["mean"], keepdims=1))
    else:
        nodes.append(helper.make_node("ReduceMean", ["sq"], ["mean"], axes=[axis], keepdims=1))
    nodes += [helper.make_node("Add", ["mean", const("eps", np.array(1e-6, ft))], ["var"]), helper.make_node("Sqrt", ["var"], ["root"])]
    if reciprocal:
        nodes += [helper.make_node("Reciprocal", ["root"], ["inv"]), helper.make_node("Mul", [xf, "inv"], ["normed"])]
    else:
        nodes.append(helper.make_node("Div", [xf, "root"], ["normed"]))
    last = "normed"
    if wide:
        nodes.append(helper.make_node("Cast", ["normed"], ["normed_n"], to=dtype))
        last = "normed_n"
    nodes.append(helper.make_node("Mul", [const("w", (1 + 0.1 * rng.standard_normal(h)).astype(npd)), last], ["Y"]))
    shape = [*lead, h]
    g = helper.make_graph(nodes, "rmsnorm", [helper.make_tensor_value_info("X", dtype, shape)],
                          [helper.make_tensor_value_info("Y", dtype, shape)], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def rms_norm_nodes(x: str, dtype: int, h: int, rng: np.random.Generator, prefix: str = "norm") -> tuple[list, list, str]:
    """(nodes, initializers, output name) of transformers' RMSNorm of value ``x`` [..., h] of ``dtype`` as its exporter
    writes it: in float32 (f16 X between a Cast to float32 and one back), Pow, ReduceMean (opset 18 axes input), Add
    eps 1e-6, Sqrt, Div, Mul weight (names prefixed by ``prefix``)."""
    f32, p = TensorProto.FLOAT, prefix
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), f"{p}_two"), numpy_helper.from_array(np.array([-1], np.int64), f"{p}_axes"),
             numpy_helper.from_array(np.array(1e-6, np.float32), f"{p}_eps"),
             numpy_helper.from_array((1 + 0.1 * rng.standard_normal(h)).astype(_NP[dtype]), f"{p}_w")]
    nodes, xf = [], x
    if dtype != f32:
        nodes.append(helper.make_node("Cast", [x], [f"{p}_xf"], to=f32))
        xf = f"{p}_xf"
    nodes += [helper.make_node("Pow", [xf, f"{p}_two"], [f"{p}_sq"]),
              helper.make_node("ReduceMean", [f"{p}_sq", f"{p}_axes"], [f"{p}_mean"], keepdims=1),
              helper.make_node("Add", [f"{p}_mean", f"{p}_eps"], [f"{p}_var"]), helper.make_node("Sqrt", [f"{p}_var"], [f"{p}_root"]),
              helper.make_node("Div", [xf, f"{p}_root"], [f"{p}_normed"])]
    normed = f"{p}_normed"
    if dtype != f32:
        nodes.append(helper.make_node("Cast", [normed], [f"{p}_normed_n"], to=dtype))
        normed = f"{p}_normed_n"
    nodes.append(helper.make_node("Mul", [normed, f"{p}_w"], [f"{p}_out"], name=f"{p}_mul"))
    return nodes, inits, f"{p}_out"


def rmsnorm_cases():
    f16 = TensorProto.FLOAT16
    return [
        positive("f32-pow-div", lambda: norm_graph()),
        positive("f16-decode-h2048", lambda: norm_graph(dtype=f16, h=2048, lead=(1, 1))),
        positive("f32-mul-reciprocal-rank2", lambda: norm_graph(square="Mul", reciprocal=True, lead=("T",))),
        positive("f16-opset13-axes-attribute", lambda: norm_graph(dtype=f16, h=128, opset=13, lead=(2, 3))),
        negative("computed-in-f16", lambda: norm_graph(dtype=f16, in_f16=True, lead=(1, 4))),
        negative("over-axis-0", lambda: norm_graph(h=8, lead=(8,), axis=0)),
    ]
