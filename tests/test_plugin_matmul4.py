"""The ``matmul4`` plugin on the seed form after ``quant4``: every dense INT4 MatMul becomes MatMulInt4 and those
reading one activation are merged (exact counts), IREE llvm-cpu decodes the quantized model's greedy tokens, ONNX
Runtime gets the same MatMulNBits as without the plugin (merged ones: one per merged node, the same logits), and
the CUDA lowering compiles (shipped PTX, no GPU)."""

from __future__ import annotations

import re
import subprocess

import numpy as np
import onnx
import pytest

from iree.compiler.tools.binaries import find_tool

from rewrite.generate import Generator
from rewrite.pipeline import apply

PROMPT = [3, 141, 59, 26, 5]
#: per layer of the seed form: q, k, v, o and the shared expert's gate, up and down projections
DENSE_PER_LAYER = 7
#: after the shared-input merge: q/k/v as one, o, the shared expert's gate/up as one, down
MERGED_PER_LAYER = 4
#: per layer: the q, k and v biases and the residual after o (output-add), the shared expert's SwiGLU (swiglu)
ADDS_PER_LAYER, SWIGLU_PER_LAYER = 4, 1
FUSED = "quant4,matmul4,cast,legalize,expand,kv,topk,moe"


def _ops(folder, op_type: str) -> int:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return sum(n.op_type == op_type for n in model.graph.node)


@pytest.fixture(scope="module")
def quant4_ref(seed_fp32, tmp_path_factory):
    """The seed form after quant4 on ONNX Runtime (the reference): its 8 greedy tokens after PROMPT, with logits."""
    ref = tmp_path_factory.mktemp("matmul4_ref") / "ref"
    apply(seed_fp32[0], ref, plugins="quant4", backend="ort", options={"ort_matmul_nbits": False})
    return Generator.reference(ref / "model.onnx").generate(PROMPT, 8)


@pytest.fixture(scope="module")
def quantized(seed_fp32, tmp_path_factory):
    """The seed form's IREE llvm-cpu folder with matmul4 (``base / "iree"``) and its manifest."""
    base = tmp_path_factory.mktemp("matmul4")
    m = apply(seed_fp32[0], base / "iree", plugins=FUSED, backend="iree", options={"stateful": True})
    return base, m


def test_every_dense_int4_matmul_is_fused(quantized):
    base, m = quantized
    (report,) = [r for r in m.report if r["plugin"] == "matmul4"]
    rules = {r["rule"]: r for r in report["rules"]}
    assert rules["dense-int4-matmul"]["matches"] == DENSE_PER_LAYER * 2 and rules["dense-int4-matmul"]["refusals"] == []
    assert rules["shared-input"]["matches"] == 2 * 2
    assert rules["swiglu"]["matches"] == SWIGLU_PER_LAYER * 2 and rules["output-add"]["matches"] == ADDS_PER_LAYER * 2
    assert _ops(base / "iree", "MatMulInt4") == MERGED_PER_LAYER * 2
    model = onnx.load(str(base / "iree" / "model.onnx"), load_external_data=False)
    acts = [a.s for n in model.graph.node if n.op_type == "MatMulInt4" for a in n.attribute if a.name == "activation"]
    assert acts == [b"swiglu"] * 2
    assert sum(len([i for i in n.input[4:] if i]) for n in model.graph.node if n.op_type == "MatMulInt4") == ADDS_PER_LAYER * 2
    assert _ops(base / "iree", "DequantizeLinear") == 0  # the experts' go into FusedMoE, the dense ones here


def test_iree_decodes_the_quantized_models_tokens(quantized, quant4_ref):
    base, _ = quantized
    got = Generator(base / "iree").generate(PROMPT, 8)
    ref = quant4_ref
    assert got.tokens == ref.tokens
    rel = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got.logits, ref.logits))
    assert rel < 1e-4


def test_ort_runs_the_same_matmulnbits(seed_fp32, tmp_path):
    """The ORT lowering gives back quant4's DequantizeLinear -> MatMul pairs, which the ort backend fuses into
    MatMulNBits as it does without the plugin: the same op counts without the merge, one per merged node with it,
    and the same logits either way."""
    apply(seed_fp32[0], tmp_path / "plain", plugins="quant4", backend="ort")
    apply(seed_fp32[0], tmp_path / "m4", plugins="quant4,matmul4", backend="ort", options={"matmul4": {"merge": False}})
    apply(seed_fp32[0], tmp_path / "merged", plugins="quant4,matmul4", backend="ort")
    assert _ops(tmp_path / "m4", "MatMulNBits") == _ops(tmp_path / "plain", "MatMulNBits") == DENSE_PER_LAYER * 2
    assert _ops(tmp_path / "merged", "MatMulNBits") == MERGED_PER_LAYER * 2
    assert _ops(tmp_path / "merged", "Split") - _ops(tmp_path / "plain", "Split") == 2 * 2
    b = Generator(tmp_path / "plain").generate(PROMPT, 4)
    for folder in ("m4", "merged"):
        assert _ops(tmp_path / folder, "MatMulInt4") == 0
        a = Generator(tmp_path / folder).generate(PROMPT, 4)
        assert a.tokens == b.tokens
        assert max(float(np.abs(x - y).max() / np.abs(y).max()) for x, y in zip(a.logits, b.logits)) < 1e-5


