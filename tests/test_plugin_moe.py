"""The ``moe`` plugin: FusedMoE kernels vs the numpy reference, one rewrite per layer on the real exports and the
seed form, rewritten vs original outputs on ORT and IREE, refusals."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from rewrite.backends import load_runner
from rewrite.core.kernels import kernel_source
from rewrite.pipeline import apply
from rewrite.plugins.moe import lowering
from rewrite.plugins.moe.lowering import FusedMoE, pack_int4, route

FLAGS = {"f16": 1, "int4": 2, "normalize": 4, "topk_softmax": 8, "zero_points": 16, "routed": 32, "bias": 64}


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """rewrite/plugins/moe/kernels/moe_cpu.c as a shared library, to call each kernel directly."""
    so = tmp_path_factory.mktemp("moe_so") / "moe_cpu.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O3", "-march=x86-64-v2", str(kernel_source(lowering.__file__, "moe_cpu.c")), "-o", str(so)], check=True)
    return ctypes.CDLL(str(so))


def _random_case(rng, T, H, I, E, k, dtype, bs, zp=True):
    x = rng.standard_normal((T, H)).astype(dtype)
    logits = (rng.standard_normal((T, E)) * 2).astype(dtype)
    if bs:
        fc1, fc2 = (pack_int4(rng.integers(0, 16, s)) for s in ((E, 2 * I, H), (E, H, I)))
        s1 = (rng.random((E, 2 * I, -(-H // bs))) * 0.05).astype(dtype)
        s2 = (rng.random((E, H, -(-I // bs))) * 0.05).astype(dtype)
        z1 = rng.integers(0, 16, s1.shape).astype(np.uint8) if zp else None
        z2 = rng.integers(0, 16, s2.shape).astype(np.uint8) if zp else None
        return [x, logits, fc1, fc2, s1, z1, s2, z2]
    fc1 = (rng.standard_normal((E, 2 * I, H)) * 0.1).astype(dtype)
    fc2 = (rng.standard_normal((E, H, I)) * 0.1).astype(dtype)
    return [x, logits, fc1, fc2]


def _bits(v: float) -> int:
    return int(np.array(v, np.float32).view(np.uint32))


def _call_kernels(lib, args, k, bs, flags, ids=None, b1=None, b2=None, act=(1.0, 0.0, 0.0)):
    """Run moe_gate_up_swiglu over its (T*k, ceil(I/32)) grid, then moe_down_proj_reduce over (T, ceil(H/32));
    ``args[1]`` is [T, E] logits, or with ``ids`` [T, k] the routed weights."""
    x, logits, fc1, fc2, *q = args + [None] * (8 - len(args))
    s1, z1, s2, z2 = q
    T, H = x.shape
    E = fc1.shape[0]
    I = fc1.shape[1] // 2
    dummy = np.zeros(1, np.int64)
    p = lambda a: (a if a is not None else dummy).ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    scratch = np.zeros((T * k, I), np.float32)
    out = np.zeros((T, H), x.dtype)
    sz = ctypes.c_size_t
    scalars = [sz(H), sz(I), sz(E), sz(k), sz(bs), sz(flags)] + [sz(_bits(v)) for v in act]
    for pair in range(T * k):
        for blk in range(-(-I // 32)):
            lib.moe_gate_up_swiglu(p(x), sz(0), p(logits), sz(0), p(ids), sz(0), p(fc1), sz(0), p(s1), sz(0), p(z1), sz(0),
                                   p(b1), sz(0), p(scratch), sz(0), *scalars, sz(pair), sz(blk))
    for t in range(T):
        for blk in range(-(-H // 32)):
            lib.moe_down_proj_reduce(p(logits), sz(0), p(ids), sz(0), p(scratch), sz(0), p(fc2), sz(0), p(s2), sz(0), p(z2),
                                     sz(0), p(b2), sz(0), p(out), sz(0), *scalars, sz(t), sz(blk))
    return out


def _routed(rng, T, E, k, dtype):
    """Routed weights [T, k] > 0 and k distinct experts per token [T, k] int64."""
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64)
    return rng.uniform(0.05, 1.0, (T, k)).astype(dtype), ids


@pytest.mark.parametrize("T,E,k,H,I", [(1, 8, 1, 64, 48), (3, 60, 4, 96, 72), (17, 8, 8, 40, 24), (3, 60, 4, 256, 192)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("quant", ["float", "int4", "int4-symmetric"])
@pytest.mark.parametrize("routing", [(0, "softmax_topk"), (1, "softmax_topk"), (0, "topk_softmax")])
def test_kernels_match_reference(kernels, T, E, k, H, I, dtype, quant, routing):
    if quant != "float" and H % 2:
        pytest.skip("packed INT4 needs an even input width")
    bs = 128 if quant != "float" else 0  # H or I not a multiple of 128: a partial last block
    rng = np.random.default_rng(T * 1000 + E + H)
    args = _random_case(rng, T, H, I, E, k, dtype, bs, zp=quant == "int4")
    normalize, mode = routing
    flags = (FLAGS["f16"] if dtype == np.float16 else 0) | (FLAGS["int4"] if bs else 0) | (FLAGS["normalize"] if normalize else 0)
    flags |= (FLAGS["topk_softmax"] if mode == "topk_softmax" else 0) | (FLAGS["zero_points"] if quant == "int4" else 0)
    got = _call_kernels(kernels, [a for a in args], k, bs, flags)
    ref = FusedMoE().reference({"k": k, "normalize": normalize, "mode": mode, "block_size": bs}, *args)[0]
    tol = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=tol, atol=tol * np.abs(ref.astype(np.float32)).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("quant", ["float", "int4"])
@pytest.mark.parametrize("activation", [(1.0, 0.0, 0.0), (1.702, 1.0, 7.0)])
def test_routed_kernels_with_biases_match_reference(kernels, dtype, quant, activation):
    """mode routed (weights and experts given), expert biases and gpt-oss's clamped SwiGLU; activations large
    enough that the clamp is reached."""
    T, E, k, H, I = 5, 8, 3, 64, 40
    bs = 32 if quant == "int4" else 0
    rng = np.random.default_rng(7)
    args = _random_case(rng, T, H, I, E, k, dtype, bs)
    args[0] = (args[0].astype(np.float32) * 20).astype(dtype)
    w, ids = _routed(rng, T, E, k, dtype)
    args[1] = w
    b1 = rng.standard_normal((E, 2 * I)).astype(dtype)
    b2 = rng.standard_normal((E, H)).astype(dtype)
    flags = (FLAGS["f16"] if dtype == np.float16 else 0) | FLAGS["routed"] | FLAGS["bias"]
    flags |= (FLAGS["int4"] | FLAGS["zero_points"]) if bs else 0
    got = _call_kernels(kernels, args, k, bs, flags, ids, b1, b2, activation)
    attrs = {"k": k, "mode": "routed", "block_size": bs, "activation_alpha": activation[0],
             "activation_beta": activation[1], "swiglu_limit": activation[2]}
    padded = args + [None] * (8 - len(args))
    ref = FusedMoE().reference(attrs, *padded, ids, b1, b2)[0].astype(np.float32)
    if activation[2]:  # the clamp is exercised: without it the result differs
        unclamped = FusedMoE().reference({**attrs, "swiglu_limit": 0.0}, *padded, ids, b1, b2)[0].astype(np.float32)
        assert np.abs(unclamped - ref).max() > 1e-2 * np.abs(ref).max()
    tol = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(got.astype(np.float32), ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_route_topk_softmax_equals_normalized_softmax_topk():
    logits = np.random.default_rng(0).standard_normal((5, 60)).astype(np.float32)
    w1, i1 = route(logits, 4, 1, "softmax_topk")
    w2, i2 = route(logits, 4, 0, "topk_softmax")
    np.testing.assert_array_equal(i1, i2)
    z = np.take_along_axis(logits, i2, -1)
    np.testing.assert_allclose(w2, np.exp(z) / np.exp(z).sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(w1, w2, rtol=1e-6)


def _fused_model(path, args, k, normalize, bs, t_dim="T"):
    """A one-node FusedMoE model (weights as initializers) for the lowering tests; ``t_dim`` the token dim."""
    x, logits = args[:2]
    names = ["x", "logits"] + [n if a is not None else "" for n, a in zip(["fc1", "fc2", "s1", "z1", "s2", "z2"], args[2:])]
    dt = helper.np_dtype_to_tensor_dtype(x.dtype)
    node = helper.make_node("FusedMoE", names, ["y"], domain="ai.rewrite", k=k, normalize=normalize, mode="softmax_topk",
                            activation="swiglu", block_size=bs)
    inits = [numpy_helper.from_array(a, n) for n, a in zip(names[2:], args[2:]) if a is not None]
    g = helper.make_graph([node], "main_graph", [helper.make_tensor_value_info("x", dt, [t_dim, x.shape[1]]),
                                                 helper.make_tensor_value_info("logits", dt, [t_dim, logits.shape[1]])],
                          [helper.make_tensor_value_info("y", dt, [t_dim, x.shape[1]])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.rewrite", 1)]), path)
    return path


@pytest.mark.parametrize("quant,normalize", [("float", 0), ("int4", 0), ("int4", 1), ("int4-symmetric", 0)])
def test_ort_lowering_matches_reference(tmp_path, quant, normalize):
    bs = 128 if quant != "float" else 0
    args = _random_case(np.random.default_rng(1), 3, 256, 192, 8, 4, np.float32, bs, zp=quant == "int4")
    out = tmp_path / "ort"
    apply(_fused_model(tmp_path / "m.onnx", args, 4, normalize, bs), out, backend="ort")
    ops = [n.op_type for n in onnx.load(out / "model.onnx").graph.node]
    # I=192 is no multiple of the model's 128 block: QMoE runs 64-blocks sharing each scale
    # the Slice: the experts in reverse order for the CPU kernels' choice among equal probabilities
    assert ops == (["Slice", "MoE"] if not bs else (["Slice", "QMoE"] if normalize else ["Slice", "Softmax", "QMoE"]))
    got = load_runner(out).run({"x": args[0], "logits": args[1]})["y"]
    ref = FusedMoE().reference({"k": 4, "normalize": normalize, "block_size": bs}, *args)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("quant", ["float", "int4"])
def test_ort_lowering_takes_the_lower_expert_of_equal_router_logits(tmp_path, quant):
    """ONNX TopK (and the reference) take the lower index of equal values first; ORT's CPU MoE kernels the higher
    one, which the lowering's reversed expert order turns into the lower."""
    bs = 128 if quant != "float" else 0
    args = list(_random_case(np.random.default_rng(2), 3, 256, 192, 8, 4, np.float32, bs, zp=quant == "int4"))
    args[1] = np.tile(np.array([5, 4, 3, 1, 0, 1, -1, -2], np.float32), (3, 1))  # 4th place: experts 3 and 5 tie
    out = tmp_path / "ort"
    apply(_fused_model(tmp_path / "m.onnx", args, 4, 0, bs), out, backend="ort")
    got = load_runner(out).run({"x": args[0], "logits": args[1]})["y"]
    attrs = {"k": 4, "normalize": 0, "block_size": bs}
    ref = FusedMoE().reference(attrs, *args)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    other = list(args)  # expert 5 instead of 3: what the kernels' own order gives
    other[1] = args[1].copy()
    other[1][:, 3] -= 0.5
    assert np.abs(FusedMoE().reference(attrs, *other)[0] - ref).max() > 1e-2 * np.abs(ref).max()


