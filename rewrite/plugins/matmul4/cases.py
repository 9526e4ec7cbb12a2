"""Conformance cases of the ``matmul4`` plugin: the dense INT4 form ``quant4`` writes (UINT4 codes with zero
points, INT4 codes without, a partial last block, f16, a leading batch dim), products sharing their input (merged
by ``shared-input``, with or without the option), and forms it must leave alone."""

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


def shared_input(*, dtype: int = TensorProto.FLOAT, k: int = 64, widths=(40, 24, 16), bs: int = 32,
                 symmetric=(False, True, False), seed: int = 0) -> onnx.ModelProto:
    """X [T, k] read by one DQ -> MatMul per width (INT4 codes without zero points where ``symmetric``), each
    followed by Relu -> Y_i; and X @ a float weight -> Z (not INT4: not merged)."""
    rng = np.random.default_rng(seed)
    nb = -(-k // bs)
    nodes, inits, outs = [], [], []
    for i, (n, sym) in enumerate(zip(widths, symmetric)):
        if sym:
            codes = rng.integers(-8, 8, (k, n)).astype(ml_dtypes.int4)
        else:
            codes = rng.integers(0, 16, (k, n)).astype(ml_dtypes.uint4)
        inits += [numpy_helper.from_array(codes, f"codes{i}"),
                  numpy_helper.from_array((rng.random((nb, n)) * 0.1 + 0.01).astype(_NP[dtype]), f"scales{i}")]
        dq_in = [f"codes{i}", f"scales{i}"]
        if not sym:
            inits.append(numpy_helper.from_array(rng.integers(0, 16, (nb, n)).astype(ml_dtypes.uint4), f"zp{i}"))
            dq_in.append(f"zp{i}")
        nodes += [helper.make_node("DequantizeLinear", dq_in, [f"W{i}"], axis=0, block_size=bs, name=f"dq{i}"),
                  helper.make_node("MatMul", ["X", f"W{i}"], [f"P{i}"], name=f"mm{i}"),
                  helper.make_node("Relu", [f"P{i}"], [f"Y{i}"], name=f"relu{i}")]
        outs.append(helper.make_tensor_value_info(f"Y{i}", dtype, ["T", n]))
    inits.append(numpy_helper.from_array(rng.standard_normal((k, 8)).astype(_NP[dtype]), "F"))
    nodes.append(helper.make_node("MatMul", ["X", "F"], ["Z"], name="float_mm"))
    outs.append(helper.make_tensor_value_info("Z", dtype, ["T", 8]))
    g = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("X", dtype, ["T", k])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def matmul4_cases() -> list:
    return [
        positive("uint4-zero-points-partial-block", lambda: dense_int4(k=80, bs=32), matches=1),
        positive("int4-symmetric", lambda: dense_int4(symmetric=True, k=64, bs=64), matches=1),
        positive("f16-batch-dim", lambda: dense_int4(dtype=TensorProto.FLOAT16, k=128, n=48, bs=128, rank=3),
                 matches=1, rtol=1e-2),
        positive("shared-input-merged", shared_input, {"dense-int4-matmul": 3, "shared-input": 1}),
        positive("shared-input-f16-all-zero-points", lambda: shared_input(dtype=TensorProto.FLOAT16, k=128, bs=64,
                 widths=(32, 32), symmetric=(False, False)), {"dense-int4-matmul": 2, "shared-input": 1}, rtol=1e-2),
        positive("shared-input-not-merged", lambda: shared_input(widths=(40,), symmetric=(False,)),
                 {"dense-int4-matmul": 1, "shared-input": 0}, options={"matmul4": {"merge": True}}),
        positive("shared-input-merge-off", shared_input, {"dense-int4-matmul": 3},
                 options={"matmul4": {"merge": False}}),
        negative("blocks-along-n", lambda: dense_int4(axis=1, k=64, n=64, bs=32)),
        negative("weight-read-elsewhere", lambda: dense_int4(tap=True)),
    ]
