"""The ``topk`` router plugin: matching and refusals, the C kernel's arithmetic (expf, f16 conversions), the
kernel on IREE against the numpy reference, lowering errors (the declared cases go through the conformance kit
in tests/test_conformance.py, with every built-in plugin's), and the tiny Qwen3-MoE export (renormalized router) decoding on
IREE like the original on ORT. (The Qwen1.5-MoE export and the seed form on IREE: tests/test_end_to_end.py.)

Tolerances: indices exactly equal everywhere; float32 weights within 1e-6 relative of the reference (one
rounding each), float16 weights within one float16 ulp; model logits relative error (max|d|/max|ref|) < 1e-4.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import qwen_moe
from rewrite.backends import load_runner
from rewrite.core.iree_lowering import PatchContext, TorchOperator, VTensor
from rewrite.backends.ort import OrtRunner, lower_abstract_ops
from rewrite.core import onnx_io
from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.driver import run_plugin
from rewrite.core.kernels import build_cpu_object, kernel_source
from rewrite.core.shapes import infer_shapes
from rewrite.errors import BackendError
from rewrite.pipeline import apply
from rewrite.plugins.router import RouterTopK, _router_model
from rewrite.plugins.router import op
from rewrite.plugins.router.op import _KERNEL_FLAGS, MoERouterTopK, router_topk_reference
from rewrite.verify import verify

PLUGIN = RouterTopK()


# ------------------------------------------------------------------------------- kernel arithmetic (ctypes)
@pytest.fixture(scope="module")
def kernel_lib(tmp_path_factory):
    """The kernel object exactly as IREE links it, wrapped into a shared library for ctypes."""
    obj = build_cpu_object(kernel_source(op.__file__, "router_topk.c"), extra_flags=_KERNEL_FLAGS)
    undefined = subprocess.run(["nm", "-u", str(obj)], capture_output=True, text=True, check=True).stdout.split()
    assert undefined == []  # nothing from libc/libm: IREE's embedded ELF loader has none
    so = tmp_path_factory.mktemp("k") / "router_topk.so"
    subprocess.run(["gcc", "-shared", "-nostdlib", str(obj), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    lib.rewrite_router_expf.restype, lib.rewrite_router_expf.argtypes = ctypes.c_float, [ctypes.c_float]
    lib.rewrite_router_f16_to_f32.restype, lib.rewrite_router_f16_to_f32.argtypes = ctypes.c_float, [ctypes.c_uint16]
    lib.rewrite_router_f32_to_f16.restype, lib.rewrite_router_f32_to_f16.argtypes = ctypes.c_uint16, [ctypes.c_float]
    return lib


def test_expf_is_within_one_rounding_of_exact(kernel_lib):
    rng = np.random.default_rng(1)
    x = np.concatenate([np.linspace(-87.3, 88.7, 6001), rng.uniform(-20, 5, 4000), [0.0, -0.0, 1e-30, -1e-30]]).astype(np.float32)
    got = np.array([kernel_lib.rewrite_router_expf(float(v)) for v in x], np.float32)
    exact = np.exp(x.astype(np.float64))
    rel = np.abs(got.astype(np.float64) - exact) / exact
    assert rel.max() < 6.0e-8  # float32 rounding is at most 2^-24 = 5.96e-8 relative
    # underflow to subnormals and 0 follows the exact value's rounding, overflow gives inf
    tails = np.array([-95.0, -103.0, -104.5, -200.0, -np.inf, 88.8, np.inf], np.float32)
    got_t = np.array([kernel_lib.rewrite_router_expf(float(v)) for v in tails], np.float32)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got_t, np.exp(tails.astype(np.float64)).astype(np.float32))


def test_f16_conversions_are_bit_exact(kernel_lib):
    h = np.arange(1 << 16, dtype=np.uint16)
    ref = h.view(np.float16).astype(np.float32)
    got = np.array([kernel_lib.rewrite_router_f16_to_f32(int(v)) for v in h], np.float32)
    same = (got.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(got) & np.isnan(ref))
    assert same.all()
    rng = np.random.default_rng(2)
    finite = ref[np.isfinite(ref)].astype(np.float64)
    finite.sort()
    mids = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)  # exact ties: round half to even
    f = np.concatenate([rng.integers(0, 1 << 32, 60000, dtype=np.uint64).astype(np.uint32).view(np.float32), ref, mids,
                        np.float32([65504, 65519.99, 65520, 1e9, 2.0**-25, 2.0**-25 * 1.0001, 2.0**-24])])
    got_h = np.array([kernel_lib.rewrite_router_f32_to_f16(float(v)) for v in f], np.uint16)
    with np.errstate(all="ignore"):
        ref_h = f.astype(np.float16).view(np.uint16)
    assert ((got_h == ref_h) | np.isnan(f)).all()


# ------------------------------------------------------------------------------- kernel on IREE vs reference
E_VALUES, K_VALUES, T_VALUES = (8, 16, 60, 128), (1, 2, 4, 8), (1, 3, 63, 64, 65, 130)
CONFIGS = [(e, k, mode, norm) for e in E_VALUES for k in K_VALUES for mode in ("softmax_topk", "topk_softmax") for norm in (0, 1)]


#: the (x, w) dtypes of the grid, by test id
DTYPE_PAIRS = {"f32-f32": (TensorProto.FLOAT, TensorProto.FLOAT), "f16-f32": (TensorProto.FLOAT16, TensorProto.FLOAT),
               "f16-f16": (TensorProto.FLOAT16, TensorProto.FLOAT16), "f32-f16": (TensorProto.FLOAT, TensorProto.FLOAT16)}


def router_grid_model(pairs: dict[str, tuple[int, int]]) -> onnx.ModelProto:
    """For each (x, w) dtype pair of ``pairs`` (id -> pair): one MoERouterTopK node per (E, k, mode, normalize) of
    CONFIGS; input x_<id>_E [T, E], outputs w_/i_<id>_<config> (``-`` in an id is ``_`` in the names)."""
    nodes, inputs, outputs = [], [], []
    for pid, (x_dt, w_dt) in pairs.items():
        p = pid.replace("-", "_")
        for e, k, mode, norm in CONFIGS:
            tag = f"{p}_{e}_{k}_{mode}_{norm}"
            nodes.append(helper.make_node(MoERouterTopK.op_type, [f"x_{p}_{e}"], [f"w_{tag}", f"i_{tag}"], domain=DOMAIN,
                                          name=f"router_{tag}", k=k, normalize=norm, mode=mode))
            outputs += [helper.make_tensor_value_info(f"w_{tag}", w_dt, ["T", k]), helper.make_tensor_value_info(f"i_{tag}", TensorProto.INT64, ["T", k])]
        inputs += [helper.make_tensor_value_info(f"x_{p}_{e}", x_dt, ["T", e]) for e in E_VALUES]
    g = helper.make_graph(nodes, "main_graph", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])


def _np(dt: int):
    return np.float16 if dt == TensorProto.FLOAT16 else np.float32


@pytest.fixture(scope="module")
def router_grid(tmp_path_factory):
    """The grids of every dtype pair as one model lowered for IREE llvm-cpu (one compile for the four tests):
    (manifest, MLIR text, runner)."""
    folder = tmp_path_factory.mktemp("router_grid")
    onnx.save(router_grid_model(DTYPE_PAIRS), folder / "grid.onnx")
    m = apply(folder / "grid.onnx", folder / "iree", backend="iree")
    return m, (folder / "iree" / "model.mlir").read_text(), load_runner(folder / "iree")


@pytest.mark.parametrize("pair", list(DTYPE_PAIRS))
def test_kernel_on_iree_equals_reference(router_grid, pair):
    m, mlir, runner = router_grid
    x_dt, w_dt = DTYPE_PAIRS[pair]
    np_x, np_w = _np(x_dt), _np(w_dt)
    entry = "router_topk_" + "_".join("f16" if dt == TensorProto.FLOAT16 else "f32" for dt in (x_dt, w_dt))
    assert mlir.count(f"flow.dispatch @{entry}_exec::@{entry}[") == len(CONFIGS)
    assert mlir.count("flow.dispatch @router_topk_") == len(DTYPE_PAIRS) * len(CONFIGS)
    assert len(m.kernel_objects) == 1
    p = pair.replace("-", "_")
    rng = np.random.default_rng(x_dt * 10 + w_dt)
    for t in T_VALUES:
        # the other pairs' inputs: zeros (their outputs are their own tests')
        feeds = {f"x_{q.replace('-', '_')}_{e}": np.zeros((t, e), _np(dts[0])) for q, dts in DTYPE_PAIRS.items() for e in E_VALUES}
        mine = {e: (3 * rng.standard_normal((t, e))).astype(np_x) for e in E_VALUES}
        mine[8][0] = 0.5  # a row of equal logits: indices 0..k-1
        feeds.update({f"x_{p}_{e}": x for e, x in mine.items()})
        got = runner.run(feeds)
        for e, k, mode, norm in CONFIGS:
            tag = f"{e}_{k}_{mode}_{norm}"
            w, i = router_topk_reference(mine[e], k, norm, mode, np_w)
            np.testing.assert_array_equal(got[f"i_{p}_{tag}"], i, err_msg=f"T={t} {tag}")
            assert got[f"w_{p}_{tag}"].dtype == np_w
            rtol = 1e-6 if np_w == np.float32 else 1e-3
            np.testing.assert_allclose(got[f"w_{p}_{tag}"], w, rtol=rtol, atol=0, err_msg=f"T={t} {tag}")
        assert got[f"i_{p}_8_4_softmax_topk_0"][0].tolist() == [0, 1, 2, 3]


def test_reference_ties_and_order_match_onnx_runtime_topk(tmp_path):
    """ONNX TopK-11 puts the lower index first among equal values; ORT and the reference agree on it."""
    path = tmp_path / "m.onnx"
    onnx.save(_router_model("softmax_topk", e=8, k=4), path)
    x = np.array([[1, 3, 3, 0, 3, 2, 2, 3], [0] * 8, [5, 5, 1, 1, 5, 5, 9, 9]], np.float32)
    ort = OrtRunner(path).run({"logits": x})
    w, i = router_topk_reference(x, 4)
    np.testing.assert_array_equal(i, ort["indices"])
    assert i.tolist() == [[1, 2, 4, 7], [0, 1, 2, 3], [6, 7, 0, 1]]
    np.testing.assert_allclose(w, ort["weights"], rtol=1e-6)


@pytest.mark.parametrize("types,attrs,error", [
    ("[?,1100],f32", {"k": 2}, "static last dim of 1..1024"),
    ("[?,?],f32", {"k": 2}, "static last dim of 1..1024"),
    ("[?,8],bf16", {"k": 2}, "expected f16|f32"),
    ("[?,8],f32", {"k": 9}, "k=9, mode='softmax_topk'; expected 1 <= k <= 8"),
    ("[?,8],f32", {"k": 2, "mode": "sort"}, "mode='sort'"),
])
def test_iree_lowering_rejects_what_the_kernel_cannot_do(types, attrs, error):
    k = attrs["k"]
    op = TorchOperator("MoERouterTopK", "router", attrs, [VTensor.parse(f"!torch.vtensor<{types}>")],
                       [VTensor.parse(f"!torch.vtensor<[?,{k}],f32>"), VTensor.parse(f"!torch.vtensor<[?,{k}],si64>")])
    with pytest.raises(BackendError, match=re.escape(error) + ".*at node 'router'|" + "at node 'router'.*" + re.escape(error)):
        MoERouterTopK().lower_iree(op, PatchContext(folder=Path("."), target="llvm-cpu"))


def test_ort_lowering_rejects_an_unknown_mode_naming_the_node():
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MoERouterTopK", ["x"], ["w", "i"], domain=DOMAIN, name="r0", k=2, mode="sort")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 8])],
        [helper.make_tensor_value_info("w", TensorProto.FLOAT, ["T", 2]), helper.make_tensor_value_info("i", TensorProto.INT64, ["T", 2])]),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    g = onnx_io.load(model)
    with pytest.raises(BackendError, match="r0.*mode='sort'"):
        lower_abstract_ops(g, {MoERouterTopK.op_type: MoERouterTopK().lower_ort})


# ------------------------------------------------------------------------------- declared cases
def _case_ids(kind):
    return [c for c in PLUGIN.cases if c.kind == kind]


REFUSAL = {
    "topk-not-on-last-axis": "TopK over axis 0 of rank 2",
    "largest-0": "largest=0",
    "sorted-0": "sorted=0",
    "k-larger-than-experts": "k=[9] is not one value in 1..8",
    "too-many-experts-for-the-kernel": "1025 experts; the kernel handles at most 1024",
    "cast-to-integer": "Cast FLOAT->INT32 between Softmax and TopK",
    "sparsemixer-rounds-with-two-thresholds": "no sparsemixer reading reproduces the router (closest: threshold",
    "sparsemixer-argmax-last-index": "ArgMax keepdims=1 select_last_index=1; expected 1 and 0",
}


@pytest.mark.parametrize("case", _case_ids("negative"), ids=lambda c: c.name)
def test_negative_cases_are_refused_with_a_reason_and_untouched(case):
    g = onnx_io.load(case.build())
    infer_shapes(g)
    before = onnx_io.to_model(g).SerializeToString()
    rep = run_plugin(g, PLUGIN)
    assert rep.matches == 0
    reasons = [r for rr in rep.rules.values() for r in rr.refusals]
    assert any(REFUSAL[case.name] in r for r in reasons), reasons
    assert onnx_io.to_model(g).SerializeToString() == before


@pytest.mark.parametrize("case", _case_ids("positive"), ids=lambda c: c.name)
def test_positive_cases_become_one_op_and_lower_to_standard_onnx_for_ort(case):
    g = onnx_io.load(case.build())
    infer_shapes(g)
    before = [n.op_type for n in g.topo_nodes()]
    run_plugin(g, PLUGIN)
    ops = [n.op_type for n in g.topo_nodes()]
    if "topk-exact" in case.matches:  # only the (sorted) TopKs are replaced; ORT gets them back unchanged
        n = case.matches["topk-exact"]
        assert ops.count("MoERouterTopK") == n and ops.count("TopK") == before.count("TopK") - n
        assert len(ops) == len(before)
        if n == before.count("TopK"):  # every TopK replaced in place
            assert ops == [("MoERouterTopK" if o == "TopK" else o) for o in before]
        lower_abstract_ops(g, {MoERouterTopK.op_type: MoERouterTopK().lower_ort})
        assert sorted(n.op_type for n in g.topo_nodes()) == sorted(before)
        return
    if "grouped-router" in case.matches:  # the whole router is one op; ORT gets standard ONNX with as many TopKs
        assert ops == ["MoERouterTopK", "Identity", "Identity"]
        lower_abstract_ops(g, {MoERouterTopK.op_type: MoERouterTopK().lower_ort})
        lowered = [n.op_type for n in g.topo_nodes()]
        assert "MoERouterTopK" not in lowered and lowered.count("TopK") == before.count("TopK")
        assert lowered.count("Sigmoid") == before.count("Sigmoid") and lowered.count("Softmax") == before.count("Softmax")
        return
    if "sparsemixer-router" in case.matches:  # both rounds are one op; ORT gets them back as standard ONNX
        assert ops == ["MoERouterTopK"]
        lower_abstract_ops(g, {MoERouterTopK.op_type: MoERouterTopK().lower_ort})
        lowered = [n.op_type for n in g.topo_nodes()]
        assert (lowered.count("ArgMax"), lowered.count("Softmax"), lowered.count("Greater")) == (2, 2, 2)
        return
    assert ops.count("MoERouterTopK") == 1 and "TopK" not in ops and "Softmax" not in ops and "Cast" not in ops
    renorm = any(r.endswith("-renorm") for r in case.matches)  # ReduceSum and Div absorbed too
    assert len(ops) == len(before) - 1 - before.count("Cast") - 2 * renorm
    lower_abstract_ops(g, {MoERouterTopK.op_type: MoERouterTopK().lower_ort})
    lowered = [n.op_type for n in g.topo_nodes()]
    assert lowered.count("TopK") == 1 and lowered.count("Softmax") == 1 and lowered.count("Div") == before.count("Div")




# ------------------------------------------------------------------------------- real model: Qwen3-MoE


def test_qwen3_moe_renormalized_router_on_iree_decodes_like_ort(qwen3_moe_tiny, tmp_path):
    out = tmp_path / "iree"
    m = apply(qwen3_moe_tiny, out, plugins="cast,legalize,topk", backend="iree")
    report = {r["plugin"]: {x["rule"]: x["matches"] for x in r["rules"]} for r in m.report}
    assert report["topk"] == {"grouped-router": 0, "softmax-topk-renorm": 2, "softmax-topk": 0, "topk-softmax-renorm": 0,
                              "topk-softmax": 0, "topk-exact": 0, "sparsemixer-router": 0}
    ops = [n.op_type for n in onnx.load(out / "model.onnx").graph.node]
    assert ops.count("MoERouterTopK") == 2 and "TopK" not in ops and "Div" not in ops
    res = verify(qwen3_moe_tiny, out)
    assert all(c.ok for c in res), [(c.name, c.max_rel) for c in res if not c.ok]
    sig = qwen_moe.decode_signature(qwen3_moe_tiny)

    def decode(run):
        return qwen_moe.greedy_decode(run, sig.input_names, sig.output_names, [3, 141, 59, 26, 5], 4, sig.kv_shape_per_layer, sig.dtype)

    ref_tokens, ref_logits = decode(OrtRunner(qwen3_moe_tiny).run)
    tokens, logits = decode(load_runner(out).run)
    assert tokens == ref_tokens
    x = np.concatenate([np.ravel(v) for v in logits]).astype(np.float64)
    y = np.concatenate([np.ravel(v) for v in ref_logits]).astype(np.float64)
    assert np.abs(x - y).max() / np.abs(y).max() < 1e-4


@pytest.mark.parametrize("e, n_group, topk_group, k, tokens", [
    (4, 2, 1, 1, "T"), (8, 4, 3, 1, "T"), (16, 8, 6, 2, "T"),  # few groups dropped: most tokens route alike without them
    (12, 6, 3, 3, 1), (16, 4, 3, 4, 1), (16, 8, 4, 2, 1),  # an export fixed to one token
])
def test_grouped_router_reading_keeps_the_group_limit(e, n_group, topk_group, k, tokens):
    """Readings that ignore the group limit agree with the true one on most tokens; the check must still take
    the graph's own groups, so that the fused router routes every token as the original does."""
    from rewrite.plugins.router.grouped import grouped_router_model

    model = grouped_router_model(e=e, n_group=n_group, topk_group=topk_group, k=k, tokens=tokens)
    g = onnx_io.load(model)
    infer_shapes(g)
    rep = run_plugin(g, PLUGIN)
    assert rep.rule("grouped-router").matches == 1
    (op,) = [n for n in g.nodes.values() if n.op_type == "MoERouterTopK"]
    assert (op.attr("n_group"), op.attr("topk_group")) == (n_group, topk_group)
    lower_abstract_ops(g, {MoERouterTopK.op_type: MoERouterTopK().lower_ort})
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    original, fused = (ort.InferenceSession(mp.SerializeToString(), so, providers=["CPUExecutionProvider"])
                       for mp in (model, onnx_io.to_model(g)))
    x = (np.random.default_rng(7).standard_normal((2000, e)) * 3).astype(np.float32)
    batches = [x[i:i + 1] for i in range(len(x))] if isinstance(tokens, int) else [x]
    for xb in batches:
        want, got = (sess.run(["indices"], {"logits": xb})[0] for sess in (original, fused))
        np.testing.assert_array_equal(np.sort(want, -1), np.sort(got, -1))


