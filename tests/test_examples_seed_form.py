"""examples/seed_form.py: the seed's static-cache graph form, checked against its PyTorch reference."""

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

import seed_form  # noqa: E402

LAYERS = 2


@pytest.fixture(scope="module", params=["fp32", "fp16"])
def built(request):
    return seed_form.build_seed_model(request.param, layers=LAYERS)


@pytest.fixture(scope="module")
def fp16_model():
    return seed_form.build_seed_model("fp16", layers=LAYERS)[0]


@pytest.fixture(scope="module")
def checks():
    return {dtype: seed_form.check_seed_model(*seed_form.build_seed_model(dtype, layers=LAYERS)) for dtype in ("fp32", "fp16")}


def _producers(model):
    return {out: node for node in model.graph.node for out in node.output}


def _initializers(model):
    return {init.name for init in model.graph.initializer}


def test_model_passes_full_onnx_check(built):
    model, _ = built
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 21 and model.ir_version == 10


@pytest.mark.parametrize("dtype, tolerance", [("fp32", 1e-4), ("fp16", 1e-2)])
def test_ort_matches_torch_reference_through_prefill_and_greedy_decode(checks, dtype, tolerance):
    report = checks[dtype]
    assert report["max_rel"] < tolerance, report
    assert report["ort_tokens"] == report["ref_tokens"]
    assert len(report["ort_tokens"]) == 6


def test_fp16_and_fp32_decode_the_same_tokens(checks):
    # Same seed, weights differ only by f16 rounding: the greedy path is the same.
    assert checks["fp16"]["ort_tokens"] == checks["fp32"]["ort_tokens"]


def test_kv_cache_is_scattered_with_the_seed_index_chain(fp16_model):
    """A5: ScatterElements(past, Expand(Reshape(Cast(Add(seq_position, Range)))), update, axis=2)."""
    prod = _producers(fp16_model)
    scatters = [n for n in fp16_model.graph.node if n.op_type == "ScatterElements"]
    assert len(scatters) == 2 * LAYERS
    assert sorted(n.input[0] for n in scatters) == sorted(f"past_{kv}_{i}" for i in range(LAYERS) for kv in ("key", "value"))
    for node in scatters:
        assert onnx.helper.get_attribute_value(node.attribute[0]) == 2
        expand = prod[node.input[1]]
        assert expand.op_type == "Expand"
        reshape = prod[expand.input[0]]
        cast = prod[reshape.input[0]]
        add = prod[cast.input[0]]
        assert (reshape.op_type, cast.op_type, add.op_type) == ("Reshape", "Cast", "Add")
        assert add.input[0] == "seq_position" and prod[add.input[1]].op_type == "Range"
        # A4: the Expand shape is Where(Equal(Concat, -1), ones, Concat).
        where = prod[expand.input[1]]
        assert where.op_type == "Where"
        equal, concat = prod[where.input[0]], prod[where.input[2]]
        assert (equal.op_type, concat.op_type) == ("Equal", "Concat") and equal.input[0] == concat.output[0]


def test_shape_inference_cannot_resolve_the_expand_but_keeps_the_scatter_static(fp16_model):
    expands = seed_form.inferred_shapes(fp16_model, "Expand")
    assert len(expands) == LAYERS
    # The seed's A4: the kv-head and head_dim dims of the index tensor are lost (onnx gives [?, ?, ?, ?]).
    assert all(len(shape) == 4 and shape[1] != 4 and shape[3] != 64 for shape in expands)
    assert seed_form.inferred_shapes(fp16_model, "ScatterElements") == [[1, 4, 64, 64]] * (2 * LAYERS)


def test_experts_are_gathered_then_dequantized_from_uint4_in_blocks_of_128(fp16_model):
    """A1: per layer 3 DequantizeLinear(block_size=128, axis=2) on UINT4 codes and zero points."""
    prod, inits = _producers(fp16_model), _initializers(fp16_model)
    dqls = [n for n in fp16_model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dqls) == 3 * LAYERS
    for node in dqls:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"axis": 2, "block_size": 128}
        for port in (0, 2):
            cast = prod[node.input[port]]
            assert cast.op_type == "Cast" and cast.attribute[0].i == TensorProto.UINT4
            gather = prod[cast.input[0]]
            assert gather.op_type == "Gather" and gather.input[0] in inits
        scale_gather = prod[node.input[1]]
        assert scale_gather.op_type == "Gather" and scale_gather.input[0] in inits
    # The down projection's K = 192 ends in a partial block: 2 scale columns.
    scales = {i.name: i for i in fp16_model.graph.initializer}["layers.0.mlp.experts.down_proj.scales"]
    assert list(scales.dims) == [8, 256, 2] and scales.data_type == TensorProto.FLOAT16


