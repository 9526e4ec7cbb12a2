"""Rules: a pattern, a check that may refuse with a reason, and a rewrite that builds the replacement.

Written as decorated functions::

    @rule(benefit=2)
    def cast_roundtrip(op, x):
        return op.Cast(op.Cast(x, to=AttrVar("wide"), _name="inner"), to=AttrVar("narrow"), _name="outer")

    @cast_roundtrip.check
    def _(m):
        if not widens(...):
            return m.fail("Cast FLOAT->FLOAT16 is lossy", m.node("inner"))

    @cast_roundtrip.rewrite
    def _(m, b):
        return m["x"]                  # replaces the pattern's output; dead matched nodes are removed

The rewrite returns one graph value name per pattern output (a list for several). Matched nodes whose
outputs are still read outside the match are kept (values used outside the match are never removed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import onnx
from onnx import helper

from rewrite.core.ir import Graph, Node
from rewrite.core.matcher import Failure, Match
from rewrite.core.pattern import Pattern


class Builder:
    """Creates the replacement nodes of one rewrite, tagging each with the rule's name.

    New nodes take the position (``order``) of the match's anchor so that the written model keeps the
    original node order around them.
    """

    def __init__(self, graph: Graph, rule_tag: str, order: float, name_hint: str):
        self.graph = graph
        self.rule_tag = rule_tag
        self._order = order
        self._hint = name_hint
        self.created: list[Node] = []
        self.initializers: list[str] = []

    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        *,
        domain: str = "",
        outputs: int | Sequence[str] = 1,
        name: str | None = None,
        dtype: int | Sequence[int | None] | None = None,
        shape: Sequence | None = None,
        **attrs: Any,
    ) -> Any:
        """Add node ``op_type(inputs, **attrs)``; returns its output name (or a tuple for several outputs).

        ``dtype``/``shape`` record the output type (a list of dtypes for several outputs); the IREE importer
        needs a type on every value an abstract op produces. A ``domain`` other than ONNX's is declared in the
        model's opset imports (version 1) where it is not yet (the checker and ONNX Runtime refuse a node of an
        undeclared domain).
        """
        if isinstance(outputs, int):
            outs = [self.graph.fresh_name(f"{self._hint}_{op_type}") for _ in range(outputs)]
        else:
            outs = list(outputs)
        self._order += 1e-6
        if domain not in ("", "ai.onnx"):
            self.graph.ensure_opset(domain)
        node = self.graph.add_node(
            op_type,
            list(inputs),
            outs,
            domain=domain,
            name=name or self.graph.fresh_name(f"{self._hint}/{op_type}"),
            attrs=[helper.make_attribute(k, v) for k, v in attrs.items() if v is not None],
            order=self._order,
            rule=self.rule_tag,
        )
        self.created.append(node)
        dts = dtype if isinstance(dtype, (list, tuple)) else [dtype] * len(outs)
        for o, dt in zip(outs, dts):
            if dt is not None:
                self.graph.values[o].set_type(dt, shape)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def const(self, array: Any, name: str = "const", dtype: Any = None) -> str:
        """Add an initializer holding ``array``; returns its name."""
        arr = np.asarray(array, dtype=dtype)
        v = self.graph.add_initializer(self.graph.fresh_name(f"{self._hint}_{name}"), arr)
        self.initializers.append(v.name)
        return v.name


@dataclass(eq=False)
class Rule:
    """A named pattern with its check and rewrite.

    Attributes:
        name: unique within its plugin; recorded on every node the rule creates as ``plugin/name``.
        pattern: the traced :class:`Pattern`.
        benefit: larger runs first (default: number of pattern nodes, so larger patterns win); ties keep
            registration order.
        doc: one line shown by ``rewrite plugins`` and ``rewrite explain``.
    """

    name: str
    pattern: Pattern
    benefit: int
    doc: str = ""
    check_fn: Callable[[Match], Failure | str | bool | None] | None = None
    rewrite_fn: Callable[[Match, Builder], Any] | None = None
    pattern_fn: Callable | None = field(default=None, repr=False)

    def check(self, fn: Callable[[Match], Failure | str | bool | None]) -> Callable:
        """Decorator: register the check. Return None/True to accept, a Failure (``m.fail(...)``) or str to refuse."""
        self.check_fn = fn
        return fn

    def rewrite(self, fn: Callable[[Match, Builder], Any]) -> Callable:
        """Decorator: register the rewrite ``fn(m, b) -> value name | list of value names``."""
        self.rewrite_fn = fn
        return fn

    def run_check(self, m: Match) -> Failure | None:
        if self.check_fn is None:
            return None
        r = self.check_fn(m)
        if r is None or r is True:
            return None
        if isinstance(r, Failure):
            return r
        return m.fail(r if isinstance(r, str) else f"check of rule '{self.name}' refused")


def rule(name: str | None = None, *, benefit: int | None = None, domain: str = "") -> Callable[[Callable], Rule]:
    """Decorator turning a pattern function into a :class:`Rule` (see the module docstring)."""

    def wrap(fn: Callable) -> Rule:
        pat = Pattern.trace(fn, domain)
        doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        return Rule(name=name or fn.__name__.replace("_", "-"), pattern=pat, benefit=pat.size if benefit is None else benefit, doc=doc, pattern_fn=fn)

    return wrap


# ONNX element types and the value sets they hold, for exactness checks (ONNX spec, "Tensor Element Types").
_INT_RANGES = {
    onnx.TensorProto.INT8: (-(2**7), 2**7 - 1),
    onnx.TensorProto.UINT8: (0, 2**8 - 1),
    onnx.TensorProto.INT16: (-(2**15), 2**15 - 1),
    onnx.TensorProto.UINT16: (0, 2**16 - 1),
    onnx.TensorProto.INT32: (-(2**31), 2**31 - 1),
    onnx.TensorProto.UINT32: (0, 2**32 - 1),
    onnx.TensorProto.INT64: (-(2**63), 2**63 - 1),
    onnx.TensorProto.UINT64: (0, 2**64 - 1),
    onnx.TensorProto.INT4: (-8, 7),
    onnx.TensorProto.UINT4: (0, 15),
    onnx.TensorProto.BOOL: (0, 1),
}
# (exponent bits, mantissa bits) of IEEE-like float types
_FLOAT_FORMATS = {
    onnx.TensorProto.FLOAT16: (5, 10),
    onnx.TensorProto.BFLOAT16: (8, 7),
    onnx.TensorProto.FLOAT: (8, 23),
    onnx.TensorProto.DOUBLE: (11, 52),
}


def holds_every_value_of(wide: int, narrow: int) -> bool:
    """True when every value of element type ``narrow`` is exactly representable in ``wide``.

    So ``Cast(Cast(x, to=wide), to=narrow)`` is the identity on ``x`` of type ``narrow``. Examples: FLOAT holds
    FLOAT16 and BFLOAT16, INT32 holds INT8, FLOAT holds INT16 (24-bit significand) but not INT32; FLOAT16
    does not hold BFLOAT16 (range) and BFLOAT16 does not hold FLOAT16 (precision). NaN and infinities are
    preserved by float-to-float widening (IEEE 754 §5.4.2).
    """
    if wide == narrow:
        return True
    if narrow in _INT_RANGES and wide in _INT_RANGES:
        lo_n, hi_n = _INT_RANGES[narrow]
        lo_w, hi_w = _INT_RANGES[wide]
        return lo_w <= lo_n and hi_n <= hi_w and not (wide == onnx.TensorProto.BOOL)
    if narrow in _FLOAT_FORMATS and wide in _FLOAT_FORMATS:
        en, mn = _FLOAT_FORMATS[narrow]
        ew, mw = _FLOAT_FORMATS[wide]
        return ew >= en and mw >= mn
    if narrow in _INT_RANGES and wide in _FLOAT_FORMATS:
        lo, hi = _INT_RANGES[narrow]
        _, mw = _FLOAT_FORMATS[wide]
        return max(abs(lo), abs(hi)) <= 2 ** (mw + 1)
    return False
