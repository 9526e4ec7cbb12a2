"""``topk``'s ``grouped-router`` rule: routers that select on biased scores and weight with the unbiased ones
(DeepSeek-V3, GLM4-MoE and dots1: sigmoid scores, a selection bias, the ``topk_group`` best of ``n_group``
groups, ``masked_fill(-inf)``, renormalization by ``sum + 1e-20``, ``routed_scaling_factor``; Ernie 4.5: softmax
scores, a selection bias, one group, renormalization by ``clamp(sum, min)``) -> ``MoERouterTopK(mode=grouped)``.

The rule anchors on ``GatherElements(scores, TopK(choice).indices)``, reads the bias, eps, min and scale from
constants and the candidate group counts from the selection's Reshape targets and TopK k values, and checks
the candidate router alone on ONNX Runtime against :func:`rewrite.plugins.router.op.router_topk_reference`
on 2,048 random tokens (see :func:`_check_grouped`) before rewriting. The selection formula: transformers 5.24
``DeepseekV3TopkRouter.forward`` and ``Ernie4_5_MoeTopKRouter.forward``.

A ``sorted=0`` final TopK is accepted when its values are not read and neither its ids nor the weights reach a
graph output (through ops that keep their order): the op's sorted order is one of the orders ``sorted=0``
allows, so the rewritten model computes one of the results the original may compute (and the experts'
weighted sum, which reads ids and weights as pairs, is the same for every order). Refused, with the reason: a
``masked_fill`` value that could outrank a kept expert, a region the check cannot run alone, and a router no
reading reproduces (the closest reading is named).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.analysis import region_model, region_session, upstream_nodes
from rewrite.core.ir import Graph, dtype_name
from rewrite.core.pattern import AttrVar, Const, Or
from rewrite.core.rules import rule
from rewrite.plugins.router.op import _FLOATS, MAX_EXPERTS, MoERouterTopK, last_axis, router_topk_reference


@rule("grouped-router")
def grouped_router(op, logits, choice, k=Const("k")):
    """GatherElements(scores, TopK(choice).indices) with scores = Sigmoid|Softmax(logits) and ``choice``
    computed from the scores (selection bias, group-limited masking), then the weights' renormalization and
    scaling -> MoERouterTopK(mode=grouped), after a check on random logits (DeepSeek-V3, GLM4-MoE, dots1,
    Ernie 4.5)."""
    scores = Or([op.Sigmoid(logits, _name="sigmoid"), op.Softmax(logits, axis=AttrVar("sm_axis", default=-1), _name="softmax")])
    _, indices = op.TopK(choice, k, axis=AttrVar("topk_axis", default=-1), largest=AttrVar("largest", default=1),
                         sorted=AttrVar("sorted", default=1), _outputs=2, _name="topk")
    return op.GatherElements(scores, indices, axis=AttrVar("gather_axis", default=0), _name="gather"), indices


#: nodes between the scores and the final TopK's input at most (DeepSeek-V3's grouped selection is about 15)
_MAX_CHOICE_NODES = 200


@grouped_router.check
def _(m):
    g = m.graph
    topk, gather = m.node("topk"), m.node("gather")
    scores_node = m.node("sigmoid") if "sigmoid" in m else m.node("softmax")
    lv = m.value("logits")
    if lv.dtype not in _FLOATS:
        return m.fail(f"router logits '{m['logits']}' are {dtype_name(lv.dtype)}; expected FLOAT16 or FLOAT", scores_node)
    if lv.shape is None or len(lv.shape) != 2 or not isinstance(lv.shape[1], int):
        return m.fail(f"router logits '{m['logits']}' are {lv.type_str()}; expected [T, E] with a static E", scores_node)
    e = lv.shape[1]
    if e > MAX_EXPERTS:
        return m.fail(f"{e} experts; the kernel handles at most {MAX_EXPERTS}", scores_node)
    if "softmax" in m and not last_axis(m.attr("sm_axis"), 2):
        return m.fail(f"Softmax over axis {m.attr('sm_axis')}, not the expert axis", scores_node)
    if not last_axis(m.attr("topk_axis"), 2) or not last_axis(m.attr("gather_axis"), 2):
        return m.fail(f"TopK over axis {m.attr('topk_axis')}, GatherElements over axis {m.attr('gather_axis')}: not the expert axis", topk)
    if m.attr("largest") != 1:
        return m.fail("TopK largest=0 selects the smallest scores, not a router", topk)
    kc = m.const("k").reshape(-1)
    if kc.size != 1 or not 1 <= int(kc[0]) <= e:
        return m.fail(f"TopK k={kc.tolist()} is not one value in 1..{e} (the number of experts)", topk)
    cv = g.values[m["choice"]]
    if cv.shape is None or len(cv.shape) != 2 or cv.shape[1] != e or cv.dtype != TensorProto.FLOAT:
        return m.fail(f"TopK input '{m['choice']}' is {cv.type_str()}; expected float32 [T, {e}]", topk)
    chain = _weights_chain(g, gather.outputs[0])
    if m.attr("sorted") != 1 and (g.uses(topk.outputs[0]) or any(_reaches_output(g, v) for v in (topk.outputs[1], chain.out))):
        return m.fail("TopK sorted=0 whose values are read, or whose ids or weights reach a graph output: ONNX "
                      "Runtime's order is unspecified, the op's is sorted", topk)
    s_out = scores_node.outputs[0]
    region = upstream_nodes(g, [m["choice"]], {s_out, m["logits"]} | set(g.initializers), _MAX_CHOICE_NODES)
    if region is None:
        return m.fail(f"more than {_MAX_CHOICE_NODES} nodes between the scores and the TopK", topk)
    if s_out not in {i for n in region for i in n.inputs} and m["choice"] != s_out:
        return m.fail(f"TopK input '{m['choice']}' is not computed from the scores '{s_out}'", topk)
    for n in region:
        if n.domain not in ("", "ai.onnx"):
            return m.fail(f"{n.describe()} is in domain '{n.domain}'", n)
    params = _grouped_candidates(g, region, e)
    if isinstance(params, str):
        return m.fail(params, topk)
    nodes = region + [scores_node, topk, gather] + chain.nodes
    model = region_model(g, nodes, [m["logits"]], [chain.out, topk.outputs[1]])
    if isinstance(model, str):
        return m.fail(model, topk)
    found = _check_grouped(model, m["logits"], lv, int(kc[0]), "sigmoid" if "sigmoid" in m else "softmax", chain, params)
    if isinstance(found, str):
        return m.fail(found, topk)
    m.found["grouped"] = found
    m.outputs[0] = chain.out  # the match ends where the weights' renormalization and scaling end
    m.extra_nodes = region + chain.nodes
    return None


@grouped_router.rewrite
def _(m, b):
    f = m.found["grouped"]
    g = b.graph
    if g.opset(DOMAIN) is None:
        g.model_shell.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    lv, wv = m.value("logits"), g.values[m.outputs[0]]
    bias = b.const(f.pop("bias"), "selection_bias")
    k = f.pop("k")
    return list(b.op(MoERouterTopK.op_type, [m["logits"], bias], domain=DOMAIN, outputs=2, dtype=[wv.dtype, TensorProto.INT64],
                     shape=(lv.shape[0], k), k=k, mode="grouped", **f))


@dataclass
class _Chain:
    """The weights after GatherElements(scores, ids): ``out`` the last value, ``nodes`` the nodes after the
    gather, ``normalize`` 0/1 with ``norm_eps`` (added to the sum) and ``norm_min`` (the sum clamped below),
    ``scale`` the scalar it is multiplied by."""

    out: str
    nodes: list
    normalize: int = 0
    norm_eps: float = 0.0
    norm_min: float = 0.0
    scale: float = 1.0


#: ops that pass a tensor's elements on in the same order
_SAME_ORDER = frozenset({"Identity", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})


def _reaches_output(g: Graph, value: str) -> bool:
    """``value`` is a graph output, or reaches one through ops that keep its elements' order."""
    return value in g.outputs or any(n.op_type in _SAME_ORDER and _reaches_output(g, n.outputs[0]) for n in g.consumers(value))


