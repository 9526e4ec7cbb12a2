"""``ai.rewrite::FusedMoE``: the routed experts of one MoE block as one op, its reference and its lowerings.

Contract (inputs; T tokens, H hidden, E experts, I expert intermediate size, float = f32 or f16):

0. ``hidden`` float [T, H]
1. ``router_logits`` [T, E], hidden's dtype (LOGITS, before the softmax); with ``mode="routed"`` instead the
   mixing weights [T, k] (hidden's dtype) of the experts given by input 8, computed by the graph's own router
2. ``fc1`` [E, 2I, H]: gate rows 0..I-1 then up rows I..2I-1 (torch Linear ``[out, in]``). Float (hidden's
   dtype), or when ``block_size > 0`` UINT8 holding INT4 codes two per byte along H, even element in the low
   nibble (the ORT QMoE packing), shape [E, 2I, ceil(H/2)]
3. ``fc2`` [E, H, I] (or [E, H, ceil(I/2)] packed), the down projection
4. ``fc1_scales`` [E, 2I, ceil(H/block_size)] hidden's dtype (only when quantized)
5. ``fc1_zero_points`` UINT8 [E, 2I, ceil(H/block_size)], codes' zero point per block (optional; absent
   means 8, ORT QMoE's symmetric convention)
6. ``fc2_scales`` [E, H, ceil(I/block_size)], 7. ``fc2_zero_points`` likewise
8. ``expert_ids`` INT64 [T, k] (``mode="routed"`` only): the k distinct experts of each token
9. ``fc1_bias`` [E, 2I] hidden's dtype (optional; gate then up, as fc1's rows), 10. ``fc2_bias`` [E, H]
   (optional; added to each expert's output before its mixing weight, gpt-oss)
11. ``addend`` [T, H] hidden's dtype (optional): added to the output, each rounded to hidden's dtype as the ONNX
   Add it replaces (the residual sum after the block: the ``fused-moe-residual`` rule)
12. ``shared`` [T, H] hidden's dtype (optional): a sigmoid-gated shared expert's output, added before the addend
   (Qwen1.5-MoE's ``moe + sigmoid(gate(x)) * shared_expert(x)``: the ``fused-moe-shared`` rule);
   13. ``shared_gate`` [T, 1] hidden's dtype, its gate logit (required with ``shared``)

Attributes: ``k`` (experts per token), ``normalize`` (0/1: divide the k weights by their sum; Qwen1.5-MoE 0,
Qwen3-MoE 1), ``mode`` ("softmax_topk": softmax over E then top-k; "topk_softmax": top-k logits then softmax
over the k, which equals softmax_topk with normalize; "routed": weights and experts given, which carries every
router the graph computes itself: sigmoid and grouped routers with a selection bias and a scaling factor,
DeepSeek-V3, GLM4-MoE, dots1, Ernie 4.5), ``activation`` ("swiglu"), ``activation_alpha`` (default 1.0),
``activation_beta`` (default 0.0), ``swiglu_limit`` (default 0.0: no clamp), ``block_size`` (0 for float
weights). Output: float [T, H], hidden's dtype::

    p = softmax(logits[t]); idx = top-k(p); w = p[idx] (/ sum when normalize)     (routed: w, idx given)
    g, u = fc1[e] @ x[t] + fc1_bias[e] split in halves                            (e = idx_j)
    g = min(g, limit); u = clamp(u, -limit, limit)                               (when swiglu_limit > 0)
    out[t] = sum_j w_j * (fc2[e] @ (g * sigmoid(alpha * g) * (u + beta)) + fc2_bias[e])
    out[t] = round(round(out[t]) + round(round(sigmoid(shared_gate[t])) * shared[t]))   (with a shared expert)
    out[t] = round(round(out[t]) + addend[t])                                     (with an addend)

The activation is com.microsoft MoE/QMoE's SwiGLU (seed 003 section 8): the defaults give SiLU(gate) * up;
gpt-oss uses alpha 1.702, beta 1, limit 7. Dequantized weight = (code - zero_point) * scale per block along
the input axis (ONNX DequantizeLinear-21, seed 000 "Expert Computation (INT4 QDQ)").
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from rewrite.core.iree_lowering import IreeLowering, PatchContext, TorchOperator, cuda_executable_source, kernel_bindings
from rewrite.core.abstract_ops import AbstractOp
from rewrite.core.int4 import ORT_MAX_BLOCK, pack_int4, unpack_int4
from rewrite.core.ir import Graph, Node
from rewrite.core.kernels import build_cpu_object, build_cuda_ptx, cpu_executable_target, kernel_source
from rewrite.core.lowering import Lowering
from rewrite.core.rules import Builder
from rewrite.errors import BackendError

ROWS_PER_WORKGROUP = 32  #: ROWS in rewrite/plugins/moe/kernels/moe_cpu.c
#: THREADS, MAX_E in rewrite/plugins/moe/kernels/moe_cuda.cu
CUDA_THREADS, CUDA_MAX_E = 256, 512
#: CUDA grid: (expert, row) items per gate_up workgroup (its I rows: ceil(this / k)) and H rows per down workgroup.
#: gate_up: two passes of 8 warps, one item (gate and up rows) each; down: one row of H per warp, all k experts'
#: pieces of it in flight at once (352 gate_up and 256 down workgroups for Qwen1.5-MoE's I=1408, k=4, H=2048 at
#: T=1; BENCHMARKS.md has the configurations measured)
CUDA_GATE_ITEMS, CUDA_DOWN_ROWS = 16, 8
#: SYNC_SLOTS in moe_cuda.cu: dispatch sites of a module that take ``moe_fused`` (one launch, option
#: ``moe.launches=1``); later sites take the two kernels
CUDA_SYNC_SLOTS = 1024
#: the S of moe_cuda.cu's tensor-core exports: ``moe_gate_up_mma<S>_f16`` takes H = 1024 S (8 warps of S blocks
#: of 128 codes), ``moe_down_mma<S>_f16`` k * I up to 1024 S
MMA_GATE_STEPS, MMA_DOWN_STEPS = (1, 2, 3, 4), (2, 4, 6, 8)
#: groups of 8 gate and 8 up rows per ``moe_gate_up_mma<S>_f16`` workgroup (its routing and staging of x paid once
#: for them): at the seeds' decode shapes on an H200, 2 took a layer from 17.3 / 20.5 us to 15.7 / 16.5 at T = 1
#: (logits mode) and 3 or 4 were no better at T = 1 (BENCHMARKS.md, "two groups a workgroup")
MMA_GATE_GROUPS = 2


def cuda_mma_steps(el: str, block_size: int, H: int, I: int, k: int) -> tuple[int, int] | None:
    """The (gate_up S, down S) of the tensor-core kernel pair in moe_cuda.cu for a FusedMoE of element type ``el``
    (``"f16"``/``"f32"``), INT4 ``block_size`` (0: float experts), hidden H, expert intermediate I and top-k ``k``
    (any routing mode); None where the pair does not apply: it takes f16, blocks of exactly 128 codes, H one of
    1024 S for S in :data:`MMA_GATE_STEPS`, I a multiple of 128 and k * I at most 1024 * max(:data:`MMA_DOWN_STEPS`).
    Its grids: gate_up (T, ceil(k * I / 8 / :data:`MMA_GATE_GROUPS`)), that many groups of 8 gate and 8 up rows
    per workgroup; down (T, H / 16).
    Measured against the other pair at the seeds' decode shapes in BENCHMARKS.md ("On the tensor cores")."""
    if el != "f16" or block_size != 128 or H % 1024 or I % 128:
        return None
    gate = H // 1024
    down = next((s for s in MMA_DOWN_STEPS if k * I <= 1024 * s), None)
    return (gate, down) if gate in MMA_GATE_STEPS and down is not None else None


