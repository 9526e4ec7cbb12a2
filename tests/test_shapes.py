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


def _specialized_claims_model() -> onnx.ModelProto:
    """The Qwen3-Next export's pattern: a chunk count ``c`` flows through MatMul and Unsqueeze (axes as an
    input) while the exporter's value_info types both results with ``c = 1``, the traced size."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["a", "W"], ["mm"], name="node_matmul"),
             helper.make_node("Unsqueeze", ["mm", "ax"], ["un"], name="node_unsqueeze"),
             helper.make_node("Shape", ["a"], ["sh"], name="shape", end=4),
             helper.make_node("Concat", ["sh", "tail"], ["sh2"], axis=0, name="cat"),
             helper.make_node("Reshape", ["un", "sh2"], ["y"], name="reshape")]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 2, "c", 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, "c", 3, 5, 1])],
        [numpy_helper.from_array(rng.standard_normal((4, 5)).astype(np.float32), "W"),
         numpy_helper.from_array(np.array([-1], np.int64), "ax"),
         numpy_helper.from_array(np.array([5, 1], np.int64), "tail")],
        value_info=[helper.make_tensor_value_info("mm", TensorProto.FLOAT, [1, 2, 1, 3, 5]),
                    helper.make_tensor_value_info("un", TensorProto.FLOAT, [1, 2, 1, 3, 5, 1]),
                    helper.make_tensor_value_info("sh2", TensorProto.INT64, [6])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_claims_their_own_inputs_contradict_take_the_inputs_symbol():
    g = onnx_io.load(_specialized_claims_model())
    assert shapes.drop_contradicted_claims(g) == ["mm", "un"]
    assert g.values["mm"].shape == (1, 2, "c", 3, 5) and g.values["un"].shape == (1, 2, "c", 3, 5, 1)
    assert shapes.drop_contradicted_claims(g) == []  # nothing left to correct
    infer_shapes(g)
    assert g.values["mm"].shape == (1, 2, "c", 3, 5) and g.values["sh2"].shape == (6,)


def test_specialized_claims_no_longer_break_iree_compile(tmp_path):
    """Before the correction iree-compile failed on this graph ('expected ... static value'); now it compiles
    and agrees with ONNX Runtime at c = 2 (the claims said 1)."""
    from rewrite.backends import load_runner
    from rewrite.pipeline import apply
    from rewrite.verify import reference_outputs

    path = tmp_path / "m.onnx"
    onnx.save(_specialized_claims_model(), path)
    apply(path, tmp_path / "iree", backend="iree")
    a = np.random.default_rng(1).standard_normal((1, 2, 2, 3, 4)).astype(np.float32)
    got = load_runner(tmp_path / "iree").run({"a": a})["y"]
    want = reference_outputs(path, {"a": a})["y"]
    assert got.shape == (1, 2, 2, 3, 5, 1) and np.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_selections_of_a_partly_known_shape_are_known_where_they_pick_static_dims():
    """Gather/Slice of Shape(x) with x [1, T, 2]: the static dims evaluate (and what is computed from them, as
    the Range of Qwen3.5-MoE's rotary ScatterND indices), the symbolic T does not."""
    from rewrite.core.shape_eval import known_value, known_values

    c = lambda n, v: numpy_helper.from_array(np.array(v, np.int64), n)  # noqa: E731
    g = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["s"]),
         helper.make_node("Gather", ["s", "two"], ["n"], axis=0),
         helper.make_node("Range", ["zero", "n", "one"], ["r"]),
         helper.make_node("Gather", ["s", "one"], ["t"], axis=0),
         helper.make_node("Slice", ["s", "zero1", "two1"], ["head"]),
         helper.make_node("Slice", ["s", "two1", "three1"], ["tail"]),
         helper.make_node("Add", ["t", "one"], ["t1"]),
         helper.make_node("Add", ["n", "one"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 2])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [])],
        [c("two", 2), c("zero", 0), c("one", 1), c("zero1", [0]), c("two1", [2]), c("three1", [3])])
    graph = onnx_io.load(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
    known = known_values(graph)
    assert int(known["n"]) == 2 and known["r"].tolist() == [0, 1] and known["tail"].tolist() == [2]
    assert "t" not in known and "t1" not in known and "head" not in known
    assert known_value(graph, "r").tolist() == [0, 1] and known_value(graph, "t1") is None


def test_a_selection_of_a_shape_cast_to_float_is_not_taken_for_an_integer():
    """Gather(Cast(Shape(x), to=FLOAT), 2) is a float: the partial-shape evaluation (int64 selections only)
    leaves it unknown rather than making it an int64."""
    from rewrite.core.shape_eval import known_values

    g = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Cast", ["s"], ["f"], to=TensorProto.FLOAT),
         helper.make_node("Gather", ["f", "two"], ["y"], axis=0)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])], [numpy_helper.from_array(np.array(2, np.int64), "two")])
    assert "y" not in known_values(onnx_io.load(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])))
