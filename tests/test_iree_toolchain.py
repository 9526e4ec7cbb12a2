"""Contracts of rewrite.backends.iree_toolchain: ONNX -> MLIR -> .vmfb -> results equal to onnxruntime's."""

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from rewrite.backends.errors import BackendError
from rewrite.backends.iree_toolchain import (
    COMPILE_CACHE_ENV,
    DRIVER_FOR_TARGET,
    ImportResult,
    IreeCompileError,
    IreeImportError,
    IreeModule,
    compile_mlir,
    import_onnx,
)

F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def _save(tmp_path: Path, name: str, nodes, inputs, outputs, initializers=(), opset=17) -> Path:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    return path


def _build(onnx_path: Path, *, externalize: bool = True) -> tuple[IreeModule, ImportResult]:
    stem = onnx_path.with_suffix("")
    result = import_onnx(onnx_path, stem.with_suffix(".mlir"), params_path=stem.with_suffix(".irpa") if externalize else None)
    compile_mlir(result.mlir_path, stem.with_suffix(".vmfb"), target="llvm-cpu")
    module = IreeModule(stem.with_suffix(".vmfb"), params_path=result.params_path, driver=DRIVER_FOR_TARGET["llvm-cpu"])
    return module, result


def _ort(onnx_path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_large_initializer_goes_to_irpa_small_stays_inline_and_results_match_ort(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 48)).astype(np.float32)  # 3072 elements >= 1024: externalized
    b = rng.standard_normal(48).astype(np.float32)  # 48 elements: inline constant
    path = _save(
        tmp_path, "mm",
        [helper.make_node("MatMul", ["X", "W"], ["M"]), helper.make_node("Add", ["M", "B"], ["Y"])],
        [helper.make_tensor_value_info("X", F32, [2, 64])],
        [helper.make_tensor_value_info("Y", F32, [2, 48])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")],
    )
    module, result = _build(path)

    mlir = result.mlir_path.read_text()
    assert '#stream.parameter.named<"model"::"W">' in mlir
    assert '"model"::"B"' not in mlir and "dense_resource<B>" in mlir
    assert result.params_path is not None and result.params_path.stat().st_size >= w.nbytes
    assert result.entry_function == "mm" and module.function_names == ("mm",)

    x = rng.standard_normal((2, 64)).astype(np.float32)
    (y,) = module(x)
    np.testing.assert_allclose(y, _ort(path, {"X": x})[0], atol=1e-5, rtol=0)


def test_dynamic_batch_runs_every_batch_size_on_one_module(tmp_path):
    scale = numpy_helper.from_array(np.array(0.5, np.float32), "scale")
    path = _save(
        tmp_path, "torch-jit.export",  # not a bare MLIR identifier: the importer quotes it
        [helper.make_node("Mul", ["X", "scale"], ["S"]), helper.make_node("Softmax", ["S"], ["P"], axis=-1),
         helper.make_node("ReduceMax", ["P"], ["Y"], axes=[1], keepdims=1)],
        [helper.make_tensor_value_info("X", F32, ["N", 8])],
        [helper.make_tensor_value_info("Y", F32, ["N", 1])],
        [scale],
    )
    module, result = _build(path, externalize=False)
    assert result.params_path is None
    assert result.entry_function == "torch-jit.export" and module.function_names == ("torch-jit.export",)

    rng = np.random.default_rng(1)
    for n in (1, 4, 9):
        x = rng.standard_normal((n, 8)).astype(np.float32)
        (y,) = module(x)
        assert y.shape == (n, 1)
        np.testing.assert_allclose(y, _ort(path, {"X": x})[0], atol=1e-5, rtol=0)


def test_arguments_follow_graph_input_order_without_initializers(tmp_path):
    # Old-style model: the initializer W is also listed in graph.input; it must not become an argument.
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    path = _save(
        tmp_path, "order",
        [helper.make_node("MatMul", ["X", "W"], ["M"]), helper.make_node("Sub", ["M", "Y"], ["Z"])],
        [helper.make_tensor_value_info("Y", F32, [2, 3]), helper.make_tensor_value_info("W", F32, [4, 3]),
         helper.make_tensor_value_info("X", F32, [2, 4])],
        [helper.make_tensor_value_info("Z", F32, [2, 3]), helper.make_tensor_value_info("M", F32, [2, 3])],
        [numpy_helper.from_array(w, "W")],
    )
    module, _ = _build(path, externalize=False)
    x, y = np.ones((2, 4), np.float32), np.full((2, 3), 2.0, np.float32)
    z, m = module(y, x)
    np.testing.assert_allclose(m, x @ w, atol=1e-5, rtol=0)
    np.testing.assert_allclose(z, x @ w - y, atol=1e-5, rtol=0)


def test_two_results_float_and_int64_in_graph_output_order(tmp_path):
    path = _save(
        tmp_path, "topk",
        [helper.make_node("TopK", ["X", "K"], ["V", "I"], axis=-1)],
        [helper.make_tensor_value_info("X", F32, [3, 16])],
        [helper.make_tensor_value_info("V", F32, [3, 4]), helper.make_tensor_value_info("I", I64, [3, 4])],
        [numpy_helper.from_array(np.array([4], np.int64), "K")],
    )
    module, _ = _build(path)
    rng = np.random.default_rng(2)
    x = np.stack([rng.permutation(16) for _ in range(3)]).astype(np.float32)  # no ties: indices are unique
    results = module(x)
    ref_values, ref_indices = _ort(path, {"X": x})
    assert isinstance(results, list) and len(results) == 2
    values, indices = results
    np.testing.assert_allclose(values, ref_values, atol=1e-5, rtol=0)
    assert indices.dtype == np.int64
    np.testing.assert_array_equal(indices, ref_indices)


def test_zero_length_kv_past_is_accepted(tmp_path):
    heads, head_dim = 4, 32
    path = _save(
        tmp_path, "kv",
        [helper.make_node("Concat", ["past", "new"], ["present"], axis=2),
         helper.make_node("Transpose", ["present"], ["present_t"], perm=[0, 1, 3, 2]),
         helper.make_node("MatMul", ["new", "present_t"], ["scores"]),
         helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
         helper.make_node("MatMul", ["probs", "present"], ["out"])],
        [helper.make_tensor_value_info("past", F32, [1, heads, "P", head_dim]),
         helper.make_tensor_value_info("new", F32, [1, heads, 1, head_dim])],
        [helper.make_tensor_value_info("out", F32, [1, heads, 1, head_dim]),
         helper.make_tensor_value_info("present", F32, [1, heads, "P1", head_dim])],
    )
    module, _ = _build(path)
    rng = np.random.default_rng(3)
    for past_len in (0, 3):
        past = rng.standard_normal((1, heads, past_len, head_dim)).astype(np.float32)
        new = rng.standard_normal((1, heads, 1, head_dim)).astype(np.float32)
        out, present = module(past, new)
        ref_out, ref_present = _ort(path, {"past": past, "new": new})
        assert present.shape == (1, heads, past_len + 1, head_dim)
        np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=0)
        np.testing.assert_allclose(present, ref_present, atol=1e-5, rtol=0)


