"""Routed experts recognized by what they compute, for spellings no structural pattern covers.

transformers' default experts implementation (``grouped_mm``) exports the routed experts as a sort of the
(token, expert) pairs by expert, one MatMul per expert on its slice of the sorted tokens, a Concat, and an
inverse permutation; the number of nodes grows with the number of experts. Instead of a pattern per spelling,
:func:`prove_fused_moe` takes the region that ends at the per-token sum over the k selected experts
(``ReduceSum(Reshape(pairs, [T, k, H]), axes=[1])``, or JetMoE's index-add of the expert outputs into the token
rows, ``ScatterND(zeros [T, H], token ids, pairs, reduction="add")``) and

1. finds the router nearest the sum: a TopK (``largest=1``) over ``Softmax(logits)`` or over ``logits``, or
   ``topk``'s ``MoERouterTopK`` (whose routing is then known), with ``logits = MatMul/Gemm(hidden, W)``;
   when that router does not explain the region (sigmoid scores, selection biases, grouped top-k, scaling
   factors: DeepSeek-V3, GLM4-MoE, dots1, Ernie 4.5; routers with biases: gpt-oss), the *routed* cut instead:
   the float [T, k] mixing weights and the integer [T, k] expert ids nearest the sum, and the ``hidden`` the
   router's MatMul/Gemm reads above the ids. The router then stays in the graph as it is;
2. collects the region: every node between the cut (``hidden``, and ``logits`` or the weights and ids) and
   the sum (it may read graph inputs only through ``Shape``), its stacked expert weights (rank-3
   initializers with E as the first dim; for a sum of one term per expert, optimum's loop over the experts,
   each expert's three 2-D MatMul weights, :func:`expert_stacks`) and expert biases (rank 2, or [E, 1, N],
   E first);
3. refuses regions that compare, clamp or round float data (thresholds random inputs may never reach;
   rounding floats cast from integers, an exporter's integer division, is exact and allowed), except a SwiGLU
   clamp: ``Clip``/``Min``/``Max`` with constant bounds of one magnitude ``limit``, accepted
   only when the draws reach it (the reading with the clamp differs from the one without); refuses ops of
   other domains; runs the region alone on ONNX Runtime (basic level) with random inputs at the cut (routed:
   weights in [0.05, 1], k distinct experts per token) for T = 1, 3 and E + 1 tokens and once with
   activations 30 times larger, and compares it with `FusedMoE.reference` under each reading of the weights
   (gate/up stack [E, 2I, H] or its transpose, gate and up concatenated or interleaved; down [E, H, I] or its
   transpose; biases in the gate/up reading's order), of the routing (softmax then top-k, renormalized or not;
   top-k then softmax; routed) and of the SwiGLU (``alpha`` from the region's scalar Mul constants, ``beta``
   from its scalar Add constants, seed 003 section 8).

The first reading that reproduces the region within the dtype's tolerance (float32 1e-4, float16 1e-2,
relative to the largest output) on every draw is the match; if none does, the region is refused with the
closest reading's error. This is a numerical check on random inputs, not a proof ("proved" below means
passed this check): it is how candidates that structure alone cannot establish are checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.analysis import region_model, region_session, upstream_nodes
from rewrite.core.feeds import make_feeds, specs_of
from rewrite.core.ir import Graph, Node
from rewrite.plugins.moe.lowering import FusedMoE
from rewrite.plugins.router.op import router_topk_reference

#: the region may not be larger than this many nodes (grouped_mm with 128 experts is about 1,000; optimum's loop
#: over Qwen3-30B-A3B's 128 experts, one module each, about 40 nodes an expert)
MAX_REGION_NODES = 12000
#: ops that compare, clamp or round: on float data they make thresholds random inputs may never reach (a
#: clamped SwiGLU, capacity limits), so a region applying them to floats is refused, not checked
_THRESHOLD_OPS = frozenset({"Clip", "Min", "Max", "Relu", "LeakyRelu", "ThresholdedRelu", "Less", "LessOrEqual",
                            "Greater", "GreaterOrEqual", "Equal", "Abs", "Sign", "Floor", "Ceil", "Round", "IsInf",
                            "IsNaN", "Mod", "HardSigmoid", "HardSwish", "Shrink"})
#: FusedMoE's kernels take at most this many experts per token (rewrite/plugins/moe/kernels/moe_cpu.c MAX_K)
MAX_K = 64
#: relative tolerance of the numerical check by hidden dtype
TOLERANCE = {TensorProto.FLOAT: 1e-4, TensorProto.FLOAT16: 1e-2, TensorProto.BFLOAT16: 1e-2}
_ROUTINGS = (("softmax_topk", 0), ("softmax_topk", 1), ("topk_softmax", 0))
#: threshold ops a SwiGLU clamp is spelled with
_CLAMP_OPS = frozenset({"Clip", "Min", "Max"})
#: rounding ops exporters spell integer division with on floats cast from integers (JetMoE's ``index // k``:
#: ``Mul(Floor(Abs(Div(Cast(i), k))), Sign(.))``): exact on such data, so checked like any other op
_ROUNDING_OPS = frozenset({"Abs", "Sign", "Floor", "Ceil", "Round", "Mod"})


@dataclass
class Proven:
    """A region proved equal to FusedMoE: the attributes and float32 weights of the fused op.

    Attributes:
        hidden: the [T, H] value the experts read; logits: the router's [T, E] output.
        fc1: gate and up stacked [E, 2I, H] (gate rows first); fc2: down [E, H, I].
        k, normalize, mode: FusedMoE's routing attributes (mode ``routed``: ``logits`` is the [T, k] mixing
            weights and ``ids`` the [T, k] expert ids).
        region: the nodes between hidden/logits (or the fused router's outputs) and the sum, removed when unused
            after the rewrite.
        error: the largest relative error of the accepted reading over the draws.
        ids: the expert ids (routed only); b1 [E, 2I] / b2 [E, H]: float32 expert biases or None;
        alpha, beta, limit: the SwiGLU's (FusedMoE ``activation_alpha``, ``activation_beta``, ``swiglu_limit``).
    """

    hidden: str
    logits: str
    fc1: np.ndarray
    fc2: np.ndarray
    k: int
    normalize: int
    mode: str
    region: list[Node]
    error: float
    ids: str = ""
    b1: np.ndarray | None = None
    b2: np.ndarray | None = None
    alpha: float = 1.0
    beta: float = 0.0
    limit: float = 0.0


def _through_casts(graph: Graph, value: str) -> str:
    node = graph.producer_node(value)
    while node is not None and node.op_type in ("Cast", "Identity"):
        value = node.inputs[0]
        node = graph.producer_node(value)
    return value


@dataclass
class Router:
    """The router above a sum: ``node`` (a TopK, or ``topk``'s MoERouterTopK whose routing is then known),
    the ``logits`` [T, E] it scores, the ``hidden`` [T, H] they come from, and E."""

    node: Node
    logits: str
    hidden: str
    experts: int

    @property
    def fused(self) -> bool:
        return self.node.domain == DOMAIN


def find_router(graph: Graph, nearest_first: list[Node]) -> Router | str:
    """The router nearest the sum (``nearest_first`` is breadth-first from it): a TopK over ``[Cast] Softmax(
    [Cast] MatMul/Gemm(hidden, W))`` or ``MatMul/Gemm(hidden, W)`` with a constant 2-D ``W``, or an
    ``ai.rewrite::MoERouterTopK`` over such logits; else a refusal. (grouped_mm's sort of the expert ids is
    also a TopK; its input is not a router's.)"""
    for node in nearest_first:
        fused = node.op_type == "MoERouterTopK" and node.domain == DOMAIN
        if (node.op_type != "TopK" and not fused) or (fused and node.attr("mode") in ("topk", "grouped", "sparsemixer")):
            continue  # (topk's plain TopK, grouped and sparsemixer routers: the routed cut takes their weights and ids)
        src = _through_casts(graph, node.inputs[0])
        producer = graph.producer_node(src)
        if not fused and producer is not None and producer.op_type == "Softmax":
            src = _through_casts(graph, producer.inputs[0])
            producer = graph.producer_node(src)
        if producer is None or producer.op_type not in ("MatMul", "Gemm"):
            continue
        weight = graph.const(producer.inputs[1])
        hidden = producer.inputs[0]
        hv, lv = graph.values[hidden], graph.values[src]
        if weight is None or weight.ndim != 2 or hv.rank != 2 or lv.rank != 2 or not isinstance(lv.shape[1], int):
            continue
        if not fused and node.attr("largest", 1) != 1:
            return f"router TopK {node.describe()} selects the smallest scores"
        return Router(node, src, hidden, int(lv.shape[1]))
    return "no router (TopK over Softmax(MatMul(hidden, W)) or MatMul(hidden, W)) above the sum"


def aliases(graph: Graph, value: str) -> list[str]:
    """``value`` and the values it is a same-shaped Reshape / Identity of (exporters flatten the hidden state
    once for the router and once for the experts), then the [B, S, H] value the last of them is a Reshape of,
    when there is one (TorchScript's exports read its shape for the output's zeros); the check feeds it as
    [1, T, H]."""
    out = [value]
    node = graph.producer_node(value)
    shape = graph.values[value].shape
    while (node is not None and node.op_type in ("Reshape", "Identity") and shape is not None
           and all(isinstance(d, int) or isinstance(d, str) for d in shape) and graph.values[node.inputs[0]].shape == shape):
        out.append(node.inputs[0])
        node = graph.producer_node(node.inputs[0])
    if node is not None and node.op_type == "Reshape" and shape is not None and len(shape) == 2 and isinstance(shape[1], int):
        src = graph.values[node.inputs[0]].shape
        if src is not None and len(src) == 3 and src[2] == shape[1]:
            out.append(node.inputs[0])
    return out


def _readings(weights: list[np.ndarray], biases: list[np.ndarray], H: int):
    """(fc1 [E, 2I, H], fc2 [E, H, I], b1 [E, 2I] | None, b2 [E, H] | None, description) for every reading of
    two stacked weights and the rank-2 biases (none; one, of width 2I or H; or one of each width)."""
    for a, b in ((0, 1), (1, 0)):
        for fc1_layout, fc1 in (("out-in", weights[a]), ("in-out", weights[a].transpose(0, 2, 1))):
            if fc1.shape[2] != H or fc1.shape[1] % 2:
                continue
            I = fc1.shape[1] // 2
            for fc2_layout, fc2 in (("out-in", weights[b]), ("in-out", weights[b].transpose(0, 2, 1))):
                if fc2.shape[1:] != (H, I):
                    continue
                if len(biases) == 2:
                    pairs = [(x, y) for ix, x in enumerate(biases) for iy, y in enumerate(biases)
                             if ix != iy and x.shape[1] == 2 * I and y.shape[1] == H]
                elif biases:
                    pairs = [p for p in ((biases[0], None), (None, biases[0]))
                             if (p[0] if p[0] is not None else p[1]).shape[1] == (2 * I if p[0] is not None else H)]
                else:
                    pairs = [(None, None)]
                for b1, b2 in pairs:
                    yield fc1, fc2, b1, b2, f"gate/up {fc1_layout} concatenated, down {fc2_layout}"
                    yield (np.concatenate([fc1[:, 0::2], fc1[:, 1::2]], axis=1), fc2,
                           None if b1 is None else np.concatenate([b1[:, 0::2], b1[:, 1::2]], axis=1), b2,
                           f"gate/up {fc1_layout} interleaved, down {fc2_layout}")


@dataclass
class Routed:
    """The routed cut above a sum: mixing ``weights`` and expert ``ids`` [T, k], the ``hidden`` [T, H] the
    router reads, E."""

    weights: str
    ids: str
    hidden: str
    experts: int


def find_routed(graph: Graph, nearest_first: list[Node], sum_node: Node, k: int) -> Routed | str:
    """The float and the integer [T, k] values nearest the sum (T the sum's first dim), and above the ids the
    nearest MatMul/Gemm with a constant [H, E] (or Gemm ``transB`` [E, H]) weight reading a [T, H] value."""
    out = graph.values[sum_node.outputs[0]]
    if out.shape is None or len(out.shape) != 2:
        return f"the sum's output '{sum_node.outputs[0]}' is {out.type_str()}, not [T, H]"
    T, H = out.shape

    def is_tk(v: str, floats: bool) -> bool:
        val = graph.values.get(v)
        if val is None or val.shape is None or len(val.shape) != 2 or val.shape[1] != k or val.shape[0] != T:
            return False
        return (val.dtype in TOLERANCE) if floats else val.dtype in (TensorProto.INT64, TensorProto.INT32)

    weights = ids = None
    for n in nearest_first:
        for o in n.outputs:
            if o and weights is None and is_tk(o, True):
                weights = o
            if o and ids is None and is_tk(o, False):
                ids = o
    if weights is None or ids is None:
        return f"no float and integer [{T}, {k}] values (mixing weights, expert ids) above the sum"
    for n in upstream_nodes(graph, [ids], set(graph.initializers) | set(graph.inputs), 400, truncate=True):
        if n.op_type not in ("MatMul", "Gemm") or len(n.inputs) < 2:
            continue
        w = graph.const(n.inputs[1])
        hv = graph.values.get(n.inputs[0])
        if w is None or w.ndim != 2 or hv is None or hv.shape is None or len(hv.shape) != 2 or hv.shape[1] != H:
            continue
        if n.op_type == "Gemm" and (n.attr("transA", 0) or n.attr("alpha", 1.0) != 1.0):
            continue
        experts = w.shape[0] if n.op_type == "Gemm" and n.attr("transB", 0) else w.shape[1]
        # an fp16/bf16 export scores in float32 (Cast(hidden) into the router) while the experts read the
        # hidden state itself: the cut is the value before the casts, which the experts' reads reach
        return Routed(weights, ids, _through_casts(graph, n.inputs[0]), int(experts))
    return f"no router MatMul/Gemm(hidden [T, {H}], W) above the expert ids '{ids}'"


def _scalars(graph: Graph, region: list[Node], op_types: tuple[str, ...]) -> list[float]:
    """Distinct scalar float constants the region's ``op_types`` nodes read."""
    out: list[float] = []
    for n in region:
        if n.op_type in op_types:
            for i in n.inputs:
                c = graph.const(i) if i else None
                if c is not None and c.size == 1 and c.dtype.kind == "f" and float(c.reshape(-1)[0]) not in out:
                    out.append(float(c.reshape(-1)[0]))
    return out


def _activation_floats(graph: Graph, region: list[Node], cut: list[str]) -> set[str]:
    """The float values of ``region`` (in graph order) computed from the float values of ``cut``; floats cast
    from integers (expert ids, counts) and what only they feed are not among them."""
    tainted = {v for v in cut if graph.values[v].dtype in TOLERANCE}
    for n in region:
        if any(i in tainted for i in n.inputs if i):
            tainted |= {o for o in n.outputs if o and graph.values[o].dtype in TOLERANCE}
    return tainted


def _clamp_limit(graph: Graph, region: list[Node], cut: list[str]) -> float | str | None:
    """The SwiGLU clamp's limit when every threshold op on float data in the region is a Clip/Min/Max with
    constant bounds of one magnitude; None when the region has no threshold op; else a refusal. Rounding ops
    on floats that hold integers (not computed from the cut's activations) are exact, and allowed."""
    limits = set()
    activations = _activation_floats(graph, region, cut)
    for n in region:
        first = graph.values.get(n.inputs[0]) if n.inputs and n.inputs[0] else None
        if n.op_type not in _THRESHOLD_OPS or first is None or first.dtype not in TOLERANCE:
            continue
        if n.op_type in _ROUNDING_OPS and n.inputs[0] not in activations:
            continue
        refusal = f"{n.describe()} applies a threshold to float data; a random-input check cannot cover it"
        if n.op_type not in _CLAMP_OPS:
            return refusal
        bounds = [graph.const(i) for i in n.inputs[1:] if i]
        if not bounds or any(b is None or b.size != 1 for b in bounds):
            return refusal
        limits |= {abs(float(b.reshape(-1)[0])) for b in bounds}
    if len(limits) > 1 or 0.0 in limits:
        return f"clamps with bounds {sorted(limits)} are not one SwiGLU limit"
    return limits.pop() if limits else None


def prove_fused_moe(graph: Graph, sum_node: Node, pairs: str, k: int | None, seed: int = 0,
                    expert_outputs: list[str] | None = None) -> Proven | str:
    """Prove that ``sum_node`` (the per-token sum over the k selected experts) computes FusedMoE; see the
    module docstring. ``k`` None: a sum that does not show k (an index-add of the expert outputs into the
    token rows) takes the router's, and only the logits cut is tried. ``expert_outputs``: for a sum of one
    term per expert, each expert's weighted output in expert order; their weights may then be one 2-D MatMul
    weight per projection and expert instead of stacks (:func:`expert_stacks`). Returns the :class:`Proven`
    reading, or a one-line refusal (the logits cut's when both cuts fail and the router was found, else the
    routed cut's)."""
    probe = upstream_nodes(graph, [pairs], set(graph.initializers) | set(graph.inputs), MAX_REGION_NODES, truncate=True)
    router = find_router(graph, probe)
    if k is None and isinstance(router, Router):
        k = router_k(graph, router)
        if k is None:
            return f"router {router.node.describe()} selects a number of experts that is not a constant"
    first = router if isinstance(router, str) else _prove(graph, sum_node, k, router, seed, expert_outputs)
    if isinstance(first, Proven) or k is None:
        return first
    routed = find_routed(graph, probe, sum_node, k)
    if isinstance(routed, str):
        return first
    second = _prove(graph, sum_node, k, routed, seed, expert_outputs)
    if isinstance(second, Proven) or not isinstance(router, Router):
        return second
    return first if first.startswith("no FusedMoE reading") and not second.startswith("no FusedMoE reading") else second


def router_k(graph: Graph, router: Router) -> int | None:
    """The number of experts ``router`` selects: topk's ``k`` attribute, or the TopK's constant K input."""
    if router.fused:
        return int(router.node.attr("k"))
    k_const = graph.const(router.node.inputs[1])
    return int(k_const.reshape(-1)[0]) if k_const is not None and k_const.size == 1 else None


def expert_stacks(graph: Graph, expert_outputs: list[str], cut: list[str], H: int) -> tuple[np.ndarray, np.ndarray] | str:
    """FusedMoE's stacks from experts written as one module each (TorchScript's export of transformers' loop over
    the experts, as optimum writes Qwen3-MoE). For expert e, the e-th of ``expert_outputs``, the
    MatMuls above its output (down to the ``cut``) with a constant 2-D float weight are its projections: two
    [H, I] (gate: the one a Sigmoid reads, SiLU's; up: the other) and one [I, H] (down), as ``torch.nn.Linear``
    exports its weight transposed. Returns (fc1 [E, 2I, H] float32, gate rows first; fc2 [E, H, I] float32) or a
    one-line refusal; the numerical check decides whether the reading is right."""
    fc1, fc2 = [], []
    stop = set(cut) | set(graph.inputs)
    for e, value in enumerate(expert_outputs):
        nodes = upstream_nodes(graph, [value], stop, MAX_REGION_NODES) or []
        # an expert may read the earlier experts' partial sum (for its shape): their nodes are theirs
        stop |= {o for n in nodes for o in n.outputs if o}
        mats = [(n, graph.const(n.inputs[1])) for n in nodes if n.op_type == "MatMul"]
        mats = [(n, w) for n, w in mats if w is not None and w.ndim == 2 and w.dtype.kind == "f"]
        gates = [(n, w) for n, w in mats if any(c.op_type == "Sigmoid" for c in graph.consumers(n.outputs[0]))]
        ups = [(n, w) for n, w in mats if gates and n is not gates[0][0] and n.inputs[0] == gates[0][0].inputs[0]]
        downs = [(n, w) for n, w in mats if (not gates or n is not gates[0][0]) and (not ups or n is not ups[0][0])]
        if len(mats) != 3 or len(gates) != 1 or len(ups) != 1 or len(downs) != 1:
            return (f"expert {e} (above '{value}'): {len(mats)} MatMuls with a constant 2-D weight, {len(gates)} of them "
                    "feeding a Sigmoid; expected a gate (SiLU's Sigmoid reads it), an up reading the gate's input, a down")
        gate, up, down = gates[0][1], ups[0][1], downs[0][1]
        if gate.shape[0] != H or up.shape != gate.shape or down.shape != (gate.shape[1], H):
            return (f"expert {e} (above '{value}'): gate {gate.shape}, up {up.shape}, down {down.shape}; expected "
                    f"[H={H}, I], [H, I], [I, H]")
        fc1.append(np.concatenate([gate.T, up.T], axis=0).astype(np.float32))
        fc2.append(down.T.astype(np.float32))
    return np.stack(fc1), np.stack(fc2)


def _prove(graph: Graph, sum_node: Node, k: int, router: Router | Routed, seed: int,
           expert_outputs: list[str] | None = None) -> Proven | str:
    """The check of the module docstring for one cut: ``router`` (logits) or ``Routed`` (weights and ids)."""
    hidden, E = router.hidden, router.experts
    routed = isinstance(router, Routed)
    if routed:
        routings = (("routed", 0),)
        logits = router.weights
        cut = [router.weights, router.ids]
    elif router.fused:  # topk's op: its routing is known, and the region starts at its outputs
        logits = router.logits
        routings = ((router.node.attr("mode", "softmax_topk"), int(router.node.attr("normalize", 0))),)
        selected = router_k(graph, router)
        # the logits too: a region may read their shape (optimum's gpt-oss scatters the routing into zeros_like(logits))
        cut = [o for o in router.node.outputs if o] + [logits]
    else:
        logits = router.logits
        routings = _ROUTINGS
        selected = router_k(graph, router)
        cut = [logits]
    if not routed and selected != k:
        return f"router {router.node.describe()} selects {selected} experts, the sum adds {k}"
    hv, lv = graph.values[hidden], graph.values[logits]
    if hv.dtype not in TOLERANCE or lv.dtype not in TOLERANCE or (not routed and lv.dtype != hv.dtype) or not isinstance(hv.shape[1], int):
        return f"hidden '{hidden}' is {hv.type_str()}, logits '{logits}' {lv.type_str()}: expected one float dtype and a static width"
    if not 1 <= k <= min(MAX_K, E):
        return f"k={k} outside 1..min({MAX_K}, E={E})"
    out = sum_node.outputs[0]
    hidden_aliases = aliases(graph, hidden)
    cut = hidden_aliases + cut
    region = upstream_nodes(graph, list(sum_node.inputs), set(cut) | set(graph.initializers) | set(graph.inputs),
                       MAX_REGION_NODES)
    if region is None:
        return f"more than {MAX_REGION_NODES} nodes between the router and the sum"
    region = sorted(region + [sum_node], key=lambda n: n.order)
    limit = _clamp_limit(graph, region, cut)
    if isinstance(limit, str):
        return limit
    for n in region:
        if n.domain not in ("", "ai.onnx"):
            return f"{n.describe()} is in domain '{n.domain}'"
    H = hv.shape[1]
    names = dict.fromkeys(i for n in region for i in n.inputs if i in graph.initializers)
    consts = [c for c in (graph.const(i) for i in names) if c is not None and c.shape[:1] == (E,) and c.dtype.kind == "f"]
    weights = [w for w in consts if w.ndim == 3 and w.shape[1] != 1]
    # a bias broadcast over the tokens may be stored [E, 1, N] (TorchScript folds ``bias[..., None, :]``)
    biases = [b for b in consts if b.ndim == 2] + [b[:, 0] for b in consts if b.ndim == 3 and b.shape[1] == 1]
    if len(biases) == 1 and sum(graph.const(i) is not None and graph.const(i).ndim == 2 and graph.const(i).shape[0] == E
                                for n in region for i in n.inputs) >= 2:
        biases *= 2  # one initializer read as both biases (an exporter merges equal constants: zero biases)
    if not weights and expert_outputs:  # one module per expert: their 2-D weights, stacked in expert order
        if len(expert_outputs) != E:
            return f"the sum adds {len(expert_outputs)} experts' outputs, the router scores E={E}"
        stacks = expert_stacks(graph, expert_outputs, cut, H)
        if isinstance(stacks, str):
            return stacks
        weights = list(stacks)
    if len(weights) != 2:
        return f"{len(weights)} stacked expert weights [E={E}, ., .] in the region (want gate/up and down)"
    if len(biases) > 2:
        return f"{len(biases)} expert biases [E={E}, .] in the region (want at most gate/up and down)"
    model = region_model(graph, region, cut, [out])
    if isinstance(model, str):
        return model
    session = region_session(model)
    if isinstance(session, str):
        return session
    dtype = helper.tensor_dtype_to_np_dtype(graph.values[hidden].dtype)
    tol = TOLERANCE.get(graph.values[hidden].dtype, 1e-4)
    rng = np.random.default_rng(seed)
    read = {i.name for i in model.graph.input}
    extra = [s for s in specs_of(model.graph.input) if s.name not in cut]
    draws = []
    # a single token, a few, more tokens than experts (several tokens per expert), and large activations; an
    # export specialized to one token count (its hidden state has a static first dim) gets that count each time
    sizes = ((1, 1.0), (3, 1.0), (min(E + 1, 33), 1.0), (2, 30.0))
    if isinstance(hv.shape[0], int):
        sizes = tuple((hv.shape[0], scale) for _, scale in sizes)
    for T, scale in sizes:
        feeds = make_feeds(extra, seq=T, seed=seed) if extra else {}
        x = (rng.standard_normal((T, H)) * scale).astype(dtype)
        feeds.update({a: x.reshape((1,) * (graph.values[a].rank - 2) + x.shape) for a in hidden_aliases if a in read})
        ldt = helper.tensor_dtype_to_np_dtype(lv.dtype)
        ids = None
        if routed:
            z = rng.uniform(0.05, 1.0, (T, k)).astype(ldt)
            ids = np.stack([rng.permutation(E)[:k] for _ in range(T)])
            feeds[router.weights] = z
            feeds[router.ids] = ids.astype(helper.tensor_dtype_to_np_dtype(graph.values[router.ids].dtype))
        else:
            z = (rng.standard_normal((T, E)) * 3).astype(ldt)  # spread by 3: no near-ties in the top-k
        if not routed and router.fused:
            mode, normalize = routings[0]
            wdt = helper.tensor_dtype_to_np_dtype(graph.values[router.node.outputs[0]].dtype)
            w, i = router_topk_reference(z, k, normalize, mode, wdt)
            feeds.update({o: v for o, v in zip(router.node.outputs, (w, i)) if o in read})
            if logits in read:
                feeds[logits] = z
        elif not routed:
            feeds[logits] = z
        try:
            got = session.run([out], feeds)[0].astype(np.float64)
        except Exception as e:
            return f"the region fails on random inputs: {str(e).splitlines()[0][:160]}"
        draws.append((x, z, ids, got))
    op = FusedMoE()
    alphas = [1.0] + [a for a in _scalars(graph, region, ("Mul",)) if a > 0 and a != 1.0]
    betas = [0.0] + [b for b in _scalars(graph, region, ("Add",)) if b != 0.0]
    activations = [(a, b, limit or 0.0) for a in alphas for b in betas]
    closest = (np.inf, "")
    for fc1, fc2, b1, b2, how in _readings(weights, biases, H):
        for mode, normalize in routings:
            for alpha, beta, lim in activations:
                attrs = dict(k=k, normalize=normalize, mode=mode, activation_alpha=alpha, activation_beta=beta, swiglu_limit=lim)
                err, reached = 0.0, not lim
                for x, z, ids, got in draws:
                    ref = op.reference(attrs, x, z, fc1, fc2, ids=ids, b1=b1, b2=b2)[0].astype(np.float64)
                    scale_ref = max(np.abs(ref).max(), 1e-6)
                    err = max(err, float(np.abs(got - ref).max() / scale_ref))
                    if err > tol:
                        break
                    if not reached:  # the clamp must change the result on some draw, or the draws never reach it
                        free = op.reference({**attrs, "swiglu_limit": 0.0}, x, z, fc1, fc2, ids=ids, b1=b1, b2=b2)[0]
                        reached = float(np.abs(free.astype(np.float64) - ref).max() / scale_ref) > 10 * tol
                if err <= tol and not reached:
                    err = np.inf
                    closest = min(closest, (err, f"{how}: the draws never reach the clamp at {lim}"))
                    continue
                if err <= tol:
                    removable = [n for n in region if n.id != sum_node.id]
                    if not routed and router.fused:  # topk's router goes too when nothing else reads it
                        removable.append(router.node)
                    f32 = lambda a: None if a is None else a.astype(np.float32)  # noqa: E731
                    return Proven(hidden, logits, fc1.astype(np.float32), fc2.astype(np.float32), k, normalize, mode,
                                  removable, err, ids=router.ids if routed else "", b1=f32(b1), b2=f32(b2),
                                  alpha=alpha, beta=beta, limit=lim)
                closest = min(closest, (err, f"{how}, {mode}{' renormalized' if normalize else ''}"
                                             f"{f', SwiGLU alpha {alpha} beta {beta} limit {lim}' if (alpha, beta, lim) != (1.0, 0.0, 0.0) else ''}"))
    return f"no FusedMoE reading reproduces the region (closest: {closest[1]}, relative error {closest[0]:.2e})"
