"""``kv``: contiguous ScatterElements KV updates -> KVCacheUpdate; growing Concat caches -> static caches.

Tolerances: the slice insert moves values, so scatter rewrites must agree exactly; decoding through a
converted model must give identical greedy tokens and logits within 1e-4 relative (fp32).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from rewrite.backends import load_runner
from rewrite.backends.ort import OrtRunner
from rewrite.core import onnx_io
from rewrite.core.driver import run_plugin
from rewrite.core.shapes import infer_shapes
from rewrite.errors import BackendError, PluginError
from rewrite.generate import GenerationError, Generator
from rewrite.pipeline import RewriteContext, apply
from rewrite.plugins.kv_cache import KVCache, _mentions, scatter_model



def _graph(model, tmp_path):
    p = tmp_path / "m.onnx"
    onnx.save(model, p)
    g = onnx_io.load(p)
    infer_shapes(g)
    return g, p


def test_seed_scatter_becomes_slice_insert_and_index_chain_goes(tmp_path):
    g, _ = _graph(scatter_model("seed"), tmp_path)
    rep = run_plugin(g, KVCache())
    assert rep.rules["scatter-slice-insert"].matches == 2
    assert g.summary() == {"ai.rewrite::KVCacheUpdate": 2}  # Range, Reshape, Cast, the A4 Where/Equal chain: gone
    assert [g.nodes[i].inputs[2] for i in g.nodes] == ["position", "position"]


@pytest.mark.parametrize("kind,batch,reason", [
    ("strided", 1, "Add is not position + Range(0, n, 1) with a one-element position"),
    ("reversed", 1, "range length not proven equal to the scattered extent (index repeated along the axis)"),
    ("per_batch", 2, "index varies along an axis other than the scatter axis (per-batch or per-head offsets)"),
    ("repeated", 1, "range length not proven equal to the scattered extent (index repeated along the axis)"),
])
def test_non_contiguous_indices_are_refused_with_the_reason(tmp_path, kind, batch, reason):
    g, _ = _graph(scatter_model(kind, batch=batch), tmp_path)
    before = g.summary()
    rep = run_plugin(g, KVCache())
    assert rep.matches == 0 and g.summary() == before
    assert rep.rules["scatter-slice-insert"].refusals == {reason: ["scatter_k", "scatter_v"]}


@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_slice_insert_equals_scatter_at_every_position(tmp_path, backend):
    _, src = _graph(scatter_model("seed"), tmp_path)
    apply(src, tmp_path / backend, plugins="kv", backend=backend)
    got, ref = load_runner(tmp_path / backend), OrtRunner(src)
    rng = np.random.default_rng(1)
    for pos, n in [(0, 16), (0, 3), (9, 1), (15, 1), (-2, 1), (-5, 5)]:
        feeds = {"k": rng.standard_normal((1, 2, n, 8), np.float32), "v": rng.standard_normal((1, 2, n, 8), np.float32),
                 "position": np.array([pos], np.int64),
                 "past_k": rng.standard_normal((1, 2, 16, 8), np.float32), "past_v": rng.standard_normal((1, 2, 16, 8), np.float32)}
        a, b = got.run(feeds), ref.run(feeds)
        for k in b:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{backend} position {pos} n {n} {k}")


def test_seed_form_decodes_identically_on_ort(seed_fp32, tmp_path):
    path, _ = seed_fp32
    m = apply(path, tmp_path / "kv", plugins="legalize,expand,kv", backend="ort")
    assert {r["plugin"]: r["matches"] for r in m.report}["kv"] == 4  # 2 layers x (K, V)
    assert not [n for n in onnx.load(tmp_path / "kv" / "model.onnx").graph.node if n.op_type == "ScatterElements"]
    apply(path, tmp_path / "orig", backend="ort")
    ref = Generator(tmp_path / "orig")
    got = Generator(tmp_path / "kv")
    r, o = ref.generate([7, 300, 12, 45, 99], 8), got.generate([7, 300, 12, 45, 99], 8)
    assert r.tokens == o.tokens
    for p in ref.past:
        np.testing.assert_array_equal(got.past[p], ref.past[p])  # the caches, bit for bit


def test_growing_cache_becomes_static_and_decodes_like_the_original(qwen2_moe_tiny, tmp_path):
    m = apply(qwen2_moe_tiny, tmp_path / "static", plugins="kv", backend="ort", options={"kv": {"max_seq": 40}})
    shapes = {d["name"]: d["shape"] for d in m.inputs}
    assert shapes["seq_position"] == [1] and shapes["attention_mask"] == [1, 40]
    assert [s for n, s in shapes.items() if n.startswith("past_key_values")] == [[1, 4, 40, 32]] * 4
    assert {d["name"]: d["shape"] for d in m.outputs}["cache.layers.1.values"] == [1, 4, 40, 32]
    apply(qwen2_moe_tiny, tmp_path / "orig", backend="ort")
    ref = Generator(tmp_path / "orig").generate([3, 141, 59, 26, 5], 32)
    gen = Generator(tmp_path / "static")
    got = gen.generate([3, 141, 59, 26, 5], 32)
    assert got.tokens == ref.tokens
    rel = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got.logits, ref.logits))
    assert rel < 1e-4
    with pytest.raises(GenerationError, match="exceeds the cache's 40 positions"):
        for _ in range(4):
            gen.step(np.array([[1, 2]]))


@pytest.mark.parametrize("backend,plugins,stateful", [("ort", "kv", False), ("iree", "kv,topk,moe", True)])  # IREE's own TopK is wrong
def test_sliding_window_caches_with_their_own_past_length_become_one_static_cache(gpt_oss_tiny, tmp_path, backend, plugins,
                                                                                   stateful):
    """gpt-oss's export: the sliding-window layer's cache has its own past-length symbol, read by its window
    mask. Decoding past the window (5 prompt tokens + 24 steps > 16 positions; the window changes the logits
    from position 16 on by about 1e-2) must match the original within 1e-4 relative."""
    g = onnx_io.load(gpt_oss_tiny)
    assert len({g.values[i].shape[2] for i in g.inputs if i.startswith("past_key_values") and i.endswith("keys")}) == 2
    m = apply(gpt_oss_tiny, tmp_path / "static", plugins=plugins, backend=backend,
              options={"kv": {"max_seq": 32}, **({"stateful": True} if stateful else {})})
    if not stateful:
        shapes = {d["name"]: d["shape"] for d in m.inputs}
        assert [s for n, s in shapes.items() if n.endswith(("keys", "values"))] == [[1, 2, 32, 16]] * 4
    apply(gpt_oss_tiny, tmp_path / "orig", backend="ort")
    ref = Generator(tmp_path / "orig").generate([11, 22, 33, 44, 55], 24)
    got = Generator(tmp_path / "static").generate([11, 22, 33, 44, 55], 24)
    assert got.tokens == ref.tokens
    rel = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got.logits, ref.logits)]
    assert max(rel) < 1e-4, rel


def test_a_cache_trimmed_to_its_window_that_shares_the_past_dim_is_refused(family_export):
    """gpt-oss through ``torch.onnx.export(dynamo=True)``: the sliding-window layer's present is its Concat
    trimmed by a Slice (not a growing cache), and its past shares the full layers' dim ``past``. Converting only
    the full layers would leave a graph that fails inside ONNX Runtime; the plugin refuses and leaves it as it was."""
    path = family_export("gpt_oss", "dynamo")
    g = onnx_io.load(path)
    infer_shapes(g)
    snap = onnx_io.to_model(g).SerializeToString()
    with pytest.raises(PluginError, match="static cache: input 'past_key_values.0.key' has a dim 'past' of a past "
                                          "length, but it is not a growing cache"):
        run_plugin(g, KVCache(), RewriteContext(options={"kv": {"max_seq": 32}}))
    assert onnx_io.to_model(g).SerializeToString() == snap


def test_symbol_mentions_are_whole_identifiers():
    assert _mentions("s70 + s81", "s81") and _mentions("Max(0, past - 15)", "past") and _mentions("s8", "s8")
    assert not _mentions("s70 + s81", "s8") and not _mentions("past_len", "past")


OPTIMUM_QWEN3_MOE = Path(__file__).parent / "data" / "optimum_qwen3_moe_tiny.onnx"  # examples/optimum_export.py


def test_optimum_export_becomes_static_and_stateful(tmp_path):
    """optimum's (TorchScript) export of Qwen3-MoE: the new keys' sequence dims are unnamed (``unk__44``) and found
    to be ``sequence_length`` by evaluation; its positions are ``Range(P, P + n)``, whose limit stays
    ``seq_position + n`` while the key length ``P + len(positions)`` becomes ``max_seq``. On ONNX Runtime and as a
    stateful IREE decode module (batch and token count fixed with --dim), 20 greedy tokens equal the original's,
    logits within 1e-4 relative; a symbolic batch is refused by --stateful with the --dim to add."""
    ref = Generator.reference(OPTIMUM_QWEN3_MOE).generate([11, 22, 33, 44, 55], 20)
    m = apply(OPTIMUM_QWEN3_MOE, tmp_path / "ort", plugins="kv", backend="ort", options={"kv": {"max_seq": 32}})
    assert {d["name"]: d["shape"] for d in m.inputs}["past_key_values.1.value"] == ["batch_size", 2, 32, 16]
    opts = {"kv": {"max_seq": 32}, "stateful": True, "next_token": True}
    m = apply(OPTIMUM_QWEN3_MOE, tmp_path / "iree", plugins="kv,topk,moe", backend="iree", options=opts,
              dims={"batch_size": 1, "sequence_length": 1})
    assert [s["shape"] for s in m.state] == [[4, 1, 2, 32, 16]]
    for folder in ("ort", "iree"):
        got = Generator(tmp_path / folder).generate([11, 22, 33, 44, 55], 20)
        assert got.tokens == ref.tokens, folder
        # each call's last position (the decode module takes the prompt one token per call)
        assert max(float(np.abs(a[0, -1] - b[0, -1]).max() / np.abs(b[0, -1]).max())
                   for a, b in zip(got.logits, ref.logits)) < 1e-4, folder
    with pytest.raises(BackendError, match="--stateful: cache 'past_key_values.0.key' has the symbolic dim 'batch_size'.*"
                                           "--dim batch_size=1"):
        apply(OPTIMUM_QWEN3_MOE, tmp_path / "x", plugins="kv", backend="iree", options={"kv": {"max_seq": 32}, "stateful": True})


def test_bad_options_fail_with_one_line(qwen2_moe_tiny):
    g = onnx_io.load(qwen2_moe_tiny)
    snap = onnx_io.to_model(g).SerializeToString()
    with pytest.raises(PluginError, match="kv: unknown option 'max_len'; options: max_seq"):
        run_plugin(g, KVCache(), RewriteContext(options={"kv": {"max_len": 8}}))
    with pytest.raises(PluginError, match=r"kv: max_seq 0 \(--max-seq or --opt kv.max_seq\): must be positive"):
        run_plugin(g, KVCache(), RewriteContext(options={"kv": {"max_seq": 0}}))
    assert onnx_io.to_model(g).SerializeToString() == snap  # left as it was
