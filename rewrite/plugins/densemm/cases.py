"""Conformance cases of the ``densemm`` plugin: an LM-head-like MatMul by a large float weight (f32, f16, a
leading batch dim), a one-column gate, and weights it must leave alone (small, shared with a Gather, computed); an
RMSNorm before a router's MatMul and a gate, read by other ops too (``rms-norm-prologue``, forced on: its default
is IREE cuda only), and the gate and the router then one op (``merge-normed-products``, forced on too)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rewrite.core.cases import negative, positive
from rewrite.plugins.densemm import MIN_ELEMENTS
from rewrite.plugins.rmsnorm.cases import rms_norm_nodes

_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def head(*, dtype: int = TensorProto.FLOAT, k: int = 64, n: int = MIN_ELEMENTS // 64, rank: int = 2, tied: bool = False,
         seed: int = 0) -> onnx.ModelProto:
    """X [T, k] (rank 3: [1, T, k]) -> MatMul(X, W [k, n]) -> Y; ``tied``: W also feeds a Gather (a tied embedding)."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array((rng.standard_normal((k, n)) * 0.1).astype(_NP[dtype]), "W")
    nodes = [helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm")]
    lead = ["T"] if rank == 2 else [1, "T"]
    outs = [helper.make_tensor_value_info("Y", dtype, [*lead, n])]
    inits = [w]
    if tied:
        inits.append(numpy_helper.from_array(np.array([0, 3], np.int64), "rows"))
        nodes.append(helper.make_node("Gather", ["W", "rows"], ["E"], axis=0, name="embed"))
        outs.append(helper.make_tensor_value_info("E", dtype, [2, n]))
    g = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("X", dtype, [*lead, k])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def normed_router(*, dtype: int = TensorProto.FLOAT, k: int = 64, experts: int = 8, gate: bool = False,
                  tap: bool = False, reshape: bool = False, shape_reader: bool = False, relu: bool = True,
                  gemm: bool | str = False, view: bool = False, seed: int = 0) -> onnx.ModelProto:
    """X [1, T, k] -> transformers' RMSNorm -> N; L = MatMul(N, W [k, experts]) (a router), Z = Relu(N) (the experts'
    input: another reader; none without ``relu``), with ``gate`` G = MatMul(N, g [k, 1]) first (a one-column
    shared-expert gate, which ``dense-float-matmul`` takes from k = 1024); ``tap``: N is a graph output too (not
    fused); ``reshape``: the readers take N through a Reshape to [T, k] (an MoE block's ``view(-1, H)``) and the
    outputs are [T, ...]; ``shape_reader``: a Shape of N too (``b, s, h = x.shape`` before the view) -> graph
    output S; ``gemm`` (with ``reshape``): the products are ``Gemm(transB=1)`` by weights [N, k], as transformers'
    OnnxExporter writes torch.nn.Linear (``"transB0"``: ``Gemm`` by weights [k, N]; ``"bias"``: the router's
    ``Gemm`` adds a bias C, which no rule takes); ``view`` (with ``reshape``): the router reads a second ``Reshape`` to
    [-1, k] of the [T, k] rows (an identity view, as that exporter writes Qwen2-MoE's router input)."""
    assert reshape or not (gemm or view), "a Gemm and the second view read the [T, k] rows: reshape=True"
    rng = np.random.default_rng(seed)
    nodes, inits, n = rms_norm_nodes("X", dtype, k, rng)
    lead = [1, "T"]
    if shape_reader:
        nodes.append(helper.make_node("Shape", [n], ["S"], name="shape"))
    if reshape:
        inits.append(numpy_helper.from_array(np.array([-1, k], np.int64), "rows"))
        nodes.append(helper.make_node("Reshape", [n, "rows"], ["NR"], name="view"))
        n, lead = "NR", ["T"]
    outs = []
    def product(w: np.ndarray, name: str, out: str, a: str):
        trans = gemm and gemm != "transB0"
        inits.append(numpy_helper.from_array((w.T if trans else w).astype(_NP[dtype]), name.upper()))
        ins = [a, name.upper()]
        if gemm == "bias" and name == "router":
            inits.append(numpy_helper.from_array(np.full(w.shape[1], 0.5, _NP[dtype]), "C"))
            ins.append("C")
        nodes.append(helper.make_node("Gemm", ins, [out], transB=int(bool(trans)), name=name) if gemm else
                     helper.make_node("MatMul", ins, [out], name=name))
    if gate:
        product(rng.standard_normal((k, 1)) * 0.1, "gate", "G", n)
        outs.append(helper.make_tensor_value_info("G", dtype, [*lead, 1]))
    if view:
        nodes.append(helper.make_node("Reshape", [n, "rows"], ["NV"], name="view2"))
    product(rng.standard_normal((k, experts)) * 0.1, "router", "L", "NV" if view else n)
    outs.append(helper.make_tensor_value_info("L", dtype, [*lead, experts]))
    if relu:
        nodes.append(helper.make_node("Relu", [n], ["Z"], name="experts"))
        outs.append(helper.make_tensor_value_info("Z", dtype, [*lead, k]))
    if tap:
        outs.append(helper.make_tensor_value_info(n, dtype, [*lead, k]))
    if shape_reader:
        outs.append(helper.make_tensor_value_info("S", TensorProto.INT64, [3]))
    g = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("X", dtype, [1, "T", k])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


PROLOGUE = {"densemm": {"prologue": True}}  #: the option that runs rms-norm-prologue on any backend
MERGE = {"densemm": {"prologue": True, "merge": True}}  #: and merge-normed-products


def densemm_cases() -> list:
    return [
        positive("lm-head-f32", lambda: head(), matches=1),
        positive("lm-head-f16-batch-dim", lambda: head(dtype=TensorProto.FLOAT16, k=128, n=MIN_ELEMENTS // 128, rank=3),
                 matches=1, rtol=1e-2),
        negative("small-weight", lambda: head(n=MIN_ELEMENTS // 64 - 1)),
        positive("one-column-gate-f16", lambda: head(dtype=TensorProto.FLOAT16, k=2048, n=1, rank=3), matches=1, rtol=1e-2),
        negative("tied-embedding", lambda: head(tied=True)),
        positive("norm-prologue-router", normed_router, {"dense-float-matmul": 0, "rms-norm-prologue": 1}, options=PROLOGUE),
        positive("norm-prologue-gate-first-f16", lambda: normed_router(dtype=TensorProto.FLOAT16, k=1024, experts=60, gate=True),
                 {"dense-float-matmul": 1, "rms-norm-prologue": 1}, rtol=1e-2, options=PROLOGUE),
        positive("norm-prologue-through-reshape-f16",
                 lambda: normed_router(dtype=TensorProto.FLOAT16, k=128, gate=True, reshape=True, shape_reader=True),
                 {"dense-float-matmul": 0, "rms-norm-prologue": 1}, rtol=2e-2, options=PROLOGUE),
        positive("norm-prologue-gemm", lambda: normed_router(reshape=True, gemm=True),
                 {"dense-float-matmul": 0, "rms-norm-prologue": 1}, options=PROLOGUE),
        positive("norm-prologue-identity-view-gemm-f16",
                 lambda: normed_router(dtype=TensorProto.FLOAT16, k=128, reshape=True, gemm=True, view=True, shape_reader=True),
                 {"dense-float-matmul": 0, "rms-norm-prologue": 1}, rtol=2e-2, options=PROLOGUE),
        positive("norm-prologue-graph-output", lambda: normed_router(tap=True), {"dense-float-matmul": 0, "rms-norm-prologue": 0},
                 options=PROLOGUE),
        negative("norm-prologue-off-by-default", normed_router),
        # merge-normed-products: the gate (first, so the norm's op) takes the router as its second output
        positive("merge-gate-and-router-f16", lambda: normed_router(dtype=TensorProto.FLOAT16, k=1024, experts=60, gate=True),
                 {"dense-float-matmul": 1, "rms-norm-prologue": 1, "merge-normed-products": 1}, rtol=1e-2, options=MERGE),
        positive("merge-through-reshape-f16",
                 lambda: normed_router(dtype=TensorProto.FLOAT16, k=128, gate=True, reshape=True, shape_reader=True),
                 {"dense-float-matmul": 0, "rms-norm-prologue": 1, "merge-normed-products": 1}, rtol=2e-2, options=MERGE),
        positive("merge-no-other-reader", lambda: normed_router(gate=True, relu=False),
                 {"dense-float-matmul": 0, "rms-norm-prologue": 1, "merge-normed-products": 1}, options=MERGE),
        positive("merge-gemm-f16", lambda: normed_router(dtype=TensorProto.FLOAT16, k=128, gate=True, reshape=True, gemm=True),
                 {"dense-float-matmul": 0, "rms-norm-prologue": 1, "merge-normed-products": 1}, rtol=2e-2, options=MERGE),
        positive("merge-identity-view-gemm-f16",
                 lambda: normed_router(dtype=TensorProto.FLOAT16, k=128, gate=True, reshape=True, gemm=True, view=True),
                 {"dense-float-matmul": 0, "rms-norm-prologue": 1, "merge-normed-products": 1}, rtol=2e-2, options=MERGE),
        positive("merge-gemm-transb0", lambda: normed_router(gate=True, reshape=True, gemm="transB0"),
                 {"dense-float-matmul": 0, "rms-norm-prologue": 1, "merge-normed-products": 1}, options=MERGE),
        negative("norm-prologue-gemm-bias", lambda: normed_router(reshape=True, gemm="bias"), options=MERGE),
        positive("merge-one-product", normed_router,
                 {"dense-float-matmul": 0, "rms-norm-prologue": 1, "merge-normed-products": 0}, options=MERGE),
    ]
