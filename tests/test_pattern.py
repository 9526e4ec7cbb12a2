"""The pattern language and matcher: commutative operands, optional and variadic inputs, alternatives with
backtracking, repeated variables, constants, attributes, dtype and symbolic-shape constraints, multi-output
patterns, and the best partial match a failed rule reports."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from rewrite.core import onnx_io
from rewrite.core.driver import PluginReport, apply_rules
from rewrite.core.matcher import Match, Matcher, MatchTrace
from rewrite.core.pattern import AttrVar, Const, Or, Pattern, Var
from rewrite.core.rules import rule

F, F16, I64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64


# ------------------------------------------------------------------ helpers
def _vi(name, shape=(4,), elem=F):
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


def _model(nodes, inputs, outputs, inits=(), opset=17, check=True) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="tests")
    m.ir_version = 8
    if check:
        onnx.checker.check_model(m, full_check=True)
    return m


def _init(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def _matches(fn, model, trace: MatchTrace | None = None) -> dict[str, Match]:
    """First complete match at every anchor, keyed by the anchor's name (graph order)."""
    g = onnx_io.load(model)
    p = Pattern.trace(fn)
    matcher = Matcher(g, p, trace)
    out: dict[str, Match] = {}
    anchors = sorted((n for t in p.root_op_types() for n in g.nodes_by_op(t)), key=lambda n: n.order)
    for a in anchors:
        for b in matcher.match_at(a):
            out[a.name] = Match(g, p, b)
            break
    return out


def _run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


# ------------------------------------------------------------ commutative
def _add_mul_orders_model():
    """Add(Mul(X, C), Y) in all four operand orders, each feeding its own output."""
    return _model(
        [
            helper.make_node("Mul", ["X", "C"], ["m0"], name="mul0"),
            helper.make_node("Add", ["m0", "Y"], ["o0"], name="add0"),
            helper.make_node("Mul", ["C", "X"], ["m1"], name="mul1"),
            helper.make_node("Add", ["m1", "Y"], ["o1"], name="add1"),
            helper.make_node("Mul", ["X", "C"], ["m2"], name="mul2"),
            helper.make_node("Add", ["Y", "m2"], ["o2"], name="add2"),
            helper.make_node("Mul", ["C", "X"], ["m3"], name="mul3"),
            helper.make_node("Add", ["Y", "m3"], ["o3"], name="add3"),
        ],
        [_vi("X"), _vi("Y")],
        [_vi(f"o{k}") for k in range(4)],
        [_init("C", np.array([2.0, -1.0, 0.5, 3.0], np.float32))],
    )


def _add_mul(op, x, c=Const("c"), y=Var("y")):
    return op.Add(op.Mul(x, c, _name="mul"), y, _name="add")


def test_commutative_operands_match_in_all_four_orders():
    ms = _matches(_add_mul, _add_mul_orders_model())
    assert list(ms) == ["add0", "add1", "add2", "add3"]
    for k, m in enumerate(ms.values()):
        assert (m["x"], m["c"], m["y"]) == ("X", "C", "Y")
        assert m.node("mul").name == f"mul{k}"
        assert m.outputs == [f"o{k}"]


