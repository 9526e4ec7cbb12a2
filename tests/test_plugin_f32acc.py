"""The ``f32acc`` plugin: f16 MatMul -> Cast(f32) x2, MatMul in f32, Cast back to f16 (seed item A7).

ONNX Runtime CPU (and IREE llvm-cpu) already accumulate f16 MatMuls in f32, so running the original model
cannot show an f16 accumulator's failure: the semantics are checked against a numpy reference that
accumulates in f16, one product at a time. Selection is checked on the real fp16 graphs: the transformers
export of Qwen3-MoE (GQA, KV heads repeated before the transpose) and the seed form with GQA, where
``attention`` must pick exactly the Q x K^T MatMul of each layer and nothing else.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper

import qwen_moe
import seed_form
from rewrite.backends.ort import OrtRunner
from rewrite.core import onnx_io
from rewrite.core.driver import run_plugin
from rewrite.core.shapes import infer_shapes
from rewrite.errors import PluginError
from rewrite.pipeline import RewriteContext
from rewrite.plugins.f32acc import F32Acc
from rewrite.verify import compare



def _ctx(mode: str | None) -> RewriteContext:
    return RewriteContext(options={} if mode is None else {"f32acc": {"mode": mode}})


def _rewrite(model, mode: str | None):
    g = onnx_io.load(model)
    infer_shapes(g)
    before = onnx_io.to_model(g).SerializeToString(deterministic=True)
    rep = run_plugin(g, F32Acc(), _ctx(mode))
    return g, rep, before


def _ser(g) -> bytes:
    return onnx_io.to_model(g).SerializeToString(deterministic=True)


# ------------------------------------------------------------------ semantics
def _matmul_model(k: int) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")], "main_graph",
                          [helper.make_tensor_value_info("a", TP.FLOAT16, [3, k]), helper.make_tensor_value_info("b", TP.FLOAT16, [k, 2])],
                          [helper.make_tensor_value_info("y", TP.FLOAT16, [3, 2])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _f16_accumulated(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b with an f16 accumulator: each product rounded to f16 and added in f16, in order of k."""
    acc = np.zeros((a.shape[0], b.shape[1]), np.float16)
    with np.errstate(over="ignore"):
        for k in range(a.shape[1]):
            acc = (acc + np.multiply.outer(a[:, k], b[k, :]).astype(np.float16)).astype(np.float16)
    return acc


def test_rewritten_matmul_accumulates_in_f32(tmp_path):
    """Row 0: 32 products of +4096 then 31 of -4096 and one of -4032, total 64: an f16 accumulator overflows
    to inf at the 16th product. Rows 1-2: small integers whose f32 sums are exact and exceed 2048, where f16
    accumulation rounds. The rewritten graph gives the exact (f32-accumulated) value in every element."""
    k = 64
    rng = np.random.default_rng(0)
    a = rng.integers(-40, 41, (3, k)).astype(np.float16)
    b = rng.integers(-40, 41, (k, 2)).astype(np.float16)
    a[0] = 64
    b[:, 0] = [64] * 32 + [-64] * 31 + [-63]
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(exact).max() < 65504 and exact[0, 0] == 64
    f16acc = _f16_accumulated(a, b)
    assert np.isinf(f16acc[0, 0]) and np.count_nonzero(f16acc[1:] != exact[1:].astype(np.float16)) > 0

    g, rep, _ = _rewrite(_matmul_model(k), "all")
    assert rep.rules["f32-accumulate"].matches == 1
    (mm,) = g.nodes_by_op("MatMul")
    assert [g.values[i].dtype for i in mm.inputs] == [TP.FLOAT, TP.FLOAT] and g.values["y"].dtype == TP.FLOAT16
    assert g.summary() == {"Cast": 3, "MatMul": 1}
    onnx.save(onnx_io.to_model(g), tmp_path / "f32acc.onnx")
    onnx.save(_matmul_model(k), tmp_path / "orig.onnx")
    got = OrtRunner(tmp_path / "f32acc.onnx").run({"a": a, "b": b})["y"]
    np.testing.assert_array_equal(got, exact.astype(np.float16))
    assert got.dtype == np.float16
    # ORT's own f16 MatMul already accumulates in f32: same result (why this plugin is for GPU backends)
    np.testing.assert_array_equal(OrtRunner(tmp_path / "orig.onnx").run({"a": a, "b": b})["y"], got)


