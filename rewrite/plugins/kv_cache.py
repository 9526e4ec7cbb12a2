"""``kv``: KV-cache updates written as one slice insert at a position.

The seed's static-cache form (seed 000, "KV Cache Update", items A4/A5) writes each layer's new keys and
values with ``ScatterElements(past, indices, update, axis=2)`` where
``indices = Expand(Reshape(Cast(Add(seq_position, Range(0, seq, 1))), [1, 1, -1, 1]), shape)``. IREE lowers
that scatter to a generic per-element scatter plus copies of the whole cache (the seed counted about 240 copy
dispatches per step, down to 2 after the rewrite). When the indices are *provably* one contiguous range
``position + j`` (``j = 0 .. n-1``) along the scatter axis, broadcast unchanged along every other axis, the
scatter is exactly ``past[..., position : position + n, ...] = update``, which this plugin writes as the
abstract op ``ai.rewrite::KVCacheUpdate`` (see :class:`KVCacheUpdate` for its contract and lowerings).

Anything else is left alone: strided or reversed ranges, a range broadcast along the scatter axis (the same
index repeated), per-batch offsets, index tensors read from a graph input, ``reduction`` other than none.
The proof uses :class:`rewrite.plugins.expand.SymbolicEvaluator`, so it holds for a symbolic ``seq``.

With the option ``max_seq`` (``--max-seq N`` or ``--opt kv.max_seq=N``) the plugin first converts
transformers' growing cache, ``present = Concat(past, new)`` on the sequence axis, into a static cache of
``N`` positions written by ``KVCacheUpdate`` at a new ``seq_position`` input (see :func:`to_static_cache`;
seed 000 item 10). The model interface changes then: pasts/presents ``[B, H, N, D]``, ``attention_mask
[B, N]``, ``seq_position`` int64 ``[1]``; :mod:`rewrite.generate` drives that interface.
"""

from __future__ import annotations

import re

import networkx as nx
import numpy as np
import onnx
from onnx import TensorProto, helper

from rewrite.core.iree_lowering import IreeLowering, PatchContext, TorchOperator, insert_rows_mlir
from rewrite.core.abstract_ops import DOMAIN, AbstractOp
from rewrite.core.driver import PluginReport, apply_rules
from rewrite.core.ir import SOURCE, Graph, Node
from rewrite.core.pattern import AttrVar
from rewrite.core.rules import Builder, rule
from rewrite.core.shapes import infer_shapes
from rewrite.errors import RewriteError
from rewrite.plugins.base import Plugin
from rewrite.plugins.expand import Sym, SymbolicEvaluator, expand_shape
from rewrite.core.cases import negative, positive

_INT_TYPES = (TensorProto.INT64, TensorProto.INT32)


