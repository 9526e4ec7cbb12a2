"""Conformance cases of the ``densemm`` plugin: an LM-head-like MatMul by a large float weight (f32, f16, a
leading batch dim), a one-column gate, and weights it must leave alone (small, shared with a Gather, computed); an
RMSNorm before a router's MatMul and a gate, read by other ops too (``rms-norm-prologue``, forced on: its default
is IREE cuda only)."""

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
                  tap: bool = False, reshape: bool = False, shape_reader: bool = False, seed: int = 0) -> onnx.ModelProto:
    """X [1, T, k] -> transformers' RMSNorm -> N; L = MatMul(N, W [k, experts]) (a router), Z = Relu(N) (the experts'
    input: another reader), with ``gate`` G = MatMul(N, g [k, 1]) first (a one-column shared-expert gate, which
    ``dense-float-matmul`` takes); ``tap``: N is a graph output too (not fused); ``reshape``: the readers take N
    through a Reshape to [T, k] (an MoE block's ``view(-1, H)``) and the outputs are [T, ...]; ``shape_reader``: a
    Shape of N too (``b, s, h = x.shape`` before the view) -> graph output S."""
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
    if gate:
        inits.append(numpy_helper.from_array((rng.standard_normal((k, 1)) * 0.1).astype(_NP[dtype]), "g"))
        nodes.append(helper.make_node("MatMul", [n, "g"], ["G"], name="gate"))
        outs.append(helper.make_tensor_value_info("G", dtype, [*lead, 1]))
    inits.append(numpy_helper.from_array((rng.standard_normal((k, experts)) * 0.1).astype(_NP[dtype]), "W"))
    nodes += [helper.make_node("MatMul", [n, "W"], ["L"], name="router"), helper.make_node("Relu", [n], ["Z"], name="experts")]
    outs += [helper.make_tensor_value_info("L", dtype, [*lead, experts]), helper.make_tensor_value_info("Z", dtype, [*lead, k])]
    if tap:
        outs.append(helper.make_tensor_value_info(n, dtype, [*lead, k]))
    if shape_reader:
        outs.append(helper.make_tensor_value_info("S", TensorProto.INT64, [3]))
    g = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("X", dtype, [1, "T", k])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


PROLOGUE = {"densemm": {"prologue": True}}  #: the option that runs rms-norm-prologue on any backend


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
        positive("norm-prologue-graph-output", lambda: normed_router(tap=True), {"dense-float-matmul": 0, "rms-norm-prologue": 0},
                 options=PROLOGUE),
        negative("norm-prologue-off-by-default", normed_router),
    ]
