"""``ai.rewrite::GroupedAttention``: scaled dot-product attention with grouped K/V heads, its reference and lowerings.

Contract (inputs; float = f32 or f16, one type for all; B batch, T query rows, S key positions, D head size):

0. ``Q`` float [B, Hq, T, D]
1. ``K`` float [B, Hkv, S, D] with Hq a multiple of Hkv: query head h reads K/V head h // (Hq / Hkv) (the grouping
   transformers' ``repeat_kv`` writes as Unsqueeze, Expand and Reshape; Hq = Hkv is plain multi-head attention)
2. ``V`` float [B, Hkv, S, D]
3. ``mask`` (optional) float [Bm, Hm, Tm, S], added to the scaled scores; Bm in (1, B), Hm in (1, Hq), Tm in (1, T)
   broadcast (ONNX multidirectional broadcasting); -inf hides a position
4. ``K_new`` (optional, with 5 and 6) float [B, Hkv, n, D], n <= S: this call's new key rows
5. ``V_new`` (optional) float [B, Hkv, n, D]
6. ``position`` (optional) int64, one element ([1] or []): with 4-6 the keys and values read are K and V with rows
   ``p .. p + n`` replaced by K_new and V_new, ``p = position`` (``position + S`` when negative), exactly
   ``KVCacheUpdate(K, K_new, position; axis=2)`` (:mod:`rewrite.plugins.kv_cache`): the cache as the step loaded
   it plus the step's rows, so the cache write itself can come after every read (see the ``attention`` plugin's
   ``attention-reads-loaded-cache`` rule)

7. ``cos`` (optional, with 8 and K_new) float [Bc, 1, Tc, D], Bc in (1, B), Tc in (1, T)
8. ``sin`` (optional) float [Bs, 1, Ts, D] likewise: Q and K_new are first rotated as
   ``RotaryEmbedding(Q, cos, sin[, q_norm_weight])`` and ``RotaryEmbedding(K_new, cos, sin[, k_norm_weight])``
   (:mod:`rewrite.plugins.rope.op`'s contract; new row r takes the tables' row r, so n = T), and the op has a
   second output ``K_rotated`` [B, Hkv, n, D], the rotated K_new: what the cache stores
9. ``q_norm_weight`` (optional) float [D]: Q's per-head RMSNorm before its rotation (Qwen3's ``q_norm``)
10. ``k_norm_weight`` (optional) float [D]: K_new's (``k_norm``); with either weight, attribute ``norm_epsilon``

Attributes ``scale`` (float), ``nan_rows_zero`` (int, default 0), ``norm_epsilon`` (float, with a norm weight).
Output ``Y`` [B, Hq, T, D] (from the rotated Q and K_new when 7 and 8 are given)::

    scores = Q K^T            (summed in float32, rounded to Q's dtype: the ONNX MatMul)
    scores = scores * scale + mask            (each rounded to Q's dtype: the ONNX Mul and Add)
    P = Softmax(scores, axis=-1)              (rounded to Q's dtype)
    P = Where(IsNaN(P), 0, P)                 (when nan_rows_zero: torch's SDPA decomposition with dynamo=True)
    Y = P V                   (summed in float32, rounded to Q's dtype)

the decomposition the ``attention`` rule replaces (seed 000 "2. Self-Attention"; transformers' eager and SDPA
attention as its exporters write it). The CUDA kernel computes the softmax online in float32 (seed 000's
split-KV flash decode, one pass over K and V) and rounds only Y: it agrees with this reference within the
conformance kit's float16 tolerance, not bit for bit.

Lowerings: ONNX Runtime (CPU and CUDA) gets the decomposition back (the K/V heads repeated by Unsqueeze, Expand and
Reshape when Hq > Hkv); IREE llvm-cpu ``linalg.generic`` ops over the grouped view [B, Hkv, G, T, D] of Q (no
repeated K/V); IREE cuda one dispatch of ``kernels/attention_cuda.cu``: a workgroup per (query head, query row,
batch), its warps over the key positions, reading the K/V rows of its group's head (the group's other heads find
them in L2) and skipping positions the mask hides; at decode a row's positions are split over several workgroups
and the last merges their states (:func:`cuda_splits`)
(iree-compile 3.13 materializes the repeated K and V and runs 5 dispatches per layer: BENCHMARKS.md, "Full-size
decode on the H200"). The rotary inputs are what ``attention-absorbs-rope`` gives a layer on IREE cuda
(:mod:`rewrite.plugins.attention.rotary`): the kernel rotates Q's row and the new K rows as it reads them, one
launch instead of the RoPE dispatch before it; the other lowerings rotate first, as RotaryEmbedding's own do.
"""

from __future__ import annotations

import re
import struct

import numpy as np
from onnx import TensorProto

from rewrite.core.abstract_ops import AbstractOp
from rewrite.core.iree_lowering import IreeLowering, PatchContext, TorchOperator, dispatch_dims, operand_dim, insert_rows_mlir, cuda_executable_source
from rewrite.core.ir import Graph, Node
from rewrite.core.kernels import build_cuda_ptx, kernel_source
from rewrite.core.lowering import Lowering
from rewrite.core.rules import Builder
from rewrite.errors import BackendError
from rewrite.plugins.kv_cache import KV_UPDATE, rows_written_onnx
from rewrite.plugins.rope.op import RotaryEmbedding, rotated_onnx, rotation_linalg, table_strides
from rewrite.plugins.rope.op import check_shapes as rotary_shapes

CUDA_THREADS = 512  #: THREADS in kernels/attention_cuda.cu: 16 warps
CUDA_HEAD_SIZES = (32, 64, 128, 256)  #: D the kernels are built for (D / 32 elements a lane)
CUDA_EXECUTABLE = "attention_exec"
CUDA_KERNELS = [f"grouped_attention_{el}_d{d}" for el in ("f16", "f32") for d in CUDA_HEAD_SIZES]
CUDA_ROTARY_EXECUTABLE = "attention_rope_exec"
CUDA_ROTARY_KERNELS = [f"grouped_attention_rope_{el}_d{d}" for el in ("f16", "f32") for d in CUDA_HEAD_SIZES]
CUDA_SPLIT_SITES = 1024  #: ATTN_SITES in kernels/attention_cuda.cu: dispatch sites of a module that may split
CUDA_SPLIT_ROWS = 128  #: ATTN_ROWS: query rows (B * Hq * T) of a launch that splits
#: workgroups a decode launch's splits aim at in all (about one per SM of an H100: 512 threads of 72 registers at D = 128)
CUDA_SPLIT_WORKGROUPS = 128
CUDA_WARPS = 16  #: WARPS in kernels/attention_cuda.cu


