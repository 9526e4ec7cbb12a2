"""The rest of the pattern-language contract not covered by test_pattern.py / test_driver.py:
reusable sub-patterns with scoped variables, scalar-constant predicates, the fixed-point bound, and the
same output for the same input across processes (hash randomization)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rewrite.core import onnx_io
from rewrite.core.driver import MAX_ITERATIONS, PluginReport, apply_rules
from rewrite.core.matcher import Match, Matcher, MatchTrace
from rewrite.core.pattern import Const, Or, Pattern, Var, subpattern
from rewrite.core.rules import rule
from rewrite.core.shapes import infer_shapes

F = TensorProto.FLOAT


def _vi(name, shape=(2, 8), elem=F):
    return helper.make_tensor_value_info(name, elem, list(shape))


def _model(nodes, inputs, outputs, inits=(), opset=18) -> onnx.ModelProto:
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)), opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 9
    onnx.checker.check_model(m, full_check=True)
    return m


def _matches(fn, model, trace=None) -> dict[str, Match]:
    g = onnx_io.load(model)
    infer_shapes(g)
    p = Pattern.trace(fn)
    matcher = Matcher(g, p, trace)
    out = {}
    for a in sorted((n for t in p.root_op_types() for n in g.nodes_by_op(t)), key=lambda n: n.order):
        for b in matcher.match_at(a):
            out[a.name] = Match(g, p, b)
            break
    return out


# ------------------------------------------------------------- sub-patterns
@subpattern
def _norm(op, x):
    """x / Sqrt(ReduceMean(x * x) + eps) * weight: eps and weight are the sub-pattern's own variables."""
    ms = op.ReduceMean(op.Mul(x, x), Const("axes", value=[-1]), _name="mean")
    return op.Mul(op.Div(x, op.Sqrt(op.Add(ms, Const("eps")))), Var("weight"), _name="scale")


def _norm_nodes(prefix, x, w, eps):
    return [
        helper.make_node("Mul", [x, x], [f"{prefix}_sq"]),
        helper.make_node("ReduceMean", [f"{prefix}_sq", "axes"], [f"{prefix}_ms"], name=f"{prefix}_mean"),
        helper.make_node("Add", [f"{prefix}_ms", eps], [f"{prefix}_v"]),
        helper.make_node("Sqrt", [f"{prefix}_v"], [f"{prefix}_r"]),
        helper.make_node("Div", [x, f"{prefix}_r"], [f"{prefix}_n"]),
        helper.make_node("Mul", [w, f"{prefix}_n"], [f"{prefix}_y"], name=f"{prefix}_scale"),  # weight first: commutative
    ]


def _two_norms_model():
    """q_y = norm(Q) * wq and k_y = norm(K) * wk with different eps initializers, then Add(q_y, k_y)."""
    nodes = _norm_nodes("q", "Q", "wq", "eps_q") + _norm_nodes("k", "K", "wk", "eps_k") + [helper.make_node("Add", ["q_y", "k_y"], ["Y"], name="sum")]
    inits = [numpy_helper.from_array(np.array([-1], np.int64), "axes"), numpy_helper.from_array(np.float32(1e-6), "eps_q"),
             numpy_helper.from_array(np.float32(1e-5), "eps_k"), numpy_helper.from_array(np.ones(8, np.float32), "wq"),
             numpy_helper.from_array(np.full(8, 2, np.float32), "wk")]
    return _model(nodes, [_vi("Q"), _vi("K")], [_vi("Y")], inits)


def test_subpattern_called_twice_binds_its_own_variables_per_call():
    ms = _matches(lambda op, q, k: op.Add(_norm(op, q, _scope="q"), _norm(op, k, _scope="k"), _name="sum"), _two_norms_model())
    m = ms["sum"]
    assert (m["q"], m["k"]) == ("Q", "K")
    assert (m["q.weight"], m["k.weight"], m["q.eps"], m["k.eps"]) == ("wq", "wk", "eps_q", "eps_k")
    assert (m.node("q.scale").name, m.node("k.mean").name) == ("q_scale", "k_mean")
    assert len(m.nodes) == 13


def test_subpattern_default_scopes_number_the_calls():
    ms = _matches(lambda op, q, k: op.Add(_norm(op, q), _norm(op, k)), _two_norms_model())
    m = ms["sum"]
    assert (m["_norm#1.weight"], m["_norm#2.weight"]) == ("wq", "wk")


def test_without_scoping_the_shared_variable_must_bind_one_value():
    def norm_plain(op, x):  # the same body as a plain function: Var("weight") is shared by both calls
        ms = op.ReduceMean(op.Mul(x, x), Const("axes", value=[-1]))
        return op.Mul(op.Div(x, op.Sqrt(op.Add(ms, Const("eps")))), Var("weight"))

    trace = MatchTrace()
    assert _matches(lambda op, q, k: op.Add(norm_plain(op, q), norm_plain(op, k)), _two_norms_model(), trace) == {}
    assert trace.best.reason in ("'eps' bound to 'eps_q' and 'eps_k'", "'weight' bound to 'wq' and 'wk'")