class KVCacheUpdate(AbstractOp):
    """``present = KVCacheUpdate(past, update, position; axis)``.

    Inputs: ``past`` ``[d0, .., S, .., dr]`` (any float type; ``S`` at ``axis``), ``update`` of the same
    shape except ``n <= S`` at ``axis``, ``position`` int64 with one element (shape ``[1]`` or ``[]``).
    Output: ``past`` with ``present[..., p : p + n, ...] = update`` along ``axis`` where ``p = position``,
    or ``position + S`` when negative (ScatterElements' index normalization, ONNX spec ScatterElements-18).

    Out-of-range writes (``p + n > S``): the reference raises ``ValueError``, ORT's ScatterND raises, the IREE
    lowering clamps the offset to ``S - n`` (an out-of-bounds write would be undefined behaviour);
    :mod:`rewrite.generate` refuses such positions before calling the model.
    """

    ort_targets = ("cpu", "cuda")  # standard ONNX ScatterND
    iree_targets = ("llvm-cpu", "cuda")  # iree_linalg_ext.scatter: no kernel

    op_type = "KVCacheUpdate"

    @staticmethod
    def sample_inputs(rng: np.random.Generator) -> list[tuple[dict, list[np.ndarray]]]:
        """Conformance samples: prefill at 0, one token mid-cache, the last slot, a negative position."""
        out = []
        for p, n in ((0, 5), (7, 1), (15, 1), (-3, 2)):
            past = rng.standard_normal((1, 2, 16, 8)).astype(np.float32)
            out.append(({"axis": 2}, [past, rng.standard_normal((1, 2, n, 8)).astype(np.float32), np.array([p], np.int64)]))
        return out

    def reference(self, attrs: dict, past: np.ndarray, update: np.ndarray, position: np.ndarray) -> list[np.ndarray]:
        axis = attrs["axis"] % past.ndim
        p, s, n = int(np.asarray(position).ravel()[0]), past.shape[axis], update.shape[axis]
        p = p + s if p < 0 else p
        if p < 0 or p + n > s:
            raise ValueError(f"KVCacheUpdate: rows {p}..{p + n} outside the cache's {s} positions")
        out = past.copy()
        sl = [slice(None)] * past.ndim
        sl[axis] = slice(p, p + n)
        out[tuple(sl)] = update
        return [out]

    def lower_ort(self, graph: Graph, node: Node) -> None:
        """:func:`rows_written_onnx` in place of the node."""
        past, update, position = node.inputs
        axis = node.attr("axis") % len(graph.values[past].shape)
        b = Builder(graph, "lower/KVCacheUpdate", node.order, node.name)
        graph.replace_node(node, [rows_written_onnx(graph, b, past, update, position, axis)])

    def lower_iree(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """``update`` scattered into ``past`` at rows ``offset ..`` of ``axis``, the offset computed on the device
        (see :func:`insert_rows_mlir`)."""
        past, update, pos = op.operand_types
        axis = int(op.attrs["axis"]) % len(past.dims)
        seq = past.dims[axis] if past.dims[axis] is not None else f"%in0_d{axis}"
        return IreeLowering(body=insert_rows_mlir("kv", "%in0", past.builtin, [], "%in1", update, "%in2", pos, seq, axis, "%out0"))


def rows_written_onnx(graph: Graph, b: Builder, past: str, update: str, position: str, axis: int) -> str:
    """The KVCacheUpdate contract as standard ONNX ops built with ``b``; returns the written cache's value name.

    ScatterND with indices over the leading ``axis + 1`` dims (measured fastest of ScatterElements, ScatterND and
    Slice+Concat on ORT 1.32 CPU, BENCHMARKS.md "kv"); when a leading dim is not static, ScatterElements with the
    range rebuilt (the original form)."""
    shape = graph.values[past].shape
    one, zero = b.const(1, "one", np.int64), b.const(0, "zero", np.int64)
    pos = b.op("Reshape", [position, b.const([1], "one_elem", np.int64)])
    size = b.const([shape[axis]], "size", np.int64) if isinstance(shape[axis], int) else b.op("Shape", [past], start=axis, end=axis + 1)
    pos = b.op("Where", [b.op("Less", [pos, b.const([0], "z1", np.int64)]), b.op("Add", [pos, size]), pos])
    n = b.op("Squeeze", [b.op("Shape", [update], start=axis, end=axis + 1)])
    rows = b.op("Add", [pos, b.op("Range", [zero, n, one])])  # [n]
    lead = shape[:axis]
    if all(isinstance(d, int) for d in lead):
        grid_shape = [1] * axis + [-1, 1]
        idx_axis = b.op("Reshape", [rows, b.const(grid_shape, "grid", np.int64)])  # [1.., n, 1]
        parts = []
        for k, d in enumerate(lead):
            g = np.arange(d, dtype=np.int64).reshape([d if j == k else 1 for j in range(axis)] + [1, 1])
            parts.append(b.const(g, f"lead{k}"))
        target = b.op("Concat", [b.op("Shape", [update], start=0, end=axis + 1), b.const([1], "one1", np.int64)], axis=0)
        parts = [b.op("Expand", [p, target]) for p in parts] + [b.op("Expand", [idx_axis, target])]
        idx = b.op("Concat", parts, axis=-1) if len(parts) > 1 else parts[0]
        out = b.op("ScatterND", [past, idx, update])
    else:
        shape_r = [1] * len(shape)
        shape_r[axis] = -1
        idx = b.op("Expand", [b.op("Reshape", [rows, b.const(shape_r, "rs", np.int64)]), b.op("Shape", [update])])
        out = b.op("ScatterElements", [past, idx, update], axis=axis)
    graph.values[out].set_type(graph.values[past].dtype, shape)
    return out


KV_UPDATE = KVCacheUpdate()


# ------------------------------------------------- growing cache -> static cache
POSITION_INPUT = "seq_position"  #: the input the static form adds: where this call's tokens are written


def growing_caches(graph: Graph) -> list[Node]:
    """``Concat(past, new)`` nodes on the sequence axis (2 of rank 4) whose ``past`` is a graph input and whose
    output is a graph output: transformers' export of a cache that grows by ``new``'s length every call."""
    out = []
    for n in graph.nodes_by_op("Concat"):
        if len(n.inputs) != 2 or n.inputs[0] not in graph.inputs or n.outputs[0] not in graph.outputs:
            continue
        shape = graph.values[n.inputs[0]].shape
        if shape is None or len(shape) != 4 or n.attr("axis") % 4 != 2:
            continue
        out.append(n)
    return out


#: the longest static cache ``to_static_cache`` builds: 2^22 positions. A cache's inputs are [B, H, N, D] per
#: layer, so that many positions of Qwen3-30B-A3B (48 layers, 4 KV heads of 128, fp16) are 400 GB: more than any
#: one GPU holds
MAX_SEQ_LIMIT = 1 << 22


def to_static_cache(graph: Graph, max_seq: int, report: PluginReport, *, dry_run: bool = False) -> int:
    """Turn transformers' growing cache into a static cache of ``max_seq`` positions (seed 000, item 10).

    Before: pasts ``[B, H, P, D]``, ``attention_mask [B, P + n]``, presents ``Concat(past, new) [B, H, P + n, D]``;
    ``n`` symbolic, or 1 (the token count fixed with ``--dim``: a module for one-token calls).
    After: pasts and presents ``[B, H, max_seq, D]``, ``attention_mask [B, max_seq]`` (1 for every slot the
    caller allows; slots not yet written are excluded by the causal mask), a new input ``seq_position`` int64
    ``[1]`` (= P, where the ``n`` new tokens are written) and each present ``KVCacheUpdate(past, new,
    seq_position)``. In the mask and position computations the past length ``P`` (read as ``Shape(past)`` at
    the sequence axis) becomes ``seq_position`` and the key length ``P + n`` becomes ``max_seq``.

    Caches may carry their own past-length symbols (transformers' gpt-oss export gives its sliding-window
    layers one, read by their window masks, and the full-attention layers another). Every cache grows by the
    same ``n`` per call and starts empty, so the presents a caller feeds back keep the lengths equal; the static
    form writes them all at ``seq_position``. A sliding-window layer then keeps every position (``max_seq``
    slots, like the others) and its window comes from the export's own mask, which compares key slot and
    query position.

    Returns how many caches were converted (0 when the model has no growing cache: then nothing changes).

    Raises:
        RewriteError: the past length is read in a way this conversion does not rewrite (the graph would
            silently compute with ``max_seq`` as the past length), or ``max_seq`` is not positive or past
            :data:`MAX_SEQ_LIMIT`; the caches do
            not grow by one new length, a past has a fixed length, another input has a dim of a past length
            (a cache trimmed to a window), or one ``P + n`` is both the positions' limit and read otherwise.
    """
    if not 0 < max_seq <= MAX_SEQ_LIMIT:  # (checked before looking for caches: a model without one too)
        raise RewriteError(f"kv: max_seq {max_seq} (--max-seq or --opt kv.max_seq): must be positive and at most "
                           f"{MAX_SEQ_LIMIT}")
    concats = growing_caches(graph)
    rep = report.rule("static-cache")
    if not concats:
        return 0
    pasts = [n.inputs[0] for n in concats]
    past_sym = {p: graph.values[p].shape[2] for p in pasts}
    ev = SymbolicEvaluator(graph)
    n_syms = {_new_length(graph, ev, n.inputs[1]) for n in concats}
    # the new length may be fixed to one token (``--dim <seq>=1``: a module for decode steps only)
    if len(n_syms) != 1 or not all(isinstance(d, str) or d == 1 for d in n_syms):
        raise RewriteError(f"static cache: caches {', '.join(pasts)} do not grow by one new length (symbolic, or 1): "
                           f"{', '.join(sorted(map(str, n_syms)))}")
    fixed = [p for p, d in past_sym.items() if not isinstance(d, str)]
    if fixed:
        raise RewriteError(f"static cache: past '{fixed[0]}' has a fixed length {past_sym[fixed[0]]} at axis 2 "
                           "(expected a symbolic past length)")
    n_sym = n_syms.pop()
    # another input sized by a past length (gpt-oss's dynamo export: the sliding-window layer's cache, trimmed by
    # a Slice, shares the full layers' dim) would keep a dynamic length the rewritten graph no longer agrees with
    for i in graph.inputs:
        shape = graph.values[i].shape or ()
        if i in past_sym or i == "attention_mask":
            continue
        hit = next((d for d in shape if isinstance(d, str) and any(_mentions(d, s) for s in set(past_sym.values()))), None)
        if hit is not None:
            raise RewriteError(f"static cache: input '{i}' has a dim '{hit}' of a past length, but it is not a growing "
                               "cache (Concat(past, new) returned as an output; a sliding-window cache trimmed by a "
                               "Slice is not converted)")
    rep.matches += len(concats)
    if dry_run:
        return len(concats)
    pos = POSITION_INPUT
    if pos in graph.values:
        raise RewriteError(f"static cache: the model already has a value named '{pos}'")
    # one past length per symbol; several when the export gives some layers their own (gpt-oss's sliding-window
    # layers): every cache grows by the same new length each call, so they all become one write position
    syms = {d: Sym(name=d) for d in past_sym.values()}
    N = Sym(name=n_sym) if isinstance(n_sym, str) else n_sym
    key_lengths = [v for P in syms.values() for v in ([[P], [N]], [[N], [P]])]
    graph.add_value(pos, dtype=TensorProto.INT64, shape=(1,))
    graph.producer[pos] = (SOURCE, 0)
    graph.inputs.append(pos)
    b = Builder(graph, "kv/static-cache", min(n.order for n in concats), "static_cache")
    replaced: list[Node] = []
    # key length P + n -> max_seq (first: it is recognized by evaluating to P + n)
    for n in graph.nodes_by_op("Add"):
        vecs = [ev.vector(i) for i in n.inputs]
        if vecs in key_lengths and not _limits_positions(graph, ev, n, next(v[0] for v in vecs if v[0] in syms.values())):
            shape = graph.values[n.outputs[0]].shape or ()
            graph.replace_all_uses(n.outputs[0], b.const(np.full(shape, max_seq, np.int64), "max_seq"))
            replaced.append(n)
    # past length P -> seq_position
    scalar_pos = None
    for p in pasts:
        P = syms[past_sym[p]]
        for c in graph.consumers(p):
            if c in concats:
                continue
            vec = ev.vector(c.outputs[0]) if c.op_type == "Shape" else None
            if vec == [P]:
                graph.replace_all_uses(c.outputs[0], pos)
            elif vec is not None and P in vec and all(g.op_type == "Gather" and ev.vector(g.outputs[0]) in ([P], None) for g in graph.consumers(c.outputs[0])):
                for g in graph.consumers(c.outputs[0]):
                    if ev.vector(g.outputs[0]) != [P]:
                        raise RewriteError(f"static cache: node {g.describe()} reads the shape of past '{p}' in a way the conversion does not rewrite")
                    if scalar_pos is None:
                        scalar_pos = b.op("Squeeze", [pos], dtype=TensorProto.INT64, shape=())
                    rank = len(graph.values[g.outputs[0]].shape or ())
                    graph.replace_all_uses(g.outputs[0], pos if rank == 1 else scalar_pos)
                    replaced.append(g)
            elif vec is None or P in vec:
                raise RewriteError(f"static cache: node {c.describe()} reads past '{p}' in a way the conversion does not rewrite")
            replaced.append(c)
    static = {p: (*graph.values[p].shape[:2], max_seq, *graph.values[p].shape[3:]) for p in pasts}
    for n in concats:
        past, new = n.inputs
        out = b.op(KVCacheUpdate.op_type, [past, new, pos], domain=DOMAIN, axis=2, dtype=graph.values[past].dtype, shape=static[past])
        graph.replace_node(n, [out])
    for p in pasts:
        graph.values[p].set_type(graph.values[p].dtype, static[p])
    if "attention_mask" in graph.inputs:
        m = graph.values["attention_mask"]
        if m.shape is not None and len(m.shape) == 2:
            m.set_type(m.dtype, (m.shape[0], max_seq))
    # intermediate types that mention the old lengths are re-inferred from the new inputs
    boundary = set(graph.inputs) | set(graph.outputs)
    for v in graph.values.values():
        if not v.is_initializer and v.name not in boundary and v.shape is not None and any(
                isinstance(d, str) and any(_mentions(d, s) for s in syms) for d in v.shape):
            v.set_type(None, None)
    for o in graph.outputs:
        graph.output_infos.pop(o, None)
    if graph.opset(DOMAIN) is None:
        graph.model_shell.opset_import.add(domain=DOMAIN, version=1)
    graph.remove_dead_nodes(n.id for n in replaced)
    infer_shapes(graph)
    report.notes.append(f"static cache of {max_seq} positions: {len(concats)} caches; new input '{pos}' int64 [1]; attention_mask [.., {max_seq}]")
    return len(concats)


def _limits_positions(graph: Graph, ev: SymbolicEvaluator, add: Node, past: Sym) -> bool:
    """``add`` (``P + n``, ``P`` = ``past``) is, through Casts, the limit of ``Range(P, P + n)``: this call's
    positions (optimum's cache_position), which stay ``seq_position + n``, not the key length.

    Raises:
        RewriteError: the same sum is also read otherwise (a key length too): one value cannot be both.
    """
    limits, todo, others = set(), [add.outputs[0]], []
    while todo:  # the sum and its Casts
        v = todo.pop()
        limits.add(v)
        for c in graph.consumers(v):
            if c.op_type == "Cast":
                todo.append(c.outputs[0])
            elif not (c.op_type == "Range" and c.inputs[1] == v and ev.vector(c.inputs[0]) == [past]):
                others.append(c)
    ranges = [c for v in limits for c in graph.consumers(v) if c.op_type == "Range" and c.inputs[1] == v
              and ev.vector(c.inputs[0]) == [past]]
    if ranges and others:
        raise RewriteError(f"static cache: {add.describe()} (past length + new length) limits the positions "
                           f"{ranges[0].describe()} and is read by {others[0].describe()} too: not converted")
    return bool(ranges)


def _new_length(graph: Graph, ev: SymbolicEvaluator, new: str) -> int | str | None:
    """The sequence length (axis 2) of the rows ``new`` a growing cache appends: the symbol or number it evaluates
    to (TorchScript's exports leave such dims unnamed, ``unk__44``, where the evaluator finds the input's
    ``sequence_length``), else the declared dim."""
    shape = ev.shape(new)
    d = shape[2] if shape is not None and len(shape) > 2 else None
    if isinstance(d, int):
        return d
    if isinstance(d, Sym) and d.name is not None:
        return d.name
    declared = graph.values[new].shape
    return declared[2] if declared is not None and len(declared) > 2 else None


def _mentions(dim: str, symbol: str) -> bool:
    """Whether the symbolic ``dim`` (a name or an expression such as ``'s70 + s81'``) contains ``symbol`` as a
    whole identifier (``'s8'`` is not in ``'s81'``)."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(symbol)}(?![A-Za-z0-9_])", dim) is not None


# ------------------------------------------------------------------- proof
def contiguous_range(graph: Graph, ev: SymbolicEvaluator, indices: str, axis: int, rank: int) -> tuple[str | None, str]:
    """Prove that ``indices`` (ScatterElements indices of rank ``rank``) equals ``p + j`` at every index
    whose ``axis`` coordinate is ``j``, with ``p`` one runtime element.

    Returns ``(position value, reason)``; the position is None when the proof
    fails, ``reason`` then says which step failed.
    """
    n = graph.producer_node(indices)
    base, full = indices, ev.shape(indices)
    if n is not None and n.op_type == "Expand":
        base, full = n.inputs[0], expand_shape(ev, n)
    bshape = ev.shape(base)
    if bshape is None or full is None or len(bshape) != rank or len(full) != rank:
        return None, "indices shape unknown (rank or broadcast)"
    if any(d != 1 for k, d in enumerate(bshape) if k != axis):
        return None, "index varies along an axis other than the scatter axis (per-batch or per-head offsets)"
    length = bshape[axis]
    if length is None or full[axis] != length:
        return None, "range length not proven equal to the scattered extent (index repeated along the axis)"
    r = graph.producer_node(base)
    if r is None or r.op_type not in ("Reshape", "Unsqueeze"):
        return None, "indices are not a reshaped 1-D range"
    vec = r.inputs[0]
    vshape = ev.shape(vec)
    if vshape is None or vshape != [length]:
        return None, "reshaped value is not a 1-D vector of the range length"
    c = graph.producer_node(vec)
    while c is not None and c.op_type == "Cast":
        src = graph.values[c.inputs[0]].dtype
        if c.attr("to") not in _INT_TYPES or src not in _INT_TYPES or (src == TensorProto.INT64 and c.attr("to") != TensorProto.INT64):
            return None, "a Cast in the index chain may change values"
        vec = c.inputs[0]
        c = graph.producer_node(vec)
    if c is None:
        return None, "indices come from a graph input or initializer, not from a position"
    if c.op_type == "Range":
        start, delta = c.inputs[0], ev.vector(c.inputs[2])
        if delta != [1]:
            return None, "range step is not 1 (strided or reversed)"
        return start, ""
    if c.op_type != "Add":
        return None, f"index chain starts with {c.op_type}, not Add(position, Range(0, n, 1))"
    for pos, rng in (c.inputs, c.inputs[::-1]):
        rn = graph.producer_node(rng)
        ps = ev.shape(pos)
        if rn is None or rn.op_type != "Range" or ps not in ([1], []):
            continue
        if ev.vector(rn.inputs[0]) != [0] or ev.vector(rn.inputs[2]) != [1]:
            return None, "range does not start at 0 with step 1 (strided or reversed)"
        if graph.values[pos].dtype not in _INT_TYPES:
            return None, "position is not an integer"
        return pos, ""
    return None, "Add is not position + Range(0, n, 1) with a one-element position"


@rule("scatter-slice-insert")
def scatter_slice_insert(op, past, indices, update):
    """ScatterElements(past, position + Range(0, n, 1) broadcast, update) -> KVCacheUpdate(past, update, position)."""
    return op.ScatterElements(past, indices, update, axis=AttrVar("axis"), _name="scatter")


@scatter_slice_insert.check
def _(m):
    g = m.graph
    node = m.node("scatter")
    if node.attr("reduction", "none") != "none":
        return m.fail(f"reduction={node.attr('reduction')} accumulates instead of writing", node)
    past = m.value("past")
    if past.shape is None:
        return m.fail(f"rank of '{past.name}' unknown (run shape inference)", node)
    rank = len(past.shape)
    pos, reason = contiguous_range(g, SymbolicEvaluator(g), m["indices"], m.attr("axis") % rank, rank)
    if pos is None:
        return m.fail(reason, node)


@scatter_slice_insert.rewrite
def _(m, b):
    g = m.graph
    past = m.value("past")
    rank = len(past.shape)
    axis = m.attr("axis") % rank
    pos, _ = contiguous_range(g, SymbolicEvaluator(g), m["indices"], axis, rank)
    # everything computing the indices (the range and the Expand's shape chain) may die with the scatter
    top = g.producer_node(m["indices"])
    _DEAD_CANDIDATES.update(a for a in nx.ancestors(g.nx, top.id) | {top.id} if a in g.nodes)
    if g.values[pos].dtype != TensorProto.INT64:
        pos = b.op("Cast", [pos], to=TensorProto.INT64, dtype=TensorProto.INT64, shape=g.values[pos].shape)
    return b.op(KVCacheUpdate.op_type, [m["past"], m["update"], pos], domain=DOMAIN, axis=axis, dtype=past.dtype, shape=past.shape)


_DEAD_CANDIDATES: set[int] = set()  # index-chain nodes of applied rewrites, removed once no scatter reads them


class KVCache(Plugin):
    """See the module docstring. Rule ``scatter-slice-insert``; abstract op :class:`KVCacheUpdate`."""

    name = "kv-cache"
    short = "kv"
    description = "ScatterElements KV updates at a contiguous position range -> slice insert (KVCacheUpdate)"
    opset_range = (13, 28)

    @property
    def rules(self):
        return [scatter_slice_insert]

    @property
    def abstract_ops(self):
        return [KV_UPDATE]

    def run(self, graph: Graph, report: PluginReport, ctx=None, *, dry_run: bool = False) -> None:
        if graph.opset("") is not None and graph.opset("") < 13:
            raise RewriteError(f"kv needs opset >= 13 (ScatterElements with negative indices), model has {graph.opset('')}")
        _DEAD_CANDIDATES.clear()
        opts = dict(((getattr(ctx, "options", None) or {}).get("kv") or {}))
        unknown = sorted(set(opts) - {"max_seq"})
        if unknown:
            raise RewriteError(f"kv: unknown option '{unknown[0]}'; options: max_seq")
        max_seq = opts.get("max_seq")
        if max_seq is not None:
            if not isinstance(max_seq, int) or isinstance(max_seq, bool):
                raise RewriteError(f"kv: option 'max_seq' must be an integer (got {max_seq!r})")
            to_static_cache(graph, max_seq, report, dry_run=dry_run)
        apply_rules(graph, self.rules, self.short, report, dry_run=dry_run, ctx=ctx)
        if not dry_run and report.matches:
            if graph.opset(DOMAIN) is None:  # shape inference and the importer need the domain declared
                graph.model_shell.opset_import.add(domain=DOMAIN, version=1)
            removed = graph.remove_dead_nodes(_DEAD_CANDIDATES)
            report.rule("scatter-slice-insert").nodes_removed += len(removed)
        _DEAD_CANDIDATES.clear()

    @property
    def cases(self):
        return [
            positive("seed-kv-scatter", lambda: scatter_model("seed"), matches=2),
            negative("strided-indices", lambda: scatter_model("strided")),
            negative("reversed-indices", lambda: scatter_model("reversed")),
            negative("per-batch-offsets", lambda: scatter_model("per_batch", batch=2)),
            negative("runtime-index-tensor", lambda: scatter_model("runtime")),
            negative("repeated-position", lambda: scatter_model("repeated")),
        ]


def scatter_model(kind: str, *, heads: int = 2, max_seq: int = 16, head_dim: int = 8, batch: int = 1) -> onnx.ModelProto:
    """A KV update in the seed's form, or a variant that must not be rewritten.

    Inputs ``k``/``v`` float ``[batch, heads, "seq", head_dim]``, ``position`` int64 ``[1]`` (``[batch]`` for
    ``per_batch``), ``past_k``/``past_v`` ``[batch, heads, max_seq, head_dim]``; outputs ``present_k``/``present_v``.
    ``kind``: ``seed`` (position + Range(0, seq, 1), the A4 Where/Equal shape), ``strided`` (step 2),
    ``reversed`` (step -1 from position + seq - 1), ``per_batch`` (one position per batch row), ``runtime``
    (indices are a graph input), ``repeated`` (a one-element range expanded along the sequence axis).
    """
    f, i64 = TensorProto.FLOAT, TensorProto.INT64

    def c(name, v, dims=None):
        v = list(np.ravel(v))
        return helper.make_tensor(name, i64, [len(v)] if dims is None else dims, v)

    inits = [c("zero", [0], []), c("one", [1], []), c("two", [2], []), c("m1s", [-1], []), c("zero1", [0]), c("m1", [-1]),
             c("heads", [heads]), c("hd", [head_dim]), c("ones", [1, 1, 1, 1]), c("rs", [1, 1, -1, 1]), c("rs_b", [batch, 1, -1, 1])]
    nodes = [helper.make_node("Shape", ["k"], ["ksh"]), helper.make_node("Gather", ["ksh", "two"], ["seq"], axis=0),
             helper.make_node("Unsqueeze", ["seq", "zero1"], ["seq1"])]
    inputs = [helper.make_tensor_value_info(n, f, [batch, heads, "seq", head_dim]) for n in ("k", "v")]
    inputs += [helper.make_tensor_value_info("position", i64, [batch if kind == "per_batch" else 1])]
    if kind in ("seed", "per_batch", "repeated"):
        nodes.append(helper.make_node("Range", ["zero", "seq" if kind != "repeated" else "one", "one"], ["r"]))
    elif kind == "strided":
        nodes += [helper.make_node("Range", ["zero", "seq", "one"], ["r0"]), helper.make_node("Mul", ["r0", "two"], ["r"])]
    elif kind == "reversed":
        nodes += [helper.make_node("Sub", ["seq", "one"], ["last"]), helper.make_node("Range", ["last", "m1s", "m1s"], ["r"])]
    if kind == "per_batch":
        nodes += [helper.make_node("Unsqueeze", ["position", "one1"], ["pos_b"]), helper.make_node("Add", ["pos_b", "r"], ["absb"]),
                  helper.make_node("Reshape", ["absb", "rs_b"], ["idx"])]
        inits.append(c("one1", [1]))
    elif kind != "runtime":
        nodes += [helper.make_node("Add", ["position", "r"], ["abs"]), helper.make_node("Cast", ["abs"], ["abs64"], to=i64),
                  helper.make_node("Reshape", ["abs64", "rs"], ["idx"])]
    if kind == "runtime":
        inputs.append(helper.make_tensor_value_info("indices", i64, [batch, heads, "seq", head_dim]))
        nodes.append(helper.make_node("Identity", ["indices"], ["full"]))
    else:
        nodes += [helper.make_node("Concat", ["m1", "heads", "seq1", "hd"], ["sizes"], axis=0),
                  helper.make_node("Equal", ["sizes", "m1"], ["is_m1"]),
                  helper.make_node("Where", ["is_m1", "ones", "sizes"], ["shape"]),
                  helper.make_node("Expand", ["idx", "shape"], ["full"])]
    for name in ("k", "v"):
        nodes.append(helper.make_node("ScatterElements", [f"past_{name}", "full", name], [f"present_{name}"], axis=2, name=f"scatter_{name}"))
        inputs.append(helper.make_tensor_value_info(f"past_{name}", f, [batch, heads, max_seq, head_dim]))
    outputs = [helper.make_tensor_value_info(f"present_{n}", f, [batch, heads, max_seq, head_dim]) for n in ("k", "v")]
    used = {i for n in nodes for i in n.input}
    g = helper.make_graph(nodes, "kv_update", inputs, outputs, initializer=[t for t in inits if t.name in used])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
