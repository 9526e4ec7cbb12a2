"""Differential tests: random small graphs over the optional-input and attribute space of what the backends
lower, each lowered output folder compared with the original on ONNX Runtime at the basic level.

Generated with hypothesis (derandomized, so every run draws the same cases). What each covers:

* weight-only ``DequantizeLinear -> MatMul`` on the ``ort`` backend: 4- and 8-bit codes, zero points present or
  absent (ONNX: absent means 0), per-tensor, per-channel and blocked scales, partial last blocks, the weight as
  ``[K, N]`` or transposed ``[N, K]``; our MatMulNBits lowering and ONNX Runtime's own fusions at the folder's
  recorded session must both keep the numbers (f32: 1e-5 of the largest output);
* the same blocked forms through ``legalize`` on IREE llvm-cpu (fewer draws: each compiles a module);
* ``MoERouterTopK``'s ONNX Runtime lowering against its reference for every mode, grouped mode's groups, kept
  groups, selection biases, renormalization (``eps``, ``norm_min``) and scaling, more experts selected than kept
  groups hold (ties among masked experts broken by the lower index), float16 and float32 logits;
* ``FusedMoE`` on ``ort`` (and, fewer draws, IREE llvm-cpu) against its reference: float and block-wise INT4
  experts, zero points present or absent (absent means 8), partial last blocks, every mode (routed from the
  graph's own Softmax and TopK), biases on either projection, gpt-oss's clamped SwiGLU, empty batches;
* ``KVCacheUpdate`` on both backends, bit-exact: any axis of a rank-3 or rank-4 cache, a batch of 1 to 3, empty
  updates, positions counted from either end, as shape ``[1]`` or a scalar.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from rewrite.backends import load_runner
from rewrite.backends.ort import OrtRunner, lower_abstract_ops
from rewrite.core import onnx_io
from rewrite.core.abstract_ops import DOMAIN
from rewrite.pipeline import apply
from rewrite.plugins.router.op import MoERouterTopK

_RANGES = {TP.UINT4: (0, 16), TP.INT4: (-8, 8), TP.UINT8: (0, 256), TP.INT8: (-128, 128)}
_SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@st.composite
def qdq_matmuls(draw, blocked_only: bool = False):
    """(model, feeds): y = x @ DequantizeLinear(codes, scale[, zero_point]) with the weight [K, N] or [N, K]."""
    codes_t = draw(st.sampled_from([TP.UINT4, TP.INT4] if blocked_only else list(_RANGES)))
    k, n = draw(st.integers(16, 160)), draw(st.integers(1, 24))
    nk = draw(st.booleans())  # the stored weight is [N, K], read through a Transpose
    if blocked_only:
        scheme = "blocked"
    elif codes_t in (TP.UINT8, TP.INT8):  # 8-bit weights: per-channel or per-tensor, as exporters write them
        scheme = draw(st.sampled_from(["channel", "tensor"]))
    else:
        scheme = draw(st.sampled_from(["blocked", "channel", "tensor"]))
    with_zp = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    lo, hi = _RANGES[codes_t]
    shape = (n, k) if nk else (k, n)
    k_axis = 1 if nk else 0
    codes = rng.integers(lo, hi, shape)
    attrs = {}
    if scheme == "blocked":
        bs = draw(st.sampled_from([16, 32, 64, 128]))
        nb = -(-k // bs)
        pshape = (n, nb) if nk else (nb, n)
        attrs = dict(axis=k_axis, block_size=bs)
    elif scheme == "channel":
        pshape = (n,)
        attrs = dict(axis=1 - k_axis)
    else:
        pshape = ()
    scale = (rng.uniform(0.5, 1.5, pshape) * 0.05).astype(np.float32)
    inits = [helper.make_tensor("W_q", codes_t, list(shape), codes.reshape(-1).tolist()), numpy_helper.from_array(scale, "W_s")]
    dq_in = ["W_q", "W_s"]
    if with_zp:
        inits.append(helper.make_tensor("W_z", codes_t, list(pshape), rng.integers(lo, hi, pshape).reshape(-1).tolist()))
        dq_in.append("W_z")
    nodes = [helper.make_node("DequantizeLinear", dq_in, ["W"], name="dq", **attrs)]
    w = "W"
    if nk:
        nodes.append(helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0], name="t"))
        w = "Wt"
    nodes.append(helper.make_node("MatMul", ["x", w], ["y"], name="mm"))
    g = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TP.FLOAT, [3, k])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [3, n])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m, {"x": rng.standard_normal((3, k)).astype(np.float32)}


def _check_folder(m: onnx.ModelProto, feeds: dict, tmp_path, backend: str, plugins: str) -> None:
    src = tmp_path / "src.onnx"
    onnx.save(m, src)
    want = OrtRunner(src, optimize="basic").run(feeds)["y"]
    out = tmp_path / backend
    apply(src, out, plugins=plugins, backend=backend)
    got = load_runner(out).run(feeds)["y"]
    scale = max(float(np.abs(want).max()), 1e-6)
    assert np.abs(got.astype(np.float64) - want).max() <= 1e-5 * scale


@settings(max_examples=60, **_SETTINGS)
@given(case=qdq_matmuls())
def test_qdq_matmul_on_ort_keeps_its_numbers(tmp_path_factory, case):
    _check_folder(*case, tmp_path_factory.mktemp("qdq"), "ort", "")


@pytest.mark.slow
@settings(max_examples=6, **_SETTINGS)
@given(case=qdq_matmuls(blocked_only=True))
def test_blocked_qdq_matmul_through_legalize_on_iree_keeps_its_numbers(tmp_path_factory, case):
    _check_folder(*case, tmp_path_factory.mktemp("qdq_iree"), "iree", "legalize")


@st.composite
def router_samples(draw):
    """(attrs, logits, bias) of a MoERouterTopK in any mode."""
    mode = draw(st.sampled_from(["softmax_topk", "topk_softmax", "topk", "grouped"]))
    dtype = draw(st.sampled_from([np.float32, np.float16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if mode == "grouped":
        n_group = draw(st.sampled_from([1, 2, 4, 8]))
        per = draw(st.integers(2, 6))
        e = n_group * per
        topk_group = draw(st.integers(1, n_group))
        k = draw(st.integers(1, e))  # more than the kept groups hold: masked experts by lower index
        attrs = dict(k=k, normalize=int(draw(st.booleans())), mode=mode, scoring=draw(st.sampled_from(["sigmoid", "softmax"])),
                     n_group=n_group, topk_group=topk_group if n_group > 1 else 1,
                     scale=draw(st.sampled_from([1.0, 2.5, 16.0])), norm_eps=draw(st.sampled_from([0.0, 1e-20])),
                     norm_min=draw(st.sampled_from([0.0, 0.5])))
        bias = (rng.standard_normal(e) * 0.2).astype(np.float32)
    else:
        e = draw(st.integers(2, 40))
        attrs = dict(k=draw(st.integers(1, e)), normalize=int(draw(st.booleans())), mode=mode)
        bias = None
    t = draw(st.integers(1, 9))
    # scores at least 0.25 apart in each row: no ties that rounding could reorder; the plain top-k renormalizes
    # the values themselves, which the graphs it comes from (TopK of probabilities) keep positive
    shift = 0.25 if mode == "topk" else -2.0
    logits = (0.25 * rng.permuted(np.broadcast_to(np.arange(e, dtype=np.float64), (t, e)), axis=-1) + shift).astype(dtype)
    return attrs, logits, bias


@settings(max_examples=100, **_SETTINGS)
@given(sample=router_samples())
def test_router_ort_lowering_equals_the_reference(sample):
    attrs, logits, bias = sample
    ins = [logits] + ([bias] if bias is not None else [])
    w, i = MoERouterTopK().reference(attrs, *ins)
    if attrs["mode"] == "topk":
        w = w.astype(logits.dtype)  # the plain top-k returns the values themselves
    node = helper.make_node("MoERouterTopK", [f"in{j}" for j in range(len(ins))], ["w", "i"], domain=DOMAIN, **attrs)
    g = helper.make_graph([node], "router", [helper.make_tensor_value_info(f"in{j}", helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)) for j, a in enumerate(ins)],
                          [helper.make_tensor_value_info("w", helper.np_dtype_to_tensor_dtype(w.dtype), list(w.shape)),
                           helper.make_tensor_value_info("i", TP.INT64, list(i.shape))])
    graph = onnx_io.load(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)]))
    lower_abstract_ops(graph, {"MoERouterTopK": MoERouterTopK().lower_ort})
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(onnx_io.to_model(graph).SerializeToString(), so, providers=["CPUExecutionProvider"])
    got_w, got_i = sess.run(["w", "i"], {f"in{j}": a for j, a in enumerate(ins)})
    np.testing.assert_array_equal(got_i, i)
    tol = 1e-6 if w.dtype == np.float32 else 1e-3
    assert np.abs(got_w.astype(np.float64) - w.astype(np.float64)).max() <= tol * max(1.0, float(np.abs(w).max()))


# ------------------------------------------------------------------ FusedMoE
def _moe_model(attrs: dict, hidden: np.ndarray, scores: np.ndarray, weights: list[np.ndarray | None]) -> onnx.ModelProto:
    """One FusedMoE over graph inputs ``hidden`` [T, H] and ``scores`` [T, E], its expert tensors initializers
    (absent optional ones ""). ``mode="routed"``: the graph computes the mixing weights and experts itself,
    ``TopK(Softmax(scores), k)``, as a model's own router does."""
    dt = helper.np_dtype_to_tensor_dtype(hidden.dtype)
    names = ["fc1", "fc2", "s1", "z1", "s2", "z2", "ids", "b1", "b2"]
    inits = [numpy_helper.from_array(w, n) for n, w in zip(names, weights) if w is not None and n != "ids"]
    ins = ["hidden", "scores"] + [n if w is not None else "" for n, w in zip(names, weights)]
    nodes = []
    if attrs["mode"] == "routed":
        inits.append(numpy_helper.from_array(np.array([attrs["k"]], np.int64), "k"))
        nodes += [helper.make_node("Softmax", ["scores"], ["p"], axis=-1, name="softmax"),
                  helper.make_node("TopK", ["p", "k"], ["w", "ids"], axis=-1, name="topk")]
        ins[1], ins[8] = "w", "ids"
    while ins and not ins[-1]:
        ins.pop()
    nodes.append(helper.make_node("FusedMoE", ins, ["y"], domain=DOMAIN, name="moe", **attrs))
    t, h = hidden.shape
    g = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("hidden", dt, ["T", h]),
                                                helper.make_tensor_value_info("scores", dt, ["T", scores.shape[1]])],
                          [helper.make_tensor_value_info("y", dt, ["T", h])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])