def test_router_is_softmax_cast_topk(fp16_model):
    prod = _producers(fp16_model)
    topks = [n for n in fp16_model.graph.node if n.op_type == "TopK"]
    assert len(topks) == LAYERS
    for node in topks:
        cast = prod[node.input[0]]
        assert cast.op_type == "Cast" and cast.attribute[0].i == TensorProto.FLOAT
        assert prod[cast.input[0]].op_type == "Softmax"


def test_float_casts_are_emitted_only_in_fp16(built):
    """fp16: Softmax -> Cast(f32) -> Cast(f16) after attention, Softmax -> Cast -> TopK in the router,
    RMSNorm's Div -> Cast; fp32: none of them (module docstring, "Dtype policy")."""
    model, weights = built
    prod = _producers(model)
    cast_source = {n.output[0]: prod[n.input[0]] for n in model.graph.node if n.op_type == "Cast" and n.input[0] in prod}
    round_trips = [s for s in cast_source.values() if s.op_type == "Cast" and prod[s.input[0]].op_type == "Softmax"]
    from_softmax = [s for s in cast_source.values() if s.op_type == "Softmax"]
    from_div = [s for s in cast_source.values() if s.op_type == "Div"]
    fp16 = weights.config.is_fp16
    assert len(round_trips) == (LAYERS if fp16 else 0)
    assert len(from_softmax) == (2 * LAYERS if fp16 else 0)
    assert len(from_div) == (2 * LAYERS + 1 if fp16 else 0)


def test_reduce_ops_take_axes_as_an_input(built):
    model, _ = built
    reduces = [n for n in model.graph.node if n.op_type.startswith("Reduce")]
    assert len(reduces) == 2 * LAYERS + 1
    inits = _initializers(model)
    for node in reduces:
        assert len(node.input) == 2 and node.input[1] in inits
        assert all(a.name != "axes" for a in node.attribute)


def test_blockwise_uint4_quantization_round_trips_within_half_a_step():
    w = np.random.default_rng(1).standard_normal((3, 5, 192)).astype(np.float32)
    codes, scales, zeros = seed_form.quantize_uint4_blockwise(w, 128, np.float32)
    assert codes.dtype == zeros.dtype == np.uint8 and codes.max() <= 15 and zeros.max() <= 15
    assert scales.shape == (3, 5, 2)
    back = seed_form.dequantize_uint4_blockwise(codes, scales, zeros, 128)
    step = np.repeat(scales, 128, axis=-1)[..., :192]
    assert np.all(np.abs(back - w) <= step / 2 + 1e-6)


def test_grouped_query_attention_variant_matches_reference():
    model, weights = seed_form.build_seed_model("fp32", layers=1, heads=4, kv_heads=2)
    onnx.checker.check_model(model, full_check=True)
    report = seed_form.check_seed_model(model, weights, steps=3, prompt_len=4)
    assert report["max_rel"] < 1e-4 and report["ort_tokens"] == report["ref_tokens"]


def test_cli_writes_the_model_and_reports(tmp_path, capsys):
    out = tmp_path / "seed.onnx"
    report = seed_form.main(["--dtype", "fp32", "--out", str(out), "--steps", "2", "--prompt-len", "3"])
    assert out.exists() and onnx.load(out).graph.name == "seed_form_qwen_moe"
    assert report["op_counts"]["ScatterElements"] == 2 * LAYERS
    assert '"max_rel"' in capsys.readouterr().out


@pytest.mark.parametrize("dtype, tolerance", [("fp32", 1e-4), ("fp16", 1e-2)])
def test_qwen3_form_matches_torch_reference(dtype, tolerance):
    """arch="qwen3_moe": RMSNorm of every query and key head, no q/k/v bias, renormalized top-k, no shared expert;
    ONNX Runtime agrees with the PyTorch reference through prefill and greedy decode."""
    model, weights = seed_form.build_seed_model(dtype, arch="qwen3_moe", layers=LAYERS)
    ops = [n.op_type for n in model.graph.node]
    names = _initializers(model)
    assert {f"layers.0.self_attn.{p}_norm.weight" for p in "qk"} <= names
    assert not any(n.endswith("_proj.bias") or "shared_expert" in n for n in names)
    assert ops.count("TopK") == LAYERS and ops.count("ReduceSum") == LAYERS  # the renormalization's sum
    report = seed_form.check_seed_model(model, weights)
    assert report["max_rel"] < tolerance, report
    assert report["ort_tokens"] == report["ref_tokens"]


