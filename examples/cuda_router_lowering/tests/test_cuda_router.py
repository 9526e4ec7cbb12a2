"""The cuda_router package: found through its entry point, takes the iree:cuda slot of MoERouterTopK from rewrite's
own lowering (``replaces=True``), and an
``apply --target cuda`` with ``topk`` compiles with its PTX kernel copied into the output folder. On a machine
with a CUDA device and IREE's cuda driver, the compiled router equals rewrite's reference."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from rewrite.core.kernels import NVCC_FLAGS, PTX_HEADER, DEFAULT_CUDA_ARCH
from rewrite.pipeline import apply
from rewrite.plugins.manager import lowering_registry
from rewrite_cuda_router.lowering import KERNEL


def _router_model(path: Path, mode: str) -> Path:
    """softmax_topk: TopK(Softmax(logits), 4), renormalized; topk_softmax: Softmax(TopK(logits, 4))."""
    k = numpy_helper.from_array(np.array([4], np.int64), "k")
    if mode == "softmax_topk":
        nodes = [helper.make_node("Softmax", ["logits"], ["p"], axis=-1), helper.make_node("TopK", ["p", "k"], ["v", "ids"], axis=-1),
                 helper.make_node("ReduceSum", ["v", "one"], ["s"], keepdims=1), helper.make_node("Div", ["v", "s"], ["w"])]
        inits = [k, numpy_helper.from_array(np.array([-1], np.int64), "one")]
    else:
        nodes = [helper.make_node("TopK", ["logits", "k"], ["v", "ids"], axis=-1), helper.make_node("Softmax", ["v"], ["w"], axis=-1)]
        inits = [k]
    g = helper.make_graph(nodes, "router", [helper.make_tensor_value_info("logits", TP.FLOAT, ["T", 60])],
                          [helper.make_tensor_value_info("w", TP.FLOAT, ["T", 4]), helper.make_tensor_value_info("ids", TP.INT64, ["T", 4])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


def test_registered_through_the_entry_point():
    low = lowering_registry().get("MoERouterTopK", "iree", "cuda")
    assert low is not None and low.origin == "rewrite-cuda-router" and low.replaces


def test_shipped_ptx_is_built_from_this_source():
    digest = hashlib.sha256(KERNEL.read_bytes() + " ".join((*NVCC_FLAGS, f"-arch={DEFAULT_CUDA_ARCH}")).encode()).hexdigest()[:16]
    shipped = KERNEL.with_name(f"{KERNEL.stem}.{DEFAULT_CUDA_ARCH}.ptx")
    assert shipped.read_text().split("\n", 1)[0] == PTX_HEADER + digest


@pytest.mark.parametrize("mode", ["softmax_topk", "topk_softmax"])
def test_apply_for_cuda_compiles_with_the_kernel_in_the_folder(tmp_path, mode):
    m = apply(_router_model(tmp_path / "m.onnx", mode), tmp_path / "out", plugins="topk", backend="iree", target="cuda")
    assert m.report[0]["matches"] == 1
    (obj,) = m.kernel_objects
    assert obj.startswith("kernels/router_topk-") and (tmp_path / "out" / obj).is_file()
    mlir = (tmp_path / "out" / "model.mlir").read_text()
    assert "flow.dispatch @rewrite_cuda_router_f32::@router_topk_f32" in mlir and str(tmp_path) not in mlir
    assert (tmp_path / "out" / "model.vmfb").stat().st_size > 0


def _cuda_available() -> bool:
    try:
        import iree.runtime as rt

        return bool(rt.get_driver("cuda").query_available_devices())
    except Exception:
        return False


@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device and IREE's cuda driver")
@pytest.mark.parametrize("mode", ["softmax_topk", "topk_softmax"])
def test_on_the_gpu_it_equals_the_reference(tmp_path, mode):
    from rewrite.backends import load_runner
    from rewrite.plugins.router.op import router_topk_reference

    apply(_router_model(tmp_path / "m.onnx", mode), tmp_path / "out", plugins="topk", backend="iree", target="cuda")
    runner = load_runner(tmp_path / "out")
    for t in (1, 7, 65, 300):
        x = np.random.default_rng(t).standard_normal((t, 60)).astype(np.float32)
        got = runner.run({"logits": x})
        w, i = router_topk_reference(x, 4, 1, mode)
        np.testing.assert_array_equal(got["ids"], i)
        np.testing.assert_allclose(got["w"], w, rtol=1e-5, atol=1e-6)
