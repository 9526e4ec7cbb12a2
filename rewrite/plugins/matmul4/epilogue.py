"""``swiglu`` and ``output-add``: the elementwise ops after a MatMulInt4 move into it.

At decode each elementwise op after a projection is a kernel launch of its own, reading and writing a few
kilobytes; on an H200 such a launch costs more than the INT4 product before it (BENCHMARKS.md, "Full-size decode
on the H200": ~27 of IREE's own dispatches per layer, the step bound by launches). The CUDA kernel applies both
epilogues in its store, so the product and what follows are one launch:

* ``swiglu``: the shared expert's (or a dense MLP's) gate and up projections, merged by ``shared-input`` into one
  MatMulInt4 with two equal ``splits``, followed by SwiGLU as transformers' exporters write it::

      G, U = MatMulInt4(A, ...; splits=[I, I])
      Y = Mul(Mul(G, Sigmoid(G)), U)            (the Muls' inputs in either order)
      ->  Y = MatMulInt4(A, ...; activation="swiglu")   (gate rows first: swapped when U is the first split)

* ``output-add``: an output whose one reader is ``Add(Y_i, C)`` with C of Y_i's dtype and either a constant of
  Y_i's width (a bias: [w], or [1, .., 1, w]) or a value of exactly Y_i's shape, every dim known (an int or the
  same symbol), that does not depend on the MatMulInt4 (a residual): C becomes the op's addend i and the Add's
  output its output i.

Both are exact: the op's contract (:mod:`rewrite.plugins.matmul4.op`) rounds each intermediate to A's dtype as
the ONNX ops it replaces do. Intermediates that other ops also read, graph outputs and dtype or shape mismatches
are left alone, with the reason in the report.
"""

from __future__ import annotations

import networkx as nx
import numpy as np

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.driver import PluginReport
from rewrite.core.ir import SINK, Graph, Node
from rewrite.core.rules import Builder

SWIGLU = "swiglu"
OUTPUT_ADD = "output-add"


def _other(node: Node, value: str) -> str | None:
    """The input of two-input ``node`` that is not ``value`` (None when both or neither are)."""
    if len(node.inputs) != 2 or node.inputs.count(value) != 1:
        return None
    return node.inputs[1 - node.inputs.index(value)]


def _swiglu_of(graph: Graph, gate: str, up: str) -> tuple[Node, Node, Node] | None:
    """(Sigmoid, Mul(G, Sigmoid), final Mul) when ``gate`` and ``up`` are read only by SwiGLU's three ops."""
    readers = [graph.node(c) for c, _ in graph.uses(gate) if c != SINK]
    if len(readers) != 2 or len(graph.uses(gate)) != 2:
        return None
    sig = next((n for n in readers if n.op_type == "Sigmoid" and n.domain == ""), None)
    silu = next((n for n in readers if n.op_type == "Mul" and n.domain == ""), None)
    if sig is None or silu is None or graph.only_reader(sig.outputs[0]) is not silu or _other(silu, gate) != sig.outputs[0]:
        return None
    final = graph.only_reader(silu.outputs[0])
    if final is None or final.op_type != "Mul" or final.domain != "" or _other(final, silu.outputs[0]) != up:
        return None
    if graph.only_reader(up) is not final:
        return None
    return sig, silu, final


def fuse_swiglu(graph: Graph, report: PluginReport, *, dry_run: bool = False) -> int:
    """The ``swiglu`` rule (module docstring); returns the number of fusions, recorded in ``report``."""
    rr = report.rule(SWIGLU)
    fused = 0
    for node in graph.nodes_by_op("MatMulInt4", DOMAIN):
        splits = node.attr("splits")
        if not splits or len(splits) != 2 or splits[0] != splits[1] or node.attr("activation") or len(node.inputs) > 4:
            continue
        dtypes = {graph.values[o].dtype for o in node.outputs}
        found = None
        for g, u in ((0, 1), (1, 0)):
            ops = _swiglu_of(graph, node.outputs[g], node.outputs[u])
            if ops is not None:
                found = (g, ops)
                break
        if found is None:
            continue
        gate_index, (sig, silu, final) = found
        if len(dtypes) != 1 or any(graph.values[n.outputs[0]].dtype not in dtypes for n in (sig, silu, final)):
            rr.refuse("SwiGLU's ops are not all of the projections' dtype", node.name)
            continue
        weights = [graph.const(i) for i in node.inputs[1:]]
        if gate_index == 1 and any(w is None for w in weights):
            rr.refuse("up projection first and weights not initializers", node.name)
            continue
        fused += 1
        rr.applied(removed=4, added=1)
        if dry_run:
            continue
        b = Builder(graph, SWIGLU, node.order, node.name)
        ins = list(node.inputs)
        if gate_index == 1:  # the gate's rows first, as the contract orders them
            half = int(splits[0])
            ins[1:] = [b.const(np.concatenate([w[half:], w[:half]]), name) for w, name in
                       zip(weights, ("B", "scales", "zero_points"))]
        out = graph.values[final.outputs[0]]
        y = b.op("MatMulInt4", ins, domain=DOMAIN, K=int(node.attr("K")), N=int(node.attr("N")),
                 block_size=int(node.attr("block_size")), activation="swiglu", dtype=out.dtype, shape=out.shape)
        graph.replace_node(final, [y])
        graph.remove_dead_nodes([silu.id, sig.id, node.id])
    if fused and not dry_run:
        graph.remove_unused_initializers()
    return fused