def cuda_splits(b: int, hq: int, t: int, s: int) -> int:
    """Splits of the key positions per query row (split-KV) for a launch of B x Hq x T query rows over S
    positions: 1 unless one row per head (decode, T = 1) and at most :data:`CUDA_SPLIT_ROWS` rows; then
    ``CUDA_SPLIT_WORKGROUPS // (B * Hq)`` workgroups per row, at most ``S // 16`` (a position per warp), at least 1.
    The lowering computes the same at run time (``_splits_mlir``)."""
    if t != 1 or b * hq > CUDA_SPLIT_ROWS:
        return 1
    return max(1, min(CUDA_SPLIT_WORKGROUPS // max(1, b * hq), s // CUDA_WARPS))


def check_shapes(q, k, v, mask, where: str, *, lowered: bool = False, new=None) -> tuple[int, int, int, int, int, int]:
    """(B, Hq, Hkv, T, S, D) from the operands' shapes (tuples, None for an unknown dim, ``mask`` None when absent;
    ``new`` the shapes of K_new and V_new, None when absent).

    The mask's last dim must be S: statically the same size or the same symbolic dim. ``lowered``: the shapes are
    an imported operator's types, which have lost the graph's dim names; a dynamic mask S with a dynamic K S is
    then taken as S (the ``attention`` rule proved it on the graph, where the names are).

    Raises:
        ValueError: naming ``where``: ranks other than 4, K and V of different shapes, Hq not a multiple of Hkv,
            D or B differing (or B unknown on the graph), a mask that does not broadcast as the contract says, or
            new rows not of [B, Hkv, n, D] (both alike, n <= S)."""
    if len(q) != 4 or len(k) != 4 or tuple(k) != tuple(v):
        raise ValueError(f"{where}: Q {list(q)}, K {list(k)}, V {list(v)}; expected Q [B, Hq, T, D] and K, V [B, Hkv, S, D]")
    b, hq, t, d = q
    _, hkv, s, dk = k
    # B: the same size or dim name (an unknown dim proves nothing on the graph; lowered, the rule proved it)
    same_b = k[0] == b and (b is not None or lowered) or lowered and (k[0] is None or b is None)
    if not isinstance(hq, int) or not isinstance(hkv, int) or hq % hkv or dk != d or not same_b:
        raise ValueError(f"{where}: Q {list(q)} and K {list(k)}: Hq must be a static multiple of Hkv, D and B equal")
    if mask is not None:
        # a dim not known statically may be 1 or the full one (the lowerings look at run time); S is taken in full
        fits = lambda dim, full: dim in (1, full) or not isinstance(dim, int) or not isinstance(full, int)  # noqa: E731
        full_s = lambda dim: dim == s and (dim is not None or lowered)  # noqa: E731  (None == None proves nothing on the graph)
        ok = len(mask) == 4 and fits(mask[0], b) and fits(mask[1], hq) and fits(mask[2], t) and full_s(mask[3])
        if not ok:
            raise ValueError(f"{where}: mask {list(mask)} does not broadcast to [B, Hq, T, S] = {[b, hq, t, s]} (S in full)")
    if new is not None:
        kn, vn = new
        n = kn[2] if len(kn) == 4 else None
        fits_s = not isinstance(n, int) or not isinstance(s, int) or n <= s
        if len(kn) != 4 or tuple(kn) != tuple(vn) or kn[1] != hkv or kn[3] != d or not fits_s \
                or not (kn[0] == k[0] or lowered and (kn[0] is None or k[0] is None)):
            raise ValueError(f"{where}: new rows K {list(kn)}, V {list(vn)}; expected both [B, Hkv, n, D] = "
                             f"{[k[0], hkv, 'n', d]} with n <= S = {s}")
    return b, hq, hkv, t, s, d


def check_rotary(q, k_new, cos, sin, q_weight, k_weight, has_epsilon: bool, outputs: int, where: str) -> None:
    """Check the rotary inputs 7-10 (shapes as tuples, None for an unknown dim, the weights None when absent)
    against Q [B, Hq, T, D] and K_new [B, Hkv, n, D]: each rotation within RotaryEmbedding's contract, n = T, a
    ``norm_epsilon`` (``has_epsilon``) with a norm weight, and two outputs (``outputs``: the node's count).

    Raises:
        ValueError: naming ``where``: no K_new, only one table, n other than T (both ints, or one of them unknown;
            two dim names are taken as equal: the rule proved them), a weight without ``norm_epsilon``, not two
            outputs, or a table or weight outside :func:`rewrite.plugins.rope.op.check_shapes`."""
    if cos is None or sin is None or k_new is None:
        raise ValueError(f"{where}: cos and sin go together, and with K_new")
    if (q_weight is not None or k_weight is not None) and not has_epsilon:
        raise ValueError(f"{where}: a norm weight without the attribute norm_epsilon")
    if outputs != 2:
        raise ValueError(f"{where}: {outputs} output(s) with the rotary inputs; Y and K_rotated expected")
    rotary_shapes(q, cos, sin, q_weight, f"{where} (Q's rotation)")
    rotary_shapes(k_new, cos, sin, k_weight, f"{where} (K_new's rotation)")
    if k_new[2] != q[2] and (isinstance(k_new[2], int) and isinstance(q[2], int) or k_new[2] is None or q[2] is None):
        raise ValueError(f"{where}: K_new {list(k_new)} and Q {list(q)}: the rotated new rows must be the call's T rows")


class GroupedAttention(AbstractOp):
    """The contract in the module docstring."""

    op_type = "GroupedAttention"
    ort_targets = ("cpu", "cuda")

    def lowerings(self) -> list[Lowering]:
        return super().lowerings() + [Lowering(self.op_type, "iree", ("cuda",), self.lower_iree_cuda, origin=type(self).__module__)]

    def reference(self, attrs: dict, q, k, v, mask=None, k_new=None, v_new=None, position=None, cos=None, sin=None,
                  q_norm_weight=None, k_norm_weight=None) -> list[np.ndarray]:
        """numpy float32 evaluation of the contract, each ONNX op's result rounded to Q's dtype; returns [Y], or
        [Y, K_rotated] with the rotary inputs (Q and K_new rotated first by RotaryEmbedding's reference).

        Raises:
            ValueError: shapes outside the contract (:func:`check_shapes`, :func:`check_rotary`), only some of the
                new-row inputs, or new rows outside the cache."""
        news = (k_new, v_new, position)
        if any(x is not None for x in news) and any(x is None for x in news):
            raise ValueError("GroupedAttention: K_new, V_new and position go together")
        if cos is not None or sin is not None:
            shape = lambda x: None if x is None else x.shape  # noqa: E731
            check_rotary(q.shape, shape(k_new), shape(cos), shape(sin), shape(q_norm_weight), shape(k_norm_weight),
                         "norm_epsilon" in attrs, 2, "GroupedAttention")
            eps = {"norm_epsilon": attrs["norm_epsilon"]} if "norm_epsilon" in attrs else {}
            q = RotaryEmbedding().reference(eps, q, cos, sin, q_norm_weight)[0]
            k_new = RotaryEmbedding().reference(eps, k_new, cos, sin, k_norm_weight)[0]
            return self.reference(attrs, q, k, v, mask, k_new, v_new, position) + [k_new]
        check_shapes(q.shape, k.shape, v.shape, None if mask is None else mask.shape, "GroupedAttention",
                     new=None if k_new is None else (k_new.shape, v_new.shape))
        if k_new is not None:  # the cache with this call's rows written: KVCacheUpdate's contract
            k = KV_UPDATE.reference({"axis": 2}, k, k_new, position)[0]
            v = KV_UPDATE.reference({"axis": 2}, v, v_new, position)[0]
        dt, f32 = q.dtype, np.float32
        g = q.shape[1] // k.shape[1]
        kr, vr = (np.repeat(x, g, axis=1).astype(f32) for x in (k, v))
        scores = (q.astype(f32) @ kr.transpose(0, 1, 3, 2)).astype(dt)
        scores = (scores.astype(f32) * np.asarray(attrs["scale"], dt).astype(f32)).astype(dt)
        if mask is not None:
            scores = (scores.astype(f32) + mask.astype(f32)).astype(dt)
        s = scores.astype(f32)
        with np.errstate(invalid="ignore", over="ignore"):
            e = np.exp(s - s.max(axis=-1, keepdims=True))
            p = (e / e.sum(axis=-1, keepdims=True)).astype(dt)
        if attrs.get("nan_rows_zero", 0):
            p = np.where(np.isnan(p), np.zeros((), dt), p)
        return [(p.astype(f32) @ vr).astype(dt)]

    def sample_inputs(self, rng: np.random.Generator) -> list[tuple[dict, list[np.ndarray]]]:
        """Conformance-kit samples: grouped (4 query heads a K/V head) and plain heads, one query row (decode) and
        several (prefill), a static cache whose later positions the mask hides, masks of [1, 1, T, S],
        [B, 1, T, S] and [1, Hq, T, S], no mask, f32 and f16; ``nan_rows_zero`` with a row the mask hides
        wholly; the new rows apart; the rotary inputs with both norms, none, and Q's alone with per-batch tables."""
        def case(b, hq, hkv, t, s, d, dt, mask="causal", visible=None):
            q, k, v = (rng.standard_normal(shape).astype(dt) for shape in ((b, hq, t, d), (b, hkv, s, d), (b, hkv, s, d)))
            ins = [q, k, v]
            if mask:
                end = s if visible is None else visible  # positions >= end: an unwritten static-cache slot
                pos = np.arange(end - t, end)[:, None]
                m = np.where((np.arange(s)[None, :] <= pos), 0.0, -np.inf).astype(dt)[None, None]
                if mask == "heads":  # a mask per query head: each hides one more position than the last
                    m = np.broadcast_to(m, (1, hq, t, s)).copy()
                    for h in range(hq):
                        m[0, h, :, :h] = -np.inf
                ins.append(np.broadcast_to(m, (b, 1, t, s)).copy() if mask == "batch" else m)
            return {"scale": float(d) ** -0.5}, ins
        def with_new(sample, p, position=None):
            """The sample's K/V rows p .. p + T given apart (the cache as loaded holds other values there)."""
            attrs, ins = sample
            q, k, v = ins[:3]
            t = q.shape[2]
            kn, vn = k[:, :, p:p + t].copy(), v[:, :, p:p + t].copy()
            k[:, :, p:p + t], v[:, :, p:p + t] = rng.standard_normal(kn.shape), rng.standard_normal(vn.shape)
            mask = ins[3] if len(ins) > 3 else None
            return attrs, [q, k, v, mask, kn, vn, np.array([p if position is None else position], np.int64)]

        def rotary(sample, q_norm=False, k_norm=False, per_batch=False):
            """The sample with the rotary inputs: tables of random positions (one per batch row with
            ``per_batch``), the norm weights asked for (epsilon 1e-6)."""
            attrs, ins = sample
            b, _, t, d = ins[0].shape
            dt = ins[0].dtype
            pos = rng.integers(0, 4096, size=(b if per_batch else 1, t)).astype(np.float32)
            inv = 1e6 ** (-np.arange(0, d, 2, dtype=np.float32) / d)
            ang = pos[..., None] * np.concatenate([inv, inv])[None, None]
            cos, sin = (f(ang)[:, None].astype(dt) for f in (np.cos, np.sin))
            weight = lambda on: (1 + 0.1 * rng.standard_normal(d)).astype(dt) if on else None  # noqa: E731
            if q_norm or k_norm:
                attrs = {**attrs, "norm_epsilon": 1e-6}
            return attrs, ins + [cos, sin, weight(q_norm), weight(k_norm)]

        guarded = case(1, 4, 2, 2, 8, 32, np.float32)  # a fully hidden row: NaN probabilities, zeroed
        guarded[0]["nan_rows_zero"] = 1
        guarded[1][3][..., 0, :] = -np.inf
        return [guarded, case(1, 8, 2, 1, 24, 32, np.float32, visible=17), case(1, 4, 4, 3, 16, 64, np.float16),
                case(2, 6, 2, 5, 9, 32, np.float32, mask="batch"), case(1, 4, 1, 2, 40, 128, np.float16, visible=33),
                case(1, 2, 2, 1, 8, 32, np.float32, mask=None), case(1, 6, 2, 2, 12, 32, np.float16, mask="heads"),
                # decode and prefill with the new rows apart: mid-cache, a negative position, at slot 0, no mask
                with_new(case(1, 8, 2, 1, 24, 32, np.float32, visible=17), 16),
                with_new(case(1, 4, 1, 3, 40, 128, np.float16, visible=33), 30, position=-10),
                with_new(case(2, 6, 2, 2, 9, 32, np.float32, mask=None), 0),
                # the rotary inputs: Qwen3's decode (both norms), Qwen1.5's (none), prefill rows with per-batch
                # tables and Q's norm alone
                rotary(with_new(case(1, 8, 2, 1, 24, 128, np.float16, visible=17), 16), q_norm=True, k_norm=True),
                rotary(with_new(case(1, 4, 4, 1, 20, 64, np.float32, visible=9), 8)),
                rotary(with_new(case(2, 4, 2, 3, 12, 32, np.float32, visible=7), 4), q_norm=True, per_batch=True)]

    # ------------------------------------------------------------------ ORT
    def lower_ort(self, graph: Graph, node: Node) -> None:
        """The decomposition of the contract: ``MatMul(Q, Transpose(K')) -> Mul(scale) -> [Add(mask)] -> Softmax ->
        MatMul(., V')`` with ``K' = Reshape(Expand(Unsqueeze(K, 2), [B, Hkv, G, S, D]), [B, Hq, S, D])`` when G > 1;
        with new rows, K and V first get them as KVCacheUpdate's ONNX Runtime lowering writes them (ScatterND); with
        the rotary inputs, Q and K_new are first rotated as RotaryEmbedding's lowering does (:func:`rotated_onnx`),
        the rotated K_new also the second output."""
        q, k, v = node.inputs[:3]
        mask = node.inputs[3] if len(node.inputs) > 3 else ""
        new = [x for x in node.inputs[4:7] if x]
        cos, sin, q_weight, k_weight = (list(node.inputs[7:11]) + [""] * 4)[:4]
        qv, kv = graph.values[q], graph.values[k]
        dt = qv.dtype
        b = Builder(graph, "lower/GroupedAttention", node.order, node.name)
        where = f"GroupedAttention node {node.describe()}"
        try:
            if len(new) not in (0, 3):
                raise ValueError(f"{where}: K_new, V_new and position go together")
            if cos or sin:
                shape = lambda x: graph.values[x].shape if x else None  # noqa: E731
                check_rotary(qv.shape, shape(new[0]) if new else None, shape(cos), shape(sin), shape(q_weight),
                             shape(k_weight), node.attr("norm_epsilon") is not None, len(node.outputs), where)
                eps = node.attr("norm_epsilon")
                q = rotated_onnx(graph, b, q, cos, sin, q_weight, eps, where)
                new[0] = rotated_onnx(graph, b, new[0], cos, sin, k_weight, eps, where)
            elif len(node.outputs) != 1:
                raise ValueError(f"{where}: {len(node.outputs)} outputs without the rotary inputs; Y alone expected")
            _, hq, hkv, _, _, d = check_shapes(qv.shape, kv.shape, graph.values[v].shape,
                                               graph.values[mask].shape if mask else None, f"GroupedAttention node {node.describe()}",
                                               lowered=True, new=(graph.values[new[0]].shape, graph.values[new[1]].shape) if new else None)
        except ValueError as e:
            raise BackendError(str(e)) from None
        rotated_rows = new[0] if cos else ""
        if new:
            k, v = (rows_written_onnx(graph, b, past, rows, new[2], 2) for past, rows in ((k, new[0]), (v, new[1])))
        i64 = lambda vals, name: b.const(np.asarray(vals, np.int64), name)  # noqa: E731
        np_dt = np.float16 if dt == TensorProto.FLOAT16 else np.float32

        def repeated(x: str) -> str:
            if hq == hkv:
                return x
            shape = b.op("Shape", [x])  # [B, Hkv, S, D] -> [B, Hkv, G, S, D] -> [B, Hq, S, D]
            five = b.op("Concat", [b.op("Slice", [shape, i64([0], "s0"), i64([2], "s2")]), i64([hq // hkv], "group"),
                                   b.op("Slice", [shape, i64([2], "s2b"), i64([4], "s4")])], axis=0)
            four = b.op("Concat", [b.op("Slice", [shape, i64([0], "s0b"), i64([1], "s1")]), i64([hq], "heads"),
                                   b.op("Slice", [shape, i64([2], "s2c"), i64([4], "s4b")])], axis=0)
            return b.op("Reshape", [b.op("Expand", [b.op("Unsqueeze", [x, i64([2], "axis2")]), five]), four], dtype=dt)

        kt = b.op("Transpose", [repeated(k)], perm=[0, 1, 3, 2], dtype=dt)
        scores = b.op("Mul", [b.op("MatMul", [q, kt], dtype=dt), b.const(np.array(node.attr("scale"), np_dt), "scale")], dtype=dt)
        if mask:
            scores = b.op("Add", [scores, mask], dtype=dt)
        probs = b.op("Softmax", [scores], axis=-1, dtype=dt)
        if node.attr("nan_rows_zero", 0):
            probs = b.op("Where", [b.op("IsNaN", [probs], dtype=TensorProto.BOOL), b.const(np.zeros((), np_dt), "zero"), probs], dtype=dt)
        y = b.op("MatMul", [probs, repeated(v)], dtype=dt, shape=graph.values[node.outputs[0]].shape)
        graph.replace_node(node, [y, rotated_rows] if len(node.outputs) > 1 else [y])
        graph.remove_unused_initializers()

    # ----------------------------------------------------------------- IREE
    def lower_iree(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """llvm-cpu: ``linalg.generic`` ops over Q viewed as [B, Hkv, G, T, D] (``tensor.expand_shape``; K and V
        are read per K/V head, not repeated): the scores summed in f32 and rounded, scaled, masked, a max, an
        exp-sum and a normalization over S, the product with V; Y collapsed back to [B, Hq, T, D].

        Raises:
            BackendError: a target other than llvm-cpu, or operands outside the contract (dynamic Hq, Hkv or D)."""
        if ctx.target != "llvm-cpu":
            raise BackendError(f"GroupedAttention linalg lowering asked for target '{ctx.target}'")
        t = _Operands(op)
        if not t.rotary:
            return IreeLowering(body=_Linalg(op).body())
        # the rotary inputs: Q and K_new rotated first (RotaryEmbedding's linalg ops), the core reading them
        body = rotation_linalg(op, 0, 7, 8, 9 if t.q_weight else None, "rq", "rq_")
        body += rotation_linalg(op, 4, 7, 8, 10 if t.k_weight else None, "rk", "rk_")
        body += f"    %out1 = tensor.cast %rk : {t.new[0].builtin} to {op.result_types[1].builtin}\n"
        return IreeLowering(body=body + re.sub(r"%in([04])(?!\w)", lambda m: "%rq" if m.group(1) == "0" else "%rk", _Linalg(op).body()))

    def lower_iree_cuda(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """One dispatch of ``kernels/attention_cuda.cu`` (PTX for ``ctx.cuda_arch``), ``grouped_attention_<el>_d<D>``
        on (Hq * splits, T, B) workgroups of 512 threads (the kernel source's header): at decode (T = 1) a row's key
        positions split over :func:`cuda_splits` workgroups, the last of which merges their states (split-KV,
        seed 000's flash decode). Bindings Q, K, V, mask, K_new, V_new, position (dummies when absent), then Y and an
        f32 scratch result of the splits' states that nothing reads; push constants T, S, Hq, Hkv, the mask's
        strides over B, heads and T (0 where it broadcasts), has_mask, the scale's float32 bits (i32), the number of
        new rows (0 without), the splits and the dispatch site (its tickets in the module's memory). With the rotary
        inputs ``grouped_attention_rope_<el>_d<D>``: bindings cos, sin and the two norm weights (dummies when
        absent) after the position, K_rotated after the scratch; push constants cos's and sin's strides over B and
        T (0 where they broadcast), the flags of the two norms and the epsilon's float32 bits after the site.

        Raises:
            BackendError: a target other than cuda, D not in :data:`CUDA_HEAD_SIZES`, or operands outside the
                contract."""
        if ctx.target != "cuda":
            raise BackendError(f"GroupedAttention CUDA lowering asked for target '{ctx.target}'")
        if int(op.attrs.get("nan_rows_zero", 0)):
            raise BackendError(f"GroupedAttention {op.where}: nan_rows_zero=1; the CUDA kernel does not zero NaN rows")
        t = _Operands(op)
        if t.d not in CUDA_HEAD_SIZES:
            raise BackendError(f"GroupedAttention {op.where}: head size D={t.d}; the CUDA kernel takes {CUDA_HEAD_SIZES}")
        obj = ctx.object_path(build_cuda_ptx(kernel_source(__file__, "attention_cuda.cu"), ctx.cuda_arch))
        dims = dispatch_dims
        # the grid: Hq, T (Q's dim 2), B (Q's dim 0); S is K's dim 2
        body = "\n".join(["    %c0 = arith.constant 0 : index", f"    %gx = arith.constant {t.hq} : index",
                          operand_dim(op, 0, 2, "%gy"), operand_dim(op, 0, 0, "%gz"), operand_dim(op, 1, 2, "%s"),
                          "    %t32 = arith.index_cast %gy : index to i32", "    %s32 = arith.index_cast %s : index to i32"]) + "\n"
        scale_bits = struct.unpack("<i", struct.pack("<f", float(op.attrs["scale"])))[0]
        for name, value in (("hq", t.hq), ("hkv", t.hkv), ("has", int(t.mask is not None)), ("scale", scale_bits)):
            body += f"    %{name}32 = arith.constant {value} : i32\n"
        body += t.mask_strides()
        mask_arg = "%in3" if t.mask is not None else "%dummy"
        mask_type = (t.mask.builtin + dims(3, t.mask)) if t.mask is not None else f"tensor<1x{t.el}>"
        if t.new:  # the new rows: K_new and V_new, the position, and n (their dim 2) as a push constant
            kn, vn, pos = t.new
            new_args = "%in4, %in5, %in6"
            new_types = f"{kn.builtin}{dims(4, kn)}, {vn.builtin}{dims(5, vn)}, {pos.builtin}{dims(6, pos)}"
            body += operand_dim(op, 4, 2, "%nn") + "\n    %n32 = arith.index_cast %nn : index to i32\n"
        else:
            new_args, new_types = "%dummy, %dummy, %nopos", f"tensor<1x{t.el}>, tensor<1x{t.el}>, tensor<1xi64>"
            body += "    %n32 = arith.constant 0 : i32\n"
        # one count of dispatch sites for both executables: no two launches share a ticket slot, whether the two
        # load as one module or as two
        body += _splits_mlir(ctx.next_site(CUDA_EXECUTABLE), t.d)
        consts = "%t32, %s32, %hq32, %hkv32, %msb, %msh, %mst, %has32, %scale32, %n32, %p32, %site32"
        args = f"%in0, %in1, %in2, {mask_arg}, {new_args}"
        types = f"{t.q.builtin}{dims(0, t.q)}, {t.k.builtin}{dims(1, t.k)}, {t.v.builtin}{dims(2, t.v)}, {mask_type}, {new_types}"
        results, casts = "%y, %part", ""
        exe, kernels, n_in, n_out, n_consts, kernel = CUDA_EXECUTABLE, CUDA_KERNELS, 7, 2, 12, f"grouped_attention_{t.el}_d{t.d}"
        if t.rotary:  # cos, sin and the norm weights after the position; their strides, flags and epsilon last
            eps_bits = struct.unpack("<i", struct.pack("<f", float(op.attrs.get("norm_epsilon", 0.0))))[0]
            flags = int(t.q_weight is not None) | 2 * int(t.k_weight is not None)
            body += "\n".join(["    %c1 = arith.constant 1 : index", f"    %cd = arith.constant {t.d} : index",
                               *table_strides(op, 7, "c"), *table_strides(op, 8, "s"),
                               f"    %rflags32 = arith.constant {flags} : i32", f"    %eps32 = arith.constant {eps_bits} : i32"]) + "\n"
            weight = lambda k, x: (f"%in{k}", f"{x.builtin}{dims(k, x)}") if x is not None else ("%dummy", f"tensor<1x{t.el}>")  # noqa: E731
            (qw, qw_type), (kw, kw_type) = weight(9, t.q_weight), weight(10, t.k_weight)
            kn = t.new[0]
            args += f", %in7, %in8, {qw}, {kw}"
            types += f", {t.cos.builtin}{dims(7, t.cos)}, {t.sin.builtin}{dims(8, t.sin)}, {qw_type}, {kw_type}"
            consts += ", %csb32, %cst32, %ssb32, %sst32, %rflags32, %eps32"
            results += ", %kr"
            casts = f"\n    %out1 = tensor.cast %kr : {kn.builtin} to {op.result_types[1].builtin}"
            exe, kernels, n_in, n_out, n_consts = CUDA_ROTARY_EXECUTABLE, CUDA_ROTARY_KERNELS, 11, 3, 18
            kernel = f"grouped_attention_rope_{t.el}_d{t.d}"
        result_types = f"{t.q.builtin}{dims(0, t.q)}, tensor<?xf32>{{%np}}" + (f", {t.new[0].builtin}{dims(4, t.new[0])}" if t.rotary else "")
        body += f"""    %dummy = arith.constant dense<0.0> : tensor<1x{t.el}>
    %nopos = arith.constant dense<0> : tensor<1xi64>
    {results} = flow.dispatch @{exe}::@{kernel}[%gxs, %gy, %gz]({args}, {consts}) :
        ({types}, {", ".join(["i32"] * n_consts)})
        -> ({result_types})
    %out0 = tensor.cast %y : {t.q.builtin} to {op.result_types[0].builtin}{casts}
"""
        return IreeLowering(body=body, module_items={exe: cuda_executable_source(exe, obj, kernels, n_in, n_out, n_consts, CUDA_THREADS)})


def _splits_mlir(site: int, d: int) -> str:
    """MLIR computing the launch's splits ``%p`` as :func:`cuda_splits` does, from the grid's ``%gx`` (Hq), ``%gy``
    (T), ``%gz`` (B) and ``%s`` (S): the grid's x ``%gxs`` = Hq * splits, the scratch's f32 count ``%np`` = B * Hq *
    T * splits * (D + 2) (1 with one split), and the push constants ``%p32`` and ``%site32``. Past
    :data:`CUDA_SPLIT_SITES` sites in a module (each keeps its tickets in the module's memory) one split."""
    lines = ["    %sp_c1 = arith.constant 1 : index"]
    if site < CUDA_SPLIT_SITES:
        lines += [f"    %sp_w = arith.constant {CUDA_SPLIT_WORKGROUPS} : index",
                  f"    %sp_warps = arith.constant {CUDA_WARPS} : index",
                  f"    %sp_rows = arith.constant {CUDA_SPLIT_ROWS} : index",
                  "    %sp_bh = arith.muli %gz, %gx : index",
                  "    %sp_bh1 = arith.maxui %sp_bh, %sp_c1 : index",
                  "    %sp_want = arith.divui %sp_w, %sp_bh1 : index",
                  "    %sp_most = arith.divui %s, %sp_warps : index",
                  "    %sp_p0 = arith.minui %sp_want, %sp_most : index",
                  "    %sp_p1 = arith.maxui %sp_p0, %sp_c1 : index",
                  "    %sp_dec = arith.cmpi eq, %gy, %sp_c1 : index",
                  "    %sp_fits = arith.cmpi ule, %sp_bh, %sp_rows : index",
                  "    %sp_ok = arith.andi %sp_dec, %sp_fits : i1",
                  "    %p = arith.select %sp_ok, %sp_p1, %sp_c1 : index"]
    else:
        lines.append("    %p = arith.constant 1 : index")
    # the scratch: B * Hq * T * splits * (D + 2) floats, one when unsplit (the kernel does not touch it then)
    lines += ["    %gxs = arith.muli %gx, %p : index",
              f"    %sp_state = arith.constant {d + 2} : index",
              "    %sp_n0 = arith.muli %gxs, %gy : index", "    %sp_n1 = arith.muli %sp_n0, %gz : index",
              "    %sp_n2 = arith.muli %sp_n1, %sp_state : index",
              "    %sp_split = arith.cmpi ugt, %p, %sp_c1 : index",
              "    %np = arith.select %sp_split, %sp_n2, %sp_c1 : index",
              "    %p32 = arith.index_cast %p : index to i32",
              f"    %site32 = arith.constant {min(site, CUDA_SPLIT_SITES - 1)} : i32"]
    return "\n".join(lines) + "\n"


class _Operands:
    """An imported GroupedAttention's operand types and static sizes.

    Raises:
        BackendError: operands outside the contract, or a dynamic Hq, Hkv or D."""

    def __init__(self, op: TorchOperator):
        types = op.operand_types
        self.q, self.k, self.v = types[:3]
        self.mask = types[3] if len(types) > 3 and types[3].element != "none" else None
        #: (K_new, V_new, position) types, or () when the op has no new rows
        self.new = tuple(types[4:7]) if len(types) > 4 and any(x.element != "none" for x in types[4:7]) else ()
        try:
            if self.new and (len(self.new) != 3 or any(x.element == "none" for x in self.new)):
                raise ValueError(f"GroupedAttention {op.where}: K_new, V_new and position go together")
            _, hq, hkv, _, _, d = check_shapes(self.q.dims, self.k.dims, self.v.dims, None if self.mask is None else self.mask.dims,
                                               f"GroupedAttention {op.where}", lowered=True,
                                               new=(self.new[0].dims, self.new[1].dims) if self.new else None)
        except ValueError as e:
            raise BackendError(str(e)) from None
        if d is None or any(t.element != self.q.element for t in (self.k, self.v, self.mask, *self.new[:2]) if t is not None):
            raise BackendError(f"GroupedAttention {op.where}: Q {self.q.text}, K {self.k.text}: a static head size and one "
                               "element type expected")
        self.hq, self.hkv, self.d, self.g = hq, hkv, d, hq // hkv
        self.el = self.q.builtin_element
        # the rotary inputs 7-10 (None when absent)
        present = lambda k: types[k] if len(types) > k and types[k].element != "none" else None  # noqa: E731
        self.cos, self.sin, self.q_weight, self.k_weight = (present(k) for k in (7, 8, 9, 10))
        self.rotary = self.cos is not None or self.sin is not None
        if self.rotary:
            dims = lambda x: None if x is None else x.dims  # noqa: E731
            try:
                check_rotary(self.q.dims, self.new[0].dims if self.new else None, dims(self.cos), dims(self.sin),
                             dims(self.q_weight), dims(self.k_weight), "norm_epsilon" in op.attrs,
                             len(op.result_types), f"GroupedAttention {op.where}")
            except ValueError as e:
                raise BackendError(str(e)) from None
            if any(x.element != self.q.element for x in (self.cos, self.sin, self.q_weight, self.k_weight) if x is not None):
                raise BackendError(f"GroupedAttention {op.where}: cos {self.cos.text}, Q {self.q.text}: the rotary inputs "
                                   "must be of Q's element type")
        elif len(op.result_types) != 1:
            raise BackendError(f"GroupedAttention {op.where}: {len(op.result_types)} results without the rotary "
                               "inputs; Y alone expected")
        # the keys and values the core reads: the operands, or (with new rows) the cache with them written
        self.keys, self.values = ("%kw", "%vw") if self.new else ("%in1", "%in2")

    def written_rows(self, op: TorchOperator) -> list[str]:
        """With new rows: MLIR defining ``%kw`` and ``%vw``, K and V with rows ``p .. p + n`` replaced (the
        KVCacheUpdate contract, :func:`insert_rows_mlir`); else nothing."""
        if not self.new:
            return []
        seq = self.k.dims[2] if self.k.dims[2] is not None else "%in1_d2"
        kn, vn, pos = self.new
        return [insert_rows_mlir("kw", "%in1", self.k.builtin, [], "%in4", kn, "%in6", pos, seq, 2, "%kw"),
                insert_rows_mlir("vw", "%in2", self.v.builtin, [], "%in5", vn, "%in6", pos, seq, 2, "%vw")]

    def mask_strides(self) -> str:
        """MLIR defining the mask's element strides ``%msb``, ``%msh``, ``%mst`` (i32) over B, heads and T: 0 where
        the mask's dim is 1 (broadcast), its row-major stride otherwise; a dynamic dim is compared with 1 at run
        time (``%c0`` must be defined)."""
        if self.mask is None:
            return "    %msb = arith.constant 0 : i32\n    %msh = arith.constant 0 : i32\n    %mst = arith.constant 0 : i32\n"
        lines = ["    %ms_one = arith.constant 1 : index"]
        for axis, d in enumerate(self.mask.dims):
            lines.append(f"    %ms_d{axis} = arith.constant {d} : index" if d is not None else f"    %ms_d{axis} = arith.addi %in3_d{axis}, %c0 : index")
        stride = "%ms_d3"
        for axis, name in ((2, "%mst"), (1, "%msh"), (0, "%msb")):
            lines += [f"    %ms_b{axis} = arith.cmpi eq, %ms_d{axis}, %ms_one : index",
                      f"    %ms_x{axis} = arith.select %ms_b{axis}, %c0, {stride} : index",
                      f"    {name} = arith.index_cast %ms_x{axis} : index to i32",
                      f"    %ms_p{axis} = arith.muli {stride}, %ms_d{axis} : index"]
            stride = f"%ms_p{axis}"
        return "\n".join(lines) + "\n"


class _Linalg:
    """The llvm-cpu lowering's MLIR (:meth:`GroupedAttention.lower_iree`)."""

    def __init__(self, op: TorchOperator):
        self.op = op
        self.t = _Operands(op)

    def body(self) -> str:
        t, op = self.t, self.op
        el, f16 = t.el, t.el == "f16"
        hkv, g, d = t.hkv, t.g, t.d
        q5 = f"tensor<?x{hkv}x{g}x?x{d}x{el}>"
        s5 = f"tensor<?x{hkv}x{g}x?x?xf32>"
        r4 = f"tensor<?x{hkv}x{g}x?xf32>"
        kt = f"tensor<?x{hkv}x?x{d}x{el}>"
        lines = ["    %c0 = arith.constant 0 : index", operand_dim(op, 0, 0, "%b"), operand_dim(op, 0, 2, "%t"), operand_dim(op, 1, 2, "%s"),
                 f"    %qc = tensor.cast %in0 : {t.q.builtin} to tensor<?x{t.hq}x?x{d}x{el}>",
                 f"    %q5 = tensor.expand_shape %qc [[0], [1, 2], [3], [4]] output_shape [%b, {hkv}, {g}, %t, {d}] : "
                 f"tensor<?x{t.hq}x?x{d}x{el}> into {q5}",
                 *t.written_rows(op),
                 f"    %kc = tensor.cast {t.keys} : {t.k.builtin} to {kt}", f"    %vc = tensor.cast {t.values} : {t.v.builtin} to {kt}",
                 "    %zero = arith.constant 0.0 : f32", "    %ninf = arith.constant 0xFF800000 : f32",
                 f"    %scale = arith.constant {_f32_literal(float(op.attrs['scale']), el)} : f32"]
        ext = lambda v: f"%{v}f = arith.extf %{v} : f16 to f32\n      " if f16 else ""  # noqa: E731
        fv = lambda v: f"%{v}f" if f16 else f"%{v}"  # noqa: E731

        def rnd(v: str, name: str = "") -> str:  # an ONNX intermediate of Q's type: f32 -> el -> f32, as %<name>r
            name = name or v
            return f"%{name}t = arith.truncf %{v} : f32 to f16\n      %{name}r = arith.extf %{name}t : f16 to f32\n      " if f16 else ""

        rv = lambda v: f"%{v}r" if f16 else f"%{v}"  # noqa: E731
        par5 = '"parallel", "parallel", "parallel", "parallel", "parallel"'
        # scores[b, h, g, t, s] = sum_d Q[b, h, g, t, d] K[b, h, s, d], rounded, scaled, rounded
        lines.append(f"""    %sc0 = tensor.empty(%b, %t, %s) : {s5}
    %sc1 = linalg.fill ins(%zero : f32) outs(%sc0 : {s5}) -> {s5}
    %sc = linalg.generic {{indexing_maps = [affine_map<(b, h, g, t, s, d) -> (b, h, g, t, d)>, affine_map<(b, h, g, t, s, d) -> (b, h, s, d)>,
                                            affine_map<(b, h, g, t, s, d) -> (b, h, g, t, s)>],
                          iterator_types = [{par5}, "reduction"]}}
        ins(%q5, %kc : {q5}, {kt}) outs(%sc1 : {s5}) {{
    ^bb0(%x: {el}, %y: {el}, %acc: f32):
      {ext("x")}{ext("y")}%p = arith.mulf {fv("x")}, {fv("y")} : f32
      %r = arith.addf %acc, %p : f32
      linalg.yield %r : f32
    }} -> {s5}""")
        read = self._mask_read(lines) if t.mask is not None else ""
        scaled = f"{rnd('m')}{read}{self._add_mask(rv('m'), rnd)}" if t.mask is not None else rnd("m").rstrip()
        final = (rv("a") if t.mask is not None else rv("m"))
        lines.append(f"""    %ss0 = tensor.empty(%b, %t, %s) : {s5}
    %ss = linalg.generic {{indexing_maps = [affine_map<(b, h, g, t, s) -> (b, h, g, t, s)>, affine_map<(b, h, g, t, s) -> (b, h, g, t, s)>],
                          iterator_types = [{par5}]}}
        ins(%sc : {s5}) outs(%ss0 : {s5}) {{
    ^bb0(%v: f32, %o: f32):
      {rnd("v")}%m = arith.mulf {rv("v")}, %scale : f32
      {scaled}
      linalg.yield {final} : f32
    }} -> {s5}""")
        lines.append(self._softmax(s5, r4, rnd))
        lines.append(f"""    %pv0 = tensor.empty(%b, %t) : tensor<?x{hkv}x{g}x?x{d}xf32>
    %pv1 = linalg.fill ins(%zero : f32) outs(%pv0 : tensor<?x{hkv}x{g}x?x{d}xf32>) -> tensor<?x{hkv}x{g}x?x{d}xf32>
    %pv = linalg.generic {{indexing_maps = [affine_map<(b, h, g, t, d, s) -> (b, h, g, t, s)>, affine_map<(b, h, g, t, d, s) -> (b, h, s, d)>,
                                            affine_map<(b, h, g, t, d, s) -> (b, h, g, t, d)>],
                          iterator_types = [{par5}, "reduction"]}}
        ins(%pr, %vc : {s5}, {kt}) outs(%pv1 : tensor<?x{hkv}x{g}x?x{d}xf32>) {{
    ^bb0(%x: f32, %y: {el}, %acc: f32):
      {ext("y")}%p = arith.mulf %x, {fv("y")} : f32
      %r = arith.addf %acc, %p : f32
      linalg.yield %r : f32
    }} -> tensor<?x{hkv}x{g}x?x{d}xf32>
    %yo0 = tensor.empty(%b, %t) : {q5}
    %yo = linalg.generic {{indexing_maps = [affine_map<(b, h, g, t, d) -> (b, h, g, t, d)>, affine_map<(b, h, g, t, d) -> (b, h, g, t, d)>],
                          iterator_types = [{par5}]}}
        ins(%pv : tensor<?x{hkv}x{g}x?x{d}xf32>) outs(%yo0 : {q5}) {{
    ^bb0(%v: f32, %o: {el}):
      {"%vt = arith.truncf %v : f32 to f16" if f16 else "%vt = arith.addf %v, %zero : f32"}
      linalg.yield %vt : {el}
    }} -> {q5}
    %y4 = tensor.collapse_shape %yo [[0], [1, 2], [3], [4]] : {q5} into tensor<?x{t.hq}x?x{d}x{el}>
    %out0 = tensor.cast %y4 : tensor<?x{t.hq}x?x{d}x{el}> to {op.result_types[0].builtin}""")
        return "\n".join(lines) + "\n"

    def _mask_read(self, lines: list[str]) -> str:
        """Statements of the scores' generic body defining ``%mv`` (the mask's element, Q's type) for the loop
        indices (b, h, g, t, s): read with ``tensor.extract`` at (b, h * G + g, t, s), 0 on each dim that is 1
        (static, or found at run time: the ``%mk_one<axis>`` flags ``lines`` gets)."""
        m = self.t.mask
        lines.append(f"    %mk_g = arith.constant {self.t.g} : index")
        lines.append("    %mk_c1 = arith.constant 1 : index")
        for axis, d in enumerate(m.dims[:3]):
            size = f"arith.constant {d} : index" if d is not None else f"arith.addi %in3_d{axis}, %c0 : index"
            lines += [f"    %mk_d{axis} = {size}", f"    %mk_one{axis} = arith.cmpi eq, %mk_d{axis}, %mk_c1 : index"]
        body = ["%ib = linalg.index 0 : index", "%ih = linalg.index 1 : index", "%ig = linalg.index 2 : index",
                "%it = linalg.index 3 : index", "%is = linalg.index 4 : index", "%ihg = arith.muli %ih, %mk_g : index",
                "%iq = arith.addi %ihg, %ig : index", "%jb = arith.select %mk_one0, %c0, %ib : index",
                "%jh = arith.select %mk_one1, %c0, %iq : index", "%jt = arith.select %mk_one2, %c0, %it : index",
                f"%mv = tensor.extract %in3[%jb, %jh, %jt, %is] : {m.builtin}"]
        return "\n      ".join(body) + "\n      "

    def _add_mask(self, scaled: str, rnd) -> str:
        f16 = self.t.el == "f16"
        ext = "%mvf = arith.extf %mv : f16 to f32\n      " if f16 else ""
        return f"{ext}%a = arith.addf {scaled}, {'%mvf' if f16 else '%mv'} : f32\n      {rnd('a')}".rstrip()

    def _softmax(self, s5: str, r4: str, rnd) -> str:
        """``%pr`` = Softmax over S of ``%ss``, each probability rounded to Q's type."""
        t = self.t
        return f"""    %mx0 = tensor.empty(%b, %t) : {r4}
    %mx1 = linalg.fill ins(%ninf : f32) outs(%mx0 : {r4}) -> {r4}
    %mx = linalg.generic {{indexing_maps = [affine_map<(b, h, g, t, s) -> (b, h, g, t, s)>, affine_map<(b, h, g, t, s) -> (b, h, g, t)>],
                          iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]}}
        ins(%ss : {s5}) outs(%mx1 : {r4}) {{
    ^bb0(%v: f32, %acc: f32):
      %r = arith.maximumf %acc, %v : f32
      linalg.yield %r : f32
    }} -> {r4}
    %sm0 = linalg.fill ins(%zero : f32) outs(%mx0 : {r4}) -> {r4}
    %sm = linalg.generic {{indexing_maps = [affine_map<(b, h, g, t, s) -> (b, h, g, t, s)>, affine_map<(b, h, g, t, s) -> (b, h, g, t)>,
                                            affine_map<(b, h, g, t, s) -> (b, h, g, t)>],
                          iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]}}
        ins(%ss, %mx : {s5}, {r4}) outs(%sm0 : {r4}) {{
    ^bb0(%v: f32, %m: f32, %acc: f32):
      %dv = arith.subf %v, %m : f32
      %e = math.exp %dv : f32
      %r = arith.addf %acc, %e : f32
      linalg.yield %r : f32
    }} -> {r4}
    %pr0 = tensor.empty(%b, %t, %s) : {s5}
    %pr = linalg.generic {{indexing_maps = [affine_map<(b, h, g, t, s) -> (b, h, g, t, s)>, affine_map<(b, h, g, t, s) -> (b, h, g, t)>,
                                            affine_map<(b, h, g, t, s) -> (b, h, g, t)>, affine_map<(b, h, g, t, s) -> (b, h, g, t, s)>],
                          iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel"]}}
        ins(%ss, %mx, %sm : {s5}, {r4}, {r4}) outs(%pr0 : {s5}) {{
    ^bb0(%v: f32, %m: f32, %z: f32, %o: f32):
      %dv = arith.subf %v, %m : f32
      %e = math.exp %dv : f32
      %p = arith.divf %e, %z : f32
      {rnd("p", "pq")}{self._nan_guard("%pqr" if t.el == "f16" else "%p")}
    }} -> {s5}"""

    def _nan_guard(self, p: str) -> str:
        """``linalg.yield`` of probability ``p``, 0 where it is NaN when the op has ``nan_rows_zero``."""
        if not int(self.op.attrs.get("nan_rows_zero", 0)):
            return f"linalg.yield {p} : f32"
        return (f"%isnan = arith.cmpf uno, {p}, {p} : f32\n      %pz = arith.select %isnan, %zero, {p} : f32\n"
                "      linalg.yield %pz : f32")


def _f32_literal(v: float, el: str) -> str:
    """``v`` as Q's type would store it (the ONNX Mul's constant), as an exact MLIR f32 hex literal."""
    if el == "f16":
        v = float(np.float16(v))
    return "0x%08X" % struct.unpack("<I", struct.pack("<f", v))[0]