@pytest.mark.parametrize("quant,dtype,t_dim", [("float", np.float16, "T"), ("int4", np.float32, 3), ("int4", np.float16, "T")])
def test_iree_lowering_matches_reference(tmp_path, quant, dtype, t_dim):
    bs = 128 if quant != "float" else 0
    args = _random_case(np.random.default_rng(4), 3, 256, 192, 60, 4, dtype, bs)
    out = tmp_path / "iree"
    man = apply(_fused_model(tmp_path / "m.onnx", args, 4, 0, bs, t_dim), out, backend="iree")
    assert len(man.kernel_objects) == 1 and "moe_cpu" in man.kernel_objects[0]
    mlir = (out / "model.mlir").read_text()
    assert mlir.count("flow.dispatch @moe_exec") == 2
    got = load_runner(out).run({"x": args[0], "logits": args[1]})["y"].astype(np.float32)
    ref = FusedMoE().reference({"k": 4, "normalize": 0, "block_size": bs}, *args)[0].astype(np.float32)
    tol = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(ref).max())


def _routed_model(path, args, ids, b1, b2, activation, bs, t_dim="T"):
    """A one-node routed FusedMoE model: hidden, weights [T, k] and experts [T, k] as graph inputs."""
    x, w = args[:2]
    k = w.shape[1]
    dt = helper.np_dtype_to_tensor_dtype(x.dtype)
    weights = dict(zip(["fc1", "fc2", "s1", "z1", "s2", "z2"], args[2:]))
    weights.update(b1=b1, b2=b2)
    names = ["x", "w"] + [n if weights.get(n) is not None else "" for n in ["fc1", "fc2", "s1", "z1", "s2", "z2"]]
    names += ["ids", "b1" if b1 is not None else "", "b2" if b2 is not None else ""]
    node = helper.make_node("FusedMoE", names, ["y"], domain="ai.rewrite", k=k, normalize=0, mode="routed", activation="swiglu",
                            block_size=bs, activation_alpha=activation[0], activation_beta=activation[1], swiglu_limit=activation[2])
    inits = [numpy_helper.from_array(a, n) for n, a in weights.items() if a is not None]
    ins = [helper.make_tensor_value_info("x", dt, [t_dim, x.shape[1]]), helper.make_tensor_value_info("w", dt, [t_dim, k]),
           helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [t_dim, k])]
    g = helper.make_graph([node], "main_graph", ins, [helper.make_tensor_value_info("y", dt, [t_dim, x.shape[1]])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.rewrite", 1)]), path)
    return path


@pytest.mark.parametrize("backend", ["ort", "iree"])
@pytest.mark.parametrize("quant,dtype,biases", [("float", np.float32, True), ("int4", np.float32, False), ("float", np.float16, False)])
def test_routed_lowering_matches_reference(tmp_path, backend, quant, dtype, biases):
    """Routed FusedMoE on both backends. ORT: QMoE takes the weights through router_weights; MoE takes log(w)
    as router_probs, which needs weights it can prove positive: from graph inputs it cannot, and says so."""
    T, E, k, H, I = 4, 8, 2, 64, 64
    bs = 64 if quant == "int4" else 0  # a QMoE block size with zero points
    rng = np.random.default_rng(11)
    args = _random_case(rng, T, H, I, E, k, dtype, bs)
    args[0] = (args[0].astype(np.float32) * 10).astype(dtype)
    w, ids = _routed(rng, T, E, k, dtype)
    args[1] = w
    b1, b2 = ((rng.standard_normal(s).astype(dtype) for s in ((E, 2 * I), (E, H))) if biases else (None, None))
    activation = (1.702, 1.0, 7.0) if biases else (1.0, 0.0, 0.0)
    model = _routed_model(tmp_path / "m.onnx", args, ids, b1, b2, activation, bs)
    if backend == "ort" and not bs:
        with pytest.raises(Exception, match="not provably positive"):
            apply(model, tmp_path / "out", backend=backend)
        return
    apply(model, tmp_path / "out", backend=backend)
    got = load_runner(tmp_path / "out").run({"x": args[0], "w": w, "ids": ids})["y"].astype(np.float32)
    attrs = {"k": k, "mode": "routed", "block_size": bs, "activation_alpha": activation[0], "activation_beta": activation[1],
             "swiglu_limit": activation[2]}
    ref = FusedMoE().reference(attrs, *(args + [None] * (8 - len(args))), ids, b1, b2)[0].astype(np.float32)
    tol = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_ort_cpu_qmoe_renormalizes_without_router_weights(tmp_path):
    """Why the normalize=0 lowering feeds router_weights: without it ORT 1.32's CPU QMoE renormalises anyway.
    (When this fails, ORT honours normalize_routing_weights=0 and the Softmax input can go.)"""
    args = _random_case(np.random.default_rng(2), 3, 256, 128, 8, 4, np.float32, 128, zp=False)
    apply(_fused_model(tmp_path / "m.onnx", args, 4, 0, 128), tmp_path / "ort", backend="ort")
    model = onnx.load(tmp_path / "ort" / "model.onnx")
    qmoe = [n for n in model.graph.node if n.op_type == "QMoE"][0]
    assert [a.i for a in qmoe.attribute if a.name == "normalize_routing_weights"] == [0]
    del qmoe.input[11:]  # drop router_weights (and the absent zero points before it)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": args[0], "logits": args[1]})[0]
    attrs = {"k": 4, "block_size": 128}
    renormalized = FusedMoE().reference({**attrs, "normalize": 1}, *args)[0]
    raw = FusedMoE().reference({**attrs, "normalize": 0}, *args)[0]
    np.testing.assert_allclose(got, renormalized, rtol=1e-5, atol=1e-5 * np.abs(renormalized).max())
    assert np.abs(got - raw).max() > 0.1 * np.abs(raw).max()


def _feeds(sess, rng):
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "attention_mask":
            feeds[i.name] = np.ones((1, 7), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(4, 7)[None]
        elif i.name == "input_ids":
            feeds[i.name] = rng.integers(0, 500, (1, 3)).astype(np.int64)
        elif i.name == "seq_position":
            feeds[i.name] = np.array([3], np.int64)
        else:
            # transformers' exporter names the static axes "4", "32": those are sizes; the past length is 4
            shape = [d if isinstance(d, int) else (int(d) if str(d).isdigit() else 4) for d in i.shape]
            feeds[i.name] = (rng.standard_normal(shape) * 0.5).astype(np.float16 if "float16" in i.type else np.float32)
    return feeds


def _moe_report(manifest):
    (rep,) = [r for r in manifest.report if r["plugin"] == "moe"]
    return {r["rule"]: r for r in rep["rules"]}


@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_qwen2_moe_export_one_rewrite_per_layer(tmp_path, qwen2_moe_tiny, backend):
    out = tmp_path / backend
    man = apply(qwen2_moe_tiny, out, plugins=["moe"], backend=backend)
    assert _moe_report(man)["fused-moe-hf"]["matches"] == 2  # tiny has 2 layers
    rewritten = onnx.load(out / "model.onnx")
    ops = [n.op_type for n in rewritten.graph.node]
    before = [n.op_type for n in onnx.load(qwen2_moe_tiny).graph.node]
    # per layer: the gate_up and down GatherND and the router TopK are gone
    assert (before.count("GatherND") - ops.count("GatherND"), before.count("TopK") - ops.count("TopK")) == (4, 2)
    if backend == "ort":
        assert ops.count("MoE") == 2
    # the sigmoid-gated shared expert stays: its gate Gemm and Sigmoid are still there in each layer
    assert sum(1 for n in rewritten.graph.node if n.op_type == "Gemm" and "shared_expert_gate" in n.input[1]) == 2
    sess = ort.InferenceSession(str(qwen2_moe_tiny))
    feeds = _feeds(sess, np.random.default_rng(0))
    ref = sess.run(["logits"], feeds)[0]
    got = load_runner(out).run(feeds)["logits"]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_qwen2_moe_export_shared_expert_sum_moves_into_the_op(tmp_path, qwen2_moe_tiny, backend):
    """transformers' Qwen2-MoE export: ``experts + sigmoid(shared_expert_gate) * shared_expert`` becomes the
    FusedMoE's shared inputs (fused-moe-shared, the IREE cuda default, forced here), after which the residual Add
    is its addend; ONNX Runtime and llvm-cpu compute the ops back and the logits stay the original's."""
    out = tmp_path / backend
    man = apply(qwen2_moe_tiny, out, plugins=["moe"], backend=backend,
                options={"moe": {"shared": True, "residual": True}})
    rules = _moe_report(man)
    assert (rules["fused-moe-hf"]["matches"], rules["fused-moe-shared"]["matches"],
            rules["fused-moe-residual"]["matches"]) == (2, 2, 2)
    sess = ort.InferenceSession(str(qwen2_moe_tiny))
    feeds = _feeds(sess, np.random.default_rng(0))
    ref = sess.run(["logits"], feeds)[0]
    np.testing.assert_allclose(load_runner(out).run(feeds)["logits"], ref, rtol=1e-4, atol=1e-5)


def test_shared_expert_on_iree_cuda_is_added_in_the_down_kernels_store(tmp_path, qwen2_moe_tiny):
    """On IREE cuda the rule is on by default (and the residual one after it): each layer's FusedMoE takes the
    shared expert, its gate logit and the residual, the gates' Sigmoids are gone from the graph, and the
    module compiles with the down kernel adding them in its store."""
    man = apply(qwen2_moe_tiny, tmp_path / "out", plugins=["moe"], backend="iree", target="cuda")
    rules = _moe_report(man)
    assert (rules["fused-moe-shared"]["matches"], rules["fused-moe-residual"]["matches"]) == (2, 2)
    nodes = onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False).graph.node
    moes = [n for n in nodes if n.op_type == "FusedMoE"]
    assert len(moes) == 2 and all(len(n.input) == 14 and n.input[11] and n.input[12] and n.input[13] for n in moes)
    before = [n.op_type for n in onnx.load(qwen2_moe_tiny).graph.node]
    # 6 Sigmoids: per layer the routed experts' SiLU, the shared expert's SiLU, the gate; only the shared SiLUs stay
    assert (before.count("Sigmoid"), [n.op_type for n in nodes].count("Sigmoid")) == (6, 2)
    mlir = (tmp_path / "out" / man.files["mlir"]).read_text()
    assert mlir.count("::@moe_down_f32[") == 2 and (tmp_path / "out" / man.files["vmfb"]).is_file()


def test_a_shared_expert_without_its_gate_is_a_clear_lowering_error(tmp_path):
    from rewrite.core import onnx_io
    from rewrite.core.abstract_ops import DOMAIN
    from rewrite.errors import BackendError
    from rewrite.plugins.moe.lowering import FusedMoE

    g = onnx_io.load(helper.make_model(helper.make_graph(
        [helper.make_node("FusedMoE", ["h", "l", "w1", "w2"] + [""] * 8 + ["s"], ["y"], domain=DOMAIN, k=1)], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 8]) for n in ("h", "l", "s")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [numpy_helper.from_array(np.zeros((8, 16, 8), np.float32), "w1"),
         numpy_helper.from_array(np.zeros((8, 8, 8), np.float32), "w2")]),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)]))
    with pytest.raises(BackendError, match=r"a shared expert \(input 12\) needs its gate logit \(input 13\)"):
        FusedMoE().lower_ort(g, g.nodes_by_op("FusedMoE", DOMAIN)[0])