def _scalar(g: Graph, value: str) -> float | None:
    """A float constant of rank 0 or shape [1] (broadcasting it keeps the other operand's shape)."""
    c = g.const(value) if value else None
    return float(c.reshape(-1)[0]) if c is not None and c.size == 1 and c.ndim <= 1 and c.dtype.kind == "f" else None


def _weights_chain(g: Graph, w: str) -> _Chain:
    """Follow ``w`` through ``w / (ReduceSum(w) [+ eps | Clip/Max(., min)])`` and ``* scale`` (constants), the
    spellings of transformers' ``norm_topk_prob`` (DeepSeek-V3: ``sum + 1e-20``; Ernie 4.5: ``clamp(sum,
    min)``) and ``routed_scaling_factor``."""
    chain = _Chain(w, [])
    users = g.consumers(w)
    sums = [n for n in users if n.op_type == "ReduceSum" and n.attr("keepdims", 1) == 1
            and g.const(n.inputs[1] if len(n.inputs) > 1 else "") is not None
            and g.const(n.inputs[1]).reshape(-1).tolist() in ([-1], [1])]
    if len(users) == 2 and len(sums) == 1:
        total, extra = sums[0].outputs[0], [sums[0]]
        eps = lo = 0.0
        nxt = g.consumers(total)
        if len(nxt) == 1 and nxt[0].op_type == "Add" and _scalar(g, nxt[0].inputs[1]) is not None:
            eps, total, extra = _scalar(g, nxt[0].inputs[1]), nxt[0].outputs[0], extra + nxt
            nxt = g.consumers(total)
        if len(nxt) == 1 and nxt[0].op_type in ("Clip", "Max") and nxt[0].inputs[0] == total and \
                len([i for i in nxt[0].inputs if i]) == 2 and _scalar(g, nxt[0].inputs[1]) is not None:
            lo, total, extra = _scalar(g, nxt[0].inputs[1]), nxt[0].outputs[0], extra + nxt
        div = [n for n in users if n.op_type == "Div" and n.inputs == [w, total]]
        if div and lo >= 0.0 and eps >= 0.0:
            chain = _Chain(div[0].outputs[0], extra + div, 1, eps, lo)
    users = g.consumers(chain.out)
    if len(users) == 1 and users[0].op_type == "Mul":
        other = [i for i in users[0].inputs if i != chain.out]
        scale = _scalar(g, other[0]) if len(other) == 1 else None
        if scale is not None:
            chain.out, chain.nodes, chain.scale = users[0].outputs[0], chain.nodes + users, scale
    return chain


