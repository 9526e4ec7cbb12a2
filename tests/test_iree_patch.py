"""The abstract-op seam: an op created in the graph is lowered for ORT by a decomposition and for IREE by a
statically linked C kernel dispatched per row, and both agree with its numpy reference."""

from __future__ import annotations

import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from rewrite.backends import load_runner
from rewrite.backends.iree_patch import IreeLowering, PatchContext, TorchOperator, find_operators, patch_module
from rewrite.core import onnx_io
from rewrite.core.abstract_ops import DOMAIN, AbstractOp
from rewrite.core.kernels import build_cpu_object, cpu_executable_target
from rewrite.core.rules import Builder
from rewrite.errors import BackendError
from rewrite.pipeline import apply
from rewrite.testing.conformance import registered_lowerings

ROWMAX_C = textwrap.dedent(
    """
    #include <stddef.h>
    #include <stdint.h>
    // one workgroup per row: max and argmax of row `row` of x[n, e]
    void rowmax_workgroup(const float* restrict x, size_t x_off, float* restrict v, size_t v_off,
                          int64_t* restrict idx, size_t idx_off, size_t e, size_t row, float scale) {
      const float* r = x + x_off + row * e;
      size_t best = 0;
      for (size_t j = 1; j < e; ++j) if (r[j] > r[best]) best = j;
      v[v_off + row] = r[best] * scale;
      idx[idx_off + row] = (int64_t)best;
    }
    """
)


class RowMax(AbstractOp):
    """(values [N,1] = max(x, -1) * scale, indices [N,1] int64 = argmax(x, -1)) for x [N, E] float32."""

    op_type = "TestRowMax"

    def __init__(self, obj_path):
        self.obj = obj_path

    def reference(self, attrs, x):
        return [x.max(-1, keepdims=True) * attrs["scale"], x.argmax(-1)[:, None].astype(np.int64)]

    def lower_ort(self, graph, node):
        b = Builder(graph, "lower/TestRowMax", node.order, node.name)
        x = node.inputs[0]
        mx = b.op("ReduceMax", [x, b.const([-1], "axes", np.int64)], keepdims=1)
        v = b.op("Mul", [mx, b.const(node.attr("scale"), "scale", np.float32)])
        i = b.op("ArgMax", [x], axis=-1, keepdims=1)
        graph.replace_node(node, [v, i])

    def lower_iree(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        e = op.operand_types[0].dims[1]
        scale = float(op.attrs["scale"])
        exe = f"""
  stream.executable private @test_rowmax_exec attributes {{
    hal.executable.objects = #hal.executable.objects<{{
      {cpu_executable_target()} = [#hal.executable.object<{{path = "{ctx.object_path(self.obj)}"}}>]
    }}>
  }} {{
    stream.executable.export public @rowmax workgroups(%n: index) -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      stream.return %n, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @rowmax_workgroup(memref<f32>, index, memref<f32>, index, memref<i64>, index, index, index, f32)
        attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @rowmax(%b0: !stream.binding, %b1: !stream.binding, %b2: !stream.binding, %n: index, %e: index, %scale: f32) {{
        %c0 = arith.constant 0 : index
        %row = stream.dispatch.workgroup.id[0] : index
        %ne = arith.muli %n, %e : index
        %m0 = stream.binding.subspan %b0[%c0] : !stream.binding -> memref<?xf32>{{%ne}}
        %m1 = stream.binding.subspan %b1[%c0] : !stream.binding -> memref<?xf32>{{%n}}
        %m2 = stream.binding.subspan %b2[%c0] : !stream.binding -> memref<?xi64>{{%n}}
        %p0, %o0, %s0, %t0 = iree_codegen.extract_strided_metadata %m0 : memref<?xf32> -> memref<f32>, index, index, index
        %p1, %o1, %s1, %t1 = iree_codegen.extract_strided_metadata %m1 : memref<?xf32> -> memref<f32>, index, index, index
        %p2, %o2, %s2, %t2 = iree_codegen.extract_strided_metadata %m2 : memref<?xi64> -> memref<i64>, index, index, index
        func.call @rowmax_workgroup(%p0, %o0, %p1, %o1, %p2, %o2, %e, %row, %scale)
          : (memref<f32>, index, memref<f32>, index, memref<i64>, index, index, index, f32) -> ()
        return
      }}
    }}
  }}"""
        body = f"""
    %n = tensor.dim %in0, %c0_0 : tensor<?x{e}xf32>
    %e = arith.constant {e} : index
    %ne = arith.muli %n, %e : index
    %flat = tensor.collapse_shape %in0 [[0, 1]] : tensor<?x{e}xf32> into tensor<?xf32>
    %scale = arith.constant {scale:e} : f32
    %v, %i = flow.dispatch @test_rowmax_exec::@rowmax[%n](%flat, %n, %e, %scale) : (tensor<?xf32>{{%ne}}, index, index, f32) -> (tensor<?xf32>{{%n}}, tensor<?xi64>{{%n}})
    %out0 = tensor.expand_shape %v [[0, 1]] output_shape [%n, 1] : tensor<?xf32> into tensor<?x1xf32>
    %out1 = tensor.expand_shape %i [[0, 1]] output_shape [%n, 1] : tensor<?xi64> into tensor<?x1xi64>"""
        return IreeLowering(body=body, module_items={"test_rowmax_exec": exe})


def rowmax_model(path):
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node(RowMax.op_type, ["r"], ["v", "i"], domain=DOMAIN, scale=0.5, name="rowmax"),
        helper.make_node("Add", ["v", "v"], ["y"]),
    ]
    g = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1]), helper.make_tensor_value_info("i", TensorProto.INT64, ["N", 1])],
                          value_info=[helper.make_tensor_value_info("v", TensorProto.FLOAT, ["N", 1])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)]), path)
    return path


