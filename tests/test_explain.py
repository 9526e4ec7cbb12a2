"""``rewrite explain`` (best partial match and stopping reason per rule), ``apply --dry-run`` and ``--expect``."""

from __future__ import annotations

import json
import subprocess
import sys

import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

from rewrite.core import onnx_io
from rewrite.core.pattern import AttrVar, Var
from rewrite.core.rules import rule
from rewrite.core.shapes import infer_shapes
from rewrite.errors import RewriteError
from rewrite.explain import explain, explain_rule, parse_expect, shortfalls


def rewrite(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rewrite.cli", *map(str, args)], capture_output=True, text=True, timeout=300)


def _casts_model() -> onnx.ModelProto:
    """A lossy f32->f16->f32 pair ('lossy_in' -> 'lossy_out') and a Cast fed by a Relu ('last')."""
    nodes = [
        helper.make_node("Cast", ["X"], ["W2"], to=TP.FLOAT16, name="lossy_in"),
        helper.make_node("Cast", ["W2"], ["B2"], to=TP.FLOAT, name="lossy_out"),
        helper.make_node("Relu", ["B2"], ["R"], name="relu"),
        helper.make_node("Cast", ["R"], ["Y"], to=TP.FLOAT16, name="last"),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TP.FLOAT, [4])], [helper.make_tensor_value_info("Y", TP.FLOAT16, [4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def test_refused_full_match_beats_partial_matches_and_names_the_pairs():
    (ex,) = explain(_casts_model(), "cast")
    assert (ex.status, ex.matches, ex.anchor) == ("refused", 0, "lossy_out")
    assert ex.pairs == [("outer", "lossy_out"), ("inner", "lossy_in")]
    assert (ex.reason, ex.node) == ("Cast FLOAT->FLOAT16 is lossy", "lossy_in")


def test_node_restricts_to_attempts_involving_it():
    (ex,) = explain(_casts_model(), "cast", node="last")
    assert (ex.status, ex.anchor, ex.pairs) == ("partial", "last", [("outer", "last")])
    assert (ex.reason, ex.node) == ("'relu' (Relu) is not inner", "relu")
    (ex,) = explain(_casts_model(), "cast", node="relu")  # not an anchor, but where 'last' stopped
    assert ex.anchor == "last"
    with pytest.raises(RewriteError, match="no node named 'nope'"):
        explain(_casts_model(), "cast", node="nope")


def test_no_anchor_and_unnamed_pattern_nodes_are_numbered():
    legalize = {e.rule: e for e in explain(_casts_model(), "legalize")}
    assert legalize["dequantize-block"].status == "no-anchor"
    assert legalize["dequantize-block"].reason == "no node of op type DequantizeLinear in the graph"

    @rule("three-casts")
    def three(op, x):
        return op.Cast(op.Cast(op.Cast(x, to=AttrVar("a")), to=AttrVar("b")), to=AttrVar("c"))

    g = onnx_io.load(_casts_model())
    infer_shapes(g)
    ex = explain_rule(g, three)
    assert ex.pairs == [("Cast#1", "lossy_out"), ("Cast#2", "lossy_in")]
    assert ex.reason == "'X' is a graph input or initializer, pattern wants the output of Cast"


def test_deepest_failure_reports_the_constraint_that_stopped_it():
    @rule("add-one")
    def add_one(op, x, one=Var("one", dtype=TP.FLOAT16)):
        return op.Add(op.Relu(x, _name="relu"), one, _name="add")

    nodes = [helper.make_node("Relu", ["X"], ["R"], name="r"), helper.make_node("Add", ["R", "c"], ["Y"], name="a")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TP.FLOAT, [4]), helper.make_tensor_value_info("c", TP.FLOAT, [4])],
                          [helper.make_tensor_value_info("Y", TP.FLOAT, [4])])
    graph = onnx_io.load(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]))
    infer_shapes(graph)
    ex = explain_rule(graph, add_one)
    assert ex.status == "partial" and ex.pairs == [("add", "a"), ("relu", "r")]
    assert ex.reason == "'one' (c) has dtype FLOAT[4], pattern wants 10"