def _grouped_candidates(g: Graph, region: list, e: int) -> dict | str:
    """Grouped mode's parameters as far as constants tell them: the selection bias (the [E] float constant an
    Add of the region reads; zeros when none), the group counts (from Reshape targets [., g, E/g]) and kept
    group counts (the region's TopK k values) to try, and the masked-fill value."""
    biases = []
    for n in region:
        if n.op_type == "Add":
            for i in n.inputs:
                c = g.const(i)
                if c is not None and c.dtype.kind == "f" and c.size == e and c.size > 1:
                    biases.append(c.reshape(-1).astype(np.float32))
    if len(biases) > 1:
        return f"{len(biases)} [E={e}] constants added in the selection; expected one selection bias"
    bias = biases[0] if biases else np.zeros(e, np.float32)
    groups = {1}
    for n in region:
        t = g.const(n.inputs[1]) if n.op_type == "Reshape" and len(n.inputs) > 1 else None
        if t is not None:
            dims = t.reshape(-1).tolist()
            groups |= {int(a) for a, b in zip(dims, dims[1:]) if a > 1 and b > 1 and a * b == e}
    kept = {int(c.reshape(-1)[0]) for n in region if n.op_type == "TopK"
            for c in [g.const(n.inputs[1])] if c is not None and c.size == 1 and 1 <= int(c.reshape(-1)[0]) <= max(groups)}
    fills = [v for n in region if n.op_type == "Where" for v in [_scalar(g, n.inputs[1]), _scalar(g, n.inputs[2])] if v is not None]
    # a masked expert must rank below every kept one: c = score + bias > min(bias) for scores in (0, 1]
    if any(v > float(bias.min()) for v in fills):
        return f"masked_fill value {max(fills)} may outrank kept experts (selection bias minimum {float(bias.min())})"
    return {"bias": bias, "groups": sorted(groups), "kept": sorted(kept | {1})}


#: tokens the grouped-router check draws at least: a reading that ignores the group limit (or keeps another
#: number of groups) agrees with the true one on most tokens when few groups are dropped
_CHECK_TOKENS = 2048


