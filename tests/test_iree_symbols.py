"""Kernels of one op type at several shapes in one IREE module: every executable and export keeps a name of its
own when iree-compile links the llvm-cpu executables into one (two FusedMoE of different H, I, E; two grouped
routers of different E, whose bias binding is [E])."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from rewrite.backends import load_runner
from rewrite.pipeline import apply
from rewrite.plugins.moe.cases import hf_block
from rewrite.plugins.router.grouped import grouped_router_model
from rewrite.testing.conformance import side_by_side


def test_two_moe_layers_and_two_grouped_routers_of_different_shapes_share_a_module(tmp_path):
    # one token dim T for all; opset 21 (the grouped router's own is 18)
    model = side_by_side({"a": hf_block(h=32, i=16, e=8), "b": hf_block(h=40, i=24, e=6, seed=1),
                          "c": grouped_router_model(), "d": grouped_router_model(e=12, n_group=6, topk_group=3, k=3)},
                         dim_param=lambda key, sym: "T", opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(model, tmp_path / "m.onnx")
    out = tmp_path / "iree"
    apply(tmp_path / "m.onnx", out, plugins=["topk", "moe"], backend="iree")
    ops = [n.op_type for n in onnx.load(out / "model.onnx").graph.node]
    assert ops.count("FusedMoE") == 2 and ops.count("MoERouterTopK") == 2
    mlir = (out / "model.mlir").read_text()
    assert mlir.count("stream.executable private @moe_exec") == 2
    assert mlir.count("stream.executable private @router_grouped_f32_f32_e") == 2

    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([3 if isinstance(d, str) else d for d in i.shape]).astype(np.float32)
             for i in sess.get_inputs()}
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    got = load_runner(out).run(feeds)
    for name, w in want.items():
        if w.dtype == np.int64:  # the chosen experts
            np.testing.assert_array_equal(got[name], w, err_msg=name)
        else:  # fp32: the MoE sums in another order than ONNX Runtime
            np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-5 * np.abs(w).max(), err_msg=name)
