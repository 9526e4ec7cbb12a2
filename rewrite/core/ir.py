"""The graph IR: ONNX ops as nodes of a ``networkx.MultiDiGraph``, values as its edges.

Layout
------
* Every op is a :class:`Node` (its key in the networkx graph is the node's integer ``id``).
* Every use of a value is an edge ``producer -> consumer`` keyed ``(value_name, in_port)`` with data
  ``value`` (name), ``out_port`` (index in the producer's outputs) and ``in_port`` (index in the consumer's
  inputs, or :data:`IMPLICIT_PORT` for a value that an If/Loop/Scan body reads from the outer scope).
* Graph inputs and initializers are produced by the pseudo node :data:`SOURCE`; graph outputs are consumed
  by the pseudo node :data:`SINK` (``in_port`` = position in the graph's output list). So "is this value
  used outside the match?" is one look at a value's edges, whether the user is a node or the graph.
* :class:`Value` holds the name, the element type and shape when known (from value_info or inference),
  and for initializers the ``TensorProto``, whose data is read only when :meth:`Value.const` is called
  (external data is read from disk lazily, one tensor at a time).

Everything ONNX carries that the IR does not model (model metadata, functions, training info, node
doc strings and metadata_props, attribute protos including If/Loop bodies) is kept verbatim, so
:func:`rewrite.core.onnx_io.load` followed by :func:`rewrite.core.onnx_io.save` reproduces the model.
"""

from __future__ import annotations

import copy
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import networkx as nx
import numpy as np
import onnx
from onnx import helper, numpy_helper

from rewrite.core import spill
from rewrite.errors import RewriteError

SOURCE = -1  #: pseudo node producing graph inputs and initializers
SINK = -2  #: pseudo node consuming graph outputs
IMPLICIT_PORT = -1  #: in_port of an outer-scope value read inside a subgraph attribute

#: metadata_props key recording which rule created a node ("plugin/rule").
RULE_TAG = "rewrite.rule"

Dim = int | str | None  #: a static size, a symbolic dim_param, or unknown


def dtype_name(elem_type: int | None) -> str:
    """ONNX element type number -> spec name (``1`` -> ``"FLOAT"``); ``"?"`` when unknown."""
    if not elem_type:
        return "?"
    return onnx.TensorProto.DataType.Name(elem_type)