def test_altered_layer_is_refused_with_reason(tmp_path, qwen2_moe_tiny):
    model = onnx.load(qwen2_moe_tiny)
    topks = [n for n in model.graph.node if n.op_type == "TopK"]
    assert len(topks) == 2
    for a in topks[1].attribute:
        if a.name == "largest":
            a.i = 0  # layer 1 now routes to the least likely experts: not the MoE contract
    onnx.save(model, tmp_path / "altered.onnx")
    man = apply(tmp_path / "altered.onnx", tmp_path / "out", plugins=["moe"], backend="ort")
    rep = _moe_report(man)["fused-moe-hf"]
    assert rep["matches"] == 1
    assert [r["reason"] for r in rep["refusals"]] == ["TopK has largest=0: it selects the lowest-probability experts"]
    assert rep["refusals"][0]["nodes"] == [topks[1].name]
    assert [n.op_type for n in onnx.load(tmp_path / "out" / "model.onnx").graph.node].count("TopK") == 1


@pytest.mark.parametrize("plugins,backend", [(["moe"], "ort"), (["legalize", "moe"], "ort"), (["legalize", "moe"], "iree")])
def test_seed_form_int4(tmp_path, seed_fp32, plugins, backend):
    path, _ = seed_fp32
    out = tmp_path / "out"
    man = apply(path, out, plugins=plugins, backend=backend)
    assert _moe_report(man)["fused-moe-seed-int4"]["matches"] == 2
    if backend == "ort":
        assert [n.op_type for n in onnx.load(out / "model.onnx").graph.node].count("QMoE") == 2
        # the seed's I=192 is no multiple of 128: QMoE gets 64-blocks, said in the report
        (moe,) = [r for r in man.report if r["plugin"] == "moe"]
        assert len(moe["notes"]) == 2 and all("QMoE block_size 64" in n for n in moe["notes"])
    sess = ort.InferenceSession(str(path))
    feeds = _feeds(sess, np.random.default_rng(0))
    ref = sess.run(None, feeds)
    got = load_runner(out).run(feeds)
    for o, r in zip(sess.get_outputs(), ref):
        np.testing.assert_allclose(got[o.name], r, rtol=1e-4, atol=1e-4)




