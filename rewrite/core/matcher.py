"""Matching patterns against the graph IR.

The matcher anchors output 0 of a pattern at a graph node and walks backwards through inputs. It is a
generator of complete bindings, so alternatives (:class:`~rewrite.core.pattern.Or`) and the two input
orders of commutative ops backtrack naturally: the rule driver takes the first binding its check accepts.
Further pattern outputs are anchored only among nodes downstream (within the pattern's depth) of values
already bound, never by trying every combination of candidate nodes.

When a match fails, :class:`MatchTrace` keeps the deepest partial match and the reason it stopped, which
``rewrite explain`` and the report show. Call sites test ``trace.deeper(b)`` before ``trace.fail(...)`` so a
reason is only formatted when it is kept (most attempts fail shallowly, at every anchor).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import onnx
from onnx import helper, numpy_helper

from rewrite.core.ir import SINK, Graph, Node
from rewrite.core.pattern import AttrVar, Const, NodeOut, NodePattern, Or, Pattern, ValuePattern, Var


@dataclass
class Binding:
    """A partial or complete match: pattern names -> graph objects (copied on every extension)."""

    values: dict[str, str] = field(default_factory=dict)  # Var/Const name -> graph value name
    nodes: dict[int, int] = field(default_factory=dict)  # NodePattern.id -> graph node id
    attrs: dict[str, Any] = field(default_factory=dict)  # AttrVar name -> python value
    symbols: dict[str, Any] = field(default_factory=dict)  # shape symbol -> dim
    names: dict[str, int] = field(default_factory=dict)  # NodePattern.name -> graph node id

    def extend(self, **kw) -> "Binding":
        """A new binding with ``field=(key, value)`` added; unchanged dicts are shared (never mutated in place)."""
        b = Binding(self.values, self.nodes, self.attrs, self.symbols, self.names)
        for k, (key, val) in kw.items():
            setattr(b, k, {**getattr(self, k), key: val})
        return b


@dataclass
class Failure:
    """Why a (partial) match stopped: a reason and the graph node or value it is about.

    ``pairs`` lists, in the order they were matched, each pattern node (its ``_name``, else its op type,
    numbered ``Cast#2`` when the pattern has several) and the graph node it matched. ``anchor`` is the graph
    node where the match was anchored (producer of the pattern's output 0).
    """

    reason: str
    node: str | None = None  # graph node name
    matched: int = 0  # pattern nodes matched when it stopped
    pairs: list[tuple[str, str]] = field(default_factory=list)  # (pattern node label, graph node name)
    anchor: str | None = None

    def __str__(self) -> str:
        return f"{self.reason}" + (f" (at node '{self.node}')" if self.node else "")


class MatchTrace:
    """Collects the deepest failure seen while trying one rule (the best partial match).

    Args:
        labels: pattern node id -> label for the pairs (see :meth:`Pattern.labels`); ids otherwise.
    """

    def __init__(self, labels: dict[int, str] | None = None) -> None:
        self.best: Failure | None = None
        self.labels: dict[int, str] = dict(labels or {})
        self.anchor: str | None = None  # set by the matcher for each anchor it tries
        self._depth: tuple[int, int] = (-1, -1)  # (pattern nodes, variables) bound at the best failure

    def deeper(self, b: Binding) -> bool:
        """Whether a failure at ``b`` would replace the best one: more pattern nodes matched, or as many and
        more variables bound (so a later alternative of an Or that got further wins over an earlier one)."""
        return self.best is None or (len(b.nodes), len(b.values)) > self._depth

    def fail(self, reason: str, b: Binding, g: Graph, node: Node | None = None) -> None:
        if self.deeper(b):
            pairs = [(self.labels.get(pid, str(pid)), node_label(g.nodes[nid])) for pid, nid in b.nodes.items()]
            self.best = Failure(reason, node.name if node is not None else None, len(b.nodes), pairs, self.anchor)
            self._depth = (len(b.nodes), len(b.values))


_UNBOUND = object()


def node_label(n: Node) -> str:
    """A graph node's name, or ``<OpType -> first output>`` for an unnamed node (names are optional in ONNX)."""
    return n.name or f"<{n.op_type} -> {next((o for o in n.outputs if o), '')}>"


def _dtype_ok(want, dtype) -> bool:
    if want is None:
        return True
    if isinstance(want, int):
        return dtype == want
    return dtype in want


class Matcher:
    """Matches one :class:`Pattern` in one :class:`Graph`.

    Args:
        graph: the graph to search.
        pattern: the traced pattern.
        trace: optional collector of the deepest failure.
    """

    def __init__(self, graph: Graph, pattern: Pattern, trace: MatchTrace | None = None):
        self.g = graph
        self.p = pattern
        self.trace = trace or MatchTrace()
        if not self.trace.labels:
            self.trace.labels = pattern.labels()

    # ----------------------------------------------------------------- entry
    def match_at(self, anchor: Node) -> Iterator[Binding]:
        """All complete bindings whose output 0 is produced by ``anchor``."""
        first = self.p.outputs[0]
        self.trace.anchor = anchor.name
        for port, val in enumerate(anchor.outputs):
            if not val:
                continue
            for b in self._value(first, val, Binding()):
                yield from self._rest(1, b)
            if not any(isinstance(o, NodeOut) and o.port > 0 for o in self._alts(first)):
                break  # only port 0 can anchor a single-output root

    def _alts(self, v: ValuePattern) -> list[ValuePattern]:
        return v.alternatives if isinstance(v, Or) else [v]

    def _rest(self, k: int, b: Binding) -> Iterator[Binding]:
        if k == len(self.p.outputs):
            yield b
            return
        out = self.p.outputs[k]
        for val in self._candidates(out, b):
            for b2 in self._value(out, val, b):
                yield from self._rest(k + 1, b2)

    def _candidates(self, out: ValuePattern, b: Binding) -> list[str]:
        """Values that could be output ``out``: outputs of nodes downstream of bound values, nearest first."""
        if isinstance(out, (Var, Const)):
            return [b.values[out.name]] if out.name in b.values else []
        direct: list[str] = []  # outputs of pattern nodes already bound (e.g. a Split's other outputs)
        for alt in (out.alternatives if isinstance(out, Or) else [out]):
            if isinstance(alt, NodeOut) and alt.node.id in b.nodes:
                outs = self.g.nodes[b.nodes[alt.node.id]].outputs
                if alt.port < len(outs) and outs[alt.port] and outs[alt.port] not in direct:
                    direct.append(outs[alt.port])
            elif isinstance(alt, (Var, Const)) and alt.name in b.values and b.values[alt.name] not in direct:
                direct.append(b.values[alt.name])
        if not isinstance(out, Or) and direct:
            return direct
        depth = _height(out)
        frontier = set(b.values.values())
        for nid in b.nodes.values():
            frontier.update(o for o in self.g.nodes[nid].outputs if o)
        found: list[str] = []
        seen = set(frontier)
        for _ in range(depth):
            nxt: set[str] = set()
            for v in sorted(frontier):
                for c in self.g.consumers(v):
                    for o in c.outputs:
                        if o and o not in seen:
                            seen.add(o)
                            nxt.add(o)
                            found.append(o)
            frontier = nxt
        return direct + [o for o in found if o not in direct]

    # ---------------------------------------------------------------- values
    def _value(self, vp: ValuePattern | None, val: str, b: Binding) -> Iterator[Binding]:
        g = self.g
        if vp is None:
            yield b
            return
        if isinstance(vp, Or):
            for alt in vp.alternatives:
                yield from self._value(alt, val, b)
            return
        if isinstance(vp, (Var, Const)):
            if not val:
                if vp.optional:
                    yield b
                else:
                    self.trace.deeper(b) and self.trace.fail(f"input '{vp.name}' is absent", b, g)
                return
            if vp.name in b.values:
                if b.values[vp.name] != val:
                    self.trace.deeper(b) and self.trace.fail(f"'{vp.name}' bound to '{b.values[vp.name]}' and '{val}'", b, g)
                    return
                yield b
                return
            v = g.values.get(val)
            if v is None:
                return
            if not _dtype_ok(vp.dtype, v.dtype):
                self.trace.deeper(b) and self.trace.fail(f"'{vp.name}' ({val}) has dtype {v.type_str()}, pattern wants {vp.dtype}", b, g)
                return
            if isinstance(vp, Var):
                if vp.shape is not None:
                    b2 = self._shape(vp, v, b)
                    if b2 is None:
                        return
                    b = b2
                if vp.check is not None:
                    r = vp.check(v)
                    if r is not True and r is not None:
                        self.trace.deeper(b) and self.trace.fail(r if isinstance(r, str) else f"check on '{vp.name}' ({val}) refused", b, g)
                        return
            else:
                data = g.const(val)
                if data is None:
                    why = " (a graph input with a default: --freeze-inputs makes it one)" if val in g.values and g.values[val].overridable else ""
                    self.trace.deeper(b) and self.trace.fail(f"'{vp.name}' ({val}) is not a constant{why}", b, g)
                    return
                if vp.value is not None:
                    want = np.asarray(vp.value)
                    if data.dtype.kind in "fc" and want.dtype.kind in "fiub":
                        want = want.astype(data.dtype)  # 1e-5 means the float32/float16 nearest to it
                    try:
                        same = np.broadcast(data, want).size == max(data.size, want.size) and bool(np.all(data == want))
                    except ValueError:
                        same = False
                    if not same:
                        self.trace.deeper(b) and self.trace.fail(f"constant '{vp.name}' ({val}) is {data.tolist()}, pattern wants {want.tolist()}", b, g)
                        return
                if vp.check is not None:
                    r = vp.check(data)
                    if r is not True and r is not None:
                        self.trace.deeper(b) and self.trace.fail(r if isinstance(r, str) else f"check on constant '{vp.name}' refused", b, g)
                        return
            yield b.extend(values=(vp.name, val))
            return
        assert isinstance(vp, NodeOut)
        if not val:
            self.trace.deeper(b) and self.trace.fail(f"an input of {vp.node.label()} is absent", b, g)
            return
        n = g.producer_node(val)
        if n is None:
            self.trace.deeper(b) and self.trace.fail(f"'{val}' is a graph input or initializer, pattern wants the output of {vp.node.label()}", b, g)
            return
        if vp.port >= len(n.outputs) or n.outputs[vp.port] != val:
            self.trace.deeper(b) and self.trace.fail(f"'{val}' is output {n.outputs.index(val)} of {n.describe()}, pattern wants output {vp.port}", b, g, n)
            return
        yield from self._node(vp.node, n, b)

    def _shape(self, vp: Var, v, b: Binding) -> Binding | None:
        want = vp.shape
        if v.shape is None or len(v.shape) != len(want):
            self.trace.deeper(b) and self.trace.fail(f"'{vp.name}' has shape {v.type_str()}, pattern wants rank {len(want)}", b, self.g)
            return None
        for w, d in zip(want, v.shape):
            if w is None:
                continue
            if isinstance(w, int):
                if d != w:
                    self.trace.deeper(b) and self.trace.fail(f"'{vp.name}' has shape {v.type_str()}, pattern wants {want}", b, self.g)
                    return None
            else:  # a symbol: bind consistently
                if w in b.symbols:
                    if b.symbols[w] != d or d is None:
                        self.trace.deeper(b) and self.trace.fail(f"shape symbol '{w}' is {b.symbols[w]} and {d}", b, self.g)
                        return None
                else:
                    if d is None:
                        self.trace.deeper(b) and self.trace.fail(f"'{vp.name}' dim for symbol '{w}' is unknown", b, self.g)
                        return None
                    b = b.extend(symbols=(w, d))
        return b

    # ----------------------------------------------------------------- nodes
    def _node(self, np_: NodePattern, n: Node, b: Binding) -> Iterator[Binding]:
        g = self.g
        if np_.id in b.nodes:
            if b.nodes[np_.id] == n.id:
                yield b
            else:
                self.trace.deeper(b) and self.trace.fail(f"{np_.label()} bound to two different nodes", b, g, n)
            return
        if n.id in b.nodes.values():
            self.trace.deeper(b) and self.trace.fail(f"node {n.describe()} already matched by another pattern node", b, g, n)
            return
        if n.op_type not in np_.op_types or n.domain != np_.domain:
            self.trace.deeper(b) and self.trace.fail(f"{n.describe()} is not {np_.label()}", b, g, n)
            return
        if len(n.outputs) < np_.num_outputs:
            self.trace.deeper(b) and self.trace.fail(f"{n.describe()} has {len(n.outputs)} outputs, pattern wants {np_.num_outputs}", b, g, n)
            return
        new_attrs: dict[str, Any] = {}
        for name, want in np_.attrs.items():
            got = n.attr(name, None)
            if isinstance(want, AttrVar):
                if got is None:
                    got = want.default
                if got is None:
                    self.trace.deeper(b) and self.trace.fail(f"{n.describe()} has no attribute '{name}'", b, g, n)
                    return
                if isinstance(got, np.ndarray):
                    got = got.tolist()
                bound = new_attrs.get(want.name, b.attrs.get(want.name, _UNBOUND))
                if bound is not _UNBOUND and bound != got:
                    self.trace.deeper(b) and self.trace.fail(f"attribute '{name}' of {n.describe()} is {got}, already bound to {bound}", b, g, n)
                    return
                if want.check is not None:
                    r = want.check(got)
                    if r is not True and r is not None:
                        self.trace.deeper(b) and self.trace.fail(r if isinstance(r, str) else f"attribute '{name}'={got} of {n.describe()} refused", b, g, n)
                        return
                new_attrs[want.name] = got
            else:
                want_c = _as_stored(name, want)
                if isinstance(got, (list, np.ndarray)):
                    got = list(np.asarray(got).tolist())
                    want_c = list(np.asarray(want_c).tolist())
                if got != want_c:
                    self.trace.deeper(b) and self.trace.fail(f"attribute '{name}' of {n.describe()} is {got}, pattern wants {want}", b, g, n)
                    return
        if np_.check is not None:
            r = np_.check(n)
            if r is not True and r is not None:
                self.trace.deeper(b) and self.trace.fail(r if isinstance(r, str) else f"check on {n.describe()} refused", b, g, n)
                return
        b = Binding(b.values, {**b.nodes, np_.id: n.id}, {**b.attrs, **new_attrs} if new_attrs else b.attrs, b.symbols,
                    {**b.names, np_.name: n.id} if np_.name else b.names)
        ins = list(n.inputs)
        while ins and ins[-1] == "":
            ins.pop()
        pats = np_.inputs
        if np_.variadic:
            if len(ins) < len(pats) - 1:
                self.trace.deeper(b) and self.trace.fail(f"{n.describe()} has {len(ins)} inputs, pattern wants at least {len(pats) - 1}", b, g, n)
                return
            pats = pats[:-1] + [_variadic_at(pats[-1], k) for k in range(len(ins) - len(pats) + 1)]
        elif len(ins) > len(pats) and not np_.allow_other_inputs:
            self.trace.deeper(b) and self.trace.fail(f"{n.describe()} has {len(ins)} inputs, pattern wants {len(pats)}", b, g, n)
            return
        ins = ins + [""] * max(0, len(pats) - len(ins))
        orders = [list(range(len(pats)))]
        if np_.commutative and len(ins) >= 2:
            orders.append([1, 0] + orders[0][2:])  # a variadic tail keeps its place
        for order in orders:
            yield from self._inputs(pats, [ins[k] for k in order], 0, b)

    def _inputs(self, pats: list, vals: list[str], k: int, b: Binding) -> Iterator[Binding]:
        if k == len(pats):
            yield b
            return
        for b2 in self._value(pats[k], vals[k], b):
            yield from self._inputs(pats, vals, k + 1, b2)


def _variadic_at(vp: ValuePattern | None, k: int) -> ValuePattern | None:
    """The variadic tail pattern for the k-th input it covers: a Var/Const binds ``name``, then ``name.1``, ...

    (Repeating the same Var would require every variadic input to be the same value.)
    """
    if k == 0 or not isinstance(vp, (Var, Const)):
        return vp
    return dataclasses.replace(vp, name=f"{vp.name}.{k}")


def _as_stored(name: str, want: Any) -> Any:
    """A literal attribute value as the graph reports it (floats rounded to float32, strings decoded)."""
    try:
        v = helper.get_attribute_value(helper.make_attribute(name, want))
    except Exception:  # noqa: BLE001 - not representable as an attribute: compare as given
        return want
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, onnx.TensorProto):
        return numpy_helper.to_array(v)
    return v


def _height(v: ValuePattern | None) -> int:
    if isinstance(v, NodeOut):
        return 1 + max((_height(i) for i in v.node.inputs), default=0)
    if isinstance(v, Or):
        return max((_height(a) for a in v.alternatives), default=0)
    return 0


class Match:
    """A complete match handed to a rule's check and rewrite.

    ``m["x"]`` is the graph value name bound to variable ``x``; ``m.value("x")`` its IR Value;
    ``m.node("inner")`` the graph node matched by the pattern node named ``inner``; ``m.attr("to")``
    an AttrVar's value; ``m.const("axes")`` a Const's data; ``m.outputs`` the graph values of the
    pattern's outputs; ``m.nodes`` every matched graph node; ``m.ctx`` the run's
    :class:`rewrite.core.driver.RewriteContext` (backend, target, options), None outside a run.
    """

    def __init__(self, graph: Graph, pattern: Pattern, binding: Binding, ctx=None):
        self.graph, self.pattern, self.binding, self.ctx = graph, pattern, binding, ctx
        self.nodes: list[Node] = sorted((graph.nodes[i] for i in binding.nodes.values()), key=lambda n: n.order)
        #: the values the rewrite's results replace; a check may move one downstream of the pattern (a match
        #: proved to extend past it), naming the nodes in between in ``extra_nodes``
        self.outputs: list[str] = [self._resolve_output(o) for o in pattern.outputs]
        #: nodes a check proved part of the match beyond the pattern's own (a region matched by what it
        #: computes); removed with the pattern's nodes when the rewrite leaves them unused
        self.extra_nodes: list[Node] = []
        #: what a check found for its rewrite to use
        self.found: dict = {}

    def _resolve_output(self, o: ValuePattern) -> str:
        for alt in (o.alternatives if isinstance(o, Or) else [o]):
            if isinstance(alt, NodeOut) and alt.node.id in self.binding.nodes:
                return self.graph.nodes[self.binding.nodes[alt.node.id]].outputs[alt.port]
            if isinstance(alt, (Var, Const)) and alt.name in self.binding.values:
                return self.binding.values[alt.name]
        raise KeyError("pattern output not bound")

    def __getitem__(self, name: str) -> str:
        return self.binding.values[name]

    def __contains__(self, name: str) -> bool:
        return name in self.binding.values or name in self.binding.names or name in self.binding.attrs

    def get(self, name: str, default=None):
        return self.binding.values.get(name, default)

    def value(self, name: str):
        return self.graph.values[self.binding.values[name]]

    def const(self, name: str) -> np.ndarray | None:
        return self.graph.const(self.binding.values[name])

    def node(self, name: str) -> Node:
        return self.graph.nodes[self.binding.names[name]]

    def attr(self, name: str):
        return self.binding.attrs[name]

    def symbol(self, name: str):
        return self.binding.symbols[name]

    @property
    def anchor(self) -> Node:
        """The node producing output 0 (where the match was found)."""
        return self.graph.producer_node(self.outputs[0]) or self.nodes[-1]

    def fail(self, reason: str, node: Node | str | None = None) -> Failure:
        """A refusal for a rule's check to return: ``return m.fail("Cast FLOAT->FLOAT16 is lossy", m.node("inner"))``."""
        name = node.name if isinstance(node, Node) else node
        return Failure(reason, name or self.anchor.name, len(self.nodes), self.pairs(), self.anchor.name)

    def pairs(self) -> list[tuple[str, str]]:
        """(pattern node label, graph node name) for every matched pattern node."""
        labels = self.pattern.labels()
        return [(labels[pid], node_label(self.graph.nodes[nid])) for pid, nid in self.binding.nodes.items()]

    def used_outside(self) -> list[str]:
        """Intermediate values (not pattern outputs) read by a node outside the match or by the graph outputs."""
        inside = {n.id for n in self.nodes}
        outs = set(self.outputs)
        leaked = []
        for n in self.nodes:
            for o in n.outputs:
                if not o or o in outs:
                    continue
                if any(c == SINK or c not in inside for c, _ in self.graph.uses(o)):
                    leaked.append(o)
        return leaked
