"""Shape refinement on models whose weights must not all pass through protobuf (rewrite/core/shapes.py)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rewrite.core import onnx_io, shapes
from rewrite.core.shapes import infer_shapes


def _model_with_a_large_weight(k: int = 512, n: int = 256) -> onnx.ModelProto:
    """y = Reshape(x @ W, Concat(Shape(x)[:1], [n])) with W [k, n] float32 (512 KiB) and a small shape constant
    that data propagation needs."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"], name="mm"),
             helper.make_node("Shape", ["x"], ["xs"], name="shape", end=1),
             helper.make_node("Concat", ["xs", "n"], ["target"], axis=0, name="cat"),
             helper.make_node("Reshape", ["xw", "target"], ["y"], name="reshape")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "W"),
                           numpy_helper.from_array(np.array([n], np.int64), "n")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_shape_inference_sees_large_initializers_as_typed_inputs_only(monkeypatch):
    """onnx shape inference serializes whatever it is given (two plugin-made 1.1 GB tensors passed protobuf's
    2 GB limit): large initializers reach it as typed graph inputs without data; small shape constants still
    propagate, and every type comes out as with the whole model."""
    seen = []
    real = onnx.shape_inference.infer_shapes

    def spy(model, *args, **kwargs):
        seen.append(({t.name for t in model.graph.initializer}, {i.name for i in model.graph.input}, model.ByteSize()))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", spy)
    g = onnx_io.load(_model_with_a_large_weight())
    infer_shapes(g)
    assert seen and all("n" in inits and "W" not in inits and "W" in inputs and size < shapes.SKELETON_MAX_BYTES for inits, inputs, size in seen)
    assert g.values["y"].shape == (3, 256) and g.values["xw"].shape == (3, 256)
    assert g.values["W"].is_initializer and "W" not in g.inputs  # the graph itself is unchanged
    written = onnx_io.to_model(g)
    assert [t.name for t in written.graph.initializer] == ["W", "n"] and [i.name for i in written.graph.input] == ["x"]
