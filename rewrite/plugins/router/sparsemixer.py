"""``topk``'s ``sparsemixer-router`` rule: PhiMoE's router (two masked argmax rounds) -> ``MoERouterTopK(mode=
sparsemixer)``.

PhiMoE does not select with TopK: transformers 5.24 ``sparsemixer`` (inference branch) takes the argmax, masks
the experts whose relative distance to it exceeds ``2 * router_jitter_noise``, weights the argmax by the softmax
of what is left, then repeats once with the first expert removed (formula: :func:`rewrite.plugins.router.op.
router_topk_reference`). The exporters write it as ``Concat(GatherElements(Softmax(Where(..)), ArgMax(logits)),
GatherElements(Softmax(Where(..)), ArgMax(ScatterElements(logits, .., -inf))))`` for the weights and
``Concat(ArgMax, ArgMax)`` for the ids, with the mask spelled through ReduceMax, Abs, Max, Sub, Div and Greater.

The rule anchors on the two Concats, reads the candidate thresholds from the region's comparisons with a scalar
constant, and checks the candidate router alone on ONNX Runtime against the reference on random logits (many
tokens with experts near the threshold) before rewriting. Refused, with the reason: axes other than the last,
ArgMax keeping no dim or picking the last of equal maxima, a region the check cannot run alone, and a router no
threshold reproduces.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.analysis import region_model, region_session, upstream_nodes
from rewrite.core.ir import dtype_name
from rewrite.core.pattern import AttrVar
from rewrite.core.rules import rule
from rewrite.plugins.router.op import _FLOATS, MAX_EXPERTS, MoERouterTopK, last_axis, router_topk_reference


def _argmax(op, x, name: str):
    return op.ArgMax(x, axis=AttrVar(f"{name}_axis", default=0), keepdims=AttrVar(f"{name}_keepdims", default=1),
                     select_last_index=AttrVar(f"{name}_last", default=0), _name=name)


def _weight(op, masked, ids, n: int):
    probs = op.Softmax(masked, axis=AttrVar(f"sm{n}_axis", default=-1), _name=f"softmax{n}")
    return op.GatherElements(probs, ids, axis=AttrVar(f"gather{n}_axis", default=0), _name=f"gather{n}")


@rule("sparsemixer-router")
def sparsemixer_router(op, logits, masked1, masked2, second):
    """Concat(weight of ArgMax(logits), weight of ArgMax(second)), Concat(the two ArgMax) with each weight a
    GatherElements of a Softmax over masked scores -> MoERouterTopK(mode=sparsemixer, k=2), after a check on
    random logits (PhiMoE)."""
    i1, i2 = _argmax(op, logits, "argmax1"), _argmax(op, second, "argmax2")
    weights = op.Concat(_weight(op, masked1, i1, 1), _weight(op, masked2, i2, 2), axis=AttrVar("wcat_axis"), _name="wcat")
    return weights, op.Concat(i1, i2, axis=AttrVar("icat_axis"), _name="icat")


#: nodes between the logits and the masked scores at most (PhiMoE's two rounds are about 20)
_MAX_REGION_NODES = 60
#: tokens of the check: a third of them draw logits whose experts sit near the threshold
_CHECK_TOKENS = 3072
_COMPARISONS = ("Greater", "Less", "GreaterOrEqual", "LessOrEqual")


@sparsemixer_router.check
def _(m):
    g = m.graph
    wcat = m.node("wcat")
    lv = m.value("logits")
    if lv.dtype not in _FLOATS:
        return m.fail(f"router logits '{m['logits']}' are {dtype_name(lv.dtype)}; expected FLOAT16 or FLOAT", wcat)
    if lv.shape is None or len(lv.shape) != 2 or not isinstance(lv.shape[-1], int):
        return m.fail(f"router logits '{m['logits']}' are {lv.type_str()}; expected [T, E] with a static E", wcat)
    rank, e = 2, lv.shape[-1]
    if not 2 <= e <= MAX_EXPERTS:
        return m.fail(f"{e} experts; sparsemixer needs 2 to {MAX_EXPERTS}", wcat)
    for name in ("argmax1_axis", "argmax2_axis", "sm1_axis", "sm2_axis", "gather1_axis", "gather2_axis", "wcat_axis", "icat_axis"):
        if not last_axis(m.attr(name), rank):
            return m.fail(f"{name.split('_')[0]} over axis {m.attr(name)} of rank {rank}, not the expert axis", wcat)
    for name in ("argmax1", "argmax2"):
        if m.attr(f"{name}_keepdims") != 1 or m.attr(f"{name}_last") != 0:
            return m.fail(f"ArgMax keepdims={m.attr(f'{name}_keepdims')} select_last_index={m.attr(f'{name}_last')}; "
                          "expected 1 and 0 (one id per token, the first of equal maxima)", m.node(name))
    wdt = g.values[wcat.outputs[0]].dtype
    if wdt not in _FLOATS:
        return m.fail(f"router weights '{wcat.outputs[0]}' are {dtype_name(wdt)}; expected FLOAT16 or FLOAT", wcat)
    starts = [m["masked1"], m["masked2"], m["second"]]
    region = upstream_nodes(g, starts, {m["logits"]} | set(g.initializers), _MAX_REGION_NODES)
    if region is None:
        return m.fail(f"more than {_MAX_REGION_NODES} nodes between the logits and the masked scores", wcat)
    for n in region:
        if n.domain not in ("", "ai.onnx"):
            return m.fail(f"{n.describe()} is in domain '{n.domain}'", n)
    thresholds = sorted({float(c.reshape(-1)[0]) for n in region if n.op_type in _COMPARISONS
                         for i in n.inputs for c in [g.const(i) if i else None]
                         if c is not None and c.size == 1 and c.dtype.kind == "f"})
    if not thresholds:
        return m.fail("no comparison with a scalar constant between the logits and the masked scores (no sparsemixer threshold)", wcat)
    matched = [m.node(n) for n in ("argmax1", "argmax2", "softmax1", "softmax2", "gather1", "gather2", "wcat", "icat")]
    in_region = {n.id for n in region}
    model = region_model(g, region + [n for n in matched if n.id not in in_region], [m["logits"]], [wcat.outputs[0], m.node("icat").outputs[0]])
    if isinstance(model, str):
        return m.fail(model, wcat)
    found = _check(model, m["logits"], lv, thresholds)
    if isinstance(found, str):
        return m.fail(found, wcat)
    m.found["jitter_eps"] = found
    m.extra_nodes = region
    return None


@sparsemixer_router.rewrite
def _(m, b):
    g = b.graph
    if g.opset(DOMAIN) is None:
        g.model_shell.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    lv, wv = m.value("logits"), g.values[m.outputs[0]]
    return list(b.op(MoERouterTopK.op_type, [m["logits"]], domain=DOMAIN, outputs=2, dtype=[wv.dtype, TensorProto.INT64],
                     shape=tuple(lv.shape[:-1]) + (2,), k=2, normalize=0, mode="sparsemixer",
                     jitter_eps=m.found["jitter_eps"]))


def check_logits(rng: np.random.Generator, tokens: int, e: int, dtype) -> np.ndarray:
    """Random [tokens, e] logits for the check: a third plain (normal x 3), a third with experts within a few
    percent of the maximum (where the mask decides), a third with a negative maximum."""
    third = tokens // 3
    plain = rng.standard_normal((tokens - 2 * third, e)) * 3
    top = np.abs(rng.standard_normal((third, 1))) * 3 + 0.5
    near = top * (1 - np.abs(rng.standard_normal((third, e))) * 0.03)
    low = -np.abs(rng.standard_normal((third, 1))) * 3 - 0.5
    negative = low * (1 + np.abs(rng.standard_normal((third, e))) * 0.03)
    x = np.concatenate([plain, near, negative])
    return rng.permuted(x, axis=-1).astype(dtype)


def _check(model, logits: str, lv, thresholds: list[float]) -> float | str:
    """Run the candidate router (logits [T, E]) on ONNX Runtime (basic level) on :func:`check_logits` in batches
    of 512 tokens (of T when the export fixed it) and return the ``jitter_eps`` (half a threshold of the region) whose
    reference gives the same ids on every token and weights within 1e-4 (float16: 1e-2) of the largest, or a
    refusal naming the closest reading."""
    session = region_session(model, "router")
    if isinstance(session, str):
        return session
    t, e = lv.shape
    rng = np.random.default_rng(0)
    xs, ws, ids = [], [], []
    while sum(len(x) for x in xs) < _CHECK_TOKENS:
        x = check_logits(rng, t if isinstance(t, int) else 512, e, _FLOATS[lv.dtype])
        try:
            w, i = session.run(None, {logits: x})
        except Exception as err:  # ORT's own exception types
            return f"the router fails on random logits: {str(err).splitlines()[0][:160]}"
        if w.shape != (len(x), 2) or i.shape != (len(x), 2):
            return f"the router's weights and ids are {list(w.shape)} and {list(i.shape)} for {len(x)} tokens, expected [{len(x)}, 2]"
        xs.append(x), ws.append(w.astype(np.float64)), ids.append(i.astype(np.int64))
    x, w, i = np.concatenate(xs), np.concatenate(ws), np.concatenate(ids)
    tol = 1e-4 if lv.dtype == TensorProto.FLOAT else 1e-2
    closest = (np.inf, "")
    for thr in thresholds:
        eps = thr / 2
        rw, ri = router_topk_reference(x, 2, 0, "sparsemixer", np.float32, jitter_eps=eps)
        differ = int((ri != i).any(axis=-1).sum())
        if differ:
            closest = min(closest, (np.inf, f"threshold {thr:g}: other expert ids on {differ} of {len(x)} tokens"))
            continue
        err = float(np.abs(w - rw).max() / max(float(np.abs(rw).max()), 1e-6))
        if err <= tol:
            return eps
        closest = min(closest, (err, f"threshold {thr:g}: weights' relative error {err:.2e}"))
    return f"no sparsemixer reading reproduces the router (closest: {closest[1]})"


# ----------------------------------------------------------------------------------------------- cases
def sparsemixer_router_model(*, e: int = 16, eps: float = 0.01, dtype: int = TensorProto.FLOAT, second_eps: float | None = None,
                             select_last_index: int = 0, tokens: int | str = "T"):
    """PhiMoE's router as transformers' exporter writes it (logits [T, E] -> weights [T, 2], ids [T, 2]), with
    knobs for the cases: ``eps`` the jitter (threshold ``2 * eps``); ``second_eps`` another jitter for the second
    round (another router); ``select_last_index`` of both ArgMax."""
    n = helper.make_node
    np_t = _FLOATS[dtype]
    inits = [numpy_helper.from_array(np.array([-1], np.int64), "axes"),
             numpy_helper.from_array(np.asarray(2 * eps, np_t), "thr"),
             numpy_helper.from_array(np.asarray(2 * (eps if second_eps is None else second_eps), np_t), "thr2"),
             numpy_helper.from_array(np.asarray(-np.inf, np_t), "neg_inf")]
    nodes = [
        n("ReduceMax", ["logits", "axes"], ["m1"], keepdims=1),
        n("ArgMax", ["logits"], ["i1"], axis=-1, keepdims=1, select_last_index=select_last_index),
        n("Abs", ["logits"], ["mag"]),
        n("Max", ["mag", "m1"], ["f1"]), n("Sub", ["m1", "logits"], ["d1"]), n("Div", ["d1", "f1"], ["r1"]),
        n("Greater", ["r1", "thr"], ["mask1"]), n("Where", ["mask1", "neg_inf", "logits"], ["z1"]),
        n("Softmax", ["z1"], ["p1"], axis=-1), n("GatherElements", ["p1", "i1"], ["w1"], axis=-1),
        n("Shape", ["i1"], ["i1_shape"]),
        n("Expand", ["neg_inf", "i1_shape"], ["fill_inf"]),
        n("ScatterElements", ["logits", "i1", "fill_inf"], ["x2"], axis=-1),
        n("ReduceMax", ["x2", "axes"], ["m2"], keepdims=1),
        n("ArgMax", ["x2"], ["i2"], axis=-1, keepdims=1, select_last_index=select_last_index),
    ]
    nodes += [
        n("Max", ["mag", "m2"], ["f2"]), n("Sub", ["m2", "logits"], ["d2"]), n("Div", ["d2", "f2"], ["r2"]),
        n("Greater", ["r2", "thr2"], ["mask2"]), n("Where", ["mask2", "neg_inf", "x2"], ["z2"]),
        n("Softmax", ["z2"], ["p2"], axis=-1), n("GatherElements", ["p2", "i2"], ["w2"], axis=-1),
        n("Concat", ["w1", "w2"], ["weights"], axis=-1), n("Concat", ["i1", "i2"], ["indices"], axis=-1),
    ]
    g = helper.make_graph(nodes, "sparsemixer_router", [helper.make_tensor_value_info("logits", dtype, [tokens, e])],
                          [helper.make_tensor_value_info("weights", dtype, None),
                           helper.make_tensor_value_info("indices", TensorProto.INT64, None)], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
