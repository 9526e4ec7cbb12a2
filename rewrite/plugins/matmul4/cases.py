"""Conformance cases of the ``matmul4`` plugin: the dense INT4 form ``quant4`` writes (UINT4 codes with zero
points, INT4 codes without, a partial last block, f16, a leading batch dim), and forms it must leave alone."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rewrite.core.cases import negative, positive

_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def dense_int4(*, dtype: int = TensorProto.FLOAT, k: int = 96, n: int = 40, bs: int = 32, symmetric: bool = False,
               axis: int = 0, rank: int = 2, tap: bool = False, seed: int = 0) -> onnx.ModelProto:
    """X [T, k] (rank 3: [1, T, k]) -> MatMul(X, DequantizeLinear(codes [k, n], scales, zero points, axis, bs)) -> Relu -> Y.

    ``symmetric``: INT4 codes and no zero points; ``tap``: the dequantized weight is also a graph output."""
    rng = np.random.default_rng(seed)
    nb = -(-k // bs)
    if symmetric:
        codes = numpy_helper.from_array(rng.integers(-8, 8, (k, n)).astype(ml_dtypes.int4), "codes")
    else:
        codes = numpy_helper.from_array(rng.integers(0, 16, (k, n)).astype(ml_dtypes.uint4), "codes")
    shape = (nb, n) if axis in (0, -2) else (k, -(-n // bs))
    inits = [codes, numpy_helper.from_array((rng.random(shape) * 0.1 + 0.01).astype(_NP[dtype]), "scales")]
    dq_in = ["codes", "scales"]
    if not symmetric:
        inits.append(numpy_helper.from_array(rng.integers(0, 16, shape).astype(ml_dtypes.uint4), "zero_points"))
        dq_in.append("zero_points")
    nodes = [helper.make_node("DequantizeLinear", dq_in, ["W"], axis=axis, block_size=bs, name="dq"),
             helper.make_node("MatMul", ["X", "W"], ["P"], name="mm"), helper.make_node("Relu", ["P"], ["Y"], name="relu")]
    lead = ["T"] if rank == 2 else [1, "T"]
    outs = [helper.make_tensor_value_info("Y", dtype, [*lead, n])]
    if tap:
        outs.append(helper.make_tensor_value_info("W", dtype, [k, n]))
    g = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("X", dtype, [*lead, k])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def matmul4_cases() -> list:
    return [
        positive("uint4-zero-points-partial-block", lambda: dense_int4(k=80, bs=32), matches=1),
        positive("int4-symmetric", lambda: dense_int4(symmetric=True, k=64, bs=64), matches=1),
        positive("f16-batch-dim", lambda: dense_int4(dtype=TensorProto.FLOAT16, k=128, n=48, bs=128, rank=3),
                 matches=1, rtol=1e-2),
        negative("blocks-along-n", lambda: dense_int4(axis=1, k=64, n=64, bs=32)),
        negative("weight-read-elsewhere", lambda: dense_int4(tap=True)),
    ]
