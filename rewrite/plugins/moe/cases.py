"""Conformance cases of the ``moe`` plugin: one-block models of each form it fuses, and forms it must refuse.

The builders write the routed-expert block exactly as the real inputs spell it (transformers' exporter with
``batched_mm`` experts, ``tests/test_plugin_moe.py`` checks the same rules on the real exports; the seed's INT4
form of ``examples/seed_form.py``), with hidden [T, H] and router logits [T, E] as graph inputs.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rewrite.core.cases import Case, negative, positive

_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def hf_block(*, dtype: int = TensorProto.FLOAT, e: int = 8, k: int = 2, h: int = 32, i: int = 16, normalize: bool = False,
             largest: int = 1, sum_axis: int = 1, seed: int = 0) -> onnx.ModelProto:
    """transformers' batched_mm experts for hidden [T, h] and logits [T, e]; fp16 adds the exporter's Casts."""
    rng = np.random.default_rng(seed)
    npdt = _NP[dtype]
    n = helper.make_node
    c = lambda name, v, dt=np.int64: numpy_helper.from_array(np.asarray(v, dt), name)  # noqa: E731
    inits = [c("k", [k]), c("m1", [-1]), c("one", [1]), c("tiles", [1, k, 1]), c("rep_shape", [-1, h]),
             c("sum_shape", [-1, k, h]), c("sum_axes", [sum_axis]),
             c("fc1", rng.standard_normal((e, 2 * i, h)) * 0.2, npdt), c("fc2", rng.standard_normal((e, h, i)) * 0.2, npdt)]
    nodes = [n("Softmax", ["logits"], ["probs"], axis=-1)]
    probs = "probs"
    if dtype == TensorProto.FLOAT16:
        nodes.append(n("Cast", ["probs"], ["probs32"], to=TensorProto.FLOAT))
        probs = "probs32"
    nodes.append(n("TopK", [probs, "k"], ["values", "ids"], axis=-1, largest=largest, sorted=1))
    w = "values"
    if normalize:
        nodes += [n("ReduceSum", ["values", "m1"], ["vsum"], keepdims=1), n("Div", ["values", "vsum"], ["normed"])]
        w = "normed"
    if dtype == TensorProto.FLOAT16:
        nodes.append(n("Cast", [w], ["w16"], to=TensorProto.FLOAT16))
        w = "w16"
    nodes += [
        n("Unsqueeze", ["hidden", "one"], ["hu"]), n("Tile", ["hu", "tiles"], ["ht"]), n("Reshape", ["ht", "rep_shape"], ["rep"]),
        n("Reshape", ["ids", "m1"], ["ids_flat"]), n("Unsqueeze", ["ids_flat", "m1"], ["ids_nd"]),
        n("GatherND", ["fc1", "ids_nd"], ["w1"]), n("Unsqueeze", ["rep", "m1"], ["rep_u"]), n("MatMul", ["w1", "rep_u"], ["gu3"]),
        n("Squeeze", ["gu3", "m1"], ["gu"]), n("Split", ["gu"], ["g", "u"], axis=1, num_outputs=2),
        n("Sigmoid", ["g"], ["sg"]), n("Mul", ["g", "sg"], ["silu"]), n("Mul", ["silu", "u"], ["act"]),
        n("GatherND", ["fc2", "ids_nd"], ["w2"]), n("Unsqueeze", ["act", "m1"], ["act_u"]), n("MatMul", ["w2", "act_u"], ["d3"]),
        n("Squeeze", ["d3", "m1"], ["d"]), n("Reshape", [w, "m1"], ["wf"]), n("Unsqueeze", ["wf", "m1"], ["wu"]),
        n("Mul", ["d", "wu"], ["dw"]), n("Reshape", ["dw", "sum_shape"], ["grouped"]),
    ]
    grouped = "grouped"
    if dtype == TensorProto.FLOAT16:
        nodes.append(n("Cast", ["grouped"], ["grouped32"], to=TensorProto.FLOAT))
        grouped = "grouped32"
    nodes.append(n("ReduceSum", [grouped, "sum_axes"], ["y"], keepdims=0))
    if dtype == TensorProto.FLOAT16:
        nodes[-1].output[0] = "y32"
        nodes.append(n("Cast", ["y32"], ["y"], to=TensorProto.FLOAT16))
    g = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("hidden", dtype, ["T", h]),
                                                helper.make_tensor_value_info("logits", dtype, ["T", e])],
                          [helper.make_tensor_value_info("y", dtype, ["T", h])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def seed_block(*, e: int = 8, k: int = 2, h: int = 128, i: int = 192, block: int = 128, seed: int = 0) -> onnx.ModelProto:
    """The seed's INT4 gather-then-compute experts (fp32), I=192 giving a partial last block along the down input."""
    rng = np.random.default_rng(seed)
    n = helper.make_node
    c = lambda name, v, dt=np.int64: numpy_helper.from_array(np.asarray(v, dt), name)  # noqa: E731
    inits = [c("k", [k]), c("m1", [-1]), c("one", [1]), c("tiles", [1, k, 1]), c("rep_shape", [-1, 1, h]),
             c("w_shape", [-1, 1, k]), c("sum_shape", [-1, k, h]), c("out_shape", [-1, h])]
    nodes = [n("Softmax", ["logits"], ["probs"], axis=-1), n("TopK", ["probs", "k"], ["values", "ids"], axis=-1),
             n("Reshape", ["ids", "m1"], ["flat"])]
    for proj, (rows, cols) in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
        nb = -(-cols // block)
        inits += [c(f"{proj}_q", rng.integers(0, 16, (e, rows, cols)), np.uint8),
                  c(f"{proj}_s", rng.random((e, rows, nb)) * 0.02 + 0.005, np.float32),
                  c(f"{proj}_z", rng.integers(0, 16, (e, rows, nb)), np.uint8)]
        nodes += [n("Gather", [f"{proj}_q", "flat"], [f"{proj}_qg"], axis=0), n("Gather", [f"{proj}_s", "flat"], [f"{proj}_sg"], axis=0),
                  n("Gather", [f"{proj}_z", "flat"], [f"{proj}_zg"], axis=0),
                  n("Cast", [f"{proj}_qg"], [f"{proj}_q4"], to=TensorProto.UINT4), n("Cast", [f"{proj}_zg"], [f"{proj}_z4"], to=TensorProto.UINT4),
                  n("DequantizeLinear", [f"{proj}_q4", f"{proj}_sg", f"{proj}_z4"], [f"{proj}_dq"], axis=2, block_size=block),
                  n("Transpose", [f"{proj}_dq"], [f"{proj}_w"], perm=[0, 2, 1])]
    nodes += [n("Unsqueeze", ["hidden", "one"], ["hu"]), n("Tile", ["hu", "tiles"], ["ht"]), n("Reshape", ["ht", "rep_shape"], ["rep"]),
              n("MatMul", ["rep", "gate_w"], ["g"]), n("Sigmoid", ["g"], ["sg"]), n("Mul", ["g", "sg"], ["silu"]),
              n("MatMul", ["rep", "up_w"], ["u"]), n("Mul", ["silu", "u"], ["act"]), n("MatMul", ["act", "down_w"], ["eo"]),
              n("Reshape", ["values", "w_shape"], ["wr"]), n("Reshape", ["eo", "sum_shape"], ["eor"]), n("MatMul", ["wr", "eor"], ["ws"]),
              n("Reshape", ["ws", "out_shape"], ["y"])]
    g = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["T", h]),
                                                helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", e])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", h])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def residual_block(*, dtype: int = TensorProto.FLOAT, tokens: int = 3, h: int = 32, reshape: bool = True,
                   elementwise: bool = False) -> onnx.ModelProto:
    """:func:`hf_block` for ``tokens`` tokens (static: the residual rule needs every dim) followed by the residual
    sum of a decoder layer: ``z = Reshape(y, [1, T, h]) + r`` with ``r = MatMul(x, Wr) + x`` (a projection and
    its residual; ``elementwise``: ``r = Sigmoid(x) * x`` instead, which the rule leaves alone), ``x`` a graph
    input [1, T, h]; without ``reshape`` the Add reads y itself, [T, h]."""
    m = hf_block(dtype=dtype, h=h)
    g = m.graph
    npdt = _NP[dtype]
    for v in list(g.input) + list(g.output):
        v.type.tensor_type.shape.dim[0].dim_value = tokens
    shape = [1, tokens, h] if reshape else [tokens, h]
    n = helper.make_node
    g.input.append(helper.make_tensor_value_info("x", dtype, shape))
    g.initializer.append(numpy_helper.from_array((np.random.default_rng(7).standard_normal((h, h)) * 0.2).astype(npdt), "wr"))
    g.initializer.append(numpy_helper.from_array(np.array(shape, np.int64), "out3"))
    if elementwise:
        g.node.extend([n("Sigmoid", ["x"], ["xs"]), n("Mul", ["xs", "x"], ["r"])])
    else:
        g.node.extend([n("MatMul", ["x", "wr"], ["xw"]), n("Add", ["xw", "x"], ["r"])])
    y = "y"
    if reshape:
        g.node.append(n("Reshape", ["y", "out3"], ["y3"]))
        y = "y3"
    g.node.append(n("Add", [y, "r"], ["z"]))
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("z", dtype, shape))
    return m


