"""Conformance cases of the ``matmul4`` plugin: the dense INT4 form ``quant4`` writes (UINT4 codes with zero
points, INT4 codes without, a partial last block, f16, a leading batch dim), products sharing their input (merged
by ``shared-input``, with or without the option), SwiGLU and bias or residual Adds after them (``swiglu``,
``output-add``, with or without the option ``epilogue``), an RMSNorm before them (``rms-norm-prologue``, forced on:
its default is IREE cuda only), and forms it must leave alone."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rewrite.core.cases import negative, positive
from rewrite.plugins.rmsnorm.cases import rms_norm_nodes

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


def _int4_weight(rng, name: str, k: int, n: int, bs: int, dtype: int) -> tuple[list, list[onnx.NodeProto]]:
    """Initializers and the DequantizeLinear node of a UINT4 weight [k, n] with zero points -> value ``name``."""
    nb = -(-k // bs)
    inits = [numpy_helper.from_array(rng.integers(0, 16, (k, n)).astype(ml_dtypes.uint4), f"{name}_codes"),
             numpy_helper.from_array((rng.random((nb, n)) * 0.1 + 0.01).astype(_NP[dtype]), f"{name}_scales"),
             numpy_helper.from_array(rng.integers(0, 16, (nb, n)).astype(ml_dtypes.uint4), f"{name}_zp")]
    node = helper.make_node("DequantizeLinear", [f"{name}_codes", f"{name}_scales", f"{name}_zp"], [name], axis=0,
                            block_size=bs, name=f"dq_{name}")
    return inits, [node]


def swiglu_mlp(*, dtype: int = TensorProto.FLOAT, k: int = 64, inter: int = 48, bs: int = 32, up_first: bool = False,
               seed: int = 0) -> onnx.ModelProto:
    """X [1, T, k] -> Mul(Mul(G, Sigmoid(G)), U) with G, U = X @ INT4 gate, up -> @ INT4 down -> + X -> Y (the
    dense MLP of a decoder layer; ``up_first``: the up projection comes first in the graph and the final Mul
    reads U first)."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []
    for name, kk, n in (("Wu", k, inter), ("Wg", k, inter)) if up_first else (("Wg", k, inter), ("Wu", k, inter)):
        i, d = _int4_weight(rng, name, kk, n, bs, dtype)
        inits += i
        nodes += d + [helper.make_node("MatMul", ["X", name], ["U" if name == "Wu" else "G"], name=f"mm_{name}")]
    i, d = _int4_weight(rng, "Wd", inter, k, bs, dtype)
    inits += i
    final = ["U", "silu"] if up_first else ["silu", "U"]
    nodes += [helper.make_node("Sigmoid", ["G"], ["sg"]), helper.make_node("Mul", ["G", "sg"], ["silu"]),
              helper.make_node("Mul", final, ["act"]), *d, helper.make_node("MatMul", ["act", "Wd"], ["down"], name="mm_down"),
              helper.make_node("Add", ["X", "down"], ["Y"], name="residual")]
    g = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("X", dtype, [1, "T", k])],
                          [helper.make_tensor_value_info("Y", dtype, [1, "T", k])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def biased_projections(*, dtype: int = TensorProto.FLOAT, k: int = 64, n: int = 32, bs: int = 32, seed: int = 0) -> onnx.ModelProto:
    """X [T, k] -> Q = X @ Wq + bq [n], K = bk [1, n] + X @ Wk, V = X @ Wv + Relu(X @ Wq2) (an addend computed
    from the product V is merged with: not fused), and X @ Wr + R (a residual input of the output's shape). The
    merge takes q, v, q2 and then k, r (three per node, in graph order)."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []
    for name in ("Wq", "Wv", "Wq2", "Wk", "Wr"):
        i, d = _int4_weight(rng, name, k, n, bs, dtype)
        inits += i
        nodes += d + [helper.make_node("MatMul", ["X", name], [f"P{name}"], name=f"mm_{name}")]
    inits += [numpy_helper.from_array(rng.standard_normal(n).astype(_NP[dtype]), "bq"),
              numpy_helper.from_array(rng.standard_normal((1, n)).astype(_NP[dtype]), "bk")]
    nodes += [helper.make_node("Add", ["PWq", "bq"], ["Q"], name="add_q"), helper.make_node("Add", ["bk", "PWk"], ["K"], name="add_k"),
              helper.make_node("Relu", ["PWq2"], ["rq"]), helper.make_node("Add", ["PWv", "rq"], ["V"], name="add_v"),
              helper.make_node("Add", ["PWr", "R"], ["O"], name="add_r")]
    ins = [helper.make_tensor_value_info("X", dtype, ["T", k]), helper.make_tensor_value_info("R", dtype, ["T", n])]
    outs = [helper.make_tensor_value_info(v, dtype, ["T", n]) for v in ("Q", "K", "V", "O")]
    g = helper.make_graph(nodes, "main_graph", ins, outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def gemm_int4(*, dtype: int = TensorProto.FLOAT, k: int = 64, n: int = 40, bs: int = 32, trans_b: int = 1,
              bias: bool = True, alpha: float = 1.0, seed: int = 0) -> onnx.ModelProto:
    """X [T, k] -> Gemm(X, DequantizeLinear(codes), C; transB) -> Relu -> Y: torch's Linear as transformers' exporter
    writes it (codes [n, k] blocked along axis 1 with ``trans_b``, else [k, n] along axis 0), C [n] or absent."""
    rng = np.random.default_rng(seed)
    nb = -(-k // bs)
    shape, sshape, axis = ((n, k), (n, nb), 1) if trans_b else ((k, n), (nb, n), 0)
    inits = [numpy_helper.from_array(rng.integers(0, 16, shape).astype(ml_dtypes.uint4), "codes"),
             numpy_helper.from_array((rng.random(sshape) * 0.1 + 0.01).astype(_NP[dtype]), "scales"),
             numpy_helper.from_array(rng.integers(0, 16, sshape).astype(ml_dtypes.uint4), "zp")]
    gemm_in = ["X", "W"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(_NP[dtype]), "C"))
        gemm_in.append("C")
    nodes = [helper.make_node("DequantizeLinear", ["codes", "scales", "zp"], ["W"], axis=axis, block_size=bs, name="dq"),
             helper.make_node("Gemm", gemm_in, ["P"], transB=trans_b, alpha=alpha, name="gemm"),
             helper.make_node("Relu", ["P"], ["Y"], name="relu")]
    g = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("X", dtype, ["T", k])],
                          [helper.make_tensor_value_info("Y", dtype, ["T", n])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def biased_gemms(*, dtype: int = TensorProto.FLOAT, k: int = 64, widths=(40, 24), bs: int = 32, seed: int = 0) -> onnx.ModelProto:
    """X [T, k] read by Gemm(X, DequantizeLinear(codes_i [n_i, k], axis=1), C_i, transB=1) -> Y_i, each with a bias
    C_i [n_i] (torch's Linear with bias as transformers' exporter writes it): merged, each bias its output's addend."""
    rng = np.random.default_rng(seed)
    nb = -(-k // bs)
    nodes, inits, outs = [], [], []
    for i, n in enumerate(widths):
        inits += [numpy_helper.from_array(rng.integers(0, 16, (n, k)).astype(ml_dtypes.uint4), f"codes{i}"),
                  numpy_helper.from_array((rng.random((n, nb)) * 0.1 + 0.01).astype(_NP[dtype]), f"scales{i}"),
                  numpy_helper.from_array(rng.integers(0, 16, (n, nb)).astype(ml_dtypes.uint4), f"zp{i}"),
                  numpy_helper.from_array(rng.standard_normal(n).astype(_NP[dtype]), f"C{i}")]
        nodes += [helper.make_node("DequantizeLinear", [f"codes{i}", f"scales{i}", f"zp{i}"], [f"W{i}"], axis=1, block_size=bs),
                  helper.make_node("Gemm", ["X", f"W{i}", f"C{i}"], [f"Y{i}"], transB=1, name=f"gemm{i}")]
        outs.append(helper.make_tensor_value_info(f"Y{i}", dtype, ["T", n]))
    g = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("X", dtype, ["T", k])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def normed_projections(*, dtype: int = TensorProto.FLOAT, k: int = 64, widths=(32, 16, 16), bs: int = 32,
                       tap: bool = False, shape_reader: bool = False, seed: int = 0) -> onnx.ModelProto:
    """X [1, T, k] -> transformers' RMSNorm (in float32: f16 X between a Cast to float32 and one back; Pow,
    ReduceMean, Add eps, Sqrt, Div, Mul weight) -> one INT4 projection per width -> Y_i (a decoder layer's input
    norm and its query/key/value). ``tap``: the norm's output is also a graph output (not fused); ``shape_reader``:
    a Shape of it too (as exporters write for the attention's reshapes) -> graph output S."""
    rng = np.random.default_rng(seed)
    nodes, inits, h = rms_norm_nodes("X", dtype, k, rng)
    outs = []
    for i, n in enumerate(widths):
        w, d = _int4_weight(rng, f"W{i}", k, n, bs, dtype)
        inits += w
        nodes += d + [helper.make_node("MatMul", [h, f"W{i}"], [f"Y{i}"], name=f"mm{i}")]
        outs.append(helper.make_tensor_value_info(f"Y{i}", dtype, [1, "T", n]))
    if tap:
        nodes.append(helper.make_node("Identity", [h], ["H"]))
        outs.append(helper.make_tensor_value_info("H", dtype, [1, "T", k]))
    if shape_reader:
        nodes.append(helper.make_node("Shape", [h], ["S"], name="shape"))
        outs.append(helper.make_tensor_value_info("S", TensorProto.INT64, [3]))
    g = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("X", dtype, [1, "T", k])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


PROLOGUE = {"matmul4": {"prologue": True}}  #: the option that runs rms-norm-prologue on any backend


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
        positive("swiglu-and-residual", swiglu_mlp, {"dense-int4-matmul": 3, "shared-input": 1, "swiglu": 1, "output-add": 1}),
        positive("swiglu-up-first-f16", lambda: swiglu_mlp(dtype=TensorProto.FLOAT16, up_first=True),
                 {"dense-int4-matmul": 3, "shared-input": 1, "swiglu": 1, "output-add": 1}, rtol=1e-2),
        positive("swiglu-epilogue-off", swiglu_mlp, {"dense-int4-matmul": 3, "shared-input": 1},
                 options={"matmul4": {"epilogue": False}}),
        positive("bias-and-residual-adds", biased_projections,
                 {"dense-int4-matmul": 5, "shared-input": 2, "output-add": 3}),
        positive("bias-and-residual-adds-f16", lambda: biased_projections(dtype=TensorProto.FLOAT16, k=128, bs=64),
                 {"dense-int4-matmul": 5, "shared-input": 2, "output-add": 3}, rtol=1e-2),
        positive("gemm-trans-b-bias", gemm_int4, {"dense-int4-gemm": 1}),
        positive("gemm-no-trans-f16", lambda: gemm_int4(dtype=TensorProto.FLOAT16, k=128, bs=64, trans_b=0, bias=False),
                 {"dense-int4-gemm": 1}, rtol=1e-2),
        negative("gemm-alpha", lambda: gemm_int4(alpha=0.5)),
        positive("gemms-with-biases-merged", biased_gemms, {"dense-int4-gemm": 2, "shared-input": 1}),
        positive("norm-prologue-qkv", normed_projections, {"dense-int4-matmul": 3, "shared-input": 1, "rms-norm-prologue": 1},
                 options=PROLOGUE),
        positive("norm-prologue-f16-casts-shape-reader",
                 lambda: normed_projections(dtype=TensorProto.FLOAT16, k=128, widths=(64,), bs=64, shape_reader=True),
                 {"dense-int4-matmul": 1, "rms-norm-prologue": 1}, rtol=1e-2, options=PROLOGUE),
        positive("norm-prologue-output-read-elsewhere", lambda: normed_projections(tap=True),
                 {"dense-int4-matmul": 3, "shared-input": 1, "rms-norm-prologue": 0}, options=PROLOGUE),
        positive("norm-prologue-off-by-default", normed_projections, {"dense-int4-matmul": 3, "shared-input": 1}),
        negative("blocks-along-n", lambda: dense_int4(axis=1, k=64, n=64, bs=32)),
        negative("weight-read-elsewhere", lambda: dense_int4(tap=True)),
    ]
