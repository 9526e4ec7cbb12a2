"""The rewrite driver's contract: values used outside a match survive, the model interface is kept, created
nodes carry their rule, rule order, fixed point, determinism, all-or-nothing plugins, refusals, dry runs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from rewrite.core import onnx_io
from rewrite.core.driver import PluginReport, apply_rules, run_plugin
from rewrite.core.ir import RULE_TAG, Graph
from rewrite.core.pattern import AttrVar
from rewrite.core.rules import rule
from rewrite.errors import PluginError
from rewrite.plugins.base import Plugin
from rewrite.plugins.cast_roundtrip import CastRoundtrip, cast_roundtrip

F, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
X16 = np.array([-65504.0, -1.5, 0.0, 1e-7, 3.140625, 65504.0], np.float16)
XF = np.array([1.0, -2.0, 0.5, 4.0, -0.25, 3.0], np.float32)


# ------------------------------------------------------------------ helpers
def _vi(name, elem=F, shape=(6,)):
    return helper.make_tensor_value_info(name, elem, list(shape))


def _model(nodes, inputs, outputs, inits=(), value_info=(), opset=17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits), value_info=list(value_info))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="tests")
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _cast(src, dst, to, name):
    return helper.make_node("Cast", [src], [dst], to=to, name=name)


def _ser(g: Graph) -> bytes:
    return onnx_io.to_model(g).SerializeToString(deterministic=True)


def _ops(g: Graph) -> list[tuple[str, str]]:
    return [(n.name, n.op_type) for n in g.topo_nodes()]


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _same_results(before: onnx.ModelProto, g: Graph, feeds: dict) -> onnx.ModelProto:
    after = onnx_io.to_model(g)
    onnx.checker.check_model(after, full_check=True)
    assert [o.SerializeToString() for o in after.graph.output] == [o.SerializeToString() for o in before.graph.output]
    assert [i.SerializeToString() for i in after.graph.input] == [i.SerializeToString() for i in before.graph.input]
    for a, b in zip(_run(before, feeds), _run(after, feeds), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    return after


class _Plugin(Plugin):
    name = "test-plugin"
    short = "tp"

    def __init__(self, *rules):
        self._rules = list(rules)

    @property
    def rules(self):
        return self._rules


def _apply(g, *rules, plugin="tp", dry_run=False):
    report = PluginReport(plugin)
    n = apply_rules(g, list(rules), plugin, report, dry_run=dry_run)
    return n, report


# -------------------------------------------------------------- rules used
def _div_to_mul():
    """Div(x, y) -> Mul(x, Reciprocal(y)): creates two nodes."""

    @rule("div-to-mul")
    def r(op, x, y):
        return op.Div(x, y)

    @r.rewrite
    def _(m, b):
        return b.op("Mul", [m["x"], b.op("Reciprocal", [m["y"]])])

    return r


def _add_self():
    """Add(x, x) -> Mul(x, 2): one new node and one initializer."""

    @rule("add-self")
    def r(op, x):
        return op.Add(x, x)

    @r.rewrite
    def _(m, b):
        return b.op("Mul", [m["x"], b.const(np.float32(2.0), "two")])

    return r


def _div_model(n=3):
    nodes, outs = [], []
    for k in range(n):
        nodes.append(helper.make_node("Div", ["X", "D"], [f"q{k}"], name=f"div{k}"))
        nodes.append(helper.make_node("Neg", [f"q{k}"], [f"Y{k}"], name=f"neg{k}"))
        outs.append(_vi(f"Y{k}"))
    return _model(nodes, [_vi("X"), _vi("D")], outs)


# ------------------------------------------------ values used outside the match
def _roundtrip_model(extra_consumer: bool):
    nodes = [
        _cast("X", "w", F, "c1"),
        _cast("w", "n", F16, "c2"),
        helper.make_node("Neg", ["n"], ["Y"], name="neg"),
    ]
    outs = [_vi("Y", F16)]
    if extra_consumer:
        nodes.append(helper.make_node("Relu", ["w"], ["Z"], name="relu"))
        outs.append(_vi("Z"))
    return _model(nodes, [_vi("X", F16)], outs)


def test_inner_cast_with_another_consumer_is_kept():
    model = _roundtrip_model(extra_consumer=True)
    g = onnx_io.load(model)
    n, report = _apply(g, cast_roundtrip, plugin="cast")
    assert n == 1
    assert _ops(g) == [("c1", "Cast"), ("neg", "Neg"), ("relu", "Relu")]
    assert g.find_node("neg").inputs == ["X"] and g.find_node("relu").inputs == ["w"]
    rep = report.rule("cast-roundtrip")
    assert (rep.matches, rep.nodes_removed, rep.nodes_added) == (1, 1, 0)
    _same_results(model, g, {"X": X16})


def test_inner_cast_without_another_consumer_is_removed():
    model = _roundtrip_model(extra_consumer=False)
    g = onnx_io.load(model)
    n, report = _apply(g, cast_roundtrip, plugin="cast")
    assert n == 1
    assert _ops(g) == [("neg", "Neg")] and g.find_node("neg").inputs == ["X"]
    assert report.rule("cast-roundtrip").nodes_removed == 2
    assert "w" not in g.values and "n" not in g.values
    _same_results(model, g, {"X": X16})


# ------------------------------------------------------- model interface kept
def test_graph_output_replaced_by_graph_input_gets_an_identity():
    model = _model([_cast("X", "w", F, "c1"), _cast("w", "Y", F16, "c2")], [_vi("X", F16)], [_vi("Y", F16)])
    g = onnx_io.load(model)
    n, report = _apply(g, cast_roundtrip, plugin="cast")
    assert n == 1 and (report.rule("cast-roundtrip").nodes_removed, report.rule("cast-roundtrip").nodes_added) == (2, 1)
    assert g.outputs == ["Y"] and g.inputs == ["X"]
    ident = g.find_node("Y_identity")
    assert _ops(g) == [("Y_identity", "Identity")]
    assert (ident.inputs, ident.outputs, ident.rule) == (["X"], ["Y"], "cast/cast-roundtrip")
    after = _same_results(model, g, {"X": X16})
    assert [(p.key, p.value) for p in after.graph.node[0].metadata_props] == [(RULE_TAG, "cast/cast-roundtrip")]


def test_graph_output_replaced_by_a_new_node_output_is_renamed():
    model = _model([helper.make_node("Add", ["X", "X"], ["Y"], name="add")], [_vi("X")], [_vi("Y")])
    g = onnx_io.load(model)
    assert _apply(g, _add_self())[0] == 1
    assert g.outputs == ["Y"]
    (mul,) = g.topo_nodes()
    assert (mul.op_type, mul.outputs, mul.rule) == ("Mul", ["Y"], "tp/add-self")
    assert mul.inputs[0] == "X" and g.const(mul.inputs[1]).tolist() == 2.0
    after = _same_results(model, g, {"X": XF})
    assert [n.op_type for n in after.graph.node] == ["Mul"]


def test_graph_output_that_is_also_read_inside_keeps_its_name():
    # Y is a graph output and feeds another node; both readers see the replacement
    model = _model(
        [helper.make_node("Add", ["X", "X"], ["Y"], name="add"), helper.make_node("Neg", ["Y"], ["Z"], name="neg")],
        [_vi("X")],
        [_vi("Y"), _vi("Z")],
    )
    g = onnx_io.load(model)
    assert _apply(g, _add_self())[0] == 1
    assert g.outputs == ["Y", "Z"] and g.find_node("neg").inputs == ["Y"]
    assert g.producer_node("Y").op_type == "Mul"
    _same_results(model, g, {"X": XF})


# ----------------------------------------------------------------- rule tags
def test_rule_name_recorded_on_every_created_node():
    model = _div_model(2)
    g = onnx_io.load(model)
    assert _apply(g, _div_to_mul())[0] == 2
    created = [n for n in g.topo_nodes() if n.op_type in ("Mul", "Reciprocal")]
    assert sorted(n.op_type for n in created) == ["Mul", "Mul", "Reciprocal", "Reciprocal"]
    assert all(n.rule == "tp/div-to-mul" for n in created)
    assert [n.rule for n in g.topo_nodes() if n.op_type == "Neg"] == [None, None]
    after = _same_results(model, g, {"X": XF, "D": np.array([2.0, -4.0, 0.5, 8.0, 1.0, -0.125], np.float32)})
    tags = {n.name: [(p.key, p.value) for p in n.metadata_props] for n in after.graph.node}
    assert sorted(tags.items()) == sorted(
        (n.name, [("rewrite.rule", "tp/div-to-mul")] if n.op_type != "Neg" else []) for n in g.topo_nodes()
    )


# -------------------------------------------------------------------- order
def _cast_pair_model():
    return _model(
        [_cast("X", "w", F, "c1"), _cast("w", "n", F16, "c2"), helper.make_node("Relu", ["n"], ["Y"], name="relu")],
        [_vi("X", F16)],
        [_vi("Y", F16)],
    )


def _small_cast_rule(benefit=None):
    """One node, overlapping cast-roundtrip's outer Cast: Cast(y, to=FLOAT16) -> CastLike(y, f16 scalar)."""

    @rule("cast-to-castlike", benefit=benefit)
    def r(op, y):
        return op.Cast(y, to=F16)

    @r.rewrite
    def _(m, b):
        return b.op("CastLike", [m["y"], b.const(np.float16(0), "like")])

    return r