def shared_block(*, dtype: int = TensorProto.FLOAT, h: int = 32, residual: bool = False, used_elsewhere: bool = False,
                 gate_first: bool = True) -> onnx.ModelProto:
    """:func:`hf_block` plus a sigmoid-gated shared expert, as Qwen1.5-MoE's block ends:
    ``z = y + sigmoid(hidden @ Wg) * silu(hidden @ Wsg) * (hidden @ Wsu) @ Wsd`` (``gate_first``: the Mul's
    operands in that order, else swapped); ``residual``: then ``+ hidden`` (the decoder layer's residual sum, which
    fused-moe-residual takes after this rule; 3 tokens, static: that rule needs every dim); ``used_elsewhere``: the
    gated product is a graph output too, so the rule must leave it."""
    m = hf_block(dtype=dtype, h=h)
    g = m.graph
    tokens = 3 if residual else "T"
    if residual:
        for v in g.input:
            v.type.tensor_type.shape.dim[0].dim_value = tokens
    npdt = _NP[dtype]
    rng = np.random.default_rng(11)
    n = helper.make_node
    for name, shape in (("wg", (h, 1)), ("wsg", (h, 24)), ("wsu", (h, 24)), ("wsd", (24, h))):
        g.initializer.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(npdt), name))
    g.node.extend([n("MatMul", ["hidden", "wg"], ["gl"]), n("Sigmoid", ["gl"], ["gs"]),
                   n("MatMul", ["hidden", "wsg"], ["sg0"]), n("Sigmoid", ["sg0"], ["sg1"]), n("Mul", ["sg0", "sg1"], ["sg2"]),
                   n("MatMul", ["hidden", "wsu"], ["su"]), n("Mul", ["sg2", "su"], ["sa"]), n("MatMul", ["sa", "wsd"], ["so"]),
                   n("Mul", ["gs", "so"] if gate_first else ["so", "gs"], ["gated"]), n("Add", ["y", "gated"], ["z"])])
    out = "z"
    if residual:
        g.node.append(n("Add", ["z", "hidden"], ["zr"]))
        out = "zr"
    del g.output[:]
    g.output.append(helper.make_tensor_value_info(out, dtype, [tokens, h]))
    if used_elsewhere:
        g.output.append(helper.make_tensor_value_info("gated", dtype, [tokens, h]))
    return m


