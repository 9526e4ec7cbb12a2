"""Routed experts recognized by what they compute, for spellings no structural pattern covers.

transformers' default experts implementation (``grouped_mm``) exports the routed experts as a sort of the
(token, expert) pairs by expert, one MatMul per expert on its slice of the sorted tokens, a Concat, and an
inverse permutation; the number of nodes grows with the number of experts. Instead of a pattern per spelling,
:func:`prove_fused_moe` takes the region that ends at the per-token sum over the k selected experts
(``ReduceSum(Reshape(pairs, [T, k, H]), axes=[1])``) and

1. finds the router nearest the sum: a TopK (``largest=1``) over ``Softmax(logits)`` or over ``logits``, or
   ``topk``'s ``MoERouterTopK`` (whose routing is then known), with ``logits = MatMul/Gemm(hidden, W)``;
2. collects the region: every node between ``hidden``/``logits`` and the sum (it may read graph inputs only
   through ``Shape``), and its stacked expert weights (rank-3 initializers with E as the first dim);
3. refuses regions that compare, clamp or round float data (thresholds random inputs may never reach) or
   use ops of other domains; runs the region alone on ONNX Runtime (basic level) with random ``hidden`` and
   ``logits`` for T = 1, 3 and E + 1 tokens and once with activations 30 times larger, and compares it with
   `FusedMoE.reference` under each reading of the weights (gate/up stack [E, 2I, H] or
   its transpose, gate and up concatenated or interleaved; down [E, H, I] or its transpose) and of the routing
   (softmax then top-k, renormalized or not; top-k then softmax).

The first reading that reproduces the region within the dtype's tolerance (float32 1e-4, float16 1e-2,
relative to the largest output) on every draw is the match; if none does, the region is refused with the
closest reading's error. This is a numerical check on random inputs, not a proof ("proved" below means
passed this check): it is how candidates that structure alone cannot establish are checked.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.feeds import make_feeds, specs_of
from rewrite.core.ir import Graph, Node
from rewrite.plugins.moe_lowering import FusedMoE
from rewrite.plugins.router import router_topk_reference

#: the region may not be larger than this many nodes (grouped_mm with 128 experts is about 1,000)
MAX_REGION_NODES = 4000
#: ops that compare, clamp or round: on float data they make thresholds random inputs may never reach (a
#: clamped SwiGLU, capacity limits), so a region applying them to floats is refused, not checked
_THRESHOLD_OPS = frozenset({"Clip", "Min", "Max", "Relu", "LeakyRelu", "ThresholdedRelu", "Less", "LessOrEqual",
                            "Greater", "GreaterOrEqual", "Equal", "Abs", "Sign", "Floor", "Ceil", "Round", "IsInf",
                            "IsNaN", "Mod", "HardSigmoid", "HardSwish", "Shrink"})
#: FusedMoE's kernels take at most this many experts per token (plugin_kernels/moe/moe_cpu.c MAX_K)
MAX_K = 64
#: relative tolerance of the numerical check by hidden dtype
TOLERANCE = {TensorProto.FLOAT: 1e-4, TensorProto.FLOAT16: 1e-2, TensorProto.BFLOAT16: 1e-2}
_ROUTINGS = (("softmax_topk", 0), ("softmax_topk", 1), ("topk_softmax", 0))


@dataclass
class Proven:
    """A region proved equal to FusedMoE: the attributes and float32 weights of the fused op.

    Attributes:
        hidden: the [T, H] value the experts read; logits: the router's [T, E] output.
        fc1: gate and up stacked [E, 2I, H] (gate rows first); fc2: down [E, H, I].
        k, normalize, mode: FusedMoE's routing attributes.
        region: the nodes between hidden/logits (or the fused router's outputs) and the sum, removed when unused
            after the rewrite.
        error: the largest relative error of the accepted reading over the draws.
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


def _upstream(graph: Graph, start: list[str], stop: set[str], limit: int, *, truncate: bool = False) -> list[Node] | None:
    """Producers of ``start`` and their producers, not crossing ``stop`` values, nearest first (breadth-first);
    past ``limit`` nodes: None, or with ``truncate`` the nearest ``limit``."""
    seen: dict[int, Node] = {}
    queue = deque(v for v in start if v not in stop)
    visited = set(queue)
    while queue:
        node = graph.producer_node(queue.popleft())
        if node is None or node.id in seen:
            continue
        seen[node.id] = node
        if len(seen) >= limit:
            return list(seen.values()) if truncate else None
        for i in node.inputs:
            if i and i not in stop and i not in visited:
                visited.add(i)
                queue.append(i)
    return list(seen.values())


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
        if (node.op_type != "TopK" and not fused) or (fused and node.attr("mode") == "topk"):
            continue  # (topk's plain exact TopK stands for a TopK whose scores this search does not follow)
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


def _aliases(graph: Graph, value: str) -> list[str]:
    """``value`` and the values it is a same-shaped Reshape / Identity of (exporters flatten the hidden state
    once for the router and once for the experts)."""
    out = [value]
    node = graph.producer_node(value)
    shape = graph.values[value].shape
    while (node is not None and node.op_type in ("Reshape", "Identity") and shape is not None
           and all(isinstance(d, int) or isinstance(d, str) for d in shape) and graph.values[node.inputs[0]].shape == shape):
        out.append(node.inputs[0])
        node = graph.producer_node(node.inputs[0])
    return out


def _region_model(graph: Graph, region: list[Node], cut: list[str], out: str) -> onnx.ModelProto | str:
    """The region as a model with output ``out``, whose inputs are the ``cut`` values it reads (hidden state and
    its aliases, logits or the fused router's outputs) and the graph inputs it reads through Shape."""
    produced = {o for n in region for o in n.outputs if o}
    inputs, inits = [], []
    for n in region:
        for i in n.inputs:
            if not i or i in produced:
                continue
            if i in graph.initializers:
                if i not in inits:
                    inits.append(i)
            elif i in cut or (i in graph.inputs and n.op_type == "Shape"):  # checked at every read
                if i not in inputs:
                    inputs.append(i)
            else:
                return f"the region reads '{i}' in {n.describe()} (not the router's hidden or logits, a constant, or a shape)"
    nodes = []
    for n in region:
        proto = helper.make_node(n.op_type, n.inputs, n.outputs, name=n.name, domain=n.domain)
        proto.attribute.extend(n.attrs.values())
        nodes.append(proto)
    vis = [graph.values[v].to_value_info() for v in inputs]
    out_vi = helper.make_tensor_value_info(out, graph.values[out].dtype, None)
    tensors = [numpy_helper.from_array(graph.const(v), v) for v in inits]
    model = helper.make_model(helper.make_graph(nodes, "moe_region", vis, [out_vi], tensors),
                              opset_imports=list(graph.model_shell.opset_import))
    model.ir_version = graph.model_shell.ir_version
    return model


def _readings(weights: list[np.ndarray], H: int):
    """(fc1 [E, 2I, H], fc2 [E, H, I], description) for every reading of two stacked weights."""
    for a, b in ((0, 1), (1, 0)):
        for fc1_layout, fc1 in (("out-in", weights[a]), ("in-out", weights[a].transpose(0, 2, 1))):
            if fc1.shape[2] != H or fc1.shape[1] % 2:
                continue
            I = fc1.shape[1] // 2
            for fc2_layout, fc2 in (("out-in", weights[b]), ("in-out", weights[b].transpose(0, 2, 1))):
                if fc2.shape[1:] != (H, I):
                    continue
                yield fc1, fc2, f"gate/up {fc1_layout} concatenated, down {fc2_layout}"
                yield (np.concatenate([fc1[:, 0::2], fc1[:, 1::2]], axis=1), fc2,
                       f"gate/up {fc1_layout} interleaved, down {fc2_layout}")


def prove_fused_moe(graph: Graph, sum_node: Node, pairs: str, k: int, seed: int = 0) -> Proven | str:
    """Prove that ``sum_node`` (the per-token sum over the k selected experts) computes FusedMoE; see the
    module docstring. Returns the :class:`Proven` reading, or a one-line refusal."""
    import onnxruntime as ort

    probe = _upstream(graph, [pairs], set(graph.initializers) | set(graph.inputs), MAX_REGION_NODES, truncate=True)
    router = find_router(graph, probe)
    if isinstance(router, str):
        return router
    logits, hidden, E = router.logits, router.hidden, router.experts
    if router.fused:  # topk's op: its routing is known, and the region starts at its outputs
        routings = ((router.node.attr("mode", "softmax_topk"), int(router.node.attr("normalize", 0))),)
        selected = int(router.node.attr("k"))
        cut = [o for o in router.node.outputs if o]
    else:
        routings = _ROUTINGS
        k_const = graph.const(router.node.inputs[1])
        selected = int(k_const.reshape(-1)[0]) if k_const is not None and k_const.size == 1 else None
        cut = [logits]
    if selected != k:
        return f"router {router.node.describe()} selects {selected} experts, the sum adds {k}"
    hv, lv = graph.values[hidden], graph.values[logits]
    if hv.dtype not in TOLERANCE or lv.dtype != hv.dtype or not isinstance(hv.shape[1], int):
        return f"hidden '{hidden}' is {hv.type_str()}, logits '{logits}' {lv.type_str()}: expected one float dtype and a static width"
    if not 1 <= k <= min(MAX_K, E):
        return f"k={k} outside 1..min({MAX_K}, E={E})"
    out = sum_node.outputs[0]
    hidden_aliases = _aliases(graph, hidden)
    cut = hidden_aliases + cut
    region = _upstream(graph, list(sum_node.inputs), set(cut) | set(graph.initializers) | set(graph.inputs),
                       MAX_REGION_NODES)
    if region is None:
        return f"more than {MAX_REGION_NODES} nodes between the router and the sum"
    region = sorted(region + [sum_node], key=lambda n: n.order)
    for n in region:
        first = graph.values.get(n.inputs[0]) if n.inputs and n.inputs[0] else None
        if n.op_type in _THRESHOLD_OPS and first is not None and first.dtype in TOLERANCE:
            return f"{n.describe()} applies a threshold to float data; a random-input check cannot cover it"
        if n.domain not in ("", "ai.onnx"):
            return f"{n.describe()} is in domain '{n.domain}'"
    H = hv.shape[1]
    names = dict.fromkeys(i for n in region for i in n.inputs if i in graph.initializers)
    weights = [graph.const(i) for i in names]
    weights = [w for w in weights if w is not None and w.ndim == 3 and w.shape[0] == E]
    if len(weights) != 2:
        return f"{len(weights)} stacked expert weights [E={E}, ., .] in the region (want gate/up and down)"
    model = _region_model(graph, region, cut, out)
    if isinstance(model, str):
        return model
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT's own exception types
        return f"the region does not run alone: {str(e).splitlines()[0][:160]}"
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
        feeds.update({a: x for a in hidden_aliases if a in read})
        z = (rng.standard_normal((T, E)) * 3).astype(helper.tensor_dtype_to_np_dtype(graph.values[logits].dtype))
        if router.fused:
            mode, normalize = routings[0]
            wdt = helper.tensor_dtype_to_np_dtype(graph.values[router.node.outputs[0]].dtype)
            w, i = router_topk_reference(z, k, normalize, mode, wdt)
            feeds.update({o: v for o, v in zip(router.node.outputs, (w, i)) if o in read})
        else:
            feeds[logits] = z  # spread by 3: no near-ties in the top-k
        try:
            got = session.run([out], feeds)[0].astype(np.float64)
        except Exception as e:
            return f"the region fails on random inputs: {str(e).splitlines()[0][:160]}"
        draws.append((x, z, got))
    op = FusedMoE()
    closest = (np.inf, "")
    for fc1, fc2, how in _readings(weights, H):
        for mode, normalize in routings:
            attrs = dict(k=k, normalize=normalize, mode=mode)
            err = 0.0
            for x, z, got in draws:
                ref = op.reference(attrs, x, z, fc1, fc2)[0].astype(np.float64)
                err = max(err, float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6)))
                if err > tol:
                    break
            if err <= tol:
                removable = [n for n in region if n.id != sum_node.id]
                if router.fused:  # topk's router goes too when nothing else reads it
                    removable.append(router.node)
                return Proven(hidden, logits, fc1.astype(np.float32), fc2.astype(np.float32), k, normalize, mode,
                              removable, err)
            closest = min(closest, (err, f"{how}, {mode}{' renormalized' if normalize else ''}"))
    return f"no FusedMoE reading reproduces the region (closest: {closest[1]}, relative error {closest[0]:.2e})"