def test_subpattern_arguments_keep_their_names_and_nest():
    @subpattern
    def pair(op, x):
        return op.Add(_norm(op, x, _scope="inner"), _norm(op, x, _scope="inner2"))

    nodes = _norm_nodes("a", "X", "wa", "eps") + _norm_nodes("b", "X", "wb", "eps") + [helper.make_node("Add", ["a_y", "b_y"], ["Y"], name="sum")]
    inits = [numpy_helper.from_array(np.array([-1], np.int64), "axes"), numpy_helper.from_array(np.float32(1e-6), "eps"),
             numpy_helper.from_array(np.ones(8, np.float32), "wa"), numpy_helper.from_array(np.ones(8, np.float32), "wb")]
    m = _matches(lambda op, x: pair(op, x, _scope="p"), _model(nodes, [_vi("X")], [_vi("Y")], inits))["sum"]
    assert m["x"] == "X"  # the argument is not renamed, so both inner calls read the same input
    assert (m["p.inner.weight"], m["p.inner2.weight"], m["p.inner.eps"]) == ("wa", "wb", "eps")


def test_subpattern_inside_alternatives():
    @subpattern
    def act(op, x):
        return Or([op.Relu(x, _name="a"), op.Sigmoid(x, _name="a")])

    model = _model([helper.make_node("Sigmoid", ["X"], ["s"], name="sig"), helper.make_node("Neg", ["s"], ["Y"], name="neg")], [_vi("X")], [_vi("Y")])
    m = _matches(lambda op, x: op.Neg(act(op, x, _scope="act")), model)["neg"]
    assert m.node("act.a").name == "sig"


def test_subpattern_needs_the_op_builder():
    try:
        _norm("not an op builder", Var("x"))
    except TypeError as e:
        assert "must be called with the op builder first" in str(e)
    else:
        raise AssertionError("no TypeError")


# --------------------------------------------------------- scalar constants
def test_const_scalar_equal_to_one_in_any_broadcastable_form():
    nodes, outs, inits = [], [], []
    for name, val in [("one_scalar", np.float32(1)), ("one_vec", np.ones(1, np.float32)), ("two", np.float32(2)), ("ones_row", np.array([1, 1], np.float32))]:
        inits.append(numpy_helper.from_array(val, name))
        nodes.append(helper.make_node("Sub", [name, "X"], [f"o_{name}"], name=f"sub_{name}"))
        outs.append(_vi(f"o_{name}", (2, 2)))
    model = _model(nodes, [_vi("X", (2, 2))], outs, inits)
    trace = MatchTrace()
    ms = _matches(lambda op, x: op.Sub(Const("one", value=1), x), model, trace)
    assert list(ms) == ["sub_one_scalar", "sub_one_vec", "sub_ones_row"]
    assert trace.best.reason == "constant 'one' (two) is 2.0, pattern wants 1.0"


# ------------------------------------------------------------- fixed point
def test_fixed_point_bound_is_reported():
    @rule("neg-again")
    def neg_again(op, x):
        return op.Neg(x)

    @neg_again.rewrite
    def _(m, b):
        return b.op("Neg", [m["x"]])

    g = onnx_io.load(_model([helper.make_node("Neg", ["X"], ["Y"])], [_vi("X")], [_vi("Y")]))
    rep = PluginReport("p")
    assert apply_rules(g, [neg_again], "p", rep) == MAX_ITERATIONS
    assert rep.notes == [f"stopped after {MAX_ITERATIONS} passes while rules still applied (no fixed point; a rule may re-match its own output)"]
    assert [n.op_type for n in g.nodes.values()] == ["Neg"]  # each pass replaced the previous Neg
    rep = PluginReport("p")
    apply_rules(onnx_io.load(_model([helper.make_node("Relu", ["X"], ["Y"])], [_vi("X")], [_vi("Y")])), [neg_again], "p", rep)
    assert rep.notes == []


# ------------------------------------------------------------ determinism
_DETERMINISM = textwrap.dedent(
    """
    import hashlib, sys
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    from rewrite.core import onnx_io
    from rewrite.core.driver import run_plugin
    from rewrite.core.pattern import AttrVar, Or, Var
    from rewrite.core.rules import rule
    from rewrite.core.shapes import infer_shapes
    from rewrite.plugins.base import Plugin

    @rule("mul-add")
    def mul_add(op, x, y, z):
        return op.Add(Or([op.Mul(x, y, _name="m"), op.Div(x, y, _name="m")]), z)

    @mul_add.rewrite
    def _(m, b):
        return b.op("Sum", [m["x"], m["y"], m["z"]])

    class P(Plugin):
        short = name = "p"
        rules = property(lambda self: [mul_add])

    nodes = []
    for k in range(40):  # commutative Add/Mul in both orders, sharing inputs, so many matches overlap
        a, c = f"v{k}", f"v{k + 1}"
        nodes.append(helper.make_node("Mul" if k % 3 else "Div", [a, "X"] if k % 2 else ["X", a], [f"m{k}"]))
        nodes.append(helper.make_node("Add", [f"m{k}", c] if k % 4 < 2 else [c, f"m{k}"], [f"v{k + 2}"]))
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [3])
    g = helper.make_graph(nodes, "g", [vi("X"), vi("v0"), vi("v1")], [vi("v41")])
    graph = onnx_io.load(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
    infer_shapes(graph)
    rep = run_plugin(graph, P())
    print(rep.matches, hashlib.sha256(onnx_io.to_model(graph).SerializeToString(deterministic=True)).hexdigest())
    """
)


def test_same_input_same_output_across_hash_seeds():
    outs = set()
    for seed in ("1", "2", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run([sys.executable, "-c", _DETERMINISM], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        outs.add(r.stdout.strip())
    assert len(outs) == 1
    (out,) = outs
    assert int(out.split()[0]) > 0
