"""``rms-norm-prologue``: an RMSNorm moves into the float product after it, which also writes the normalized row.

A decoder layer's post-attention norm feeds the router's MatMul, the experts and (Qwen1.5-MoE) the shared expert;
at decode the norm is a launch of its own (BENCHMARKS.md, "Full-size decode on the H200": a step bound by its
launches). The first float product reading it (a DenseMatMul, or a MatMul or bias-free Gemm by a float initializer
such as the router's [H, E] weight, too small for ``dense-float-matmul``) takes the norm's input and weight
(:mod:`rewrite.plugins.densemm.op`, ``norm_epsilon``), and its second output is the normalized row for the norm's
other readers::

    N = RMSNorm(X0);  Y = MatMul(N, W);  ... other readers of N
    ->  Y, N' = DenseMatMul(X0, W^T, norm_weight; norm_epsilon);  ... they read N'

N may reach the products through a Reshape that keeps its last axis (an MoE block's ``view(-1, H)``), and a product
through an identity view of that (``Reshape(.., [-1, H])`` of the [T, H] rows, read by it only: transformers'
OnnxExporter writes Qwen3-MoE's router input so): the norm is per row, so the Reshape moves before it
(``Reshape(X0)`` is the op's input; the products read N' as they read the Reshape's output).

On CUDA one launch then normalizes the row (every workgroup for itself; workgroup 0 writes N') and computes the
product. The norm is the subgraph transformers' RMSNorm exports to or an ``ai.rewrite::RMSNorm``
(:func:`rewrite.plugins.rmsnorm.pattern.find_rms_norm`). The op computes the norm as the RMSNorm contract does
(float32 inside; the normalized row and its product with the weight rounded to A's dtype); the CUDA kernel sums the
squares in another order (within the conformance tolerance, not bit for bit). A norm whose output is a graph
output is left alone, with the reason in the report; when the first product reading a norm is refused, the next
one is tried.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.driver import PluginReport
from rewrite.core.ir import Graph, Node
from rewrite.core.rules import Builder
from rewrite.plugins.rmsnorm.pattern import find_rms_norm, norm_misfit, shape_readers

NORM_PROLOGUE = "rms-norm-prologue"
_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)


def product_weight(graph: Graph, node: Node, k_multiple: int) -> np.ndarray | str | None:
    """W [N, K] of a product that can take a norm (a DenseMatMul without one; a MatMul by a float initializer
    [K, N], or a ``Gemm`` without C, ``transA`` 0 and ``alpha`` 1 by a float initializer [N, K] with ``transB`` 1
    or [K, N] without (torch.nn.Linear as transformers' OnnxExporter writes it), read by it only and of A's dtype;
    A of rank 2 or more, K a multiple of ``k_multiple``), or a refusal reason; None for other nodes."""
    if node.domain == DOMAIN and node.op_type == "DenseMatMul":
        if node.attr("norm_epsilon") is not None or len(node.outputs) != 1:
            return None
        w = graph.const(node.inputs[1])
        if w is None:
            return None
    elif node.domain == "" and node.op_type in ("MatMul", "Gemm"):
        if node.op_type == "Gemm" and (len(node.inputs) > 2 and node.inputs[2] or node.attr("transA", 0)
                                       or node.attr("alpha", 1.0) != 1.0):
            return None
        w, wv = graph.const(node.inputs[1]), graph.values[node.inputs[1]]
        if w is None or not wv.is_initializer or w.ndim != 2 or wv.dtype not in _FLOATS:
            return None
        if wv.dtype != graph.values[node.inputs[0]].dtype or len(graph.uses(node.inputs[1])) != 1:
            return "the weight is of another dtype than A or read elsewhere too"
        w = w if node.op_type == "Gemm" and node.attr("transB", 0) else np.ascontiguousarray(w.T)
    else:
        return None
    a = graph.values[node.inputs[0]]
    if a.shape is None or len(a.shape) < 2:
        return f"A '{node.inputs[0]}' has shape {a.shape}; rank 2 or more expected"
    if w.shape[1] % k_multiple:
        return f"K={w.shape[1]}: the CUDA kernel reads rows in multiples of {k_multiple}"
    return w


def _norm_through_reshape(graph: Graph, a: str):
    """``(find_rms_norm's answer for the Reshape's input, the Reshape)`` when ``a`` is a Reshape's output, keeping
    the last dim, of a norm's output read by that Reshape only (and Shape ops); None otherwise."""
    r = graph.producer_node(a)
    if r is None or r.op_type != "Reshape" or r.domain != "":
        return None
    inner = r.inputs[0]
    found = find_rms_norm(graph, inner)
    others = [c for c, _ in graph.uses(inner) if c != r.id]
    if found is None or graph.is_graph_output(inner) or shape_readers(graph, others) is None:
        return None
    src, dst = graph.values[inner].shape, graph.values[a].shape
    if not src or not dst or not isinstance(src[-1], int) or src[-1] != dst[-1]:
        return "the Reshape after the norm changes its last dim"
    return found, r


def identity_view(graph: Graph, value: str) -> Node | None:
    """The ``Reshape(v, [-1, K])`` producing ``value`` when v is [rows, K] (rank 2, K static): a view that changes
    nothing, as transformers' OnnxExporter writes each ``view(-1, H)`` of an MoE block; else None."""
    r = graph.producer_node(value)
    if r is None or r.op_type != "Reshape" or r.domain != "" or len(r.inputs) < 2:
        return None
    shape, target = graph.values[r.inputs[0]].shape, graph.const(r.inputs[1])
    if shape is None or len(shape) != 2 or not isinstance(shape[-1], int) or target is None:
        return None
    return r if [int(v) for v in np.ravel(target)] == [-1, shape[-1]] else None


def fuse_norm_prologue(graph: Graph, report: PluginReport, *, k_multiple: int = 1, max_k: int | None = None,
                       dry_run: bool = False) -> int:
    """The rule (module docstring): per RMSNorm, the first product reading it (in graph order) takes it. Products
    need K a multiple of ``k_multiple`` and at most ``max_k`` (the CUDA kernel's rows; None: any). Returns the
    number of norms fused, recorded in ``report``."""
    rr = report.rule(NORM_PROLOGUE)
    fused, seen = 0, set()
    for node in sorted(graph, key=lambda n: n.order):
        if node.id not in graph.nodes or not node.inputs:
            continue
        a = node.inputs[0]
        if a in seen:
            continue
        w = product_weight(graph, node, k_multiple)
        if w is None:
            continue
        read, view = a, None  # what the product reads; the norm's (reshaped) row, maybe behind an identity view
        found, reshape = find_rms_norm(graph, a), None
        if found is None:
            through = _norm_through_reshape(graph, a)
            if through is None and (view := identity_view(graph, a)) is not None and len(graph.uses(a)) == 1:
                a = view.inputs[0]  # Qwen3-MoE through OnnxExporter: norm -> Reshape -> identity Reshape -> router
                through = _norm_through_reshape(graph, a) if a not in seen else None
            if through is None:
                continue
            found, reshape = through if isinstance(through, tuple) else (through, None)
        if isinstance(w, str) or isinstance(found, str):
            rr.refuse(w if isinstance(w, str) else found, node.name)
            continue
        x0, weight, eps, norm_nodes = found
        av = graph.values[a]
        if graph.is_graph_output(a) or node.inputs.count(read) != 1:
            rr.refuse("the norm's output is a graph output or read twice by the product", node.name)
            continue
        misfit = norm_misfit(graph, a, x0, weight, w.shape[1], max_k)
        if misfit is not None:
            rr.refuse(misfit, node.name)
            continue
        others = [c for c, _ in graph.uses(a) if c not in (node.id, view.id if view is not None else None)]
        seen.add(a)
        fused += 1
        rr.applied(removed=len(norm_nodes) + 1 + (reshape is not None) + (view is not None), added=1 + (reshape is not None))
        if dry_run:
            continue
        graph.ensure_opset(DOMAIN)
        b = Builder(graph, NORM_PROLOGUE, node.order, node.name)
        wt = node.inputs[1] if node.op_type == "DenseMatMul" else b.const(w, "weight")
        y = graph.values[node.outputs[0]]
        if reshape is not None:  # the norm is per row: the Reshape, keeping the last dim, goes before it
            for shape in shape_readers(graph, [c for c, _ in graph.uses(reshape.inputs[0]) if c != reshape.id]):
                graph.set_input(shape, 0, x0)
            kept = {"allowzero": reshape.attr("allowzero")} if reshape.attr("allowzero") is not None else {}
            x0 = b.op("Reshape", [x0, reshape.inputs[1]], **kept, dtype=av.dtype, shape=av.shape)
            norm_nodes = [*norm_nodes, reshape]
        outs = b.op("DenseMatMul", [x0, wt, weight], domain=DOMAIN, outputs=2 if others else 1, norm_epsilon=eps)
        outs = [outs] if isinstance(outs, str) else list(outs)
        graph.values[outs[0]].set_type(y.dtype, y.shape)
        graph.replace_node(node, [outs[0]])
        if view is not None:  # the identity view only the product read
            graph.remove_node(view)
        if others:
            graph.values[outs[1]].set_type(av.dtype, av.shape)
            graph.replace_all_uses(a, outs[1])
        graph.remove_dead_nodes([n.id for n in reversed(norm_nodes) if n.id in graph.nodes])
    if fused and not dry_run:
        graph.remove_unused_initializers()
    return fused