_FLAG = {"f16": 1, "int4": 2, "normalize": 4, "topk_softmax": 8, "zero_points": 16, "routed": 32, "bias": 64, "addend": 128,
         "shared": 256}
MODES = ("softmax_topk", "topk_softmax", "routed")
#: input positions of the contract
IDS, FC1_BIAS, FC2_BIAS, ADDEND, SHARED, SHARED_GATE = 8, 9, 10, 11, 12, 13


def dequantize(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, block: int) -> np.ndarray:
    """Float32 [E, N, k] from packed codes, per-block scales [E, N, nb] and zero points (8 when None)."""
    codes = unpack_int4(packed, k).astype(np.float32)
    zp = np.full(scales.shape, 8.0, np.float32) if zero_points is None else zero_points.astype(np.float32)
    rep = lambda a: np.repeat(a.astype(np.float32), block, axis=-1)[..., :k]  # noqa: E731
    return (codes - rep(zp)) * rep(scales)


def route(logits: np.ndarray, k: int, normalize: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(weights f32 [T, k], indices int64 [T, k]) of the contract's routing; ties pick the lower expert index."""
    z = logits.astype(np.float32)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, idx, -1)
    if normalize or mode == "topk_softmax":
        w = w / w.sum(-1, keepdims=True)
    return w, idx.astype(np.int64)


def activation_params(attrs: dict) -> tuple[float, float, float]:
    """(alpha, beta, limit) of the SwiGLU: ``activation_alpha`` (1.0), ``activation_beta`` (0.0),
    ``swiglu_limit`` (0.0 = no clamp)."""
    return (float(attrs.get("activation_alpha", 1.0)), float(attrs.get("activation_beta", 0.0)),
            float(attrs.get("swiglu_limit", 0.0)))


