"""Graph inputs with an initializer default (ONNX IR spec, "Graphs": an initializer named among the inputs is
that input's default, which a caller may override). The interface never changes unless ``--freeze-inputs``
asks: the plugins, shape inference and both backends treat such a value as an input, and the output folder
takes it as an optional argument that gives the same outputs as the original model on ONNX Runtime, with and
without the override.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from rewrite.backends import load_runner
from rewrite.core import onnx_io
from rewrite.core.driver import run_plugin
from rewrite.core.feeds import TensorSpec
from rewrite.core.interface import validate_feeds
from rewrite.core.shapes import infer_shapes
from rewrite.errors import InputError, RewriteError
from rewrite.pipeline import RewriteContext, apply
from rewrite.plugins.legalize import Legalize
from rewrite.plugins.quant4 import Quant4

ort.set_default_logger_severity(3)  # ORT warns about every initializer listed among the inputs


def _save(path: Path, nodes, inputs, outputs, inits, *, ir_version: int = 8, opset: int = 18) -> Path:
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits), opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = ir_version
    onnx.checker.check_model(m)
    onnx.save(m, path)
    return path


def _reduce_model(path: Path) -> Path:
    """y = ReduceSum(x: f32[2, 3, 4], axes), axes an input with default [1]."""
    return _save(path, [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0, name="sum")],
                 [helper.make_tensor_value_info("x", TP.FLOAT, [2, 3, 4]), helper.make_tensor_value_info("axes", TP.INT64, [1])],
                 [helper.make_tensor_value_info("y", TP.FLOAT, ["d0", "d1"])], [numpy_helper.from_array(np.array([1], np.int64), "axes")])


def _bias_model(path: Path) -> Path:
    """y = x: f32[2, 3] + bias, bias an input with default [1, 2, 3]."""
    return _save(path, [helper.make_node("Add", ["x", "bias"], ["y"], name="add")],
                 [helper.make_tensor_value_info("x", TP.FLOAT, [2, 3]), helper.make_tensor_value_info("bias", TP.FLOAT, [3])],
                 [helper.make_tensor_value_info("y", TP.FLOAT, [2, 3])], [numpy_helper.from_array(np.array([1, 2, 3], np.float32), "bias")])


def _matmul_model(path: Path, **kw) -> Path:
    """y = Relu(x: f32[4, 64] @ w), w an input with a default f32[64, 32] (a weight quant4 would otherwise take;
    the Relu keeps the MatMul from being an LM head)."""
    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    return _save(path, [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["y"], name="relu")],
                 [helper.make_tensor_value_info("x", TP.FLOAT, [4, 64]), helper.make_tensor_value_info("w", TP.FLOAT, [64, 32])],
                 [helper.make_tensor_value_info("y", TP.FLOAT, [4, 32])], [numpy_helper.from_array(w, "w")], **kw)


def _original(path: Path, feeds: dict) -> dict:
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rewrite.cli", *map(str, args)], capture_output=True, text=True)


# ------------------------------------------------------------------ the graph
def test_a_default_is_no_constant_until_frozen(tmp_path):
    g = onnx_io.load(_reduce_model(tmp_path / "m.onnx"))
    assert g.values["axes"].overridable and g.overridable_inputs() == ["axes"]
    assert g.const("axes") is None
    infer_shapes(g)
    assert g.values["y"].shape == ("d0", "d1")  # which dims remain depends on the axes a caller passes
    g = onnx_io.load(tmp_path / "m.onnx")
    assert g.freeze_inputs() == ["axes"] and g.inputs == ["x"] and g.overridable_inputs() == []
    assert g.const("axes").tolist() == [1]
    infer_shapes(g)
    assert g.values["y"].shape == (2, 4)


def test_a_round_trip_keeps_the_default_an_input(tmp_path):
    g = onnx_io.load(_bias_model(tmp_path / "m.onnx"))
    m = onnx_io.to_model(g)
    assert [i.name for i in m.graph.input] == ["x", "bias"] and [t.name for t in m.graph.initializer] == ["bias"]
    skeleton = onnx_io.to_model(g, skeleton_bytes=1 << 16)
    assert [i.name for i in skeleton.graph.input] == ["x", "bias"] and list(skeleton.graph.initializer) == []


def test_before_ir4_an_initializer_among_the_inputs_is_a_weight(tmp_path):
    """IR 3 lists every initializer among the inputs; ONNX Runtime treats them as constants (feeding one is
    "Invalid input name"), and so does the graph: quant4 takes the weight, the folder does not take it."""
    src = _matmul_model(tmp_path / "m.onnx", ir_version=3, opset=9)
    g = onnx_io.load(src)
    assert not g.values["w"].overridable and g.const("w") is not None and g.freeze_inputs() == []
    m = apply(src, tmp_path / "out", plugins="cast", backend="ort")
    assert [d["name"] for d in m.inputs] == ["x"]
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    np.testing.assert_array_equal(load_runner(tmp_path / "out").run({"x": x})["y"], _original(src, {"x": x})["y"])


# ------------------------------------------------------------------ plugins
def test_quant4_leaves_an_overridable_weight_alone_and_takes_it_once_frozen(tmp_path):
    src = _matmul_model(tmp_path / "m.onnx")
    g = onnx_io.load(src)
    rep = run_plugin(g, Quant4(), RewriteContext(options={"quant4": {"min_elements": 0}}))
    assert rep.matches == 0
    assert [n.op_type for n in g.topo_nodes()] == ["MatMul", "Relu"] and g.inputs == ["x", "w"]
    g = onnx_io.load(src)
    g.freeze_inputs()
    rep = run_plugin(g, Quant4(), RewriteContext(options={"quant4": {"min_elements": 0}}))
    assert rep.matches == 1
    assert "DequantizeLinear" in {n.op_type for n in g.topo_nodes()} and g.inputs == ["x"]


def test_legalize_refuses_to_retype_a_4bit_input_and_leaves_the_graph(tmp_path):
    codes = helper.make_tensor("q", TP.UINT4, [8], list(range(8)))
    src = _save(tmp_path / "m.onnx",
                [helper.make_node("DequantizeLinear", ["q", "s"], ["y"], name="dq")],
                [helper.make_tensor_value_info("q", TP.UINT4, [8])], [helper.make_tensor_value_info("y", TP.FLOAT, [8])],
                [codes, numpy_helper.from_array(np.array(0.5, np.float32), "s")], ir_version=10, opset=21)
    g = onnx_io.load(src)
    with pytest.raises(RewriteError, match=r"graph input 'q' is a 4-bit tensor with an initializer default.*--freeze-inputs"):
        run_plugin(g, Legalize(), RewriteContext(backend="iree"))
    assert g.values["q"].dtype == TP.UINT4 and g.inputs == ["q"]


# ------------------------------------------------------------------ feeds
def test_a_default_input_may_be_left_out_but_not_mistyped():
    specs = [TensorSpec("x", TP.FLOAT, (2,)), TensorSpec("b", TP.FLOAT, (2,), default=True)]
    validate_feeds(specs, {"x": np.zeros(2, np.float32)}, "m")
    with pytest.raises(InputError, match="missing input 'x'"):
        validate_feeds(specs, {"b": np.zeros(2, np.float32)}, "m")
    with pytest.raises(InputError, match="input 'b' is float64, expected float32"):
        validate_feeds(specs, {"x": np.zeros(2, np.float32), "b": np.zeros(2)}, "m")
    assert TensorSpec.from_json(specs[1].to_json()) == specs[1] and "default" not in specs[0].to_json()


# ------------------------------------------------------------------ output folders
@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_output_folder_takes_the_default_as_an_optional_input(tmp_path, backend):
    src = _bias_model(tmp_path / "m.onnx")
    m = apply(src, tmp_path / "out", backend=backend)
    assert [(d["name"], d.get("default", False)) for d in m.inputs] == [("x", False), ("bias", True)]
    assert m.frozen_inputs == []
    runner = load_runner(tmp_path / "out")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([10, 20, 30], np.float32)
    np.testing.assert_array_equal(runner.run({"x": x})["y"], _original(src, {"x": x})["y"])
    np.testing.assert_array_equal(runner.run({"x": x, "bias": b})["y"], _original(src, {"x": x, "bias": b})["y"])
    np.testing.assert_array_equal(runner.run({"x": x, "bias": b})["y"], x + b)


def test_ort_folder_keeps_overridable_reduce_axes(tmp_path):
    src = _reduce_model(tmp_path / "m.onnx")
    r = _cli("apply", src, "--plugins", "cast", "--backend", "ort", "-o", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert "inputs with initializer defaults kept overridable: axes" in r.stdout
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [d["name"] for d in manifest["inputs"]] == ["x", "axes"]
    assert manifest["outputs"][0]["shape"] == ["d0", "d1"]  # not folded to the default's [2, 4]
    x = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x, axes=np.array([2], np.int64))
    r = _cli("run", tmp_path / "out", "--inputs", tmp_path / "in.npz", "--save", tmp_path / "y.npz")
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(np.load(tmp_path / "y.npz")["y"], x.sum(axis=2), rtol=1e-6)
    assert _cli("verify", src, tmp_path / "out").returncode == 0


def test_iree_refuses_runtime_axes_naming_the_option_then_freezing_works(tmp_path):
    src = _reduce_model(tmp_path / "m.onnx")
    r = _cli("apply", src, "--backend", "iree", "-o", tmp_path / "out")
    assert r.returncode == 2 and not (tmp_path / "out").exists()
    assert r.stderr.strip().splitlines() == [
        "error: node 'sum' (ReduceSum): axes 'axes' are known only at run time, which IREE cannot lower (iree-compile "
        "fails to legalize the reduction); they must be a constant (a graph input with a default: --freeze-inputs makes it one)"]
    r = _cli("apply", src, "--backend", "iree", "-o", tmp_path / "out", "--freeze-inputs")
    assert r.returncode == 0, r.stderr
    assert "frozen (now constants, no longer inputs): axes" in r.stdout
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["frozen_inputs"] == ["axes"] and [d["name"] for d in manifest["inputs"]] == ["x"]
    assert manifest["outputs"][0]["shape"] == [2, 4]
    assert _cli("verify", src, tmp_path / "out").returncode == 0
