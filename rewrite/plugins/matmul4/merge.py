"""``shared-input``: MatMulInt4 nodes reading the same A become one MatMulInt4 over their columns.

A decoder layer multiplies one activation by several weights: the attention's query, key and value projections,
the shared expert's gate and up projections. At decode (one token) each such product is a few megabytes of INT4
weights, which an H200 reads in about a microsecond; a kernel launch and its ramp cost several
(BENCHMARKS.md, "Full-size decode on the H200": MatMulInt4 at 8-9% of the copy bandwidth on the layer shapes).
One product over the concatenated columns reads the same bytes in one launch, and writes each member's columns
to its own output (the op's ``splits``; a Split after it cost iree-compile 3.13 one more dispatch per output)::

    Y_i = MatMulInt4(A, B_i, scales_i, zero_points_i)       i = 1..g (g = 2 or 3), N_i columns each
    ->  Y_1, .., Y_g = MatMulInt4(A, concat_i B_i, concat_i scales_i, concat_i zero_points_i; splits=[N_1, .., N_g])

Exact: column n is computed from row n of the concatenated B, scales and zero points alone (the contract of
:mod:`rewrite.plugins.matmul4.op`), so each Y_i is the same sum in the same order. Merged: nodes with the same A,
K, block_size and output dtype whose B, scales and zero points are initializers, three at most per merged node
(in graph order); a member without zero points gets its implied 8s when others have them, and a member's addend
(a Gemm's bias) becomes the addend of its output.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.driver import PluginReport
from rewrite.core.ir import Graph, Node
from rewrite.core.rules import Builder

RULE = "shared-input"
MAX_OUTPUTS = 3  #: outputs of one merged MatMulInt4 (the CUDA kernel's *_o2 and *_o3 variants)


def _weights(graph: Graph, node: Node) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """(B, scales, zero points or None) of ``node`` when all are initializers, else None."""
    b, s = graph.const(node.inputs[1]), graph.const(node.inputs[2])
    z_in = node.inputs[3] if len(node.inputs) > 3 else ""
    z = graph.const(z_in) if z_in else None
    if b is None or s is None or (z_in and z is None):
        return None
    return b, s, z


def merge_shared_input(graph: Graph, report: PluginReport, *, dry_run: bool = False) -> int:
    """Merge each group of two or more MatMulInt4 nodes that read the same A (module docstring); returns the
    number of groups merged and records them in ``report`` under :data:`RULE`."""
    rr = report.rule(RULE)
    groups: dict[tuple, list[tuple[Node, tuple]]] = defaultdict(list)  # key -> (node, its weights)
    for node in graph.nodes_by_op("MatMulInt4", DOMAIN):
        if node.attr("splits") or node.attr("activation"):  # merged already, or a SwiGLU of a merged pair
            continue
        weights = _weights(graph, node)
        if weights is None:
            rr.refuse("B, scales or zero points not initializers", node.name)
            continue
        out = graph.values[node.outputs[0]]
        key = (node.inputs[0], int(node.attr("K")), int(node.attr("block_size")), out.dtype)
        groups[key].append((node, weights))
    chunks = []
    for key, members in groups.items():
        members.sort(key=lambda nw: nw[0].order)
        chunks += [(key, members[i:i + MAX_OUTPUTS]) for i in range(0, len(members), MAX_OUTPUTS)]
    merged = 0
    for (a, k, bs, dtype), members in chunks:
        if len(members) < 2:
            continue
        nodes, parts = [n for n, _ in members], [w for _, w in members]
        merged += 1
        rr.applied(removed=len(nodes), added=1)
        if dry_run:
            continue
        widths = [int(n.attr("N")) for n in nodes]
        with_zp = any(z is not None for _, _, z in parts)
        b = Builder(graph, RULE, nodes[0].order, nodes[0].name)
        ins = [a, b.const(np.concatenate([p[0] for p in parts]), "B"), b.const(np.concatenate([p[1] for p in parts]), "scales")]
        if with_zp:
            ins.append(b.const(np.concatenate([z if z is not None else np.full(s.shape, 8, np.uint8) for _, s, z in parts]),
                               "zero_points"))
        addends = [n.inputs[4] if len(n.inputs) > 4 else "" for n in nodes]  # a member's bias (dense-int4-gemm's C)
        if any(addends):
            ins += [""] * (4 - len(ins)) + addends
            while ins[-1] == "":
                ins.pop()
        outs = b.op("MatMulInt4", ins, domain=DOMAIN, outputs=len(nodes), K=k, N=sum(widths), block_size=bs,
                    splits=widths, dtype=[dtype] * len(nodes))
        for node, out in zip(nodes, outs):
            graph.values[out].set_type(dtype, graph.values[node.outputs[0]].shape)
            graph.replace_node(node, [out])
    if merged and not dry_run:
        graph.remove_unused_initializers()
    return merged