FULL_CHAIN = ["quant4", "cast", "legalize", "expand", "kv", "topk", "moe"]


@pytest.fixture(scope="module")
def unfused_decode(tmp_path_factory):
    """``src -> (signature, (tokens, logits))``: ``src`` after the chain without ``moe`` on ORT, decoded greedily
    (32 steps after [1, 2, 3, 4, 5]), once per model for both backends' tests."""
    import qwen_moe

    made = {}

    def get(src: Path):
        if src not in made:
            base = tmp_path_factory.mktemp("unfused") / "base"
            apply(src, base, plugins=FULL_CHAIN[:-1], backend="ort")
            sig = qwen_moe.decode_signature(base / "model.onnx")
            made[src] = sig, qwen_moe.greedy_decode(load_runner(base).run, sig.input_names, sig.output_names,
                                                    [1, 2, 3, 4, 5], 32, sig.kv_shape_per_layer, sig.dtype)
        return made[src]

    return get


@pytest.mark.parametrize("arch,backend", [("qwen2_moe", "ort"), ("qwen2_moe", "iree"), ("qwen3_moe", "iree")])
def test_full_chain_greedy_tokens_match_unfused_ort(tmp_path, request, unfused_decode, arch, backend):
    """The full plugin chain gives the greedy tokens (32 steps) of the same chain without ``moe`` on ORT.

    (The baseline keeps legalize: quant4 alone vs quant4,legalize already differ by ~1e-2 in the logits on ORT,
    before moe runs; see the moe section of BENCHMARKS.md.)"""
    import qwen_moe

    src = request.getfixturevalue(f"{arch}_tiny")
    sig, base_run = unfused_decode(src)
    if arch == "qwen2_moe":  # the same apply as test_plugin_order's, made once
        fused, man = request.getfixturevalue("qwen2_moe_tiny_applied")(",".join(FULL_CHAIN), backend)
    else:
        fused = tmp_path / "fused"
        man = apply(src, fused, plugins=FULL_CHAIN, backend=backend)
    reports = {r["plugin"]: r for r in man.report}
    assert reports["topk"]["matches"] == 2 and reports["moe"]["matches"] == 2  # one router, one MoE per layer
    fused_run = qwen_moe.greedy_decode(load_runner(fused).run, sig.input_names, sig.output_names, [1, 2, 3, 4, 5], 32,
                                       sig.kv_shape_per_layer, sig.dtype)
    assert fused_run[0] == base_run[0]
    np.testing.assert_allclose(fused_run[1][-1], base_run[1][-1], atol=1e-4)


