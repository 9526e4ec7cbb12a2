"""The pattern language: patterns are written as the ops they match.

A pattern is a Python function whose first argument is an op builder and whose other arguments are
pattern variables; it returns the value(s) the pattern produces::

    def cast_roundtrip(op, x):
        inner = op.Cast(x, to=AttrVar("wide"), _name="inner")
        return op.Cast(inner, to=AttrVar("narrow"), _name="outer")

Building blocks
---------------
* ``op.<OpType>(*inputs, _domain="", _name=None, _outputs=1, _allow_other_inputs=False, _variadic=False,
  _check=None, **attributes)``: a node. An attribute given as a literal must equal it; an :class:`AttrVar`
  binds it (the same AttrVar twice must bind equal values); an attribute not named is not constrained.
* :class:`Var`: any value, optionally constrained by ``dtype`` (one or a set of ONNX element types),
  ``shape`` (a tuple of ints, symbols like ``"B"`` bound consistently across the pattern, or ``None`` for
  any dim), ``check`` (a predicate on the IR :class:`~rewrite.core.ir.Value`), and ``optional=True`` to also
  match an absent optional input.
* :class:`Const`: a value whose data is known (initializer or Constant node), optionally equal to ``value``
  (broadcast compare, e.g. ``Const("axes", value=[-1])``) or passing ``check(array)``.
* :class:`Or`: one of several alternative sub-patterns, tried in order with backtracking.
* Commutative ops (:data:`COMMUTATIVE`) match their two inputs in either order; no rule copies are needed.
* Reusing a Python variable reuses the pattern: a variable bound twice must bind the same graph value.
* :func:`subpattern`: a pattern function called from another pattern function. Each call builds fresh
  nodes, and the Vars, Consts, AttrVars and node ``_name`` s created inside it are scoped to that call
  (``<scope>.<name>``), so calling it twice does not force both calls to bind the same values::

      @subpattern
      def rms_norm(op, x):
          var = op.ReduceMean(op.Pow(x, Const("two", value=2.0)), _name="mean")
          return op.Mul(op.Div(x, op.Sqrt(op.Add(var, Const("eps")))), Var("weight"), _name="scale")

      def two_norms(op, x, y):
          return rms_norm(op, x, _scope="q"), rms_norm(op, y, _scope="k")   # m["q.weight"], m.node("k.scale")

  Without ``_scope`` the scope is ``<function name>#<k>`` for the k-th call (1-based) within the pattern.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

#: Binary ops whose result does not depend on the order of their two inputs (ONNX spec).
COMMUTATIVE = frozenset({"Add", "Mul", "And", "Or", "Xor", "Equal", "Max", "Min", "Sum", "Mean", "BitwiseAnd", "BitwiseOr", "BitwiseXor"})

_counter = itertools.count()


class ValuePattern:
    """Base class of everything that matches one graph value."""


@dataclass(eq=False)
class Var(ValuePattern):
    """A pattern variable: matches any value satisfying the constraints and binds it to ``name``."""

    name: str
    dtype: int | Sequence[int] | None = None
    shape: tuple | None = None
    check: Callable[[Any], bool | str] | None = None
    optional: bool = False


@dataclass(eq=False)
class Const(ValuePattern):
    """A value with known data (initializer or Constant output), bound to ``name`` like a :class:`Var`.

    ``value`` requires equality after broadcasting; ``check`` gets the numpy array and returns True, or
    False / a reason string to refuse.
    """

    name: str
    value: Any = None
    check: Callable[[np.ndarray], bool | str] | None = None
    dtype: int | Sequence[int] | None = None
    optional: bool = False


@dataclass(eq=False)
class AttrVar:
    """Binds an attribute's value to ``name``; ``check(value)`` may refuse it."""

    name: str
    check: Callable[[Any], bool | str] | None = None
    default: Any = None