@pytest.fixture(scope="module")
def altered_seed(tmp_path_factory):
    """The seed form with an Identity inserted before layer 1's second expert DequantizeLinear."""
    import seed_form

    model, _ = seed_form.build_seed_model("fp32")
    g = model.graph
    i, dq = next((i, n) for i, n in enumerate(g.node) if n.name == "/model/layers.1/mlp/DequantizeLinear_1")
    src = dq.input[0]
    dq.input[0] = src + "_altered"
    g.node.insert(i, helper.make_node("Identity", [src], [src + "_altered"], name="/model/layers.1/mlp/altered"))
    path = tmp_path_factory.mktemp("seed") / "altered.onnx"
    onnx.save(model, path)
    return path


def test_explain_cli_names_where_the_altered_layer_stopped(altered_seed, tmp_path):
    r = rewrite("explain", altered_seed, "--plugins", "legalize", "--node", "/model/layers.1/mlp/altered", "--json", tmp_path / "e.json")
    assert r.returncode == 0, r.stderr
    assert "legalize/exact-4bit-cast: fired 11 time(s) elsewhere; here it did not fire; best partial match 1/2 pattern nodes" in r.stdout
    assert "stopped: '/model/layers.1/mlp/altered' (Identity) is not narrow (at node '/model/layers.1/mlp/altered')" in r.stdout
    e = {d["rule"]: d for d in json.loads((tmp_path / "e.json").read_text())}
    assert e["exact-4bit-cast"]["matched"] == [["widen", e["exact-4bit-cast"]["anchor"]]]
    assert e["exact-4bit-cast"]["anchor"].startswith("/model/layers.1/mlp/DequantizeLinear_1/Cast")
    r = rewrite("explain", altered_seed, "--plugins", "legalize")  # without --node both rules fired somewhere
    assert r.returncode == 0 and "fired: legalize/dequantize-block x6, legalize/exact-4bit-cast x11" in r.stdout


def test_dry_run_writes_nothing_and_expect_fails_with_status_3(altered_seed, tmp_path):
    out = tmp_path / "out"
    r = rewrite("apply", altered_seed, "--plugins", "legalize", "--backend", "iree", "--dry-run", "-o", out, "--expect", "legalize/exact-4bit-cast=12", "--expect", "legalize=17")
    assert r.returncode == 3, r.stdout + r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert ("error: expected legalize/exact-4bit-cast=12 matches, got 11 (dequantize-block: 6, exact-4bit-cast: 11, "
            "empty-scatter-nd: 0, empty-scatter-elements: 0, scatter-nd-rows: 0, shared-splat-scatter-elements: 0, "
            "shared-splat-scatter-nd: 0, full-sort-topk: 0)") in r.stderr
    assert "legalize=17" not in r.stderr  # 6 + 11 = 17 is met
    assert "dry run: nothing written" in r.stdout
    r = rewrite("apply", altered_seed, "--plugins", "legalize", "--backend", "iree", "--dry-run", "--expect", "legalize=17", "--report", tmp_path / "r.json")
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert [(x["rule"], x["matches"]) for x in rep[0]["rules"]] == [("dequantize-block", 6), ("exact-4bit-cast", 11), ("empty-scatter-nd", 0),
                                                                  ("empty-scatter-elements", 0), ("scatter-nd-rows", 0),
                                                                  ("shared-splat-scatter-elements", 0), ("shared-splat-scatter-nd", 0), ("full-sort-topk", 0)]
    assert list(tmp_path.iterdir()) == [tmp_path / "r.json"]


def test_expect_with_apply_and_bad_specs(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_casts_model(), path)
    r = rewrite("apply", path, "--plugins", "cast", "-o", tmp_path / "o", "--expect", "cast=1", "--report", tmp_path / "r.json")
    assert r.returncode == 3 and "error: expected cast=1 matches, got 0 (cast-roundtrip: 0)" in r.stderr
    assert f"nothing lowered or written to {tmp_path / 'o'} except {tmp_path / 'r.json'}" in r.stderr
    assert not (tmp_path / "o").exists()  # stopped before lowering
    assert json.loads((tmp_path / "r.json").read_text())[0]["matches"] == 0
    r = rewrite("apply", path, "--plugins", "cast", "-o", tmp_path / "o", "--expect", "cast=0")
    assert r.returncode == 0 and (tmp_path / "o" / "model.onnx").exists()
    r = rewrite("apply", path, "--plugins", "cast", "--dry-run", "--expect", "cast=many")
    assert r.returncode == 2 and "--expect 'cast=many': expected PLUGIN=N" in r.stderr
    r = rewrite("apply", path, "--plugins", "cast")
    assert r.returncode == 2 and "missing option '-o'" in r.stderr