class FusedMoE(AbstractOp):
    """The contract in the module docstring; ORT lowering to com.microsoft MoE / QMoE (CPU and CUDA forms), IREE
    to two kernels (C for llvm-cpu, CUDA for cuda; or one CUDA launch, ``moe_fused``)."""

    ort_targets = ("cpu",)  # lower_ort; ort:cuda is lower_ort_cuda (QMoE's CUDA weight layout: seed 003 section 5.1)
    iree_targets = ("llvm-cpu",)  # C kernels; iree:cuda is lower_iree_cuda (moe_cuda.cu)

    op_type = "FusedMoE"

    def lowerings(self) -> list[Lowering]:
        return super().lowerings() + [Lowering(self.op_type, "ort", ("cuda",), self.lower_ort_cuda, origin=type(self).__module__),
                                      Lowering(self.op_type, "iree", ("cuda",), self.lower_iree_cuda, origin=type(self).__module__)]

    # ------------------------------------------------------------ reference
    def reference(self, attrs: dict, hidden, logits, fc1, fc2, s1=None, z1=None, s2=None, z2=None, ids=None,
                  b1=None, b2=None, addend=None, shared=None, shared_gate=None) -> list[np.ndarray]:
        """numpy float32 evaluation of the contract; returns [out] in hidden's dtype. ``logits`` are the mixing
        weights [T, k] and ``ids`` the experts when ``mode="routed"``; ``shared`` [T, H] gated by
        sigmoid(``shared_gate`` [T, 1]), then ``addend`` [T, H], are added last, each step rounded to hidden's
        dtype as the ONNX ops they stand for."""
        T, H = hidden.shape
        I = fc1.shape[1] // 2
        bs = int(attrs.get("block_size", 0))
        if bs:
            fc1, fc2 = dequantize(fc1, s1, z1, H, bs), dequantize(fc2, s2, z2, I, bs)
        fc1, fc2 = fc1.astype(np.float32), fc2.astype(np.float32)
        if attrs.get("mode", "softmax_topk") == "routed":
            w, idx = logits.astype(np.float32), np.asarray(ids).astype(np.int64)
        else:
            w, idx = route(logits, int(attrs["k"]), int(attrs.get("normalize", 0)), attrs.get("mode", "softmax_topk"))
        alpha, beta, limit = activation_params(attrs)
        x = hidden.astype(np.float32)
        out = np.zeros((T, H), np.float32)
        for j in range(idx.shape[1]):
            e = idx[:, j]
            gu = np.einsum("tnh,th->tn", fc1[e], x)
            if b1 is not None:
                gu = gu + b1.astype(np.float32)[e]
            g, u = gu[:, :I], gu[:, I:]
            if limit > 0:
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            a = g / (1 + np.exp(np.minimum(-alpha * g, 80.0))) * (u + beta)  # (no overflow warning)
            d = np.einsum("thi,ti->th", fc2[e], a)
            if b2 is not None:
                d = d + b2.astype(np.float32)[e]
            out += w[:, j:j + 1] * d
        dt = hidden.dtype
        out = out.astype(dt)
        if shared is not None:
            gate = (1 / (1 + np.exp(-shared_gate.astype(np.float32)))).astype(dt).astype(np.float32)
            gated = (gate * shared.astype(np.float32)).astype(dt)
            out = (out.astype(np.float32) + gated.astype(np.float32)).astype(dt)
        if addend is not None:
            out = (out.astype(np.float32) + addend.astype(np.float32)).astype(dt)
        return [out]

    # ------------------------------------------------------------------ ORT
    def lower_ort(self, graph: Graph, node: Node) -> None:
        """For the CPU execution provider: see :meth:`_lower_ort`."""
        self._lower_ort(graph, node, cuda=False)

    def lower_ort_cuda(self, graph: Graph, node: Node) -> None:
        """For the CUDA execution provider (onnxruntime-gpu 1.31, measured on an H200 against :meth:`reference`):
        QMoE gets ``weights_prepacked=0``, so the EP packs the raw [E, N, K/2] codes into its SM80 layout at
        session start (seed 003 section 5.1; the default, -1, reads them as already packed and gave rel. error
        1.5); block_size 64 or 128 only (seed 003 section 4), with zero points only where each row has 2 blocks
        or more (:func:`_ort_block`); no ``router_weights``, which this kernel ignores: the routed mode passes
        log(w) as router_probs, as for MoE (the CUDA kernel honours normalize_routing_weights=0). QMoE has no
        float32 CUDA kernel, so f32 INT4 experts are dequantized to com.microsoft MoE, which has one."""
        self._lower_ort(graph, node, cuda=True)

    def _lower_ort(self, graph: Graph, node: Node, cuda: bool) -> None:
        """com.microsoft MoE (float) or QMoE (INT4) with swiglu_fusion=1 (interleaved gate/up rows: the only
        layout ORT 1.32's CPU kernels accept) and router_probs = the logits (the op applies softmax, top-k).

        QMoE's block_size must be a power of two >= 16 dividing H and I (>= 64 with zero points, ORT docs); a
        block of the model that is not, or is larger than ORT_MAX_BLOCK, is split into smaller blocks sharing its
        scale and zero point, which is exact. When no such block exists the experts are dequantized to float and
        lowered to MoE (the plugin's report notes it). Qwen1.5-MoE's normalize=0 goes through QMoE's
        ``router_weights`` input: ORT 1.32's CPU QMoE renormalises the top-k weights even with
        normalize_routing_weights=0 (MoE does not).

        On the CPU the experts are given in reverse order (every per-expert tensor, router_probs' columns through
        a ``Slice`` with step -1): its kernels take the higher expert index first among equal probabilities
        (a descending sort of (probability, expert) pairs, onnxruntime/contrib_ops/cpu/moe/moe_cpu.cc), ONNX
        TopK the lower, so the reversal gives exact ties the model's experts.

        ``mode="routed"``: QMoE gets router_probs 0 at the given experts and -1e30 elsewhere (its top-k picks
        them) and the weights scattered into ``router_weights``. MoE has no ``router_weights``: router_probs is
        log(w) at the given experts, so its softmax yields w / sum(w), and the output is multiplied by sum(w);
        this needs weights > 0, which :func:`positive` must establish from the graph (sigmoid or softmax
        probabilities, sums and positive constants), else BackendError.

        Raises:
            BackendError: weights that are not initializers; routed float weights not provably positive.
        """
        ins = list(node.inputs) + [""] * (14 - len(node.inputs))
        hidden, logits, fc1, fc2, s1, z1, s2, z2, ids, bias1, bias2, addend, shared, shared_gate = ins
        if bool(shared) != bool(shared_gate):
            raise BackendError(f"FusedMoE {node.name}: a shared expert (input 12) needs its gate logit (input 13), and "
                               "a gate its expert")
        k, normalize = int(node.attr("k")), int(node.attr("normalize", 0))
        mode = node.attr("mode", "softmax_topk")
        if mode == "topk_softmax":
            normalize = 1  # softmax over the k selected logits == renormalised softmax probabilities
        dt = graph.values[hidden].dtype
        npdt = np.float16 if dt == TensorProto.FLOAT16 else np.float32
        bs = int(node.attr("block_size", 0))
        # ONNX TopK takes the lower index of equal values first; the CPU MoE / QMoE kernels sort (probability,
        # expert) pairs in descending order, so the higher index first. On the CPU the experts are given in
        # reverse order (each per-expert tensor and router_probs' columns), which makes its choice among equal
        # probabilities the model's. Routed selections are forced by router_probs and keep the order.
        reverse = mode != "routed" and not cuda
        order = slice(None, None, -1) if reverse else slice(None)

        def experts(name: str) -> np.ndarray | None:
            """A per-expert initializer [E, ...] in the order the kernel is given the experts."""
            a = graph.const(name)
            return None if a is None else a[order]

        w1, w2 = experts(fc1), experts(fc2)
        c1, c2 = (experts(v) if v else None for v in (bias1, bias2))
        if w1 is None or w2 is None or (bias1 and c1 is None) or (bias2 and c2 is None):
            raise BackendError(f"node {node.describe()}: FusedMoE expert weights and biases must be initializers for ONNX Runtime")
        b = Builder(graph, "lower/FusedMoE", node.order, node.name)
        alpha, beta, limit = activation_params({a: node.attr(a) for a in node.attrs})
        attrs = dict(k=k, activation_type="swiglu", normalize_routing_weights=normalize, swiglu_fusion=1,
                     activation_alpha=alpha, activation_beta=beta)
        if limit > 0:
            attrs["swiglu_limit"] = limit
        E, N1 = w1.shape[0], w1.shape[1]
        I, H = N1 // 2, w2.shape[1]
        out_shape = graph.values[node.outputs[0]].shape
        fb1 = b.const(_interleave(c1).astype(npdt), "fc1_bias") if c1 is not None else ""
        fb2 = b.const(c2.astype(npdt), "fc2_bias") if c2 is not None else ""
        qbs = _ort_block(bs, H, I, bool(z1), cuda=cuda) if bs and (dt == TensorProto.FLOAT16 or not cuda) else 0
        scale = None  # routed float MoE: the sum of the weights its softmax divided by
        if mode == "routed":
            attrs["normalize_routing_weights"] = 0
            low = -6e4 if npdt == np.float16 else -1e30  # router_probs of the experts not given: never selected (finite in f16)
            if bs and qbs and not cuda:  # (the CUDA QMoE ignores router_weights: measured, rel. error 1.4)
                probs = _scatter(b, hidden, ids, b.op("Mul", [logits, b.const(np.zeros((), npdt), "zero")], dtype=dt), E, low, dt)
                weights = _scatter(b, hidden, ids, logits, E, 0.0, dt)
            else:
                why = positive(graph, logits)
                if why:
                    raise BackendError(f"node {node.describe()}: com.microsoft {'QMoE' if bs and qbs else 'MoE'} takes routed weights as probabilities, "
                                       f"but '{logits}' is not provably positive ({why})")
                tiny = np.float32(np.finfo(npdt).smallest_subnormal if npdt == np.float16 else np.finfo(np.float32).tiny)
                logw = b.op("Log", [b.op("Max", [logits, b.const(np.asarray(tiny, npdt), "tiny")], dtype=dt)], dtype=dt)
                probs = _scatter(b, hidden, ids, logw, E, low, dt)
                scale = b.op("ReduceSum", [logits, b.const(np.array([1], np.int64), "axes")], keepdims=1, dtype=dt)
                weights = None
        elif reverse:
            last = np.array([-1], np.int64)
            probs = b.op("Slice", [logits, b.const(last, "starts"), b.const(np.array([np.iinfo(np.int64).min], np.int64), "ends"),
                                   b.const(last, "axes"), b.const(last, "steps")], dtype=dt, shape=graph.values[logits].shape)
            weights = None
        else:
            probs, weights = logits, None
        if bs and qbs:
            rep = bs // qbs
            sc1, sc2 = np.repeat(experts(s1), rep, -1), np.repeat(experts(s2), rep, -1)
            sc1, sc2 = sc1[..., : H // qbs], sc2[..., : I // qbs]
            q_ins = [hidden, probs, b.const(_interleave(w1), "fc1"), b.const(_interleave(sc1).astype(npdt), "fc1_scales"), fb1,
                     b.const(w2, "fc2"), b.const(sc2.astype(npdt), "fc2_scales"), fb2, "", "", ""]
            if z1:
                zp1 = np.repeat(experts(z1), rep, -1)[..., : H // qbs]
                zp2 = np.repeat(experts(z2), rep, -1)[..., : I // qbs]
                q_ins += [b.const(pack_int4(_interleave(zp1)), "fc1_zp"), b.const(pack_int4(zp2), "fc2_zp")]
            if weights is None and not normalize and not cuda:
                # ORT 1.32's CPU QMoE renormalises the top-k weights even with normalize_routing_weights=0
                # (measured: tests/test_plugin_moe.py); router_weights = softmax(logits) gives it the raw ones.
                weights = b.op("Softmax", [probs], axis=-1, dtype=dt)  # (probs: the logits, reversed on the CPU)
            if weights is not None:
                q_ins += [""] * (14 - len(q_ins)) + [weights]
            if cuda:
                attrs["weights_prepacked"] = 0
            out = b.op("QMoE", q_ins, domain="com.microsoft", expert_weight_bits=4, block_size=qbs, dtype=dt,
                       shape=out_shape, **attrs)
            if scale is not None:
                out = b.op("Mul", [out, scale], dtype=dt, shape=out_shape)
        else:
            if bs:
                w1 = dequantize(w1, experts(s1), experts(z1) if z1 else None, H, bs)
                w2 = dequantize(w2, experts(s2), experts(z2) if z2 else None, I, bs)
            out = b.op("MoE", [hidden, probs, b.const(_interleave(w1).astype(npdt), "fc1"), fb1, b.const(w2.astype(npdt), "fc2"), fb2],
                       domain="com.microsoft", dtype=dt, shape=out_shape, **attrs)
            if scale is not None:
                out = b.op("Mul", [out, scale], dtype=dt, shape=out_shape)
        if shared:  # the gated shared expert, as the graph had it
            gate = b.op("Sigmoid", [shared_gate], dtype=dt, shape=graph.values[shared_gate].shape)
            out = b.op("Add", [out, b.op("Mul", [gate, shared], dtype=dt, shape=out_shape)], dtype=dt, shape=out_shape)
        if addend:  # the residual sum after the block, as the graph had it
            out = b.op("Add", [out, addend], dtype=dt, shape=out_shape)
        graph.ensure_opset("com.microsoft")
        graph.replace_node(node, [out])
        graph.remove_unused_initializers()  # the FusedMoE layouts, now repacked: do not ship the weights twice

    # ----------------------------------------------------------------- IREE
    def lower_iree_cuda(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """Two dispatches of rewrite/plugins/moe/kernels/moe_cuda.cu (PTX for ``ctx.cuda_arch``), as
        :meth:`lower_iree`: ``moe_gate_up_<el>`` on (T, ceil(I / ceil(16 / k))) workgroups of 256 threads,
        ``moe_down_<el>`` on (T, ceil(H / 8)), the first gate_up workgroup of a token leaving its routing behind
        the act rows for down. With the moe plugin's option ``launches=1``, one dispatch instead:
        ``moe_fused_<el>`` on T * (ceil(I / ceil(16 / k)) + ceil(H / 8)) workgroups, the gate_up row blocks of
        every token, then the down row blocks, ordered by tickets the workgroups take as they start (down waits
        for every gate_up workgroup after issuing its first weight loads; the kernel's comment gives the argument
        that the wait ends), the act rows an f32 [T*k, I] scratch result no one reads; a launch fewer, but 16%
        more GPU time per layer at the seeds' decode shapes on an H100 (BENCHMARKS.md), and past
        :data:`CUDA_SYNC_SLOTS` sites in a module (each has its own counters) the two kernels again. With two
        launches (the default), where :func:`cuda_mma_steps` holds (f16, INT4 blocks of 128: the seeds' decode
        layers) and the option ``moe.tensor_cores`` is not false, the two kernels are the tensor-core pair
        ``moe_gate_up_mma<S>_f16`` on (T, ceil(k * I / 8 / :data:`MMA_GATE_GROUPS`)) and ``moe_down_mma<S>_f16`` on (T, H / 16), same bindings and
        constants (``moe_fused`` and the sites past its slots keep the other pair); where hidden's token count is
        statically 1 (a decode graph), down is the one-token export ``moe_down_mma<S>t1_f16`` (the same sums, its
        act values read before its weights). The INT4
        dequantization is inside the dot product (the kernel source's header gives the fast path); down adds the
        gated shared expert and the addend in its store. The scalars are i32 push constants (10; moe_fused also
        its two row-block counts and its site).

        Raises:
            BackendError: as :meth:`lower_iree`, and H or I not a multiple of 8, a block size that is not, more
                than 512 experts (the router's 16 logits per lane).
        """
        return self._lower_iree(op, ctx, cuda=True)

    def lower_iree(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """Two dispatches of rewrite/plugins/moe/kernels/moe_cpu.c: ``moe_gate_up_swiglu`` on a (T*k, ceil(I/32)) grid
        into an f32 [T*k, I] scratch, then ``moe_down_proj_reduce`` on (T, ceil(H/32)) into [T, H]; each
        workgroup recomputes its token's routing (E logits, negligible next to its dot products) or, routed,
        reads it. Absent optional inputs (imported as ``!torch.none``) become 1-element placeholders.

        Raises:
            BackendError: a target other than llvm-cpu, dynamic H/E/I, k outside the kernel's range, an INT4
                op without both scales or with one zero point of two, a routed op without expert ids.
        """
        return self._lower_iree(op, ctx, cuda=False)

    def _lower_iree(self, op: TorchOperator, ctx: PatchContext, cuda: bool) -> IreeLowering:
        if ctx.target != ("cuda" if cuda else "llvm-cpu"):
            raise BackendError(f"FusedMoE lowering for {'cuda' if cuda else 'llvm-cpu'} asked for target '{ctx.target}'")
        if cuda:
            obj = ctx.object_path(build_cuda_ptx(kernel_source(__file__, "moe_cuda.cu"), ctx.cuda_arch))
        else:
            obj = ctx.object_path(build_cpu_object(kernel_source(__file__, "moe_cpu.c")))
        tys = list(op.operand_types) + [None] * (14 - len(op.operand_types))
        present = [t is not None and t.element != "none" for t in tys]
        el = tys[0].builtin_element
        mode = op.attrs.get("mode", "softmax_topk")
        routed = mode == "routed"
        k, bs = int(op.attrs["k"]), int(op.attrs.get("block_size", 0))
        H = tys[0].dims[1]
        I = None if tys[2].dims[1] is None else tys[2].dims[1] // 2
        E = tys[2].dims[0]
        if routed and not present[IDS]:
            raise BackendError("FusedMoE mode 'routed' needs its expert ids (input 8)")
        if bs and not (present[4] and present[6] and present[5] == present[7]):
            raise BackendError("FusedMoE with block_size > 0 needs both scales (inputs 4, 6) and both zero points "
                               "(5, 7) or neither on IREE")
        if None in (H, E, I) or not 1 <= k <= min(64, E):
            raise BackendError(f"FusedMoE: H, E, I must be static and 1 <= k <= min(64, E) (got H={H}, E={E}, I={I}, k={k})")
        if cuda and (E > CUDA_MAX_E or H % 8 or I % 8 or (bs and bs % 8)):
            raise BackendError(f"FusedMoE on cuda: H={H}, I={I}, E={E}, block_size={bs}; the kernels take E <= "
                               f"{CUDA_MAX_E}, H and I multiples of 8 and a block size that is one")
        bias = present[FC1_BIAS] or present[FC2_BIAS]
        if bias and not (present[FC1_BIAS] and present[FC2_BIAS]):
            raise BackendError("FusedMoE on IREE takes both expert biases (inputs 9 and 10) or neither")
        flags = (_FLAG["f16"] if el == "f16" else 0) | (_FLAG["int4"] if bs else 0)
        flags |= _FLAG["normalize"] if int(op.attrs.get("normalize", 0)) else 0
        flags |= _FLAG["topk_softmax"] if mode == "topk_softmax" else 0
        flags |= (_FLAG["zero_points"] if bs and present[5] else 0) | (_FLAG["routed"] if routed else 0) | (_FLAG["bias"] if bias else 0)
        addend = present[ADDEND]
        if addend and (tys[ADDEND].dims[1:] != [H] or tys[ADDEND].element != tys[0].element
                       or None not in (tys[ADDEND].dims[0], tys[0].dims[0]) and tys[ADDEND].dims[0] != tys[0].dims[0]):
            raise BackendError(f"FusedMoE {op.where}: addend {tys[ADDEND].text} with hidden {tys[0].text}: the addend "
                               f"[T, {H}] of hidden's T and type expected")
        flags |= _FLAG["addend"] if addend and cuda else 0
        shared = present[SHARED]
        if shared != present[SHARED_GATE]:
            raise BackendError(f"FusedMoE {op.where}: a shared expert (input 12) needs its gate logit (input 13), and "
                               "a gate its expert")
        if shared and (tys[SHARED].dims[1:] != [H] or tys[SHARED_GATE].dims[1:] != [1]
                       or {tys[SHARED].element, tys[SHARED_GATE].element} != {tys[0].element}):
            raise BackendError(f"FusedMoE {op.where}: shared expert {tys[SHARED].text} and gate {tys[SHARED_GATE].text} "
                               f"with hidden {tys[0].text}: [T, {H}] and [T, 1] of hidden's type expected")
        flags |= _FLAG["shared"] if shared and cuda else 0
        alpha, beta, limit = (_f32_bits(v) for v in activation_params(op.attrs))
        wel = "i8" if bs else el
        names = ("fc1", "fc2", "s1", "z1", "s2", "z2", "ids", "b1", "b2")
        elements = {"fc1": wel, "fc2": wel, "s1": el, "z1": "i8", "s2": el, "z2": "i8", "ids": "i64", "b1": el, "b2": el}
        # static element counts of the weight bindings (the ids are sized by the token count at run time)
        S = {n: int(np.prod(tys[kk].dims)) if present[kk] and n != "ids" else 1 for n, kk in zip(names, range(2, 11))}
        L = k if routed else E  # columns of input 1: routed weights [T, k] or logits [T, E]
        rows1, rows2 = (-(-CUDA_GATE_ITEMS // k), CUDA_DOWN_ROWS) if cuda else (ROWS_PER_WORKGROUP, ROWS_PER_WORKGROUP)
        moe_opts = ctx.options.get("moe") or {}  # the moe plugin's options (checked there)
        launches = moe_opts.get("launches", 2)
        mma = cuda_mma_steps(el, bs, H, I, k) if cuda and launches == 2 and moe_opts.get("tensor_cores", True) else None
        # gate_up: ceil(I / rows1) row blocks of every expert slot, or (mma) MMA_GATE_GROUPS of the k * I / 8 groups
        # of 8 rows a workgroup; down: H rows
        nb1, nb2 = (-(-I // rows1), -(-H // rows2)) if mma is None else (-(-(k * I // 8) // MMA_GATE_GROUPS), H // 16)
        # act: the [T*k, I] SwiGLU rows; on cuda 2*T*k more floats behind them, where gate_up leaves the
        # routing (k weights, k ids) for down (moe_cuda.cu's header)
        consts = {f"%c{k}k": k, "%cH": H, "%cE": E, "%cI": I, "%cIa": I + 2 if cuda else I, "%cL": L, "%cbs": bs, "%cfl": flags,
                  "%nb1": nb1, "%nb2": nb2, "%cal": alpha, "%cbe": beta,
                  "%cli": limit}
        lines = [f"    {n} = arith.constant {v} : index" for n, v in consts.items()]
        lines += ["    %moe_c0 = arith.constant 0 : index",
                  f"    %t = tensor.dim %in0, %moe_c0 : {tys[0].builtin}",
                  f"    %tk = arith.muli %t, %c{k}k : index",
                  "    %th = arith.muli %t, %cH : index", "    %tl = arith.muli %t, %cL : index",
                  "    %tki = arith.muli %tk, %cIa : index"]
        for name, kk, e in (("x", 0, el), ("l", 1, el), ("ids", IDS, "i64")):  # [T, n] -> tensor<?xel>
            if name == "ids" and not routed:
                continue
            t = tys[kk]
            if t.dims[0] is None:
                lines.append(f"    %{name} = tensor.collapse_shape %in{kk} [[0, 1]] : {t.builtin} into tensor<?x{e}>")
            else:
                lines.append(f"    %{name}_s = tensor.collapse_shape %in{kk} [[0, 1]] : {t.builtin} into tensor<{t.dims[0] * t.dims[1]}x{e}>")
                lines.append(f"    %{name} = tensor.cast %{name}_s : tensor<{t.dims[0] * t.dims[1]}x{e}> to tensor<?x{e}>")
        for n, kk in zip(names, range(2, 11)):
            if n == "ids":
                if not routed:
                    lines.append("    %ids = arith.constant dense<[0, 1]> : tensor<2xi64>")  # not a splat (above)
                continue
            if present[kk] and (n in ("fc1", "fc2") or (bs and n[0] in "sz") or (bias and n[0] == "b")):
                rank = len(tys[kk].dims)
                lines.append(f"    %{n} = tensor.collapse_shape %in{kk} [[{', '.join(map(str, range(rank)))}]] : "
                             f"{tys[kk].builtin} into tensor<{S[n]}x{elements[n]}>")
            else:
                # a placeholder the kernels never read, each of its own size (equal constants would be one value,
                # bound twice in moe_fused) and not a splat (iree-compile fills a splat at every call: a launch)
                S[n] = 2 + names.index(n)
                vals = ", ".join(str(v) if elements[n] in ("i8", "i64") else f"{v}.0" for v in range(S[n]))
                lines.append(f"    %{n} = arith.constant dense<[{vals}]> : tensor<{S[n]}x{elements[n]}>")
        ids_t = "tensor<?xi64>{%tk}" if routed else "tensor<2xi64>"
        if cuda:  # the shared expert and its gate logit ([T, H], [T, 1]) for the down half, or placeholders
            for n, kk, size in (("sh", SHARED, "%th"), ("sg", SHARED_GATE, "%t")):
                if shared:
                    t = tys[kk]
                    flat = "?" if t.dims[0] is None else str(t.dims[0] * t.dims[1])
                    lines.append(f"    %{n}_s = tensor.collapse_shape %in{kk} [[0, 1]] : {t.builtin} into tensor<{flat}x{el}>")
                    lines.append(f"    %{n} = tensor.cast %{n}_s : tensor<{flat}x{el}> to tensor<?x{el}>")
                    S[n] = size
                else:  # not a splat and of its own size (above)
                    S[n] = 2 + len(names) + (n == "sg")
                    lines.append(f"    %{n} = arith.constant dense<[{', '.join(f'{v}.0' for v in range(S[n]))}]> : tensor<{S[n]}x{el}>")
            shared_types = ", ".join(f"tensor<?x{el}>{{{S[n]}}}" if shared else f"tensor<{S[n]}x{el}>" for n in ("sh", "sg"))
        scalar_names = ["%t", "%cH", "%cI", "%cE", f"%c{k}k", "%cbs", "%cfl", "%cal", "%cbe", "%cli"]
        st = "index"
        if cuda:  # push constants: 32-bit
            st = "i32"
            lines += [f"    {n}_i32 = arith.index_cast {n} : index to i32" for n in scalar_names]
            scalar_names = [f"{n}_i32" for n in scalar_names]
        scalars = ", ".join(scalar_names)
        # named by every binding size its executable declares (one module may hold FusedMoE ops of several shapes)
        name = (f"moe_exec_{el}_{wel}_{'r' if routed else 'l'}_{S['fc1']}_{S['s1']}_{S['z1']}_{S['fc2']}_{S['s2']}_{S['z2']}"
                f"_{S['b1']}_{S['b2']}{'_sh' if shared else ''}")
        if launches not in (1, 2) or isinstance(launches, bool):
            raise BackendError(f"FusedMoE {op.where}: option moe.launches={launches!r}; 1 or 2 expected")
        # one sequence per module: iree-compile merges the equal moe_fused executables into one PTX module
        site = ctx.next_site("moe_fused") if cuda and launches == 1 else CUDA_SYNC_SLOTS
        if site < CUDA_SYNC_SLOTS:
            return self._fused_cuda(op, lines, name, obj, el, wel, S, ids_t, shared_types, scalars, site, H, addend)
        lines.append(
            f"    %act = flow.dispatch @moe_exec::@gate_up[{'%t' if cuda else '%tk'}, %nb1](%x, %l, %ids, %fc1, %s1, %z1, %b1, {scalars}) : "
            f"(tensor<?x{el}>{{%th}}, tensor<?x{el}>{{%tl}}, {ids_t}, tensor<{S['fc1']}x{wel}>, tensor<{S['s1']}x{el}>, "
            f"tensor<{S['z1']}xi8>, tensor<{S['b1']}x{el}>, {', '.join([st] * 10)}) -> tensor<?xf32>{{%tki}}")
        if addend and cuda:  # down's output is the addend, tied in place: the kernel adds to it (flag ADDEND)
            lines += _flat_addend(tys[ADDEND], H, el)
            down_out, down_arg = "%ad{%th}", ", %ad"
            down_type = f", tensor<?x{el}>{{%th}}"
        else:
            down_out, down_arg, down_type = f"tensor<?x{el}>{{%th}}", "", ""
        lines.append(
            f"    %o = flow.dispatch @moe_exec::@down[%t, %nb2](%l, %ids, %act, %fc2, %s2, %z2, %b2{', %sh, %sg' if cuda else ''}"
            f"{down_arg}, {scalars}) : "
            f"(tensor<?x{el}>{{%tl}}, {ids_t}, tensor<?xf32>{{%tki}}, tensor<{S['fc2']}x{wel}>, tensor<{S['s2']}x{el}>, "
            f"tensor<{S['z2']}xi8>, tensor<{S['b2']}x{el}>{', ' + shared_types if cuda else ''}{down_type}, "
            f"{', '.join([st] * 10)}) -> {down_out}")
        lines.append(f"    %o2 = tensor.expand_shape %o [[0, 1]] output_shape [%t, {H}] : tensor<?x{el}> into tensor<?x{H}x{el}>")
        if (addend or shared) and not cuda:  # the C kernel writes the sum of the experts; the rest after it
            lines.append(_cpu_tail(tys, H, el, addend, shared))
        else:
            lines.append(f"    %o3 = tensor.cast %o2 : tensor<?x{H}x{el}> to tensor<?x{H}x{el}>")
        lines.append(f"    %out0 = tensor.cast %o3 : tensor<?x{H}x{el}> to {op.result_types[0].builtin}")
        # decode (hidden's token count statically 1): down's one-token export, its act values read before its weights
        one_token = mma is not None and tys[0].dims[0] == 1
        gate_k, down_k = (f"moe_gate_up_{el}", f"moe_down_{el}") if mma is None else \
            (f"moe_gate_up_mma{mma[0]}_{el}", f"moe_down_mma{mma[1]}{'t1' if one_token else ''}_{el}")
        name += "" if mma is None else f"_mma{mma[0]}{mma[1]}{'t1' if one_token else ''}"
        body = "\n".join(lines).replace("@moe_exec::", f"@{name}::")
        if cuda:  # a PTX export is named after its kernel
            body = body.replace(f"@{name}::@gate_up", f"@{name}::@{gate_k}").replace(f"@{name}::@down", f"@{name}::@{down_k}")
        else:  # exports named after their executable: iree-compile links the llvm-cpu executables into one
            body = body.replace(f"@{name}::@gate_up", f"@{name}::@{name}_gate_up").replace(f"@{name}::@down", f"@{name}::@{name}_down")
        exe = _cuda_executable(name, obj, gate_k, down_k) if cuda else _executable(name, obj, el, wel, S, routed)
        return IreeLowering(body=body, module_items={name: exe})

    @staticmethod
    def _fused_cuda(op: TorchOperator, lines: list[str], name: str, obj: str, el: str, wel: str, S: dict,
                    ids_t: str, shared_types: str, scalars: str, site: int, H: int, addend: bool) -> IreeLowering:
        """``lines`` (the operands as :meth:`_lower_iree` prepared them) and one ``moe_fused_<el>`` dispatch on a
        1-D grid of T * (gy1 + gy2) workgroups; with an addend, the output is the addend tied in place (flag
        ADDEND). Bindings: the 11 inputs, the shared expert and its gate, then the output, then the act scratch."""
        lines = list(lines)
        lines += ["    %gsum = arith.addi %nb1, %nb2 : index", "    %g = arith.muli %t, %gsum : index"]
        lines += [f"    {n}_i32 = arith.index_cast {n} : index to i32" for n in ("%nb1", "%nb2")]
        lines.append(f"    %site_i32 = arith.constant {site} : i32")
        ins = "%x, %l, %ids, %fc1, %s1, %z1, %b1, %fc2, %s2, %z2, %b2, %sh, %sg"
        in_types = (f"tensor<?x{el}>{{%th}}, tensor<?x{el}>{{%tl}}, {ids_t}, tensor<{S['fc1']}x{wel}>, tensor<{S['s1']}x{el}>, "
                    f"tensor<{S['z1']}xi8>, tensor<{S['b1']}x{el}>, tensor<{S['fc2']}x{wel}>, tensor<{S['s2']}x{el}>, "
                    f"tensor<{S['z2']}xi8>, tensor<{S['b2']}x{el}>, {shared_types}")
        if addend:
            lines += _flat_addend(op.operand_types[ADDEND], H, el)
            ins += ", %ad"
            in_types += f", tensor<?x{el}>{{%th}}"
            out = "%ad{%th}"
        else:
            out = f"tensor<?x{el}>{{%th}}"
        lines.append(f"    %o, %act = flow.dispatch @{name}_fused::@moe_fused_{el}[%g]({ins}, {scalars}, %nb1_i32, %nb2_i32, "
                     f"%site_i32) : ({in_types}, {', '.join(['i32'] * 13)}) -> ({out}, tensor<?xf32>{{%tki}})")
        lines.append(f"    %o2 = tensor.expand_shape %o [[0, 1]] output_shape [%t, {H}] : tensor<?x{el}> into tensor<?x{H}x{el}>")
        lines.append(f"    %out0 = tensor.cast %o2 : tensor<?x{H}x{el}> to {op.result_types[0].builtin}")
        exe = cuda_executable_source(f"{name}_fused", obj, [f"moe_fused_{el}"], 13, 2, 13, CUDA_THREADS, grid=1)
        return IreeLowering(body="\n".join(lines), module_items={f"{name}_fused": exe})


def _cpu_tail(tys: list, H: int, el: str, addend: bool, shared: bool) -> str:
    """``%o3`` [T, H] from the C kernels' ``%o2``: plus the gated shared expert, then the addend, each step in
    hidden's type ``el`` as the ONNX Sigmoid, Mul and Adds compute it (the sigmoid in f32, rounded to ``el``)."""
    ins, types, maps, args, lines = ["%o2"], [f"tensor<?x{H}x{el}>"], ["(t, h)"], [f"%ya: {el}"], []
    for use, kk, nm, shape, m in ((shared, SHARED, "sh3", f"?x{H}", "(t, h)"), (shared, SHARED_GATE, "sg3", "?x1", "(t, 0)"),
                                  (addend, ADDEND, "ad3", f"?x{H}", "(t, h)")):
        if use:
            lines.append(f"    %{nm} = tensor.cast %in{kk} : {tys[kk].builtin} to tensor<{shape}x{el}>")
            ins.append(f"%{nm}"), types.append(f"tensor<{shape}x{el}>"), maps.append(m), args.append(f"%y_{nm}: {el}")
    body, y = [], "%ya"
    if shared:
        g = "%y_sg3"
        if el != "f32":
            body.append(f"%g32 = arith.extf %y_sg3 : {el} to f32")
            g = "%g32"
        body += [f"%gn = arith.negf {g} : f32", "%ge = math.exp %gn : f32", "%one = arith.constant 1.0 : f32",
                 "%gd = arith.addf %one, %ge : f32", "%gs = arith.divf %one, %gd : f32"]
        gr = "%gs"
        if el != "f32":
            body.append(f"%gr = arith.truncf %gs : f32 to {el}")
            gr = "%gr"
        body += [f"%gm = arith.mulf {gr}, %y_sh3 : {el}", f"%ys1 = arith.addf %ya, %gm : {el}"]
        y = "%ys1"
    if addend:
        body.append(f"%ys2 = arith.addf {y}, %y_ad3 : {el}")
        y = "%ys2"
    maps.append("(t, h)")
    text = "\n".join(f"      {line}" for line in body)
    lines += [f"    %tail_e = tensor.empty(%t) : tensor<?x{H}x{el}>",
              "    %o3 = linalg.generic {indexing_maps = [" + ", ".join(f"affine_map<(t, h) -> {m}>" for m in maps)
              + "], iterator_types = [\"parallel\", \"parallel\"]}\n"
              f"        ins({', '.join(ins)} : {', '.join(types)}) outs(%tail_e : tensor<?x{H}x{el}>) {{\n"
              f"    ^bb0({', '.join(args)}, %yo: {el}):\n{text}\n      linalg.yield {y} : {el}\n    }} -> tensor<?x{H}x{el}>"]
    return "\n".join(lines)


def _flat(t, H: int) -> str:
    """The flattened length of a [T, H] operand's type: ``?`` when T is dynamic."""
    return "?" if t.dims[0] is None else str(t.dims[0] * H)


def _flat_addend(t, H: int, el: str) -> list[str]:
    """MLIR lines making ``%ad`` (``tensor<?xEL>``): the [T, H] addend operand flattened, for the down kernel
    that adds its sum to it in place."""
    return [f"    %ad_s = tensor.collapse_shape %in{ADDEND} [[0, 1]] : {t.builtin} into tensor<{_flat(t, H)}x{el}>",
            f"    %ad = tensor.cast %ad_s : tensor<{_flat(t, H)}x{el}> to tensor<?x{el}>"]


def _f32_bits(v: float) -> int:
    """The bits of ``v`` as float32, as an unsigned integer (how the kernels receive float parameters)."""
    return int(np.array(v, np.float32).view(np.uint32))


def _executable(name: str, obj: str, el: str, wel: str, S: dict[str, int], routed: bool) -> str:
    """The stream.executable with the two exports (``<name>_gate_up``, ``<name>_down``: public symbols stay unique
    when iree-compile links every llvm-cpu executable into one) calling the statically linked kernels (bareptr
    ABI)."""
    # (element type, size: static int or an SSA dim computed in the function) of each binding, output last
    ids = ("i64", "%tk" if routed else 2)
    gate_up = [(el, "%th"), (el, "%tl"), ids, (wel, S["fc1"]), (el, S["s1"]), ("i8", S["z1"]), (el, S["b1"]), ("f32", "%tki")]
    down = [(el, "%tl"), ids, ("f32", "%tki"), (wel, S["fc2"]), (el, S["s2"]), ("i8", S["z2"]), (el, S["b2"]), (el, "%th")]
    scalars = ["%t", "%h", "%i", "%e", "%k", "%bs", "%fl", "%al", "%be", "%li"]
    exports, funcs = [], []
    for export, kernel, bindings in ((f"{name}_gate_up", "moe_gate_up_swiglu", gate_up), (f"{name}_down", "moe_down_proj_reduce", down)):
        args = [f"%b{i}: !stream.binding" for i in range(len(bindings))] + [f"{a}: index" for a in scalars]
        body = ["        %c0 = arith.constant 0 : index",
                "        %wx = stream.dispatch.workgroup.id[0] : index", "        %wy = stream.dispatch.workgroup.id[1] : index",
                "        %tk = arith.muli %t, %k : index", "        %th = arith.muli %t, %h : index",
                f"        %tl = arith.muli %t, {'%k' if routed else '%e'} : index", "        %tki = arith.muli %tk, %i : index"]
        call_args, call_types = [], []
        for j, (etype, size) in enumerate(bindings):
            dyn = isinstance(size, str)
            mt = f"memref<?x{etype}>" if dyn else f"memref<{size}x{etype}>"
            body.append(f"        %m{j} = stream.binding.subspan %b{j}[%c0] : !stream.binding -> {mt}" + (f"{{{size}}}" if dyn else ""))
            body.append(f"        %p{j}, %o{j}, %s{j}, %t{j} = iree_codegen.extract_strided_metadata %m{j} : {mt} -> memref<{etype}>, index, index, index")
            call_args += [f"%p{j}", f"%o{j}"]
            call_types += [f"memref<{etype}>", "index"]
        call_args += ["%h", "%i", "%e", "%k", "%bs", "%fl", "%al", "%be", "%li", "%wx", "%wy"]
        call_types += ["index"] * 11
        body.append(f"        func.call @{kernel}({', '.join(call_args)}) : ({', '.join(call_types)}) -> ()")
        body.append("        return")
        exports.append(f"    stream.executable.export public @{export} workgroups(%gx: index, %gy: index) -> (index, index, index) {{\n"
                       f"      %c1 = arith.constant 1 : index\n      stream.return %gx, %gy, %c1 : index, index, index\n    }}")
        funcs.append(f"      func.func private @{kernel}({', '.join(call_types)}) attributes {{hal.import.static, llvm.bareptr = true}}\n"
                     f"      func.func @{export}({', '.join(args)}) {{\n" + "\n".join(body) + "\n      }")
    return (f"  stream.executable private @{name} attributes {{\n"
            f"    hal.executable.objects = #hal.executable.objects<{{\n"
            f"      {cpu_executable_target()} = [#hal.executable.object<{{path = \"{obj}\"}}>]\n"
            f"    }}>\n  }} {{\n" + "\n".join(exports) + "\n    builtin.module {\n" + "\n".join(funcs) + "\n    }\n  }")




def _cuda_executable(name: str, obj: str, gate_up: str, down: str) -> str:
    """The ``hal.executable.source`` declaring the PTX kernels ``gate_up`` (``moe_gate_up_<el>`` or a tensor-core
    ``moe_gate_up_mma<S>_f16``: 7 bindings read, the act rows written) and ``down`` (``moe_down_<el>``,
    ``moe_down_mma<S>_f16`` or its one-token ``moe_down_mma<S>t1_f16``: 9 read: the routed weights or logits, the ids, act, the down weights, the shared
    expert and its gate; the output written), 10 i32 push constants, workgroups of CUDA_THREADS threads on the
    grid the dispatch's workload gives (tokens, row blocks)."""
    exports = []
    for ordinal, (export, read) in enumerate(((gate_up, 7), (down, 9))):
        exports.append(f"""    hal.executable.export public @{export} ordinal({ordinal})
        layout(#hal.pipeline.layout<constants = 10, bindings = [{kernel_bindings(read, 1)}]>)
        count(%device: !hal.device, %gx: index, %gy: index) -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      hal.return %gx, %gy, %c1 : index, index, index
    }} <workgroup_size = [{CUDA_THREADS} : index, 1 : index, 1 : index]>""")
    src = "\n".join(exports)
    return (f"  hal.executable.source private @{name} <objects = <{{\n"
            f"      #hal.executable.target<\"cuda\", \"cuda-nvptx-fb\"> = [#hal.executable.object<{{path = \"{obj}\"}}>]}}>> {{\n"
            f"{src}\n  }}")


def _ort_block(bs: int, h: int, i: int, zero_points: bool, cuda: bool = False) -> int:
    """Largest power-of-two block dividing ``bs``, H and I that QMoE accepts: on the CPU EP <= ORT_MAX_BLOCK
    and >= 16 (>= 64 with zero points); on the CUDA EP 64 or 128, and with zero points an even number of blocks
    along both H and I (onnxruntime-gpu 1.31.1 on an H200, examples/gpu_check.py samples: 11 blocks along I,
    as H=2048, I=704 with block 64 or I=1408 with block 128, and 1 block, as H=256, I=128 with block 128, give
    rel. errors of 0.3-1.6 with zero points, while the CPU EP computes the same QMoE to 1e-4; 6, 12 and 22
    blocks, and any count without zero points, are right). 0 if none."""
    if cuda:
        fits = lambda q: bs % q == 0 and h % q == 0 and i % q == 0 and (not zero_points or (h // q) % 2 == (i // q) % 2 == 0)  # noqa: E731
        return next((q for q in (128, 64) if fits(q)), 0)
    q = min(bs & -bs, ORT_MAX_BLOCK)  # bs & -bs: largest power of two dividing bs (96 -> 32)
    while q >= (64 if zero_points else 16):
        if h % q == 0 and i % q == 0:
            return q
        q //= 2
    return 0


def _scatter(b: Builder, hidden: str, ids: str, values: str, experts: int, fill: float, dt: int) -> str:
    """[T, E] of ``fill`` with ``values`` [T, k] at columns ``ids`` [T, k] (ScatterElements, axis 1)."""
    npdt = np.float16 if dt == TensorProto.FLOAT16 else np.float32
    rows = b.op("Slice", [b.op("Shape", [hidden]), b.const(np.array([0], np.int64), "s0"), b.const(np.array([1], np.int64), "s1")])
    shape = b.op("Concat", [rows, b.const(np.array([experts], np.int64), "experts")], axis=0)
    base = b.op("ConstantOfShape", [shape], value=numpy_helper.from_array(np.array([fill], npdt)), dtype=dt)
    return b.op("ScatterElements", [base, ids, values], axis=1, dtype=dt)


#: ops through which a positive input stays positive (data input 0), and positive sources
_KEEPS_SIGN = frozenset({"Gather", "GatherElements", "GatherND", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Cast",
                         "Identity", "Expand", "Transpose", "Slice", "Tile", "Concat", "ReduceSum", "ReduceMax", "Relu6"})
_POSITIVE = frozenset({"Sigmoid", "Softmax", "Exp"})


def positive(graph: Graph, value: str, depth: int = 24) -> str | None:
    """None when ``value`` is provably > 0 from how the graph computes it (Sigmoid, Softmax, Exp; kept by
    selection and reshaping ops, ReduceSum, TopK values, Mul/Div of positives, Add of a positive and a
    non-negative, Clip or Max with a positive lower bound); else the reason, naming the node."""
    if depth == 0:
        return f"'{value}' is computed too far from a sigmoid or softmax"
    c = graph.const(value)
    if c is not None:
        return None if c.size and float(np.min(c)) > 0 else f"constant '{value}' is not positive"
    n = graph.producer_node(value)
    if n is None:
        return f"'{value}' is a graph input"
    if n.op_type in _POSITIVE:
        return None
    if n.op_type == "TopK" and value == n.outputs[0]:
        return positive(graph, n.inputs[0], depth - 1)
    if n.op_type in _KEEPS_SIGN:
        inputs = [i for i in n.inputs if i] if n.op_type == "Concat" else n.inputs[:1]
        return next((r for r in (positive(graph, i, depth - 1) for i in inputs) if r), None)
    if n.op_type in ("Mul", "Div"):
        return next((r for r in (positive(graph, i, depth - 1) for i in n.inputs) if r), None)
    if n.op_type == "Add":
        nonneg = [i for i in n.inputs if (graph.const(i) is not None and float(np.min(graph.const(i))) >= 0)]
        rest = [i for i in n.inputs if i not in nonneg]
        if len(rest) == 1 or (not rest and nonneg):
            return positive(graph, rest[0], depth - 1) if rest else None
        return next((r for r in (positive(graph, i, depth - 1) for i in rest) if r), None)
    if n.op_type in ("Clip", "Max"):
        bound = n.inputs[1] if n.op_type == "Clip" and len(n.inputs) > 1 else None
        if n.op_type == "Max":
            return None if any(positive(graph, i, depth - 1) is None for i in n.inputs) else f"{n.describe()} of non-positive values"
        c = graph.const(bound) if bound else None
        if c is not None and float(np.min(c)) > 0:
            return None
        return positive(graph, n.inputs[0], depth - 1)
    return f"{n.describe()} may give values <= 0"


def _interleave(a: np.ndarray) -> np.ndarray:
    """[E, 2I, ...] gate rows then up rows -> rows g0, u0, g1, u1, ... (ORT swiglu_fusion=1)."""
    n = a.shape[1] // 2
    out = np.empty_like(a)
    out[:, 0::2], out[:, 1::2] = a[:, :n], a[:, n:]
    return out