def test_seeded_int4_export_regenerates_and_routes_like_the_inline_form(tmp_path):
    """export_seeded writes the graph build_seed_model writes, with its weights as page-aligned external data drawn
    by the generator (experts directly as UINT8 codes 0..15, zero points 7..8, positive scales); regenerating from
    the graph gives the same bytes, and ONNX Runtime decodes it."""
    import filecmp
    import shutil

    import onnxruntime as ort
    import seeded_weights

    sizes = dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=16, top_k=8, vocab=512, max_seq=32)
    path = seed_form.export_seeded("qwen3_moe", tmp_path / "a", dtype="fp16", seed=4, threads=2, **sizes)
    model = onnx.load(str(path), load_external_data=False)
    inline, _ = seed_form.build_seed_model("fp16", arch="qwen3_moe", **sizes)
    assert [n.op_type for n in model.graph.node] == [n.op_type for n in inline.graph.node]
    ext = {t.name: t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert set(ext) == _initializers(inline) - {"rope.inv_freq"} - {t.name for t in inline.graph.initializer if t.name.startswith("const_")}
    offsets = [int(next(e.value for e in t.external_data if e.key == "offset")) for t in ext.values()]
    assert all(o % seed_form.PAGE == 0 for o in offsets)
    data = tmp_path / "a" / "model.onnx.data"
    codes = onnx.numpy_helper.to_array(ext["layers.1.mlp.experts.down_proj.qweight"], str(tmp_path / "a"))
    zeros = onnx.numpy_helper.to_array(ext["layers.1.mlp.experts.down_proj.zero_points"], str(tmp_path / "a"))
    scales = onnx.numpy_helper.to_array(ext["layers.1.mlp.experts.down_proj.scales"], str(tmp_path / "a"))
    assert codes.dtype == np.uint8 and (codes.min(), codes.max()) == (0, 15)
    assert (zeros.min(), zeros.max()) == (7, 8) and scales.dtype == np.float16 and scales.min() > 0
    (tmp_path / "b").mkdir()
    shutil.copy(path, tmp_path / "b" / "model.onnx")
    seeded_weights.regenerate(tmp_path / "b" / "model.onnx", threads=1)
    assert filecmp.cmp(data, tmp_path / "b" / "model.onnx.data", shallow=False)
    cfg = seed_form.seed_config("fp16", "qwen3_moe", **sizes)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    step = seed_form.runner_step(lambda feeds: dict(zip(names, sess.run(names, feeds))), cfg)
    tokens, logits, _ = seed_form.greedy(step, cfg, np.array([[11, 22, 33, 44, 55]]), 4)
    assert all(np.isfinite(lg.astype(np.float32)).all() for lg in logits) and len(tokens) == 4
    # zero-mean INT4 weights: no common offset builds up in the residual stream across layers
    centered = codes.astype(np.float64) - np.repeat(zeros, cfg.block_size, axis=-1)[..., :codes.shape[-1]]
    assert abs(centered.mean()) < 0.05 and 4.0 < centered.std() < 5.0


def test_a_recorded_router_std_draws_the_router_and_regenerates(tmp_path):
    """router_std (the full-size configs' `FULL_ROUTER_STD`) is recorded in the metadata: the router weights have
    that std, regenerating gives the same bytes, and a graph recorded without one regenerates with the toy std."""
    import filecmp
    import shutil

    import seeded_weights

    sizes = dict(layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=16, top_k=8, vocab=512, max_seq=32)
    path = seed_form.export_seeded("qwen3_moe", tmp_path / "a", dtype="fp16", seed=4, threads=1, router_std=0.05,
                                   **sizes)
    model = onnx.load(str(path), load_external_data=False)
    recorded = json.loads({p.key: p.value for p in model.metadata_props}[seeded_weights.METADATA_KEY])
    assert recorded["router_std"] == 0.05
    router = next(t for t in model.graph.initializer if t.name == "layers.0.mlp.gate.weight")
    assert 0.045 < onnx.numpy_helper.to_array(router, str(tmp_path / "a")).astype(np.float64).std() < 0.055
    (tmp_path / "b").mkdir()
    shutil.copy(path, tmp_path / "b" / "model.onnx")
    seeded_weights.regenerate(tmp_path / "b" / "model.onnx", threads=1)
    assert filecmp.cmp(tmp_path / "a" / "model.onnx.data", tmp_path / "b" / "model.onnx.data", shallow=False)
    del model.metadata_props[:]  # as graphs exported before the std was recorded
    onnx.helper.set_model_props(model, {seeded_weights.METADATA_KEY: json.dumps({"seed": 4, "derived": {}})})
    onnx.save(model, str(tmp_path / "b" / "model.onnx"))
    seeded_weights.regenerate(tmp_path / "b" / "model.onnx", threads=1)
    old = onnx.numpy_helper.to_array(router, str(tmp_path / "b")).astype(np.float64)
    assert 0.45 < old.std() < 0.55
    assert seed_form.FULL["qwen2_moe"]["router_std"] == seed_form.FULL["qwen3_moe"]["router_std"] == seed_form.FULL_ROUTER_STD
