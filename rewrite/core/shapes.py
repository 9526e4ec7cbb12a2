"""Shape and type refinement: onnx shape inference with data propagation, dimension overrides, and
partial evaluation of shape computations (:mod:`rewrite.core.shape_eval`).

``--dim seq_len=1`` replaces the symbolic dim ``seq_len`` by 1 wherever it appears (graph inputs, outputs,
value_info), drops the intermediate types that mentioned it and infers again, so every value whose shape
follows from the override becomes static while other symbolic dims stay symbolic (seed 000, items A3/A6:
per-node types that ignore free-dimension overrides leave every op dynamic).
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from rewrite.core import onnx_io
from rewrite.core.shape_eval import known_values
from rewrite.core.interface import exporter_static_dims
from rewrite.core.ir import Graph
from rewrite.errors import RewriteError


def symbolic_dims(graph: Graph) -> list[str]:
    """Symbolic dim names used by the graph inputs, in first-seen order."""
    out: list[str] = []
    for name in graph.inputs:
        for d in graph.values[name].shape or ():
            if isinstance(d, str) and d not in out:
                out.append(d)
    return out


def override_dims(graph: Graph, dims: dict[str, int]) -> None:
    """Replace symbolic dims by sizes everywhere; types of intermediates that used them are dropped.

    Raises:
        RewriteError: a name is not a symbolic dim of any graph input (the message lists those that are),
            or a size is negative.
    """
    if not dims:
        return
    known = symbolic_dims(graph)
    for k, v in dims.items():
        if k not in known:
            raise RewriteError(f"--dim {k}={v}: '{k}' is not a symbolic dim of the graph inputs; they are: {', '.join(known) or 'none'}")
        if v < 0:
            raise RewriteError(f"--dim {k}={v}: size must be >= 0")
    _substitute_dims(graph, dims)


def resolve_exporter_dims(graph: Graph) -> dict[str, int]:
    """Make the symbolic dims named like integers (``"4"``, an exporter artefact, see
    :func:`rewrite.core.interface.exporter_static_dims`) static on every value; returns them by name."""
    boundary = [graph.values[n].shape for n in (*graph.inputs, *graph.outputs) if n in graph.values]
    dims = exporter_static_dims(boundary)
    if dims:
        _substitute_dims(graph, dims)
    return dims


def _substitute_dims(graph: Graph, dims: dict[str, int]) -> None:
    boundary = set(graph.inputs) | set(graph.outputs)
    for v in graph.values.values():
        if v.shape is None or not any(isinstance(d, str) and d in dims for d in v.shape):
            continue
        if v.name in boundary:
            v.set_type(v.dtype, tuple(dims.get(d, d) if isinstance(d, str) else d for d in v.shape))
        elif not v.is_initializer:
            v.set_type(None, None)  # re-inferred below from the now-static inputs
    for name in graph.outputs:
        graph.output_infos.pop(name, None)


def drop_contradicted_claims(graph: Graph) -> list[str]:
    """Replace static dims an exporter claims for a node's output where the node's own inputs, by the op's
    shape inference, give a symbolic dim (or another size); returns the values changed, in graph order.

    transformers' exporter on Qwen3-Next / Qwen3.5-MoE types the chunked linear-attention values as
    ``[1, 4, 1, 64, 64]`` while the inputs of the same MatMul carry the chunk count
    ``((s70 + ...)//64)``: a size specialized to the traced sequence length. IREE's importer takes the
    claim as the result type and iree-compile then rejects the reshape feeding it. A claim onnx cannot
    confirm (inference gives no dim) is kept: only a claim contradicted by its inputs' claims is replaced,
    by the symbol inference propagates from them. Nodes are visited in topological order, so a corrected
    type reaches its consumers' checks. Graph inputs, initializers and nodes with subgraphs are left alone.
    """
    opset = graph.opset("") or 1
    types: dict[str, onnx.TypeProto] = {}

    def type_of(name: str) -> onnx.TypeProto | None:
        if name not in types:
            v = graph.values.get(name)
            types[name] = (None if v is None or v.dtype is None or v.shape is None
                           else helper.make_tensor_type_proto(v.dtype, list(v.shape)))
        return types[name]

    changed = []
    for node in graph.topo_nodes():
        if node.domain not in ("", "ai.onnx") or node.has_subgraphs():
            continue
        claims = {o: graph.values[o] for o in node.outputs if o in graph.values and graph.values[o].shape is not None}
        if not any(isinstance(d, int) for v in claims.values() for d in v.shape):
            continue
        in_types = {i: type_of(i) for i in node.inputs if i}
        if any(t is None for t in in_types.values()):
            continue
        symbols = {d for i in in_types for d in graph.values[i].shape if isinstance(d, str)}
        if not symbols:
            continue
        proto = helper.make_node(node.op_type, node.inputs, node.outputs, domain=node.domain)
        proto.attribute.extend(node.attrs.values())
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
            data = {i: numpy_helper.from_array(c, i) for i in in_types  # axes, shapes, pads: small constants
                    if _small(graph.values[i].shape) and (c := graph.const(i)) is not None}
            inferred = onnx.shape_inference.infer_node_outputs(schema, proto, in_types, data)
        except Exception:  # noqa: BLE001 - an op onnx cannot infer here confirms nothing
            continue
        for name, v in claims.items():
            tp = inferred.get(name)
            if tp is None or not tp.tensor_type.HasField("shape") or len(tp.tensor_type.shape.dim) != len(v.shape):
                continue
            got = [d.dim_value if d.HasField("dim_value") else d.dim_param if d.dim_param in symbols else None
                   for d in tp.tensor_type.shape.dim]
            fixed = tuple(g if isinstance(c, int) and g is not None and g != c else c for c, g in zip(v.shape, got))
            if fixed != v.shape:
                v.set_type(v.dtype, fixed)
                types[name] = helper.make_tensor_type_proto(v.dtype, list(fixed))
                changed.append(name)
    return changed


def _small(shape: tuple, limit: int = 64) -> bool:
    """A static shape of at most ``limit`` elements (decided before reading any data: weights stay on disk)."""
    n = 1
    for d in shape:
        if not isinstance(d, int):
            return False
        n *= d
    return n <= limit


MAX_ROUNDS = 6  #: inference / partial-evaluation rounds before giving up on further refinement


def infer_shapes(graph: Graph, dims: dict[str, int] | None = None) -> int:
    """Read integer-named dims as static (:func:`resolve_exporter_dims`), apply ``dims`` (see
    :func:`override_dims`), run onnx shape inference with data propagation, then
    alternate partial evaluation of shape computations and inference until no value gains a static dim.
    Records inferred types on values that had none or had a less static shape. Returns how many values
    gained information.

    Raises:
        RewriteError: shape inference found an inconsistency (message names the node ONNX reports).
    """
    resolve_exporter_dims(graph)
    if dims:
        override_dims(graph, dims)
    drop_contradicted_claims(graph)
    gained = _infer_round(graph, onnx_io.to_model(graph, skeleton_bytes=SKELETON_MAX_BYTES))
    for _ in range(MAX_ROUNDS):
        known = known_values(graph)
        if not known:
            break
        new = _infer_round(graph, _with_known_constants(graph, known))
        for name, val in known.items():  # folded values are initializers in the probe: type them directly
            v = graph.values[name]
            if v.shape is None or not all(isinstance(d, int) for d in v.shape):
                v.set_type(helper.np_dtype_to_tensor_dtype(val.dtype), val.shape)
                new += 1
        gained += new
        if not new:
            break
    return gained


#: initializers larger than this go to shape inference as typed graph inputs, without their data
#: (``onnx_io.to_model(skeleton_bytes=...)``): inference needs only their types, data propagation only small
#: shape tensors, and two 1.1 GB plugin-made tensors made the probe pass protobuf's 2 GB limit
SKELETON_MAX_BYTES = 64 * 1024


def _with_known_constants(graph: Graph, known: dict) -> onnx.ModelProto:
    """The model with every node whose outputs are all known replaced by initializers holding them, and
    intermediate value_info dropped (so inference starts from the constants, not from stale symbols)."""
    model = onnx_io.to_model(graph, skeleton_bytes=SKELETON_MAX_BYTES)
    gp = model.graph
    keep = [n for n in gp.node if not all((not o) or o in known for o in n.output)]
    folded = {o for n in gp.node if n not in keep for o in n.output if o}
    del gp.node[:]
    gp.node.extend(keep)
    gp.initializer.extend(numpy_helper.from_array(known[o], o) for o in sorted(folded) if o not in graph.outputs)
    del gp.value_info[:]
    return model


def _infer_round(graph: Graph, model: onnx.ModelProto) -> int:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as e:
        raise RewriteError(f"shape inference failed: {str(e).splitlines()[0]}") from e
    gained = 0
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        v = graph.values.get(vi.name)
        if v is None or v.is_initializer:
            continue
        dt, shape, other = onnx_io._type_of(vi)
        if other is not None or dt is None:
            continue
        if v.dtype is None or v.shape is None or (shape is not None and _more_static(shape, v.shape)):
            v.set_type(dt, shape)
            gained += 1
    return gained


def _more_static(new: tuple, old: tuple) -> bool:
    if len(new) != len(old):
        return False
    return sum(isinstance(d, int) for d in new) > sum(isinstance(d, int) for d in old)
