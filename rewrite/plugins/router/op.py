"""``ai.rewrite::MoERouterTopK``, the MoE router as one abstract op: its numpy reference, its ONNX Runtime
lowering (standard ONNX) and its IREE lowering (one dispatch of ``rewrite/plugins/router/kernels/router_topk.c``).

The rules that produce it are the ``topk`` plugin's (:mod:`rewrite.plugins.router`, grouped routers in
:mod:`rewrite.plugins.router.grouped`); ``moe`` reads its routing (:mod:`rewrite.plugins.moe.semantic`).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from rewrite.core.iree_lowering import IreeLowering, PatchContext, TorchOperator, kernel_bindings
from rewrite.core.abstract_ops import AbstractOp
from rewrite.core.ir import Graph, Node
from rewrite.core.kernels import build_cpu_object, build_cuda_ptx, cpu_executable_target, kernel_source
from rewrite.core.rules import Builder
from rewrite.errors import BackendError

MAX_EXPERTS = 1024  #: the kernel keeps one f32 score per expert on the stack (passed to it with -D)
TOKENS_PER_WORKGROUP = 64  #: tokens one IREE workgroup routes
MODES = ("softmax_topk", "topk_softmax", "topk", "grouped", "sparsemixer")
SCORINGS = ("sigmoid", "softmax")  #: grouped mode's scoring functions
_FLOATS = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
CUDA_THREADS = 64  #: threads per CUDA workgroup, one token each
_KERNEL_FLAGS = (f"-DROUTER_TOPK_MAX_EXPERTS={MAX_EXPERTS}", f"-DROUTER_TOPK_TOKENS={TOKENS_PER_WORKGROUP}",
                 "-fno-tree-loop-distribute-patterns")  # no memset/memcpy calls: there is no libc to link


def ranked(scores: np.ndarray) -> np.ndarray:
    """Indices [..., E] int64 of ``scores`` [..., E] in the plain modes' order: NaN first (ONNX Runtime's TopK
    ranks NaN above every number), then values descending, then indices ascending among equals (ONNX TopK-11;
    -0 and +0 equal)."""
    nan = np.isnan(scores)
    # lexsort: the last key is the primary one, and equal keys keep their index order
    return np.lexsort((-np.where(nan, 0, scores), ~nan), axis=-1).astype(np.int64)


def router_topk_reference(logits: np.ndarray, k: int, normalize: int = 0, mode: str = "softmax_topk",
                          weights_dtype=np.float32, *, bias: np.ndarray | None = None, scoring: str = "sigmoid",
                          n_group: int = 1, topk_group: int = 1, scale: float = 1.0, norm_eps: float = 0.0,
                          norm_min: float = 0.0, jitter_eps: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    """numpy semantics of ``ai.rewrite::MoERouterTopK`` (what the C kernel computes, bit for bit on indices; in the
    plain modes NaN ranks first, as ONNX Runtime's TopK ranks it: :func:`ranked`).

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

        jitter_eps: ``sparsemixer`` mode only: PhiMoE's router (transformers 5.24 ``sparsemixer`` at inference,
            ``router_jitter_noise``; Liu et al. 2024, "GRIN: GRadient-INformed MoE", arXiv:2409.12136), k = 2::

                i1 = argmax(x) (first among equal)          m1 = x[i1]
                keep1 = not ((m1 - x) / max(|x|, m1) > 2 * jitter_eps)
                w1 = softmax(x where keep1 else -inf)[i1]
                x2 = x with x[i1] = -inf; i2 = argmax(x2)   m2 = x2[i2]
                keep2 = not ((m2 - x) / max(|x|, m2) > 2 * jitter_eps)
                w2 = softmax(x2 where keep2 else -inf)[i2]

            Everything runs in float32, also for float16 logits and a float16 threshold (its value taken exactly):
            that is what ONNX Runtime's CPU provider computes for the exported float16 graph (it has no float16
            kernels for the mask's ops and runs the chain in float32), so the mask keeps the experts it keeps. A
            runtime that rounds every step to float16 may mask an expert whose ratio lies within that rounding of
            the threshold differently. NaN ratios keep.

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
    if mode == "sparsemixer":
        if k != 2 or e < 2:
            raise ValueError(f"MoERouterTopK: sparsemixer selects k=2 of at least 2 experts, not k={k} of {e}")
        return _sparsemixer_reference(np.asarray(logits), jitter_eps, weights_dtype, softmax)
    scores = softmax(x) if mode == "softmax_topk" else x
    idx = ranked(scores)[..., :k]
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


