"""Lowerings by (abstract op, backend, target): declared by the ops, added through the ``rewrite_lowerings``
hook, checked by ``apply`` before it writes anything; output folders that hold their kernels and are the same
bytes on every run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rewrite.backends.iree_toolchain import COMPILE_CACHE_ENV
from rewrite.core.lowering import Lowering, LoweringError, LoweringRegistry
from rewrite.plugins.manager import lowering_registry
from rewrite.testing.conformance import registered_lowerings


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rewrite.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def _builtin_only():
    """The registry without lowerings installed packages add (``examples/cuda_router_lowering`` adds one)."""
    return LoweringRegistry(low for low in lowering_registry().all() if low.origin.startswith("rewrite."))


def test_builtin_ops_declare_their_targets():
    reg = _builtin_only()
    assert reg.targets_of("MoERouterTopK") == ["ort:cpu", "ort:cuda", "iree:llvm-cpu", "iree:cuda"]
    assert reg.targets_of("FusedMoE") == ["ort:cpu", "ort:cuda", "iree:llvm-cpu", "iree:cuda"]
    assert reg.targets_of("KVCacheUpdate") == ["ort:cpu", "ort:cuda", "iree:llvm-cpu", "iree:cuda"]


def test_registry_refuses_unknown_targets_and_two_claims_of_one_slot():
    with pytest.raises(LoweringError, match="backend 'iree' has no target 'rocm'; targets: llvm-cpu, cuda"):
        Lowering("X", "iree", ("rocm",), print, origin="pkg")
    reg = LoweringRegistry([Lowering("X", "iree", ("cuda",), print, origin="a")])
    with pytest.raises(LoweringError, match="two lowerings of X for iree:cuda: a and b"):
        reg.add(Lowering("X", "iree", ("cuda", "llvm-cpu"), repr, origin="b"))


def _double_model(path):
    """y = ai.rewrite::Double(x): an abstract op no plugin declares (no lowering for any target)."""
    import onnx
    from onnx import TensorProto, helper

    from rewrite.core.abstract_ops import DOMAIN

    g = helper.make_graph([helper.make_node("Double", ["x"], ["y"], domain=DOMAIN, name="double")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)], ir_version=10), path)
    return path


def test_a_target_without_a_lowering_stops_apply_with_one_line(tmp_path):
    r = _cli("apply", _double_model(tmp_path / "double.onnx"), "--backend", "iree", "--target", "cuda", "-o", tmp_path / "out")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line == ("error: abstract op Double (at node 'double') has no lowering for iree:cuda; it has lowerings for no "
                    "target (a plugin registers an op's lowerings by listing it in its abstract_ops: docs/writing-a-plugin.md)")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))] == []  # no folder, no staging left


def test_a_replacing_lowering_takes_the_slot_in_either_order():
    builtin, mine = Lowering("X", "iree", ("cuda",), print, origin="builtin"), Lowering("X", "iree", ("cuda",), repr, origin="pkg", replaces=True)
    for order in ([builtin, mine], [mine, builtin]):
        assert LoweringRegistry(order).get("X", "iree", "cuda") is mine
    with pytest.raises(LoweringError, match=r"two lowerings of X for iree:cuda: pkg and other \(both replace\)"):
        LoweringRegistry([mine, Lowering("X", "iree", ("cuda",), str, origin="other", replaces=True)])


def test_a_lowering_from_the_hook_fills_its_slot(tmp_path):
    """A lowering registered through ``rewrite_lowerings`` (as a package's entry point would) is what ``apply``
    uses for its target, and only while it is registered: here of an op no plugin declares, y = 2 x."""
    import numpy as np
    from onnx import TensorProto

    from rewrite.backends import load_runner
    from rewrite.core.rules import Builder
    from rewrite.pipeline import apply

    path = _double_model(tmp_path / "double.onnx")
    used = []

    def lower(graph, node):
        used.append(node.op_type)
        b = Builder(graph, "lower/Double", node.order, node.name)
        graph.replace_node(node, [b.op("Add", [node.inputs[0], node.inputs[0]], dtype=TensorProto.FLOAT, shape=(3,))])

    with pytest.raises(LoweringError, match="Double .* has no lowering for ort:cuda"):
        apply(path, tmp_path / "out", backend="ort", target="cuda")
    with registered_lowerings([Lowering("Double", "ort", ("cuda",), lower, origin="test")]):
        m = apply(path, tmp_path / "out", backend="ort", target="cuda")
    assert used == ["Double"]
    assert m.session["providers"] == ["CUDAExecutionProvider", "CPUExecutionProvider"] and m.session["optimize"] == "basic"
    assert lowering_registry().get("Double", "ort", "cuda") is None
    m.session["providers"] = ["CPUExecutionProvider"]  # run it here: the lowered graph is plain ONNX
    m.write(tmp_path / "out")
    got = load_runner(tmp_path / "out").run({"x": np.array([1, 2, 3], np.float32)})["y"]
    assert got.tolist() == [2, 4, 6]


def test_a_second_lowering_for_a_taken_slot_names_both_packages(qwen2_moe_tiny, tmp_path):
    from rewrite.pipeline import apply

    with registered_lowerings([Lowering("FusedMoE", "ort", ("cuda",), print, origin="test")]), \
            pytest.raises(LoweringError, match="two lowerings of FusedMoE for ort:cuda: rewrite.plugins.moe.lowering and test"):
        apply(qwen2_moe_tiny, tmp_path / "out", plugins="moe", backend="ort", target="cuda")


@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_two_runs_write_the_same_bytes(tmp_path, backend, qwen2_moe_tiny, monkeypatch):
    """Different output folder names and hash seeds, the same folder contents (kernels copied in, paths
    relative, value_info in a fixed order). Both runs compile: no module reused from a compile cache."""
    monkeypatch.delenv(COMPILE_CACHE_ENV, raising=False)
    plugins = "kv,topk,moe" if backend == "iree" else "quant4,kv,topk,moe"
    outs = []
    for k in (1, 2):
        out = tmp_path / f"out{k}"
        r = _cli("apply", qwen2_moe_tiny, "--plugins", plugins, "--backend", backend, "-o", out, env={"PYTHONHASHSEED": str(k)})
        assert r.returncode == 0, r.stderr
        outs.append(out)
    files = sorted(str(p.relative_to(outs[0])) for p in outs[0].rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(outs[1])) for p in outs[1].rglob("*") if p.is_file())
    if backend == "iree":
        assert any(f.startswith("kernels/") for f in files)
    differ = [f for f in files if (outs[0] / f).read_bytes() != (outs[1] / f).read_bytes()]
    assert differ == []


def test_a_package_whose_hook_returns_something_else_is_named(router_onnx, tmp_path):
    from rewrite.pipeline import apply

    with registered_lowerings(["not a lowering"]), pytest.raises(LoweringError, match=r"rewrite_lowerings\(\) of .* returned a list holding a str; expected a list of rewrite.core.lowering.Lowering"):
        apply(router_onnx, tmp_path / "out", plugins="topk", backend="ort")
    with registered_lowerings(["not a lowering"]):  # a graph without abstract ops needs no lowering at all
        apply(router_onnx, tmp_path / "plain", backend="ort")


def test_declaring_a_target_without_its_method_is_refused():
    from rewrite.core.abstract_ops import AbstractOp

    class Half(AbstractOp):
        op_type = "Half"
        iree_targets = ("cuda",)

    with pytest.raises(LoweringError, match="Half declares iree targets cuda but has no lower_iree"):
        Half().lowerings()


def test_the_builder_declares_an_abstract_ops_domain():
    """A rewrite's ``b.op(..., domain=DOMAIN)`` declares the domain in the model's opset imports (the checker and
    ONNX Runtime refuse a node of an undeclared domain); ONNX's own domain is left alone."""
    from onnx import TensorProto, helper

    from rewrite.core import onnx_io
    from rewrite.core.abstract_ops import DOMAIN
    from rewrite.core.rules import Builder

    g = onnx_io.load(helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="r")], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]), opset_imports=[helper.make_opsetid("", 17)]))
    b = Builder(g, "mine/r", 0.0, "r")
    assert g.opset(DOMAIN) is None
    b.op("Neg", ["x"])
    b.op("Double", ["x"], domain=DOMAIN, dtype=TensorProto.FLOAT, shape=[2])
    b.op("Double", ["x"], domain=DOMAIN, dtype=TensorProto.FLOAT, shape=[2])
    assert g.opset(DOMAIN) == 1 and [o.domain for o in g.model_shell.opset_import] == ["", DOMAIN]
