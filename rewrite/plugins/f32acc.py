"""``f32acc``: f16 MatMuls computed with f32 accumulation, as a targeted rewrite (seed 000, item A7).

``MatMul(a: f16, b: f16) -> y: f16`` becomes ``Cast(MatMul(Cast(a, to=FLOAT), Cast(b, to=FLOAT)), to=FLOAT16)``.
Every f16 value is exact in f32, each product of two f16 values is exact in f32 (11+11 significant bits),
so the rewritten MatMul sums exactly the products the original sums, in f32, and rounds the result once
to f16: where an f16 accumulator overflows (partial sums above 65504) or loses the small terms, the
rewrite gives the f32-accumulated answer. The output type stays FLOAT16, so nothing downstream changes.

Why: IREE on gfx1100 picks an f16-accumulator WMMA for f16 MatMuls, which yields NaN for transposed-B
operands, the Q x K^T of attention (iree#23806). The seed's workaround promotes every f16 MatMul; option
``mode`` (``RewriteContext.options["f32acc"]["mode"]``, CLI ``--opt f32acc.mode=all``) chooses:

* ``attention`` (default): only the attention-score MatMuls, rule ``f32-accumulate-qk``. B is produced by
  a Transpose that swaps the last two axes, possibly followed by Unsqueeze/Expand/Reshape that keep the last
  two dims (a GQA repeat done after the transpose), and the product reaches a Softmax over its last axis
  through scaling/masking ops only (Mul, Div, Add, Sub, Where, Cast, Tanh). The Softmax condition is
  needed: the seed form's expert MatMuls also take a ``Transpose(perm=[0, 2, 1])`` B (of the dequantized
  expert weights) and are not attention. In the transformers exports (Qwen2-MoE, and Qwen3-MoE with GQA
  repeated before the transpose) and the seed form this picks exactly one MatMul per layer.
* ``all``: every f16 MatMul, rule ``f32-accumulate`` (the seed's EP behaviour).
* ``none``: nothing.

On this machine the rewrite changes no result: ONNX Runtime CPU and IREE llvm-cpu both already accumulate
f16 MatMuls in f32 (measured: 32 products of +4096, 31 of -4096 and one of -4032 give 64 on both, where an
f16 accumulator overflows to inf); tests/test_plugin_f32acc.py checks the semantics against a numpy
f16-accumulation reference.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rewrite.core.driver import PluginReport, apply_rules
from rewrite.core.ir import Graph, dtype_name
from rewrite.core.rules import rule
from rewrite.errors import RewriteError
from rewrite.plugins.base import Plugin
from rewrite.core.cases import bad_input, negative, positive

MODES = ("attention", "all", "none")
#: Ops between the attention-score MatMul and its Softmax (scale, mask, soft-capping, dtype changes).
_SCORE_PATH = frozenset({"Mul", "Div", "Add", "Sub", "Where", "Cast", "Tanh"})
#: Ops between K^T's Transpose and the MatMul that may repeat KV heads (GQA) without touching the last two axes.
_REPEAT = frozenset({"Unsqueeze", "Expand", "Reshape"})


@rule("f32-accumulate")
def f32_accumulate(op, a, b):
    """MatMul(a: f16, b: f16) -> Cast(MatMul(Cast(a, f32), Cast(b, f32)), f16)."""
    return op.MatMul(a, b, _name="mm")


@rule("f32-accumulate-qk")
def f32_accumulate_qk(op, a, b):
    """MatMul(q: f16, K^T: f16) feeding a Softmax -> the same with f32 accumulation."""
    return op.MatMul(a, b, _name="mm")


def _check_f16(m):
    for k in ("a", "b"):
        dt = m.value(k).dtype
        if dt is None:
            return m.fail(f"element type of '{m[k]}' is unknown (run shape inference)", m.node("mm"))
        if dt != TensorProto.FLOAT16:
            return m.fail(f"MatMul input is {dtype_name(dt)}, not FLOAT16", m.node("mm"))
    return None


@f32_accumulate.check
def _(m):
    return _check_f16(m)


def transposed_last_two(graph: Graph, value: str) -> str | None:
    """Name of the Transpose node that makes ``value`` a K^T: its perm swaps the last two axes and keeps the
    others, and between it and ``value`` only :data:`_REPEAT` ops that keep the last two dims. None otherwise."""
    last2 = graph.values[value].shape
    for _ in range(6):
        n = graph.producer_node(value)
        if n is None:
            return None
        if n.op_type == "Transpose":
            perm = list(n.attr("perm") or [])
            r = len(perm)
            if r >= 2 and perm == list(range(r - 2)) + [r - 1, r - 2]:
                out = graph.values[n.outputs[0]].shape
                if last2 is not None and out is not None and tuple(last2[-2:]) != tuple(out[-2:]):
                    return None  # a reshape in between changed the last two dims: not K^T any more
                return n.name or n.outputs[0]
            return None
        if n.op_type not in _REPEAT:
            return None
        value = n.inputs[0]
    return None


def feeds_softmax(graph: Graph, value: str, depth: int = 4) -> bool:
    """Whether ``value`` reaches a Softmax over its last axis through :data:`_SCORE_PATH` ops only."""
    for c in graph.consumers(value):
        if c.op_type == "Softmax" and c.inputs[0] == value:
            r = graph.values[value].rank
            ax = c.attr("axis", -1)
            if ax == -1 or (r is not None and ax == r - 1):
                return True
        elif depth and c.op_type in _SCORE_PATH and any(feeds_softmax(graph, o, depth - 1) for o in c.outputs if o):
            return True
    return False


@f32_accumulate_qk.check
def _(m):
    fail = _check_f16(m)
    if fail is not None:
        return fail
    if transposed_last_two(m.graph, m["b"]) is None:
        return m.fail("B is not a Transpose swapping the last two axes (not Q x K^T)", m.node("mm"))
    if not feeds_softmax(m.graph, m.node("mm").outputs[0]):
        return m.fail("the product does not reach a Softmax over its last axis (not attention scores)", m.node("mm"))
    return None


def _promote(m, b):
    mm = m.node("mm")
    y = m.graph.values[mm.outputs[0]]
    af = b.op("Cast", [m["a"]], to=TensorProto.FLOAT, dtype=TensorProto.FLOAT, shape=m.value("a").shape)
    bf = b.op("Cast", [m["b"]], to=TensorProto.FLOAT, dtype=TensorProto.FLOAT, shape=m.value("b").shape)
    yf = b.op("MatMul", [af, bf], dtype=TensorProto.FLOAT, shape=y.shape)
    return b.op("Cast", [yf], to=TensorProto.FLOAT16, dtype=TensorProto.FLOAT16, shape=y.shape)


f32_accumulate.rewrite(_promote)
f32_accumulate_qk.rewrite(_promote)


def mode_of(ctx) -> str:
    """``ctx.options["f32acc"]["mode"]`` (default ``attention``).

    Raises:
        RewriteError: an unknown option or mode."""
    opts = dict(((getattr(ctx, "options", None) or {}).get("f32acc") or {}))
    unknown = sorted(set(opts) - {"mode"})
    if unknown:
        raise RewriteError(f"f32acc: unknown option '{unknown[0]}'; options: mode")
    mode = opts.get("mode", "attention")
    if mode not in MODES:
        raise RewriteError(f"f32acc: mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


class F32Acc(Plugin):
    """The ``f32acc`` plugin (module docstring)."""

    name = "f16-matmul-f32-accumulate"
    short = "f32acc"
    description = "f16 MatMul -> Cast to f32, MatMul, Cast back (seed A7); mode attention (Q x K^T only) | all | none"
    opset_range = (13, 28)

    @property
    def rules(self):
        return [f32_accumulate_qk, f32_accumulate]

    def run(self, graph: Graph, report: PluginReport, ctx=None, *, dry_run: bool = False) -> None:
        mode = mode_of(ctx)
        selected = {"attention": [f32_accumulate_qk], "all": [f32_accumulate], "none": []}[mode]
        apply_rules(graph, selected, self.short, report, dry_run=dry_run, ctx=ctx)

    @property
    def cases(self):
        return [
            positive("qk-fp16", _attention_model, {"f32-accumulate-qk": 1}),
            positive("qk-fp16-gqa-repeat-after-transpose", lambda: _attention_model(gqa=True), {"f32-accumulate-qk": 1}),
            positive("all-fp16", _attention_model, {"f32-accumulate": 2}, options={"f32acc": {"mode": "all"}}),
            negative("qk-fp32", lambda: _attention_model(TensorProto.FLOAT), options={"f32acc": {"mode": "all"}}),
            negative("mode-none", _attention_model, options={"f32acc": {"mode": "none"}}),
            negative("transposed-b-without-softmax", lambda: _attention_model(softmax=False)),
            bad_input("unknown-mode", _attention_model, "mode must be one of attention, all, none", options={"f32acc": {"mode": "qk"}}),
        ]


def _attention_model(dtype: int = TensorProto.FLOAT16, gqa: bool = False, softmax: bool = True) -> onnx.ModelProto:
    """scores = MatMul(q [1, 4, 3, 8], Transpose(k, perm=[0, 1, 3, 2])) * 1/sqrt(8) -> Softmax -> MatMul(., v).

    ``gqa``: k and v have 2 heads; K^T is repeated to 4 heads after the transpose (Unsqueeze, Expand, Reshape).
    ``softmax=False``: the scaled scores are the output (a transposed-B MatMul that is not attention)."""
    np_t = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    hkv = 2 if gqa else 4
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2], name="k_transpose")]
    inits = [numpy_helper.from_array(np.array(8**-0.5, np_t), "scale")]
    kt = "kt"
    if gqa:
        nodes += [helper.make_node("Unsqueeze", ["kt", "ax2"], ["kt5"], name="rep_unsqueeze"),
                  helper.make_node("Expand", ["kt5", "rep_shape"], ["kte"], name="rep_expand"),
                  helper.make_node("Reshape", ["kte", "heads_shape"], ["kt_rep"], name="rep_reshape")]
        inits += [numpy_helper.from_array(np.array([2], np.int64), "ax2"),
                  numpy_helper.from_array(np.array([1, 2, 2, 8, 5], np.int64), "rep_shape"),
                  numpy_helper.from_array(np.array([1, 4, 8, 5], np.int64), "heads_shape")]
        kt = "kt_rep"
    nodes += [helper.make_node("MatMul", ["q", kt], ["s"], name="qk"), helper.make_node("Mul", ["s", "scale"], ["ss"], name="scale")]
    outs = []
    if softmax:
        if gqa:
            nodes += [helper.make_node("Unsqueeze", ["v", "ax2"], ["v5"], name="v_unsqueeze"),
                      helper.make_node("Expand", ["v5", "v_rep_shape"], ["ve"], name="v_expand"),
                      helper.make_node("Reshape", ["ve", "v_heads_shape"], ["v4"], name="v_reshape")]
            inits += [numpy_helper.from_array(np.array([1, 2, 2, 5, 8], np.int64), "v_rep_shape"),
                      numpy_helper.from_array(np.array([1, 4, 5, 8], np.int64), "v_heads_shape")]
        else:
            nodes.append(helper.make_node("Identity", ["v"], ["v4"], name="v_identity"))
        nodes += [helper.make_node("Softmax", ["ss"], ["p"], axis=-1, name="softmax"),
                  helper.make_node("MatMul", ["p", "v4"], ["o"], name="pv")]
        outs.append(helper.make_tensor_value_info("o", dtype, [1, 4, 3, 8]))
    else:
        outs.append(helper.make_tensor_value_info("ss", dtype, [1, 4, 3, 5]))
    inputs = [helper.make_tensor_value_info("q", dtype, [1, 4, 3, 8]), helper.make_tensor_value_info("k", dtype, [1, hkv, 5, 8])]
    if softmax:
        inputs.append(helper.make_tensor_value_info("v", dtype, [1, hkv, 5, 8]))
    g = helper.make_graph(nodes, "f32acc_case", inputs, outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], producer_name="f32acc-cases")
    m.ir_version = 10
    return m