@st.composite
def moe_samples(draw, iree: bool = False):
    """(attrs, hidden, scores, weights in contract order from fc1): float or block-wise INT4 experts with and
    without zero points (absent: 8), partial last blocks, every mode, renormalized or not, biases, gpt-oss's
    clamped SwiGLU, T = 0 (an empty batch) to 5 tokens. ``iree``: only what the IREE kernels take (INT4, both
    biases or neither)."""
    from rewrite.plugins.moe.lowering import pack_int4

    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    dtype = draw(st.sampled_from([np.float32, np.float16]))
    e = draw(st.integers(2, 6))
    k = draw(st.integers(1, min(e, 4)))
    h, i = draw(st.sampled_from([16, 24, 32, 64])), draw(st.sampled_from([8, 16, 40, 64]))
    t = draw(st.sampled_from([0, 1, 2, 5]))
    mode = draw(st.sampled_from(["softmax_topk", "topk_softmax", "routed"]))
    attrs = dict(k=k, normalize=int(draw(st.booleans())), mode=mode, activation="swiglu")
    if draw(st.booleans()):
        attrs.update(activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)  # gpt-oss
    quant = True if iree else draw(st.booleans())
    if quant:
        bs = draw(st.sampled_from([16, 32, 64]))
        attrs["block_size"] = bs
        zp = draw(st.booleans())
        fc1 = pack_int4(rng.integers(0, 16, (e, 2 * i, h)))
        fc2 = pack_int4(rng.integers(0, 16, (e, h, i)))
        s1 = (rng.uniform(0.5, 1.5, (e, 2 * i, -(-h // bs))) * 0.05).astype(dtype)
        s2 = (rng.uniform(0.5, 1.5, (e, h, -(-i // bs))) * 0.05).astype(dtype)
        z1 = rng.integers(0, 16, s1.shape).astype(np.uint8) if zp else None
        z2 = rng.integers(0, 16, s2.shape).astype(np.uint8) if zp else None
    else:
        fc1 = (rng.standard_normal((e, 2 * i, h)) * 0.2).astype(dtype)
        fc2 = (rng.standard_normal((e, h, i)) * 0.2).astype(dtype)
        s1 = z1 = s2 = z2 = None
    bias = draw(st.sampled_from(["none", "both"] if iree else ["none", "both", "fc1", "fc2"]))
    b1 = (rng.standard_normal((e, 2 * i)) * 0.1).astype(dtype) if bias in ("both", "fc1") else None
    b2 = (rng.standard_normal((e, h)) * 0.1).astype(dtype) if bias in ("both", "fc2") else None
    hidden = rng.standard_normal((t, h)).astype(dtype)
    # scores at least 0.25 apart in each row: no ties that rounding could reorder
    scores = (0.25 * rng.permuted(np.broadcast_to(np.arange(e, dtype=np.float64), (t, e)), axis=-1) - 0.5).astype(dtype)
    return attrs, hidden, scores, [fc1, fc2, s1, z1, s2, z2, None, b1, b2]


def _moe_reference(attrs: dict, hidden, scores, weights) -> np.ndarray:
    from rewrite.plugins.moe.lowering import FusedMoE

    logits, ids = scores, None
    if attrs["mode"] == "routed":
        z = scores.astype(np.float32)
        p = np.exp(z - z.max(-1, keepdims=True))
        p = (p / p.sum(-1, keepdims=True)).astype(scores.dtype)
        ids = np.argsort(-p.astype(np.float32), axis=-1, kind="stable")[:, :attrs["k"]].astype(np.int64)
        logits = np.take_along_axis(p, ids, -1)
    w = list(weights)
    w[6] = ids
    return FusedMoE().reference(attrs, hidden, logits, *w)[0]


def _check_moe(sample, backend: str, workdir) -> None:
    from rewrite.plugins.moe.lowering import FusedMoE
    from rewrite.testing.conformance import lower_graph

    attrs, hidden, scores, weights = sample
    want = _moe_reference(attrs, hidden, scores, weights)
    folder = lower_graph(onnx_io.load(_moe_model(attrs, hidden, scores, weights)), backend, workdir / backend, [FusedMoE()])
    got = load_runner(folder).run({"hidden": hidden, "scores": scores})["y"]
    assert got.shape == want.shape and got.dtype == hidden.dtype
    tol = 1e-5 if hidden.dtype == np.float32 else 1e-2
    if want.size:
        assert np.abs(got.astype(np.float64) - want.astype(np.float64)).max() <= tol * max(1.0, float(np.abs(want).max()))


@settings(max_examples=150, **_SETTINGS)
@given(sample=moe_samples())
def test_fused_moe_on_ort_equals_the_reference(tmp_path_factory, sample):
    _check_moe(sample, "ort", tmp_path_factory.mktemp("moe"))


@pytest.mark.slow
@settings(max_examples=6, **_SETTINGS)
@given(sample=moe_samples(iree=True))
def test_fused_moe_on_iree_equals_the_reference(tmp_path_factory, sample):
    _check_moe(sample, "iree", tmp_path_factory.mktemp("moe_iree"))


# ------------------------------------------------------------------ KVCacheUpdate
@st.composite
def kv_samples(draw):
    """(attrs, past, update, position): any axis of a rank-3 or rank-4 cache, a batch of 1 to 3, 0 (empty) to S
    rows written at any position that fits, given as it is or negative (from the end), shape [1] or []."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    rank = draw(st.sampled_from([3, 4]))
    shape = [draw(st.integers(1, 3))] + [draw(st.integers(1, 6)) for _ in range(rank - 1)]
    axis = draw(st.integers(1, rank - 1))
    s = shape[axis]
    n = draw(st.integers(0, s))
    p = draw(st.integers(0, s - n))
    if draw(st.booleans()) and p > 0:
        p -= s  # the same row counted from the end
    dtype = draw(st.sampled_from([np.float32, np.float16]))
    upd = list(shape)
    upd[axis] = n
    pos = np.array([p] if draw(st.booleans()) else p, np.int64)
    return {"axis": axis if draw(st.booleans()) else axis - rank}, rng.standard_normal(shape).astype(dtype), \
        rng.standard_normal(upd).astype(dtype), pos


def _check_kv(sample, backend: str, workdir) -> None:
    from rewrite.plugins.kv_cache import KVCacheUpdate
    from rewrite.testing.conformance import single_op_model, lower_graph

    attrs, *inputs = sample
    op = KVCacheUpdate()
    want = op.reference(attrs, *inputs)[0]
    folder = lower_graph(onnx_io.load(single_op_model(op, attrs, inputs, [want])), backend, workdir / backend, [op])
    got = load_runner(folder).run({f"in{i}": x for i, x in enumerate(inputs)})["out0"]
    np.testing.assert_array_equal(got, want)  # data movement only: bit-exact


@settings(max_examples=60, **_SETTINGS)
@given(sample=kv_samples())
def test_kv_cache_update_on_ort_equals_the_reference(tmp_path_factory, sample):
    _check_kv(sample, "ort", tmp_path_factory.mktemp("kv"))


@pytest.mark.slow
@settings(max_examples=6, **_SETTINGS)
@given(sample=kv_samples())
def test_kv_cache_update_on_iree_equals_the_reference(tmp_path_factory, sample):
    _check_kv(sample, "iree", tmp_path_factory.mktemp("kv_iree"))


@pytest.mark.slow
@pytest.mark.parametrize("what", ["moe", "kv"])
def test_empty_batches_on_iree_equal_the_reference(tmp_path, what):
    """The first draw with no tokens (FusedMoE) or no rows written (KVCacheUpdate): zero workgroups, empty
    tensors."""
    from hypothesis import find

    quiet = settings(database=None, derandomize=True)
    if what == "moe":
        _check_moe(find(moe_samples(iree=True), lambda s: s[1].shape[0] == 0, settings=quiet), "iree", tmp_path)
    else:
        _check_kv(find(kv_samples(), lambda s: s[2].size == 0, settings=quiet), "iree", tmp_path)


# ------------------------------------------------------------------ FusedMoE for the CUDA execution provider
def _int4_sample(mode: str, h: int, i: int, bs: int, zp: bool, dtype=np.float16, e: int = 8, k: int = 2, t: int = 3):
    from rewrite.plugins.moe.lowering import pack_int4

    rng = np.random.default_rng(h + i + bs)
    attrs = dict(k=k, normalize=1, mode=mode, activation="swiglu", block_size=bs)
    fc1, fc2 = pack_int4(rng.integers(0, 16, (e, 2 * i, h))), pack_int4(rng.integers(0, 16, (e, h, i)))
    s1 = (rng.uniform(0.5, 1.5, (e, 2 * i, -(-h // bs))) * 0.02).astype(dtype)
    s2 = (rng.uniform(0.5, 1.5, (e, h, -(-i // bs))) * 0.02).astype(dtype)
    z1 = rng.integers(0, 16, s1.shape).astype(np.uint8) if zp else None
    z2 = rng.integers(0, 16, s2.shape).astype(np.uint8) if zp else None
    hidden = rng.standard_normal((t, h)).astype(dtype)
    scores = (0.25 * rng.permuted(np.broadcast_to(np.arange(e, dtype=np.float64), (t, e)), axis=-1) - 0.5).astype(dtype)
    return attrs, hidden, scores, [fc1, fc2, s1, z1, s2, z2, None, None, None]


@pytest.mark.parametrize("mode, h, i, bs, zp, dtype, op, block", [
    ("softmax_topk", 256, 128, 64, True, np.float16, "QMoE", 64),
    ("softmax_topk", 256, 128, 128, True, np.float16, "QMoE", 64),   # 1 block of 128 along I: split in two
    ("softmax_topk", 256, 128, 128, False, np.float16, "QMoE", 128),  # symmetric: one block is fine
    ("routed", 256, 128, 64, True, np.float16, "QMoE", 64),           # log(w) as router_probs, times sum(w)
    ("softmax_topk", 128, 64, 64, True, np.float16, "MoE", None),     # 1 block along I with zero points: float
    ("softmax_topk", 256, 192, 64, True, np.float16, "MoE", None),    # 3 blocks (odd) along I with zero points
    ("softmax_topk", 256, 384, 128, True, np.float16, "QMoE", 64),    # 3 blocks of 128 along I: 6 of 64
    ("softmax_topk", 256, 128, 64, True, np.float32, "MoE", None),    # QMoE has no float32 CUDA kernel
])
def test_fused_moe_cuda_lowering_takes_the_forms_the_cuda_kernels_compute_right(tmp_path, mode, h, i, bs, zp, dtype, op, block):
    """The ort:cuda lowering emits what onnxruntime-gpu 1.31 computes right on an H200 (examples/gpu_check.py
    measures it there): QMoE with weights_prepacked=0 and without router_weights, else dequantized MoE. The CPU
    execution provider computes the same forms, so their numbers are checked here against the reference."""
    from rewrite.plugins.moe.lowering import FusedMoE

    attrs, hidden, scores, weights = _int4_sample(mode, h, i, bs, zp, dtype)
    want = _moe_reference(attrs, hidden, scores, weights)
    g = onnx_io.load(_moe_model(attrs, hidden, scores, weights))
    FusedMoE().lower_ort_cuda(g, g.nodes_by_op("FusedMoE", DOMAIN)[0])
    m = onnx_io.to_model(g)
    (moe,) = [n for n in m.graph.node if n.op_type in ("QMoE", "MoE")]
    assert moe.op_type == op
    if op == "QMoE":
        got_attrs = {a.name: helper.get_attribute_value(a) for a in moe.attribute}
        assert got_attrs["weights_prepacked"] == 0 and got_attrs["block_size"] == block
        assert len(moe.input) <= 14  # no router_weights
    onnx.save(m, tmp_path / "m.onnx")
    got = OrtRunner(tmp_path / "m.onnx", optimize="basic").run({"hidden": hidden, "scores": scores})["y"]
    tol = 1e-5 if dtype == np.float32 else 1e-2
    assert np.abs(got.astype(np.float64) - want.astype(np.float64)).max() <= tol * max(1.0, float(np.abs(want).max()))


def test_cuda_qmoe_leaves_normalize_0_to_the_kernel():
    """Qwen1.5-MoE's normalize=0: the CPU lowering passes softmax(logits) as router_weights (ORT's CPU QMoE
    renormalizes otherwise); the CUDA kernel honours normalize_routing_weights=0 (measured on the H200 by
    examples/gpu_check.py, sample int4-asym-qwen15) and ignores router_weights, so none is made."""
    from rewrite.plugins.moe.lowering import FusedMoE

    attrs, hidden, scores, weights = _int4_sample("softmax_topk", 256, 128, 64, True)
    attrs["normalize"] = 0
    g = onnx_io.load(_moe_model(attrs, hidden, scores, weights))
    FusedMoE().lower_ort_cuda(g, g.nodes_by_op("FusedMoE", DOMAIN)[0])
    m = onnx_io.to_model(g)
    (q,) = [n for n in m.graph.node if n.op_type == "QMoE"]
    assert {a.name: helper.get_attribute_value(a) for a in q.attribute}["normalize_routing_weights"] == 0
    assert len(q.input) <= 14 and not [n for n in m.graph.node if n.op_type == "Softmax"]


def _cuda_device() -> bool:
    try:
        import iree.runtime as rt

        return bool(rt.get_driver("cuda").query_available_devices())
    except Exception:
        return False


@pytest.mark.parametrize("mode, dtype, sites, launches", [("softmax_topk", np.float16, None, None),
                                                         ("routed", np.float32, None, None),
                                                         ("softmax_topk", np.float16, 0, 1),
                                                         ("routed", np.float16, None, 1),
                                                         ("softmax_topk", np.float32, None, 1)])
def test_fused_moe_compiles_for_iree_cuda_with_the_plugins_kernels(tmp_path, monkeypatch, mode, dtype, sites, launches):
    """iree:cuda lowers FusedMoE to two extern dispatches of moe_cuda.cu (PTX carried in the folder), or with
    ``--opt moe.launches=1`` to one of moe_fused, unless past the kernel's counter slots (``sites`` 0 here); on
    a machine with a CUDA device the folder's outputs equal the reference at 1, 3 and 8 tokens."""
    from rewrite.plugins.moe import lowering

    if sites is not None:
        monkeypatch.setattr(lowering, "CUDA_SYNC_SLOTS", sites)
    attrs, hidden, scores, weights = _int4_sample(mode, 256, 128, 64, True, dtype)
    path = tmp_path / "m.onnx"
    onnx.save(_moe_model(attrs, hidden, scores, weights), path)
    m = apply(path, tmp_path / "out", backend="iree", target="cuda", plugins="moe" if launches else (),
              options={"moe": {"launches": launches}} if launches else None)
    kernels = sorted(p.name for p in (tmp_path / "out" / "kernels").iterdir())
    assert len(kernels) == 1 and kernels[0].startswith("moe_cuda") and kernels[0].endswith(".sm_80.ptx")
    mlir = (tmp_path / "out" / m.files["mlir"]).read_text()
    el = "f16" if dtype == np.float16 else "f32"
    two = (mlir.count(f"::@moe_gate_up_{el}["), mlir.count(f"::@moe_down_{el}["))
    assert (mlir.count(f"::@moe_fused_{el}["), two) == ((1, (0, 0)) if launches == 1 and sites != 0 else (0, (1, 1)))
    if not _cuda_device():
        return
    runner = load_runner(tmp_path / "out")
    for t in (1, 3, 8):
        a, x, s, w = _int4_sample(mode, 256, 128, 64, True, dtype, t=t)
        want = _moe_reference(a, x, s, w).astype(np.float64)
        got = runner.run({"hidden": x, "scores": s})["y"].astype(np.float64)
        assert np.abs(got - want).max() <= (1e-4 if dtype == np.float32 else 1e-2) * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize("mode, h, i, k, bs, options, pair, grids", [
    ("routed", 1024, 256, 2, 128, None, ("mma1", "mma2"), (32, 64)),    # k * I / 8 groups, 2 a workgroup; H / 16
    ("routed", 2048, 384, 8, 128, None, ("mma2", "mma4"), (192, 128)),  # k * I = 3072: down's 4 steps a warp
    ("routed", 1024, 256, 2, 128, {"tensor_cores": False}, ("", ""), (32, 128)),
    ("routed", 1024, 256, 2, 64, None, ("", ""), (32, 128)),             # blocks of 64
    ("softmax_topk", 1024, 256, 2, 128, None, ("mma1", "mma2"), (32, 64)),  # routing in gate_up's warp 0
    ("softmax_topk", 1536, 256, 2, 128, None, ("", ""), (32, 192)),     # H not 1024 S
])
def test_fused_moe_takes_the_tensor_core_pair_on_iree_cuda_where_it_applies(tmp_path, mode, h, i, k, bs, options, pair,
                                                                           grids):
    """iree:cuda lowers an f16 FusedMoE with INT4 blocks of 128 to ``moe_gate_up_mma<S>_f16`` on (T, k * I / 16)
    (``MMA_GATE_GROUPS`` = 2 groups of 8 rows a workgroup) and ``moe_down_mma<S>_f16`` on (T, H / 16) (``cuda_mma_steps``), and everything else, or ``moe.tensor_cores``
    false, to the other pair on (T, ceil(I / ceil(16 / k))) and (T, H / 8); with a CUDA device, the outputs equal
    the reference at 1, 3 and 8 tokens."""
    attrs, hidden, scores, weights = _int4_sample(mode, h, i, bs, True, k=k)
    path = tmp_path / "m.onnx"
    onnx.save(_moe_model(attrs, hidden, scores, weights), path)
    m = apply(path, tmp_path / "out", backend="iree", target="cuda", plugins="moe" if options else (),
              options={"moe": options} if options else None)
    mlir = (tmp_path / "out" / m.files["mlir"]).read_text()
    names = [f"moe_gate_up_{pair[0] + '_' if pair[0] else ''}f16", f"moe_down_{pair[1] + '_' if pair[1] else ''}f16"]
    assert mlir.count("::@moe_gate_up_") == mlir.count("::@moe_down_") == 1
    # the dispatches' workloads: (tokens, row blocks), the row blocks a constant iree-compile names %c<value>
    assert [tuple(int(g) for g in re.findall(rf"::@{n}\[%\w+, %c(\d+)(?:_\d+)?\]", mlir)) for n in names] == \
        [(grids[0],), (grids[1],)]
    if not _cuda_device():
        return
    runner = load_runner(tmp_path / "out")
    for t in (1, 3, 8):
        a, x, s, w = _int4_sample(mode, h, i, bs, True, k=k, t=t)
        want = _moe_reference(a, x, s, w).astype(np.float64)
        got = runner.run({"hidden": x, "scores": s})["y"].astype(np.float64)
        assert np.abs(got - want).max() <= 1e-2 * max(1.0, float(np.abs(want).max()))


def test_every_tensor_core_export_the_lowering_names_is_in_the_shipped_ptx():
    """The names ``lower_iree_cuda`` can give the tensor-core pair (``moe_gate_up_mma<S>_f16`` for S in
    MMA_GATE_STEPS, ``moe_down_mma<S>_f16`` and the one-token ``moe_down_mma<S>t1_f16`` for S in MMA_DOWN_STEPS)
    are entries of the PTX shipped for machines without nvcc: a missing one fails only at module load there."""
    from rewrite.plugins.moe.lowering import MMA_DOWN_STEPS, MMA_GATE_STEPS

    ptx = (Path(__file__).resolve().parents[1] / "rewrite/plugins/moe/kernels/moe_cuda.sm_80.ptx").read_text()
    entries = set(re.findall(r"\.entry (\w+)\(", ptx))
    names = {f"moe_gate_up_mma{s}_f16" for s in MMA_GATE_STEPS}
    names |= {f"moe_down_mma{s}{t1}_f16" for s in MMA_DOWN_STEPS for t1 in ("", "t1")}
    assert len(names) == 12 and names <= entries, sorted(names - entries)


@pytest.mark.parametrize("mode, i, k, down_s", [("routed", 384, 8, 4), ("softmax_topk", 384, 8, 4),
                                                ("routed", 768, 8, 6),     # Qwen3-30B-A3B's layer: S = 6
                                                ("routed", 256, 2, 2), ("routed", 1024, 8, 8)])
def test_a_one_token_graph_takes_downs_one_token_export(tmp_path, mode, i, k, down_s):
    """A FusedMoE whose hidden has a static token count of 1 (a decode graph) lowers down to
    ``moe_down_mma<S>t1_f16`` in an executable of its own name (``..._mma<S><S>t1``), gate_up unchanged; the same
    op with a symbolic token count keeps ``moe_down_mma<S>_f16``. With a CUDA device, the one-token module's output
    equals the reference."""
    attrs, hidden, scores, weights = _int4_sample(mode, 2048, i, 128, True, k=k, t=1)
    model = _moe_model(attrs, hidden, scores, weights)
    for v in (*model.graph.input, *model.graph.output):
        v.type.tensor_type.shape.dim[0].dim_value = 1
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    m = apply(path, tmp_path / "out", backend="iree", target="cuda")
    mlir = (tmp_path / "out" / m.files["mlir"]).read_text()
    counts = (mlir.count("::@moe_gate_up_mma2_f16["), mlir.count(f"::@moe_down_mma{down_s}t1_f16["),
              mlir.count(f"::@moe_down_mma{down_s}_f16["))
    assert counts == (1, 1, 0) and f"_mma2{down_s}t1::@moe_down_mma{down_s}t1_f16[" in mlir
    onnx.save(_moe_model(attrs, hidden, scores, weights), path)
    m2 = apply(path, tmp_path / "dyn", backend="iree", target="cuda")
    mlir2 = (tmp_path / "dyn" / m2.files["mlir"]).read_text()
    assert (mlir2.count(f"::@moe_down_mma{down_s}_f16["), mlir2.count("t1_f16")) == (1, 0)
    if not _cuda_device():
        return
    want = _moe_reference(attrs, hidden, scores, weights).astype(np.float64)
    got = load_runner(tmp_path / "out").run({"hidden": hidden, "scores": scores})["y"].astype(np.float64)
    assert np.abs(got - want).max() <= 1e-2 * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize("el, bs, h, i, k, steps", [
    ("f16", 128, 2048, 768, 8, (2, 6)),     # Qwen3-30B-A3B's layer
    ("f16", 128, 2048, 1408, 4, (2, 6)),    # Qwen1.5-MoE-A2.7B's (k * I = 5632)
    ("f16", 128, 4096, 1024, 8, (4, 8)),    # the largest steps: H = 4096, k * I = 8192
    ("f16", 128, 4096, 1152, 8, None),      # k * I = 9216: more than down's 8 steps a warp
    ("f16", 128, 5120, 128, 2, None),       # H = 1024 * 5
    ("f16", 128, 2880, 2880, 4, None),      # gpt-oss's H: not 1024 S
    ("f16", 128, 2048, 704, 4, None),       # I not a multiple of 128
    ("f16", 64, 2048, 768, 8, None),        # blocks of 64
    ("f16", 0, 2048, 768, 8, None),         # float experts
    ("f32", 128, 2048, 768, 8, None),
])
def test_the_tensor_core_pair_takes_the_shapes_its_exports_hold(el, bs, h, i, k, steps):
    """``cuda_mma_steps``: the (gate_up S, down S) of the exports moe_cuda.cu has (H = 1024 S for S in
    MMA_GATE_STEPS, the smallest down S in MMA_DOWN_STEPS with k * I <= 1024 S), None outside them."""
    from rewrite.plugins.moe.lowering import cuda_mma_steps

    assert cuda_mma_steps(el, bs, h, i, k) == steps


def test_the_tensor_core_down_takes_the_shared_expert_and_the_addend(tmp_path):
    """A FusedMoE with Qwen1.5-MoE's gated shared expert (inputs 12, 13) and the residual as addend (input 11) on a
    shape of the tensor-core pair: its down dispatch binds the shared expert, its gate and the addend (tied in
    place as the output); with a CUDA device, the outputs equal the reference at 1, 3 and 8 tokens."""
    from onnx import helper

    from rewrite.plugins.moe.lowering import FusedMoE

    def model(attrs, hidden, scores, weights):
        m = _moe_model(attrs, hidden, scores, weights)
        node = m.graph.node[-1]
        del node.input[len(node.input):]
        node.input.extend([""] * (11 - len(node.input)) + ["res", "sh", "sg"])
        dt, h = helper.np_dtype_to_tensor_dtype(hidden.dtype), hidden.shape[1]
        m.graph.input.extend([helper.make_tensor_value_info("res", dt, ["T", h]),
                              helper.make_tensor_value_info("sh", dt, ["T", h]),
                              helper.make_tensor_value_info("sg", dt, ["T", 1])])
        return m

    attrs, hidden, scores, weights = _int4_sample("softmax_topk", 1024, 256, 128, True, k=2)
    path = tmp_path / "m.onnx"
    onnx.save(model(attrs, hidden, scores, weights), path)
    m = apply(path, tmp_path / "out", backend="iree", target="cuda")
    mlir = (tmp_path / "out" / m.files["mlir"]).read_text()
    (down,) = [line for line in mlir.splitlines() if "::@moe_down_mma2_f16[" in line]
    assert mlir.count("::@moe_gate_up_mma1_f16[") == 1 and "_sh_mma12::" in down  # the executable with the shared expert
    assert re.search(r"\) -> %\w+\{", down)  # its output is an operand (the addend), tied in place
    if not _cuda_device():
        return
    runner = load_runner(tmp_path / "out")
    rng = np.random.default_rng(1)
    for t in (1, 3, 8):
        a, x, sc, w = _int4_sample("softmax_topk", 1024, 256, 128, True, k=2, t=t)
        res, sh = (rng.standard_normal((t, 1024)).astype(np.float16) for _ in range(2))
        sg = rng.standard_normal((t, 1)).astype(np.float16)
        want = FusedMoE().reference(a, x, sc, *w, res, sh, sg)[0].astype(np.float64)
        got = runner.run({"hidden": x, "scores": sc, "res": res, "sh": sh, "sg": sg})["y"].astype(np.float64)
        assert np.abs(got - want).max() <= 1e-2 * max(1.0, float(np.abs(want).max()))


def test_one_launch_keeps_moe_fused_where_the_tensor_core_pair_would_apply(tmp_path):
    """``moe.launches=1`` takes moe_fused (the other pair's arithmetic in one launch) on a shape the tensor-core
    pair takes by default."""
    attrs, hidden, scores, weights = _int4_sample("softmax_topk", 1024, 256, 128, True, k=2)
    path = tmp_path / "m.onnx"
    onnx.save(_moe_model(attrs, hidden, scores, weights), path)
    m = apply(path, tmp_path / "out", backend="iree", target="cuda", plugins="moe", options={"moe": {"launches": 1}})
    mlir = (tmp_path / "out" / m.files["mlir"]).read_text()
    assert mlir.count("::@moe_fused_f16[") == 1 and "_mma" not in mlir


@pytest.mark.parametrize("opts, message", [({"launches": 3}, "moe: option launches=3; 1 or 2 expected"),
                                           ({"launches": True}, "moe: option launches=True; 1 or 2 expected"),
                                           ({"lanches": 2}, "moe: unknown option 'lanches'; options: residual, shared, launches, tensor_cores"),
                                           ({"tensor_cores": 1}, "moe: option tensor_cores=1; true or false expected")])
def test_the_moe_plugins_options_are_checked(tmp_path, opts, message):
    from rewrite.errors import RewriteError

    path = tmp_path / "m.onnx"
    onnx.save(_moe_model(*_int4_sample("softmax_topk", 256, 128, 64, True)), path)
    with pytest.raises(RewriteError, match=re.escape(message)):
        apply(path, tmp_path / "out", plugins="moe", backend="iree", target="cuda", options={"moe": opts})


@pytest.mark.parametrize("mode", ["softmax_topk", "routed"])
def test_symmetric_int4_fused_moe_on_iree_equals_the_reference(tmp_path, mode):
    """INT4 experts without zero points (8, ORT QMoE's symmetric convention) lower for IREE too."""
    _check_moe(_int4_sample(mode, 64, 32, 32, False, np.float32), "iree", tmp_path)


def test_fused_moe_shapes_the_cuda_kernels_do_not_take_are_refused_with_the_reason(tmp_path):
    from rewrite.errors import RewriteError

    attrs, hidden, scores, weights = _int4_sample("softmax_topk", 252, 128, 36, True)  # H, block not multiples of 8
    path = tmp_path / "m.onnx"
    onnx.save(_moe_model(attrs, hidden, scores, weights), path)
    with pytest.raises(RewriteError, match=r"FusedMoE on cuda: H=252, I=128, E=8, block_size=36; the kernels take"):
        apply(path, tmp_path / "out", backend="iree", target="cuda")


def test_the_kernels_and_their_lowering_agree_on_the_grid_constants():
    """The workgroup shapes the lowerings dispatch are the ones the kernel sources compute with."""
    import re
    from pathlib import Path

    from rewrite.plugins.moe import lowering

    kernels = Path(lowering.__file__).parent / "kernels"

    def defines(name: str) -> dict[str, int]:
        return {k: int(v) for k, v in re.findall(r"^#define (\w+) (\d+)", (kernels / name).read_text(), re.M)}

    cpu, cuda = defines("moe_cpu.c"), defines("moe_cuda.cu")
    assert cpu["ROWS"] == lowering.ROWS_PER_WORKGROUP
    assert (cuda["THREADS"], cuda["MAX_E"]) == (lowering.CUDA_THREADS, lowering.CUDA_MAX_E)
    assert cuda["SYNC_SLOTS"] == lowering.CUDA_SYNC_SLOTS
