"""``expand``: recover the output shape of Expand ops whose shape inference left dims unknown.

Seed 000, item A4: the KV-cache index ``Expand(x, Where(Equal(Concat(...), -1), ones, Concat(...)))`` kept
``[1,1,?,1]`` instead of ``[1,16,?,128]`` because ONNX shape inference does not propagate data through
Equal/Where, so the ScatterElements it feeds looked like it wrote one element per position.
:mod:`rewrite.core.shape_eval` already folds such chains when every input is static (``--dim seq_len=1``);
this plugin handles the symbolic case.

Method: evaluate the Expand's shape operand *symbolically*, each element an ``int``, a symbolic dim
(:class:`Sym`: a dim_param name, or "dim ``axis`` of value ``v``" when the dim is unnamed) or ``None``
(unknown), through Shape/Gather/Concat/Slice/Unsqueeze/Squeeze/Cast/Identity/Reshape/Equal/Where and
integer Add/Sub/Mul; evaluate the input's shape the same way (through Range, elementwise ops and Reshape);
then broadcast per ONNX Expand ("bidirectional broadcasting", ONNX spec Expand-13 and Broadcasting.md).
A target element 1 (which is where the seed's Where turns -1 into 1) takes the input's dim. A dim known only
at run time stays symbolic (a dim_param) or unknown: nothing static is invented. Dims are never negative,
so ``Equal(dim, -1)`` is false for every symbolic dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from rewrite.core.driver import PluginReport
from rewrite.core.ir import Graph, Node
from rewrite.plugins.base import Plugin
from rewrite.core.cases import negative, positive

MAX_RANK = 16  #: shape vectors longer than this are not evaluated
#: onnx shape inference names each dim it cannot infer ``unk__N``: a placeholder, not a user's symbol
ANONYMOUS_PREFIX = "unk__"


@dataclass(frozen=True)
class Sym:
    """A non-negative size known only at run time: the dim_param ``name``, or dim ``axis`` of value ``value``."""

    name: str | None = None
    value: str | None = None
    axis: int | None = None

    @property
    def dim_param(self) -> str | None:
        """The ONNX dim_param to write for this dim (None when it has no name)."""
        return self.name


SymDim = int | Sym | None  #: one evaluated element
_BOOL_T, _BOOL_F = "T", "F"  # evaluated booleans are kept apart from the ints 0/1


def _dim_of(graph: Graph, value: str, axis: int) -> SymDim:
    v = graph.values.get(value)
    if v is None or v.shape is None:
        return Sym(value=value, axis=axis)
    d = v.shape[axis]
    if isinstance(d, int):
        return d
    return Sym(name=d) if isinstance(d, str) and not d.startswith(ANONYMOUS_PREFIX) else Sym(value=value, axis=axis)


class SymbolicEvaluator:
    """Evaluates small integer vectors and shapes of a graph symbolically (see the module docstring).

    :meth:`vector` returns the elements of a rank-0/1 integer value (a scalar as one element) or None when
    it cannot; :meth:`shape` returns a value's shape as a list of :data:`SymDim` or None when the rank is
    unknown. Results are memoized per evaluator; build a new one after changing the graph.
    """

    def __init__(self, graph: Graph):
        self.graph = graph
        self._vec: dict[str, list | None] = {}
        self._shape: dict[str, list[SymDim] | None] = {}

    # ---------------------------------------------------------------- vectors
    def vector(self, value: str) -> list | None:
        if value not in self._vec:
            self._vec[value] = None  # cycle guard
            self._vec[value] = self._eval_vector(value)
        return self._vec[value]

    def _eval_vector(self, value: str) -> list | None:
        g = self.graph
        c = g.const(value)
        if c is not None:
            if c.ndim > 1 or c.size > MAX_RANK or not (np.issubdtype(c.dtype, np.integer) or c.dtype == bool):
                return None
            if c.dtype == bool:
                return [_BOOL_T if x else _BOOL_F for x in c.ravel()]
            return [int(x) for x in c.ravel()]
        n = g.producer_node(value)
        if n is None or n.domain not in ("", "ai.onnx"):
            return None
        fn = getattr(self, f"_v_{n.op_type}", None)
        return None if fn is None else fn(n)

    def _v_Shape(self, n: Node) -> list | None:
        shape = self.shape(n.inputs[0])
        if shape is None:
            return None
        r = len(shape)
        start, end = n.attr("start", 0), n.attr("end", r)
        start, end = (max(0, min(r, s + r if s < 0 else s)) for s in (start, end))
        return shape[start:end]

    def _v_Gather(self, n: Node) -> list | None:
        data, idx = self.vector(n.inputs[0]), self.graph.const(n.inputs[1])
        if data is None or idx is None or n.attr("axis", 0) != 0 or idx.ndim > 1:
            return None
        try:
            return [data[int(i)] for i in idx.ravel()]
        except IndexError:
            return None

    def _v_Concat(self, n: Node) -> list | None:
        parts = [self.vector(i) for i in n.inputs]
        return None if any(p is None for p in parts) else [x for p in parts for x in p]

    def _v_Slice(self, n: Node) -> list | None:
        data = self.vector(n.inputs[0])
        consts = [self.graph.const(i) if i else None for i in n.inputs[1:5]]
        consts += [None] * (4 - len(consts))  # axes and steps are optional inputs
        if data is None or consts[0] is None or consts[1] is None:
            return None
        if consts[2] is not None and [int(a) for a in consts[2]] not in ([0], [-1]):
            return None
        step = 1 if consts[3] is None else int(consts[3][0])
        return data[int(consts[0][0]) : int(consts[1][0]) : step]

    def _same(self, n: Node) -> list | None:
        return self.vector(n.inputs[0])

    _v_Identity = _v_Unsqueeze = _v_Squeeze = _same

    def _v_Cast(self, n: Node) -> list | None:
        x = self.vector(n.inputs[0])
        if x is None or any(e in (_BOOL_T, _BOOL_F) for e in x) or n.attr("to") not in (TensorProto.INT64, TensorProto.INT32):
            return None  # only sizes kept as sizes; int32 holds every dim a tensor can have here
        return x

    def _v_Reshape(self, n: Node) -> list | None:
        x, shape = self.vector(n.inputs[0]), self.graph.const(n.inputs[1])
        return x if x is not None and shape is not None and shape.size <= 1 else None

    def _binary(self, n: Node, fn) -> list | None:
        a, b = self.vector(n.inputs[0]), self.vector(n.inputs[1])
        if a is None or b is None or (len(a) != len(b) and 1 not in (len(a), len(b))):
            return None
        k = max(len(a), len(b))
        a, b = (a * k if len(a) == 1 else a), (b * k if len(b) == 1 else b)
        return [fn(x, y) for x, y in zip(a, b)]

    def _v_Equal(self, n: Node) -> list | None:
        def eq(x, y):
            if isinstance(x, int) and isinstance(y, int):
                return _BOOL_T if x == y else _BOOL_F
            if isinstance(x, Sym) and isinstance(y, Sym) and x == y:
                return _BOOL_T
            if isinstance(x, Sym) and isinstance(y, int) and y < 0 or isinstance(y, Sym) and isinstance(x, int) and x < 0:
                return _BOOL_F  # a size is never negative
            return None

        return self._binary(n, eq)

    def _v_Where(self, n: Node) -> list | None:
        cond, a, b = (self.vector(i) for i in n.inputs)
        if cond is None or a is None or b is None:
            return None
        k = max(len(cond), len(a), len(b))
        if any(len(v) not in (1, k) for v in (cond, a, b)):
            return None
        cond, a, b = ((v * k if len(v) == 1 else v) for v in (cond, a, b))
        return [x if c == _BOOL_T else y if c == _BOOL_F else None for c, x, y in zip(cond, a, b)]

    def _v_Add(self, n: Node) -> list | None:
        return self._binary(n, lambda x, y: x + y if isinstance(x, int) and isinstance(y, int) else x if y == 0 else y if x == 0 else None)

    def _v_Sub(self, n: Node) -> list | None:
        return self._binary(n, lambda x, y: x - y if isinstance(x, int) and isinstance(y, int) else x if y == 0 else None)

    def _v_Mul(self, n: Node) -> list | None:
        return self._binary(n, lambda x, y: x * y if isinstance(x, int) and isinstance(y, int) else x if y == 1 else y if x == 1 else None)

    # ----------------------------------------------------------------- shapes
    def shape(self, value: str) -> list[SymDim] | None:
        if value not in self._shape:
            self._shape[value] = None
            self._shape[value] = self._eval_shape(value)
        return self._shape[value]

    def _eval_shape(self, value: str) -> list[SymDim] | None:
        g = self.graph
        v = g.values.get(value)
        known = None if v is None or v.shape is None else [_dim_of(g, value, k) for k in range(len(v.shape))]
        if known is not None and all(isinstance(d, int) or (isinstance(d, Sym) and d.name) for d in known):
            return known
        n = g.producer_node(value)
        derived = None
        if n is not None and n.domain in ("", "ai.onnx"):
            fn = getattr(self, f"_s_{n.op_type}", None)
            if fn is None and n.op_type in _ELEMENTWISE:
                fn = self._s_elementwise
            derived = None if fn is None else fn(n)
        if known is None:
            return derived
        if derived is None or len(derived) != len(known):
            return known
        # keep what inference knew; fill its anonymous dims from the derivation
        return [d if isinstance(k, Sym) and k.name is None and d is not None else k for k, d in zip(known, derived)]

    def _s_Range(self, n: Node) -> list[SymDim] | None:
        start, limit, delta = (self.vector(i) for i in n.inputs)
        if start == [0] and delta == [1] and limit is not None and len(limit) == 1 and limit[0] not in (_BOOL_T, _BOOL_F):
            return [limit[0]]  # ONNX Range: max(ceil((limit - start) / delta), 0) elements; a size is >= 0
        if delta == [1] and start is not None and len(start) == 1 and isinstance(start[0], Sym):
            # Range(p, p + n): n elements (a KV cache's positions: p the past length, n the new tokens)
            add = self.graph.producer_node(n.inputs[1])
            while add is not None and add.op_type == "Cast":
                add = self.graph.producer_node(add.inputs[0])
            if add is not None and add.op_type == "Add":
                a, b = (self.vector(i) for i in add.inputs)
                for p, n_ in ((a, b), (b, a)):
                    if p == start and n_ is not None and len(n_) == 1 and (isinstance(n_[0], Sym) or
                                                                            isinstance(n_[0], int) and n_[0] >= 0):
                        return [n_[0]]
        return None

    def _s_elementwise(self, n: Node) -> list[SymDim] | None:
        shapes = [self.shape(i) for i in n.inputs if i]
        if any(s is None for s in shapes):
            return None
        return broadcast(*shapes)

    def _s_Cast(self, n: Node) -> list[SymDim] | None:
        return self.shape(n.inputs[0])

    _s_Identity = _s_Cast

    def _s_Reshape(self, n: Node) -> list[SymDim] | None:
        target, x = self.vector(n.inputs[1]), self.shape(n.inputs[0])
        if target is None or any(t in (_BOOL_T, _BOOL_F) for t in target):
            return None
        if n.attr("allowzero", 0) == 0 and x is not None:
            target = [x[k] if t == 0 and k < len(x) else t for k, t in enumerate(target)]
        if target.count(-1) == 1 and x is not None:
            # -1 is numel(x) / product(other target dims): resolved when both sides are plain products
            rest = [t for t in target if t != -1]
            rest_int = [t for t in rest if isinstance(t, int)]
            x_int = [d for d in x if isinstance(d, int)]
            x_sym = [d for d in x if not isinstance(d, int)]
            rest_sym = [t for t in rest if not isinstance(t, int)]
            if None in x_sym or None in rest_sym:
                return [t if t != -1 else None for t in target]
            left = list(x_sym)
            for s in rest_sym:
                if s not in left:
                    return [t if t != -1 else None for t in target]
                left.remove(s)
            num, den = int(np.prod(x_int)), int(np.prod(rest_int))
            if den == 0 or num % den:
                return [t if t != -1 else None for t in target]
            q = num // den
            fill = q if not left else (left[0] if len(left) == 1 and q == 1 else None)
            target = [fill if t == -1 else t for t in target]
        return [t if isinstance(t, (int, Sym)) and t != -1 else None for t in target]


_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Where", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual",
                          "And", "Or", "Not", "Neg", "Abs", "Relu", "Sqrt", "Exp", "Pow", "Max", "Min", "Mod"})


def broadcast(*shapes: list[SymDim]) -> list[SymDim]:
    """Multidirectional broadcasting of symbolic shapes (ONNX Broadcasting.md).

    A pair (1, d) gives d; equal dims give that dim; an int > 1 against a symbol gives the int (the symbol
    must then be 1 or equal); anything else (two different symbols, an unknown) gives None.
    """
    r = max(len(s) for s in shapes)
    out: list[SymDim] = []
    for k in range(r):
        dims = [s[k - r + len(s)] for s in shapes if k - r + len(s) >= 0]
        cur: SymDim = 1
        for d in dims:
            if d == 1:
                continue
            if cur == 1 or cur == d:
                cur = d
            elif isinstance(cur, int) and isinstance(d, int):
                cur = None  # an invalid broadcast: not ours to resolve
            elif isinstance(cur, int) and cur > 1:
                continue
            elif isinstance(d, int) and d > 1:
                cur = d
            else:
                cur = None
        out.append(cur)
    return out


def expand_shape(ev: SymbolicEvaluator, node: Node) -> list[SymDim] | None:
    """Output shape of Expand ``node`` = broadcast(input shape, shape operand), or None when unknown."""
    x, target = ev.shape(node.inputs[0]), ev.vector(node.inputs[1])
    if x is None or target is None or any(t in (_BOOL_T, _BOOL_F) for t in target):
        return None
    return broadcast(x, target)


def _gains(old: tuple | None, new: list[SymDim]) -> bool:
    as_onnx = [d if isinstance(d, int) else d.dim_param if isinstance(d, Sym) else None for d in new]
    if old is None:
        return any(d is not None for d in as_onnx)
    if len(old) != len(new):
        return False
    old = [None if isinstance(o, str) and o.startswith(ANONYMOUS_PREFIX) else o for o in old]
    return any((o is None and d is not None) or (isinstance(o, str) and isinstance(d, int)) for o, d in zip(old, as_onnx))


class ExpandShapes(Plugin):
    """Annotates Expand outputs with the shape recovered by :func:`expand_shape` (see the module docstring)."""

    name = "expand-shape"
    short = "expand"
    takes_options = False
    description = "Recover Expand output shapes through Shape/Gather/Concat/Where/Equal chains (seed A4)"
    opset_range = (8, 28)

    def run(self, graph: Graph, report: PluginReport, ctx=None, *, dry_run: bool = False) -> None:
        rep = report.rule("expand-shape")
        ev = SymbolicEvaluator(graph)
        for n in graph.nodes_by_op("Expand"):
            out = graph.values[n.outputs[0]]
            shape = expand_shape(ev, n)
            if shape is None:
                rep.refuse("shape operand not evaluable symbolically", n.name)
                continue
            if not _gains(out.shape, shape):
                continue
            onnx_shape = [d if isinstance(d, int) else d.dim_param if isinstance(d, Sym) else None for d in shape]
            if out.shape is not None and len(out.shape) == len(onnx_shape):
                onnx_shape = [o if d is None else d for o, d in zip(out.shape, onnx_shape)]  # never lose what was known
            rep.matches += 1
            if not dry_run:
                dtype = out.dtype if out.dtype is not None else graph.values[n.inputs[0]].dtype
                out.set_type(dtype, tuple(onnx_shape))
                report.notes.append(f"{n.name}: output {out.name} -> [{','.join('?' if d is None else str(d) for d in onnx_shape)}]")

    @property
    def cases(self):
        return [
            positive("seed-a4-kv-index-expand", a4_expand_model, matches=1),
            negative("runtime-shape-expand", runtime_expand_model),
        ]


def a4_expand_model() -> onnx.ModelProto:
    """Seed A4 in isolation: ``Expand(positions [1,1,seq,1], Where(Equal(Concat(-1, 4, seq, 8), -1), 1, ...))``
    with ``x`` float ``[1, "seq", 8]``; output ``y`` = the expanded int64 index ``[1, 4, seq, 8]``."""
    def c(name, v):
        return helper.make_tensor(name, TensorProto.INT64, [len(v)], v)

    nodes = [
        helper.make_node("Shape", ["x"], ["sh"]),
        helper.make_node("Gather", ["sh", "one"], ["seq"], axis=0),
        helper.make_node("Unsqueeze", ["seq", "zero1"], ["seq1"]),
        helper.make_node("Range", ["zero", "seq", "one"], ["r"]),
        helper.make_node("Reshape", ["r", "idx_shape"], ["idx"]),
        helper.make_node("Concat", ["m1", "four", "seq1", "eight"], ["sizes"], axis=0),
        helper.make_node("Equal", ["sizes", "m1"], ["is_m1"]),
        helper.make_node("Where", ["is_m1", "ones", "sizes"], ["shape"]),
        helper.make_node("Expand", ["idx", "shape"], ["y"], name="a4_expand"),
    ]
    inits = [helper.make_tensor("one", TensorProto.INT64, [], [1]), helper.make_tensor("zero", TensorProto.INT64, [], [0]),
             c("zero1", [0]), c("idx_shape", [1, 1, -1, 1]), c("m1", [-1]), c("four", [4]), c("eight", [8]), c("ones", [1, 1, 1, 1])]
    g = helper.make_graph(nodes, "a4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, None)], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def runtime_expand_model() -> onnx.ModelProto:
    """An Expand whose shape operand is a graph input (a runtime value): its output must stay unknown."""
    g = helper.make_graph([helper.make_node("Expand", ["x", "shape"], ["y"], name="runtime_expand")], "dyn",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 8]),
                           helper.make_tensor_value_info("shape", TensorProto.INT64, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
