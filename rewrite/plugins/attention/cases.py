"""Conformance cases of the ``attention`` plugin: the attention core as exporters write it (K/V heads repeated per
query group by Unsqueeze, Expand and Reshape, or read as they are; a causal mask of [1, 1, T, S] or [B, 1, T, S], or
none; a scale Mul or none, or torch's SDPA decomposition; f32, and f16 with the Cast pair after the Softmax), and
forms it must leave alone (a Softmax over another axis, a per-head scale)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rewrite.core.cases import negative, positive

_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def attention_core(*, dtype: int = TensorProto.FLOAT, b: int = 1, hq: int = 8, hkv: int = 2, t="T", s: int = 12,
                   d: int = 32, mask: str = "causal", cast_pair: bool = False, axis: int = -1,
                   per_head_scale: bool = False, unscaled: bool = False, sdpa: bool = False,
                   nan_guard: bool = False) -> onnx.ModelProto:
    """Q [b, hq, t, d], K and V [b, hkv, s, d] (graph inputs) -> the decomposed attention core -> Y [b, hq, t, d].

    ``mask``: "causal" (an input [1, 1, t, s]), "batch" ([b, 1, t, s]), "rows" ([1, 1, M, s], M a symbol of its own)
    or "" (none); ``cast_pair``: Cast to
    float32 and back after the Softmax; ``per_head_scale``: the scale is [1, hq, 1, 1]; ``unscaled``: no Mul (a
    scale of 1, which exporters drop: GraniteMoE's attention multiplier of 1); ``sdpa``: the scores as torch's
    scaled_dot_product_attention decomposes them, Q and K^T (K' viewed as [N, S, D], transposed, viewed back) each
    times sqrt(scale) (a per-head [1, hq, 1, 1] one on Q with ``per_head_scale``); ``nan_guard``:
    ``Where(IsNaN(P), 0, P)`` after the Softmax (that decomposition with ``dynamo=True``)."""
    npd = _NP[dtype]
    nodes, inits = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def repeat(x):
        if hq == hkv:
            return x
        nodes.append(helper.make_node("Unsqueeze", [x, const(f"{x}_axes", np.array([2], np.int64))], [f"{x}_u"]))
        nodes.append(helper.make_node("Expand", [f"{x}_u", const(f"{x}_g", np.array([b, hkv, hq // hkv, s, d], np.int64))], [f"{x}_e"]))
        nodes.append(helper.make_node("Reshape", [f"{x}_e", const(f"{x}_r", np.array([b, hq, s, d], np.int64))], [f"{x}_rep"]))
        return f"{x}_rep"

    scale = np.full((1, hq, 1, 1), d ** -0.5, npd) if per_head_scale else np.array(d ** -0.5, npd)
    if sdpa:
        root = np.sqrt(scale).astype(npd)
        nodes += [helper.make_node("Reshape", [repeat("K"), const("k3", np.array([-1, s, d], np.int64))], ["K3"]),
                  helper.make_node("Transpose", ["K3"], ["K3t"], perm=[0, 2, 1]),
                  helper.make_node("Reshape", ["K3t", const("kt4", np.array([b, hq, d, s], np.int64))], ["Kt"]),
                  helper.make_node("Mul", ["Q", const("q_root", root)], ["Qs"]),
                  helper.make_node("Mul", ["Kt", const("k_root", np.sqrt(np.array(d ** -0.5, npd)).astype(npd))], ["Kts"]),
                  helper.make_node("MatMul", ["Qs", "Kts"], ["scaled"])]
        unscaled = True  # the scale is in the two Muls
    else:
        nodes += [helper.make_node("Transpose", [repeat("K")], ["Kt"], perm=[0, 1, 3, 2]),
                  helper.make_node("MatMul", ["Q", "Kt"], ["scores" if not unscaled else "scaled"])]
    if not unscaled:
        nodes.append(helper.make_node("Mul", ["scores", const("scale", scale)], ["scaled"]))
    last = "scaled"
    inputs = [helper.make_tensor_value_info("Q", dtype, [b, hq, t, d]), helper.make_tensor_value_info("K", dtype, [b, hkv, s, d]),
              helper.make_tensor_value_info("V", dtype, [b, hkv, s, d])]
    if mask:
        rows = "M" if mask == "rows" else t  # "rows": a dim of its own, 1 or T at run time
        inputs.append(helper.make_tensor_value_info("mask", dtype, [b if mask == "batch" else 1, 1, rows, s]))
        nodes.append(helper.make_node("Add", ["scaled", "mask"], ["masked"]))
        last = "masked"
    nodes.append(helper.make_node("Softmax", [last], ["probs"], axis=axis))
    last = "probs"
    if cast_pair:
        nodes += [helper.make_node("Cast", ["probs"], ["probs32"], to=TensorProto.FLOAT),
                  helper.make_node("Cast", ["probs32"], ["probs16"], to=dtype)]
        last = "probs16"
    if nan_guard:
        nodes += [helper.make_node("IsNaN", [last], ["probs_nan"]),
                  helper.make_node("Where", ["probs_nan", const("nan_zero", np.zeros((), npd)), last], ["probs_ok"])]
        last = "probs_ok"
    nodes.append(helper.make_node("MatMul", [last, repeat("V")], ["Y"]))
    g = helper.make_graph(nodes, "main_graph", inputs, [helper.make_tensor_value_info("Y", dtype, [b, hq, t, d])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Random Q, K, V and a causal mask over the last positions (T = 3 query rows where T is symbolic)."""
    rng = np.random.default_rng(0)
    feeds = {}
    for i in model.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else 3 for d in i.type.tensor_type.shape.dim]
        dt = helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        if i.name == "mask":
            t, s = dims[2], dims[3]
            m = np.where(np.arange(s)[None, :] <= np.arange(s - t - 2, s - 2)[:, None], 0.0, -np.inf).astype(dt)
            feeds[i.name] = np.broadcast_to(m, dims).copy()
        else:
            feeds[i.name] = rng.standard_normal(dims).astype(dt)
    return feeds


def _one_mask_row(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """:func:`_feeds` with the mask's rows dim at 1: one row broadcast over the T = 3 query rows."""
    feeds = _feeds(model)
    feeds["mask"] = feeds["mask"][:, :, -1:, :].copy()
    return feeds


def attention_cases() -> list:
    return [
        positive("grouped-causal-f32", lambda: attention_core(), matches=1, feeds=_feeds),
        positive("heads-f16-cast-pair", lambda: attention_core(dtype=TensorProto.FLOAT16, hq=4, hkv=4, d=64, cast_pair=True),
                 matches=1, rtol=1e-2, feeds=_feeds),
        positive("grouped-batch-mask", lambda: attention_core(b=2, hq=6, hkv=3, mask="batch"), matches=1, feeds=_feeds),
        positive("mask-rows-broadcast-at-run-time", lambda: attention_core(mask="rows"), matches=1, feeds=_one_mask_row),
        positive("no-mask-decode", lambda: attention_core(t=1, mask=""), matches=1, feeds=_feeds),
        positive("unscaled", lambda: attention_core(unscaled=True), matches=1, feeds=_feeds),
        positive("sdpa-decomposition", lambda: attention_core(sdpa=True), matches=1, feeds=_feeds),
        negative("sdpa-f16", lambda: attention_core(dtype=TensorProto.FLOAT16, hq=4, hkv=4, d=64, sdpa=True)),
        negative("softmax-over-queries", lambda: attention_core(axis=2)),
        negative("per-head-scale", lambda: attention_core(per_head_scale=True)),
        positive("sdpa-nan-guard", lambda: attention_core(sdpa=True, nan_guard=True), matches=1, feeds=_feeds),
        negative("sdpa-per-head-scale", lambda: attention_core(sdpa=True, per_head_scale=True)),
    ]
