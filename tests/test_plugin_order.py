"""Plugins run in one order whatever the order of --plugins: declared constraints, then registration order."""

from __future__ import annotations

import itertools

import pytest

from rewrite.errors import PluginOrderError
from rewrite.plugins.base import Plugin
from rewrite.plugins.manager import _ordered, select_plugins


@pytest.mark.parametrize("names", list(itertools.permutations(["topk", "quant4", "moe", "legalize"])))
def test_any_order_of_the_same_plugins_runs_the_same(names):
    assert [p.short for p in select_plugins(list(names))] == ["quant4", "topk", "moe", "legalize"]


def test_unconstrained_plugins_keep_registration_order():
    assert [p.short for p in select_plugins("kv,expand,cast")] == ["cast", "expand", "kv"]


def test_contradictory_declarations_name_the_plugins():
    class A(Plugin):
        short = "a"
        runs_before = ("b",)

    class B(Plugin):
        short = "b"
        runs_before = ("a",)

    with pytest.raises(PluginOrderError, match="a after b, b after a"):
        _ordered([A(), B()])


def test_declarations_about_unselected_plugins_are_ignored():
    class A(Plugin):
        short = "a"
        runs_after = ("not-selected",)

    assert [p.short for p in _ordered([A()])] == ["a"]


@pytest.mark.slow
def test_one_plugin_list_serves_both_backends(qwen2_moe_tiny, qwen2_moe_tiny_applied, tmp_path):
    """``quant4,cast,legalize,expand,kv,topk,moe`` for ort keeps the quantized MatMuls as MatMulNBits (legalize
    is not run there; it decomposed them into 13 float MatMuls), and for iree fuses the INT4 experts with their
    4-bit weights (legalize after moe; before, moe fused the decomposed float weights)."""
    import collections

    import onnx

    from rewrite.pipeline import apply
    from rewrite.verify import verify

    plugins = "quant4,cast,legalize,expand,kv,topk,moe"
    q4 = tmp_path / "q4"
    apply(qwen2_moe_tiny, q4, plugins="quant4", backend="ort")
    for backend in ("ort", "iree"):
        out, m = qwen2_moe_tiny_applied(plugins, backend)  # apply(qwen2_moe_tiny, out, plugins=plugins, backend=backend)
        assert [r["plugin"] for r in m.report] == ["cast", "expand", "kv", "quant4", "topk", "moe", "legalize"]
        legalize = next(r for r in m.report if r["plugin"] == "legalize")
        model = onnx.load(out / "model.onnx", load_external_data=False)
        ops = collections.Counter(n.op_type for n in model.graph.node)
        if backend == "ort":
            assert legalize["matches"] == 0 and legalize["notes"][0].startswith("not run")
            assert ops["MatMulNBits"] == 14 and ops["QMoE"] == 2 and ops["MatMul"] == 5  # 4 in attention, the LM head
        else:
            assert legalize["matches"] > 0
            fused = [n for n in model.graph.node if n.op_type == "FusedMoE"]
            assert len(fused) == 2 and all(a.i == 128 for n in fused for a in n.attribute if a.name == "block_size")
        assert all(c.ok for c in verify(q4 / "model.onnx", out))
