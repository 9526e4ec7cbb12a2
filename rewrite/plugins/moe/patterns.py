"""Patterns of the routed-expert computation of an MoE block, in the forms real models come in.

Reusable sub-patterns (plain functions of the op builder, called once per use so each use is its own nodes):

* :func:`routing`: the routing weights and expert indices, from ``ai.rewrite::MoERouterTopK(logits)`` (the
  ``topk`` plugin's op) or from the raw ``Softmax(-1) -> [Cast f32] -> TopK(k) [-> Div(., ReduceSum)] ->
  [Cast to the model dtype]`` chain;
* :func:`dequantized_expert_weight`: the seed's gathered INT4 weight, ``DequantizeLinear(Cast(Gather(codes),
  UINT4), Gather(scales), Cast(Gather(zero points), UINT4), axis=2, block_size)``, or ``legalize``'s
  decomposition of it, ``(Cast(codes) - expand(Cast(zp))) * expand(scales)`` with ``expand`` = Unsqueeze,
  Tile, Reshape [, Slice of a partial last block].

Top-level patterns, each ending at the [T, H] routed-expert output (the sigmoid-gated shared expert of
Qwen1.5-MoE is outside them and stays as it is):

* :func:`hf_experts`: transformers' exporter and ``torch.onnx.export(dynamo=True)`` with ``batched_mm`` experts
  (tokens repeated k times by Tile or Expand, GatherND of
  stacked [E, 2I, H] / [E, H, I] weights by expert id, batched MatMul, Split, SiLU * up, MatMul, Mul by the
  routing weight, ReduceSum over k; fp16 exports have Casts around the router and the ReduceSum);
* :func:`seed_experts`: the seed's form (seed 000 "Expert Computation (INT4 QDQ, gather-then-compute)",
  examples/seed_form.py ``moe``).
"""

from __future__ import annotations

from onnx import TensorProto

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.pattern import AttrVar, Const, Or, Var

FLOAT, FLOAT16, UINT4 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.UINT4


def _is(want):
    """AttrVar check: the attribute (or its ONNX default, given as AttrVar.default) equals ``want``."""
    return lambda v: v == want or f"is {v}, pattern wants {want}"


def _last_axis(name: str):
    """The last axis of the rank-2 router logits [T, E], spelled -1 or 1 (ONNX's default is -1 for Softmax-13 and
    TopK); the rank is checked by the rule. Each use has its own name: exporters mix the spellings."""
    return AttrVar(name, check=lambda v: v in (-1, 1) or f"is {v}, pattern wants the last axis of [T, E]", default=-1)


def routing(op, logits):
    """(weights [T, k] or its flattening source, indices [T, k]) from a router over ``logits`` [T, E]: raw
    ``Softmax -> [Cast] -> TopK [-> Div(., ReduceSum)]``, raw ``TopK -> Softmax`` (GraniteMoE, Mixtral-style
    top-k then softmax), or ``topk``'s ``MoERouterTopK``. The rule refuses a match whose weights and indices
    come from different alternatives."""
    probs = op.Softmax(logits, axis=_last_axis("softmax_axis"), _name="softmax")
    probs = Or([op.Cast(probs, to=FLOAT, _name="probs_cast"), probs])
    values, indices = op.TopK(probs, Const("k"), axis=_last_axis("topk_axis"), largest=AttrVar("largest", default=1), _outputs=2, _name="topk")
    norm = op.Div(values, op.ReduceSum(values, Const("norm_axes", value=[-1]), keepdims=1), _name="norm_div")
    raw = Or([norm, values])
    first_values, first_indices = op.TopK(logits, Const("k"), axis=_last_axis("topk_first_axis"),
                                          largest=AttrVar("largest", default=1), _outputs=2, _name="topk_first")
    then_softmax = op.Softmax(first_values, axis=_last_axis("softmax_after_axis"), _name="softmax_after")
    r_w, r_i = op.MoERouterTopK(logits, _domain=DOMAIN, _outputs=2, _name="router")
    weights = Or([raw, then_softmax, r_w])
    weights = Or([op.Cast(weights, to=AttrVar("weights_to"), _name="weights_cast"), weights])
    return weights, Or([indices, first_indices, r_i])


def repeated(op, hidden):
    """``hidden`` [T, H] with each row repeated k times, [T, k, H]: ``Tile(Unsqueeze(hidden, 1), [1, k, 1])``
    (transformers' exporter) or ``Expand(Unsqueeze(hidden, 1), [1, k, 1])`` (``torch.onnx.export`` with
    ``dynamo=True``); the repeat count is checked by the rule (``rep_tiles`` / ``rep_expand``)."""
    rows = op.Unsqueeze(hidden, Const("rep_axes", value=[1]))
    return Or([op.Tile(rows, Const("rep_tiles")), op.Expand(rows, Var("rep_expand"))])