def _roundtrip_rule(benefit=None):
    @rule("roundtrip", benefit=benefit)
    def r(op, x):
        return op.Cast(op.Cast(x, to=AttrVar("wide")), to=AttrVar("narrow"))

    @r.check
    def _(m):
        if m.value("x").dtype != m.attr("narrow"):
            return "not a round trip"

    @r.rewrite
    def _(m, b):
        return m["x"]

    return r


def test_larger_pattern_wins_by_default():
    small, big = _small_cast_rule(), _roundtrip_rule()
    assert (small.benefit, big.benefit) == (1, 2)
    model = _cast_pair_model()
    g = onnx_io.load(model)
    n, report = _apply(g, small, big)  # registered first, but smaller
    assert n == 1
    assert _ops(g) == [("relu", "Relu")] and g.find_node("relu").inputs == ["X"]
    assert (report.rule("roundtrip").matches, report.rule("cast-to-castlike").matches) == (1, 0)
    _same_results(model, g, {"X": X16})


def test_explicit_benefit_changes_the_winner():
    model = _cast_pair_model()
    g = onnx_io.load(model)
    n, report = _apply(g, _roundtrip_rule(), _small_cast_rule(benefit=5))
    assert n == 1
    assert [op for _, op in _ops(g)] == ["Cast", "CastLike", "Relu"]
    assert g.find_node("c1") is not None and g.find_node("c2") is None
    assert (report.rule("roundtrip").matches, report.rule("cast-to-castlike").matches) == (0, 1)
    _same_results(model, g, {"X": X16})


