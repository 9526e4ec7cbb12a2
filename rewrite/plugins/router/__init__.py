"""``topk``: the MoE router (scores + top-k [+ renormalization, scaling]) as one abstract op, ``MoERouterTopK``
(:mod:`rewrite.plugins.router.op`).

Forms matched (ONNX opset 13+, expert axis last):

* ``softmax-topk``: ``Softmax(logits) -> [Cast] -> TopK`` (Qwen1.5/Qwen2-MoE as transformers exports it; the
  seed form, whose f16 probabilities are Cast to f32 before TopK);
* ``softmax-topk-renorm``: the same, then ``Div(values, ReduceSum(values, axes=[-1], keepdims=1))``
  (Qwen3-MoE's ``router_top_value /= router_top_value.sum(dim=-1, keepdim=True)``, Mixtral);
* ``topk-softmax`` / ``topk-softmax-renorm``: ``TopK(logits) -> Softmax`` over the k selected logits
  (gpt-oss), optionally renormalized the same way;
* ``grouped-router`` (:mod:`rewrite.plugins.router.grouped`): routers that select on biased scores, limited to
  the best groups, and weight with the unbiased scores (DeepSeek-V3, GLM4-MoE, dots1, Ernie 4.5), checked on
  random logits before the rewrite -> ``mode=grouped``;
* ``sparsemixer-router`` (:mod:`rewrite.plugins.router.sparsemixer`): PhiMoE's router, two masked argmax rounds
  instead of a TopK, checked on random logits before the rewrite -> ``mode=sparsemixer``;
* ``topk-exact`` (tried last): any other float TopK over the last axis with ``largest=1, sorted=1`` (routers
  the forms above do not cover) -> ``mode=topk``, the k largest values and their indices, so that IREE never
  runs its own TopK on them.

Why: IREE 3.13's own lowering of the router TopK returns wrong indices inside the full models (seed 000
"TopK Extern Kernel"; located by ``rewrite verify --locate``), and its sort-based TopK costs ~216 dispatches.
On IREE the op runs as one dispatch of ``rewrite/plugins/router/kernels/router_topk.c``; on ONNX Runtime it is lowered
back to standard ONNX (a ``moe`` plugin may instead absorb it into com.microsoft MoE/QMoE).

Refused, with the reason in the report: Softmax and TopK on different axes or not on the last axis,
a grouped router whose ``masked_fill`` value could outrank a kept expert or that no reading reproduces,
``largest=0``, ``sorted=0`` (ORT's order is then unspecified), k not a constant or outside ``1..E``, a
dynamic or too large expert count, a Cast between Softmax and TopK that does not hold every value (to a
narrower float or to an integer), logits other than float16/float32, intermediate values read outside the
match (renormalized forms).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.ir import dtype_name
from rewrite.core.pattern import AttrVar, Const, Or
from rewrite.core.rules import Builder, holds_every_value_of, rule
from rewrite.plugins.base import KernelObject, Plugin
from rewrite.plugins.router.grouped import grouped_router, grouped_router_model
from rewrite.plugins.router.op import _FLOATS, MAX_EXPERTS, MoERouterTopK, last_axis
from rewrite.plugins.router.sparsemixer import sparsemixer_router, sparsemixer_router_model


# ----------------------------------------------------------------------------------------------- rules
def _topk(op, x, k):
    return op.TopK(x, k, axis=AttrVar("topk_axis", default=-1), largest=AttrVar("largest", default=1),
                   sorted=AttrVar("sorted", default=1), _outputs=2, _name="topk")


def _probs(op, logits):
    """Softmax(logits), optionally Cast (the seed form's f16 -> f32)."""
    sm = op.Softmax(logits, axis=AttrVar("sm_axis", default=-1), _name="softmax")
    return Or([op.Cast(sm, to=AttrVar("cast_to"), _name="cast"), sm])


def _renorm(op, w):
    s = op.ReduceSum(w, Const("sum_axes"), keepdims=AttrVar("keepdims", default=1), _name="sum")
    return op.Div(w, s, _name="div")


@rule("topk-exact")
def topk_exact(op, x, k=Const("k")):
    """Any other TopK over the last axis (largest=1, sorted=1) -> MoERouterTopK(mode=topk): the exact kernel on
    IREE instead of IREE's own TopK (group scores and biased selection of sigmoid routers, for one)."""
    return _topk(op, x, k)


@topk_exact.check
def _(m):
    topk, xv = m.node("topk"), m.value("x")
    if xv.dtype not in _FLOATS:
        return m.fail(f"TopK input '{m['x']}' is {dtype_name(xv.dtype)}; the kernel takes FLOAT16 or FLOAT", topk)
    if xv.shape is None or len(xv.shape) < 2 or not isinstance(xv.shape[-1], int) or xv.shape[-1] > MAX_EXPERTS:
        return m.fail(f"TopK input '{m['x']}' is {xv.type_str()}; expected rank >= 2 and a static last dim of at most {MAX_EXPERTS}", topk)
    rank, e = len(xv.shape), xv.shape[-1]
    if not last_axis(m.attr("topk_axis"), rank):
        return m.fail(f"TopK over axis {m.attr('topk_axis')} of rank {rank}, not the last", topk)
    if m.attr("largest") != 1 or m.attr("sorted") != 1:
        return m.fail(f"TopK largest={m.attr('largest')} sorted={m.attr('sorted')}; the kernel gives the largest, sorted", topk)
    kc = m.const("k").reshape(-1)
    if kc.size != 1 or not 1 <= int(kc[0]) <= e:
        return m.fail(f"TopK k={kc.tolist()} is not one value in 1..{e}", topk)
    return None


@topk_exact.rewrite
def _(m, b):
    xv = m.value("x")
    k = int(m.const("k").reshape(-1)[0])
    if b.graph.opset(DOMAIN) is None:
        b.graph.model_shell.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return list(b.op(MoERouterTopK.op_type, [m["x"]], domain=DOMAIN, outputs=2, dtype=[xv.dtype, TensorProto.INT64],
                     shape=tuple(xv.shape[:-1]) + (k,), k=k, normalize=0, mode="topk"))


@rule("softmax-topk")
def softmax_topk(op, logits, k=Const("k")):
    """Softmax -> [Cast] -> TopK over the expert axis -> MoERouterTopK(mode=softmax_topk)."""
    return _topk(op, _probs(op, logits), k)


@rule("softmax-topk-renorm")
def softmax_topk_renorm(op, logits, k=Const("k")):
    """Softmax -> [Cast] -> TopK -> values / ReduceSum(values) -> MoERouterTopK(softmax_topk, normalize=1)."""
    values, indices = _topk(op, _probs(op, logits), k)
    return _renorm(op, values), indices


@rule("topk-softmax")
def topk_softmax(op, logits, k=Const("k")):
    """TopK -> Softmax over the k logits -> MoERouterTopK(mode=topk_softmax)."""
    values, indices = _topk(op, logits, k)
    return op.Softmax(values, axis=AttrVar("sm_axis", default=-1), _name="softmax"), indices


@rule("topk-softmax-renorm")
def topk_softmax_renorm(op, logits, k=Const("k")):
    """TopK -> Softmax -> w / ReduceSum(w) -> MoERouterTopK(topk_softmax, normalize=1)."""
    values, indices = _topk(op, logits, k)
    return _renorm(op, op.Softmax(values, axis=AttrVar("sm_axis", default=-1), _name="softmax")), indices


def _check(m, mode: str, renorm: bool):
    """Shared refusals of the four rules (see the module docstring)."""
    topk = m.node("topk")
    lv = m.value("logits")
    if lv.dtype not in _FLOATS:
        return m.fail(f"router logits '{m['logits']}' are {dtype_name(lv.dtype)}; expected FLOAT16 or FLOAT", topk)
    if lv.shape is None or len(lv.shape) < 2:
        return m.fail(f"rank of router logits '{m['logits']}' is {lv.type_str()}; expected [..., T, E]", topk)
    rank, e = len(lv.shape), lv.shape[-1]
    if not isinstance(e, int):
        return m.fail(f"expert axis of '{m['logits']}' ({lv.type_str()}) is not static", topk)
    if e > MAX_EXPERTS:
        return m.fail(f"{e} experts; the kernel handles at most {MAX_EXPERTS}", topk)
    sm_axis, topk_axis = m.attr("sm_axis"), m.attr("topk_axis")
    if not last_axis(topk_axis, rank):
        return m.fail(f"TopK over axis {topk_axis} of rank {rank}: the expert axis must be the last", topk)
    if not last_axis(sm_axis, rank):
        return m.fail(f"Softmax over axis {sm_axis}, TopK over axis {topk_axis}: not the same (last) axis", m.node("softmax"))
    if m.attr("largest") != 1:
        return m.fail("TopK largest=0 selects the smallest scores, not a router", topk)
    if m.attr("sorted") != 1:
        return m.fail("TopK sorted=0: ONNX Runtime's output order is unspecified, the op's is sorted", topk)
    kc = m.const("k").reshape(-1)
    if kc.size != 1 or not 1 <= int(kc[0]) <= e:
        return m.fail(f"TopK k={kc.tolist()} is not one value in 1..{e} (the number of experts)", topk)
    if "cast" in m:
        sm_dt, to = m.value("logits").dtype, m.attr("cast_to")
        if to not in _FLOATS or not holds_every_value_of(to, sm_dt):
            return m.fail(f"Cast {dtype_name(sm_dt)}->{dtype_name(to)} between Softmax and TopK changes the probabilities", m.node("cast"))
    wdt = m.graph.values[m.outputs[0]].dtype
    if wdt not in _FLOATS:
        return m.fail(f"router weights '{m.outputs[0]}' are {dtype_name(wdt)}; expected FLOAT16 or FLOAT", topk)
    if renorm:
        axes = m.const("sum_axes").reshape(-1).tolist()
        if m.attr("keepdims") != 1 or len(axes) != 1 or not last_axis(int(axes[0]), rank):
            return m.fail(f"ReduceSum axes={axes} keepdims={m.attr('keepdims')}: not a per-token sum over the k weights", m.node("sum"))
    inner = [m.node("topk").outputs[0]] if (renorm or mode == "topk_softmax") else []
    if renorm and mode == "topk_softmax":
        inner.append(m.node("softmax").outputs[0])
    leaked = sorted(set(inner) & set(m.used_outside()))
    if leaked:
        return m.fail(f"'{leaked[0]}' is also read outside the router pattern", topk)
    return None


def _emit(m, b: Builder, mode: str, normalize: int) -> list[str]:
    lv = m.value("logits")
    k = int(m.const("k").reshape(-1)[0])
    graph = b.graph
    if graph.opset(DOMAIN) is None:
        graph.model_shell.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    wdt = graph.values[m.outputs[0]].dtype
    w, i = b.op(MoERouterTopK.op_type, [m["logits"]], domain=DOMAIN, outputs=2, dtype=[wdt, TensorProto.INT64],
                shape=tuple(lv.shape[:-1]) + (k,), k=k, normalize=normalize, mode=mode)
    return [w, i]


for _r, _mode, _renorm_ in ((softmax_topk, "softmax_topk", False), (softmax_topk_renorm, "softmax_topk", True),
                            (topk_softmax, "topk_softmax", False), (topk_softmax_renorm, "topk_softmax", True)):
    _r.check(lambda m, mode=_mode, rn=_renorm_: _check(m, mode, rn))
    _r.rewrite(lambda m, b, mode=_mode, rn=_renorm_: _emit(m, b, mode, int(rn)))


class RouterTopK(Plugin):
    """The ``topk`` plugin: MoE router subgraphs -> ``ai.rewrite::MoERouterTopK`` (see the module docstring)."""

    name = "router-topk"
    short = "topk"
    takes_options = False
    description = ("Softmax->[Cast]->TopK [->renormalize], TopK->Softmax, grouped (biased, group-limited) and sparsemixer "
                   "(PhiMoE) routers -> one MoERouterTopK op (C kernel on IREE, built with nvcc for CUDA)")
    opset_range = (13, 28)
    kernels = (KernelObject("router_topk", "iree", "llvm-cpu", "kernels/router_topk.c"),)

    @property
    def rules(self):
        return [grouped_router, sparsemixer_router, softmax_topk_renorm, softmax_topk, topk_softmax_renorm, topk_softmax,
                topk_exact]

    @property
    def abstract_ops(self):
        return [MoERouterTopK()]

    @property
    def cases(self):
        return _cases()


# ----------------------------------------------------------------------------------------------- cases
def _router_model(form: str, *, e: int = 8, k: int = 2, dtype: int = TensorProto.FLOAT, cast_to: int | None = None,
                  sm_axis: int = -1, topk_axis: int = -1, largest: int = 1, sorted_: int = 1, renorm: bool = False,
                  lead: tuple = ("T",), values_out: bool = False):
    """A one-router model: logits [*lead, E] -> (weights, indices) graph outputs, in ``form`` softmax_topk|topk_softmax;
    ``values_out`` also outputs the TopK values (read outside a renormalized pattern)."""
    n = helper.make_node
    nodes, x = [], "logits"
    topk_attrs = dict(axis=topk_axis, largest=largest, sorted=sorted_)
    if form == "softmax_topk":
        nodes.append(n("Softmax", [x], ["probs"], axis=sm_axis))
        x = "probs"
        if cast_to is not None:
            nodes.append(n("Cast", [x], ["probs_cast"], to=cast_to))
            x = "probs_cast"
        nodes.append(n("TopK", [x, "k"], ["values", "indices"], **topk_attrs))
        w = "values"
        if values_out:
            nodes.append(n("Identity", ["values"], ["raw_values"]))
    else:
        nodes.append(n("TopK", [x, "k"], ["top_logits", "indices"], **topk_attrs))
        nodes.append(n("Softmax", ["top_logits"], ["values"], axis=sm_axis))
        w = "values"
    if renorm:
        nodes += [n("ReduceSum", [w, "sum_axes"], ["sum"], keepdims=1), n("Div", [w, "sum"], ["normed"])]
        w = "normed"
    nodes.append(n("Identity", [w], ["weights"]))
    wdt = cast_to if (cast_to is not None and form == "softmax_topk") else dtype
    shape = list(lead) + [e]
    inits = [helper.make_tensor("k", TensorProto.INT64, [1], [k])]
    if renorm:
        inits.append(helper.make_tensor("sum_axes", TensorProto.INT64, [1], [-1]))
    outs = [helper.make_tensor_value_info("weights", wdt, None), helper.make_tensor_value_info("indices", TensorProto.INT64, None)]
    if values_out:
        outs.append(helper.make_tensor_value_info("raw_values", wdt, None))
    g = helper.make_graph(nodes, "router", [helper.make_tensor_value_info("logits", dtype, shape)], outs, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _separated_feeds(model) -> dict[str, np.ndarray]:
    """Logits whose scores differ by at least 0.25 per row, so float16 rounding cannot create ties."""
    from rewrite.core.feeds import specs_of

    (spec,) = specs_of(model.graph.input)
    shape = [d if isinstance(d, int) else 5 for d in spec.shape]
    rng = np.random.default_rng(0)
    base = rng.permuted(np.broadcast_to(np.arange(shape[-1], dtype=np.float64), shape), axis=-1)
    return {"logits": (0.25 * base - 1.0).astype(_FLOATS[model.graph.input[0].type.tensor_type.elem_type])}


def _cases() -> list:
    from rewrite.core.cases import negative, positive

    F, H, I32 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT32
    pos = [
        ("qwen2-softmax-topk", dict(form="softmax_topk"), "softmax-topk"),
        ("seed-f16-softmax-cast-f32-topk", dict(form="softmax_topk", dtype=H, cast_to=F, e=60, k=4), "softmax-topk"),
        ("f16-softmax-topk", dict(form="softmax_topk", dtype=H, e=16, k=4), "softmax-topk"),
        ("qwen3-softmax-topk-renorm", dict(form="softmax_topk", renorm=True, e=16, k=8), "softmax-topk-renorm"),
        ("gptoss-topk-softmax", dict(form="topk_softmax", e=32, k=4), "topk-softmax"),
        ("topk-softmax-renorm", dict(form="topk_softmax", renorm=True), "topk-softmax-renorm"),
        ("rank3-logits", dict(form="softmax_topk", lead=("B", "S")), "softmax-topk"),
        # renormalization refused (its input is read outside), the plain router still replaced
        ("values-read-outside-keep-renorm", dict(form="softmax_topk", renorm=True, values_out=True), "softmax-topk"),
        # not a router: the TopK alone is still replaced by the exact kernel
        ("softmax-on-another-axis-plain-topk", dict(form="softmax_topk", sm_axis=0), "topk-exact"),
        ("lossy-cast-f32-to-f16-plain-topk", dict(form="softmax_topk", cast_to=H), "topk-exact"),
    ]
    neg = [
        ("topk-not-on-last-axis", dict(form="softmax_topk", sm_axis=0, topk_axis=0)),
        ("largest-0", dict(form="softmax_topk", largest=0)),
        ("sorted-0", dict(form="softmax_topk", sorted_=0)),
        ("k-larger-than-experts", dict(form="softmax_topk", e=8, k=9)),
        ("too-many-experts-for-the-kernel", dict(form="softmax_topk", e=MAX_EXPERTS + 1)),
        ("cast-to-integer", dict(form="softmax_topk", cast_to=I32)),
    ]
    grouped = [
        ("deepseek-v3-grouped-sigmoid", dict(), {"grouped-router": 1}),

        ("glm4-no-renorm-no-scale", dict(normalize="none", scale=1.0), {"grouped-router": 1}),
        ("ernie-softmax-bias-clamped-renorm", dict(n_group=1, scoring="softmax", normalize="clip", scale=1.0, k=2), {"grouped-router": 1}),
        ("groups-of-two-keep-three", dict(e=12, n_group=6, topk_group=3, k=3), {"grouped-router": 1}),
        # refused (the plain TopKs are still replaced by the exact kernel, sorted ones only): a masked_fill of 0
        # under a negative selection bias lets masked experts outrank kept ones; a group score of the top 3
        ("fill-zero-under-negative-bias-plain-topk", dict(fill=0.0, bias_shift=-2.0), {"topk-exact": 3}),
        ("group-score-of-top-3-plain-topk", dict(group_top=3), {"topk-exact": 3}),
    ]
    out = [positive(name, (lambda kw=kw: _router_model(**kw)), {rule_name: 1}, feeds=_separated_feeds) for name, kw, rule_name in pos]
    out += [positive(name, (lambda kw=kw: grouped_router_model(**kw)), counts) for name, kw, counts in grouped]
    # sorted=0 leaves ORT's order open: fused only where nothing reads the order (the sum over the experts);
    # ONNX Runtime only (IREE 3.13 cannot compile a TopK with sorted=0)
    out.append(positive("unsorted-ids-are-graph-outputs-plain-topk", lambda: grouped_router_model(sorted_=0),
                        {"topk-exact": 1}, backends=("ort",)))
    out += [negative(name, (lambda kw=kw: _router_model(**kw))) for name, kw in neg]
    sparsemixer = [
        ("phimoe-sparsemixer", dict(), {"sparsemixer-router": 1}),
        ("phimoe-sparsemixer-f16", dict(dtype=TensorProto.FLOAT16, e=8), {"sparsemixer-router": 1}),
        ("phimoe-sparsemixer-jitter-0.1", dict(eps=0.1, e=6), {"sparsemixer-router": 1}),
    ]
    out += [positive(name, (lambda kw=kw: sparsemixer_router_model(**kw)), counts) for name, kw, counts in sparsemixer]
    # other routers: a second round with another threshold; the last of equal maxima
    out += [negative(name, (lambda kw=kw: sparsemixer_router_model(**kw))) for name, kw in
            (("sparsemixer-rounds-with-two-thresholds", dict(second_eps=0.05)),
             ("sparsemixer-argmax-last-index", dict(select_last_index=1)))]
    return out