def test_sparsemixer_reference_is_transformers_phimoe_router():
    """``mode="sparsemixer"`` is transformers' ``sparsemixer`` at inference (PhiMoE), ids exactly and weights
    within float32 rounding, on logits whose experts sit near the mask's threshold."""
    import torch
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    from rewrite.plugins.router.sparsemixer import check_logits

    x = check_logits(np.random.default_rng(3), 3000, 16, np.float32)
    for eps in (0.01, 0.1):
        want_w, want_i = sparsemixer(torch.from_numpy(x), jitter_eps=eps, training=False)
        w, i = router_topk_reference(x, 2, 0, "sparsemixer", np.float32, jitter_eps=eps)
        np.testing.assert_array_equal(i, want_i.numpy())
        np.testing.assert_allclose(w, want_w.numpy(), rtol=2e-6, atol=0)


@pytest.mark.parametrize("x_dt, w_dt", [(TensorProto.FLOAT, TensorProto.FLOAT), (TensorProto.FLOAT16, TensorProto.FLOAT16)],
                         ids=["f32-f32", "f16-f16"])
def test_sparsemixer_kernel_on_iree_and_lowering_on_ort_equal_reference(tmp_path, x_dt, w_dt):
    """The C kernel (IREE llvm-cpu) and the standard-ONNX lowering (ONNX Runtime) of mode=sparsemixer against the
    numpy reference on ragged token counts (around the 64-token workgroup) with experts near the threshold."""
    from rewrite.plugins.router.sparsemixer import check_logits

    node = helper.make_node(MoERouterTopK.op_type, ["x"], ["w", "i"], domain=DOMAIN, name="router", k=2, normalize=0,
                            mode="sparsemixer", jitter_eps=0.02)
    g = helper.make_graph([node], "main_graph", [helper.make_tensor_value_info("x", x_dt, ["T", 12])],
                          [helper.make_tensor_value_info("w", w_dt, ["T", 2]), helper.make_tensor_value_info("i", TensorProto.INT64, ["T", 2])])
    path = tmp_path / "sm.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)]), path)
    np_x, np_w = (np.float16 if d == TensorProto.FLOAT16 else np.float32 for d in (x_dt, w_dt))
    runners = {b: load_runner(tmp_path / b) for b in ("ort", "iree") if apply(path, tmp_path / b, backend=b)}
    rng = np.random.default_rng(5)
    for t in (1, 63, 65, 300):
        x = check_logits(rng, t, 12, np_x) if t >= 3 else (3 * rng.standard_normal((t, 12))).astype(np_x)
        w, i = router_topk_reference(x, 2, 0, "sparsemixer", np_w, jitter_eps=0.02)
        for backend, runner in runners.items():
            got = runner.run({"x": x})
            np.testing.assert_array_equal(got["i"], i, err_msg=f"{backend} T={t}")
            rtol = 1e-6 if np_w == np.float32 else 1e-3
            np.testing.assert_allclose(got["w"], w, rtol=rtol, atol=1e-7, err_msg=f"{backend} T={t}")