_ACCUMULATOR_MLIR = """
module {
  util.global private mutable @acc = dense<0.0> : tensor<4xf32>
  func.func @add(%x: tensor<4xf32>) -> tensor<4xf32> {
    %a = util.global.load @acc : tensor<4xf32>
    %s = arith.addf %a, %x : tensor<4xf32>
    util.global.store %s, @acc : tensor<4xf32>
    return %s : tensor<4xf32>
  }
}
"""


def test_module_state_persists_across_calls_until_reset(tmp_path):
    mlir = tmp_path / "acc.mlir"
    mlir.write_text(_ACCUMULATOR_MLIR)
    compile_mlir(mlir, tmp_path / "acc.vmfb")
    module = IreeModule(tmp_path / "acc.vmfb")
    one = np.ones(4, np.float32)
    (first,) = module(one)
    (second,) = module(one)
    np.testing.assert_array_equal(first, one)  # a host copy: not changed by the second call
    np.testing.assert_array_equal(second, 2 * one)
    module.reset()
    np.testing.assert_array_equal(module(one)[0], one)


def _assert_one_line(message: str, *fragments: str) -> None:
    assert "\n" not in message and len(message) < 800, message
    for fragment in fragments:
        assert fragment in message, message


def test_unreadable_file_raises_import_error_naming_it(tmp_path):
    path = tmp_path / "garbage.onnx"
    path.write_bytes(b"this is not a protobuf \x00\x01\x02")
    with pytest.raises(IreeImportError) as info:
        import_onnx(path, tmp_path / "garbage.mlir", params_path=None)
    assert isinstance(info.value, BackendError)
    _assert_one_line(str(info.value), str(path), "DecodeError")
    assert not (tmp_path / "garbage.mlir").exists()