@pytest.mark.parametrize("first", ["small", "big"])
def test_equal_benefit_keeps_registration_order(first):
    small, big = _small_cast_rule(benefit=2), _roundtrip_rule()
    g = onnx_io.load(_cast_pair_model())
    _, report = _apply(g, *((small, big) if first == "small" else (big, small)))
    winner = "cast-to-castlike" if first == "small" else "roundtrip"
    assert {k: r.matches for k, r in report.rules.items()} == {"cast-to-castlike": winner == "cast-to-castlike", "roundtrip": winner == "roundtrip"}


# ---------------------------------------------------------------- fixed point
def test_nested_cast_roundtrips_collapse_to_a_fixed_point():
    chain = [F, F16, F, F16, F, F16]  # f16 -> f32 -> f16 -> f32 -> f16 -> f32 -> f16
    nodes, src = [], "X"
    for k, to in enumerate(chain):
        nodes.append(_cast(src, f"v{k}", to, f"c{k}"))
        src = f"v{k}"
    nodes.append(helper.make_node("Neg", [src], ["Y"], name="neg"))
    model = _model(nodes, [_vi("X", F16)], [_vi("Y", F16)])
    g = onnx_io.load(model)
    n, report = _apply(g, cast_roundtrip, plugin="cast")
    assert n == 3
    rep = report.rule("cast-roundtrip")
    assert (rep.matches, rep.nodes_removed, rep.nodes_added) == (3, 6, 0)
    assert _ops(g) == [("neg", "Neg")] and g.find_node("neg").inputs == ["X"]
    _same_results(model, g, {"X": X16})
    # applying again finds nothing: a fixed point
    assert _apply(g, cast_roundtrip, plugin="cast")[0] == 0


