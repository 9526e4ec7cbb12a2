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
    description = "Remove Cast(T->W)->Cast(W->T) when W holds every value of T"
    opset_range = (6, 28)

    @property
    def rules(self):
        return [cast_roundtrip]