@dataclass(eq=False)
class Value:
    """A tensor flowing through the graph.

    Attributes:
        name: unique name in the graph.
        dtype: ONNX element type (``onnx.TensorProto.FLOAT`` ...) or None when unknown.
        shape: tuple of dims (int, symbolic str, or None for unknown), or None when the rank is unknown.
        initializer: the TensorProto for an initializer (data may live in an external file), else None.
        base_dir: directory against which external data locations resolve.
        info: the original ValueInfoProto, kept so an unchanged value is written back byte for byte.
        non_tensor_type: the original TypeProto when the value is not a plain tensor (sequence, optional, map).
        overridable: an initializer also listed in ``graph.input`` of a model of IR 4 or later: a default the
            caller may replace at run time (ONNX IR spec, "Graphs"; before IR 4 every initializer is listed among
            the inputs and is a weight). Its data is not a constant (:meth:`Graph.const` returns None) until
            :meth:`Graph.freeze_inputs`.
    """

    name: str
    dtype: int | None = None
    shape: tuple[Dim, ...] | None = None
    initializer: onnx.TensorProto | None = None
    base_dir: str = ""
    info: onnx.ValueInfoProto | None = None
    non_tensor_type: onnx.TypeProto | None = None
    overridable: bool = False
    _const_cache: np.ndarray | None = field(default=None, repr=False)

    @property
    def is_initializer(self) -> bool:
        return self.initializer is not None

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    def const(self) -> np.ndarray | None:
        """The initializer's data as a numpy array; None for other values. Data inside the model is read on the
        first call and cached; external data (the source's data files, or the spill file) is a copy-on-write
        memory map made per call (:func:`rewrite.core.spill.read_external`), so a model larger than memory is read
        one tensor at a time.

        Raises:
            RewriteError: the external data file is missing or shorter than the tensor needs.
        """
        if self.initializer is None:
            return None
        if self.initializer.data_location == onnx.TensorProto.EXTERNAL:
            return spill.read_external(self.initializer, self.base_dir)  # a memory map, released with the array
        if self._const_cache is None:
            try:
                self._const_cache = numpy_helper.to_array(self.initializer, self.base_dir)
            except (OSError, ValueError) as e:
                raise RewriteError(f"initializer '{self.name}': cannot read its data ({e})") from e
        return self._const_cache

    def set_type(self, dtype: int | None, shape: Sequence[Dim] | None) -> None:
        """Record element type and shape; drops the stored ValueInfoProto if they differ from it."""
        shape_t = None if shape is None else tuple(shape)
        if (dtype, shape_t) != (self.dtype, self.shape):
            self.dtype, self.shape = dtype, shape_t
            self.info = None

    def type_str(self) -> str:
        dims = "?" if self.shape is None else "[" + ",".join("?" if d is None else str(d) for d in self.shape) + "]"
        return f"{dtype_name(self.dtype)}{dims}"

    def to_value_info(self) -> onnx.ValueInfoProto | None:
        """A ValueInfoProto for this value: the original one if unchanged, else built from dtype/shape."""
        if self.info is not None:
            return self.info
        if self.non_tensor_type is not None:
            vi = onnx.ValueInfoProto(name=self.name)
            vi.type.CopyFrom(self.non_tensor_type)
            return vi
        if self.dtype is None:
            return None
        return helper.make_tensor_value_info(self.name, self.dtype, None if self.shape is None else list(self.shape))


@dataclass(eq=False)
class Node:
    """One ONNX op.

    Attributes:
        id: key of this node in the networkx graph (unique, never reused).
        op_type, domain, name: as in NodeProto (domain ``""`` is the default ONNX domain).
        inputs: value names by input port; ``""`` marks an absent optional input (ONNX spec, "Optional Inputs").
        outputs: value names by output port; ``""`` marks an unused optional output.
        attrs: AttributeProtos by name, in their original order (subgraph bodies are kept whole).
        extra: a NodeProto holding the fields the IR does not model (doc_string, metadata_props, overload,
            device_configurations), copied into the node on save.
        order: sort key used to write nodes back in their original order; nodes a rule creates take the
            order of the node they replace.
    """

    id: int
    op_type: str
    domain: str
    name: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, onnx.AttributeProto]
    extra: onnx.NodeProto
    order: float

    def attr(self, name: str, default=None):
        """The Python value of attribute ``name`` (ints, floats, strings decoded, tensors as numpy)."""
        a = self.attrs.get(name)
        if a is None:
            return default
        v = helper.get_attribute_value(a)
        if isinstance(v, bytes):
            return v.decode()
        if isinstance(v, onnx.TensorProto):
            return numpy_helper.to_array(v)
        return v

    def has_subgraphs(self) -> bool:
        return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in self.attrs.values())

    @property
    def rule(self) -> str | None:
        """Name of the rule that created this node, if a rule did."""
        for p in self.extra.metadata_props:
            if p.key == RULE_TAG:
                return p.value
        return None

    @property
    def display_name(self) -> str:
        """The node's name; for a node without one ``<unnamed #i>``, i its position in the source graph's node
        list (stable across runs on the same model)."""
        return self.name or f"<unnamed #{int(self.order)}>"

    def describe(self) -> str:
        """``'name' (domain::OpType)`` with :attr:`display_name`."""
        return f"'{self.display_name}' ({self.domain + '::' if self.domain else ''}{self.op_type})"