def test_plugin_order_is_declared(seed_fp32, tmp_path):
    """matmul4 runs after quant4 and before legalize whatever the order given: the same matches."""
    m = apply(seed_fp32[0], tmp_path / "o", plugins="legalize,matmul4,quant4", backend="ort")
    assert m.plugins == ["quant4", "matmul4", "legalize"]
    assert [r["matches"] for r in m.report if r["plugin"] == "matmul4"] == [(DENSE_PER_LAYER + 2 + ADDS_PER_LAYER + SWIGLU_PER_LAYER) * 2]


@pytest.mark.slow
def test_cuda_lowering_compiles(tmp_path):
    """iree --target cuda on a 6-layer f16 seed form: one dispatch of the shipped PTX kernel per MatMulInt4 (the
    merged q/k/v and their biases through the three-output kernel, gate/up and their SwiGLU through the swiglu one,
    o and its residual add), and the module compiles (no GPU). Reshapes around these dispatches made iree-compile 3.13 fail from 6 layers up
    ("failed to sink reshape ops"); the dispatch takes A and returns Y in their own shapes."""
    import seed_form

    model, _ = seed_form.build_seed_model("fp16", layers=6, hidden=256, heads=2, kv_heads=2, head_dim=128, experts=4,
                                          top_k=2, moe_intermediate=128, shared_intermediate=512, vocab=512, max_seq=16)
    path = seed_form.save_seed_model(model, tmp_path / "seed6.onnx")
    m = apply(path, tmp_path / "cuda", plugins=FUSED, backend="iree", target="cuda", options={"stateful": True})
    mlir = (tmp_path / "cuda" / "model.mlir").read_text()
    assert mlir.count("flow.dispatch @matmul4_exec::@matmul_int4_f16_v32[") == 2 * 6
    assert mlir.count("flow.dispatch @matmul4_exec::@matmul_int4_f16_v32_o3[") == 6
    assert mlir.count("flow.dispatch @matmul4_exec::@matmul_int4_f16_v32_swiglu[") == 6
    assert "::@matmul_int4_f16_v32_o2[" not in mlir
    wrapper = mlir.split("func.func private @rewrite_MatMulInt4_0", 1)[1].split("\n  }", 1)[0]
    assert "flow.dispatch" in wrapper and "collapse_shape" not in wrapper and "expand_shape" not in wrapper
    assert any(k.startswith("kernels/matmul4_cuda-") for k in m.kernel_objects)
    assert (tmp_path / "cuda" / "model.vmfb").stat().st_size > 0
    # the kernels survive iree-compile's executable deduplication (exports of one executable source)
    flags = (tmp_path / "cuda" / "compile.log").read_text().split("\n", 1)[0].split()[4:]
    flow = tmp_path / "flow.mlir"
    subprocess.run([find_tool("iree-compile"), "model.mlir", *flags, "--compile-to=flow", "-o", str(flow)],
                   check=True, cwd=tmp_path / "cuda", capture_output=True)
    calls = re.findall(r"flow\.dispatch @matmul4_exec::@(matmul_int4_\w+)\[", flow.read_text())
    assert sorted(set(calls)) == ["matmul_int4_f16_v32", "matmul_int4_f16_v32_o3", "matmul_int4_f16_v32_swiglu"]
    assert calls.count("matmul_int4_f16_v32_swiglu") == 6


def test_transformers_export_at_opset_20(qwen2_moe_tiny, tmp_path):
    """transformers' exporter writes opset 20 and the shared expert's Linear layers as Gemm(transB=1); quant4 moves
    the model to 21 before matmul4 runs, so the two run together on it: every dense product fused (q/k/v merged
    with their biases, the shared expert's gate/up with their SwiGLU, o with the residual add), and IREE llvm-cpu
    decodes the quantized model's tokens."""
    import onnx as onnx_

    assert onnx_.load(str(qwen2_moe_tiny), load_external_data=False).opset_import[0].version == 20
    small = {"block_size": 32, "min_elements": 256}  # the tiny model's shared expert too
    apply(qwen2_moe_tiny, tmp_path / "ref", plugins="quant4", backend="ort", options={"ort_matmul_nbits": False, "quant4": small})
    m = apply(qwen2_moe_tiny, tmp_path / "iree", plugins="quant4,matmul4,cast,legalize,expand,kv,topk,moe", backend="iree",
              options={"kv": {"max_seq": 32}, "quant4": small})
    (report,) = [r for r in m.report if r["plugin"] == "matmul4"]
    rules = {r["rule"]: r["matches"] for r in report["rules"]}
    layers = _ops(tmp_path / "ref", "Softmax") // 2  # one in attention, one in the router per layer
    # per layer: q, k, v, o (MatMul), the shared expert's gate, up, down (Gemm, transB=1)
    assert rules["dense-int4-matmul"] == 4 * layers and rules["dense-int4-gemm"] == 3 * layers
    assert rules["shared-input"] == 2 * layers and rules["swiglu"] == layers and rules["output-add"] == 4 * layers
    got = Generator(tmp_path / "iree").generate(PROMPT, 8)
    ref = Generator.reference(tmp_path / "ref" / "model.onnx").generate(PROMPT, 8)
    assert got.tokens == ref.tokens