RESIDUAL = {"moe": {"residual": True}}  #: the option that runs fused-moe-residual on any backend
SHARED = {"moe": {"shared": True, "residual": True}}  #: fused-moe-shared (and the residual rule after it) anywhere


def moe_cases() -> list[Case]:
    """Positive: each form, fp32/fp16, with and without renormalisation. Negative: forms that are not the contract."""
    F16 = TensorProto.FLOAT16
    return [
        positive("hf-fp32", hf_block, {"fused-moe-hf": 1}),
        positive("hf-fp32-renorm-e60-k4", lambda: hf_block(e=60, k=4, normalize=True), {"fused-moe-hf": 1}),
        positive("hf-fp16", lambda: hf_block(dtype=F16), {"fused-moe-hf": 1}, rtol=2e-2),
        positive("seed-int4-partial-block", seed_block, {"fused-moe-seed-int4": 1}),
        # the residual rule is for IREE cuda by default: forced here, so ONNX Runtime and llvm-cpu check the addend
        positive("hf-fp32-residual", residual_block, {"fused-moe-hf": 1, "fused-moe-residual": 1}, options=RESIDUAL),
        positive("hf-fp16-residual-no-reshape", lambda: residual_block(dtype=F16, reshape=False),
                 {"fused-moe-hf": 1, "fused-moe-residual": 1}, rtol=2e-2, options=RESIDUAL),
        positive("hf-fp32-elementwise-addend-left", lambda: residual_block(elementwise=True),
                 {"fused-moe-hf": 1, "fused-moe-residual": 0}, options=RESIDUAL),
        positive("hf-fp32-residual-off-by-default", residual_block, {"fused-moe-hf": 1}),
        # the shared-expert rule is for IREE cuda by default too: forced here (ONNX Runtime and llvm-cpu compute it)
        positive("hf-fp32-shared", lambda: shared_block(gate_first=False), {"fused-moe-hf": 1, "fused-moe-shared": 1},
                 options=SHARED),
        positive("hf-fp16-shared-residual", lambda: shared_block(dtype=F16, residual=True),
                 {"fused-moe-hf": 1, "fused-moe-shared": 1, "fused-moe-residual": 1}, rtol=2e-2, options=SHARED),
        positive("hf-fp32-shared-read-elsewhere-left", lambda: shared_block(used_elsewhere=True),
                 {"fused-moe-hf": 1, "fused-moe-shared": 0}, options=SHARED),
        positive("hf-fp32-shared-off-by-default", shared_block, {"fused-moe-hf": 1}),
        negative("topk-largest-0", lambda: hf_block(largest=0)),
        negative("sum-over-hidden-axis", lambda: hf_block(sum_axis=2)),
    ]