def _stored(name: str, array: np.ndarray) -> tuple[onnx.TensorProto, str, np.ndarray | None]:
    """(TensorProto, base_dir, in-memory cache) for new initializer data: spilled to disk when large."""
    array = np.asarray(array)
    if array.nbytes >= spill.SPILL_MIN_BYTES:
        spilled = spill.spill_array(name, array)  # straight from the array: no serialized copy in memory
        if spilled is None:
            spilled = spill.spill_tensor(numpy_helper.from_array(array, name))
        return spilled[0], spilled[1], None
    return numpy_helper.from_array(array, name), "", array


def _copy_proto(m: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(m)
    return out


def subgraph_outer_names(attrs: Iterable[onnx.AttributeProto]) -> list[str]:
    """Names that subgraph attributes read from the enclosing scope, in first-use order.

    A name is outer when a node of the body (or of a nested body) reads it and the body neither
    produces it, takes it as an input, nor holds it as an initializer (ONNX IR spec, "Names Within a Graph").
    """
    seen: dict[str, None] = {}

    def visit(g: onnx.GraphProto, bound: set[str]) -> None:
        bound = bound | {i.name for i in g.input} | {t.name for t in g.initializer}
        bound |= {t.values.name for t in g.sparse_initializer}
        for n in g.node:
            for i in n.input:
                if i and i not in bound:
                    seen.setdefault(i)
            for a in n.attribute:
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    visit(sub, bound)
            bound |= set(n.output)
        for o in g.output:
            if o.name not in bound:
                seen.setdefault(o.name)

    for a in attrs:
        if a.type == onnx.AttributeProto.GRAPH:
            visit(a.g, set())
        elif a.type == onnx.AttributeProto.GRAPHS:
            for g in a.graphs:
                visit(g, set())
    return list(seen)


#: every Graph object alive in this process: spilled tensors any of them holds are not released
_LIVE_GRAPHS: "weakref.WeakSet[Graph]" = weakref.WeakSet()


class Graph:
    """A mutable ONNX graph over a ``networkx.MultiDiGraph``.

    Build one with :func:`rewrite.core.onnx_io.load` (or :meth:`from_model`); write it back with
    :meth:`to_model`. All mutation goes through the methods below, which keep the networkx edges, the
    node port lists and the value table consistent.
    """

    def __init__(self) -> None:
        self.nx = nx.MultiDiGraph()
        self.nx.add_node(SOURCE)
        self.nx.add_node(SINK)
        self.nodes: dict[int, Node] = {}
        self.values: dict[str, Value] = {}
        self.producer: dict[str, tuple[int, int]] = {}  # value name -> (node id or SOURCE, out port)
        self.inputs: list[str] = []  # graph inputs in order (overridable initializers among them)
        self.outputs: list[str] = []
        self.initializers: list[str] = []  # in original order; new ones appended
        self.name = ""
        self.doc_string = ""
        # sparse_initializer, quantization_annotation, metadata_props, value_info of inputs/initializers,
        # and name/doc_string presence (proto2), as read
        self.passthrough = onnx.GraphProto()
        self.value_info_order: list[str] = []  # names that had value_info in the source, in order
        self.output_infos: dict[str, onnx.ValueInfoProto] = {}  # graph outputs' ValueInfoProtos as read
        self.model_shell = onnx.ModelProto()  # everything of the ModelProto but the graph
        self._ids = itertools.count()
        self._names = itertools.count()
        _LIVE_GRAPHS.add(self)

    # ----------------------------------------------------------------- queries
    def node(self, node_id: int) -> Node:
        return self.nodes[node_id]

    def topo_nodes(self) -> list[Node]:
        """Nodes in a topological order that keeps the original order where possible (stable by ``order``)."""
        indeg = {nid: 0 for nid in self.nodes}
        for u, v in self.nx.edges():
            if u in self.nodes and v in self.nodes and u != v:
                indeg[v] += 1
        import heapq

        heap = [(n.order, n.id) for n in self.nodes.values() if indeg[n.id] == 0]
        heapq.heapify(heap)
        out: list[Node] = []
        while heap:
            _, nid = heapq.heappop(heap)
            out.append(self.nodes[nid])
            for _, v in self.nx.out_edges(nid):
                if v in self.nodes and v != nid:
                    indeg[v] -= 1
                    if indeg[v] == 0:
                        heapq.heappush(heap, (self.nodes[v].order, v))
        if len(out) != len(self.nodes):
            stuck = sorted((n for n in self.nodes.values() if indeg[n.id] > 0), key=lambda n: n.order)
            raise RewriteError(f"graph has a cycle through node {stuck[0].describe()}")
        return out

    def producer_node(self, value: str) -> Node | None:
        """The node producing ``value``; None for graph inputs, initializers and unknown names."""
        p = self.producer.get(value)
        if p is None or p[0] == SOURCE:
            return None
        return self.nodes[p[0]]


    def uses(self, value: str) -> list[tuple[int, int]]:
        """Every use of ``value`` as ``(consumer id, in_port)``; consumer is :data:`SINK` for a graph output."""
        p = self.producer.get(value)
        if p is None:
            return []
        # the adjacency dict directly (same order as out_edges): the view objects cost more than the scan
        return [(v, d["in_port"]) for v, keyed in self.nx._succ[p[0]].items() for d in keyed.values() if d["value"] == value]

    def consumers(self, value: str) -> list[Node]:
        """Distinct nodes reading ``value`` (graph outputs excluded), in graph order."""
        ids = {c for c, _ in self.uses(value) if c != SINK}
        return sorted((self.nodes[i] for i in ids), key=lambda n: n.order)

    def only_reader(self, value: str) -> Node | None:
        """The node that is ``value``'s one reader (one input port, not a graph output), else None."""
        uses = self.uses(value)
        if len(uses) != 1 or uses[0][0] == SINK:
            return None
        return self.nodes[uses[0][0]]

    def is_graph_output(self, value: str) -> bool:
        return value in self.outputs

    def const(self, value: str) -> np.ndarray | None:
        """Data of ``value`` when it is an initializer or the output of a Constant node, else None (also for an
        initializer that is a graph input: its data is only a default, see :attr:`Value.overridable`)."""
        v = self.values.get(value)
        if v is None or v.overridable:
            return None
        if v.is_initializer:
            return v.const()
        n = self.producer_node(value)
        if n is not None and n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            if v._const_cache is None:
                a = next(iter(n.attrs.values()), None)
                if a is None or a.name not in ("value", "value_float", "value_floats", "value_int", "value_ints"):
                    return None
                # value_float(s) are float32 and value_int(s) int64 in ONNX, not numpy's float64 default
                dtype = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64, "value_ints": np.int64}.get(a.name)
                v._const_cache = np.asarray(n.attr(a.name), dtype=dtype)
            return v._const_cache
        return None

    def overridable_inputs(self) -> list[str]:
        """Graph inputs whose initializer is their default (:attr:`Value.overridable`), in input order."""
        return [n for n in self.inputs if self.values[n].overridable]

    def freeze_inputs(self) -> list[str]:
        """Make every overridable input a constant: its initializer stays, the graph input goes (the interface
        changes: callers can no longer pass it). Returns the names, in input order."""
        frozen = self.overridable_inputs()
        for name in frozen:
            self.values[name].overridable = False
            self.values[name].info = None  # its declaration was the input's
        self.inputs = [n for n in self.inputs if n not in set(frozen)]
        return frozen

    def ensure_opset(self, domain: str, version: int = 1) -> None:
        """Declare ``domain`` in the model's opset imports when it is not (ORT refuses nodes of an undeclared
        domain)."""
        if self.opset(domain) is None:
            self.model_shell.opset_import.add(domain=domain, version=version)

    def nodes_by_op(self, op_type: str, domain: str = "") -> list[Node]:
        return sorted((n for n in self.nodes.values() if n.op_type == op_type and n.domain == domain), key=lambda n: n.order)

    def opset(self, domain: str = "") -> int | None:
        for o in self.model_shell.opset_import:
            if o.domain == domain or (domain == "" and o.domain == "ai.onnx"):
                return o.version
        return None

    def find_node(self, name: str) -> Node | None:
        for n in self.nodes.values():
            if n.name == name:
                return n
        return None

    # ---------------------------------------------------------------- mutation
    def fresh_name(self, hint: str) -> str:
        """A value or node name not used in the graph, derived from ``hint``."""
        while True:
            cand = f"{hint}__{next(self._names)}"
            if cand not in self.values:
                return cand

    def add_value(self, name: str, **kw) -> Value:
        if name in self.values:
            raise RewriteError(f"value '{name}' already exists in the graph")
        v = Value(name=name, **kw)
        self.values[name] = v
        return v

    def _connect(self, value: str, consumer: int, in_port: int) -> None:
        p = self.producer.get(value)
        if p is None:
            raise RewriteError(f"value '{value}' is used but never produced (not a graph input, initializer or node output)")
        self.nx.add_edge(p[0], consumer, key=(value, in_port), value=value, out_port=p[1], in_port=in_port)

    def _disconnect(self, value: str, consumer: int, in_port: int) -> None:
        p = self.producer.get(value)
        if p is not None and self.nx.has_edge(p[0], consumer, key=(value, in_port)):
            self.nx.remove_edge(p[0], consumer, key=(value, in_port))

    def add_node(
        self,
        op_type: str,
        inputs: Sequence[str],
        outputs: Sequence[str],
        *,
        domain: str = "",
        name: str = "",
        attrs: Iterable[onnx.AttributeProto] = (),
        extra: onnx.NodeProto | None = None,
        order: float | None = None,
        rule: str | None = None,
    ) -> Node:
        """Insert a node. Output values are created (untyped) unless they already exist unproduced.

        Raises:
            RewriteError: an input is never produced, or an output name is already produced.
        """
        nid = next(self._ids)
        ex = onnx.NodeProto() if extra is None else extra
        if rule is not None:
            ex = copy.deepcopy(ex)
            p = ex.metadata_props.add()
            p.key, p.value = RULE_TAG, rule
        node = Node(
            id=nid,
            op_type=op_type,
            domain=domain,
            name=name,
            inputs=list(inputs),
            outputs=list(outputs),
            attrs={a.name: a for a in attrs},
            extra=ex,
            order=float(nid) if order is None else order,
        )
        # validate everything before touching the graph, so a refused node leaves no trace
        outs = [o for o in node.outputs if o]
        for k, o in enumerate(outs):
            if o in self.producer or o in outs[:k]:
                raise RewriteError(f"node {node.describe()}: output '{o}' is already produced by another node")
        for i in node.inputs:
            if i and i not in self.producer and i not in outs:
                raise RewriteError(
                    f"node {node.describe()}: input '{i}' is never produced (not a graph input, initializer or node output)"
                )
        for o_port, o in enumerate(node.outputs):
            if not o:
                continue
            if o not in self.values:
                self.values[o] = Value(name=o)
            self.producer[o] = (nid, o_port)
        self.nodes[nid] = node
        self.nx.add_node(nid)
        for port, i in enumerate(node.inputs):
            if i:
                self._connect(i, nid, port)
        if node.has_subgraphs():
            for i in subgraph_outer_names(node.attrs.values()):
                if i in self.producer:
                    self._connect(i, nid, IMPLICIT_PORT)
        return node

    def remove_node(self, node: Node | int) -> None:
        """Delete a node whose outputs have no remaining uses.

        Raises:
            RewriteError: one of its outputs is still used (by a node or as a graph output).
        """
        node = self.nodes[node] if isinstance(node, int) else node
        for o in node.outputs:
            if o and self.uses(o):
                users = [self.nodes[c].describe() if c != SINK else "the graph outputs" for c, _ in self.uses(o)]
                raise RewriteError(f"cannot remove node {node.describe()}: its output '{o}' is still used by {users[0]}")
        self.nx.remove_node(node.id)
        del self.nodes[node.id]
        for o in node.outputs:
            if o:
                del self.producer[o]
                del self.values[o]

    def set_input(self, node: Node, port: int, value: str) -> None:
        """Make input ``port`` of ``node`` read ``value`` (``""`` makes an optional input absent)."""
        if value and value not in self.producer:
            raise RewriteError(f"node {node.describe()}: input {port} cannot read '{value}', which is never produced")
        old = node.inputs[port]
        if old:
            self._disconnect(old, node.id, port)
        node.inputs[port] = value
        if value:
            self._connect(value, node.id, port)

    def replace_all_uses(self, old: str, new: str) -> None:
        """Make every reader of ``old`` read ``new`` instead: node inputs, subgraph outer reads and graph outputs.

        A graph output keeps its name, since the model's interface must not change: if ``new`` is produced by
        a node and is not itself a graph input, output or initializer, ``new`` is renamed to ``old``;
        otherwise an Identity node named after the output bridges the two.
        """
        if old == new:
            return
        if new not in self.producer:  # checked first: a half-done replacement would leave the graph inconsistent
            raise RewriteError(f"cannot replace '{old}' by '{new}': '{new}' is never produced")
        for consumer, port in list(self.uses(old)):
            if consumer == SINK:
                continue
            n = self.nodes[consumer]
            if port == IMPLICIT_PORT:
                self._rename_in_subgraphs(n, old, new)
            else:
                self.set_input(n, port, new)
        if old in self.outputs:
            self._redirect_graph_output(old, new)

    def _rename_in_subgraphs(self, node: Node, old: str, new: str) -> None:
        def fix(g: onnx.GraphProto) -> None:
            for n in g.node:
                for k, i in enumerate(n.input):
                    if i == old:
                        n.input[k] = new
                for a in n.attribute:
                    for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                        fix(sub)

        for name, a in list(node.attrs.items()):
            if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                a2 = copy.deepcopy(a)
                for sub in ([a2.g] if a2.type == onnx.AttributeProto.GRAPH else list(a2.graphs)):
                    fix(sub)
                node.attrs[name] = a2
        self._disconnect(old, node.id, IMPLICIT_PORT)
        self._connect(new, node.id, IMPLICIT_PORT)

    def _redirect_graph_output(self, old: str, new: str) -> None:
        idx = [k for k, o in enumerate(self.outputs) if o == old]
        new_p = self.producer.get(new)
        old_uses_left = [u for u in self.uses(old) if u[0] != SINK]
        renamable = (
            new_p is not None
            and new_p[0] != SOURCE
            and new not in self.outputs
            and not old_uses_left
            and self.producer.get(old, (SOURCE,))[0] != SOURCE
        )
        old_v = self.values[old]
        old_info = old_v.info  # taken now: renaming old_v below gives it a copy under the new name
        for k in idx:
            self._disconnect(old, SINK, k)
        if renamable:
            # the old producer loses its graph-output use; give its output a fresh name so `old` can move
            old_node = self.producer_node(old)
            if old_node is not None:
                tmp = self.fresh_name(old)
                self._rename_value(old, tmp)
            self._rename_value(new, old)
            nv = self.values[old]
            if nv.dtype is None:
                nv.set_type(old_v.dtype, old_v.shape)
            nv.info = old_info if (nv.dtype, nv.shape) == (old_v.dtype, old_v.shape) else None
            for k in idx:
                self._connect(old, SINK, k)
        else:
            bridge = self.fresh_name(old)
            self._rename_value(old, bridge)
            self.add_node("Identity", [new], [old], name=f"{old}_identity", order=self._order_after(new))
            self.values[old].set_type(old_v.dtype, old_v.shape)
            self.values[old].info = old_info
            for k in idx:
                self._connect(old, SINK, k)

    def _order_after(self, value: str) -> float:
        n = self.producer_node(value)
        return (n.order + 0.5) if n is not None else -0.5

    def _rename_value(self, old: str, new: str) -> None:
        """Rename a value everywhere (producer port, consumers, graph lists)."""
        if new in self.values:
            raise RewriteError(f"cannot rename '{old}' to '{new}': name taken")
        uses = self.uses(old)
        for c, port in uses:
            self._disconnect(old, c, port)
        v = self.values.pop(old)
        v.name = new
        if v.info is not None:
            v.info = copy.deepcopy(v.info)
            v.info.name = new
        self.values[new] = v
        p = self.producer.pop(old)
        self.producer[new] = p
        if p[0] != SOURCE:
            self.nodes[p[0]].outputs[p[1]] = new
        for lst in (self.inputs, self.initializers):
            if old in lst:
                lst[lst.index(old)] = new
        if v.initializer is not None:
            v.initializer = copy.copy(v.initializer)
            v.initializer.name = new
        for c, port in uses:
            if c == SINK:
                self.outputs[port] = new
            elif port == IMPLICIT_PORT:
                self._rename_in_subgraphs(self.nodes[c], old, new)
                continue
            else:
                self.nodes[c].inputs[port] = new
            self._connect(new, c, port)

    def add_output(self, value: str) -> None:
        """Append ``value`` to the graph outputs.

        Raises:
            RewriteError: ``value`` is never produced, or is already a graph output.
        """
        if value not in self.producer:
            raise RewriteError(f"cannot make '{value}' a graph output: it is never produced")
        if value in self.outputs:
            raise RewriteError(f"'{value}' is already a graph output")
        self.outputs.append(value)
        self._connect(value, SINK, len(self.outputs) - 1)

    def add_initializer(self, name: str, array: np.ndarray) -> Value:
        """Add a constant tensor (stored in the model as an initializer; a fresh name if ``name`` is taken).

        A tensor of :data:`~rewrite.core.spill.SPILL_MIN_BYTES` or more is written to the spill file at once and
        not kept in memory (:func:`~rewrite.core.spill.spill_tensor`).
        """
        if name in self.values:
            name = self.fresh_name(name)
        t, base_dir, cache = _stored(name, array)
        v = self.add_value(name, dtype=t.data_type, shape=tuple(t.dims), initializer=t, base_dir=base_dir)
        v._const_cache = cache
        self.producer[name] = (SOURCE, 0)
        self.initializers.append(name)
        return v

    def set_initializer_data(self, name: str, array: np.ndarray) -> Value:
        """Replace the data of initializer ``name`` by ``array`` (its element type and shape become the array's;
        large data is spilled as in :meth:`add_initializer`).

        Raises:
            RewriteError: ``name`` is not an initializer.
        """
        v = self.values.get(name)
        if v is None or not v.is_initializer:
            raise RewriteError(f"'{name}' is not an initializer")
        t, base_dir, cache = _stored(name, array)
        v.initializer, v.base_dir, v._const_cache = t, base_dir, cache
        v.set_type(t.data_type, tuple(t.dims))
        return v

    def remove_unused_initializers(self) -> int:
        """Drop initializers nothing reads; returns how many went. Linear in the number of initializers and of
        their uses (one pass over the SOURCE pseudo node's edges, not one per initializer)."""
        read = {d["value"] for keyed in self.nx._succ[SOURCE].values() for d in keyed.values()}
        inputs = set(self.inputs)
        dead = [i for i in self.initializers if i not in read and i not in inputs]
        if dead:
            gone = set(dead)
            self.initializers[:] = [i for i in self.initializers if i not in gone]
            for i in dead:
                del self.values[i]
                del self.producer[i]
        return len(dead)

    def release_spilled(self) -> int:
        """Give back the spill file's ranges of tensors that no live graph of this process holds any more (this
        one and any other, e.g. a copy a caller kept; see :func:`rewrite.core.spill.release_unreferenced`); returns
        the bytes released. Only where no :meth:`snapshot` of this graph taken before a tensor was dropped can be
        restored: between plugins, during lowering."""
        live = [(v.initializer, v.base_dir) for g in list(_LIVE_GRAPHS) for v in g.values.values() if v.is_initializer]
        return spill.release_unreferenced(live)

    def replace_node(self, node: Node, outputs: Sequence[str]) -> None:
        """Redirect every use of ``node``'s outputs to ``outputs`` (same order; ``""`` for an output nobody
        reads) and remove ``node``. Graph outputs keep their names (see :meth:`replace_all_uses`).

        Raises:
            RewriteError: the number of outputs differs, or a used output has no replacement.
        """
        if len(outputs) != len(node.outputs):
            raise RewriteError(f"node {node.describe()}: {len(outputs)} replacement outputs for {len(node.outputs)}")
        for old, new in zip(node.outputs, outputs):
            if old and new:
                self.replace_all_uses(old, new)
            elif old and self.uses(old):
                raise RewriteError(f"node {node.describe()}: output '{old}' is used but has no replacement")
        self.remove_node(node)

    def remove_dead_nodes(self, candidates: Iterable[int]) -> list[Node]:
        """Remove those of ``candidates`` (and their producers among them, transitively) with no remaining uses."""
        cand = set(candidates)
        removed: list[Node] = []
        changed = True
        while changed:
            changed = False
            for nid in sorted(cand):
                n = self.nodes.get(nid)
                if n is None:
                    cand.discard(nid)
                    continue
                if all(not o or not self.uses(o) for o in n.outputs):
                    self.remove_node(n)
                    removed.append(n)
                    cand.discard(nid)
                    changed = True
        return removed

    # -------------------------------------------------------------- snapshot
    def snapshot(self) -> dict:
        """A copy of the mutable state, for :meth:`restore` (initializer data is shared, never copied).

        Cheap by design (every plugin run takes one): the edge list and each node's and value's field dict are
        copied, not the networkx graph or the objects themselves; :meth:`restore` rebuilds from them.
        """
        return {
            "edges": [(u, v, k, d) for u, nbrs in self.nx._succ.items() for v, keyed in nbrs.items() for k, d in keyed.items()],
            "nodes": {k: (n, n.__dict__.copy(), list(n.inputs), list(n.outputs), dict(n.attrs)) for k, n in self.nodes.items()},
            "values": {k: (v, v.__dict__.copy()) for k, v in self.values.items()},
            "producer": dict(self.producer),
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "initializers": list(self.initializers),
            "model_shell": _copy_proto(self.model_shell),  # opset imports a plugin may add
            "output_infos": dict(self.output_infos),
        }

    def restore(self, snap: dict) -> None:
        """Return to the state captured by :meth:`snapshot`.

        Installs copies, so later edits leave ``snap`` intact and it can be restored again. Node and Value
        objects that existed at the snapshot are reused, with their fields as they were.
        """
        g = nx.MultiDiGraph()
        g.add_nodes_from((SOURCE, SINK, *snap["nodes"]))
        g.add_edges_from((u, v, k, dict(d)) for u, v, k, d in snap["edges"])
        self.nx = g
        self.nodes = {}
        for k, (n, fields, i, o, a) in snap["nodes"].items():
            n.__dict__.clear()
            n.__dict__.update(fields)
            n.inputs, n.outputs, n.attrs = list(i), list(o), dict(a)
            self.nodes[k] = n
        self.values = {}
        for k, (v, fields) in snap["values"].items():
            v.__dict__.clear()
            v.__dict__.update(fields)
            self.values[k] = v
        self.producer = dict(snap["producer"])
        self.inputs, self.outputs, self.initializers = list(snap["inputs"]), list(snap["outputs"]), list(snap["initializers"])
        self.model_shell = _copy_proto(snap["model_shell"])
        self.output_infos = dict(snap["output_infos"])

    # ------------------------------------------------------------- printing
    def summary(self) -> dict[str, int]:
        """Op-type counts, ``domain::op`` for non-default domains."""
        counts: dict[str, int] = {}
        for n in self.nodes.values():
            k = f"{n.domain}::{n.op_type}" if n.domain else n.op_type
            counts[k] = counts.get(k, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def __iter__(self) -> Iterator[Node]:
        return iter(self.topo_nodes())

    def __len__(self) -> int:
        return len(self.nodes)