def hf_experts(op, hidden, logits):
    """transformers' exporter, ``batched_mm`` experts (qwen2_moe / qwen3_moe, fp32 and fp16; float stacks, or
    INT4 stacks as ``quant4`` leaves them: GatherND of codes / scales / zero points, then DequantizeLinear)."""
    weights, indices = routing(op, logits)
    rep = op.Reshape(repeated(op, hidden), Var("rep_shape"))
    ids = op.Unsqueeze(op.Reshape(indices, Const("ids_shape", value=[-1])), Const("ids_axes", value=[-1]))

    def stack(name):
        gather = lambda c: op.GatherND(c, ids, batch_dims=AttrVar("batch_dims", check=_is(0), default=0))  # noqa: E731
        return Or([gather(Const(name)), dequantized_expert_weight(op, name + "q", gather)])

    gate_up = op.MatMul(stack("fc1"), op.Unsqueeze(rep, Const("a1", value=[-1])))
    gate, up = op.Split(op.Squeeze(gate_up, Const("a2", value=[-1])), axis=1, num_outputs=2, _outputs=2, _name="split")
    act = op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)
    down = op.MatMul(stack("fc2"), op.Unsqueeze(act, Const("a3", value=[-1])))
    w = op.Unsqueeze(op.Reshape(weights, Const("w_shape", value=[-1])), Const("a4", value=[-1]))
    per_pair = op.Mul(op.Squeeze(down, Const("a5", value=[-1])), w)
    grouped = op.Reshape(per_pair, Var("sum_shape"))
    grouped = Or([op.Cast(grouped, to=FLOAT), grouped])
    total = op.ReduceSum(grouped, Const("sum_axes", value=[1]), keepdims=0, _name="sum")
    return Or([op.Cast(total, to=FLOAT16, _name="out_cast"), total])


def dequantized_expert_weight(op, proj: str, gather):
    """A gathered INT4 expert weight [T*k, N, K] (DequantizeLinear or legalize's decomposition); ``gather(c)``
    builds the Gather / GatherND of the stacked constant ``c`` [E, ...] by the selected expert ids."""
    codes = gather(Const(f"{proj}_codes"))
    scales = gather(Const(f"{proj}_scales"))
    zps = gather(Const(f"{proj}_zp"))
    dq = op.DequantizeLinear(op.Cast(codes, to=UINT4), scales, op.Cast(zps, to=UINT4), axis=2,
                             block_size=AttrVar(f"{proj}_bs"), _name=f"{proj}_dq")

    def widened(v):  # legalize's exact-4bit-cast folds Cast(Cast(v, UINT4), F) to Cast(v, F)
        return Or([op.Cast(v, to=AttrVar("float_to")), op.Cast(op.Cast(v, to=UINT4), to=AttrVar("float_to"))])

    codes_f = widened(codes)

    def expand(p, tag):
        r = op.Reshape(op.Tile(op.Unsqueeze(p, Const(f"{proj}_{tag}_ax", value=[3])), Const(f"{proj}_{tag}_tiles"),
                               _name=f"{proj}_{tag}_tile"), Const(f"{proj}_{tag}_shape", value=[0, 0, -1]))
        cut = op.Slice(r, Const(f"{proj}_{tag}_start", value=[0]), op.Shape(codes_f, start=2, end=3),
                       Const(f"{proj}_{tag}_axes", value=[2]))
        return Or([cut, r])

    legal = op.Mul(op.Sub(codes_f, expand(widened(zps), "zp")), expand(scales, "sc"))
    return Or([dq, legal])


def seed_experts(op, hidden, logits):
    """The seed's INT4 gather-then-compute experts (examples/seed_form.py ``moe``)."""
    weights, indices = routing(op, logits)
    flat = op.Reshape(indices, Const("ids_shape", value=[-1]))
    gather = lambda c: op.Gather(c, flat, axis=0)  # noqa: E731
    gw, uw, dw = (op.Transpose(dequantized_expert_weight(op, p, gather), perm=[0, 2, 1]) for p in ("gate", "up", "down"))
    rep = op.Reshape(repeated(op, hidden), Const("rep_shape"))
    gate = op.MatMul(rep, gw)
    act = op.Mul(op.Mul(gate, op.Sigmoid(gate)), op.MatMul(rep, uw))
    expert_out = op.MatMul(act, dw)
    weighted = op.MatMul(op.Reshape(weights, Const("w_shape")), op.Reshape(expert_out, Const("sum_shape")))
    return op.Reshape(weighted, Const("out_shape"))