def test_unknown_op_raises_import_error_naming_file_and_op(tmp_path):
    path = _save(
        tmp_path, "unknown_op", [helper.make_node("NoSuchOp", ["X"], ["Y"])],
        [helper.make_tensor_value_info("X", F32, [2])], [helper.make_tensor_value_info("Y", F32, [2])],
    )
    with pytest.raises(IreeImportError) as info:
        import_onnx(path, tmp_path / "unknown_op.mlir", params_path=tmp_path / "unknown_op.irpa")
    _assert_one_line(str(info.value), str(path), "NoSuchOp")


def test_op_without_lowering_raises_compile_error_with_log(tmp_path):
    # The importer accepts any registered op; ops torch-mlir cannot lower fail in iree-compile.
    path = _save(
        tmp_path, "strings", [helper.make_node("StringNormalizer", ["S"], ["T"])],
        [helper.make_tensor_value_info("S", TensorProto.STRING, [3])],
        [helper.make_tensor_value_info("T", TensorProto.STRING, [3])],
    )
    result = import_onnx(path, tmp_path / "strings.mlir", params_path=None)
    with pytest.raises(IreeCompileError) as info:
        compile_mlir(result.mlir_path, tmp_path / "strings.vmfb")
    log = tmp_path / "compile.log"
    _assert_one_line(str(info.value), str(result.mlir_path), "error:", "StringNormalizer", str(log))
    assert "StringNormalizer" in log.read_text()
    assert not (tmp_path / "strings.vmfb").exists()


def test_cuda_target_compiles_without_a_gpu(tmp_path):
    path = _save(
        tmp_path, "cuda_mm",
        [helper.make_node("MatMul", ["X", "W"], ["Y"])],
        [helper.make_tensor_value_info("X", F32, ["N", 32])],
        [helper.make_tensor_value_info("Y", F32, ["N", 16])],
        [numpy_helper.from_array(np.ones((32, 16), np.float32), "W")],
    )
    result = import_onnx(path, tmp_path / "cuda_mm.mlir", params_path=tmp_path / "cuda_mm.irpa")
    compile_mlir(result.mlir_path, tmp_path / "cuda_mm.vmfb", target="cuda")
    assert (tmp_path / "cuda_mm.vmfb").stat().st_size > 0


def test_a_compile_error_at_an_onnx_node_names_the_node():
    """The module reaches iree-compile with the importer's locations (one per ONNX node); the one-line summary
    names the node (seen on the Qwen3-Next export: its value_info claims a static chunk count)."""
    from rewrite.backends.iree_toolchain import _failure_summary

    log = ("<unknown>:0: error: loc(\"node_matmul\"): 'tensor.expand_shape' op expected dimension 0 of collapsed type "
           "to be static value of 4\n<unknown>:0: note: loc(\"node_matmul\"): see current operation: ...\n")
    assert _failure_summary(1, log) == ("at node 'node_matmul': 'tensor.expand_shape' op expected dimension 0 of "
                                        "collapsed type to be static value of 4")
    missing = ("ERROR: referenced object file not found on any path: #hal.executable.object<{path = \"kernels/x.o\"}>\n"
               "<unknown>:0: error: failed to serialize executable for target backend llvm-cpu\n")
    assert _failure_summary(1, missing).startswith("ERROR: referenced object file not found") and "kernels/x.o" in _failure_summary(1, missing)