def test_shortfalls_counts_missing_plugins_and_rules_as_zero():
    reports = [{"plugin": "cast", "matches": 2, "rules": [{"rule": "cast-roundtrip", "matches": 2}]}]
    assert shortfalls(parse_expect(["cast=2", "cast/cast-roundtrip=2"]), reports) == []
    assert shortfalls({"moe": 24}, reports) == ["expected moe=24 matches, got 0 (plugin not run)"]
    assert shortfalls({"cast/other": 1}, reports) == ["expected cast/other=1 matches, got 0 (cast-roundtrip: 2)"]


def test_explain_names_the_altered_moe_layer():
    """The seed form's second MoE block with its router TopK switched to largest=0 (needs the 'moe' plugin)."""
    import seed_form

    from rewrite.plugins.manager import available_plugins

    if "moe" not in available_plugins():
        pytest.skip("the moe plugin is not registered in this tree")
    model, _ = seed_form.build_seed_model("fp32")
    topk = [n for n in model.graph.node if n.op_type == "TopK"][1]
    topk.attribute.append(helper.make_attribute("largest", 0))
    (seed,) = [e for e in explain(model, "moe", node=topk.name) if e.rule == "fused-moe-seed-int4"]
    assert (seed.matches, seed.status, seed.node) == (1, "refused", topk.name)
    assert "largest=0" in seed.reason
    assert ("gate_dq", "/model/layers.1/mlp/DequantizeLinear") in seed.pairs
    assert all("/layers.1/" in g for _, g in seed.pairs)


def test_a_pass_without_pattern_rules_explains_its_own_steps():
    """``quant4`` finds its weights itself (no pattern rules): explain lists each of its steps with the matches and
    the refusals its report recorded, instead of nothing."""
    import numpy as np
    from onnx import numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((256, 64)).astype(np.float32), "big"),
             numpy_helper.from_array(rng.standard_normal((64, 8)).astype(np.float32), "small")]
    nodes = [helper.make_node("MatMul", ["X", "big"], ["H"], name="mm_big"),
             helper.make_node("MatMul", ["H", "small"], ["Y"], name="mm_small")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TP.FLOAT, [2, 256])],
                          [helper.make_tensor_value_info("Y", TP.FLOAT, [2, 8])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    exps = {e.rule: e for e in explain(model, "quant4")}
    dense = exps["dense-weight"]
    assert (dense.status, dense.matches) == ("fired", 1)
    assert dense.refusals == [("512 elements < min_elements 4096", ["small"])]
    assert dense.lines() == ["quant4/dense-weight: fired 1 time(s)", "    refused 1x: 512 elements < min_elements 4096 (small)"]
    assert dense.to_json()["refusals"] == [{"reason": "512 elements < min_elements 4096", "nodes": ["small"]}]
    with pytest.raises(RewriteError, match="no node named 'nowhere' in the graph"):
        explain(model, "quant4", node="nowhere")  # a pass has no rule to check --node: explain does
    # nothing for it to quantize: the step says so (not "check refused a full match")
    tiny = helper.make_model(helper.make_graph([helper.make_node("Relu", ["X"], ["Y"], name="relu")], "g",
                                               [helper.make_tensor_value_info("X", TP.FLOAT, [2])],
                                               [helper.make_tensor_value_info("Y", TP.FLOAT, [2])]),
                             opset_imports=[helper.make_opsetid("", 21)])
    lines = [line for e in explain(tiny, "quant4") for line in e.lines()]
    assert lines and all(line.endswith("did not fire: the pass found nothing to rewrite") for line in lines), lines