def _sparsemixer_reference(logits: np.ndarray, jitter_eps: float, weights_dtype, softmax):
    """``sparsemixer`` mode of :func:`router_topk_reference` (logits [..., E] float16 or float32)."""
    ct = np.float32  # the mask's arithmetic type (see router_topk_reference)
    x = logits.astype(ct)
    thr = ct(np.float32(2.0) * np.float32(jitter_eps))

    def one(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i = np.argmax(scores, axis=-1)[..., None]  # first index among equal maxima (ONNX ArgMax)
        m = np.take_along_axis(scores, i, -1)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = ((m - x) / np.maximum(np.abs(x), m)).astype(ct)
        keep = ~(ratio > thr)
        w = np.take_along_axis(softmax(np.where(keep, scores, -np.inf).astype(np.float32)), i, -1)
        return w, i

    w1, i1 = one(x)
    second = x.copy()
    np.put_along_axis(second, i1, -np.inf, -1)
    w2, i2 = one(second)
    return np.concatenate([w1, w2], -1).astype(weights_dtype), np.concatenate([i1, i2], -1).astype(np.int64)


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
            (top-k of the logits, then softmax over the k), ``topk``, ``grouped`` or ``sparsemixer`` (PhiMoE, k=2).
        scoring (string), n_group, topk_group (int), scale, norm_eps, norm_min (float): grouped mode (see
            :func:`router_topk_reference`).
        jitter_eps (float): sparsemixer mode, half the relative distance to the maximum past which an expert is
            masked (see :func:`router_topk_reference`).

    Softmax is always computed in float32 (exp/sum in float64), also for float16 logits, as the seed's kernel
    does: on float16 graphs the op is more accurate than the original, whose probabilities are rounded to
    float16, so experts whose probabilities tie only after that rounding may be ordered differently.
    Semantics: :func:`router_topk_reference`. A ``moe`` plugin consuming this op may read the router's
    ``logits`` input and ``k``/``normalize`` for com.microsoft MoE/QMoE (``k``, ``normalize_routing_weights``).
    """

    ort_targets = ("cpu", "cuda")  # standard ONNX ops
    iree_targets = ("llvm-cpu", "cuda")  # a C kernel; the same source built for CUDA, one thread per token

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
            # PhiMoE: experts within a few percent of the maximum, where the mask decides
            (dict(k=2, normalize=0, mode="sparsemixer", jitter_eps=0.01), [_near_max(rng, (67, 16), np.float32)]),
            (dict(k=2, normalize=0, mode="sparsemixer", jitter_eps=0.1), [_near_max(rng, (5, 8), np.float16)]),
        ]

    def lower_ort(self, graph: Graph, node: Node) -> None:
        """Standard ONNX: Cast to f32, Softmax/TopK in the op's order, [ReduceSum, Div], Cast to the weights type;
        mode ``topk`` without renormalization is the TopK it replaced; grouped mode: see ``_grouped_onnx``;
        sparsemixer mode: ``_sparsemixer_onnx``."""
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
        if mode == "sparsemixer":
            graph.replace_node(node, _sparsemixer_onnx(graph, node, b, k))
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
        :data:`TOKENS_PER_WORKGROUP` tokens; logits are collapsed to 1-D and results expanded back. On ``cuda``:
        :func:`_lower_iree_cuda`.

        Raises:
            BackendError: dtype other than f16/f32, dynamic or too large E, k outside 1..E, unknown mode.
        """
        xt, wt, it = op.operand_types[0], op.result_types[0], op.result_types[1]
        where = f"MoERouterTopK {op.where}"
        rank, e = len(xt.dims), xt.dims[-1] if xt.dims else None
        k, normalize, mode = int(op.attrs.get("k", 0)), int(op.attrs.get("normalize", 0)), op.attrs.get("mode", "softmax_topk")
        if xt.element not in ("f16", "f32") or wt.element not in ("f16", "f32") or it.element != "si64":
            raise BackendError(f"{where}: types {xt.text} -> {wt.text}, {it.text}; expected f16|f32 -> f16|f32, si64")
        if rank < 2 or not isinstance(e, int) or not 1 <= e <= MAX_EXPERTS:
            raise BackendError(f"{where}: logits {xt.text} need rank >= 2 and a static last dim of 1..{MAX_EXPERTS}")
        if not 1 <= k <= e or mode not in MODES:
            raise BackendError(f"{where}: k={k}, mode='{mode}'; expected 1 <= k <= {e} and a mode in {', '.join(MODES)}")
        if ctx.target == "cuda":
            return _lower_iree_cuda(op, ctx, where, k, normalize, mode)
        obj = ctx.object_path(build_cpu_object(kernel_source(__file__, "router_topk.c"), extra_flags=_KERNEL_FLAGS))
        xe, we = xt.builtin_element, wt.builtin_element
        entry = f"router_topk_{xe}_{we}"
        lines, dims, t = _token_count(xt.dims, "rt")
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
            exe = f"{entry}_e{e}"  # the bias binding is [E]: one executable per E
            lines.append(
                f"    %rt_w, %rt_i = flow.dispatch @{exe}_exec::@{exe}[%rt_nwg](%rt_flat, %in1, {t}, %rt_e, %rt_k, %rt_norm, "
                f"%rt_sc, %rt_g, %rt_kg, %rt_scale, %rt_eps, %rt_lo) : (tensor<?x{xe}>{{%rt_ne}}, tensor<{e}xf32>, index, index, "
                f"index, index, index, index, index, index, index, index) -> (tensor<?x{we}>{{%rt_nk}}, tensor<?xi64>{{%rt_nk}})")
            executable = _executable(entry, xe, we, obj, bias=e, params=("norm", "sc", "g", "kg", "scale", "eps", "lo"), name=exe)
        elif mode == "sparsemixer":
            if k != 2 or e < 2:
                raise BackendError(f"{where}: sparsemixer selects k=2 of at least 2 experts, not k={k} of {e}")
            entry = exe = f"router_sparsemixer_{xe}_{we}"
            eps = float(_grouped_args(op.attrs, None)["jitter_eps"])
            thr = int(np.array(np.float32(2.0) * np.float32(eps), np.float32).view(np.uint32))
            lines += [f"    %rt_thr = arith.constant {thr} : index"]
            lines.append(
                f"    %rt_w, %rt_i = flow.dispatch @{entry}_exec::@{entry}[%rt_nwg](%rt_flat, {t}, %rt_e, %rt_k, %rt_thr)"
                f" : (tensor<?x{xe}>{{%rt_ne}}, index, index, index, index) -> (tensor<?x{we}>{{%rt_nk}}, tensor<?xi64>{{%rt_nk}})"
            )
            executable = _executable(entry, xe, we, obj, params=("thr",))
        else:
            lines.append(
                f"    %rt_w, %rt_i = flow.dispatch @{entry}_exec::@{entry}[%rt_nwg](%rt_flat, {t}, %rt_e, %rt_k, %rt_mode, %rt_norm)"
                f" : (tensor<?x{xe}>{{%rt_ne}}, index, index, index, index, index) -> (tensor<?x{we}>{{%rt_nk}}, tensor<?xi64>{{%rt_nk}})"
            )
            executable = _executable(entry, xe, we, obj)
            exe = entry
        lead = "?x" * (rank - 1)
        shape = ", ".join(dims + [str(k)])
        for name, src, res in (("%out0", "%rt_w", wt), ("%out1", "%rt_i", it)):
            el = res.builtin_element
            dyn = f"tensor<{lead}{k}x{el}>"
            lines.append(f"    {name}_x = tensor.expand_shape {src} {group} output_shape [{shape}] : tensor<?x{el}> into {dyn}")
            lines.append(f"    {name} = tensor.cast {name}_x : {dyn} to {res.builtin}")
        return IreeLowering(body="\n".join(lines), module_items={f"{exe}_exec": executable})


def _token_count(dims: list, prefix: str) -> tuple[list[str], list[str], str]:
    """MLIR lines that multiply the leading dims of logits ``dims`` ([..., E]; None for dynamic, read from
    ``%in0_d<axis>``) into the token count: (lines, the leading dims as index values, the count's SSA name)."""
    lines, values = [f"    %{prefix}_t0 = arith.constant 1 : index"], []
    for ax, d in enumerate(dims[:-1]):
        if d is None:
            values.append(f"%in0_d{ax}")
        else:
            lines.append(f"    %{prefix}_s{ax} = arith.constant {d} : index")
            values.append(f"%{prefix}_s{ax}")
        lines.append(f"    %{prefix}_t{ax + 1} = arith.muli %{prefix}_t{ax}, {values[-1]} : index")
    return lines, values, f"%{prefix}_t{len(dims) - 1}"


def _lower_iree_cuda(op: TorchOperator, ctx: PatchContext, where: str, k: int, normalize: int, mode: str) -> IreeLowering:
    """The ``cuda`` body: logits ``[..., E]`` collapsed to ``[T, E]``, one dispatch of ``router_<mode>_<x>_<w>``
    (``kernels/router_topk_cuda.cu``: ``router_topk.c`` built with nvcc, PTX for ``ctx.cuda_arch``) on
    ``ceil(T / CUDA_THREADS)`` workgroups, weights and ids ``[T, k]`` expanded back. Modes ``softmax_topk``,
    ``topk_softmax`` and ``topk`` share the ``topk`` kernel (the mode a push constant).

    Raises:
        BackendError: grouped mode without an f32 [E] bias or with invalid groups, sparsemixer with k != 2; nvcc
            failing or missing without a matching shipped PTX.
    """
    xt, wt, it = op.operand_types[0], op.result_types[0], op.result_types[1]
    rank, e = len(xt.dims), xt.dims[-1]
    xe, we = xt.builtin_element, wt.builtin_element
    lines, dims, t = _token_count(xt.dims, "rc")
    group = "[[" + ", ".join(str(a) for a in range(rank - 1)) + f"], [{rank - 1}]]"
    lead = "?" if None in xt.dims[:-1] else str(int(np.prod(xt.dims[:-1], dtype=np.int64)))
    lines += [
        f"    %rc_flat0 = tensor.collapse_shape %in0 {group} : {xt.builtin} into tensor<{lead}x{e}x{xe}>",
        f"    %rc_flat = tensor.cast %rc_flat0 : tensor<{lead}x{e}x{xe}> to tensor<?x{e}x{xe}>",
        f"    %rc_t32 = arith.index_cast {t} : index to i32",
    ]
    tensors, tensor_types = ["%rc_flat"], [f"tensor<?x{e}x{xe}>{{{t}}}"]
    consts = {"e": e, "k": k}
    if mode == "grouped":
        ga = _grouped_args(op.attrs, None)
        bt = op.operand_types[1] if len(op.operand_types) > 1 else None
        if bt is None or bt.element != "f32" or bt.dims != [e]:
            raise BackendError(f"{where}: grouped mode needs its bias as f32 [{e}], got {bt.text if bt else 'none'}")
        _validate_grouped(where, e, ga)
        bits = {n: int(np.array(ga[n], np.float32).view(np.uint32)) for n in ("scale", "norm_eps", "norm_min")}
        consts.update(normalize=normalize, scoring=SCORINGS.index(ga["scoring"]), n_group=ga["n_group"],
                      topk_group=ga["topk_group"], scale=bits["scale"], eps=bits["norm_eps"], lo=bits["norm_min"])
        tensors.append("%in1")
        tensor_types.append(f"tensor<{e}xf32>")
        kernel = "grouped"
    elif mode == "sparsemixer":
        if k != 2 or e < 2:
            raise BackendError(f"{where}: sparsemixer selects k=2 of at least 2 experts, not k={k} of {e}")
        eps = float(_grouped_args(op.attrs, None)["jitter_eps"])
        consts["thr"] = int(np.array(np.float32(2.0) * np.float32(eps), np.float32).view(np.uint32))
        kernel = "sparsemixer"
    else:
        consts.update(mode=MODES.index(mode), normalize=normalize)
        kernel = "topk"
    for name, value in consts.items():  # 32-bit push constants (bit patterns above 2^31 wrap as i32 does)
        lines.append(f"    %rc_{name} = arith.constant {np.int32(np.uint32(value)) if value >= 2**31 else value} : i32")
    entry = f"router_{kernel}_{xe}_{we}"
    ptx = ctx.object_path(build_cuda_ptx(kernel_source(__file__, "router_topk_cuda.cu"), ctx.cuda_arch))
    operands = ", ".join(tensors + ["%rc_t32"] + [f"%rc_{n}" for n in consts])
    types = ", ".join(tensor_types + ["i32"] * (1 + len(consts)))
    lines.append(f"    %rc_w, %rc_i = flow.dispatch @{entry}_cuda::@{entry}[{t}]({operands}) : ({types}) -> "
                 f"(tensor<?x{k}x{we}>{{{t}}}, tensor<?x{k}xi64>{{{t}}})")
    shape = ", ".join(dims + [str(k)])
    for name, src, res in (("%out0", "%rc_w", wt), ("%out1", "%rc_i", it)):
        el = res.builtin_element
        dyn = "tensor<" + "?x" * (rank - 1) + f"{k}x{el}>"
        lines.append(f"    {name}_x = tensor.expand_shape {src} {group} output_shape [{shape}] : tensor<?x{k}x{el}> into {dyn}")
        lines.append(f"    {name} = tensor.cast {name}_x : {dyn} to {res.builtin}")
    bindings = kernel_bindings(len(tensors), 2)
    executable = f"""
  hal.executable.source private @{entry}_cuda <objects = <{{
      #hal.executable.target<"cuda", "cuda-nvptx-fb"> = [#hal.executable.object<{{path = "{ptx}"}}>]}}>> {{
    hal.executable.export public @{entry} ordinal(0)
        layout(#hal.pipeline.layout<constants = {1 + len(consts)}, bindings = [
          {bindings}]>)
        count(%device: !hal.device, %t: index) -> (index, index, index) {{
      %x = affine.apply affine_map<()[s0] -> (s0 ceildiv {CUDA_THREADS})>()[%t]
      %c1 = arith.constant 1 : index
      hal.return %x, %c1, %c1 : index, index, index
    }} <workgroup_size = [{CUDA_THREADS} : index, 1 : index, 1 : index]>
  }}"""
    return IreeLowering(body="\n".join(lines), module_items={f"{entry}_cuda": executable})


def _near_max(rng: np.random.Generator, shape: tuple, dtype) -> np.ndarray:
    """Logits whose experts lie within a few percent of each row's maximum (positive and negative rows)."""
    top = rng.standard_normal(shape[:-1] + (1,)) * 3
    return (top * (1 - np.abs(rng.standard_normal(shape)) * 0.04 * np.sign(top))).astype(dtype)


def _grouped_args(attrs: dict, bias) -> dict:
    """Keyword arguments of :func:`router_topk_reference` for grouped and sparsemixer modes (none for the others)."""
    if attrs.get("mode") == "sparsemixer":
        return dict(jitter_eps=float(attrs.get("jitter_eps", 0.01)))
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


def _sparsemixer_onnx(graph: Graph, node: Node, b: Builder, k: int) -> list[str]:
    """Sparsemixer mode as standard ONNX in float32 (ArgMax, GatherElements, Abs, Max, Sub, Div, Greater, Where,
    Softmax, ScatterElements: transformers' exporter's spelling of PhiMoE's router), weights Cast to the output type.

    Raises:
        BackendError: k other than 2, or fewer than 2 experts (naming the node).
    """
    x = node.inputs[0]
    xv = graph.values[x]
    e = (xv.shape or [None])[-1]
    if k != 2 or (isinstance(e, int) and e < 2):
        raise BackendError(f"node {node.describe()}: sparsemixer selects k=2 of at least 2 experts, not k={k} of {e}")
    if xv.dtype != TensorProto.FLOAT:
        x = b.op("Cast", [x], to=TensorProto.FLOAT)
    eps = float(node.attr("jitter_eps", 0.01))
    thr = b.const(np.float32(2.0) * np.float32(eps), "threshold")
    neg_inf = b.const(np.array(-np.inf, np.float32), "neg_inf")
    mag = b.op("Abs", [x])

    def one(scores: str) -> tuple[str, str]:
        i = b.op("ArgMax", [scores], axis=-1, keepdims=1, select_last_index=0)
        m = b.op("GatherElements", [scores, i], axis=-1)  # the maximum (ReduceMax's axes input needs opset 18)
        masked = b.op("Greater", [b.op("Div", [b.op("Sub", [m, x]), b.op("Max", [mag, m])]), thr])
        z = b.op("Where", [masked, neg_inf, scores])
        return b.op("GatherElements", [b.op("Softmax", [z], axis=-1), i], axis=-1), i

    w1, i1 = one(x)
    w2, i2 = one(b.op("ScatterElements", [x, i1, b.op("Expand", [neg_inf, b.op("Shape", [i1])])], axis=-1))
    w = b.op("Concat", [w1, w2], axis=-1)
    wdt = graph.values[node.outputs[0]].dtype or TensorProto.FLOAT
    if wdt != TensorProto.FLOAT:
        w = b.op("Cast", [w], to=wdt)
    return [w, b.op("Concat", [i1, i2], axis=-1)]


def _executable(entry: str, xe: str, we: str, obj, *, bias: int | None = None,
                params: tuple[str, ...] = ("mode", "norm"), name: str | None = None) -> str:
    """The ``stream.executable`` ``@<name>_exec`` whose export ``@<name>`` (``name`` defaults to ``entry``; public
    symbols must stay unique when iree-compile links every llvm-cpu executable into one) calls the statically
    linked ``<entry>_workgroup`` C function.

    Bindings: logits, then (grouped mode, ``bias`` = E) the f32 [E] bias, then weights and indices; push
    constants: t, e, k and ``params``. The C signature (rewrite/plugins/router/kernels/router_topk.c ``ROUTER_ENTRY`` /
    ``GROUPED_ENTRY``): each binding's base pointer and offset, then t, e, k, the workgroup id and ``params``.
    """
    name = name or entry
    bufs = [("b0", "m0", "p0", "o0", f"?x{xe}", xe, "%ne")]
    if bias is not None:
        bufs.append(("bb", "mb", "pb", "ob", f"{bias}xf32", "f32", None))
    bufs += [("b1", "m1", "p1", "o1", f"?x{we}", we, "%nk"), ("b2", "m2", "p2", "o2", "?xi64", "i64", "%nk")]
    c_args = ", ".join(f"memref<{el}>, index" for *_, el, _n in bufs) + ", index, index, index, index" + ", index" * len(params)
    bindings = ", ".join(f"%{b}: !stream.binding" for b, *_ in bufs)
    consts = ", ".join(f"%{p}: index" for p in ("t", "e", "k") + params)
    body = []
    for b, mref, ptr, off, ty, el, n in bufs:
        dyn = f"{{{n}}}" if n else ""
        body.append(f"        %{mref} = stream.binding.subspan %{b}[%c0] : !stream.binding -> memref<{ty}>{dyn}")
    for b, mref, ptr, off, ty, el, n in bufs:
        body.append(f"        %{ptr}, %{off}, %s_{ptr}, %t_{ptr} = iree_codegen.extract_strided_metadata %{mref} : memref<{ty}> -> memref<{el}>, index, index, index")
    call_args = ", ".join(f"%{ptr}, %{off}" for _b, _m, ptr, off, *_ in bufs) + ", %t, %e, %k, %wg" + "".join(f", %{p}" for p in params)
    nl = "\n"
    return f"""
  stream.executable private @{name}_exec attributes {{
    hal.executable.objects = #hal.executable.objects<{{
      {cpu_executable_target()} = [#hal.executable.object<{{path = "{obj}"}}>]
    }}>
  }} {{
    stream.executable.export public @{name} workgroups(%n: index) -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      stream.return %n, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @{entry}_workgroup({c_args})
        attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{name}({bindings}, {consts}) {{
        %c0 = arith.constant 0 : index
        %wg = stream.dispatch.workgroup.id[0] : index
        %ne = arith.muli %t, %e : index
        %nk = arith.muli %t, %k : index
{nl.join(body)}
        func.call @{entry}_workgroup({call_args})
          : ({c_args}) -> ()
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


def last_axis(axis: int, rank: int) -> bool:
    """``axis`` (possibly negative) is the last of ``rank`` axes."""
    return (axis + rank if axis < 0 else axis) == rank - 1
