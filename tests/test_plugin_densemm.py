"""The ``densemm`` plugin on a seed form whose LM head is large enough (vocabulary 4096 x hidden 256 = 2^20
elements): exactly the LM head becomes DenseMatMul, IREE llvm-cpu decodes the quantized model's greedy tokens, ONNX
Runtime gets the MatMul back, and the CUDA lowering compiles (shipped PTX, no GPU)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from rewrite.generate import Generator
from rewrite.pipeline import apply

PROMPT = [3, 141, 59, 26, 5]
FUSED = "quant4,matmul4,densemm,cast,legalize,expand,kv,topk,moe"


@pytest.fixture(scope="module")
def seed_big_vocab(tmp_path_factory):
    import seed_form

    model, _ = seed_form.build_seed_model("fp32", vocab=4096)
    return seed_form.save_seed_model(model, tmp_path_factory.mktemp("densemm") / "seed.onnx")


def _ops(folder, op_type: str) -> int:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return sum(n.op_type == op_type for n in model.graph.node)


def test_the_lm_head_alone_is_fused_and_decodes_like_the_quantized_model(seed_big_vocab, tmp_path):
    apply(seed_big_vocab, tmp_path / "ref", plugins="quant4", backend="ort", options={"ort_matmul_nbits": False})
    m = apply(seed_big_vocab, tmp_path / "iree", plugins=FUSED, backend="iree", options={"stateful": True})
    (report,) = [r for r in m.report if r["plugin"] == "densemm"]
    # the LM head; the routers ([256, 8]) are far below MIN_ELEMENTS, the shared-expert gates ([256, 1]) below MIN_GATE_K
    assert report["matches"] == 1
    assert _ops(tmp_path / "iree", "DenseMatMul") == 1
    got = Generator(tmp_path / "iree").generate(PROMPT, 8)
    ref = Generator.reference(tmp_path / "ref" / "model.onnx").generate(PROMPT, 8)
    assert got.tokens == ref.tokens
    assert max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got.logits, ref.logits)) < 1e-4


def test_ort_gets_the_matmul_back(seed_big_vocab, tmp_path):
    apply(seed_big_vocab, tmp_path / "plain", backend="ort")
    apply(seed_big_vocab, tmp_path / "d", plugins="densemm", backend="ort")
    assert _ops(tmp_path / "d", "MatMul") == _ops(tmp_path / "plain", "MatMul")
    a, b = Generator(tmp_path / "d").generate(PROMPT, 4), Generator(tmp_path / "plain").generate(PROMPT, 4)
    assert a.tokens == b.tokens
    assert max(float(np.abs(x - y).max() / np.abs(y).max()) for x, y in zip(a.logits, b.logits)) == 0.0


@pytest.mark.slow
def test_cuda_lowering_compiles(seed_big_vocab, tmp_path):
    """iree --target cuda (no GPU): the LM head's kernel, and ``rms-norm-prologue`` (on by default for IREE cuda)
    gives each post-attention norm to its router's MatMul (through the MoE block's Reshape) and the final norm to the
    LM head, and ``merge-normed-products`` (also on) makes each layer's shared-expert gate ([256, 1]: a MatMul)
    the router op's second output. Any number of tokens: each norm a dispatch of the RMSNorm kernel before the
    product's (``_o2``: both outputs); one token per call: the ``dense_matmul_norm`` kernel normalizes the row
    itself, and with matmul4's prologue (the input norms) no RMSNorm dispatch is left."""
    m = apply(seed_big_vocab, tmp_path / "cuda", plugins=FUSED, backend="iree", target="cuda", options={"stateful": True})
    (report,) = [r for r in m.report if r["plugin"] == "densemm"]
    rules = {r["rule"]: r["matches"] for r in report["rules"]}
    layers = _ops(tmp_path / "cuda", "FusedMoE")
    assert rules == {"dense-float-matmul": 1, "rms-norm-prologue": layers + 1, "merge-normed-products": layers}
    model = onnx.load(str(tmp_path / "cuda" / "model.onnx"), load_external_data=False)
    assert [len(n.output) for n in model.graph.node if n.op_type == "DenseMatMul"].count(3) == layers  # Y, G, A_normed
    mlir = (tmp_path / "cuda" / "model.mlir").read_text()
    assert mlir.count("flow.dispatch @densemm_exec_f32::@dense_matmul_f32[") == 1
    assert mlir.count("flow.dispatch @densemm_o2_exec_f32::@dense_matmul_o2_f32[") == layers
    assert mlir.count("flow.dispatch @rmsnorm_exec::@rms_norm_f32[") == 2 * layers + 1  # matmul4's input norms too
    assert any(k.startswith("kernels/densemm_cuda-") for k in m.kernel_objects)
    assert (tmp_path / "cuda" / "model.vmfb").stat().st_size > 0
    apply(seed_big_vocab, tmp_path / "t1", plugins=FUSED, backend="iree", target="cuda", options={"stateful": True},
          dims={"seq_len": 1})
    mlir = (tmp_path / "t1" / "model.mlir").read_text()
    assert mlir.count("flow.dispatch @densemm_norm_exec_f32::@dense_matmul_norm_f32[") == 1
    assert mlir.count("flow.dispatch @densemm_norm_o2_exec_f32::@dense_matmul_norm_o2_f32[") == layers
    assert "@rms_norm_f32[" not in mlir
    assert (tmp_path / "t1" / "model.vmfb").stat().st_size > 0