@pytest.mark.slow
def test_cuda_norm_prologue(tmp_path):
    """iree --target cuda (no GPU): ``rms-norm-prologue`` takes each layer's input norm into the merged q/k/v
    MatMulInt4 (its other reader, the attention's Shape, reads the norm's input instead). With one token per call
    the ``_t1_o3_norm`` kernel normalizes the row itself: no RMSNorm dispatch is left for those norms; with any
    number of tokens the norm is a dispatch of the RMSNorm kernel before the plain three-output kernel."""
    import seed_form

    layers = 2
    model, _ = seed_form.build_seed_model("fp16", layers=layers, hidden=256, heads=2, kv_heads=2, head_dim=128, experts=4,
                                          top_k=2, moe_intermediate=128, shared_intermediate=512, vocab=512, max_seq=16)
    path = seed_form.save_seed_model(model, tmp_path / "seed.onnx")
    one = apply(path, tmp_path / "t1", plugins=FUSED, backend="iree", target="cuda", options={"stateful": True},
                dims={"seq_len": 1})
    (report,) = [r for r in one.report if r["plugin"] == "matmul4"]
    assert {r["rule"]: r["matches"] for r in report["rules"]}["rms-norm-prologue"] == layers
    mlir = (tmp_path / "t1" / "model.mlir").read_text()
    assert mlir.count("flow.dispatch @matmul4_exec::@matmul_int4_f16_v32_t1_o3_norm[") == layers
    assert "@rmsnorm_exec::@rms_norm_f16[" not in mlir  # the other norms are the decomposition: norm is not in FUSED
    assert (tmp_path / "t1" / "model.vmfb").stat().st_size > 0
    many = apply(path, tmp_path / "any", plugins=FUSED, backend="iree", target="cuda", options={"stateful": True})
    mlir = (tmp_path / "any" / "model.mlir").read_text()
    assert mlir.count("flow.dispatch @rmsnorm_exec::@rms_norm_f16[") == layers
    assert mlir.count("flow.dispatch @matmul4_exec::@matmul_int4_f16_v32_o3[") == layers
    assert (tmp_path / "any" / "model.vmfb").stat().st_size > 0


@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_norm_epsilon_without_its_weight_is_a_clear_error(backend, tmp_path):
    """A MatMulInt4 whose ``norm_epsilon`` has no norm weight after its addend slots is refused by the lowering
    with one line naming the node and the layout expected, not lowered as a product without the norm."""
    from rewrite.core import onnx_io
    from rewrite.errors import BackendError
    from rewrite.plugins.matmul4.op import MatMulInt4
    from rewrite.testing.conformance import lower_graph, single_op_model

    op = MatMulInt4()
    attrs, inputs = op.sample_inputs(np.random.default_rng(0))[0]
    attrs = dict(attrs, norm_epsilon=1e-6)  # and no norm weight
    out = np.zeros((inputs[0].shape[0], attrs["N"]), np.float32)
    model = single_op_model(op, attrs, inputs, [out])
    with pytest.raises(BackendError, match=r"MatMulInt4 .*with norm_epsilon, inputs 4 \.\. 4 are the addends .* input 5 the norm weight"):
        lower_graph(onnx_io.load(model), backend, tmp_path / backend, [op])


@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_norm_prologues_after_the_norm_plugin(seed_fp32, quant4_ref, tmp_path, backend):
    """With the ``norm`` plugin first (its RMSNorm ops, the order the full-size decode runs in) and the prologues
    forced on (their default is IREE cuda only): every input norm goes into its layer's q/k/v MatMulInt4, every
    post-attention norm into its router's product through the MoE block's Reshape and the final norm into the LM
    head, no RMSNorm is left, and the model decodes the quantized model's greedy tokens with its logits (ONNX
    Runtime and IREE llvm-cpu lower the norms back)."""
    plugins = "cast,norm,quant4,matmul4,densemm,kv,topk,moe" + (",legalize,expand" if backend == "iree" else "")
    opts = {"matmul4": {"prologue": True}, "densemm": {"prologue": True}}
    m = apply(seed_fp32[0], tmp_path / "p", plugins=plugins, backend=backend, options={**opts, "stateful": backend == "iree"})
    rules = {(r["plugin"], x["rule"]): x["matches"] for r in m.report for x in r["rules"]}
    layers = 2
    assert rules[("norm", "rms-norm")] == 2 * layers + 1
    assert rules[("matmul4", "rms-norm-prologue")] == layers
    assert rules[("densemm", "rms-norm-prologue")] == layers + 1
    if backend == "iree":
        assert _ops(tmp_path / "p", "RMSNorm") == 0
    got = Generator(tmp_path / "p").generate(PROMPT, 8)
    ref = quant4_ref
    assert got.tokens == ref.tokens
    assert max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got.logits, ref.logits)) < 1e-4
