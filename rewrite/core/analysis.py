"""Small static analyses over the IR that rules use to prove a rewrite exact."""

from __future__ import annotations

from collections import deque

import numpy as np
import onnx
from onnx import helper, numpy_helper

from rewrite.core.ir import Graph, Node

#: Ops that only move, select or replicate elements: the output's values are a subset of the data input's.
DATA_MOVEMENT = frozenset(
    {"Gather", "GatherND", "GatherElements", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice", "Flatten",
     "Identity", "Expand", "Tile", "Split", "Concat", "Compress"}
)


#: the ten Reduce ops, which take ``axes`` as an input from opset 18 (ReduceSum from 13)
REDUCE_OPS = (
    "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd",
    "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
)


_NONDETERMINISTIC = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"})


def known_before_run(graph: Graph, value: str, _depth: int = 0, _memo: dict | None = None) -> bool:
    """Whether ``value`` is a constant or folds to one: computed by default-domain ops from constants only
    (``Shape``/``Size`` of a value of static shape count as constants). Measured with importer 3.13: such
    Reduce axes lower (Concat or Neg of constants, Size of a static Shape); a graph input, or a Concat or
    Unsqueeze of one, fails in iree-compile."""
    memo = {} if _memo is None else _memo
    if value in memo:
        return memo[value]
    if graph.const(value) is not None:
        known = True
    else:
        n = graph.producer_node(value)
        if n is None or n.domain not in ("", "ai.onnx") or n.op_type in _NONDETERMINISTIC or n.has_subgraphs() or _depth > 64:
            known = False
        elif n.op_type in ("Shape", "Size"):
            shape = graph.values[n.inputs[0]].shape
            known = shape is not None and all(isinstance(d, int) for d in shape)
        else:
            known = all(known_before_run(graph, i, _depth + 1, memo) for i in n.inputs if i)
    memo[value] = known
    return known



def value_range(graph: Graph, value: str, _depth: int = 0) -> tuple[float, float] | None:
    """Bounds (min, max) on every element of ``value``, or None when they cannot be proven.

    Known when the value is a constant, or is computed from constants only through data-movement ops
    (:data:`DATA_MOVEMENT`), which never create a value their data input does not hold.
    """
    data = graph.const(value)
    if data is not None:
        if data.size == 0:
            return None
        if data.dtype.kind in "fc" and np.isnan(data).any():
            return None  # NaN has no place in any range (it compares false against both bounds)
        return float(data.min()), float(data.max())
    n = graph.producer_node(value)
    if n is None or n.domain not in ("", "ai.onnx") or n.op_type not in DATA_MOVEMENT or _depth > 32:
        return None
    sources = [i for i in n.inputs if i] if n.op_type == "Concat" else n.inputs[:1]
    lo, hi = float("inf"), float("-inf")
    for s in sources:
        r = value_range(graph, s, _depth + 1)
        if r is None:
            return None
        lo, hi = min(lo, r[0]), max(hi, r[1])
    return lo, hi


def upstream_nodes(graph: Graph, start: list[str], stop: set[str], limit: int, *, truncate: bool = False) -> list[Node] | None:
    """Producers of ``start`` and their producers, not crossing ``stop`` values, nearest first (breadth-first);
    past ``limit`` nodes: None, or with ``truncate`` the nearest ``limit``."""
    seen: dict[int, Node] = {}
    queue = deque(v for v in start if v not in stop)
    visited = set(queue)
    while queue:
        node = graph.producer_node(queue.popleft())
        if node is None or node.id in seen:
            continue
        seen[node.id] = node
        if len(seen) >= limit:
            return list(seen.values()) if truncate else None
        for i in node.inputs:
            if i and i not in stop and i not in visited:
                visited.add(i)
                queue.append(i)
    return list(seen.values())


def region_model(graph: Graph, region: list[Node], cut: list[str], outs: list[str]) -> onnx.ModelProto | str:
    """The ``region`` nodes as a standalone model with outputs ``outs``, for checking what it computes on
    random inputs. Its inputs are the ``cut`` values it reads and the graph inputs it reads through ``Shape``;
    initializers come along. Returns a one-line refusal when the region reads any other value."""
    produced = {o for n in region for o in n.outputs if o}
    inputs, inits = [], []
    for n in region:
        for i in n.inputs:
            if not i or i in produced:
                continue
            if graph.values[i].is_initializer and not graph.values[i].overridable:
                if i not in inits:
                    inits.append(i)
            elif i in cut or (i in graph.inputs and n.op_type == "Shape"):  # checked at every read
                if i not in inputs:
                    inputs.append(i)
            else:
                return f"the region reads '{i}' in {n.describe()} (not one of {', '.join(cut)}, a constant, or a shape)"
    nodes = []
    for n in sorted(region, key=lambda n: n.order):
        proto = helper.make_node(n.op_type, n.inputs, n.outputs, name=n.name, domain=n.domain)
        proto.attribute.extend(n.attrs.values())
        nodes.append(proto)
    vis = [graph.values[v].to_value_info() for v in inputs]
    out_vis = [helper.make_tensor_value_info(o, graph.values[o].dtype, None) for o in outs]
    tensors = [numpy_helper.from_array(graph.const(v), v) for v in inits]
    model = helper.make_model(helper.make_graph(nodes, "region", vis, out_vis, tensors),
                              opset_imports=list(graph.model_shell.opset_import))
    model.ir_version = graph.model_shell.ir_version
    return model


def region_session(model: onnx.ModelProto, what: str = "region"):
    """An ONNX Runtime CPU session for a region checked by value, at the "basic" level (the graph's exact
    semantics); a one-line refusal naming ``what`` when ONNX Runtime cannot load it."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT's own exception types
        return f"the {what} does not run alone: {str(e).splitlines()[0][:160]}"
