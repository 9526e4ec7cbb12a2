"""Small static analyses over the IR that rules use to prove a rewrite exact."""

from __future__ import annotations

import numpy as np

from rewrite.core.ir import Graph

#: Ops that only move, select or replicate elements: the output's values are a subset of the data input's.
DATA_MOVEMENT = frozenset(
    {"Gather", "GatherND", "GatherElements", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice", "Flatten",
     "Identity", "Expand", "Tile", "Split", "Concat", "Compress"}
)


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