def _check_grouped(model, logits: str, lv, k: int, scoring: str, chain: _Chain, params: dict) -> dict | str:
    """Run the candidate router ``model`` (logits -> weights, ids) on ONNX Runtime (basic level) with random
    logits, at least :data:`_CHECK_TOKENS` tokens in batches of 1, 3, E + 1 and 512 (of the static count when
    the export fixed one), and return the grouped-mode attributes of the first reading whose weights and expert
    ids equal :func:`router_topk_reference`'s on every token (ids as sets: TopK ``sorted=0`` leaves their order
    open; weights within 1e-4 of the largest, float16 1e-2), or a refusal naming the closest reading. Readings
    are tried with the most groups first, so that a grouping the graph spells is preferred to the readings it
    contains (one group, every group kept)."""
    session = region_session(model, "router")
    if isinstance(session, str):
        return session
    e = lv.shape[1]
    rng = np.random.default_rng(0)
    sizes = [1, 3, e + 1] if not isinstance(lv.shape[0], int) else [lv.shape[0]] * 3
    while sum(sizes) < _CHECK_TOKENS:
        sizes.append(512 if not isinstance(lv.shape[0], int) else lv.shape[0])
    xs, ws, ids = [], [], []
    for t in sizes:
        x = (rng.standard_normal((t, e)) * 3).astype(_FLOATS[lv.dtype])
        try:
            w, i = session.run(None, {logits: x})
        except Exception as err:
            return f"the router fails on random logits: {str(err).splitlines()[0][:160]}"
        if w.shape != (t, k) or i.shape != (t, k):
            return f"the router's weights and ids are {list(w.shape)} and {list(i.shape)} for {t} tokens, expected [{t}, {k}]"
        xs.append(x), ws.append(w.astype(np.float64)), ids.append(i.astype(np.int64))
    x, w, i = np.concatenate(xs), np.concatenate(ws), np.concatenate(ids)
    order = np.argsort(i, axis=-1)
    got_i, got_w = np.take_along_axis(i, order, -1), np.take_along_axis(w, order, -1)
    tol = 1e-4 if lv.dtype == TensorProto.FLOAT else 1e-2
    attrs = dict(normalize=chain.normalize, scoring=scoring, scale=chain.scale, norm_eps=chain.norm_eps, norm_min=chain.norm_min)
    closest = (np.inf, "")
    for n_group in sorted(params["groups"], reverse=True):
        for topk_group in sorted(params["kept"], reverse=True):
            if topk_group > n_group or (n_group > 1 and e // n_group < 2) or (n_group == 1 and topk_group != 1):
                continue
            rw, ri = router_topk_reference(x, k, chain.normalize, "grouped", np.float32, bias=params["bias"], scoring=scoring,
                                           n_group=n_group, topk_group=topk_group, scale=chain.scale,
                                           norm_eps=chain.norm_eps, norm_min=chain.norm_min)
            rorder = np.argsort(ri, axis=-1)
            differ = int((np.take_along_axis(ri, rorder, -1) != got_i).any(axis=-1).sum())
            if differ:
                closest = min(closest, (np.inf, f"{n_group} groups, {topk_group} kept: other expert ids on {differ} of {len(x)} tokens"))
                continue
            ref = np.take_along_axis(rw.astype(np.float64), rorder, -1)
            err = float(np.abs(got_w - ref).max() / max(np.abs(ref).max(), 1e-6))
            if err <= tol:
                return {**attrs, "k": k, "n_group": n_group, "topk_group": topk_group, "bias": params["bias"]}
            closest = min(closest, (err, f"{n_group} groups, {topk_group} kept: weights' relative error {err:.2e}"))
    return f"no grouped-router reading reproduces the router (closest: {closest[1]})"


# ----------------------------------------------------------------------------------------------- cases
def grouped_router_model(*, e: int = 16, k: int = 4, n_group: int = 4, topk_group: int = 2, scoring: str = "sigmoid",
                          fill: float = float("-inf"), bias_shift: float = 0.0, normalize: str = "eps", scale: float = 2.5,
                          group_top: int = 2, sorted_: int = 1, tokens: int | str = "T"):
    """DeepSeek-V3's router as transformers' exporter writes it (logits [T, E] -> weights, ids), with knobs for
    the cases: ``normalize`` "eps" (sum + 1e-20), "clip" (Clip(sum, 0.5): Ernie 4.5) or "none"; ``fill`` the
    masked_fill value; ``bias_shift`` added to the selection bias; ``group_top`` the per-group top count that
    makes the group score (DeepSeek-V3: 2); ``tokens`` the logits' first dim (an int: an export fixed to it)."""
    n = helper.make_node
    rng = np.random.default_rng(1)
    bias = (rng.standard_normal(e) * 0.1 + bias_shift).astype(np.float32)
    inits = [numpy_helper.from_array(bias, "bias"), numpy_helper.from_array(np.array([k], np.int64), "k"),
             numpy_helper.from_array(np.array([-1], np.int64), "last")]
    nodes = [n("Sigmoid", ["logits"], ["scores"]) if scoring == "sigmoid" else n("Softmax", ["logits"], ["scores"], axis=1),
             n("Add", ["scores", "bias"], ["choice"])]
    choice = "choice"
    if n_group > 1:
        inits += [numpy_helper.from_array(np.array([-1, n_group, e // n_group], np.int64), "grouped_shape"),
                  numpy_helper.from_array(np.array([group_top], np.int64), "group_top"),
                  numpy_helper.from_array(np.array([topk_group], np.int64), "topk_group"),
                  numpy_helper.from_array(np.array([-1, e], np.int64), "flat_shape"),
                  numpy_helper.from_array(np.array(fill, np.float32), "fill"),
                  numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
        nodes += [
            n("Reshape", ["choice", "grouped_shape"], ["grouped"]),
            n("TopK", ["grouped", "group_top"], ["top2", "top2_i"], axis=-1, largest=1, sorted=1),
            n("ReduceSum", ["top2", "last"], ["group_scores"], keepdims=0),
            n("TopK", ["group_scores", "topk_group"], ["_g", "group_idx"], axis=-1, largest=1, sorted=sorted_),
            n("Shape", ["group_scores"], ["gs_shape"]), n("Expand", ["zero", "gs_shape"], ["zeros"]),
            n("Shape", ["group_idx"], ["gi_shape"]),
            n("ConstantOfShape", ["gi_shape"], ["ones"], value=numpy_helper.from_array(np.ones(1, np.float32))),
            n("ScatterElements", ["zeros", "group_idx", "ones"], ["group_mask"], axis=1),
            n("Unsqueeze", ["group_mask", "last"], ["gm3"]),
            n("Expand", ["gm3", "grouped_shape_pos"], ["gm_wide"]),
            n("Reshape", ["gm_wide", "flat_shape"], ["score_mask"]),
            n("Cast", ["score_mask"], ["mask_b"], to=TensorProto.BOOL), n("Not", ["mask_b"], ["masked"]),
            n("Where", ["masked", "fill", "choice"], ["masked_choice"]),
        ]
        inits.append(numpy_helper.from_array(np.array([1, n_group, e // n_group], np.int64), "grouped_shape_pos"))
        choice = "masked_choice"
    nodes += [n("TopK", [choice, "k"], ["_v", "ids"], axis=-1, largest=1, sorted=sorted_),
              n("GatherElements", ["scores", "ids"], ["w"], axis=1)]
    w = "w"
    if normalize != "none":
        nodes.append(n("ReduceSum", ["w", "last"], ["w_sum"], keepdims=1))
        if normalize == "eps":
            inits.append(numpy_helper.from_array(np.array(1e-20, np.float32), "eps"))
            nodes.append(n("Add", ["w_sum", "eps"], ["denom"]))
        else:
            inits.append(numpy_helper.from_array(np.array(0.5, np.float32), "norm_min"))
            nodes.append(n("Clip", ["w_sum", "norm_min"], ["denom"]))
        nodes.append(n("Div", ["w", "denom"], ["w_norm"]))
        w = "w_norm"
    if scale != 1.0:
        inits.append(numpy_helper.from_array(np.array(scale, np.float32), "scale"))
        nodes.append(n("Mul", [w, "scale"], ["w_scaled"]))
        w = "w_scaled"
    nodes += [n("Identity", [w], ["weights"]), n("Identity", ["ids"], ["indices"])]
    g = helper.make_graph(nodes, "grouped_router", [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [tokens, e])],
                          [helper.make_tensor_value_info("weights", TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("indices", TensorProto.INT64, None)], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
