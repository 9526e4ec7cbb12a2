"""``fused-moe-shared``: a sigmoid-gated shared expert's sum with the routed experts moves into their FusedMoE
(inputs 12 ``shared`` and 13 ``shared_gate``).

Qwen1.5-MoE (transformers' ``Qwen2MoeSparseMoeBlock``) ends its MoE block
``y = experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)``: as written, the Sigmoid, the Mul and the
Add are an elementwise dispatch of their own after the block's kernel (24 launches per decode step of
Qwen1.5-MoE-A2.7B). With the shared expert's output and its gate logit as FusedMoE inputs, CUDA's down half adds
them in its store; the residual sum after the block then has FusedMoE's output as its operand again, so
``fused-moe-residual`` takes it too. ONNX Runtime and llvm-cpu get the Sigmoid, Mul and Add back after the block.
Matched::

    Y = FusedMoE(...)                       (no addend or shared expert yet; Y read by one node)
    M = Mul(Sigmoid(G), S) or Mul(S, Sigmoid(G))   (M read by one node)
    Z = Add(Y, M) or Add(M, Y)              (Y, S, Z of one dtype and shape [T, H]; G [T, 1]; S and G not
                                             computed from Y)
    ->  Z = FusedMoE(..., shared=S, shared_gate=G)

The contract rounds each step to the block's dtype as the graph does, so it is exact. The plugin runs the rule for
IREE cuda only unless its option ``shared`` says otherwise (``--opt moe.shared=true``).
"""

from __future__ import annotations

import networkx as nx

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.driver import PluginReport
from rewrite.core.ir import Graph, Node
from rewrite.core.rules import Builder

SHARED = "fused-moe-shared"
SHARED_PORT = 12  #: FusedMoE's input ``shared`` (rewrite.plugins.moe.lowering); ``shared_gate`` is 13


def _onnx(node: Node | None, op_type: str) -> bool:
    return node is not None and node.domain == "" and node.op_type == op_type


def _shared_of(graph: Graph, node: Node) -> tuple[Node, Node, str, str] | str | None:
    """(the Add, the Mul, S, G) for FusedMoE ``node``; a refusal reason, or None when no gated sum follows."""
    if len(node.inputs) > SHARED_PORT and node.inputs[SHARED_PORT] or len(node.inputs) > 11 and node.inputs[11]:
        return None
    y = node.outputs[0]
    add = graph.only_reader(y)
    if not _onnx(add, "Add") or len(add.inputs) != 2:
        return None
    mul = graph.producer_node(add.inputs[1 - add.inputs.index(y)])
    if not _onnx(mul, "Mul") or len(mul.inputs) != 2:
        return None
    sig = [graph.producer_node(v) for v in mul.inputs]
    j = 0 if _onnx(sig[0], "Sigmoid") else 1 if _onnx(sig[1], "Sigmoid") else None
    if j is None:
        return None
    s, g = mul.inputs[1 - j], sig[j].inputs[0]
    if graph.only_reader(mul.outputs[0]) is not add:
        return "the gated shared expert is read elsewhere too"
    # the block's output has hidden's [T, H] (the contract), whatever symbol shape inference gave it
    xv, yv, sv, gv, zv = (graph.values[v] for v in (node.inputs[0], y, s, g, add.outputs[0]))
    if xv.dtype is None or not (xv.dtype == yv.dtype == sv.dtype == gv.dtype == zv.dtype):
        return "the shared expert, its gate or the sum has another dtype than the block"
    if xv.shape is None or len(xv.shape) != 2 or sv.shape != xv.shape:
        return "the shared expert is not of the block's hidden shape [T, H] (every dim an int or the same symbol)"
    if gv.shape is None or len(gv.shape) != 2 or gv.shape[1] != 1 or gv.shape[0] != xv.shape[0]:
        return "the gate logit is not [T, 1] of the block's T"
    for v in (s, g):
        producer = graph.producer_node(v)
        if producer is not None and nx.has_path(graph.nx, node.id, producer.id):
            return "the shared expert or its gate is computed from the block"
    return add, mul, s, g


def fuse_shared(graph: Graph, report: PluginReport, *, dry_run: bool = False) -> int:
    """The ``fused-moe-shared`` rule (module docstring); returns the number of gated shared experts moved into a
    FusedMoE, recorded in ``report``."""
    rr = report.rule(SHARED)
    fused = 0
    for node, (add, mul, s, g) in rr.found(graph.nodes_by_op("FusedMoE", DOMAIN), lambda n: _shared_of(graph, n)):
        sigmoid = graph.producer_node(mul.inputs[0] if mul.inputs[1] == s else mul.inputs[1])
        fused += 1
        rr.applied(removed=3 + (graph.only_reader(sigmoid.outputs[0]) is mul), added=1)
        if dry_run:
            continue
        b = Builder(graph, SHARED, node.order, node.name)
        ins = (list(node.inputs) + [""] * SHARED_PORT)[:SHARED_PORT] + [s, g]  # (inputs 12, 13 were absent)
        hidden = graph.values[node.inputs[0]]  # the op's output has hidden's [T, H] (the contract)
        y = b.op("FusedMoE", ins, domain=DOMAIN, dtype=hidden.dtype, shape=hidden.shape, **{k: node.attr(k) for k in node.attrs})
        graph.replace_node(add, [y])
        graph.remove_dead_nodes([mul.id, sigmoid.id, node.id])
    return fused
