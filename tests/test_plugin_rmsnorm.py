"""The ``norm`` plugin on real graphs: every RMSNorm of transformers' tiny Qwen3-MoE export and of the seed form
becomes one RMSNorm op (Qwen3's per-head q/k norms go to ``rope`` first, which runs before), greedy tokens equal to
ONNX Runtime on the original on both backends, and on IREE cuda one dispatch per norm (shipped PTX, no GPU)."""

from __future__ import annotations

import re

import pytest

from rewrite.backends.iree_census import census
from rewrite.generate import Generator
from rewrite.pipeline import apply

PROMPT = [11, 22, 33, 44, 55]


def _matches(m, plugin: str) -> int:
    (report,) = [r for r in m.report if r["plugin"] == plugin]
    return report["matches"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_transformers_export_decodes_like_the_original(qwen3_moe_tiny, tmp_path, backend):
    """transformers' Qwen3-MoE export (2 layers): the input and post-attention norms of each layer and the final
    norm (5); the q/k norms are rope's. 16 greedy tokens equal to ONNX Runtime on the original, logits within
    float32 tolerance."""
    plugins = "cast,rope,norm,kv,topk,moe" if backend == "ort" else "cast,rope,norm,legalize,expand,kv,topk,moe"
    m = apply(qwen3_moe_tiny, tmp_path / backend, plugins=plugins, backend=backend, options={"kv": {"max_seq": 32}})
    assert _matches(m, "norm") == 5 and _matches(m, "rope") == 4
    got = Generator(tmp_path / backend).generate(PROMPT, 16)
    ref = Generator.reference(qwen3_moe_tiny).generate(PROMPT, 16)
    assert got.tokens == ref.tokens
    assert max(float(abs(a - b).max() / abs(b).max()) for a, b in zip(got.logits, ref.logits)) < 1e-4


@pytest.mark.slow
def test_seed_form_fp16_cuda_step(tmp_path):
    """The fp16 Qwen1.5 seed form: 5 norms, the original's greedy tokens on IREE llvm-cpu; on IREE cuda (the
    stateful one-token step) one dispatch of the shipped kernel per norm, where iree-compile 3.13 runs each of these
    norms as two (a cast to float32, then the reduction with the scaling)."""
    import seed_form

    model, _ = seed_form.build_seed_model("fp16", arch="qwen2_moe")
    path = seed_form.save_seed_model(model, tmp_path / "seed.onnx")
    m = apply(path, tmp_path / "cpu", plugins="cast,norm,legalize,expand,kv,topk,moe", backend="iree")
    assert _matches(m, "norm") == 5
    assert Generator(tmp_path / "cpu").generate(PROMPT, 8).tokens == Generator.reference(path).generate(PROMPT, 8).tokens
    counts = {}
    for name, plugins in (("own", "cast,rope,legalize,expand,kv,attention,topk,moe"),
                          ("rms", "cast,rope,norm,legalize,expand,kv,attention,topk,moe")):
        apply(path, tmp_path / name, plugins=plugins, backend="iree", target="cuda", options={"stateful": True},
              dims={"seq_len": 1})
        counts[name] = census(tmp_path / name)
    mlir = (tmp_path / "rms" / "model.mlir").read_text()
    assert len(re.findall(r"flow\.dispatch @rmsnorm_exec::@rms_norm_f16\[", mlir)) == 5
    assert counts["own"]["dispatches"] - counts["rms"]["dispatches"] == 5


def test_find_rms_norm_tries_each_way_the_norm_matches():
    """An f16 X cast to float32 before a norm computed in float32 with a float32 weight: the match that takes the
    Cast into the norm is refused (no Cast back to f16), the one whose input is the Cast's output is the norm;
    ``find_rms_norm`` (the prologue rules' finder) returns that one, not the first refusal."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from rewrite.core import onnx_io
    from rewrite.core.shapes import infer_shapes
    from rewrite.plugins.rmsnorm.pattern import find_rms_norm

    f32 = TensorProto.FLOAT
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"), numpy_helper.from_array(np.array([-1], np.int64), "axes"),
             numpy_helper.from_array(np.array(1e-6, np.float32), "eps"), numpy_helper.from_array(np.ones(16, np.float32), "w")]
    nodes = [helper.make_node("Cast", ["X"], ["X32"], to=f32), helper.make_node("Pow", ["X32", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1), helper.make_node("Add", ["mean", "eps"], ["var"]),
             helper.make_node("Sqrt", ["var"], ["root"]), helper.make_node("Div", ["X32", "root"], ["normed"]),
             helper.make_node("Mul", ["normed", "w"], ["Y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT16, [2, 16])],
                          [helper.make_tensor_value_info("Y", f32, [2, 16])], inits)
    graph = onnx_io.load(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
    infer_shapes(graph)
    found = find_rms_norm(graph, "Y")
    assert not isinstance(found, str) and found[:3] == ("X32", "w", pytest.approx(1e-6))
    assert sorted(n.op_type for n in found[3]) == ["Add", "Div", "Mul", "Pow", "ReduceMean", "Sqrt"]
