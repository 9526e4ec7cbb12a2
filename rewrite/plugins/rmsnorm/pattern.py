"""The RMSNorm subgraph as exporters write it, shared by the ``norm`` and ``rope`` rules, and
:func:`find_rms_norm` for the rules that take a norm into the op after it (``matmul4``'s and ``densemm``'s
``rms-norm-prologue``)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.ir import SINK, Graph, Node, dtype_name
from rewrite.core.matcher import Match, Matcher
from rewrite.core.pattern import AttrVar, Const, Or, Pattern, Var


def rms_norm(op, x0):
    """transformers' RMSNorm over the last axis, as its exporters and the seed form write it: ``[Cast(float32)] ->
    Pow 2 (or Mul(x, x)) -> ReduceMean(-1, keepdims) -> Add eps -> Sqrt -> Div (or Reciprocal, Mul) -> [Cast back] ->
    Mul weight``. Binds ``weight``, ``eps`` and the nodes ``norm_*`` (``norm_weight`` the last)."""
    xf = Or([op.Cast(x0, to=TensorProto.FLOAT, _name="norm_wide"), x0])
    sq = Or([op.Pow(xf, Const("two", value=2.0), _name="norm_sq"), op.Mul(xf, xf, _name="norm_sq")])
    # ReduceMean's axes: an input (opset 18) or an attribute (before)
    mean = Or([op.ReduceMean(sq, Const("norm_axes", value=[-1]), keepdims=1, _name="norm_mean"),
               op.ReduceMean(sq, axes=AttrVar("norm_axes_attr"), keepdims=1, _name="norm_mean")])
    root = op.Sqrt(op.Add(mean, Const("eps"), _name="norm_eps"), _name="norm_sqrt")
    normed = Or([op.Div(xf, root, _name="norm_div"), op.Mul(xf, op.Reciprocal(root, _name="norm_recip"), _name="norm_div")])
    normed = Or([op.Cast(normed, to=AttrVar("norm_narrow"), _name="norm_back"), normed])
    return op.Mul(normed, Var("weight"), _name="norm_weight")


def norm_refusal(m, x0, last: int):
    """None when the matched :func:`rms_norm` over X0 (an IR value) is the one the ops take: computed in float32
    (X0 float32, or float16 between a Cast to float32 and one back), over the last axis (``last``: its index),
    a scalar constant epsilon and a constant weight [H] of X0's type; else the refusal."""
    div = m.node("norm_div")
    wide = m.graph.values[m.node("norm_sq").inputs[0]]
    if wide.dtype != TensorProto.FLOAT:
        return m.fail(f"the norm computes in {dtype_name(wide.dtype)}: float32 expected", div)
    if ("norm_wide" in m) != (x0.dtype != TensorProto.FLOAT) or ("norm_back" in m and m.attr("norm_narrow") != x0.dtype) \
            or ("norm_back" in m) != ("norm_wide" in m):
        return m.fail("the norm's Casts do not go to float32 and back to X's type", div)
    if "norm_axes_attr" in m and list(m.attr("norm_axes_attr")) not in ([-1], [last]):
        return m.fail(f"the ReduceMean is over axes {m.attr('norm_axes_attr')}, not the last", m.node("norm_mean"))
    eps = m.const("eps")
    if eps is None or eps.size != 1 or eps.ndim > 1:
        return m.fail(f"the norm's epsilon '{m['eps']}' is not a scalar constant", m.node("norm_eps"))
    if "two" in m and np.asarray(m.const("two")).ndim > 1:  # a [1, 1, 1] exponent would broadcast X up a rank
        return m.fail(f"the exponent '{m['two']}' has rank {np.asarray(m.const('two')).ndim}", m.node("norm_sq"))
    out = m.graph.values[m.node("norm_weight").outputs[0]]
    if out.shape is not None and x0.shape is not None and list(out.shape) != list(x0.shape):
        return m.fail(f"the norm's output has shape {out.shape}, not X's {x0.shape} (a broadcast)", m.node("norm_weight"))
    w, wv = m.graph.const(m["weight"]), m.value("weight")
    h = x0.shape[-1] if x0.shape else None
    if w is None or wv.dtype != x0.dtype or list(w.shape) != [h]:
        return m.fail(f"the norm's weight '{m['weight']}' is not a constant [{h}] of X's type", m.node("norm_weight"))
    return None


_NORM = Pattern.trace(rms_norm, "")


def shape_readers(graph: Graph, readers: list[int]) -> list[Node] | None:
    """The nodes ``readers`` (ids, as :meth:`Graph.uses` gives them) when every one is a Shape op, which may read a
    norm's input instead of its output (a norm keeps its shape); None when one is not (or is the graph's output)."""
    nodes = [graph.node(c) for c in readers if c != SINK]
    if len(nodes) != len(readers) or any(n.op_type != "Shape" or n.domain != "" for n in nodes):
        return None
    return nodes


def norm_misfit(graph: Graph, a: str, x0: str, weight: str, k: int, max_k: int | None) -> str | None:
    """None when the norm ``X0 -> a`` (weight ``weight``) can be a product's prologue over K = ``k``: X0 [..., K]
    and the weight [K] of ``a``'s dtype, K at most ``max_k`` (a CUDA kernel's shared row; None: any); else why not."""
    if max_k is not None and k > max_k:
        return f"K={k}: the CUDA kernel normalizes rows of at most {max_k}"
    av, xv, wv = graph.values[a], graph.values[x0], graph.values[weight]
    if xv.dtype != av.dtype or wv.dtype != av.dtype or list(wv.shape or []) != [k] or (xv.shape or [None])[-1] != k:
        return f"the norm's input {xv.shape} or weight {wv.shape} is not [..., K={k}] and [K] of A's dtype"
    return None


def find_rms_norm(graph: Graph, value: str) -> tuple[str, str, float, list[Node]] | str | None:
    """The RMSNorm producing ``value``: ``(X0, weight, epsilon, its nodes)`` when it is an ``ai.rewrite::RMSNorm``
    (the ``norm`` plugin's op) or a match of the subgraph :func:`rms_norm` (each way it matches, in turn: with an
    f16 X, the Cast to float32 inside the norm or before it) that :func:`norm_refusal` accepts, with no value inside
    it read outside; else the first match's refusal reason (a norm that must stay); None when it is no norm."""
    producer = graph.producer_node(value)
    if producer is None:
        return None
    if producer.op_type == "RMSNorm" and producer.domain == DOMAIN:
        if producer.attr("epsilon") is None or len(producer.inputs) < 2:
            return f"the RMSNorm {producer.describe()} has no epsilon or no weight"
        return producer.inputs[0], producer.inputs[1], float(producer.attr("epsilon")), [producer]
    if producer.op_type != "Mul" or producer.domain != "":
        return None
    first = None
    for binding in Matcher(graph, _NORM).match_at(producer):
        m = Match(graph, _NORM, binding)
        x0 = m.value("x0")
        bad = norm_refusal(m, x0, len(x0.shape) - 1) if x0.shape else None
        why = ("the norm's input has no known rank" if not x0.shape else bad.reason if bad is not None
               else "a value inside the norm is read outside it" if m.used_outside() else None)
        if why is None:
            return m["x0"], m["weight"], float(np.asarray(m.const("eps")).reshape(-1)[0]), m.nodes
        first = first or why
    return first
