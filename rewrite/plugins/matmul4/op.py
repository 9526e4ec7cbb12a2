"""``ai.rewrite::MatMulInt4``: a MatMul by a constant block-wise INT4 weight, its reference and its lowerings.

Contract (inputs; K the reduction size, N the output size, nb = ceil(K / block_size), float = f32 or f16):

0. ``A`` float [..., K]
1. ``B`` UINT8 [N, ceil(K/2)]: the weight's INT4 codes (0..15) of output column n along K, two per byte, the even
   element in the low nibble (com.microsoft MatMulNBits / QMoE packing, :func:`rewrite.core.int4.pack_int4`)
2. ``scales`` [N, nb], A's dtype
3. ``zero_points`` UINT8 [N, nb] (optional; absent means 8, MatMulNBits' default)
4. .. ``addend_i`` (optional, one per output, absent ones ``""``): A's dtype, [width_i] (a bias, added to every
   row) or output i's own shape (a residual)
4 + outputs. ``norm_weight`` [K], A's dtype: present exactly when the attribute ``norm_epsilon`` is (the addends
   before it padded with ``""`` to one per output)

Attributes ``K``, ``N``, ``block_size``, optionally ``splits`` (2 or 3 widths summing to N), ``activation``
(``"swiglu"``: no splits, no addends) and ``norm_epsilon`` (float: A is an RMSNorm's input, the ``rms-norm-prologue``
rule, :mod:`rewrite.plugins.matmul4.prologue`). Output ``Y`` [..., N] in A's dtype, or with ``splits`` one output
per width, ``Y_i`` [..., splits[i]] = Y's next splits[i] columns (the ``shared-input`` merge of products reading
one A, :mod:`rewrite.plugins.matmul4.merge`)::

    A = RMSNorm(A, norm_weight, norm_epsilon)  (with norm_epsilon: ai.rewrite::RMSNorm's contract,
                                                rewrite.plugins.rmsnorm.op)
    W[k, n] = (code[n, k] - zero_point[n, k // block_size]) * scales[n, k // block_size]
    Y = A @ W                                  (summed in float32, rounded to A's dtype)
    Y_i = Y_i + addend_i                       (in A's dtype: the ONNX Add the output-add rule fused)

(On IREE CUDA the one-row float16 kernels, decode's, take products and sums of 4 in half precision first, with A
scaled by 1/16 (rewrite/plugins/kernels/cuda_int4.h), as the moe plugin's FusedMoE kernels do: within float16's
tolerance of the reference, for |A| up to about 17,000.)

With ``activation="swiglu"`` the one output is [..., N/2]: ``G = Y[..., :N/2]``, ``U = Y[..., N/2:]``,
``Y' = (G * Sigmoid(G)) * U``, each of Sigmoid and the two products rounded to A's dtype as the ONNX ops it
replaces (the ``swiglu`` rule, :mod:`rewrite.plugins.matmul4.epilogue`).

``W`` is what ``DequantizeLinear(codes [K, N], scales [nb, N], zero_points, axis=0, block_size)`` (ONNX
DequantizeLinear-21) computes from the ``quant4`` plugin's dense form, which the ``matmul4`` rule replaces.

Lowerings: ONNX Runtime (CPU and CUDA) gets that DequantizeLinear -> MatMul pair back (then a Split for
``splits``, the Sigmoid and Muls for ``swiglu``, an Add per addend), which the ``ort`` backend turns into
com.microsoft MatMulNBits (:mod:`rewrite.backends.ort_matmul_nbits`); IREE llvm-cpu gets the dequantization and
the product as ``linalg.generic`` ops (IREE's own code), a slice per output and the epilogue; IREE cuda gets one
dispatch of ``kernels/matmul4_cuda.cu``, the dequantization inside the dot product and the epilogue in its store,
each column stored straight into its output, so a decode step reads each weight byte once (iree-compile 3.13
materializes the dequantized weight of the DequantizeLinear form at every call and runs the product at 230 GB/s
on an H200: BENCHMARKS.md, "Full-size decode on the H200"), and launches once for a projection and its bias or
residual add, or for the gate and up projections and their SwiGLU; with ``norm_epsilon`` and an A of one row,
the ``_norm`` kernel normalizes A's row in its prologue (one launch for the norm and the product; a longer A's norm
is a dispatch of the RMSNorm kernel before the product's).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import TensorProto

from rewrite.core.abstract_ops import AbstractOp
from rewrite.core.int4 import pack_int4, unpack_int4
from rewrite.core.iree_lowering import (IreeLowering, PatchContext, TorchOperator, VTensor, kernel_bindings, row_count,
                                        rows_result, rows_view)
from rewrite.core.ir import Graph, Node
from rewrite.core.kernels import build_cuda_ptx, kernel_source
from rewrite.core.lowering import Lowering
from rewrite.core.rules import Builder
from rewrite.errors import BackendError
from rewrite.plugins.rmsnorm.op import (CUDA_MAX_H, RMSNorm, f32_bits, rms_norm_cuda_dispatch, rms_norm_onnx,
                                        rms_norm_rows_linalg)

_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
CUDA_THREADS = 256  #: THREADS in kernels/matmul4_cuda.cu: 8 warps, one output column each
CUDA_TOKENS = 8  #: TOKENS in kernels/matmul4_cuda.cu: rows of A per workgroup


def output_count(attrs: dict) -> int:
    """The outputs the attributes give: 1, or one per ``splits`` width (none with ``activation``)."""
    return 1 if attrs.get("activation") or not attrs.get("splits") else len(attrs["splits"])


def extra_inputs(attrs: dict, extras: list, where: str) -> tuple[list, object]:
    """(the addend inputs, the norm weight or None) from the inputs after the zero points (``extras``: names with
    ``""`` for absent ones, or arrays with None), by the contract's layout (module docstring).

    Raises:
        ValueError: naming ``where``: with ``norm_epsilon``, not exactly one addend slot per output before the
            norm weight, or an absent norm weight."""
    if attrs.get("norm_epsilon") is None:
        return list(extras), None
    outs = output_count(attrs)
    if len(extras) != outs + 1 or extras[outs] is None or (isinstance(extras[outs], str) and not extras[outs]):
        raise ValueError(f"{where}: with norm_epsilon, inputs 4 .. {3 + outs} are the addends (\"\" when absent) "
                         f"and input {4 + outs} the norm weight; got {len(extras)} input(s) after the zero points")
    return list(extras[:outs]), extras[outs]


def check_epilogue(attrs: dict, where: str, addends: int, outputs: int | None = None) -> None:
    """The contract's rules for ``activation``, ``splits`` and the addend inputs (module docstring): ``attrs``
    holds ``N`` and optionally ``splits`` and ``activation``; ``addends`` counts the inputs after zero points.

    Raises:
        ValueError: naming ``where``: an activation other than swiglu, swiglu with an odd N, splits or addends,
            more addends than outputs, or ``outputs`` other than the attributes give."""
    act, splits, n = attrs.get("activation") or "", attrs.get("splits"), int(attrs["N"])
    if act not in ("", "swiglu"):
        raise ValueError(f"{where}: activation '{act}'; only 'swiglu' is defined")
    if act and (n % 2 or splits or addends):
        raise ValueError(f"{where}: activation swiglu needs an even N (got {n}), no splits and no addends")
    expected = output_count(attrs)
    if addends > expected or (outputs is not None and outputs != expected):
        raise ValueError(f"{where}: {addends} addend input(s) and {outputs} output(s) for {expected} output(s)")


def dequantize(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, block: int) -> np.ndarray:
    """float32 W [K, N] from packed codes [N, ceil(K/2)], scales [N, nb] and zero points [N, nb] (8 when None)."""
    c = unpack_int4(codes, k).astype(np.float32)
    zp = np.full(scales.shape, 8.0, np.float32) if zero_points is None else zero_points.astype(np.float32)
    rep = lambda a: np.repeat(a.astype(np.float32), block, axis=-1)[:, :k]  # noqa: E731
    return ((c - rep(zp)) * rep(scales)).T


class MatMulInt4(AbstractOp):
    """The contract in the module docstring."""

    op_type = "MatMulInt4"
    ort_targets = ("cpu", "cuda")

    def lowerings(self) -> list[Lowering]:
        return super().lowerings() + [Lowering(self.op_type, "iree", ("cuda",), self.lower_iree_cuda, origin=type(self).__module__)]

    def reference(self, attrs: dict, a, codes, scales, zero_points=None, *addends) -> list[np.ndarray]:
        """numpy float32 evaluation of the contract, each ONNX op's result rounded to A's dtype.

        ``a`` [..., K] f32/f16, ``codes`` uint8 [N, ceil(K/2)], ``scales`` [N, nb], ``zero_points`` uint8 [N, nb] or
        None, ``addends`` one per output, each [width] or the output's shape, or None (with ``norm_epsilon`` one
        per output, then the norm weight [K]). Returns [Y] [..., N], one
        array per split, or with ``activation="swiglu"`` [Y'] [..., N/2], in A's dtype.

        Raises:
            ValueError: an activation other than swiglu, or attributes and inputs outside the contract."""
        where = f"MatMulInt4 with attributes {attrs}"
        addends, norm_weight = extra_inputs(attrs, list(addends), where)
        check_epilogue(attrs, where, len(addends) if any(x is not None for x in addends) else 0)
        if norm_weight is not None:
            a = RMSNorm().reference({"epsilon": attrs["norm_epsilon"]}, a, np.asarray(norm_weight))[0]
        dt, f32 = a.dtype, np.float32
        w = dequantize(codes, scales, zero_points, int(attrs["K"]), int(attrs["block_size"]))
        y = (a.astype(f32) @ w).astype(dt)
        if attrs.get("activation") == "swiglu":
            half = y.shape[-1] // 2
            g, u = y[..., :half].astype(f32), y[..., half:].astype(f32)
            sig = (1.0 / (1.0 + np.exp(-g))).astype(dt).astype(f32)
            return [((g * sig).astype(dt).astype(f32) * u).astype(dt)]
        splits = attrs.get("splits")
        ys = np.split(y, np.cumsum(splits)[:-1], axis=-1) if splits else [y]
        return [yi if add is None else (yi.astype(f32) + np.asarray(add).astype(f32)).astype(dt)
                for yi, add in zip(ys, list(addends) + [None] * (len(ys) - len(addends)))]

    def sample_inputs(self, rng: np.random.Generator) -> list[tuple[dict, list[np.ndarray]]]:
        """Conformance-kit samples: a partial last block, no zero points, f16, 3-D A, rows not a multiple of 8,
        splits, addends (a bias, a residual, absent ones), SwiGLU, and the RMSNorm prologue with each of them."""
        def case(m, k, n, bs, dt, zp=True, lead=(), splits=None, adds=(), act=None, norm=None):
            nb = -(-k // bs)
            a = (rng.standard_normal((*lead, m, k)) * (3 if norm else 1)).astype(dt)
            ins = [a, pack_int4(rng.integers(0, 16, (n, k))), (rng.random((n, nb)) * 0.1 + 0.01).astype(dt)]
            ins.append(rng.integers(0, 16, (n, nb)).astype(np.uint8) if zp else None)
            outs = 1 if act else len(splits or [n])
            for w, add in zip(splits or [n], adds):  # "bias" [w], "residual" [..., m, w] or None
                ins.append(None if add is None else rng.standard_normal((w,) if add == "bias" else (*lead, m, w)).astype(dt))
            if norm is not None:  # the addend slots padded to one per output, then the norm weight
                ins += [None] * (4 + outs - len(ins)) + [(1 + 0.1 * rng.standard_normal(k)).astype(dt)]
            while ins[-1] is None:
                ins.pop()
            attrs = dict(K=k, N=n, block_size=bs, **({"splits": splits} if splits else {}), **({"activation": act} if act else {}),
                         **({"norm_epsilon": norm} if norm is not None else {}))
            return attrs, ins
        return [case(3, 96, 40, 32, np.float32), case(1, 64, 24, 64, np.float32, zp=False),
                case(9, 128, 72, 128, np.float16), case(5, 80, 16, 16, np.float16, lead=(2,)),
                case(2, 64, 56, 32, np.float32, splits=[24, 16, 16]), case(1, 128, 48, 64, np.float16, splits=[40, 8]),
                case(3, 64, 56, 32, np.float16, splits=[24, 16, 16], adds=("bias", None, "residual")),
                case(1, 96, 32, 32, np.float32, zp=False, lead=(1,), adds=("residual",)),
                case(2, 64, 48, 64, np.float16, adds=("bias",)),
                case(3, 64, 48, 32, np.float16, act="swiglu"), case(1, 96, 64, 32, np.float32, zp=False, lead=(1,), act="swiglu"),
                # the RMSNorm prologue: one row (the CUDA kernels' own) and several (a dispatch of the norm first)
                case(1, 256, 48, 64, np.float16, lead=(1,), splits=[32, 8, 8], norm=1e-6),
                case(1, 64, 40, 32, np.float32, zp=False, adds=("residual",), norm=1e-5),
                case(1, 128, 32, 32, np.float16, lead=(1,), act="swiglu", norm=1e-6),
                case(4, 96, 24, 32, np.float16, splits=[16, 8], adds=(None, "bias"), norm=1e-6),
                case(3, 64, 16, 64, np.float32, lead=(2,), norm=1e-6)]

    # ------------------------------------------------------------------ ORT
    def lower_ort(self, graph: Graph, node: Node) -> None:
        """Initializer weights: ``DequantizeLinear(codes [K, N] UINT4, scales [nb, N], zero_points [nb, N] UINT4,
        axis=0, block_size) -> MatMul``, the ``quant4`` form the ort backend then runs as com.microsoft
        MatMulNBits. Weights computed in the graph: the same dequantization in standard ONNX ops (BitwiseAnd and
        BitShift unpack the nibbles; scales and zero points repeated per block, as ``legalize`` does). Then the
        ops the plugin's later rules fused, back as they were: a Split for ``splits``, Split, Sigmoid and two Muls
        for ``swiglu``, an Add per addend; the RMSNorm before the product for ``norm_epsilon``
        (:func:`rewrite.plugins.rmsnorm.op.rms_norm_onnx`)."""
        a, b_in, s_in = node.inputs[:3]
        z_in = node.inputs[3] if len(node.inputs) > 3 else ""
        codes, scales = graph.const(b_in), graph.const(s_in)
        zps = graph.const(z_in) if z_in else None
        k, n, bs = int(node.attr("K")), int(node.attr("N")), int(node.attr("block_size"))
        dt = graph.values[a].dtype
        b = Builder(graph, "lower/MatMulInt4", node.order, node.name)
        if codes is not None and scales is not None and (zps is not None or not z_in):
            zps = np.full(scales.shape, 8, np.uint8) if zps is None else zps
            q = b.const(unpack_int4(codes, k).T.astype(ml_dtypes.uint4), "codes")
            zp = b.const(np.ascontiguousarray(zps.T).astype(ml_dtypes.uint4), "zero_points")
            w = b.op("DequantizeLinear", [q, b.const(np.ascontiguousarray(scales.T), "scales"), zp], axis=0, block_size=bs,
                     dtype=dt, shape=[k, n])
        else:
            w = b.op("Transpose", [_dequantize_onnx(b, b_in, s_in, z_in, k, n, bs, dt)], perm=[1, 0], dtype=dt, shape=[k, n])
        attrs = {k: node.attr(k) for k in ("N", "splits", "activation", "norm_epsilon") if node.attr(k) is not None}
        try:
            where = f"MatMulInt4 node {node.describe()}"
            addends, norm_weight = extra_inputs(attrs, list(node.inputs[4:]), where)
            check_epilogue(attrs, where, len(addends) if any(addends) else 0, len(node.outputs))
        except ValueError as e:
            raise BackendError(str(e)) from None
        if norm_weight:
            a = rms_norm_onnx(b, a, norm_weight, float(attrs["norm_epsilon"]))
        splits = node.attr("splits")
        swiglu = node.attr("activation") == "swiglu"
        shapes = [graph.values[o].shape for o in node.outputs]
        y = b.op("MatMul", [a, w], dtype=dt, shape=None if splits or swiglu else shapes[0])
        if swiglu:  # the ops the swiglu rule fused: Sigmoid(G) * G * U, each in A's dtype
            g, u = b.op("Split", [y, b.const(np.array([n // 2, n // 2], np.int64), "halves")], outputs=2, axis=-1,
                        dtype=dt, shape=shapes[0])
            ys = [b.op("Mul", [b.op("Mul", [g, b.op("Sigmoid", [g], dtype=dt, shape=shapes[0])], dtype=dt, shape=shapes[0]), u],
                       dtype=dt, shape=shapes[0])]
        elif splits:
            ys = list(b.op("Split", [y, b.const(np.array(splits, np.int64), "splits")], outputs=len(splits), axis=-1))
            for new, shape in zip(ys, shapes):
                graph.values[new].set_type(dt, shape)
        else:
            ys = [y]
        for i, add in enumerate(addends):  # the Adds the output-add rule fused
            if add:
                ys[i] = b.op("Add", [ys[i], add], dtype=dt, shape=shapes[i])
        graph.replace_node(node, ys)
        graph.remove_unused_initializers()

    # ----------------------------------------------------------------- IREE
    def lower_iree(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """llvm-cpu: a ``linalg.generic`` dequantizing B into a float32 [N, K] tensor, then one computing
        ``A W`` over [M, N, K] (M = the product of A's leading dims), truncated to A's type; then SwiGLU of its
        halves, or a slice per output and its addend (:class:`_Types`).

        Raises:
            BackendError: a target other than llvm-cpu, a dynamic K or N, or an operand outside the contract.
        """
        if ctx.target != "llvm-cpu":
            raise BackendError(f"MatMulInt4 linalg lowering asked for target '{ctx.target}'")
        t = _Types(op)
        f16 = t.el == "f16"
        zp = (f"%z = tensor.extract %in3[%n, %blk] : tensor<{t.N}x{t.nb}xi8>\n      %zi = arith.extui %z : i8 to i32"
              if t.has_zp else "%zi = arith.constant 8 : i32")
        scale = "%s = tensor.extract %in2[%n, %blk] : tensor<{N}x{nb}x{el}>".format(N=t.N, nb=t.nb, el=t.el)
        scale += "\n      %sf = arith.extf %s : f16 to f32" if f16 else ""
        x = "%xf = arith.extf %x : f16 to f32\n      " if f16 else ""
        body = t.collapse() + f"""
    %w0 = tensor.empty() : tensor<{t.N}x{t.K}xf32>
    %w = linalg.generic {{indexing_maps = [affine_map<(n, k) -> (n, k)>], iterator_types = ["parallel", "parallel"]}}
        outs(%w0 : tensor<{t.N}x{t.K}xf32>) {{
    ^bb0(%o: f32):
      %n = linalg.index 0 : index
      %k = linalg.index 1 : index
      %c2 = arith.constant 2 : index
      %cbs = arith.constant {t.bs} : index
      %kb = arith.divui %k, %c2 : index
      %odd = arith.remui %k, %c2 : index
      %byte = tensor.extract %in1[%n, %kb] : tensor<{t.N}x{t.Kp}xi8>
      %b32 = arith.extui %byte : i8 to i32
      %odd32 = arith.index_cast %odd : index to i32
      %c4 = arith.constant 4 : i32
      %sh = arith.muli %odd32, %c4 : i32
      %hi = arith.shrui %b32, %sh : i32
      %c15 = arith.constant 15 : i32
      %code = arith.andi %hi, %c15 : i32
      %blk = arith.divui %k, %cbs : index
      {zp}
      %d = arith.subi %code, %zi : i32
      %df = arith.sitofp %d : i32 to f32
      {scale}
      %v = arith.mulf %df, {"%sf" if f16 else "%s"} : f32
      linalg.yield %v : f32
    }} -> tensor<{t.N}x{t.K}xf32>
    %zero = arith.constant 0.0 : f32
    %y0 = tensor.empty(%m) : tensor<?x{t.N}xf32>
    %y1 = linalg.fill ins(%zero : f32) outs(%y0 : tensor<?x{t.N}xf32>) -> tensor<?x{t.N}xf32>
    %y = linalg.generic {{indexing_maps = [affine_map<(i, n, k) -> (i, k)>, affine_map<(i, n, k) -> (n, k)>, affine_map<(i, n, k) -> (i, n)>],
                         iterator_types = ["parallel", "parallel", "reduction"]}}
        ins(%a, %w : tensor<?x{t.K}x{t.el}>, tensor<{t.N}x{t.K}xf32>) outs(%y1 : tensor<?x{t.N}xf32>) {{
    ^bb0(%x: {t.el}, %wv: f32, %acc: f32):
      {x}%p = arith.mulf {"%xf" if f16 else "%x"}, %wv : f32
      %r = arith.addf %acc, %p : f32
      linalg.yield %r : f32
    }} -> tensor<?x{t.N}xf32>
"""
        if f16:
            body += f"""    %yo0 = tensor.empty(%m) : tensor<?x{t.N}xf16>
    %yo = linalg.generic {{indexing_maps = [affine_map<(i, n) -> (i, n)>, affine_map<(i, n) -> (i, n)>], iterator_types = ["parallel", "parallel"]}}
        ins(%y : tensor<?x{t.N}xf32>) outs(%yo0 : tensor<?x{t.N}xf16>) {{
    ^bb0(%v: f32, %o: f16):
      %vt = arith.truncf %v : f32 to f16
      linalg.yield %vt : f16
    }} -> tensor<?x{t.N}xf16>
"""
        body += t.expand("%yo" if f16 else "%y")
        return IreeLowering(body=body)

    def lower_iree_cuda(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """One dispatch of ``kernels/matmul4_cuda.cu`` (PTX for ``ctx.cuda_arch``), ``matmul_int4_<el>_v<VEC>``
        (``_o2``/``_o3`` with 2 or 3 ``splits``, ``_swiglu`` with that activation) on (ceil(C / 8), ceil(M / 8))
        workgroups of 256 threads (C output columns): a warp per output column and 8 rows of A, the dequantization
        inside the dot product, the addends or SwiGLU in the store (the kernel source's header); for an A of one
        row (static shape) the ``_t1`` variant, one row per workgroup. Bindings A, B, scales, zero points (a dummy
        when absent), one addend per output (a dummy when absent), the outputs; push constants M, K, N,
        block_size, has_zp, the first two split widths and add_mode (i32). With ``norm_epsilon``: for a one-row A
        the ``_t1..._norm`` kernel, the norm weight bound after the zero points and the epsilon's float32 bits a
        ninth push constant; for a longer A a dispatch of the RMSNorm kernel first
        (:func:`rewrite.plugins.rmsnorm.op.rms_norm_cuda_dispatch`).

        Raises:
            BackendError: a target other than cuda, a dynamic K or N, K or the block size not a multiple of 8, K
                over 8192 with ``norm_epsilon``, or
                an operand outside the contract (:class:`_Types`).
        """
        if ctx.target != "cuda":
            raise BackendError(f"MatMulInt4 CUDA lowering asked for target '{ctx.target}'")
        t = _Types(op)
        if t.K % 8 or t.bs % 8:
            raise BackendError(f"MatMulInt4 on cuda: K={t.K}, block_size={t.bs}; the kernel takes multiples of 8")
        vec = 32 if t.K % 32 == 0 and t.bs % 32 == 0 else 8
        obj = ctx.object_path(build_cuda_ptx(kernel_source(__file__, "matmul4_cuda.cu"), ctx.cuda_arch))
        outs = len(t.widths)
        one_row = None not in t.a.dims[:-1] and int(np.prod(t.a.dims[:-1])) == 1  # decode: the *_t1 kernels
        tokens = 1 if one_row else CUDA_TOKENS
        norm_in_kernel = t.norm is not None and one_row
        if t.norm is not None and t.K > CUDA_MAX_H:
            raise BackendError(f"MatMulInt4 {op.where}: K={t.K} with norm_epsilon; the CUDA kernels normalize rows of at most {CUDA_MAX_H}")
        variant = (f"{t.el}_v{vec}" + ("_t1" if one_row else "") + (f"_o{outs}" if outs > 1 else "")
                   + ("_swiglu" if t.swiglu else "") + ("_norm" if norm_in_kernel else ""))
        kernel, name = f"matmul_int4_{variant}", CUDA_EXECUTABLE
        zp = "%in3" if t.has_zp else "%z"
        ztype = f"tensor<{t.N}x{t.nb}xi8>" if t.has_zp else "tensor<1xi8>"
        adds, add_types = [], []
        for i, add in enumerate(t.addends):
            if add is None:
                adds.append("%dummy")
                add_types.append(f"tensor<1x{t.el}>")
            else:
                dyn = [f"%in{4 + i}_d{ax}" for ax, d in enumerate(add[1].dims) if d is None]
                adds.append(f"%in{4 + i}")
                add_types.append(add[1].builtin + (f"{{{', '.join(dyn)}}}" if dyn else ""))
        rows, dyn, _ = row_count(t.a, t.N)
        results = [row_count(t.a, w)[2] for w in t.widths]
        n0, n1 = ((t.widths if not t.swiglu else []) + [0, 0])[:2]
        items = {name: _cuda_executable(obj)}
        a, norm, norm_type, consts, const_types = "%in0", "", "", "", ""
        if norm_in_kernel:
            norm, norm_type = f"%in{t.norm[0]}, ", f"{t.norm[1].builtin}, "
            consts, const_types = ", %eps32", ", i32"
            rows += f"\n    %eps32 = arith.constant {f32_bits(t.eps)} : i32"
        elif t.norm is not None:  # several rows: the RMSNorm kernel's dispatch, then the plain product's
            norm_body, norm_items = rms_norm_cuda_dispatch(ctx, "%in0", f"{t.a.builtin}{dyn}", f"%in{t.norm[0]}",
                                                           t.norm[1].builtin, "%m", t.K, t.el, t.eps, "%an")
            rows += "\n" + norm_body
            items.update(norm_items)
            a = "%an"
        # A and Y go to the kernel in their own shapes (a pointer is all it takes): reshapes around the dispatch
        # make iree-compile 3.13 fail in SinkReshapes ("failed to sink reshape ops") on a 6-layer model
        body = rows + f"""
    %tok = arith.constant {tokens} : index
    %gx = arith.constant {-(-sum(t.widths) // (CUDA_THREADS // 32))} : index
    %gy = arith.ceildivui %m, %tok : index
    %z = arith.constant dense<0> : tensor<1xi8>
    %dummy = arith.constant dense<0.0> : tensor<1x{t.el}>
    %m32 = arith.index_cast %m : index to i32
    %k32 = arith.constant {t.K} : i32
    %n32 = arith.constant {t.N} : i32
    %bs32 = arith.constant {t.bs} : i32
    %zp32 = arith.constant {1 if t.has_zp else 0} : i32
    %n0 = arith.constant {n0} : i32
    %n1 = arith.constant {n1} : i32
    %addm = arith.constant {t.add_mode()} : i32
    %y{":" + str(outs) if outs > 1 else ""} = flow.dispatch @{name}::@{kernel}[%gx, %gy]({a}, %in1, %in2, {zp}, {norm}{", ".join(adds)}, %m32, %k32, %n32, %bs32, %zp32, %n0, %n1, %addm{consts}) :
        ({t.a.builtin}{dyn}, tensor<{t.N}x{t.Kp}xi8>, tensor<{t.N}x{t.nb}x{t.el}>, {ztype}, {norm_type}{", ".join(add_types)}, i32, i32, i32, i32, i32, i32, i32, i32{const_types})
        -> ({", ".join(r + dyn for r in results)})
"""
        for i, (r, o) in enumerate(zip(results, t.outs)):
            body += f"    %out{i} = tensor.cast %y{'#' + str(i) if outs > 1 else ''} : {r} to {o.builtin}\n"
        return IreeLowering(body=body, module_items=items)


def _dequantize_onnx(b: Builder, codes: str, scales: str, zero_points: str, k: int, n: int, bs: int, dt: int) -> str:
    """W [N, K] of dtype ``dt`` from the contract's inputs, in standard ONNX (opset 18+)."""
    i64 = lambda v, name: b.const(np.asarray(v, np.int64), name)  # noqa: E731
    lo = b.op("BitwiseAnd", [codes, b.const(np.array(15, np.uint8), "low_mask")])
    hi = b.op("BitShift", [codes, b.const(np.array(4, np.uint8), "four")], direction="RIGHT")
    last = i64([-1], "last")
    pairs = b.op("Concat", [b.op("Unsqueeze", [lo, last]), b.op("Unsqueeze", [hi, last])], axis=-1)  # [N, K/2, 2]
    start, end, axis1 = i64([0], "start"), i64([k], "k"), i64([1], "axis1")
    c = b.op("Slice", [b.op("Reshape", [pairs, i64([n, -1], "rows")]), start, end, axis1])

    def per_element(param: str) -> str:  # [N, nb] -> [N, K]: each block's value repeated block_size times
        t = b.op("Tile", [b.op("Unsqueeze", [param, last]), i64([1, 1, bs], "repeats")])
        return b.op("Slice", [b.op("Reshape", [t, i64([n, -1], "rows")]), start, end, axis1])

    zf = b.op("Cast", [zero_points], to=dt) if zero_points else b.const(np.array(8, _NP[dt]), "eight")
    diff = b.op("Sub", [b.op("Cast", [c], to=dt), per_element(zf) if zero_points else zf])
    return b.op("Mul", [diff, per_element(scales)], dtype=dt, shape=[n, k])


class _Types:
    """An imported MatMulInt4's sizes and the MLIR that views A as [M, K] (``%a``, ``%m``) and the [M, N] result
    as the outputs (``%out<i>``), the epilogue (addends, SwiGLU) included.

    Raises:
        BackendError: splits, activation, addends or shapes outside the contract (module docstring).
    """

    def __init__(self, op: TorchOperator):
        a, b = op.operand_types[0], op.operand_types[1]
        self.a, self.outs = a, op.result_types
        self.K, self.N, self.bs = int(op.attrs["K"]), int(op.attrs["N"]), int(op.attrs["block_size"])
        try:
            where = f"MatMulInt4 {op.where}"
            extras = [None if t.element == "none" else t for t in op.operand_types[4:]]
            add_types, norm = extra_inputs(op.attrs, extras, where)
            check_epilogue(op.attrs, where, len(add_types) if any(t is not None for t in add_types) else 0, len(self.outs))
        except ValueError as e:
            raise BackendError(str(e)) from None
        #: the norm weight's operand index and type, or None (the RMSNorm prologue)
        self.norm: tuple[int, VTensor] | None = None
        if norm is not None:
            if norm.dims != [self.K] or norm.element != a.element:
                raise BackendError(f"MatMulInt4 {op.where}: norm weight {norm.text}; [{self.K}] of A's element type expected")
            self.norm = (4 + len(add_types), norm)
            self.eps = float(op.attrs["norm_epsilon"])
        self.swiglu = op.attrs.get("activation") == "swiglu"
        self.widths = [self.N // 2] if self.swiglu else [int(w) for w in op.attrs.get("splits") or [self.N]]
        if (not self.swiglu and sum(self.widths) != self.N) or len(self.widths) != len(self.outs) or len(self.widths) > 3:
            raise BackendError(f"MatMulInt4 {op.where}: splits {self.widths} for N={self.N} and {len(self.outs)} "
                               "output(s); 1 to 3 widths summing to N, one per output, expected")
        if a.dims[-1] not in (None, self.K) or b.dims != [self.N, (self.K + 1) // 2]:
            raise BackendError(f"MatMulInt4 {op.where}: A {a.text} and B {b.text} do not fit K={self.K}, N={self.N}")
        if a.dims[-1] is None:
            raise BackendError(f"MatMulInt4 {op.where}: A's last dim (K) must be static, got {a.text}")
        self.Kp, self.nb = (self.K + 1) // 2, -(-self.K // self.bs)
        self.el = a.builtin_element
        self.has_zp = len(op.operand_types) > 3 and op.operand_types[3].element != "none"
        # per output: None, ("bias", type) for [width] or ("rows", type) for the output's own shape
        self.addends: list[tuple[str, VTensor] | None] = [None] * len(self.outs)
        for i, t in enumerate(add_types):
            if t is None:
                continue
            out = self.outs[i]
            if t.element != a.element or (t.dims != [self.widths[i]] and t.dims != out.dims):
                raise BackendError(f"MatMulInt4 {op.where}: addend {i} is {t.text}; A's element type and "
                                   f"[{self.widths[i]}] (a bias) or the output's shape {out.text} expected")
            self.addends[i] = ("bias" if t.dims == [self.widths[i]] else "rows", t)

    def collapse(self) -> str:
        """``%a`` (A as ``tensor<?xKxel>``, normalized for ``norm_epsilon``) and ``%m`` (its rows)."""
        if self.norm is None:
            return rows_view(self.a, self.K)
        k, t = self.norm
        return (rows_view(self.a, self.K, "%a_in") + "\n"
                + rms_norm_rows_linalg("%a_in", "%m", self.K, self.el, f"%in{k}", t.builtin, self.eps, "%a"))

    def add_mode(self) -> int:
        """The CUDA kernel's ``add_mode`` push constant: 2 bits per output, 0 none, 1 bias, 2 rows."""
        return sum({"bias": 1, "rows": 2}[a[0]] << (2 * i) for i, a in enumerate(self.addends) if a)

    def expand(self, y: str) -> str:
        """``%out<i>`` from the [M, N] result ``y`` (A's element type): SwiGLU of its halves, or one slice of
        columns per output plus its addend, expanded to A's leading dims."""
        if self.swiglu:
            return self._swiglu(y) + "\n" + rows_result(self.a, self.widths[0], "%ysw", self.outs[0])
        el, lines, off = self.el, [], 0
        for i, (w, out) in enumerate(zip(self.widths, self.outs)):
            part = y
            if len(self.widths) > 1:
                lines.append(f"    %ys{i} = tensor.extract_slice {y}[0, {off}] [%m, {w}] [1, 1] : tensor<?x{self.N}x{el}> to tensor<?x{w}x{el}>")
                part = f"%ys{i}"
            if self.addends[i] is not None:
                lines.append(self._add(i, part, w))
                part = f"%ya{i}"
            lines.append(rows_result(self.a, w, part, out, f"%out{i}"))
            off += w
        return "\n".join(lines)

    def _add(self, i: int, part: str, w: int) -> str:
        """``%ya<i>`` = ``part`` [M, w] + addend i (operand 4 + i), in f32 and rounded to A's type."""
        el, k = self.el, 4 + i
        kind, t = self.addends[i]
        rows = f"tensor<?x{w}x{el}>"
        if kind == "bias":
            lines, view, vtype, amap = [], f"%in{k}", t.builtin, "affine_map<(i, n) -> (n)>"
        elif len(t.dims) == 2:
            lines, view, vtype, amap = [f"    %av{i} = tensor.cast %in{k} : {t.builtin} to {rows}"], f"%av{i}", rows, "affine_map<(i, n) -> (i, n)>"
        else:
            m = "?" if None in t.dims[:-1] else str(int(np.prod(t.dims[:-1])))
            col = f"tensor<{m}x{w}x{el}>"
            lines = [f"    %avc{i} = tensor.collapse_shape %in{k} [[{', '.join(map(str, range(len(t.dims) - 1)))}], [{len(t.dims) - 1}]] : "
                     f"{t.builtin} into {col}", f"    %av{i} = tensor.cast %avc{i} : {col} to {rows}"]
            view, vtype, amap = f"%av{i}", rows, "affine_map<(i, n) -> (i, n)>"
        f16 = el == "f16"
        math = ("%pf = arith.extf %p : f16 to f32\n      %qf = arith.extf %q : f16 to f32\n      %r = arith.addf %pf, %qf : f32\n"
                "      %rt = arith.truncf %r : f32 to f16\n      linalg.yield %rt : f16") if f16 else "%r = arith.addf %p, %q : f32\n      linalg.yield %r : f32"
        lines.append(f"""    %ya{i}_e = tensor.empty(%m) : {rows}
    %ya{i} = linalg.generic {{indexing_maps = [affine_map<(i, n) -> (i, n)>, {amap}, affine_map<(i, n) -> (i, n)>], iterator_types = ["parallel", "parallel"]}}
        ins({part}, {view} : {rows}, {vtype}) outs(%ya{i}_e : {rows}) {{
    ^bb0(%p: {el}, %q: {el}, %o: {el}):
      {math}
    }} -> {rows}""")
        return "\n".join(lines)

    def _swiglu(self, y: str) -> str:
        """``%ysw`` [M, N/2] = (G * Sigmoid(G)) * U of ``y``'s halves, each step rounded to A's type."""
        el, h = self.el, self.N // 2
        f16 = el == "f16"
        lines = ["%gf = arith.extf %g : f16 to f32", "%uf = arith.extf %u : f16 to f32"] if f16 else []
        g, u = ("%gf", "%uf") if f16 else ("%g", "%u")

        def rounded(v: str) -> str:  # v (f32) as an ONNX intermediate of A's type stores it
            if not f16:
                return v
            lines.extend([f"{v}t = arith.truncf {v} : f32 to f16", f"{v}r = arith.extf {v}t : f16 to f32"])
            return f"{v}r"

        lines += ["%one = arith.constant 1.0 : f32", f"%ng = arith.negf {g} : f32", "%e = math.exp %ng : f32",
                  "%den = arith.addf %one, %e : f32", "%sg = arith.divf %one, %den : f32"]
        lines.append(f"%gs = arith.mulf {g}, {rounded('%sg')} : f32")
        lines.append(f"%r = arith.mulf {rounded('%gs')}, {u} : f32")
        lines += ["%rt = arith.truncf %r : f32 to f16", "linalg.yield %rt : f16"] if f16 else ["linalg.yield %r : f32"]
        body = "\n      ".join(lines)
        half = f"tensor<?x{h}x{el}>"
        return f"""    %ysg = tensor.extract_slice {y}[0, 0] [%m, {h}] [1, 1] : tensor<?x{self.N}x{el}> to {half}
    %ysu = tensor.extract_slice {y}[0, {h}] [%m, {h}] [1, 1] : tensor<?x{self.N}x{el}> to {half}
    %ysw_e = tensor.empty(%m) : {half}
    %ysw = linalg.generic {{indexing_maps = [affine_map<(i, n) -> (i, n)>, affine_map<(i, n) -> (i, n)>, affine_map<(i, n) -> (i, n)>],
                           iterator_types = ["parallel", "parallel"]}}
        ins(%ysg, %ysu : {half}, {half}) outs(%ysw_e : {half}) {{
    ^bb0(%g: {el}, %u: {el}, %o: {el}):
      {body}
    }} -> tensor<?x{h}x{el}>"""


#: the kernels of kernels/matmul4_cuda.cu: (name, outputs, with the RMSNorm prologue), in the order of their
#: ordinals; the ``_norm`` kernels for one-row A only
CUDA_KERNELS = [(f"matmul_int4_{el}_v{vec}{t1}{suffix}{norm}", outs, bool(norm)) for norm in ("", "_norm")
                for el in ("f16", "f32") for vec in (32, 8) for t1 in ("", "_t1") if t1 or not norm
                for suffix, outs in (("", 1), ("_o2", 2), ("_o3", 3), ("_swiglu", 1))]
CUDA_EXECUTABLE = "matmul4_exec"


def _cuda_executable(obj: str) -> str:
    """The ``hal.executable.source`` declaring every kernel of the PTX (:data:`CUDA_KERNELS`), each with 4 + outs
    bindings read (A, B, scales, zero points, an addend per output; the ``_norm`` kernels the norm weight after
    the zero points), then outs written; 8 i32 push constants (9 with the norm's epsilon); workgroups of
    CUDA_THREADS threads on the grid the dispatch's workload gives.

    One executable for all: iree-compile 3.13 merges executables that differ only in their export's name
    (DeduplicateExecutables), so one per kernel would run the ``_swiglu`` kernel's dispatches on the plain one
    (same bindings); and the 2 MB of PTX are embedded once."""
    exports = []
    for ordinal, (kernel, outs, norm) in enumerate(CUDA_KERNELS):
        exports.append(
            f"    hal.executable.export public @{kernel} ordinal({ordinal})\n"
            f"        layout(#hal.pipeline.layout<constants = {8 + norm}, bindings = [{kernel_bindings(4 + norm + outs, outs)}]>)\n"
            f"        count(%device: !hal.device, %gx: index, %gy: index) -> (index, index, index) {{\n"
            f"      %c1 = arith.constant 1 : index\n      hal.return %gx, %gy, %c1 : index, index, index\n"
            f"    }} <workgroup_size = [{CUDA_THREADS} : index, 1 : index, 1 : index]>")
    return (f"  hal.executable.source private @{CUDA_EXECUTABLE} <objects = <{{\n"
            f"      #hal.executable.target<\"cuda\", \"cuda-nvptx-fb\"> = [#hal.executable.object<{{path = \"{obj}\"}}>]}}>> {{\n"
            + "\n".join(exports) + "\n  }")