def test_one_commutative_rule_rewrites_every_order_and_keeps_results():
    model = _add_mul_orders_model()

    @rule("mul-add-to-sum")
    def r(op, x, c=Const("c"), y=Var("y")):
        return op.Add(op.Mul(x, c), y)

    @r.rewrite
    def _(m, b):
        return b.op("Sum", [b.op("Mul", [m["x"], m["c"]]), m["y"]])

    g = onnx_io.load(model)
    assert apply_rules(g, [r], "t", PluginReport("t")) == 4
    out = onnx_io.to_model(g)
    onnx.checker.check_model(out, full_check=True)
    assert sorted(n.op_type for n in out.graph.node) == ["Mul"] * 4 + ["Sum"] * 4
    assert [o.name for o in out.graph.output] == ["o0", "o1", "o2", "o3"]
    feeds = {"X": np.array([1.0, 2.0, -3.0, 4.0], np.float32), "Y": np.array([0.5, 0.25, 1.0, -2.0], np.float32)}
    for a, b in zip(_run(model, feeds), _run(out, feeds)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("op_type", ["Sub", "Div"])
def test_non_commutative_ops_do_not_match_swapped(op_type):
    model = _model(
        [
            helper.make_node("Mul", ["X", "C"], ["m0"], name="mul0"),
            helper.make_node(op_type, ["m0", "Y"], ["o0"], name="straight"),
            helper.make_node("Mul", ["C", "X"], ["m1"], name="mul1"),  # Mul still commutes
            helper.make_node(op_type, ["m1", "Y"], ["o1"], name="straight_mul_swapped"),
            helper.make_node("Mul", ["X", "C"], ["m2"], name="mul2"),
            helper.make_node(op_type, ["Y", "m2"], ["o2"], name="swapped"),
        ],
        [_vi("X"), _vi("Y")],
        [_vi("o0"), _vi("o1"), _vi("o2")],
        [_init("C", np.ones(4, np.float32))],
    )

    def pat(op, x, c=Const("c"), y=Var("y")):
        return getattr(op, op_type)(op.Mul(x, c), y)

    ms = _matches(pat, model)
    assert list(ms) == ["straight", "straight_mul_swapped"]
    assert [(m["x"], m["c"], m["y"]) for m in ms.values()] == [("X", "C", "Y")] * 2


def test_matmul_does_not_match_swapped():
    model = _model(
        [
            helper.make_node("MatMul", ["X", "W"], ["o0"], name="xw"),
            helper.make_node("MatMul", ["W", "X"], ["o1"], name="wx"),
        ],
        [_vi("X", (4, 4))],
        [_vi("o0", (4, 4)), _vi("o1", (4, 4))],
        [_init("W", np.eye(4, dtype=np.float32))],
    )
    ms = _matches(lambda op, x, w=Const("w"): op.MatMul(x, w), model)
    assert list(ms) == ["xw"]
    assert (ms["xw"]["x"], ms["xw"]["w"]) == ("X", "W")


# ---------------------------------------------------------- optional inputs
def _clip_model():
    return _model(
        [
            helper.make_node("Clip", ["X"], ["o0"], name="none"),
            helper.make_node("Clip", ["X", "lo"], ["o1"], name="min_only"),
            helper.make_node("Clip", ["X", "", "hi"], ["o2"], name="max_only"),
            helper.make_node("Clip", ["X", "lo", "hi"], ["o3"], name="both"),
        ],
        [_vi("X")],
        [_vi(f"o{k}") for k in range(4)],
        [_init("lo", np.float32(-1.0)), _init("hi", np.float32(1.0))],
    )


def test_optional_var_matches_present_and_absent_inputs():
    def pat(op, x, lo=Var("lo", optional=True), hi=Var("hi", optional=True)):
        return op.Clip(x, lo, hi)

    ms = _matches(pat, _clip_model())
    assert list(ms) == ["none", "min_only", "max_only", "both"]
    assert [(m.get("lo"), m.get("hi")) for m in ms.values()] == [(None, None), ("lo", None), (None, "hi"), ("lo", "hi")]


def test_non_optional_var_does_not_match_an_absent_input():
    ms = _matches(lambda op, x, lo, hi: op.Clip(x, lo, hi), _clip_model())
    assert list(ms) == ["both"]
    ms = _matches(lambda op, x, lo, hi=Var("hi", optional=True): op.Clip(x, lo, hi), _clip_model())
    assert list(ms) == ["min_only", "both"]


def test_optional_zero_point_of_dequantize_linear():
    model = _model(
        [
            helper.make_node("DequantizeLinear", ["Q", "s"], ["o0"], name="no_zp"),
            helper.make_node("DequantizeLinear", ["Q", "s", "zp"], ["o1"], name="zp"),
        ],
        [_vi("Q", (4,), TensorProto.UINT8)],
        [_vi("o0"), _vi("o1")],
        [_init("s", np.float32(0.5)), _init("zp", np.uint8(3))],
    )
    ms = _matches(lambda op, x, s, zp=Var("zp", optional=True): op.DequantizeLinear(x, s, zp), model)
    assert [(a, m.get("zp")) for a, m in ms.items()] == [("no_zp", None), ("zp", "zp")]
    ms = _matches(lambda op, x, s, zp: op.DequantizeLinear(x, s, zp), model)
    assert list(ms) == ["zp"]
    # a pattern naming only two inputs does not match a node with three unless told to allow others
    ms = _matches(lambda op, x, s: op.DequantizeLinear(x, s), model)
    assert list(ms) == ["no_zp"]


# ----------------------------------------------------- variadic / other inputs
def _concat_model():
    return _model(
        [
            helper.make_node("Concat", ["A"], ["o1"], name="one", axis=0),
            helper.make_node("Concat", ["A", "B"], ["o2"], name="two", axis=0),
            helper.make_node("Concat", ["A", "B", "C"], ["o3"], name="three", axis=0),
            helper.make_node("Concat", ["A", "A"], ["o4"], name="same", axis=0),
        ],
        [_vi("A"), _vi("B"), _vi("C")],
        [_vi("o1"), _vi("o2", (8,)), _vi("o3", (12,)), _vi("o4", (8,))],
    )


def test_variadic_input_matches_any_number_of_distinct_values():
    ms = _matches(lambda op, xs: op.Concat(xs, _variadic=True, axis=0), _concat_model())
    assert list(ms) == ["one", "two", "three", "same"]
    assert ms["one"].binding.values == {"xs": "A"}
    assert ms["two"].binding.values == {"xs": "A", "xs.1": "B"}
    assert ms["three"].binding.values == {"xs": "A", "xs.1": "B", "xs.2": "C"}
    assert ms["same"].binding.values == {"xs": "A", "xs.1": "A"}


def test_variadic_tail_after_fixed_inputs_and_its_constraints():
    # the first input is fixed to B; the tail covers zero or more further inputs
    ms = _matches(lambda op, first, rest: op.Concat(first, rest, _variadic=True, axis=0), _concat_model())
    assert list(ms) == ["one", "two", "three", "same"]
    assert ms["one"].binding.values == {"first": "A"}
    assert ms["three"].binding.values == {"first": "A", "rest": "B", "rest.1": "C"}
    # each variadic input is checked against the tail's constraints
    not_c = Var("xs", check=lambda v: v.name != "C")
    ms = _matches(lambda op, xs=not_c: op.Concat(xs, _variadic=True, axis=0), _concat_model())
    assert list(ms) == ["one", "two", "same"]
    # without _variadic the pattern wants exactly its inputs
    ms = _matches(lambda op, x, y: op.Concat(x, y, axis=0), _concat_model())
    assert list(ms) == ["two", "same"]


def test_variadic_tail_of_a_commutative_op_tries_both_first_orders():
    model = _model(
        [helper.make_node("Sum", ["A", "B", "C"], ["Y"], name="sum3"), helper.make_node("Sum", ["B", "A"], ["Z"], name="sum2")],
        [_vi("A"), _vi("B"), _vi("C")],
        [_vi("Y"), _vi("Z")],
    )
    not_b = Var("ys", check=lambda v: v.name != "B" or "B refused")
    ms = _matches(lambda op, x, ys=not_b: op.Sum(x, ys, _variadic=True), model)
    assert [(a, m.binding.values) for a, m in ms.items()] == [
        ("sum3", {"x": "B", "ys": "A", "ys.1": "C"}),  # first two swapped, the tail in place
        ("sum2", {"x": "B", "ys": "A"}),
    ]


def test_allow_other_inputs():
    ms = _matches(lambda op, x: op.Clip(x), _clip_model())
    assert list(ms) == ["none"]
    ms = _matches(lambda op, x: op.Clip(x, _allow_other_inputs=True), _clip_model())
    assert list(ms) == ["none", "min_only", "max_only", "both"]
    assert all(m.binding.values == {"x": "X"} for m in ms.values())


# -------------------------------------------------------------- alternatives
def test_or_backtracks_from_an_alternative_that_fails_deeper():
    model = _model(
        [
            helper.make_node("Relu", ["X"], ["r"], name="relu"),
            helper.make_node("Neg", ["r"], ["n"], name="neg"),
            helper.make_node("Exp", ["n"], ["Y"], name="exp"),
        ],
        [_vi("X")],
        [_vi("Y")],
    )

    def pat(op, x):
        # the first alternative matches Neg, then fails on Abs vs Relu; the second matches
        return op.Exp(Or([op.Neg(op.Abs(x, _name="abs")), op.Neg(op.Relu(x, _name="relu"))]))

    ms = _matches(pat, model)
    assert list(ms) == ["exp"]
    m = ms["exp"]
    assert m["x"] == "X" and m.node("relu").name == "relu" and "abs" not in m
    assert [n.name for n in m.nodes] == ["relu", "neg", "exp"]


def test_or_backtracks_when_a_later_input_rejects_the_first_alternative():
    model = _model(
        [
            helper.make_node("Relu", ["X"], ["r"], name="relu"),
            helper.make_node("Neg", ["r"], ["n"], name="neg"),
            helper.make_node("Sub", ["n", "X"], ["Y"], name="sub"),
        ],
        [_vi("X")],
        [_vi("Y")],
    )

    def pat(op, x):
        # alternative 1 matches Neg(r) binding x=r, then Sub's second input X != r rejects it
        return op.Sub(Or([op.Neg(x, _name="neg_only"), op.Neg(op.Relu(x), _name="neg_relu")]), x)

    ms = _matches(pat, model)
    assert list(ms) == ["sub"]
    assert ms["sub"]["x"] == "X" and "neg_relu" in ms["sub"] and "neg_only" not in ms["sub"]
    assert [n.name for n in ms["sub"].nodes] == ["relu", "neg", "sub"]

    # when both alternatives would do, the first wins
    def pat_first(op, x, y):
        return op.Sub(Or([op.Neg(x, _name="neg_only"), op.Neg(op.Relu(x), _name="neg_relu")]), y)

    ms = _matches(pat_first, model)
    assert ms["sub"]["x"] == "r" and "neg_only" in ms["sub"]


# ---------------------------------------------------------- repeated variable
def test_variable_used_twice_binds_the_same_value():
    model = _model(
        [
            helper.make_node("Mul", ["A", "A"], ["o0"], name="square"),
            helper.make_node("Mul", ["A", "B"], ["o1"], name="product"),
        ],
        [_vi("A"), _vi("B")],
        [_vi("o0"), _vi("o1")],
    )
    ms = _matches(lambda op, x: op.Mul(x, x), model)
    assert list(ms) == ["square"] and ms["square"]["x"] == "A"


# ----------------------------------------------------------------- constants
def test_const_value_matches_initializer_and_constant_node():
    model = _model(
        [
            helper.make_node("Unsqueeze", ["X", "ax_init"], ["o0"], name="init_m1"),
            helper.make_node("Constant", [], ["ax_node"], name="cst", value=helper.make_tensor("v", I64, [1], [-1])),
            helper.make_node("Unsqueeze", ["X", "ax_node"], ["o1"], name="node_m1"),
            helper.make_node("Constant", [], ["ax_ints"], name="cst_ints", value_ints=[-1]),
            helper.make_node("Unsqueeze", ["X", "ax_ints"], ["o2"], name="ints_m1"),
            helper.make_node("Unsqueeze", ["X", "ax_pos"], ["o3"], name="init_p1"),
            helper.make_node("Unsqueeze", ["X", "AX"], ["o4"], name="runtime"),
        ],
        [_vi("X"), _vi("AX", (1,), I64)],
        [_vi("o0", (4, 1)), _vi("o1", (4, 1)), _vi("o2", (4, 1)), _vi("o3", (4, 1)), _vi("o4", ("d0", "d1"))],
        [_init("ax_init", np.array([-1], np.int64)), _init("ax_pos", np.array([1], np.int64))],
    )
    trace = MatchTrace()
    ms = _matches(lambda op, x: op.Unsqueeze(x, Const("axes", value=[-1])), model, trace)
    assert list(ms) == ["init_m1", "node_m1", "ints_m1"]
    assert [m["axes"] for m in ms.values()] == ["ax_init", "ax_node", "ax_ints"]
    assert ms["node_m1"].const("axes").tolist() == [-1]

    neg = Const("axes", check=lambda a: bool(a.size == 1 and a.reshape(-1)[0] < 0) or "axis is not negative")
    trace = MatchTrace()
    ms = _matches(lambda op, x, axes=neg: op.Unsqueeze(x, axes), model, trace)
    assert list(ms) == ["init_m1", "node_m1", "ints_m1"]
    assert trace.best.reason == "axis is not negative"

    ms = _matches(lambda op, x, axes=Const("axes"): op.Unsqueeze(x, axes), model)
    assert list(ms) == ["init_m1", "node_m1", "ints_m1", "init_p1"]  # AX is not a constant


def test_const_float_value_means_the_nearest_value_of_the_tensor_type():
    model = _model(
        [
            helper.make_node("Add", ["X", "eps32"], ["o0"], name="f32"),
            helper.make_node("Add", ["H", "eps16"], ["o1"], name="f16"),
            helper.make_node("Add", ["X", "eps_other"], ["o2"], name="other"),
        ],
        [_vi("X"), _vi("H", (4,), F16)],
        [_vi("o0"), _vi("o1", (4,), F16), _vi("o2")],
        [_init("eps32", np.float32(1e-5)), _init("eps16", np.float16(1e-5)), _init("eps_other", np.float32(2e-5))],
    )
    ms = _matches(lambda op, x: op.Add(x, Const("eps", value=1e-5)), model)
    assert list(ms) == ["f32", "f16"]


# ---------------------------------------------------------------- attributes
def test_attrvar_binds_and_must_agree_when_used_twice():
    model = _model(
        [
            helper.make_node("Cast", ["X"], ["a"], name="in_same", to=F),
            helper.make_node("Cast", ["a"], ["o0"], name="out_same", to=F),
            helper.make_node("Cast", ["X"], ["b"], name="in_diff", to=F),
            helper.make_node("Cast", ["b"], ["o1"], name="out_diff", to=F16),
        ],
        [_vi("X", (4,), F16)],
        [_vi("o0"), _vi("o1", (4,), F16)],
    )
    ms = _matches(lambda op, x: op.Cast(op.Cast(x, to=AttrVar("t")), to=AttrVar("t")), model)
    assert list(ms) == ["out_same"] and ms["out_same"].attr("t") == F
    ms = _matches(lambda op, x: op.Cast(op.Cast(x, to=AttrVar("w")), to=AttrVar("n")), model)
    assert [(m.attr("w"), m.attr("n")) for m in ms.values()] == [(F, F), (F, F16)]
    ms = _matches(lambda op, x: op.Cast(op.Cast(x, to=F), to=F16), model)  # literals
    assert list(ms) == ["out_diff"]
    ms = _matches(lambda op, x: op.Cast(x, to=AttrVar("t", check=lambda t: t == F16 or "not to f16")), model)
    assert list(ms) == ["out_diff"]


def test_literal_attribute_equality_and_attrvar_default():
    model = _model(
        [
            helper.make_node("LeakyRelu", ["X"], ["o0"], name="a01", alpha=0.1),
            helper.make_node("LeakyRelu", ["X"], ["o1"], name="a02", alpha=0.2),
            helper.make_node("Softmax", ["X2"], ["o2"], name="sm_default"),
            helper.make_node("Softmax", ["X2"], ["o3"], name="sm_last", axis=-1),
            helper.make_node("Softmax", ["X2"], ["o4"], name="sm_first", axis=0),
            helper.make_node("DepthToSpace", ["X4"], ["o5"], name="crd", blocksize=2, mode="CRD"),
            helper.make_node("DepthToSpace", ["X4"], ["o6"], name="dcr", blocksize=2, mode="DCR"),
        ],
        [_vi("X"), _vi("X2", (2, 3)), _vi("X4", (1, 4, 2, 2))],
        [_vi("o0"), _vi("o1")] + [_vi(f"o{k}", (2, 3)) for k in (2, 3, 4)] + [_vi(f"o{k}", (1, 1, 4, 4)) for k in (5, 6)],
    )
    assert list(_matches(lambda op, x: op.LeakyRelu(x, alpha=0.1), model)) == ["a01"]
    assert list(_matches(lambda op, x: op.Softmax(x, axis=-1), model)) == ["sm_last"]
    assert list(_matches(lambda op, x: op.DepthToSpace(x, mode="CRD"), model)) == ["crd"]
    assert list(_matches(lambda op, x: op.DepthToSpace(x, mode="CRD", blocksize=3), model)) == []
    ms = _matches(lambda op, x: op.Softmax(x, axis=AttrVar("axis", default=-1)), model)
    assert [(a, m.attr("axis")) for a, m in ms.items()] == [("sm_default", -1), ("sm_last", -1), ("sm_first", 0)]
    assert list(_matches(lambda op, x: op.Softmax(x, axis=AttrVar("axis")), model)) == ["sm_last", "sm_first"]


# ------------------------------------------------------------ type and shape
def test_dtype_constraint():
    model = _model(
        [
            helper.make_node("Relu", ["X32"], ["o0"], name="r32"),
            helper.make_node("Relu", ["X16"], ["o1"], name="r16"),
            helper.make_node("Relu", ["X64"], ["o2"], name="r64"),
        ],
        [_vi("X32"), _vi("X16", (4,), F16), _vi("X64", (4,), TensorProto.DOUBLE)],
        [_vi("o0"), _vi("o1", (4,), F16), _vi("o2", (4,), TensorProto.DOUBLE)],
    )
    assert list(_matches(lambda op, x=Var("x", dtype=F16): op.Relu(x), model)) == ["r16"]
    assert list(_matches(lambda op, x=Var("x", dtype=(F, F16)): op.Relu(x), model)) == ["r32", "r16"]
    assert list(_matches(lambda op, x=Var("x", dtype={TensorProto.DOUBLE}): op.Relu(x), model)) == ["r64"]


def _sub_model(x_shape, y_shape):
    return _model(
        [helper.make_node("Sub", ["X", "Y"], ["Z"], name="sub")],
        [_vi("X", x_shape), _vi("Y", y_shape)],
        [_vi("Z", [f"z{k}" for k in range(len(x_shape))])],
        check=all(a == b or 1 in (a, b) for a, b in zip(x_shape, y_shape)),  # valid broadcasts only
    )


def _sym_pat(op, x=Var("x", shape=("B", "S", 16)), y=Var("y", shape=("B", "S", 16))):
    return op.Sub(x, y)


def test_symbolic_shape_binds_consistently():
    ms = _matches(_sym_pat, _sub_model((2, 5, 16), (2, 5, 16)))
    assert list(ms) == ["sub"] and ms["sub"].binding.symbols == {"B": 2, "S": 5}
    assert ms["sub"].symbol("S") == 5
    ms = _matches(_sym_pat, _sub_model(("batch", "seq", 16), ("batch", "seq", 16)))
    assert ms["sub"].binding.symbols == {"B": "batch", "S": "seq"}


@pytest.mark.parametrize(
    "x_shape,y_shape,reason",
    [
        ((2, 5, 16), (2, 1, 16), "shape symbol 'S' is 5 and 1"),
        ((2, 5, 16), (1, 5, 16), "shape symbol 'B' is 2 and 1"),
        (("batch", "seq", 16), ("batch", "len", 16), "shape symbol 'S' is seq and len"),
        ((2, 5, 8), (2, 5, 8), "'x' has shape FLOAT[2,5,8], pattern wants ('B', 'S', 16)"),
        ((2, 5), (2, 5), "'x' has shape FLOAT[2,5], pattern wants rank 3"),
    ],
)
def test_symbolic_shape_mismatch_does_not_match(x_shape, y_shape, reason):
    trace = MatchTrace()
    assert _matches(_sym_pat, _sub_model(x_shape, y_shape), trace) == {}
    assert trace.best.reason == reason


# -------------------------------------------------------- multi-output patterns
def _softmax_two_consumers(op, x):
    s = op.Softmax(x, axis=-1, _name="sm")
    return op.Relu(s, _name="relu"), op.Neg(s, _name="neg")


def test_multi_output_pattern_finds_second_output_from_bound_values(monkeypatch):
    n_noise = 30
    nodes = [
        helper.make_node("Softmax", ["X"], ["s"], name="sm", axis=-1),
        helper.make_node("Relu", ["s"], ["R"], name="relu"),
        helper.make_node("Neg", ["s"], ["N"], name="neg"),
    ]
    outputs = [_vi("R"), _vi("N")]
    for k in range(n_noise):  # same op types, unrelated to the match
        nodes += [
            helper.make_node("Softmax", [f"Z{k}"], [f"zs{k}"], name=f"sm{k}", axis=-1),
            helper.make_node("Relu", [f"zs{k}"], [f"zr{k}"], name=f"relu{k}"),
            helper.make_node("Neg", ["W"], [f"wn{k}"], name=f"neg{k}"),
        ]
        outputs += [_vi(f"zr{k}"), _vi(f"wn{k}")]
    model = _model(nodes, [_vi("X"), _vi("W")] + [_vi(f"Z{k}") for k in range(n_noise)], outputs)

    explored: list[list[str]] = []
    orig = Matcher._candidates

    def counting(self, out, b):
        c = orig(self, out, b)
        explored.append(list(c))
        return c

    monkeypatch.setattr(Matcher, "_candidates", counting)
    ms = _matches(_softmax_two_consumers, model)
    assert list(ms) == ["relu"]
    m = ms["relu"]
    assert m.outputs == ["R", "N"] and m["x"] == "X"
    assert [n.name for n in m.nodes] == ["sm", "relu", "neg"]
    # one call per anchor whose first output matched; only the real second consumer was a candidate
    assert len(explored) == n_noise + 1
    assert sum(len(c) for c in explored) == 1 and explored[0] == ["N"]


def test_multi_output_pattern_rewrite_replaces_both_outputs():
    model = _model(
        [
            helper.make_node("Softmax", ["X"], ["s"], name="sm", axis=-1),
            helper.make_node("Relu", ["s"], ["R"], name="relu"),
            helper.make_node("Neg", ["s"], ["N"], name="neg"),
        ],
        [_vi("X")],
        [_vi("R"), _vi("N")],
    )

    @rule("softmax-pair")
    def r(op, x):
        s = op.Softmax(x, axis=-1)
        return op.Relu(s), op.Neg(s)

    @r.rewrite
    def _(m, b):  # Softmax output is positive: Relu is the identity
        s = b.op("Softmax", [m["x"]], axis=-1)
        return [b.op("Identity", [s]), b.op("Neg", [s])]

    g = onnx_io.load(model)
    assert apply_rules(g, [r], "t", PluginReport("t")) == 1
    out = onnx_io.to_model(g)
    onnx.checker.check_model(out, full_check=True)
    s = out.graph.node[0].output[0]
    assert [(n.op_type, list(n.input), list(n.output)) for n in out.graph.node] == [
        ("Softmax", ["X"], [s]),
        ("Identity", [s], ["R"]),
        ("Neg", [s], ["N"]),
    ]
    assert [n.rule for n in g.topo_nodes()] == ["t/softmax-pair"] * 3
    feeds = {"X": np.array([1.0, -2.0, 0.5, 3.0], np.float32)}
    for a, b in zip(_run(model, feeds), _run(out, feeds)):
        np.testing.assert_array_equal(a, b)


def test_multi_output_pattern_on_split_outputs():
    model = _model(
        [
            helper.make_node("Split", ["X", "sizes"], ["a", "b"], name="split", axis=0),
            helper.make_node("Split", ["Y", "sizes"], ["c", "d"], name="split2", axis=0),
            helper.make_node("Neg", ["c"], ["nc"], name="neg"),
            helper.make_node("Relu", ["d"], ["rd"], name="relu"),
        ],
        [_vi("X"), _vi("Y")],
        [_vi("a", (2,)), _vi("b", (2,)), _vi("nc", (2,)), _vi("rd", (2,))],
        [_init("sizes", np.array([2, 2], np.int64))],
    )

    def raw(op, x, s):
        p, q = op.Split(x, s, _outputs=2, axis=0)
        return p, q

    ms = _matches(raw, model)
    assert [(a, m.outputs) for a, m in ms.items()] == [("split", ["a", "b"]), ("split2", ["c", "d"])]

    def consumers(op, x, s):
        p, q = op.Split(x, s, _outputs=2, axis=0)
        return op.Neg(p), op.Relu(q)

    ms = _matches(consumers, model)
    assert [(a, m.outputs) for a, m in ms.items()] == [("neg", ["nc", "rd"])]


def test_output_port_beyond_the_producers_outputs_is_a_mismatch():
    model = _model(
        [helper.make_node("Relu", ["X"], ["r"], name="relu"), helper.make_node("Add", ["X", "r"], ["Y"], name="add")],
        [_vi("X")],
        [_vi("Y")],
    )

    def pat(op, x, s):
        _, q = op.Split(x, s, _outputs=2)
        return op.Add(x, q)

    trace = MatchTrace()
    assert _matches(pat, model, trace) == {}
    assert trace.best.reason == "'r' is output 0 of 'relu' (Relu), pattern wants output 1"


# ----------------------------------------------------------------- MatchTrace
def test_match_trace_keeps_the_deepest_partial_match():
    model = _model(
        [  # shallow partial match, deep one, shallow one: the deep one is kept whatever the order
            helper.make_node("Exp", ["X"], ["e"], name="exp"),
            helper.make_node("Neg", ["e"], ["Y0"], name="neg_shallow"),
            helper.make_node("Sigmoid", ["X"], ["s"], name="sigmoid"),
            helper.make_node("Abs", ["s"], ["a"], name="abs"),
            helper.make_node("Neg", ["a"], ["Y1"], name="neg_deep"),
            helper.make_node("Tanh", ["X"], ["t"], name="tanh"),
            helper.make_node("Neg", ["t"], ["Y2"], name="neg_shallow2"),
        ],
        [_vi("X")],
        [_vi("Y0"), _vi("Y1"), _vi("Y2")],
    )
    trace = MatchTrace()
    ms = _matches(lambda op, x: op.Neg(op.Abs(op.Relu(x, _name="relu"), _name="abs"), _name="neg"), model, trace)
    assert ms == {}
    best = trace.best
    assert best.reason == "'sigmoid' (Sigmoid) is not relu"
    assert best.node == "sigmoid" and best.matched == 2
    assert best.pairs == [("neg", "neg_deep"), ("abs", "abs")]
    assert str(best) == "'sigmoid' (Sigmoid) is not relu (at node 'sigmoid')"


def test_failed_rule_reports_its_best_partial_match():
    model = _model(
        [
            helper.make_node("Relu", ["X"], ["r"], name="relu"),
            helper.make_node("Cast", ["r"], ["Y"], name="cast", to=F16),
        ],
        [_vi("X")],
        [_vi("Y", (4,), F16)],
    )
    from rewrite.plugins.cast_roundtrip import cast_roundtrip

    g = onnx_io.load(model)
    report = PluginReport("cast")
    assert apply_rules(g, [cast_roundtrip], "cast", report) == 0
    rep = report.rule("cast-roundtrip")
    assert rep.best_partial.reason == "'relu' (Relu) is not inner"
    assert rep.to_json()["best_partial"] == {"reason": "'relu' (Relu) is not inner", "node": "relu", "matched": [("outer", "cast")]}
