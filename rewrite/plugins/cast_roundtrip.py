"""``cast``: Cast round-trip elimination with exact semantics only.

``Cast(Cast(x: T, to=W), to=T)`` is the identity on ``x`` when the wider type W holds every value of T
(f16->f32->f16, bf16->f32->bf16, int8->int32->int8, ...). The lossy direction (f32->f16->f32) rounds and is
never touched. The inner Cast stays when something else reads its output. Seed 000, items A6 and
"Eliminate Cast->Cast roundtrips": each round trip after a Softmax costs two dispatches on IREE.
"""

from __future__ import annotations

from rewrite.core.ir import dtype_name
from rewrite.core.pattern import AttrVar
from rewrite.core.rules import holds_every_value_of, rule
from rewrite.plugins.base import Plugin


@rule("cast-roundtrip")
def cast_roundtrip(op, x):
    """Cast(Cast(x: T, to=W), to=T) -> x when W holds every value of T."""
    inner = op.Cast(x, to=AttrVar("wide"), _name="inner")
    return op.Cast(inner, to=AttrVar("narrow"), _name="outer")


@cast_roundtrip.check
def _(m):
    t = m.value("x").dtype
    wide, narrow = m.attr("wide"), m.attr("narrow")
    if t is None:
        return m.fail(f"element type of '{m['x']}' is unknown (run shape inference)", m.node("inner"))
    if narrow != t:
        return m.fail(f"not a round trip: {dtype_name(t)}->{dtype_name(wide)}->{dtype_name(narrow)}", m.node("outer"))
    if not holds_every_value_of(wide, t):
        return m.fail(f"Cast {dtype_name(t)}->{dtype_name(wide)} is lossy", m.node("inner"))


@cast_roundtrip.rewrite
def _(m, b):
    return m["x"]


class CastRoundtrip(Plugin):
    name = "cast-roundtrip"
    short = "cast"
    takes_options = False
    description = "Remove Cast(T->W)->Cast(W->T) when W holds every value of T"
    opset_range = (6, 28)

    @property
    def rules(self):
        return [cast_roundtrip]

    @property
    def cases(self):
        from onnx import TensorProto as TP
        from onnx import helper

        from rewrite.core.cases import negative, positive

        def chain(t: int, w: int, back: int, *, tap: bool = False):
            """X: t[2,8] -> Softmax (floats) or Neg -> Cast(to=w) -> Cast(to=back) -> Mul by itself -> Y;
            with ``tap`` the inner Cast's output is also a graph output (the inner Cast must stay)."""
            f = t in (TP.FLOAT, TP.FLOAT16, TP.BFLOAT16, TP.DOUBLE)
            nodes = [
                helper.make_node("Softmax" if f else "Neg", ["X"], ["S"], name="src"),
                helper.make_node("Cast", ["S"], ["W"], to=w, name="inner"),
                helper.make_node("Cast", ["W"], ["B"], to=back, name="outer"),
                helper.make_node("Mul", ["B", "B"], ["Y"], name="use"),
            ]
            outs = [helper.make_tensor_value_info("Y", back, [2, 8])] + ([helper.make_tensor_value_info("W", w, [2, 8])] if tap else [])
            g = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("X", t, [2, 8])], outs)
            return lambda: helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)

        return [
            positive("f16-f32-f16-after-softmax", chain(TP.FLOAT16, TP.FLOAT, TP.FLOAT16), matches=1),
            positive("int8-int32-int8-inner-read-elsewhere", chain(TP.INT8, TP.INT32, TP.INT8, tap=True), matches=1),
            negative("lossy-f32-f16-f32", chain(TP.FLOAT, TP.FLOAT16, TP.FLOAT)),
            negative("lossy-f32-bf16-f32", chain(TP.FLOAT, TP.BFLOAT16, TP.FLOAT)),
            negative("lossy-f16-bf16-f16", chain(TP.FLOAT16, TP.BFLOAT16, TP.FLOAT16)),
            negative("lossy-int32-f32-int32", chain(TP.INT32, TP.FLOAT, TP.INT32)),
            negative("not-a-roundtrip-f16-f32-f64", chain(TP.FLOAT16, TP.FLOAT, TP.DOUBLE)),
        ]
