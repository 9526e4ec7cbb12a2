"""``attention-absorbs-rope``: a layer's RoPE of Q and K becomes part of its GroupedAttention (IREE cuda only).

On IREE cuda the ``rope`` plugin leaves each layer one ``RotaryEmbedding`` pair (Q as X, K as X2, the
``rotary-embedding-pair`` rule), whose outputs feed the layer's GroupedAttention (Q and K_new, after
``attention-reads-loaded-cache``) and the cache write of K. The attention kernel can rotate Q's row and the new K
rows as it reads them: the pair's inputs become the attention's rotary inputs (cos, sin, the two norm weights,
:mod:`rewrite.plugins.attention.op`), and the attention's second output, the rotated K_new, replaces the pair's
Y2 wherever else it is read (the cache write). One launch fewer per layer: a decode step on IREE 3.13 pays host
time for every launch (BENCHMARKS.md, "Full-size decode on the H200").

Taken when the attention reads the new rows apart (K_new, V_new, position) with no rotary inputs yet, its Q is
one output of a RotaryEmbedding pair and its K_new the other, the pair's output for Q is read by that attention
alone, every other reader of the rotated K comes after the attention (none of them feeds it), and Q and K_new have
the same number of rows T (the tables' row r rotates new row r). Elsewhere the attention and the RoPE stay apart:
ONNX Runtime and llvm-cpu would lower the absorbed form as the two ops it was, gaining nothing.
"""

from __future__ import annotations

import networkx as nx

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.driver import PluginReport
from rewrite.core.ir import Graph, Node
from rewrite.core.rules import Builder

ABSORB = "attention-absorbs-rope"


def _pair_of(graph: Graph, attn: Node) -> tuple[Node, int] | str:
    """(the RotaryEmbedding pair, the index of its output that is Q) for ``attn``, or the reason there is none."""
    q, k_new = attn.inputs[0], attn.inputs[4]
    rope = graph.producer_node(q)
    if rope is None or rope.op_type != "RotaryEmbedding" or rope.domain != DOMAIN:
        return "Q is not rotated by a RotaryEmbedding"
    if len(rope.outputs) != 2 or graph.producer_node(k_new) is not rope or q == k_new:
        return "Q and K_new are not the two outputs of one RotaryEmbedding pair"
    return rope, rope.outputs.index(q)


def _why_not(graph: Graph, attn: Node, rope: Node, qi: int) -> str | None:
    """None when ``attn`` can take ``rope``'s rotation (output ``qi`` its Q), else the reason."""
    q_out, k_out = rope.outputs[qi], rope.outputs[1 - qi]
    if [c.id for c in graph.consumers(q_out)] != [attn.id] or graph.is_graph_output(q_out):
        return f"the rotated Q '{q_out}' is read by more than the attention"
    for c in graph.consumers(k_out):
        if c.id != attn.id and nx.has_path(graph.nx, c.id, attn.id):
            return f"the rotated K '{k_out}' is read by {c.describe()}, which the attention depends on"
    tq, tk = graph.values[attn.inputs[0]].shape, graph.values[attn.inputs[4]].shape
    if tq is None or tk is None or len(tq) != 4 or len(tk) != 4 or tq[2] is None or tq[2] != tk[2]:
        return f"Q {tq} and K_new {tk}: the same number of rows T (an int or one symbol) expected"
    return None


def absorb_rotary(graph: Graph, report: PluginReport, *, dry_run: bool = False) -> int:
    """The ``attention-absorbs-rope`` rule (module docstring) over every GroupedAttention of ``graph``; returns the
    number of attentions that took their RoPE, each recorded in ``report`` (a refusal with its reason)."""
    rr = report.rule(ABSORB)
    made = 0
    for attn in sorted(graph.nodes_by_op("GroupedAttention", DOMAIN), key=lambda n: n.order):
        if len(attn.inputs) < 7 or not attn.inputs[4] or len(attn.inputs) > 7 and any(attn.inputs[7:]):
            continue  # no new rows apart, or rotary inputs already
        found = _pair_of(graph, attn)
        why = found if isinstance(found, str) else _why_not(graph, attn, *found)
        if why is not None:
            rr.refuse(why, attn.name)
            continue
        rope, qi = found
        made += 1
        rr.applied(removed=2, added=1)
        if dry_run:
            continue
        r_ins = list(rope.inputs) + [""] * (6 - len(rope.inputs))
        # the pair: X (0) with weight (3), X2 (4) with weight2 (5); Q is X when qi is 0
        (qx, qw), (kx, kw) = ((r_ins[0], r_ins[3]), (r_ins[4], r_ins[5]))[:: 1 if qi == 0 else -1]
        ins = [qx] + list(attn.inputs[1:4]) + [kx] + list(attn.inputs[5:7]) + [r_ins[1], r_ins[2], qw, kw]
        attrs = {k: attn.attr(k) for k in ("scale", "nan_rows_zero") if k in attn.attrs}
        if qw or kw:
            attrs["norm_epsilon"] = float(rope.attr("norm_epsilon"))
        y, k_rot = graph.values[attn.outputs[0]], graph.values[rope.outputs[1 - qi]]
        outs = Builder(graph, ABSORB, attn.order, attn.name).op("GroupedAttention", ins, domain=DOMAIN, outputs=2, **attrs)
        graph.values[outs[0]].set_type(y.dtype, y.shape)
        graph.values[outs[1]].set_type(k_rot.dtype, k_rot.shape)
        k_name = rope.outputs[1 - qi]
        graph.replace_node(attn, [outs[0]])
        graph.replace_all_uses(k_name, outs[1])
        graph.remove_node(rope)
    return made