@dataclass(eq=False)
class NodePattern:
    """One node of a pattern. Built through the op builder, not directly."""

    op_type: str | tuple[str, ...]
    domain: str
    inputs: list[ValuePattern | None]
    attrs: dict[str, Any]
    name: str | None
    num_outputs: int
    allow_other_inputs: bool = False
    variadic: bool = False
    check: Callable | None = None
    id: int = field(default_factory=lambda: next(_counter))

    @property
    def op_types(self) -> tuple[str, ...]:
        return self._op_types

    def __post_init__(self) -> None:
        self._op_types = self.op_type if isinstance(self.op_type, tuple) else (self.op_type,)

    @property
    def commutative(self) -> bool:
        return len(self.inputs) == 2 and all(t in COMMUTATIVE for t in self.op_types)

    def label(self) -> str:
        return self.name or "|".join(self.op_types)


@dataclass(eq=False)
class NodeOut(ValuePattern):
    """Output ``port`` of a pattern node."""

    node: NodePattern
    port: int = 0


@dataclass(eq=False)
class Or(ValuePattern):
    """Matches the first alternative that leads to a full match (backtracking into later ones)."""

    alternatives: list[ValuePattern]


class OpBuilder:
    """``op.Cast(x, to=1)`` builds a :class:`NodePattern` and returns its output pattern(s)."""

    def __init__(self, domain: str = ""):
        self._domain = domain
        self._calls: dict[str, int] = {}  # subpattern name -> calls so far (default scopes)

    def __getattr__(self, op_type: str) -> Callable[..., Any]:
        if op_type.startswith("__"):
            raise AttributeError(op_type)

        def make(
            *inputs: ValuePattern | None,
            _domain: str | None = None,
            _name: str | None = None,
            _outputs: int = 1,
            _allow_other_inputs: bool = False,
            _variadic: bool = False,
            _check: Callable | None = None,
            _op_types: tuple[str, ...] | None = None,
            **attrs: Any,
        ):
            for i in inputs:
                if i is not None and not isinstance(i, ValuePattern):
                    raise TypeError(f"pattern {op_type}: inputs must be pattern values, got {type(i).__name__}")
            np_ = NodePattern(
                op_type=_op_types or op_type,
                domain=self._domain if _domain is None else _domain,
                inputs=list(inputs),
                attrs=attrs,
                name=_name,
                num_outputs=_outputs,
                allow_other_inputs=_allow_other_inputs,
                variadic=_variadic,
                check=_check,
            )
            outs = tuple(NodeOut(np_, k) for k in range(_outputs))
            return outs[0] if _outputs == 1 else outs

        return make

    def any_of(self, op_types: Sequence[str], *inputs, **kw):
        """A node whose op_type is any of ``op_types`` (e.g. ``("Gemm", "MatMul")`` is not equivalent; use with care)."""
        return getattr(self, op_types[0])(*inputs, _op_types=tuple(op_types), **kw)


def subpattern(fn: Callable) -> Callable:
    """Decorator: ``fn(op, *inputs, **kw)`` becomes a reusable pattern fragment (see the module docstring).

    Called as ``fn(op, *inputs, _scope=None, **kw)`` from inside another pattern function; returns what ``fn``
    returns. Pattern objects passed in as arguments keep their names; everything ``fn`` creates is renamed
    ``<scope>.<name>``. Shape symbols (``"B"``, ``"S"``) are not scoped: they bind across the whole pattern.

    Raises:
        TypeError: called without an :class:`OpBuilder` as first argument.
    """

    def call(op: OpBuilder, *args: Any, _scope: str | None = None, **kw: Any) -> Any:
        if not isinstance(op, OpBuilder):
            raise TypeError(f"subpattern {fn.__name__} must be called with the op builder first, got {type(op).__name__}")
        if _scope is None:
            op._calls[fn.__name__] = op._calls.get(fn.__name__, 0) + 1
            _scope = f"{fn.__name__}#{op._calls[fn.__name__]}"
        start = next(_counter)  # node patterns created by this call have larger ids
        out = fn(op, *args, **kw)
        outer = {id(a) for a in itertools.chain(args, kw.values())}
        done: set[int] = set()

        def scope(v: Any) -> None:
            if v is None or id(v) in outer or id(v) in done:
                return
            done.add(id(v))
            if isinstance(v, (Var, Const, AttrVar)):
                v.name = f"{_scope}.{v.name}"
            elif isinstance(v, Or):
                for a in v.alternatives:
                    scope(a)
            elif isinstance(v, NodeOut) and v.node.id > start and id(v.node) not in done:
                done.add(id(v.node))
                if v.node.name:
                    v.node.name = f"{_scope}.{v.node.name}"
                for a in v.node.attrs.values():
                    if isinstance(a, AttrVar):
                        scope(a)
                for i in v.node.inputs:
                    scope(i)

        for o in out if isinstance(out, (tuple, list)) else (out,):
            scope(o)
        return out

    call.__name__, call.__doc__, call.__wrapped__ = fn.__name__, fn.__doc__, fn  # type: ignore[attr-defined]
    return call