@pytest.fixture(scope="module")
def qwen3_seed_q4(tmp_path_factory):
    """The Qwen3-MoE seed form (fp16) and its quant4-only folder on ORT: (model path, folder)."""
    import seed_form

    base = tmp_path_factory.mktemp("qwen3_seed")
    model, _ = seed_form.build_seed_model("fp16", arch="qwen3_moe")
    src = seed_form.save_seed_model(model, base / "seed.onnx")
    apply(src, base / "q4", plugins=["quant4"], backend="ort")
    return src, base / "q4"


@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_qwen3_seed_form_full_chain_decodes_like_its_quant4_model(tmp_path, qwen3_seed_q4, backend):
    """The Qwen3-MoE seed form (INT4 experts, renormalized router, QK-norm) through the full chain: one router and
    one FusedMoE per layer, and every call's logits within float16 tolerance of the quant4-only model on ORT at
    the basic level, with the same 8 greedy tokens (the full-size run of BENCHMARKS.md, at toy size)."""
    from rewrite.generate import Generator
    from rewrite.verify import compare

    src, q4 = qwen3_seed_q4
    man = apply(src, tmp_path / "out", plugins=FULL_CHAIN, backend=backend)
    reports = {r["plugin"]: r for r in man.report}
    assert reports["topk"]["matches"] == 2 and reports["moe"]["matches"] == 2
    prompt = [11, 22, 33, 44, 55]
    res = Generator(tmp_path / "out").generate(prompt, 8)
    ref = Generator.reference(q4 / "model.onnx").replay(prompt, res.tokens)
    assert [int(np.argmax(r[0, -1])) for r in ref] == res.tokens
    for got, want in zip(res.logits, ref):
        c = compare("logits", got, want)
        assert c.ok, c.line()


