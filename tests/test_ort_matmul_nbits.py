"""ORT lowering of quant4's dense 4-bit weights to com.microsoft::MatMulNBits (rewrite/backends/ort_matmul_nbits.py).

Tolerances: MatMulNBits with accuracy_level 0 multiplies the float activations by the dequantized weight,
so it equals DequantizeLinear -> MatMul up to summation order: 1e-5 relative (to max|y|) in float32, 1e-2 in
float16 (whose rounding of partial sums differs between the two kernels). Both are run on ONNX Runtime at
level "basic", which keeps the DequantizeLinear -> MatMul pair unfused.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import qwen_moe
from rewrite.backends.ort import OrtRunner
from rewrite.backends.ort_matmul_nbits import lower_matmul_nbits
from rewrite.core import onnx_io
from rewrite.core.driver import run_plugin
from rewrite.core.shapes import infer_shapes
from rewrite.pipeline import RewriteContext, apply
from rewrite.plugins.moe.lowering import ORT_MAX_BLOCK
from rewrite.plugins.quant4 import Quant4

_NP = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16}


def _model(form: str, k: int, n: int, dtype: int, rank: int) -> onnx.ModelProto:
    """y = (x @ W + 1) with W [K, N] random, read as ``form``: "matmul" (MatMul(x, W)), "gemm-t" (Gemm(x, W^T,
    transB=1) with a bias [N]) or "transpose" (MatMul(x, Transpose(W^T))); x is [3, K] or [2, 3, K] (Gemm: always
    rank 2, as ONNX Gemm requires)."""
    rank = 2 if form == "gemm-t" else rank
    rng = np.random.default_rng(k * n + rank)
    w = rng.standard_normal((k, n)).astype(_NP[dtype])
    x_shape = [3, k] if rank == 2 else [2, 3, k]
    inits = [numpy_helper.from_array(np.ones(n, _NP[dtype]), "one")]
    if form == "matmul":
        nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"], name="mm")]
        inits.append(numpy_helper.from_array(w, "W"))
    elif form == "gemm-t":
        nodes = [helper.make_node("Gemm", ["x", "Wt", "bias"], ["xw"], transB=1, name="gemm")]
        inits += [numpy_helper.from_array(np.ascontiguousarray(w.T), "Wt"), numpy_helper.from_array(np.linspace(-1, 1, n).astype(_NP[dtype]), "bias")]
    else:
        nodes = [helper.make_node("Transpose", ["Wt"], ["W"], perm=[1, 0], name="t"), helper.make_node("MatMul", ["x", "W"], ["xw"], name="mm")]
        inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T), "Wt"))
    nodes.append(helper.make_node("Add", ["xw", "one"], ["y"], name="add"))  # not an LM head: quant4 takes it
    g = helper.make_graph(nodes, "nbits", [helper.make_tensor_value_info("x", dtype, x_shape)],
                          [helper.make_tensor_value_info("y", dtype, x_shape[:-1] + [n])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def _quantized_and_lowered(model: onnx.ModelProto, tmp_path, options: dict):
    """(quant4's DequantizeLinear form, the same lowered to MatMulNBits, how many were lowered) as files."""
    src = tmp_path / "src.onnx"
    onnx.save(model, src)
    graph = onnx_io.load(src)
    report = run_plugin(graph, Quant4(), RewriteContext(options={"quant4": options}))
    infer_shapes(graph)
    dq_path, nbits_path = tmp_path / "dq.onnx", tmp_path / "nbits.onnx"
    onnx_io.save(graph, dq_path)
    count = lower_matmul_nbits(graph)
    onnx_io.save(graph, nbits_path)
    return dq_path, nbits_path, count, report


@pytest.mark.parametrize("form", ["matmul", "gemm-t", "transpose"])
@pytest.mark.parametrize("dtype", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("k,n,bs,symmetric,rank", [
    (256, 48, 128, False, 2),  # K a multiple of the block
    (200, 40, 64, False, 3),  # partial last block, odd number of blocks (packed zero points padded)
    (96, 33, 32, True, 3),  # symmetric (INT4, no zero points), odd N
    (150, 24, 128, True, 2),  # symmetric with a partial block
])
def test_lowered_equals_dequantize_matmul(tmp_path, form, dtype, k, n, bs, symmetric, rank):
    rank = 2 if form == "gemm-t" else rank
    model = _model(form, k, n, dtype, rank)
    dq_path, nbits_path, count, report = _quantized_and_lowered(model, tmp_path, {"block_size": bs, "symmetric": symmetric, "min_elements": 0})
    assert report.rule("dense-weight").matches == 1 and count == 1
    lowered = onnx.load(nbits_path)
    onnx.checker.check_model(lowered)
    ops = [(nd.domain, nd.op_type) for nd in lowered.graph.node]
    assert ops.count(("com.microsoft", "MatMulNBits")) == 1 and ("", "DequantizeLinear") not in ops and ("", "Transpose") not in ops
    (mnb,) = [nd for nd in lowered.graph.node if nd.op_type == "MatMulNBits"]
    attrs = {a.name: helper.get_attribute_value(a) for a in mnb.attribute}
    ort_bs = min(bs, ORT_MAX_BLOCK)  # larger blocks are split (same scale and zero point): exact, faster on ORT
    assert attrs == {"K": k, "N": n, "bits": 4, "block_size": ort_bs, "accuracy_level": 0}
    inits = {t.name: t for t in lowered.graph.initializer}
    nb = -(-k // ort_bs)
    assert list(inits[mnb.input[1]].dims) == [n, nb, ort_bs // 2] and inits[mnb.input[1]].data_type == TP.UINT8
    assert list(inits[mnb.input[2]].dims) == [n, nb] and inits[mnb.input[2]].data_type == dtype
    has_zp = len(mnb.input) > 3 and mnb.input[3] != ""
    assert has_zp == (not symmetric)
    if has_zp:
        assert list(inits[mnb.input[3]].dims) == [n, -(-nb // 2)]
    assert not any(t.data_type in (TP.UINT4, TP.INT4) for t in inits.values())  # codes not shipped twice

    x = np.random.default_rng(1).standard_normal([3, k] if rank == 2 else [2, 3, k]).astype(_NP[dtype])
    want = OrtRunner(dq_path, optimize="basic").run({"x": x})["y"].astype(np.float32)
    got = OrtRunner(nbits_path, optimize="basic").run({"x": x})["y"].astype(np.float32)
    tol = 1e-5 if dtype == TP.FLOAT else 1e-2
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= tol * np.abs(want).max(), np.abs(got - want).max() / np.abs(want).max()


@pytest.mark.parametrize("codes_type", [TP.UINT4, TP.INT4])
def test_absent_zero_point_keeps_dequantize_linear_semantics(tmp_path, codes_type):
    """DequantizeLinear without a zero point means zero point 0 for UINT4 and INT4 codes (ONNX spec); an absent
    MatMulNBits zero point means 8. UINT4 codes therefore get explicit zero points of 0; INT4 codes are offset
    by 8 and keep the default. A partial last block checks the padding too."""
    k, n, bs = 80, 12, 32
    rng = np.random.default_rng(3)
    lo, hi = (0, 16) if codes_type == TP.UINT4 else (-8, 8)
    codes = rng.integers(lo, hi, (k, n))
    scales = (rng.uniform(0.5, 1.5, (-(-k // bs), n)) * 0.1).astype(np.float32)
    inits = [helper.make_tensor("W_q", codes_type, [k, n], codes.reshape(-1).tolist()), numpy_helper.from_array(scales, "W_s")]
    nodes = [helper.make_node("DequantizeLinear", ["W_q", "W_s"], ["W"], axis=0, block_size=bs, name="dq"),
             helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    g = helper.make_graph(nodes, "nbits", [helper.make_tensor_value_info("x", TP.FLOAT, [3, k])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [3, n])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    src, lowered = tmp_path / "src.onnx", tmp_path / "nbits.onnx"
    onnx.save(m, src)
    graph = onnx_io.load(src)
    infer_shapes(graph)
    assert lower_matmul_nbits(graph) == 1
    onnx_io.save(graph, lowered)
    (mnb,) = [nd for nd in onnx.load(lowered).graph.node if nd.op_type == "MatMulNBits"]
    assert (len(mnb.input) > 3 and mnb.input[3] != "") == (codes_type == TP.UINT4)
    x = rng.standard_normal((3, k)).astype(np.float32)
    want = x @ ((codes.astype(np.float32)) * np.repeat(scales, bs, axis=0)[:k])
    got = OrtRunner(lowered, optimize="basic").run({"x": x})["y"]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    ref = OrtRunner(src, optimize="basic").run({"x": x})["y"]
    assert np.abs(ref - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("codes_type, attrs", [(TP.INT4, dict(axis=1)), (TP.UINT8, dict(axis=1)), (TP.INT4, {})])
def test_ort_folder_runs_qdq_matmuls_as_verified(tmp_path, codes_type, attrs):
    """An untouched weight-only QDQ MatMul (per-channel or per-tensor: not ours to lower) is fused by ONNX
    Runtime's own "all" level into MatMulNBits, by default with int8 activations (0.4-0.7 % off). The folder
    records the session it runs with, and that session keeps float activations: verify passes."""
    from rewrite.backends.base import Manifest
    from rewrite.backends.ort import folder_session
    from rewrite.verify import verify

    k, n = 256, 64
    rng = np.random.default_rng(5)
    lo, hi = (-8, 8) if codes_type == TP.INT4 else (0, 256)
    codes = rng.integers(lo, hi, (k, n))
    scale = (rng.uniform(0.5, 1.5, (n,) if attrs else ()) * 0.05).astype(np.float32)
    inits = [helper.make_tensor("W_q", codes_type, [k, n], codes.reshape(-1).tolist()), numpy_helper.from_array(scale, "W_s")]
    nodes = [helper.make_node("DequantizeLinear", ["W_q", "W_s"], ["W"], name="dq", **attrs),
             helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    g = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TP.FLOAT, [8, k])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [8, n])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    src = tmp_path / "qdq.onnx"
    onnx.save(m, src)
    out = tmp_path / "ort"
    apply(src, out, plugins="cast", backend="ort")
    assert Manifest.read(out).session == folder_session("cpu")
    res = verify(src, out)
    assert all(c.ok for c in res), [c.line() for c in res]


def test_dequantized_weight_read_twice_is_left_alone(tmp_path):
    """A DequantizeLinear whose output is also a graph output (or read by another node) stays as it is."""
    model = _model("matmul", 128, 32, TP.FLOAT, 2)
    dq_path, _, _, _ = _quantized_and_lowered(model, tmp_path, {"block_size": 32, "min_elements": 0})
    graph = onnx_io.load(dq_path)
    (dq,) = graph.nodes_by_op("DequantizeLinear")
    graph.add_node("Relu", [dq.outputs[0]], ["w_relu"], name="other_reader")
    graph.outputs.append("w_relu")
    before = sorted(n.op_type for n in graph.nodes.values())
    assert lower_matmul_nbits(graph) == 0
    assert sorted(n.op_type for n in graph.nodes.values()) == before and graph.opset("com.microsoft") is None


def test_qwen2_moe_tiny_quant4_on_ort_uses_matmul_nbits(qwen2_moe_tiny, tmp_path):
    """``--plugins quant4 --backend ort``: every dense quantized weight becomes one MatMulNBits, the expert
    stacks keep their Gather -> DequantizeLinear form, and the logits equal those of the quant4-only graph
    (before this lowering) on ORT "basic" within 1e-4 of max|logits|."""
    manifest = apply(qwen2_moe_tiny, tmp_path / "ort", plugins="quant4", backend="ort")
    dense = {r["rule"]: r for r in manifest.report[0]["rules"]}["dense-weight"]["matches"]
    lowered = onnx.load(tmp_path / "ort" / "model.onnx")
    ops = [(nd.domain, nd.op_type) for nd in lowered.graph.node]
    assert dense == 14 and ops.count(("com.microsoft", "MatMulNBits")) == dense
    assert ops.count(("", "DequantizeLinear")) == 4  # the expert stacks

    graph = onnx_io.load(qwen2_moe_tiny)
    run_plugin(graph, Quant4(), RewriteContext(backend="ort"))
    infer_shapes(graph)
    onnx_io.save(graph, tmp_path / "dq.onnx")

    sig = qwen_moe.decode_signature(qwen2_moe_tiny)
    past = {nm: np.zeros((1, sig.kv_shape_per_layer[0], 0, sig.kv_shape_per_layer[1]), sig.dtype) for nm in sig.input_names if ".layers." in nm}
    feeds = qwen_moe.make_feeds(sig.input_names, np.array([[3, 141, 59, 26, 5, 77, 300]]), past, 0)
    want = OrtRunner(tmp_path / "dq.onnx", optimize="basic").run(feeds)["logits"]
    got = OrtRunner(tmp_path / "ort" / "model.onnx", optimize="basic").run(feeds)["logits"]
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), np.abs(got - want).max() / np.abs(want).max()
