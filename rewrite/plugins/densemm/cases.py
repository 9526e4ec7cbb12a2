"""Conformance cases of the ``densemm`` plugin: an LM-head-like MatMul by a large float weight (f32, f16, a
leading batch dim), a one-column gate, and weights it must leave alone (small, shared with a Gather, computed)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rewrite.core.cases import negative, positive
from rewrite.plugins.densemm import MIN_ELEMENTS

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


def densemm_cases() -> list:
    return [
        positive("lm-head-f32", lambda: head(), matches=1),
        positive("lm-head-f16-batch-dim", lambda: head(dtype=TensorProto.FLOAT16, k=128, n=MIN_ELEMENTS // 128, rank=3),
                 matches=1, rtol=1e-2),
        negative("small-weight", lambda: head(n=MIN_ELEMENTS // 64 - 1)),
        positive("one-column-gate-f16", lambda: head(dtype=TensorProto.FLOAT16, k=2048, n=1, rank=3), matches=1, rtol=1e-2),
        negative("tied-embedding", lambda: head(tied=True)),
    ]