def _fused_logits_match(model_path: Path, out: Path, backend: str) -> None:
    man = apply(model_path, out, plugins=["moe"], backend=backend)
    assert _moe_report(man)["fused-moe-hf"]["matches"] == 2  # one per MoE layer
    sess = ort.InferenceSession(str(model_path))
    feeds = _feeds(sess, np.random.default_rng(0))
    ref = sess.run(["logits"], feeds)[0]
    np.testing.assert_allclose(load_runner(out).run(feeds)["logits"], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_dynamo_export_repeats_tokens_with_expand(tmp_path, qwen2_moe_tiny_dynamo, backend):
    """torch.onnx.export(dynamo=True) repeats each token row with Expand(.., [1, k, 1]) where transformers'
    exporter uses Tile: the same rule fires on both."""
    ops = [n.op_type for n in onnx.load(qwen2_moe_tiny_dynamo).graph.node]
    assert "Tile" not in ops and "Expand" in ops
    _fused_logits_match(qwen2_moe_tiny_dynamo, tmp_path / backend, backend)


def test_reshape_targets_computed_from_the_sequence_length(tmp_path, qwen2_moe_tiny):
    """onnxscript 0.7.0 writes the [T, k, H] target of the per-expert sum as Concat(Shape(input_ids)[1:2],
    [k], [H]) where 0.7.2 folds it to the constant [-1, k, H]; respelled here the 0.7.0 way, both layers fuse."""
    model = onnx.load(qwen2_moe_tiny)
    graph = model.graph
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    targets = [n for n in graph.node if n.op_type == "Reshape" and n.input[1] in consts
               and consts[n.input[1]].tolist() == [-1, 4, 128]]  # k = 4, H = 128
    assert len(targets) == 2
    for layer, node in enumerate(targets):
        tag = f"sum_shape_{layer}"
        at = list(graph.node).index(node)
        graph.node.insert(at, helper.make_node("Concat", [f"{tag}_s", f"{tag}_kh"], [f"{tag}_v"], axis=0, name=f"{tag}_cat"))
        graph.node.insert(at, helper.make_node("Shape", ["input_ids"], [f"{tag}_s"], start=1, end=2, name=f"{tag}_shape"))
        graph.initializer.append(numpy_helper.from_array(np.array([4, 128], np.int64), f"{tag}_kh"))
        node.input[1] = f"{tag}_v"
    onnx.save(model, tmp_path / "respelled.onnx")
    _fused_logits_match(tmp_path / "respelled.onnx", tmp_path / "out", "ort")


def test_grouped_mm_experts_fuse_by_value(tmp_path, qwen2_moe_tiny_grouped_mm):
    """transformers' default experts implementation has no fixed structure (one MatMul per expert): the
    by-value rule proves each layer's region equal to FusedMoE on random inputs and replaces it whole."""
    before = onnx.load(qwen2_moe_tiny_grouped_mm)
    assert sum(n.op_type == "MatMul" for n in before.graph.node) > 2 * 2 * 8  # gate_up and down per expert
    man = apply(qwen2_moe_tiny_grouped_mm, tmp_path / "out", plugins=["topk", "moe"], backend="ort")
    rep = _moe_report(man)
    assert rep["fused-moe-by-value"]["matches"] == 2 and rep["fused-moe-hf"]["matches"] == 0
    after = onnx.load(tmp_path / "out" / "model.onnx")
    assert [n.op_type for n in after.graph.node].count("MoE") == 2
    assert "TopK" not in [n.op_type for n in after.graph.node]  # topk's router went with its region
    assert len(after.graph.node) < len(before.graph.node) - 2 * 100  # the per-expert regions are gone
    sess = ort.InferenceSession(str(qwen2_moe_tiny_grouped_mm))
    feeds = _feeds(sess, np.random.default_rng(0))
    np.testing.assert_allclose(load_runner(tmp_path / "out").run(feeds)["logits"], sess.run(["logits"], feeds)[0],
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("activation, refusal", [
    ("Tanh", "no FusedMoE reading reproduces the region"),                   # x * tanh(x): checked, differs
    ("Relu", "'node_Sigmoid_626' (Relu) applies a threshold to float data"),  # not even checked
    ("Floor", "'node_Sigmoid_626' (Floor) applies a threshold to float data"),  # rounding of activations, not ids
])
def test_region_that_computes_something_else_is_refused(tmp_path, qwen2_moe_tiny_grouped_mm, activation, refusal):
    """Layer 1's expert activation x * sigmoid(x) changed to x * tanh(x) or x * relu(x): that region is refused
    (with the closest reading's error, or because a threshold on float data is beyond a random-input check), so
    only layer 0 fuses."""
    model = onnx.load(qwen2_moe_tiny_grouped_mm)
    producer = {o: n for n in model.graph.node for o in n.output}
    # the routed experts' SiLU reads the gate half of the Concat of the per-expert MatMuls
    routed = [n for n in model.graph.node if n.op_type == "Sigmoid" and producer[n.input[0]].op_type == "Split"
              and producer[producer[n.input[0]].input[0]].op_type == "Concat"]
    assert len(routed) == 2
    routed[1].op_type = activation
    onnx.save(model, tmp_path / "altered.onnx")
    man = apply(tmp_path / "altered.onnx", tmp_path / "out", plugins=["moe"], backend="ort")
    rep = _moe_report(man)["fused-moe-by-value"]
    assert rep["matches"] == 1
    assert [r["reason"][:len(refusal)] for r in rep["refusals"]] == [refusal], rep["refusals"]


OPTIMUM = {f: Path(__file__).parent / "data" / f"optimum_{f}_tiny.onnx" for f in ("qwen3_moe", "gpt_oss")}  # examples/optimum_export.py


@pytest.mark.parametrize("family, rule, removed", [
    ("qwen3_moe", "fused-moe-scatter-sum", "ScatterElements"),  # a loop over the 8 experts, one module each
    ("gpt_oss", "fused-moe-dense-sum", "ReduceSum"),            # all 8 experts on every token, summed over them
])
@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_optimum_exports_fuse(tmp_path, backend, family, rule, removed):
    """optimum's (TorchScript) exports: one match of ``rule`` per layer, the experts' nodes gone, 24 greedy tokens
    (gpt-oss: past its 16-position window) equal to ONNX Runtime on the original and logits within 1e-4
    relative (fp32)."""
    from rewrite.generate import Generator

    before = [n.op_type for n in onnx.load(OPTIMUM[family]).graph.node]
    assert before.count(removed) >= 2
    man = apply(OPTIMUM[family], tmp_path / "out", plugins=["topk", "moe"], backend=backend)
    rep = _moe_report(man)
    assert rep[rule]["matches"] == 2
    assert sum(r["matches"] for r in rep.values()) == 2
    if backend == "ort":
        ops = [n.op_type for n in onnx.load(tmp_path / "out" / "model.onnx").graph.node]
        assert ops.count("MoE") == 2 and removed not in ops and "NonZero" not in ops
    got = Generator(tmp_path / "out").generate([11, 22, 33, 44, 55], 24)
    ref = Generator.reference(OPTIMUM[family]).generate([11, 22, 33, 44, 55], 24)
    assert got.tokens == ref.tokens
    assert max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got.logits, ref.logits)) < 1e-4


