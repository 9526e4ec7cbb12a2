"""``rotary-embedding-pair``: two RotaryEmbedding ops with the same cos and sin become one (X2, its output Y2).

A decoder layer rotates its queries and its keys by the same tables: two launches on IREE cuda for a few
kilobytes each, where a decode step is bound by launches (BENCHMARKS.md). One op with ``X2`` is one dispatch of
the ``rotary_embedding2`` kernel (the contract: :mod:`rewrite.plugins.rope.op`). Taken pairwise in graph order
(the layer's Q then its K), when the two have X of one dtype with equal B, T and D, the same ``norm_epsilon``
(or a norm on at most one of them), and neither is computed from the other. For IREE cuda only: elsewhere the
pair is lowered as the two ops it was, so it would gain nothing.
"""

from __future__ import annotations

import networkx as nx

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.driver import PluginReport
from rewrite.core.ir import Graph, Node
from rewrite.core.rules import Builder

PAIR = "rotary-embedding-pair"


def _why_not(graph: Graph, a: Node, b: Node) -> str | None:
    """None when ``a`` and ``b`` (same cos and sin) can be one op, else the reason."""
    xa, xb = graph.values[a.inputs[0]], graph.values[b.inputs[0]]
    if xa.dtype != xb.dtype or xa.shape is None or xb.shape is None or len(xa.shape) != 4 or len(xb.shape) != 4:
        return "X of another dtype or rank"
    if any(xa.shape[k] is None or xa.shape[k] != xb.shape[k] for k in (0, 2, 3)):
        return "X of another B, T or D (or one not known: an int or the same symbol needed)"
    norms = [n.attr("norm_epsilon") for n in (a, b) if len(n.inputs) > 3 and n.inputs[3]]
    if len(norms) == 2 and norms[0] != norms[1]:
        return "norms of two epsilons"
    if nx.has_path(graph.nx, a.id, b.id) or nx.has_path(graph.nx, b.id, a.id):
        return "one is computed from the other"
    return None


def pair_rotary_embeddings(graph: Graph, report: PluginReport, *, dry_run: bool = False) -> int:
    """The ``rotary-embedding-pair`` rule (module docstring); returns the number of pairs made, recorded in
    ``report``."""
    rr = report.rule(PAIR)
    groups: dict[tuple[str, str], list[Node]] = {}
    for n in graph.nodes_by_op("RotaryEmbedding", DOMAIN):
        if len(n.inputs) > 4 and n.inputs[4]:
            continue  # a pair already
        groups.setdefault((n.inputs[1], n.inputs[2]), []).append(n)
    made = 0
    for nodes in groups.values():
        nodes.sort(key=lambda n: n.order)
        i = 0
        while i + 1 < len(nodes):
            a, b = nodes[i], nodes[i + 1]
            why = _why_not(graph, a, b)
            if why is not None:
                rr.refuse(why, a.name)
                i += 1
                continue
            i += 2
            made += 1
            rr.applied(removed=2, added=1)
            if dry_run:
                continue
            wa = a.inputs[3] if len(a.inputs) > 3 else ""
            wb = b.inputs[3] if len(b.inputs) > 3 else ""
            eps = a.attr("norm_epsilon") if wa else b.attr("norm_epsilon")
            attrs = {"norm_epsilon": float(eps)} if eps is not None else {}
            ins = [a.inputs[0], a.inputs[1], a.inputs[2], wa, b.inputs[0]] + ([wb] if wb else [])
            builder = Builder(graph, PAIR, max(a.order, b.order), a.name)
            ya, yb = graph.values[a.outputs[0]], graph.values[b.outputs[0]]
            outs = builder.op("RotaryEmbedding", ins, domain=DOMAIN, outputs=2, **attrs)
            graph.values[outs[0]].set_type(ya.dtype, ya.shape)
            graph.values[outs[1]].set_type(yb.dtype, yb.shape)
            graph.replace_node(a, [outs[0]])
            graph.replace_node(b, [outs[1]])
    return made
