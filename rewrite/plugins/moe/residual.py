"""``fused-moe-residual``: the residual sum after an MoE block moves into its FusedMoE (input 11, ``addend``).

Qwen3-MoE's decoder layer ends ``h = h + moe(norm(h))``: as written, the Add is a launch of its own after the
block's kernel (48 per decode step of Qwen3-30B-A3B, ~8 us of host time each on an H200: BENCHMARKS.md).
With the addend, the down half on CUDA adds it in its store (the addend tied in place as its output); ONNX Runtime
and llvm-cpu get the Add back after the block. Matched::

    Y = FusedMoE(...)                       (no addend yet; Y read by one node)
    Y' = Reshape(Y, shape)                  (optional: [T, H] back to [B, T, H]; read by one node)
    Z = Add(Y', R) or Add(R, Y')            (R of Z's dtype and shape, every dim an int or the same symbol (no
                                             broadcast), not computed from Y)
    ->  Z = Reshape(FusedMoE(..., addend=Reshape(R, [-1, H])), shape)

The contract rounds the block's sum to its dtype before the Add, as the graph does, so it is exact. Where the
other input is made by an elementwise op (Qwen1.5-MoE: the shared expert's gated output), the Add is left alone:
iree-compile fuses that op and the Add into one dispatch, which the addend would split in two; an Add of a
projection's output (the residual stream after attention's o projection) is taken, being part of the product's
dispatch (``matmul4``'s ``output-add``, which runs later, or iree-compile's own fusion). The plugin runs the rule
for IREE cuda only unless its option ``residual`` says otherwise (``--opt moe.residual=true``).
"""

from __future__ import annotations

import networkx as nx
import numpy as np

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.driver import PluginReport
from rewrite.core.ir import Graph, Node
from rewrite.core.rules import Builder

RESIDUAL = "fused-moe-residual"
ADDEND_PORT = 11  #: FusedMoE's input ``addend`` (rewrite.plugins.moe.lowering)
#: products whose output plus a residual is one dispatch (matmul4's output-add, or iree-compile's own fusion)
PRODUCTS = frozenset({"MatMul", "Gemm", "MatMulInt4", "MatMulNBits", "DenseMatMul"})
#: ops whose output iree-compile computes in the dispatch of the Add that reads it (so no launch is saved)
ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Sigmoid", "Tanh", "Relu", "Neg", "Exp", "Cast", "Where", "Sqrt",
                         "Pow", "Erf", "Clip"})


def _residual_add(graph: Graph, node: Node) -> bool:
    """Whether ``node`` is an Add of a product (MatMul, Gemm, MatMulInt4, ...) and something else: the residual
    stream after a projection, an Add that ``matmul4``'s ``output-add`` (or iree-compile) makes part of the
    product's dispatch, so taking its output as the addend splits no dispatch."""
    if node.op_type != "Add":
        return False
    for v in node.inputs:
        p = graph.producer_node(v)
        if p is not None and p.op_type in PRODUCTS:
            return True
    return False


def _residual_of(graph: Graph, node: Node) -> tuple[Node | None, Node, str] | str | None:
    """(the Reshape between or None, the Add, the addend R) for FusedMoE ``node``; a refusal reason, or None when
    nothing after the block looks like a sum."""
    if len(node.inputs) > ADDEND_PORT and node.inputs[ADDEND_PORT]:
        return None
    y = node.outputs[0]
    nxt = graph.only_reader(y)
    reshape = None
    if nxt is not None and nxt.op_type == "Reshape" and nxt.domain == "" and nxt.inputs[0] == y:
        reshape, y = nxt, nxt.outputs[0]
        nxt = graph.only_reader(y)
    if nxt is None or nxt.op_type != "Add" or nxt.domain != "" or len(nxt.inputs) != 2:
        return None
    r = nxt.inputs[1 - nxt.inputs.index(y)]  # (y's only reader reads it once)
    yv, rv, zv = graph.values[y], graph.values[r], graph.values[nxt.outputs[0]]
    if not (yv.dtype == rv.dtype == zv.dtype) or yv.dtype is None:
        return "the Add's other input or output has another dtype"
    if zv.shape is None or any(d is None for d in zv.shape) or rv.shape != zv.shape or yv.shape != zv.shape:
        return "the addend is not of the output's shape, every dim known (an int or the same symbol)"
    producer = graph.producer_node(r)
    if producer is not None and producer.domain == "" and producer.op_type in ELEMENTWISE and not _residual_add(graph, producer):
        return "the addend is made by an elementwise op (iree-compile fuses it with the Add)"
    if producer is not None and nx.has_path(graph.nx, node.id, producer.id):
        return "the addend is computed from the block"
    return reshape, nxt, r


def fuse_residual(graph: Graph, report: PluginReport, *, dry_run: bool = False) -> int:
    """The ``fused-moe-residual`` rule (module docstring); returns the number of Adds moved into a FusedMoE,
    recorded in ``report``."""
    rr = report.rule(RESIDUAL)
    fused = 0
    for node, (reshape, add, r) in rr.found(graph.nodes_by_op("FusedMoE", DOMAIN), lambda n: _residual_of(graph, n)):
        fused += 1
        rr.applied(removed=2 + (reshape is not None), added=1 + 2 * (reshape is not None))
        if dry_run:
            continue
        hidden = graph.values[node.inputs[0]]
        out = graph.values[add.outputs[0]]
        b = Builder(graph, RESIDUAL, node.order, node.name)
        addend = r
        if reshape is not None:
            addend = b.op("Reshape", [r, b.const(np.array([-1, hidden.shape[1]], np.int64), "addend_shape")],
                          dtype=hidden.dtype, shape=graph.values[node.outputs[0]].shape)
        ins = list(node.inputs) + [""] * (ADDEND_PORT + 1 - len(node.inputs))
        ins[ADDEND_PORT] = addend  # (fused-moe-shared's inputs, when there, follow it)
        moe_out = graph.values[node.outputs[0]]
        y = b.op("FusedMoE", ins, domain=DOMAIN, dtype=moe_out.dtype, shape=moe_out.shape,
                 **{k: node.attr(k) for k in node.attrs})
        if reshape is not None:
            y = b.op("Reshape", [y, reshape.inputs[1]], dtype=out.dtype, shape=out.shape,
                     **{k: reshape.attr(k) for k in reshape.attrs})
        graph.replace_node(add, [y])
        graph.remove_dead_nodes([x.id for x in (reshape, node) if x is not None])
    return fused