def test_optimum_loop_whose_order_is_not_the_experts_is_refused(tmp_path):
    """Layer 1's experts 3 and 4 swap the rows they take (the expert index each one's mask Gather reads), so the
    chain's order is no longer the expert ids' order: the stacked weights compute something else and that layer
    is refused with the closest reading's error; layer 0 still fuses."""
    model = onnx.load(OPTIMUM["qwen3_moe"])
    producer = {o: n for n in model.graph.node for o in n.output}
    # per expert, Gather(Transpose(OneHot(ids)), e): the rows of the tokens routed to expert e
    masks = [n for n in model.graph.node if n.op_type == "Gather" and n.name.startswith("/model/layers.1/mlp/")
             and n.input[0] in producer and producer[n.input[0]].op_type == "Transpose"
             and producer[producer[n.input[0]].input[0]].op_type == "OneHot"]
    assert len(masks) == 8
    masks[3].input[1], masks[4].input[1] = masks[4].input[1], masks[3].input[1]
    onnx.save(model, tmp_path / "altered.onnx")
    man = apply(tmp_path / "altered.onnx", tmp_path / "out", plugins=["topk", "moe"], backend="ort")
    rep = _moe_report(man)["fused-moe-scatter-sum"]
    assert rep["matches"] == 1
    reasons = [r["reason"] for r in rep["refusals"] if r["reason"].startswith("no FusedMoE reading")]
    assert len(reasons) == 1, rep["refusals"]


