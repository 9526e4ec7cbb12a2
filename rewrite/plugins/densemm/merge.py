"""``merge-normed-products``: a second float product of a normalized row joins the op that normalizes it.

After ``rms-norm-prologue`` (:mod:`rewrite.plugins.densemm.prologue`) a norm's first product computes the norm and
writes the normalized row as its last output, for the norm's other readers. Another float product of that row is
a launch of its own at decode: Qwen1.5-MoE's one-column shared-expert gate beside its router (24 launches a
token). It joins the op as a second output (``splits``, :mod:`rewrite.plugins.densemm.op`), its weight rows after
the op's::

    Y, N = DenseMatMul(X, W, nw; norm_epsilon);  G = DenseMatMul(N, Wg)       (or MatMul(N, Wg^T))
    ->  Y, G, N' = DenseMatMul(X, concat(W, Wg), nw; norm_epsilon, splits=[rows of W, rows of Wg])

N' only while the row has other readers. The product may read N through an identity view, ``Reshape(N, [-1, K])`` of
the [rows, K] row (transformers' OnnxExporter writes one for each ``view(-1, H)`` of an MoE block). The candidates
are what the prologue rule itself takes (:func:`rewrite.plugins.densemm.prologue.product_weight`: a DenseMatMul
without a norm or splits, or a MatMul or bias-free Gemm by a float initializer read by it only, of A's dtype), here
reading the normalized row as A with W's K. The contract has two splits, so one product joins each op: the narrowest
candidate (the gate, rather than a float model's shared-expert gate_proj reading the same row), the first in graph
order among equals. Every output is computed as before (the same sums in float32, each rounded to A's dtype once).
In a dry run the prologue rule changes nothing, so this rule counts no match there.
"""

from __future__ import annotations

import numpy as np

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.driver import PluginReport
from rewrite.core.ir import Graph, Node
from rewrite.core.rules import Builder
from rewrite.plugins.densemm.prologue import identity_view, product_weight

MERGE = "merge-normed-products"


def _normed(node: Node) -> str | None:
    """The normalized-row output of a DenseMatMul that computes a norm and has no splits, else None."""
    if node.domain != DOMAIN or node.op_type != "DenseMatMul" or node.attr("norm_epsilon") is None:
        return None
    if node.attr("splits") is not None or len(node.outputs) != 2:
        return None
    return node.outputs[1] or None


def _readers(graph: Graph, normed: str) -> list[tuple[Node, str]]:
    """``(node, the value it reads)`` for the readers of ``normed`` [rows, K] and of its identity views
    (:func:`rewrite.plugins.densemm.prologue.identity_view`: Qwen2-MoE's router and shared-expert gate through
    transformers' OnnxExporter each read one), in graph order."""
    out = [(c, normed) for c in graph.consumers(normed)]
    for r in [c for c, _ in out if c.op_type == "Reshape"]:
        if identity_view(graph, r.outputs[0]) is r and r.inputs[0] == normed:
            out += [(c, r.outputs[0]) for c in graph.consumers(r.outputs[0])]
    return sorted(out, key=lambda ca: ca[0].order)


def merge_normed_products(graph: Graph, report: PluginReport, *, dry_run: bool = False) -> int:
    """The rule (module docstring) over every DenseMatMul with a norm and a normalized-row output. Returns the
    number of products merged, recorded in ``report``."""
    rr = report.rule(MERGE)
    merged = 0
    for node in sorted(graph, key=lambda n: n.order):
        if node.id not in graph.nodes:
            continue
        normed = _normed(node)
        w1 = graph.const(node.inputs[1]) if normed else None
        if w1 is None:
            continue
        candidates = []
        for c, a in _readers(graph, normed):
            if c.inputs[0] != a or c.inputs.count(a) != 1:
                continue
            w2 = product_weight(graph, c, 1)
            if w2 is None:
                continue
            if isinstance(w2, str):
                rr.refuse(w2, c.name)
            elif w2.shape[1] != w1.shape[1] or w2.dtype != w1.dtype:
                rr.refuse(f"weight [{w2.shape[0]}, {w2.shape[1]}] {w2.dtype}; [*, {w1.shape[1]}] {w1.dtype} expected", c.name)
            else:
                candidates.append((w2.shape[0], c.order, c, a, w2))
        if not candidates:
            continue
        *_, other, a, w2 = min(candidates, key=lambda t: t[:2])
        view = graph.producer_node(a) if a != normed else None
        drop = {other.id} | ({view.id} if view is not None and len(graph.uses(a)) == 1 else set())
        merged += 1
        rr.applied(removed=1 + len(drop), added=1)
        if dry_run:
            continue
        others = [u for u in graph.uses(normed) if u[0] not in drop]
        b = Builder(graph, MERGE, node.order, node.name)
        wc = b.const(np.ascontiguousarray(np.concatenate([w1, w2])), "weight")
        outs = list(b.op("DenseMatMul", [node.inputs[0], wc, node.inputs[2]], domain=DOMAIN, outputs=3 if others else 2,
                         norm_epsilon=node.attr("norm_epsilon"), splits=[int(w1.shape[0]), int(w2.shape[0])]))
        for new, old in zip(outs, [node.outputs[0], other.outputs[0], normed]):
            v = graph.values[old]
            graph.values[new].set_type(v.dtype, v.shape)
        graph.replace_node(other, [outs[1]])
        if view is not None and view.id in drop:  # the identity view only the product read
            graph.remove_node(view)
        graph.replace_node(node, [outs[0], outs[2] if others else ""])
    if merged and not dry_run:
        graph.remove_unused_initializers()
    return merged