@dataclass(eq=False)
class Pattern:
    """A traced pattern: its output value patterns and every node pattern reachable from them."""

    outputs: list[ValuePattern]
    vars: list[str]

    @classmethod
    def trace(cls, fn: Callable, domain: str = "") -> "Pattern":
        """Call ``fn(op, *vars)`` with an :class:`OpBuilder` and one :class:`Var` per remaining parameter.

        A parameter whose default is a :class:`Var` or :class:`Const` uses that (with the parameter's name).
        """
        params = list(inspect.signature(fn).parameters.values())[1:]
        args = []
        for p in params:
            d = p.default
            if isinstance(d, (Var, Const)):
                d.name = p.name
                args.append(d)
            else:
                args.append(Var(p.name))
        out = fn(OpBuilder(domain), *args)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        for o in outs:
            if not isinstance(o, ValuePattern):
                raise TypeError(f"pattern {fn.__name__} must return pattern values, got {type(o).__name__}")
        return cls(outputs=outs, vars=[p.name for p in params])

    def node_patterns(self) -> list[NodePattern]:
        """All node patterns, outputs' roots first, then depth-first through inputs (deterministic)."""
        seen: dict[int, NodePattern] = {}

        def visit(v: ValuePattern | None) -> None:
            if isinstance(v, NodeOut):
                if v.node.id in seen:
                    return
                seen[v.node.id] = v.node
                for i in v.node.inputs:
                    visit(i)
            elif isinstance(v, Or):
                for a in v.alternatives:
                    visit(a)

        for o in self.outputs:
            visit(o)
        return list(seen.values())

    def labels(self) -> dict[int, str]:
        """NodePattern id -> label for reports: its ``_name``, else its op type, numbered (``Cast#2``) when the
        pattern has several unnamed nodes of that type (numbered in :meth:`node_patterns` order)."""
        nodes = self.node_patterns()
        counts: dict[str, int] = {}
        for n in nodes:
            if not n.name:
                counts[n.label()] = counts.get(n.label(), 0) + 1
        seen: dict[str, int] = {}
        out = {}
        for n in nodes:
            lab = n.label()
            if not n.name and counts[lab] > 1:
                seen[lab] = seen.get(lab, 0) + 1
                lab = f"{lab}#{seen[lab]}"
            out[n.id] = lab
        return out

    def max_nodes(self) -> int:
        """Pattern nodes a complete match binds, taking the largest alternative of each :class:`Or`."""

        def nodes(v: ValuePattern | None) -> frozenset[int]:
            if isinstance(v, NodeOut):
                return frozenset({v.node.id}).union(*(nodes(i) for i in v.node.inputs))
            if isinstance(v, Or):
                return max((nodes(a) for a in v.alternatives), key=len, default=frozenset())
            return frozenset()

        return len(frozenset().union(*(nodes(o) for o in self.outputs)))

    @property
    def size(self) -> int:
        """Number of node patterns (the default rule benefit: larger patterns are tried first)."""
        return len(self.node_patterns())

    def root(self, k: int = 0) -> NodePattern | None:
        o = self.outputs[k]
        while isinstance(o, Or):
            o = o.alternatives[0]
        return o.node if isinstance(o, NodeOut) else None

    def root_op_types(self) -> tuple[str, ...]:
        """op_types that can anchor output 0 (all alternatives of an Or root)."""
        o = self.outputs[0]
        alts = o.alternatives if isinstance(o, Or) else [o]
        out: list[str] = []
        for a in alts:
            if isinstance(a, NodeOut):
                out.extend(t for t in a.node.op_types if t not in out)
        return tuple(out)