def _cuda_device() -> bool:
    try:
        import iree.runtime as rt

        return bool(rt.get_driver("cuda").query_available_devices())
    except Exception:
        return False


def _cuda_router_cases():
    from rewrite.plugins.router.grouped import grouped_router_model
    from rewrite.plugins.router.sparsemixer import sparsemixer_router_model

    return {
        "softmax_topk-renorm-f16": (lambda: _router_model("softmax_topk", e=60, k=4, renorm=True, dtype=TensorProto.FLOAT16), "topk_f16_f16"),
        "topk_softmax": (lambda: _router_model("topk_softmax", e=8, k=2), "topk_f32_f32"),
        "grouped-sigmoid": (lambda: grouped_router_model(), "grouped_f32_f32"),
        "grouped-clip": (lambda: grouped_router_model(normalize="clip", n_group=1, topk_group=1, scoring="softmax"), "grouped_f32_f32"),
        "sparsemixer": (lambda: sparsemixer_router_model(), "sparsemixer_f32_f32"),
        "sparsemixer-f16": (lambda: sparsemixer_router_model(dtype=TensorProto.FLOAT16, eps=0.1), "sparsemixer_f16_f16"),
    }


@pytest.mark.parametrize("case", list(_cuda_router_cases()))
def test_every_router_mode_compiles_for_iree_cuda_from_the_c_kernel(tmp_path, case):
    """iree:cuda lowers every mode to one dispatch of router_topk_cuda.cu (router_topk.c built with nvcc, or its
    shipped PTX); on a machine with a CUDA device the folder's ids equal the reference's and the weights are within
    1e-5 (float16: 1e-3) at 1, 7, 65 and 300 tokens, half of them with experts near each other."""
    build, entry = _cuda_router_cases()[case]
    path = tmp_path / "m.onnx"
    onnx.save(build(), path)
    m = apply(path, tmp_path / "out", plugins="topk", backend="iree", target="cuda")
    assert m.report[0]["rules"] and sum(r["matches"] for r in m.report[0]["rules"]) == 1
    kernels = sorted(p.name for p in (tmp_path / "out" / "kernels").iterdir())
    assert len(kernels) == 1 and kernels[0].startswith("router_topk_cuda-") and kernels[0].endswith(".sm_80.ptx")
    mlir = (tmp_path / "out" / m.files["mlir"]).read_text()
    assert mlir.count(f"::@router_{entry}[") == 1 and str(tmp_path) not in mlir
    if not _cuda_device():
        return
    runner = load_runner(tmp_path / "out")
    rg = onnx_io.load(tmp_path / "out" / "model.onnx")
    (node,) = rg.nodes_by_op("MoERouterTopK", DOMAIN)
    attrs = {a: node.attr(a) for a in node.attrs}
    bias = rg.const(node.inputs[1]) if len(node.inputs) > 1 else None
    xv = rg.values[node.inputs[0]]
    dtype, e = (np.float16 if xv.dtype == TensorProto.FLOAT16 else np.float32), xv.shape[-1]
    for t in (1, 7, 65, 300):
        rng = np.random.default_rng(t)
        x = op._near_max(rng, (t, e), dtype) if t % 2 else (rng.standard_normal((t, e)) * 2).astype(dtype)
        got = runner.run({"logits": x})
        w, i = MoERouterTopK().reference(attrs, x, bias)
        np.testing.assert_array_equal(got["indices"], i)
        tol = 1e-3 if got["weights"].dtype == np.float16 else 1e-5
        np.testing.assert_allclose(got["weights"].astype(np.float64), w.astype(np.float64), rtol=tol, atol=tol / 10)