# ------------------------------------------------------------------ selection on real graphs
@pytest.fixture(scope="module")
def qwen3_fp16(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE (GQA: 4 query heads, 2 KV heads) exported in fp16 by transformers' exporter."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = qwen_moe.build_model("qwen3_moe", "tiny", torch.float16)
        return qwen_moe.export_hf(model, tmp_path_factory.mktemp("qwen3_moe_fp16"))


@pytest.fixture(scope="module")
def seed_gqa_fp16(tmp_path_factory) -> Path:
    model, _ = seed_form.build_seed_model("fp16", kv_heads=2)
    return seed_form.save_seed_model(model, tmp_path_factory.mktemp("seed_gqa") / "seed.onnx")


def _qk_matmuls(model: onnx.ModelProto) -> list[str]:
    """Q x K^T read off the graph: a MatMul whose B is a Transpose(perm=[0, 1, 3, 2]) of rank-4 K."""
    prod = {o: n for n in model.graph.node for o in n.output}
    out = []
    for n in model.graph.node:
        t = prod.get(n.input[1]) if n.op_type == "MatMul" else None
        if t is not None and t.op_type == "Transpose" and [list(a.ints) for a in t.attribute if a.name == "perm"] == [[0, 1, 3, 2]]:
            out.append(n.name)
    return out


def _f16_matmuls(g) -> int:
    return sum(g.values[n.inputs[0]].dtype == TP.FLOAT16 for n in g.nodes_by_op("MatMul"))


@pytest.mark.parametrize("which", ["qwen3_fp16", "seed_gqa_fp16"])
def test_attention_mode_picks_exactly_the_qk_matmul_of_each_layer(which, request):
    path = request.getfixturevalue(which)
    want = _qk_matmuls(onnx.load(path))
    assert len(want) == 2  # one per layer
    g, rep, _ = _rewrite(path, None)  # default mode: attention
    r = rep.rules["f32-accumulate-qk"]
    assert list(rep.rules) == ["f32-accumulate-qk"] and r.matches == 2
    promoted = sorted(n.name for n in g.nodes_by_op("MatMul") if n.rule == "f32acc/f32-accumulate-qk")
    assert len(promoted) == 2 and all(g.values[n.inputs[0]].dtype == TP.FLOAT for n in g.nodes_by_op("MatMul") if n.rule)
    anchors = {n.name.rsplit("/MatMul", 1)[0] for n in g.nodes_by_op("MatMul") if n.rule}  # named after the node replaced
    assert anchors == set(want)
    if which == "seed_gqa_fp16":  # the 6 expert MatMuls with Transpose(perm=[0, 2, 1]) B are not attention
        assert len(r.refusals["the product does not reach a Softmax over its last axis (not attention scores)"]) == 6
    onnx.checker.check_model(onnx_io.to_model(g), full_check=True)


def test_all_mode_promotes_every_f16_matmul_and_outputs_agree(seed_gqa_fp16, tmp_path):
    g0 = onnx_io.load(seed_gqa_fp16)
    infer_shapes(g0)
    n16 = _f16_matmuls(g0)
    g, rep, _ = _rewrite(seed_gqa_fp16, "all")
    assert n16 == 31 and rep.rules["f32-accumulate"].matches == n16  # 32 MatMuls, the RoPE one is f32
    assert _f16_matmuls(g) == 0 and g.summary()["MatMul"] == 32
    onnx.save(onnx_io.to_model(g), tmp_path / "all.onnx")
    feeds = {"input_ids": np.array([[7, 300, 12, 45]], np.int64), "seq_position": np.array([0], np.int64)}
    feeds |= {f"past_{kv}_{i}": np.zeros([1, 2, 64, 64], np.float16) for kv in ("key", "value") for i in range(2)}
    want = OrtRunner(seed_gqa_fp16, optimize="basic").run(feeds)
    got = OrtRunner(tmp_path / "all.onnx", optimize="basic").run(feeds)
    assert all(compare(k, got[k], want[k]).ok for k in want)  # f16 tolerance 1e-2 (normwise)


# ------------------------------------------------------------------ what stays untouched
def test_f32_graph_none_mode_and_non_transposed_matmuls_untouched(qwen2_moe_tiny, qwen3_fp16):
    g, rep, before = _rewrite(qwen2_moe_tiny, "all")  # fp32 export
    assert rep.matches == 0 and _ser(g) == before
    assert list(rep.rules["f32-accumulate"].refusals) == ["MatMul input is FLOAT, not FLOAT16"]
    g, rep, before = _rewrite(qwen3_fp16, "none")
    assert rep.matches == 0 and _ser(g) == before
    g, rep, _ = _rewrite(qwen3_fp16, "attention")
    g0 = onnx_io.load(qwen3_fp16)
    infer_shapes(g0)
    refused = rep.rules["f32-accumulate-qk"].refusals["B is not a Transpose swapping the last two axes (not Q x K^T)"]
    assert len(refused) == _f16_matmuls(g0) - 2  # probs x V, projections, experts: every other f16 MatMul


def test_bad_mode_is_a_one_line_error_and_leaves_the_graph(qwen3_fp16):
    g = onnx_io.load(qwen3_fp16)
    infer_shapes(g)
    before = _ser(g)
    with pytest.raises(PluginError, match=r"f32acc: mode must be one of attention, all, none, got 'qk'") as e:
        run_plugin(g, F32Acc(), _ctx("qk"))
    assert "\n" not in str(e.value) and _ser(g) == before
    with pytest.raises(PluginError, match=r"f32acc: unknown option 'modes'; options: mode"):
        run_plugin(g, F32Acc(), RewriteContext(options={"f32acc": {"modes": "all"}}))