def test_fixed_point_runs_another_pass_when_a_later_rule_creates_a_match():
    @rule("drop-identity")
    def drop_identity(op, x):
        return op.Identity(x)

    @drop_identity.rewrite
    def _(m, b):
        return m["x"]

    # the round trip (benefit 2) is only visible after drop-identity (benefit 1) ran in the first pass
    model = _model(
        [
            _cast("X", "w", F, "c1"),
            helper.make_node("Identity", ["w"], ["i"], name="ident"),
            _cast("i", "n", F16, "c2"),
            helper.make_node("Neg", ["n"], ["Y"], name="neg"),
        ],
        [_vi("X", F16)],
        [_vi("Y", F16)],
    )
    g = onnx_io.load(model)
    n, report = _apply(g, drop_identity, cast_roundtrip)
    assert n == 2
    assert (report.rule("drop-identity").matches, report.rule("cast-roundtrip").matches) == (1, 1)
    assert _ops(g) == [("neg", "Neg")] and g.find_node("neg").inputs == ["X"]
    _same_results(model, g, {"X": X16})


# -------------------------------------------------------------- determinism
def test_two_loads_of_the_same_model_give_identical_output():
    model = _div_model(3)
    outs = []
    for _ in range(2):
        g = onnx_io.load(onnx.load_from_string(model.SerializeToString()))
        assert _apply(g, _add_self(), _div_to_mul())[0] == 3
        outs.append(onnx_io.to_model(g).SerializeToString())
    assert outs[0] == outs[1]
    names = [(n.name, n.op_type) for n in onnx.load_from_string(outs[0]).graph.node]
    assert [op for _, op in names] == ["Reciprocal", "Mul", "Neg"] * 3
    assert len({nm for nm, _ in names}) == 9


# ------------------------------------------------------------ all-or-nothing
def test_plugin_that_raises_leaves_the_graph_unchanged():
    calls = []

    @rule("div-to-mul")
    def r(op, x, y):
        return op.Div(x, y)

    @r.rewrite
    def _(m, b):
        calls.append(m.anchor.name)
        if len(calls) == 2:
            b.op("Neg", [m["x"]])  # a half-built replacement must vanish too
            raise ValueError("boom")
        return b.op("Mul", [m["x"], b.op("Reciprocal", [m["y"]])])

    model = _div_model(3)
    g = onnx_io.load(model)
    before = onnx_io.to_model(g).SerializeToString()
    with pytest.raises(PluginError) as ei:
        run_plugin(g, _Plugin(r))
    assert calls == ["div0", "div1"]
    assert str(ei.value) == "plugin 'tp', rule 'div-to-mul', at node 'div1': ValueError: boom (graph left unchanged by this plugin)"
    assert (ei.value.plugin, ei.value.rule, ei.value.node) == ("tp", "div-to-mul", "div1")
    assert onnx_io.to_model(g).SerializeToString() == before
    assert onnx_io.to_model(g).SerializeToString() == onnx_io.to_model(onnx_io.load(model)).SerializeToString()
    # the restored graph is fully usable
    report = run_plugin(g, _Plugin(_div_to_mul()))
    assert report.matches == 3
    _same_results(model, g, {"X": XF, "D": np.array([2.0, -4.0, 0.5, 8.0, 1.0, -0.125], np.float32)})


