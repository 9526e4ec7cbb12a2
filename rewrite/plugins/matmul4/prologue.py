"""``rms-norm-prologue``: the RMSNorm before a MatMulInt4 moves into it.

A decoder layer's input norm has one reader, the merged query/key/value projection; at decode the norm is a
launch of its own before it (BENCHMARKS.md, "Full-size decode on the H200": a step bound by its launches). The
op's ``norm_epsilon`` form (:mod:`rewrite.plugins.matmul4.op`) takes the norm's input and weight, and the CUDA
kernel for one row normalizes the row in its prologue::

    Y.. = MatMulInt4(RMSNorm(X0), ...)          (the norm's output read by this op only, as A, and by Shape ops)
    ->  Y.. = MatMulInt4(X0, ..., norm_weight; norm_epsilon)   (the Shape ops read X0: the norm keeps its shape)

The norm is the subgraph transformers' RMSNorm exports to or an ``ai.rewrite::RMSNorm`` the ``norm`` plugin made
(:func:`rewrite.plugins.rmsnorm.pattern.find_rms_norm`). The op's contract computes the norm as that op does
(float32 inside; the normalized row and its product with the weight rounded to A's dtype); the CUDA kernels sum
the squares in another order (within the conformance tolerance, not bit for bit). Norms with other readers (the
post-attention norm feeds the router and the experts: ``densemm``'s rule takes those), graph outputs and norms of
another width or dtype are left alone, with the reason in the report.
"""

from __future__ import annotations

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.driver import PluginReport
from rewrite.core.ir import Graph
from rewrite.core.rules import Builder
from rewrite.plugins.rmsnorm.pattern import find_rms_norm, norm_misfit, shape_readers

NORM_PROLOGUE = "rms-norm-prologue"


def fuse_norm_prologue(graph: Graph, report: PluginReport, *, max_k: int | None = None, dry_run: bool = False) -> int:
    """The rule (module docstring) on every MatMulInt4 without a prologue, of K up to ``max_k`` (the CUDA kernels'
    shared row; None: any); returns the number of norms fused, recorded in ``report``."""
    rr = report.rule(NORM_PROLOGUE)
    fused = 0
    unfused = lambda n: n.attr("norm_epsilon") is None and n.id in graph.nodes  # noqa: E731
    for node, (x0, weight, eps, norm_nodes) in rr.found(graph.nodes_by_op("MatMulInt4", DOMAIN),
                                                        lambda n: find_rms_norm(graph, n.inputs[0]) if unfused(n) else None):
        a = node.inputs[0]
        shapes = shape_readers(graph, [c for c, _ in graph.uses(a) if c != node.id])
        if shapes is None or node.inputs.count(a) != 1:
            rr.refuse("the norm's output is read by more than this product's A (and Shape ops)", node.name)
            continue
        misfit = norm_misfit(graph, a, x0, weight, int(node.attr("K")), max_k)
        if misfit is not None:
            rr.refuse(misfit, node.name)
            continue
        fused += 1
        rr.applied(removed=len(norm_nodes) + 1, added=1)
        if dry_run:
            continue
        outs = len(node.outputs)
        extras = list(node.inputs[4:]) + [""] * (outs - len(node.inputs[4:]))
        ins = [x0] + list(node.inputs[1:4]) + [""] * (3 - len(node.inputs[1:4])) + extras + [weight]
        attrs = {name: node.attr(name) for name in ("K", "N", "block_size", "splits", "activation") if node.attr(name) is not None}
        b = Builder(graph, NORM_PROLOGUE, node.order, node.name)
        new = b.op("MatMulInt4", ins, domain=DOMAIN, outputs=outs, norm_epsilon=eps, **attrs)
        new = [new] if isinstance(new, str) else list(new)
        for old, value in zip(node.outputs, new):
            graph.values[value].set_type(graph.values[old].dtype, graph.values[old].shape)
        graph.replace_node(node, new)
        for shape in shapes:
            graph.set_input(shape, 0, x0)
        graph.remove_dead_nodes([n.id for n in reversed(norm_nodes) if n.id in graph.nodes])
    if fused and not dry_run:
        graph.remove_unused_initializers()
    return fused