@pytest.fixture(scope="module")
def rowmax_op(tmp_path_factory):
    src = tmp_path_factory.mktemp("k") / "rowmax.c"
    src.write_text(ROWMAX_C)
    return RowMax(build_cpu_object(src))


def test_find_operators_parses_results_attrs_and_types(tmp_path):
    text = """module {
  func.func @g(%0: !torch.vtensor<[?,8],f32>) -> !torch.vtensor<[?,1],f32> {
    %1:2 = torch.operator "onnx.TestRowMax"(%0) {torch.onnx.scale = 5.000000e-01 : f32, torch.onnx.mode = "a", torch.onnx.axes = [1 : si64, -1 : si64]} : (!torch.vtensor<[?,8],f32>) -> (!torch.vtensor<[?,1],f32>, !torch.vtensor<[?,1],si64>) loc("rowmax_node")
    %2 = torch.operator "onnx.Relu"(%1#0) : (!torch.vtensor<[?,1],f32>) -> !torch.vtensor<[?,1],f32>
    return %2 : !torch.vtensor<[?,1],f32>
  }
}"""
    (op,) = find_operators(text, {"TestRowMax"})
    assert op.op_type == "TestRowMax" and op.node == "rowmax_node" and op.where == "at node 'rowmax_node'"
    assert op.attrs == {"scale": 0.5, "mode": "a", "axes": [1, -1]}
    assert [t.builtin for t in op.operand_types] == ["tensor<?x8xf32>"]
    assert [t.builtin for t in op.result_types] == ["tensor<?x1xf32>", "tensor<?x1xi64>"]