def test_rewrite_returning_a_bad_value_is_a_plugin_error():
    @rule("bad")
    def r(op, x):
        return op.Neg(x)

    @r.rewrite
    def _(m, b):
        return "no_such_value"

    model = _roundtrip_model(extra_consumer=False)
    g = onnx_io.load(model)
    before = _ser(g)
    with pytest.raises(PluginError, match=r"^plugin 'tp', rule 'bad', at node 'neg': RewriteError: rewrite returned unknown value 'no_such_value'"):
        run_plugin(g, _Plugin(r))
    assert _ser(g) == before


# ----------------------------------------------------------------- refusals
def test_refusal_is_reported_with_reason_and_node_and_changes_nothing():
    # f32 -> f16 -> f32 rounds: never removed
    model = _model(
        [_cast("X", "h", F16, "narrow"), _cast("h", "w", F, "widen"), helper.make_node("Neg", ["w"], ["Y"], name="neg")],
        [_vi("X")],
        [_vi("Y")],
    )
    g = onnx_io.load(model)
    before = _ser(g)
    report = run_plugin(g, CastRoundtrip())
    rep = report.rule("cast-roundtrip")
    assert rep.matches == 0 and report.matches == 0
    assert rep.refusals == {"Cast FLOAT->FLOAT16 is lossy": ["narrow"]}
    assert rep.to_json()["refusals"] == [{"reason": "Cast FLOAT->FLOAT16 is lossy", "count": 1, "nodes": ["narrow"]}]
    assert _ser(g) == before


def test_refusal_by_plain_string_names_the_anchor():
    r = _roundtrip_rule()
    model = _model(
        [_cast("X", "w", F, "c1"), _cast("w", "Y", F, "c2")],  # f16 -> f32 -> f32: not a round trip
        [_vi("X", F16)],
        [_vi("Y")],
    )
    g = onnx_io.load(model)
    before = _ser(g)
    n, report = _apply(g, r)
    assert n == 0 and report.rule("roundtrip").refusals == {"not a round trip": ["c2"]}
    assert _ser(g) == before


# ------------------------------------------------------------------ dry run
def _three_roundtrips():
    nodes, outs = [], []
    for k in range(3):
        nodes += [_cast("X", f"w{k}", F, f"in{k}"), _cast(f"w{k}", f"n{k}", F16, f"out{k}")]
        nodes.append(helper.make_node("Neg", [f"n{k}"], [f"Y{k}"], name=f"neg{k}"))
        outs.append(_vi(f"Y{k}", F16))
    return _model(nodes, [_vi("X", F16)], outs)


def test_dry_run_counts_matches_and_changes_nothing():
    g = onnx_io.load(_three_roundtrips())
    before = _ser(g)
    n, report = _apply(g, cast_roundtrip, plugin="cast", dry_run=True)
    assert n == 3 and report.rule("cast-roundtrip").matches == 3
    assert report.rule("cast-roundtrip").nodes_removed == 0
    assert _ser(g) == before and len(g.nodes) == 9

    report = run_plugin(g, CastRoundtrip(), dry_run=True)
    assert report.matches == 3 and _ser(g) == before

    report = run_plugin(g, CastRoundtrip())
    assert report.matches == 3 and [op for _, op in _ops(g)] == ["Neg"] * 3