def test_nan_ranks_first_as_onnx_runtime_ranks_it(tmp_path):
    """ONNX Runtime's TopK ranks NaN above every number, NaNs by index: a plain TopK the topk plugin rewrites
    gives the same indices and values on IREE (the C kernel), and so does the reference; in every mode a row of
    NaN scores picks experts 0..k-1, distinct."""
    g = helper.make_graph([helper.make_node("TopK", ["x", "k"], ["v", "i"], name="tk", axis=-1)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                          [helper.make_tensor_value_info("v", TensorProto.FLOAT, ["n", 4]),
                           helper.make_tensor_value_info("i", TensorProto.INT64, ["n", 4])],
                          [onnx.numpy_helper.from_array(np.array([4], np.int64), "k")])
    path = tmp_path / "topk.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), path)
    x = np.random.default_rng(3).standard_normal((4, 16)).astype(np.float32)
    x[0, 7] = np.nan
    x[1, [2, 9]] = np.nan
    x[2] = np.nan
    x[3, [0, 5]], x[3, 11] = np.inf, np.nan
    want = OrtRunner(path).run({"x": x})
    assert want["i"][:3].tolist() == [[7] + want["i"][0, 1:].tolist(), [2, 9] + want["i"][1, 2:].tolist(), [0, 1, 2, 3]]
    m = apply(path, tmp_path / "iree", backend="iree", plugins="topk,legalize")
    (topk,) = [r for r in m.report if r["plugin"] == "topk"]
    assert {r["rule"]: r["matches"] for r in topk["rules"]}["topk-exact"] == 1
    got = load_runner(tmp_path / "iree").run({"x": x})
    np.testing.assert_array_equal(got["i"], want["i"])
    np.testing.assert_array_equal(got["v"], want["v"])  # NaN equal to NaN, position by position
    for mode in ("softmax_topk", "topk_softmax", "topk"):
        _, idx = router_topk_reference(x, 4, 0, mode)
        assert idx[2].tolist() == [0, 1, 2, 3], mode
    np.testing.assert_array_equal(router_topk_reference(x, 4, 0, "topk")[1], want["i"])