def test_optimum_dense_experts_computing_something_else_are_refused(tmp_path):
    """optimum's gpt-oss with layer 1's expert activation ``gate * sigmoid(alpha * gate)`` changed to ``gate *
    tanh(alpha * gate)``: no FusedMoE reading reproduces that layer, which is refused with the closest reading's
    error; layer 0 still fuses."""
    model = onnx.load(OPTIMUM["gpt_oss"])
    acts = [n for n in model.graph.node if n.op_type == "Sigmoid" and n.name.startswith("/model/layers.1/mlp/experts/")]
    assert len(acts) == 1
    acts[0].op_type = "Tanh"
    onnx.save(model, tmp_path / "altered.onnx")
    man = apply(tmp_path / "altered.onnx", tmp_path / "out", plugins=["topk", "moe"], backend="ort")
    rep = _moe_report(man)["fused-moe-dense-sum"]
    assert rep["matches"] == 1
    assert [r["reason"][:len("no FusedMoE reading")] for r in rep["refusals"]] == ["no FusedMoE reading"], rep["refusals"]


def test_optimum_export_that_left_experts_out_is_refused(tmp_path):
    """optimum's DeepSeek-V3 export traces transformers' ``if`` per expert, keeping only the experts its random
    dummy input routed to (7 of 8 in layer 0, 4 in layer 1 of this file): both layers are refused with the
    reason, and the graph keeps its loops."""
    path = Path(__file__).parent / "data" / "optimum_deepseek_v3_tiny.onnx"
    man = apply(path, tmp_path / "out", plugins=["topk", "moe"], backend="ort")
    rep = _moe_report(man)["fused-moe-scatter-sum"]
    assert rep["matches"] == 0
    reasons = sorted(r["reason"].split(":")[0] for r in rep["refusals"] if r["reason"].startswith("the loop sums"))
    assert reasons == ["the loop sums 4 experts' outputs, the experts' one-hot masks have 8",
                       "the loop sums 7 experts' outputs, the experts' one-hot masks have 8"]
    ops = [n.op_type for n in onnx.load(tmp_path / "out" / "model.onnx").graph.node]
    assert ops.count("ScatterElements") == 7 + 4 + 2  # the experts' loops, and the router's two scatters


@pytest.mark.parametrize("start", ["zeros", "two terms"])
def test_scatter_chain_reads_the_experts_in_order(tmp_path, start):
    """The chain of Adds of ScatterElements(zeros, rows, out_e, axis=0) gives its terms first expert first, whether
    it starts from zeros (TorchScript's index_add_) or with an Add of the first two terms; an Add of two other
    values is no chain."""
    from rewrite.core import onnx_io
    from rewrite.plugins.moe import _scatter_chain

    f = TensorProto.FLOAT
    zero = helper.make_tensor("v", f, [1], [0.0])
    nodes = [helper.make_node("ConstantOfShape", ["shp"], [f"z{i}"], value=zero) for i in range(4)]
    nodes += [helper.make_node("ScatterElements", [f"z{i}", "idx", f"u{i}"], [f"s{i}"], axis=0) for i in range(3)]
    if start == "zeros":
        nodes += [helper.make_node("Add", ["z3", "s0"], ["a0"]), helper.make_node("Add", ["a0", "s1"], ["a1"])]
    else:
        nodes += [helper.make_node("Add", ["s0", "s1"], ["a1"])]
    nodes += [helper.make_node("Add", ["a1", "s2"], ["a2"]), helper.make_node("Add", ["u0", "u1"], ["other"])]
    inputs = [helper.make_tensor_value_info(f"u{i}", f, [2, 4]) for i in range(3)]
    inputs.append(helper.make_tensor_value_info("idx", TensorProto.INT64, [2, 4]))
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("a2", "other")]
    graph = helper.make_graph(nodes, "chain", inputs, outputs, [helper.make_tensor("shp", TensorProto.INT64, [2], [3, 4])])
    onnx.save(helper.make_model(graph), tmp_path / "chain.onnx")
    g = onnx_io.load(tmp_path / "chain.onnx")
    adds = {n.outputs[0]: n for n in g.nodes_by_op("Add")}
    assert [t.outputs[0] for t in _scatter_chain(g, adds["a2"])] == ["s0", "s1", "s2"]
    assert _scatter_chain(g, adds["other"]) is None
