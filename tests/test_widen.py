"""``rewrite.core.widen.widen_float16``: an fp16 model's float32 twin computes the same model without fp16 rounding."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from rewrite.core.widen import widen_float16
from rewrite.errors import ModelLoadError, RewriteError

F16, F32 = TensorProto.FLOAT16, TensorProto.FLOAT


def _fp16_model(tmp_path, rng):
    """y = (Cast(x + X, FLOAT16) @ W + If(flag, c_then, c_else)) * Constant, with W (fp16) and X (float32) external
    and the branches fp16."""
    w = (rng.standard_normal((64, 32)) * 0.1).astype(np.float16)
    bias = rng.standard_normal(32).astype(np.float16)
    shift = rng.standard_normal((4, 64)).astype(np.float32)
    then_g = helper.make_graph([helper.make_node("Constant", [], ["t"], value=numpy_helper.from_array(bias, "tb"))],
                               "then", [], [helper.make_tensor_value_info("t", F16, [32])])
    else_g = helper.make_graph([helper.make_node("Constant", [], ["e"], value=numpy_helper.from_array(-bias, "eb"))],
                               "else", [], [helper.make_tensor_value_info("e", F16, [32])])
    nodes = [
        helper.make_node("Add", ["x", "X"], ["x2"]),
        helper.make_node("Cast", ["x2"], ["xh"], to=F16),
        helper.make_node("MatMul", ["xh", "W"], ["mm0"]),
        helper.make_node("Reshape", ["mm0", "shape"], ["mm"]),
        helper.make_node("If", ["flag"], ["br"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Add", ["mm", "br"], ["s"]),
        helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array([0.333], np.float16), "k")),
        helper.make_node("Mul", ["s", "k"], ["y"]),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, [4, 64]),
                                       helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", F16, [4, 32])], [numpy_helper.from_array(w, "W"), numpy_helper.from_array(shift, "X"),
                                                                   numpy_helper.from_array(np.array([4, 32]), "shape")],
                          value_info=[helper.make_tensor_value_info("mm", F16, [4, 32])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    src = tmp_path / "src" / "model.onnx"
    src.parent.mkdir()
    onnx.save(model, str(src), save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data",
              size_threshold=1024)  # W and X; the Reshape's shape stays inline (ONNX Runtime reads it at load)
    return src, w, bias, shift


def _run(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_the_twin_is_float32_everywhere_and_computes_the_model_without_fp16_rounding(tmp_path):
    rng = np.random.default_rng(0)
    src, w, bias, shift = _fp16_model(tmp_path, rng)
    dst = widen_float16(src, tmp_path / "dst" / "model.onnx")
    assert dst == tmp_path / "dst" / "model.onnx" and (dst.parent / "model.onnx.data").is_file()
    m = onnx.load(str(dst), load_external_data=False)
    assert m.graph.output[0].type.tensor_type.elem_type == F32
    assert m.graph.value_info[0].type.tensor_type.elem_type == F32
    cast = next(n for n in m.graph.node if n.op_type == "Cast")
    assert helper.get_attribute_value(cast.attribute[0]) == F32
    branches = next(n for n in m.graph.node if n.op_type == "If").attribute
    assert all(a.g.node[0].attribute[0].t.data_type == F32 and a.g.output[0].type.tensor_type.elem_type == F32
               for a in branches)
    assert [t.external_data[0].value for t in m.graph.initializer if t.external_data] == ["model.onnx.data"] * 2
    full = onnx.load(str(dst))
    assert full.graph.initializer[0].data_type == F32
    assert np.array_equal(numpy_helper.to_array(full.graph.initializer[0]), w.astype(np.float32))  # exact upcast
    x = rng.standard_normal((4, 64)).astype(np.float32)
    for flag, b in ((True, bias), (False, -bias)):
        feeds = {"x": x, "flag": np.array(flag)}
        # the twin's Cast to FLOAT16 is a Cast to FLOAT: x is not rounded either
        exact = ((x + shift).astype(np.float64) @ w.astype(np.float64) + b.astype(np.float64)) * np.float64(np.float16(0.333))
        wide, narrow = _run(dst, feeds), _run(src, feeds)
        assert wide.dtype == np.float32 and narrow.dtype == np.float16
        scale = np.abs(exact).max()
        assert np.abs(wide - exact).max() / scale < 1e-6  # float32 sums of the same values
        assert 1e-5 < np.abs(narrow.astype(np.float64) - exact).max() / scale < 1e-2  # fp16's rounding, which it removes


def test_bad_arguments_are_one_clear_error(tmp_path):
    src, *_ = _fp16_model(tmp_path, np.random.default_rng(1))
    with pytest.raises(RewriteError, match="another file"):
        widen_float16(src, src)
    (src.parent / "model.onnx.data").write_bytes(b"\0" * 16)  # shorter than W
    with pytest.raises(RewriteError, match="'W'.*missing or ends early"):
        widen_float16(src, tmp_path / "dst" / "model.onnx")
    assert list((tmp_path / "dst").iterdir()) == []  # the data file begun is removed
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(ModelLoadError):
        widen_float16(tmp_path / "junk.onnx", tmp_path / "out.onnx")


def test_in_the_source_folder_only_the_widened_tensors_are_written(tmp_path):
    rng = np.random.default_rng(2)
    src, w, *_ = _fp16_model(tmp_path, rng)
    before = (src.parent / "model.onnx.data").read_bytes()
    dst = widen_float16(src, src.with_name("model.fp32.onnx"))
    m = onnx.load(str(dst), load_external_data=False)
    where = {t.name: {e.key: e.value for e in t.external_data}["location"] for t in m.graph.initializer if t.external_data}
    assert where == {"W": "model.fp32.onnx.data", "X": "model.onnx.data"}  # the float32 tensor is not copied
    assert (src.parent / "model.fp32.onnx.data").stat().st_size == w.size * 4
    assert (src.parent / "model.onnx.data").read_bytes() == before
    feeds = {"x": rng.standard_normal((4, 64)).astype(np.float32), "flag": np.array(True)}
    assert np.abs(_run(dst, feeds) - _run(src, feeds)).max() < 1e-2
    onnx.save(onnx.load(str(src)), str(src.with_name("other.onnx")), save_as_external_data=True, location="x.data",
              size_threshold=1024)
    with pytest.raises(RewriteError, match="x.data is where the float32 twin's would go"):
        widen_float16(src.with_name("other.onnx"), src.with_name("x"))


def test_every_element_type_attribute_and_no_half_written_twin(tmp_path):
    """``output_dtype`` (DequantizeLinear, opset 23) is widened like ``to`` and ``dtype``; a Constant whose tensor
    keeps its data outside the model is refused in one line, and nothing of the twin is left behind."""
    nodes = [helper.make_node("DequantizeLinear", ["q", "s"], ["y"], output_dtype=F16),
             helper.make_node("EyeLike", ["y"], ["e"], dtype=F16)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("q", TensorProto.UINT8, [4, 4])],
                          [helper.make_tensor_value_info("e", F16, [4, 4])],
                          [numpy_helper.from_array(np.array(0.5, np.float32), "s")])
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)]), str(src))
    m = onnx.load(str(widen_float16(src, tmp_path / "w" / "m.onnx")))
    assert [helper.get_attribute_value(n.attribute[0]) for n in m.graph.node] == [F32, F32]
    const = numpy_helper.from_array(np.ones(600, np.float16), "big")
    g = helper.make_graph([helper.make_node("Constant", [], ["y"], value=const)], "g", [],
                          [helper.make_tensor_value_info("y", F16, [600])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(model, str(tmp_path / "c.onnx"), save_as_external_data=True, convert_attribute=True, size_threshold=0,
              location="c.onnx.data")
    with pytest.raises(RewriteError, match="attribute tensor 'big' keeps its data outside the model"):
        widen_float16(tmp_path / "c.onnx", tmp_path / "out" / "c.onnx")
    assert not (tmp_path / "out" / "c.onnx").exists() and not (tmp_path / "out" / "c.onnx.data").exists()