@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_abstract_op_lowered_per_backend_matches_reference(tmp_path, rowmax_op, backend):
    model = rowmax_model(tmp_path / "m.onnx")
    out = tmp_path / backend
    with registered_lowerings(rowmax_op.lowerings()):
        m = apply(model, out, backend=backend)
    if backend == "iree":
        assert m.kernel_objects == [f"kernels/{rowmax_op.obj.name}"]
        assert (out / m.kernel_objects[0]).read_bytes() == rowmax_op.obj.read_bytes()
        assert "flow.dispatch @test_rowmax_exec::@rowmax" in (out / "model.mlir").read_text()
    else:
        assert [n.op_type for n in onnx.load(out / "model.onnx").graph.node] == ["Relu", "ReduceMax", "Mul", "ArgMax", "Add"]
    runner = load_runner(out)
    for n in (1, 5, 33):
        x = np.random.default_rng(n).standard_normal((n, 8)).astype(np.float32)
        got = runner.run({"x": x})
        v, i = rowmax_op.reference({"scale": 0.5}, np.maximum(x, 0))
        np.testing.assert_allclose(got["y"], 2 * v, rtol=1e-6)
        np.testing.assert_array_equal(got["i"], i)


class _BrokenRowMax(RowMax):
    """RowMax whose IREE lowering is wrong in one way: ``how`` = "body" (a value the body never defines) or
    "object" (an executable naming a kernel object that is not there)."""

    def __init__(self, obj_path, how):
        super().__init__(obj_path)
        self.how = how

    def lower_iree(self, op, ctx):
        low = super().lower_iree(op, ctx)
        if self.how == "body":
            return IreeLowering(body=low.body.replace("%flat, %n, %e, %scale", "%flat, %nowhere, %e, %scale"),
                                module_items=low.module_items)
        items = {k: v.replace(f'path = "kernels/{self.obj.name}"', 'path = "kernels/missing.o"') for k, v in low.module_items.items()}
        return IreeLowering(body=low.body, module_items=items)


def test_a_lowering_that_does_not_parse_is_refused_before_compiling_naming_the_node(tmp_path, rowmax_op):
    op = _BrokenRowMax(rowmax_op.obj, "body")
    with registered_lowerings(op.lowerings()), pytest.raises(BackendError) as e:
        apply(rowmax_model(tmp_path / "m.onnx"), tmp_path / "out", backend="iree")
    assert str(e.value).startswith("IREE lowering of TestRowMax at node 'rowmax': its MLIR does not parse:")
    assert "nowhere" in str(e.value) or "undeclared SSA value" in str(e.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.failed").exists()  # iree-compile never ran


def test_the_module_iree_compile_gets_carries_node_locations(tmp_path, rowmax_op):
    """The module goes to iree-compile with its locations (errors at an imported op name its ONNX node; at a
    lowering's op, the lowering and the node); a kernel object that is not there is named in the error."""
    with registered_lowerings(rowmax_op.lowerings()):
        apply(rowmax_model(tmp_path / "m.onnx"), tmp_path / "good", backend="iree")
    mlir = (tmp_path / "good" / "model.mlir").read_text()
    assert 'loc("rowmax")' in mlir and "IREE lowering of TestRowMax at node 'rowmax'" in mlir
    op = _BrokenRowMax(rowmax_op.obj, "object")
    with registered_lowerings(op.lowerings()), pytest.raises(BackendError) as e:
        apply(rowmax_model(tmp_path / "m.onnx"), tmp_path / "out", backend="iree")
    assert "iree-compile (llvm-cpu)" in str(e.value) and 'kernels/missing.o' in str(e.value)
    assert (tmp_path / "out.failed" / "model.mlir").is_file()
    with registered_lowerings(rowmax_op.lowerings()):  # a later apply that succeeds removes the stale failure
        apply(rowmax_model(tmp_path / "m.onnx"), tmp_path / "out", backend="iree")
    assert (tmp_path / "out" / "model.vmfb").is_file() and not (tmp_path / "out.failed").exists()


def test_a_lowering_returning_something_else_is_an_error_naming_the_node(tmp_path, rowmax_op):
    class _Nothing(RowMax):
        def lower_iree(self, op, ctx):
            return None

    with registered_lowerings(_Nothing(rowmax_op.obj).lowerings()), pytest.raises(BackendError) as e:
        apply(rowmax_model(tmp_path / "m.onnx"), tmp_path / "out", backend="iree")
    assert str(e.value) == ("IREE lowering of TestRowMax at node 'rowmax' failed: TypeError: returned NoneType, "
                            "not an IreeLowering")