def test_params_written_file_to_file_equal_the_importers(tmp_path):
    """The .irpa our import writes from the external data (spans of the data file) holds, key by key, the bytes
    IREE's importer writes from arrays in memory; inline and external initializers, several element types."""
    import subprocess
    import sys

    import iree.runtime as rt
    from onnx.external_data_helper import convert_model_to_external_data

    rng = np.random.default_rng(0)
    arrays = {"wf": rng.standard_normal((64, 80)).astype(np.float32), "wh": rng.standard_normal((80, 64)).astype(np.float16),
              "codes": rng.integers(0, 16, (64, 512), dtype=np.uint8), "idx": np.arange(5000, dtype=np.int64)}
    nodes = [helper.make_node("MatMul", ["x", "wf"], ["a"]), helper.make_node("Cast", ["wh"], ["whf"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["a", "whf"], ["b"]), helper.make_node("Cast", ["codes"], ["cf"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["b", "cf"], ["c"]), helper.make_node("Gather", ["idx", "i"], ["g"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64]),
                                       helper.make_tensor_value_info("i", TensorProto.INT64, [3])],
                          [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 512]),
                           helper.make_tensor_value_info("g", TensorProto.INT64, [3])],
                          [numpy_helper.from_array(a, n) for n, a in arrays.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    convert_model_to_external_data(m, location="m.onnx.data", size_threshold=20000)  # "idx" (40 kB) too; "wh" inline
    onnx.save(m, tmp_path / "m.onnx")
    assert {t.name for t in m.graph.initializer if t.data_location == TensorProto.EXTERNAL} == {"wf", "codes", "idx"}

    ours = import_onnx(tmp_path / "m.onnx", tmp_path / "ours.mlir", params_path=tmp_path / "ours.irpa",
                       param_threshold_elements=1024)
    assert ours.params_path == tmp_path / "ours.irpa"
    theirs = tmp_path / "theirs.irpa"
    subprocess.run([sys.executable, "-m", "iree.compiler.tools.import_onnx", str(tmp_path / "m.onnx"), "-o",
                    str(tmp_path / "theirs.mlir"), "--externalize-params", "--num-elements-threshold", "1024",
                    "--params-scope", "model", "--save-params-to", str(theirs)], check=True, capture_output=True)

    def contents(path):
        index = rt.ParameterIndex()
        index.load(str(path))
        return {k: bytes(e.file_view) for k, e in index.items()}

    got, want = contents(tmp_path / "ours.irpa"), contents(theirs)
    assert sorted(got) == sorted(want) and len(got) == 4
    for k in want:
        assert got[k] == want[k], k
    # the spans the folder's model.onnx is pointed at hold each initializer's ONNX raw bytes
    assert sorted(ours.param_spans) == sorted(arrays)
    blob = (tmp_path / "ours.irpa").read_bytes()
    for name, (offset, length) in ours.param_spans.items():
        assert blob[offset:offset + length] == arrays[name].tobytes(), name


def test_compile_cache_reuses_a_module_only_for_the_same_inputs(tmp_path, monkeypatch):
    """With REWRITE_IREE_COMPILE_CACHE set, the second compile of the same MLIR and flags copies the stored module
    (the log says so, the module runs the same); other flags, or other bytes of a file the MLIR names, compile
    again; a failed compile stores nothing."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(COMPILE_CACHE_ENV, str(cache))
    path = _save(
        tmp_path, "mm",
        [helper.make_node("MatMul", ["X", "W"], ["Y"])],
        [helper.make_tensor_value_info("X", F32, ["N", 8])],
        [helper.make_tensor_value_info("Y", F32, ["N", 4])],
        [numpy_helper.from_array(np.arange(32, dtype=np.float32).reshape(8, 4), "W")],
    )
    result = import_onnx(path, tmp_path / "mm.mlir", params_path=None)
    (tmp_path / "obj.bin").write_bytes(b"one")  # a file the MLIR names, as kernel objects are named
    with open(result.mlir_path, "a") as f:
        f.write('\n// path = "obj.bin"\n')
    compiled = []
    for k, flags in enumerate([(), (), ("--iree-opt-strip-assertions",), ()]):
        if k == 3:
            (tmp_path / "obj.bin").write_bytes(b"two")
        out = tmp_path / f"out{k}" / "mm.vmfb"
        compile_mlir(result.mlir_path, out, extra_flags=flags)
        compiled.append("not compiled" not in (out.parent / "compile.log").read_text())
        module = IreeModule(out, driver=DRIVER_FOR_TARGET["llvm-cpu"])
        x = np.ones((2, 8), np.float32)
        np.testing.assert_array_equal(module(x)[0], x @ np.arange(32, dtype=np.float32).reshape(8, 4))
    assert compiled == [True, False, True, True]
    assert "iree-compile" in (tmp_path / "out1" / "compile.log").read_text().splitlines()[0]  # the command first
    monkeypatch.delenv(COMPILE_CACHE_ENV)
    (tmp_path / "obj.bin").write_bytes(b"one")
    compile_mlir(result.mlir_path, tmp_path / "fresh" / "mm.vmfb")  # what the reused module must equal
    assert (tmp_path / "out1" / "mm.vmfb").read_bytes() == (tmp_path / "fresh" / "mm.vmfb").read_bytes()
    assert len(list(cache.glob("*.vmfb"))) == len(list(cache.glob("*.log"))) == 3 and not list(cache.glob(".*.part"))
    monkeypatch.setenv(COMPILE_CACHE_ENV, str(cache))

    bad = tmp_path / "bad.mlir"
    bad.write_text("func.func @f() { this is not MLIR }\n")
    with pytest.raises(IreeCompileError):
        compile_mlir(bad, tmp_path / "bad" / "bad.vmfb")
    assert len(list(cache.glob("*.vmfb"))) == 3