def _addend(graph: Graph, node: Node, port: int, add: Node) -> tuple[str, np.ndarray | None] | str:
    """(the addend's value, a [w] array to store when it is a bias of another shape) for output ``port`` read
    by ``add``; a refusal reason when it cannot be fused."""
    y = node.outputs[port]
    other = _other(add, y)
    if other is None:
        return "the Add reads the output twice"
    yv, ov, av = graph.values[y], graph.values[other], graph.values[add.outputs[0]]
    if not (yv.dtype == ov.dtype == av.dtype) or yv.dtype is None:
        return "the Add's other input or output has another dtype"
    width = int(node.attr("splits")[port]) if node.attr("splits") else int(node.attr("N"))
    const = graph.const(other)
    if const is not None and const.size == width and const.ndim <= len(yv.shape or []) and const.shape[-1:] == (width,):
        return other, (None if const.shape == (width,) else const.reshape(width))
    if yv.shape is None or any(d is None for d in yv.shape):  # an unknown dim could hide a broadcast
        return "the output's shape is not known dim by dim"
    if ov.shape != yv.shape or av.shape != yv.shape:
        return "the addend is neither a bias of the output's width nor of the output's shape"
    producer = graph.producer_node(other)
    if producer is not None and nx.has_path(graph.nx, node.id, producer.id):
        return "the addend is computed from the product"
    return other, None


def fuse_output_add(graph: Graph, report: PluginReport, *, dry_run: bool = False) -> int:
    """The ``output-add`` rule (module docstring); returns the number of Adds fused, recorded in ``report``."""
    rr = report.rule(OUTPUT_ADD)
    fused_total = 0
    for node in graph.nodes_by_op("MatMulInt4", DOMAIN):
        if node.attr("activation"):
            continue
        present = list(node.inputs[4:]) + [""] * (len(node.outputs) - len(node.inputs[4:]))
        fused: dict[int, tuple[Node, str, np.ndarray | None]] = {}
        for port, y in enumerate(node.outputs):
            add = graph.only_reader(y)
            if present[port] or add is None or add.op_type != "Add" or add.domain != "":
                continue
            got = _addend(graph, node, port, add)
            if isinstance(got, str):
                rr.refuse(got, add.name)
                continue
            fused[port] = (add, *got)
        if not fused:
            continue
        fused_total += len(fused)
        rr.applied(removed=1 + len(fused), added=1, matches=len(fused))
        if dry_run:
            continue
        b = Builder(graph, OUTPUT_ADD, node.order, node.name)
        for port, (add, value, array) in fused.items():
            present[port] = value if array is None else b.const(array, "bias")
        ins = list(node.inputs[:4]) + [""] * (4 - len(node.inputs[:4])) + present
        while ins[-1] == "":
            ins.pop()
        attrs = {k: node.attr(k) for k in ("K", "N", "block_size", "splits") if node.attr(k) is not None}
        outs = b.op("MatMulInt4", ins, domain=DOMAIN, outputs=len(node.outputs), **attrs)
        outs = [outs] if isinstance(outs, str) else list(outs)
        for port, (old, new) in enumerate(zip(node.outputs, outs)):
            src = graph.values[fused[port][0].outputs[0]] if port in fused else graph.values[old]
            graph.values[new].set_type(src.dtype, src.shape)
        for port, (add, _, _) in fused.items():
            graph.replace_node(add, [outs[port]])
        graph.replace_node(node, ["" if port in fused else new for port, new in enumerate(outs)])
    if fused_total and not dry_run:
        graph.remove_unused_initializers()
    return fused_total
