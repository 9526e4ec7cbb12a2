"""Conformance cases of the ``rmsnorm`` plugin: small models built with onnx.helper."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rewrite.testing import bad_input, negative, positive


def _rmsnorm_model(*, opset=23, dtype=TensorProto.FLOAT, reciprocal=False, axes=(-1,), exponent=2.0, eps_input=False,
                   weight_shape=(16,), layers=1, compute=None):
    """x [2, 3, 16] -> ``layers`` RMSNorms in a row (weight first in the final Mul when ``reciprocal``); with
    ``compute``, x is Cast to that type first and the normalized value Cast back (as transformers exports it)."""
    npdt = helper.tensor_dtype_to_np_dtype(dtype)
    cdt = helper.tensor_dtype_to_np_dtype(compute or dtype)
    rng = np.random.default_rng(0)
    nodes, inits = [], [numpy_helper.from_array(np.array(axes, np.int64), "axes"), numpy_helper.from_array(np.array(exponent, cdt), "two")]
    inputs = [helper.make_tensor_value_info("x0", dtype, [2, 3, 16])]
    if eps_input:
        inputs.append(helper.make_tensor_value_info("eps", dtype, []))
    else:
        inits.append(numpy_helper.from_array(np.array(1e-6, cdt), "eps"))
    for k in range(layers):
        x, p = f"x{k}", f"l{k}_"
        inits.append(numpy_helper.from_array(rng.uniform(0.5, 1.5, weight_shape).astype(npdt), p + "w"))
        if compute:
            nodes.append(helper.make_node("Cast", [x], [p + "xc"], to=compute))
            x = p + "xc"
        nodes += [
            helper.make_node("Pow", [x, "two"], [p + "sq"]),
            helper.make_node("ReduceMean", [p + "sq", "axes"], [p + "ms"], name=p + "mean"),
            helper.make_node("Add", ["eps", p + "ms"], [p + "v"]),
            helper.make_node("Sqrt", [p + "v"], [p + "std"]),
        ]
        if reciprocal:
            nodes += [helper.make_node("Reciprocal", [p + "std"], [p + "inv"]), helper.make_node("Mul", [p + "inv", x], [p + "n"])]
        else:
            nodes.append(helper.make_node("Div", [x, p + "std"], [p + "n"]))
        if compute:
            nodes.append(helper.make_node("Cast", [p + "n"], [p + "nt"], to=dtype))
        n = p + "nt" if compute else p + "n"
        nodes.append(helper.make_node("Mul", [p + "w", n] if reciprocal else [n, p + "w"], [f"x{k + 1}"], name=p + "scale"))
    out = helper.make_tensor_value_info(f"x{layers}", dtype, None)
    g = helper.make_graph(nodes, "main_graph", inputs, [out], inits)
    return lambda: helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    out = {}
    for vi in model.graph.input:
        dt = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        out[vi.name] = np.full(shape, 1e-6, dt) if vi.name == "eps" else (np.random.default_rng(1).standard_normal(shape) * 3).astype(dt)
    return out


def cases():
    """The declared cases: what the plugin must fuse, must leave alone, and must refuse."""
    return [
        positive("div-form", _rmsnorm_model(), matches=1, feeds=_feeds),
        positive("reciprocal-form-weight-first-two-layers", _rmsnorm_model(reciprocal=True, layers=2), matches=2, feeds=_feeds),
        positive("float16", _rmsnorm_model(dtype=TensorProto.FLOAT16), matches=1, feeds=_feeds),
        positive("float16-computed-in-float32", _rmsnorm_model(dtype=TensorProto.FLOAT16, compute=TensorProto.FLOAT, reciprocal=True),
                 matches=1, feeds=_feeds),
        negative("reduce-over-axis-1", _rmsnorm_model(axes=(1,), weight_shape=(16,))),
        negative("cube-not-square", _rmsnorm_model(exponent=3.0)),
        negative("epsilon-is-a-graph-input", _rmsnorm_model(eps_input=True)),
        negative("weight-per-row", _rmsnorm_model(weight_shape=(3, 16))),
        negative("float32-computed-in-float16", _rmsnorm_model(compute=TensorProto.FLOAT16)),
        bad_input("opset-21", _rmsnorm_model(opset=21), error="opset 21 is outside plugin 'rmsnorm' range 23..28"),
    ]
