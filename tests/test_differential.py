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
  groups hold (ties among masked experts broken by the lower index), float16 and float32 logits.
"""

from __future__ import annotations

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
from rewrite.plugins.router_op import MoERouterTopK

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
    # scores at least 0.25 apart in each row: no ties that rounding could reorder
    logits = (0.25 * rng.permuted(np.broadcast_to(np.arange(e, dtype=np.float64), (t, e)), axis=-1) - 2.0).astype(dtype)
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
    lower_abstract_ops(graph, {"MoERouterTopK": MoERouterTopK()})
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(onnx_io.to_model(graph).SerializeToString(), so, providers=["CPUExecutionProvider"])
    got_w, got_i = sess.run(["w", "i"], {f"in{j}": a for j, a in enumerate(ins)})
    np.testing.assert_array_equal(got_i, i)
    tol = 1e-6 if w.dtype == np.float32 else 1e-3
    assert np.abs(got_w.astype(np.float64) - w.astype(np.float64)).max() <= tol * max(1.0, float(np.abs(w).max()))
