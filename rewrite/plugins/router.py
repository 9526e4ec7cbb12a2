"""``topk``: the MoE router (scores + top-k [+ renormalization, scaling]) as one abstract op, ``MoERouterTopK``.

Forms matched (ONNX opset 13+, expert axis last):

* ``softmax-topk``: ``Softmax(logits) -> [Cast] -> TopK`` (Qwen1.5/Qwen2-MoE as transformers exports it; the
  seed form, whose f16 probabilities are Cast to f32 before TopK);
* ``softmax-topk-renorm``: the same, then ``Div(values, ReduceSum(values, axes=[-1], keepdims=1))``
  (Qwen3-MoE's ``router_top_value /= router_top_value.sum(dim=-1, keepdim=True)``, Mixtral);
* ``topk-softmax`` / ``topk-softmax-renorm``: ``TopK(logits) -> Softmax`` over the k selected logits
  (gpt-oss), optionally renormalized the same way;
* ``grouped-router``: ``GatherElements(scores, TopK(choice).indices)`` with ``scores = Sigmoid|Softmax(logits)``
  and ``choice`` computed from the scores, then the weights' ``w / (ReduceSum(w) [+ eps | Clip(., min)])`` and
  ``* scale`` -> ``mode=grouped`` (DeepSeek-V3, GLM4-MoE and dots1: sigmoid scores, selection bias, the
  ``topk_group`` best of ``n_group`` groups by the sum of their 2 best, ``masked_fill(-inf)``, ``+ 1e-20``,
  ``routed_scaling_factor``; Ernie 4.5: softmax scores, selection bias, one group, ``clamp(sum, min)``). The
  bias, scale, eps and min are read from constants, the group counts are tried from the Reshape targets and
  TopK k values of the selection; the candidate router runs alone on ONNX Runtime with random logits and the
  first reading whose expert ids (as sets) and weights equal :func:`router_topk_reference` on 2,048 random
  tokens is taken, the reading with the most groups first. A ``sorted=0`` final TopK is accepted when its
  values are not read and neither its ids nor the weights reach a graph output (through ops that keep their
  order): the op's sorted order is one of the orders ``sorted=0`` allows, so the rewritten model computes one
  of the results the original may compute (and the experts' weighted sum, which reads ids and weights as pairs,
  is the same for every order);
* ``topk-exact`` (tried last): any other float TopK over the last axis with ``largest=1, sorted=1`` (routers
  the forms above do not cover) -> ``mode=topk``, the k largest values and their indices, so that IREE never
  runs its own TopK on them.

Why: IREE 3.13's own lowering of the router TopK returns wrong indices inside the full models (seed 000
"TopK Extern Kernel"; located by ``rewrite verify --locate``), and its sort-based TopK costs ~216 dispatches.
On IREE the op runs as one dispatch of ``plugin_kernels/topk/router_topk.c``; on ONNX Runtime it is lowered
back to standard ONNX (a ``moe`` plugin may instead absorb it into com.microsoft MoE/QMoE).

Refused, with the reason in the report: Softmax and TopK on different axes or not on the last axis,
a grouped router whose ``masked_fill`` value could outrank a kept expert or that no reading reproduces,
``largest=0``, ``sorted=0`` (ORT's order is then unspecified), k not a constant or outside ``1..E``, a
dynamic or too large expert count, a Cast between Softmax and TopK that does not hold every value (to a
narrower float or to an integer), logits other than float16/float32, intermediate values read outside the
match (renormalized forms).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from rewrite.backends.iree_patch import IreeLowering, PatchContext, TorchOperator
from rewrite.core.abstract_ops import DOMAIN, AbstractOp
from rewrite.core.analysis import region_model, upstream_nodes
from rewrite.core.ir import Graph, Node, dtype_name
from rewrite.core.kernels import build_cpu_object, kernel_source
from rewrite.core.pattern import AttrVar, Const, Or
from rewrite.core.rules import Builder, holds_every_value_of, rule
from rewrite.errors import BackendError
from rewrite.plugins.base import KernelObject, Plugin

MAX_EXPERTS = 1024  #: the kernel keeps one f32 score per expert on the stack (passed to it with -D)
TOKENS_PER_WORKGROUP = 64  #: tokens one IREE workgroup routes
MODES = ("softmax_topk", "topk_softmax", "topk", "grouped")
SCORINGS = ("sigmoid", "softmax")  #: grouped mode's scoring functions
_FLOATS = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
_KERNEL_FLAGS = (f"-DROUTER_TOPK_MAX_EXPERTS={MAX_EXPERTS}", f"-DROUTER_TOPK_TOKENS={TOKENS_PER_WORKGROUP}",
                 "-fno-tree-loop-distribute-patterns")  # no memset/memcpy calls: there is no libc to link


def router_topk_reference(logits: np.ndarray, k: int, normalize: int = 0, mode: str = "softmax_topk",
                          weights_dtype=np.float32, *, bias: np.ndarray | None = None, scoring: str = "sigmoid",
                          n_group: int = 1, topk_group: int = 1, scale: float = 1.0, norm_eps: float = 0.0,
                          norm_min: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """numpy semantics of ``ai.rewrite::MoERouterTopK`` (what the C kernel computes, bit for bit on indices).

    Args:
        logits: [..., E] float16 or float32 router logits (expert axis last).
        k: experts per token, 1 <= k <= E.
        normalize: 1 to divide the k weights by their sum.
        mode: ``softmax_topk`` (softmax over E, then the k largest probabilities), ``topk_softmax`` (the k
            largest logits, then softmax over them), ``topk`` (the k largest values themselves: ONNX TopK with
            ``largest=1, sorted=1`` over the last axis) or ``grouped`` (below).
        weights_dtype: float32 or float16, the weights' element type.
        bias, scoring, n_group, topk_group, scale, norm_eps, norm_min: grouped mode only. DeepSeek-V3's router
            (transformers 5.24 ``DeepseekV3TopkRouter.forward``; GLM4-MoE and dots1 alike; Ernie 4.5's
            ``Ernie4_5_MoeTopKRouter`` is one group of softmax scores), in float32::

                s = sigmoid(x) (or softmax(x)); c = s + bias                     (bias [E] float32, selection only)
                group score = sum of the 2 largest c in each of n_group groups of E / n_group experts
                keep the topk_group best groups; c = -inf in the others           (masked_fill(~mask, -inf))
                idx = top-k(c); w = s[idx]
                w /= max(sum(w) + norm_eps, norm_min)   (when normalize: DeepSeek-V3 adds 1e-20, Ernie clamps)
                w *= scale                                                       (routed_scaling_factor)

    Returns:
        (weights [..., k] ``weights_dtype``, indices [..., k] int64), sorted by descending score; equal scores
        give the lower index first (ONNX TopK-11). Softmax runs on float32 inputs with exp and sum in float64,
        rounded once to float32; renormalization divides in float64 and rounds to float32 (grouped mode: the
        sigmoid in float64 rounded once, the rest in float32 as the exported graphs compute it); then one
        rounding to ``weights_dtype``.

    Raises:
        ValueError: bad k, mode, scoring or groups.
    """
    x = np.asarray(logits).astype(np.float32)
    e = x.shape[-1]
    if not 1 <= k <= e:
        raise ValueError(f"MoERouterTopK: k={k} outside 1..{e}")
    if mode not in MODES:
        raise ValueError(f"MoERouterTopK: mode '{mode}' is not one of {', '.join(MODES)}")

    def softmax(v: np.ndarray) -> np.ndarray:
        d = v.astype(np.float64)
        ex = np.exp(d - d.max(-1, keepdims=True))
        return (ex / ex.sum(-1, keepdims=True)).astype(np.float32)

    if mode == "grouped":
        return _grouped_reference(x, k, normalize, weights_dtype, bias, scoring, n_group, topk_group, scale,
                                  norm_eps, norm_min, softmax)
    scores = softmax(x) if mode == "softmax_topk" else x
    idx = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    w = np.take_along_axis(scores, idx, -1)
    if mode == "topk_softmax":
        w = softmax(w)
    if normalize:
        d = w.astype(np.float64)
        w = (d / d.sum(-1, keepdims=True)).astype(np.float32)
    return w.astype(weights_dtype), idx.astype(np.int64)


def _grouped_reference(x, k, normalize, weights_dtype, bias, scoring, n_group, topk_group, scale, norm_eps,
                       norm_min, softmax):
    """Grouped mode of :func:`router_topk_reference` (float32 [..., E] logits ``x``)."""
    e = x.shape[-1]
    if scoring not in SCORINGS:
        raise ValueError(f"MoERouterTopK: scoring '{scoring}' is not one of {', '.join(SCORINGS)}")
    if n_group < 1 or e % n_group or not 1 <= topk_group <= n_group or (n_group > 1 and e // n_group < 2):
        raise ValueError(f"MoERouterTopK: {n_group} groups of {e} experts, {topk_group} kept: not a grouping")
    s = (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32) if scoring == "sigmoid" else softmax(x)
    c = (s + (np.zeros(e, np.float32) if bias is None else np.asarray(bias, np.float32))).astype(np.float32)
    if n_group > 1:
        g = c.reshape(c.shape[:-1] + (n_group, e // n_group))
        top2 = -np.sort(-g, axis=-1)[..., :2]
        gs = (top2[..., 0] + top2[..., 1]).astype(np.float32)
        keep = np.argsort(-gs, axis=-1, kind="stable")[..., :topk_group]
        mask = np.zeros(gs.shape, bool)
        np.put_along_axis(mask, keep, True, -1)
        c = np.where(np.repeat(mask, e // n_group, axis=-1), c, np.float32(-np.inf))
    idx = np.argsort(-c, axis=-1, kind="stable")[..., :k]
    w = np.take_along_axis(s, idx, -1)
    if normalize:
        denom = np.maximum(w.sum(-1, keepdims=True, dtype=np.float32) + np.float32(norm_eps), np.float32(norm_min))
        w = (w / denom).astype(np.float32)
    w = (w * np.float32(scale)).astype(np.float32)
    return w.astype(weights_dtype), idx.astype(np.int64)


class MoERouterTopK(AbstractOp):
    """``ai.rewrite::MoERouterTopK(logits) -> (weights, indices)``: the MoE router in one op.

    Inputs:
        logits: [..., E] float16 | float32 (in the Qwen models [T, E]); E static, at most :data:`MAX_EXPERTS`.
        bias: [E] float32, grouped mode only (the selection bias; zeros when the router has none).
    Outputs:
        weights: [..., k] float32 | float16, the element type the matched graph's consumers read (the TopK
            values', or the Softmax's/Div's output type);
        indices: [..., k] int64 expert ids, by descending score, lower index first among equal scores.
    Attributes:
        k (int): experts per token.
        normalize (int 0/1): divide the k weights by their sum.
        mode (string): ``softmax_topk`` (softmax over all E in float32, then top-k), ``topk_softmax``
            (top-k of the logits, then softmax over the k), ``topk`` or ``grouped``.
        scoring (string), n_group, topk_group (int), scale, norm_eps, norm_min (float): grouped mode (see
            :func:`router_topk_reference`).

    Softmax is always computed in float32 (exp/sum in float64), also for float16 logits, as the seed's kernel
    does: on float16 graphs the op is more accurate than the original, whose probabilities are rounded to
    float16, so experts whose probabilities tie only after that rounding may be ordered differently.
    Semantics: :func:`router_topk_reference`. A ``moe`` plugin consuming this op may read the router's
    ``logits`` input and ``k``/``normalize`` for com.microsoft MoE/QMoE (``k``, ``normalize_routing_weights``).
    """

    op_type = "MoERouterTopK"

    def reference(self, attrs: dict, logits: np.ndarray, bias: np.ndarray | None = None) -> list[np.ndarray]:
        """``attrs``: k, normalize, mode, grouped mode's scoring, n_group, topk_group, scale, norm_eps, norm_min,
        and optionally ``weights_dtype`` (numpy dtype, default float32)."""
        w, i = router_topk_reference(logits, int(attrs["k"]), int(attrs.get("normalize", 0)),
                                     attrs.get("mode", "softmax_topk"), attrs.get("weights_dtype", np.float32),
                                     **_grouped_args(attrs, bias))
        return [w, i]

    def sample_inputs(self, rng: np.random.Generator) -> list[tuple[dict, list[np.ndarray]]]:
        """Conformance-kit samples: ragged token counts around the 64-token workgroup, both modes, f16 logits."""
        return [
            (dict(k=4, normalize=0, mode="softmax_topk"), [rng.standard_normal((65, 60)).astype(np.float32)]),
            (dict(k=8, normalize=1, mode="softmax_topk"), [rng.standard_normal((3, 128)).astype(np.float16)]),
            (dict(k=2, normalize=0, mode="topk_softmax"), [rng.standard_normal((2, 63, 16)).astype(np.float32)]),
            (dict(k=3, normalize=1, mode="grouped", scoring="sigmoid", n_group=4, topk_group=2, scale=2.5,
                  norm_eps=1e-20, norm_min=0.0),
             [rng.standard_normal((65, 32)).astype(np.float32), (rng.standard_normal(32) * 0.3).astype(np.float32)]),
            # more experts selected than the kept groups hold: masked experts (-inf) by lower index
            (dict(k=6, normalize=0, mode="grouped", scoring="sigmoid", n_group=4, topk_group=1, scale=1.0),
             [rng.standard_normal((5, 16)).astype(np.float32), (rng.standard_normal(16) * 0.3).astype(np.float32)]),
            (dict(k=2, normalize=1, mode="grouped", scoring="softmax", n_group=1, topk_group=1, scale=1.0,
                  norm_eps=0.0, norm_min=0.5),
             [rng.standard_normal((3, 16)).astype(np.float16), (rng.standard_normal(16) * 0.1).astype(np.float32)]),
        ]

    def lower_ort(self, graph: Graph, node: Node) -> None:
        """Standard ONNX: Cast to f32, Softmax/TopK in the op's order, [ReduceSum, Div], Cast to the weights type;
        mode ``topk`` without renormalization is the TopK it replaced; grouped mode: see ``_grouped_onnx``."""
        k, normalize, mode = _attrs_of(node)
        b = Builder(graph, "lower/MoERouterTopK", node.order, node.name or "router")
        x = node.inputs[0]
        if mode == "topk" and not normalize:
            v, idx = b.op("TopK", [x, b.const([k], "k", np.int64)], outputs=2, axis=-1, largest=1, sorted=1)
            graph.replace_node(node, [v, idx])
            return
        if mode == "grouped":
            graph.replace_node(node, _grouped_onnx(graph, node, b, k, normalize))
            return
        if graph.values[x].dtype != TensorProto.FLOAT:
            x = b.op("Cast", [x], to=TensorProto.FLOAT)
        kk = b.const([k], "k", np.int64)
        if mode == "softmax_topk":
            w, idx = b.op("TopK", [b.op("Softmax", [x], axis=-1), kk], outputs=2, axis=-1, largest=1, sorted=1)
        elif mode == "topk":  # renormalized plain top-k (the kernel and the reference divide by the sum too)
            w, idx = b.op("TopK", [x, kk], outputs=2, axis=-1, largest=1, sorted=1)
        else:
            v, idx = b.op("TopK", [x, kk], outputs=2, axis=-1, largest=1, sorted=1)
            w = b.op("Softmax", [v], axis=-1)
        if normalize:
            w = b.op("Div", [w, b.op("ReduceSum", [w, b.const([-1], "axes", np.int64)], keepdims=1)])
        wdt = graph.values[node.outputs[0]].dtype or TensorProto.FLOAT
        if wdt != TensorProto.FLOAT:
            w = b.op("Cast", [w], to=wdt)
        graph.replace_node(node, [w, idx])

    def lower_iree(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """One ``flow.dispatch`` of ``router_topk_<in>_<out>`` (C kernel, statically linked), one workgroup per
        :data:`TOKENS_PER_WORKGROUP` tokens; logits are collapsed to 1-D and results expanded back.

        Raises:
            BackendError: dtype other than f16/f32, dynamic or too large E, k outside 1..E, unknown mode.
        """
        xt, wt, it = op.operand_types[0], op.result_types[0], op.result_types[1]
        where = f"MoERouterTopK {op.result}"
        rank, e = len(xt.dims), xt.dims[-1] if xt.dims else None
        k, normalize, mode = int(op.attrs.get("k", 0)), int(op.attrs.get("normalize", 0)), op.attrs.get("mode", "softmax_topk")
        if xt.element not in ("f16", "f32") or wt.element not in ("f16", "f32") or it.element != "si64":
            raise BackendError(f"{where}: types {xt.text} -> {wt.text}, {it.text}; expected f16|f32 -> f16|f32, si64")
        if rank < 2 or not isinstance(e, int) or not 1 <= e <= MAX_EXPERTS:
            raise BackendError(f"{where}: logits {xt.text} need rank >= 2 and a static last dim of 1..{MAX_EXPERTS}")
        if not 1 <= k <= e or mode not in MODES:
            raise BackendError(f"{where}: k={k}, mode='{mode}'; expected 1 <= k <= {e} and a mode in {', '.join(MODES)}")
        obj = build_cpu_object(kernel_source("topk", "router_topk.c"), extra_flags=_KERNEL_FLAGS)
        xe, we = xt.builtin_element, wt.builtin_element
        entry = f"router_topk_{xe}_{we}"
        lines = ["    %rt_t0 = arith.constant 1 : index"]
        dims = []
        for ax in range(rank - 1):
            d = xt.dims[ax]
            if d is None:
                dims.append(f"%in0_d{ax}")
            else:
                lines.append(f"    %rt_s{ax} = arith.constant {d} : index")
                dims.append(f"%rt_s{ax}")
            lines.append(f"    %rt_t{ax + 1} = arith.muli %rt_t{ax}, {dims[-1]} : index")
        t = f"%rt_t{rank - 1}"
        group = "[[" + ", ".join(str(a) for a in range(rank)) + "]]"
        static = all(isinstance(d, int) for d in xt.dims)
        flat_static = f"tensor<{np.prod(xt.dims, dtype=np.int64) if static else '?'}x{xe}>"
        lines += [
            f"    %rt_e = arith.constant {e} : index",
            f"    %rt_k = arith.constant {k} : index",
            f"    %rt_mode = arith.constant {MODES.index(mode)} : index",
            f"    %rt_norm = arith.constant {normalize} : index",
            f"    %rt_ne = arith.muli {t}, %rt_e : index",
            f"    %rt_nk = arith.muli {t}, %rt_k : index",
            f"    %rt_c{TOKENS_PER_WORKGROUP - 1} = arith.constant {TOKENS_PER_WORKGROUP - 1} : index",
            f"    %rt_c{TOKENS_PER_WORKGROUP} = arith.constant {TOKENS_PER_WORKGROUP} : index",
            f"    %rt_tp = arith.addi {t}, %rt_c{TOKENS_PER_WORKGROUP - 1} : index",
            f"    %rt_nwg = arith.divui %rt_tp, %rt_c{TOKENS_PER_WORKGROUP} : index",
            f"    %rt_flat{'0' if static else ''} = tensor.collapse_shape %in0 {group} : {xt.builtin} into {flat_static}",
        ]
        if static:  # the dispatch takes a dynamic 1-D tensor (T is dynamic in every real graph)
            lines.append(f"    %rt_flat = tensor.cast %rt_flat0 : {flat_static} to tensor<?x{xe}>")
        if mode == "grouped":
            ga = _grouped_args(op.attrs, None)
            g, kg = ga["n_group"], ga["topk_group"]
            bt = op.operand_types[1] if len(op.operand_types) > 1 else None
            if bt is None or bt.element != "f32" or bt.dims != [e]:
                raise BackendError(f"{where}: grouped mode needs its bias as f32 [{e}], got {bt.text if bt else 'none'}")
            _validate_grouped(where, e, ga)
            entry = f"router_grouped_{xe}_{we}"
            bits = {n: int(np.array(ga[n], np.float32).view(np.uint32)) for n in ("scale", "norm_eps", "norm_min")}
            params = {"%rt_sc": SCORINGS.index(ga["scoring"]), "%rt_g": g, "%rt_kg": kg, "%rt_scale": bits["scale"],
                      "%rt_eps": bits["norm_eps"], "%rt_lo": bits["norm_min"]}
            lines += [f"    {n} = arith.constant {v} : index" for n, v in params.items()]
            lines.append(
                f"    %rt_w, %rt_i = flow.dispatch @{entry}_exec::@{entry}[%rt_nwg](%rt_flat, %in1, {t}, %rt_e, %rt_k, %rt_norm, "
                f"%rt_sc, %rt_g, %rt_kg, %rt_scale, %rt_eps, %rt_lo) : (tensor<?x{xe}>{{%rt_ne}}, tensor<{e}xf32>, index, index, "
                f"index, index, index, index, index, index, index, index) -> (tensor<?x{we}>{{%rt_nk}}, tensor<?xi64>{{%rt_nk}})")
            executable = _grouped_executable(entry, xe, we, e, obj)
        else:
            lines.append(
                f"    %rt_w, %rt_i = flow.dispatch @{entry}_exec::@{entry}[%rt_nwg](%rt_flat, {t}, %rt_e, %rt_k, %rt_mode, %rt_norm)"
                f" : (tensor<?x{xe}>{{%rt_ne}}, index, index, index, index, index) -> (tensor<?x{we}>{{%rt_nk}}, tensor<?xi64>{{%rt_nk}})"
            )
            executable = _executable(entry, xe, we, obj)
        lead = "?x" * (rank - 1)
        shape = ", ".join(dims + [str(k)])
        for name, src, res in (("%out0", "%rt_w", wt), ("%out1", "%rt_i", it)):
            el = res.builtin_element
            dyn = f"tensor<{lead}{k}x{el}>"
            lines.append(f"    {name}_x = tensor.expand_shape {src} {group} output_shape [{shape}] : tensor<?x{el}> into {dyn}")
            lines.append(f"    {name} = tensor.cast {name}_x : {dyn} to {res.builtin}")
        return IreeLowering(body="\n".join(lines), module_items={f"{entry}_exec": executable}, kernel_objects=[str(obj)])


def _grouped_args(attrs: dict, bias) -> dict:
    """Keyword arguments of :func:`router_topk_reference` for grouped mode (none for the other modes)."""
    if attrs.get("mode") != "grouped":
        return {}
    scoring = attrs.get("scoring", "sigmoid")
    return dict(bias=bias, scoring=scoring.decode() if isinstance(scoring, bytes) else scoring,
                n_group=int(attrs.get("n_group", 1)), topk_group=int(attrs.get("topk_group", 1)),
                scale=float(attrs.get("scale", 1.0)), norm_eps=float(attrs.get("norm_eps", 0.0)),
                norm_min=float(attrs.get("norm_min", 0.0)))


def _validate_grouped(where: str, e, ga: dict) -> None:
    """Grouped mode's attributes for E experts; BackendError naming the op otherwise (both lowerings)."""
    g, kg = ga["n_group"], ga["topk_group"]
    if not isinstance(e, int) or g < 1 or e % g or not 1 <= kg <= g or (g > 1 and e // g < 2) or ga["scoring"] not in SCORINGS:
        raise BackendError(f"{where}: {g} groups of {e} experts, {kg} kept, scoring '{ga['scoring']}': expected groups "
                           f"of at least 2 experts dividing E, 1 <= topk_group <= n_group, scoring in {', '.join(SCORINGS)}")


def _grouped_onnx(graph: Graph, node: Node, b: Builder, k: int, normalize: int) -> list[str]:
    """Grouped mode as standard ONNX (float32; the nodes transformers' exporter writes for DeepSeek-V3).

    Raises:
        BackendError: invalid groups or scoring (naming the node).
    """
    ga = _grouped_args({a: node.attr(a) for a in node.attrs}, None)
    x = node.inputs[0]
    e = (graph.values[x].shape or [None])[-1]
    _validate_grouped(f"node {node.describe()}", e, ga)
    i64 = lambda v, n: b.const(np.asarray(v, np.int64), n)  # noqa: E731
    if graph.values[x].dtype != TensorProto.FLOAT:
        x = b.op("Cast", [x], to=TensorProto.FLOAT)
    s = b.op("Sigmoid", [x]) if ga["scoring"] == "sigmoid" else b.op("Softmax", [x], axis=-1)
    c = b.op("Add", [s, node.inputs[1]]) if len(node.inputs) > 1 and node.inputs[1] else s
    g, kg = ga["n_group"], ga["topk_group"]
    if g > 1:
        lead = b.op("Slice", [b.op("Shape", [c]), i64([0], "s0"), i64([-1], "s1")])
        grouped = b.op("Reshape", [c, b.op("Concat", [lead, i64([g, e // g], "groups")], axis=0)])
        top2, _ = b.op("TopK", [grouped, i64([2], "two")], outputs=2, axis=-1, largest=1, sorted=1)
        gs = b.op("ReduceSum", [top2, i64([-1], "axes")], keepdims=0)
        _, keep = b.op("TopK", [gs, i64([kg], "kg")], outputs=2, axis=-1, largest=1, sorted=1)
        zeros = b.op("ConstantOfShape", [b.op("Shape", [gs])], value=numpy_helper.from_array(np.zeros(1, np.float32)))
        ones = b.op("ConstantOfShape", [b.op("Shape", [keep])], value=numpy_helper.from_array(np.ones(1, np.float32)))
        mask = b.op("ScatterElements", [zeros, keep, ones], axis=-1)
        wide = b.op("Expand", [b.op("Unsqueeze", [mask, i64([-1], "last")]),
                               b.op("Concat", [b.op("Shape", [gs]), i64([e // g], "per")], axis=0)])
        keep_e = b.op("Cast", [b.op("Reshape", [wide, b.op("Shape", [c])])], to=TensorProto.BOOL)
        c = b.op("Where", [keep_e, c, b.const(np.array(-np.inf, np.float32), "masked")])
    _, idx = b.op("TopK", [c, i64([k], "k")], outputs=2, axis=-1, largest=1, sorted=1)
    w = b.op("GatherElements", [s, idx], axis=-1)
    if normalize:
        total = b.op("ReduceSum", [w, i64([-1], "axes")], keepdims=1)
        if ga["norm_eps"]:
            total = b.op("Add", [total, b.const(np.float32(ga["norm_eps"]), "eps")])
        if ga["norm_min"]:
            total = b.op("Max", [total, b.const(np.float32(ga["norm_min"]), "norm_min")])
        w = b.op("Div", [w, total])
    if ga["scale"] != 1.0:
        w = b.op("Mul", [w, b.const(np.float32(ga["scale"]), "scale")])
    wdt = graph.values[node.outputs[0]].dtype or TensorProto.FLOAT
    if wdt != TensorProto.FLOAT:
        w = b.op("Cast", [w], to=wdt)
    return [w, idx]


def _executable(entry: str, xe: str, we: str, obj) -> str:
    """The ``stream.executable`` whose export calls the statically linked ``<entry>_workgroup`` C function."""
    return f"""
  stream.executable private @{entry}_exec attributes {{
    hal.executable.objects = #hal.executable.objects<{{
      #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64"> = [#hal.executable.object<{{path = "{obj}"}}>]
    }}>
  }} {{
    stream.executable.export public @{entry} workgroups(%n: index) -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      stream.return %n, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @{entry}_workgroup(memref<{xe}>, index, memref<{we}>, index, memref<i64>, index, index, index, index, index, index, index)
        attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{entry}(%b0: !stream.binding, %b1: !stream.binding, %b2: !stream.binding, %t: index, %e: index, %k: index, %mode: index, %norm: index) {{
        %c0 = arith.constant 0 : index
        %wg = stream.dispatch.workgroup.id[0] : index
        %ne = arith.muli %t, %e : index
        %nk = arith.muli %t, %k : index
        %m0 = stream.binding.subspan %b0[%c0] : !stream.binding -> memref<?x{xe}>{{%ne}}
        %m1 = stream.binding.subspan %b1[%c0] : !stream.binding -> memref<?x{we}>{{%nk}}
        %m2 = stream.binding.subspan %b2[%c0] : !stream.binding -> memref<?xi64>{{%nk}}
        %p0, %o0, %s0, %t0 = iree_codegen.extract_strided_metadata %m0 : memref<?x{xe}> -> memref<{xe}>, index, index, index
        %p1, %o1, %s1, %t1 = iree_codegen.extract_strided_metadata %m1 : memref<?x{we}> -> memref<{we}>, index, index, index
        %p2, %o2, %s2, %t2 = iree_codegen.extract_strided_metadata %m2 : memref<?xi64> -> memref<i64>, index, index, index
        func.call @{entry}_workgroup(%p0, %o0, %p1, %o1, %p2, %o2, %t, %e, %k, %wg, %mode, %norm)
          : (memref<{xe}>, index, memref<{we}>, index, memref<i64>, index, index, index, index, index, index, index) -> ()
        return
      }}
    }}
  }}"""


def _grouped_executable(entry: str, xe: str, we: str, e: int, obj) -> str:
    """The ``stream.executable`` of grouped mode: logits, the f32 [E] bias, weights and indices bindings."""
    return f"""
  stream.executable private @{entry}_exec attributes {{
    hal.executable.objects = #hal.executable.objects<{{
      #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64"> = [#hal.executable.object<{{path = "{obj}"}}>]
    }}>
  }} {{
    stream.executable.export public @{entry} workgroups(%n: index) -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      stream.return %n, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @{entry}_workgroup(memref<{xe}>, index, memref<f32>, index, memref<{we}>, index, memref<i64>, index, index, index, index, index, index, index, index, index, index, index, index)
        attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{entry}(%b0: !stream.binding, %bb: !stream.binding, %b1: !stream.binding, %b2: !stream.binding, %t: index, %e: index, %k: index, %norm: index, %sc: index, %g: index, %kg: index, %scale: index, %eps: index, %lo: index) {{
        %c0 = arith.constant 0 : index
        %wg = stream.dispatch.workgroup.id[0] : index
        %ne = arith.muli %t, %e : index
        %nk = arith.muli %t, %k : index
        %m0 = stream.binding.subspan %b0[%c0] : !stream.binding -> memref<?x{xe}>{{%ne}}
        %mb = stream.binding.subspan %bb[%c0] : !stream.binding -> memref<{e}xf32>
        %m1 = stream.binding.subspan %b1[%c0] : !stream.binding -> memref<?x{we}>{{%nk}}
        %m2 = stream.binding.subspan %b2[%c0] : !stream.binding -> memref<?xi64>{{%nk}}
        %p0, %o0, %s0, %t0 = iree_codegen.extract_strided_metadata %m0 : memref<?x{xe}> -> memref<{xe}>, index, index, index
        %pb, %ob, %sb, %tb = iree_codegen.extract_strided_metadata %mb : memref<{e}xf32> -> memref<f32>, index, index, index
        %p1, %o1, %s1, %t1 = iree_codegen.extract_strided_metadata %m1 : memref<?x{we}> -> memref<{we}>, index, index, index
        %p2, %o2, %s2, %t2 = iree_codegen.extract_strided_metadata %m2 : memref<?xi64> -> memref<i64>, index, index, index
        func.call @{entry}_workgroup(%p0, %o0, %pb, %ob, %p1, %o1, %p2, %o2, %t, %e, %k, %wg, %norm, %sc, %g, %kg, %scale, %eps, %lo)
          : (memref<{xe}>, index, memref<f32>, index, memref<{we}>, index, memref<i64>, index, index, index, index, index, index, index, index, index, index, index, index) -> ()
        return
      }}
    }}
  }}"""


def _attrs_of(node: Node) -> tuple[int, int, str]:
    """(k, normalize, mode) of a MoERouterTopK node; BackendError naming the node when they are invalid."""
    mode = node.attr("mode", "softmax_topk")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    k, normalize = node.attr("k"), node.attr("normalize", 0)
    if mode not in MODES or k is None or int(k) < 1 or normalize not in (0, 1):
        raise BackendError(f"node {node.describe()}: k={k}, normalize={normalize}, mode='{mode}'; expected k >= 1, normalize 0|1, mode in {', '.join(MODES)}")
    return int(k), int(normalize), mode


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
    if not _last_axis(m.attr("topk_axis"), rank):
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


@rule("grouped-router")
def grouped_router(op, logits, choice, k=Const("k")):
    """GatherElements(scores, TopK(choice).indices) with scores = Sigmoid|Softmax(logits) and ``choice``
    computed from the scores (selection bias, group-limited masking), then the weights' renormalization and
    scaling -> MoERouterTopK(mode=grouped), after a check on random logits (DeepSeek-V3, GLM4-MoE, dots1,
    Ernie 4.5)."""
    scores = Or([op.Sigmoid(logits, _name="sigmoid"), op.Softmax(logits, axis=AttrVar("sm_axis", default=-1), _name="softmax")])
    _, indices = _topk(op, choice, k)
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
    if "softmax" in m and not _last_axis(m.attr("sm_axis"), 2):
        return m.fail(f"Softmax over axis {m.attr('sm_axis')}, not the expert axis", scores_node)
    if not _last_axis(m.attr("topk_axis"), 2) or not _last_axis(m.attr("gather_axis"), 2):
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
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT's own exception types
        return f"the router does not run alone: {str(e).splitlines()[0][:160]}"
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


def _last_axis(axis: int, rank: int) -> bool:
    return (axis + rank if axis < 0 else axis) == rank - 1


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
    if not _last_axis(topk_axis, rank):
        return m.fail(f"TopK over axis {topk_axis} of rank {rank}: the expert axis must be the last", topk)
    if not _last_axis(sm_axis, rank):
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
        if m.attr("keepdims") != 1 or len(axes) != 1 or not _last_axis(int(axes[0]), rank):
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
    description = "Softmax->[Cast]->TopK [->renormalize], TopK->Softmax and grouped (biased, group-limited) routers -> one MoERouterTopK op (C kernel on IREE)"
    opset_range = (13, 28)
    kernels = (KernelObject("router_topk", "iree", "llvm-cpu", "topk/router_topk.c"),)

    @property
    def rules(self):
        return [grouped_router, softmax_topk_renorm, softmax_topk, topk_softmax_renorm, topk_softmax, topk_exact]

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


def _grouped_router_model(*, e: int = 16, k: int = 4, n_group: int = 4, topk_group: int = 2, scoring: str = "sigmoid",
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


def _separated_feeds(model) -> dict[str, np.ndarray]:
    """Logits whose scores differ by at least 0.25 per row, so float16 rounding cannot create ties."""
    from rewrite.core.feeds import specs_of

    (spec,) = specs_of(model.graph.input)
    shape = [d if isinstance(d, int) else 5 for d in spec.shape]
    rng = np.random.default_rng(0)
    base = rng.permuted(np.broadcast_to(np.arange(shape[-1], dtype=np.float64), shape), axis=-1)
    return {"logits": (0.25 * base - 1.0).astype(_FLOATS[model.graph.input[0].type.tensor_type.elem_type])}


def _cases() -> list:
    from rewrite.testing.cases import negative, positive

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
    out += [positive(name, (lambda kw=kw: _grouped_router_model(**kw)), counts) for name, kw, counts in grouped]
    # sorted=0 leaves ORT's order open: fused only where nothing reads the order (the sum over the experts);
    # ONNX Runtime only (IREE 3.13 cannot compile a TopK with sorted=0)
    out.append(positive("unsorted-ids-are-graph-outputs-plain-topk", lambda: _grouped_router_model(sorted_=0),
                        {"topk-exact": 1}, backends=("ort",)))
    out += [negative(name, (lambda kw=kw: _router_model(**kw))) for name, kw in neg]
    return out
