"""``ai.rewrite::MatMulInt4``: a MatMul by a constant block-wise INT4 weight, its reference and its lowerings.

Contract (inputs; K the reduction size, N the output size, nb = ceil(K / block_size), float = f32 or f16):

0. ``A`` float [..., K]
1. ``B`` UINT8 [N, ceil(K/2)]: the weight's INT4 codes (0..15) of output column n along K, two per byte, the even
   element in the low nibble (com.microsoft MatMulNBits / QMoE packing, :func:`rewrite.core.int4.pack_int4`)
2. ``scales`` [N, nb], A's dtype
3. ``zero_points`` UINT8 [N, nb] (optional; absent means 8, MatMulNBits' default)

Attributes ``K``, ``N``, ``block_size`` and optionally ``splits`` (2 or 3 widths summing to N). Output ``Y``
[..., N] in A's dtype, or with ``splits`` one output per width, ``Y_i`` [..., splits[i]] = Y's next splits[i]
columns (the ``shared-input`` merge of products reading one A, :mod:`rewrite.plugins.matmul4.merge`)::

    W[k, n] = (code[n, k] - zero_point[n, k // block_size]) * scales[n, k // block_size]
    Y = A @ W                                  (summed in float32)

``W`` is what ``DequantizeLinear(codes [K, N], scales [nb, N], zero_points, axis=0, block_size)`` (ONNX
DequantizeLinear-21) computes from the ``quant4`` plugin's dense form, which the ``matmul4`` rule replaces.

Lowerings: ONNX Runtime (CPU and CUDA) gets that DequantizeLinear -> MatMul pair back (then a Split for
``splits``), which the ``ort`` backend turns into com.microsoft MatMulNBits
(:mod:`rewrite.backends.ort_matmul_nbits`); IREE llvm-cpu gets the dequantization and the product as two
``linalg.generic`` ops (IREE's own code) and a slice per output; IREE cuda gets one dispatch of
``kernels/matmul4_cuda.cu``, the dequantization inside the dot product, each column stored straight into its
output, so a decode step reads each weight byte once (iree-compile 3.13 materializes the dequantized weight of the
DequantizeLinear form at every call and runs the product at 230 GB/s on an H200: BENCHMARKS.md, "Full-size decode
on the H200").
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import TensorProto

from rewrite.core.abstract_ops import AbstractOp
from rewrite.core.int4 import pack_int4, unpack_int4
from rewrite.core.iree_lowering import IreeLowering, PatchContext, TorchOperator, kernel_bindings, row_count, rows_result, rows_view
from rewrite.core.ir import Graph, Node
from rewrite.core.kernels import build_cuda_ptx, kernel_source
from rewrite.core.lowering import Lowering
from rewrite.core.rules import Builder
from rewrite.errors import BackendError

_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
CUDA_THREADS = 256  #: THREADS in kernels/matmul4_cuda.cu: 8 warps, one output column each
CUDA_TOKENS = 8  #: TOKENS in kernels/matmul4_cuda.cu: rows of A per workgroup


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

    def reference(self, attrs: dict, a, codes, scales, zero_points=None) -> list[np.ndarray]:
        """numpy float32 evaluation of the contract; returns [Y] (or one array per split) in A's dtype."""
        w = dequantize(codes, scales, zero_points, int(attrs["K"]), int(attrs["block_size"]))
        y = (a.astype(np.float32) @ w).astype(a.dtype)
        splits = attrs.get("splits")
        return np.split(y, np.cumsum(splits)[:-1], axis=-1) if splits else [y]

    def sample_inputs(self, rng: np.random.Generator) -> list[tuple[dict, list[np.ndarray]]]:
        """Conformance-kit samples: a partial last block, no zero points, f16, 3-D A, rows not a multiple of 8."""
        def case(m, k, n, bs, dt, zp=True, lead=(), splits=None):
            nb = -(-k // bs)
            a = rng.standard_normal((*lead, m, k)).astype(dt)
            ins = [a, pack_int4(rng.integers(0, 16, (n, k))), (rng.random((n, nb)) * 0.1 + 0.01).astype(dt)]
            if zp:
                ins.append(rng.integers(0, 16, (n, nb)).astype(np.uint8))
            return dict(K=k, N=n, block_size=bs, **({"splits": splits} if splits else {})), ins
        return [case(3, 96, 40, 32, np.float32), case(1, 64, 24, 64, np.float32, zp=False),
                case(9, 128, 72, 128, np.float16), case(5, 80, 16, 16, np.float16, lead=(2,)),
                case(2, 64, 56, 32, np.float32, splits=[24, 16, 16]), case(1, 128, 48, 64, np.float16, splits=[40, 8])]

    # ------------------------------------------------------------------ ORT
    def lower_ort(self, graph: Graph, node: Node) -> None:
        """Initializer weights: ``DequantizeLinear(codes [K, N] UINT4, scales [nb, N], zero_points [nb, N] UINT4,
        axis=0, block_size) -> MatMul``, the ``quant4`` form the ort backend then runs as com.microsoft
        MatMulNBits. Weights computed in the graph: the same dequantization in standard ONNX ops (BitwiseAnd and
        BitShift unpack the nibbles; scales and zero points repeated per block, as ``legalize`` does)."""
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
        splits = node.attr("splits")
        shape = graph.values[node.outputs[0]].shape
        y = b.op("MatMul", [a, w], dtype=dt, shape=None if splits else shape)
        if splits:
            ys = b.op("Split", [y, b.const(np.array(splits, np.int64), "splits")], outputs=len(splits), axis=-1)
            for out, new in zip(node.outputs, ys):
                graph.values[new].set_type(dt, graph.values[out].shape)
            graph.replace_node(node, list(ys))
        else:
            graph.replace_node(node, [y])
        graph.remove_unused_initializers()

    # ----------------------------------------------------------------- IREE
    def lower_iree(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """llvm-cpu: a ``linalg.generic`` dequantizing B into a float32 [N, K] tensor, then one computing
        ``A W`` over [M, N, K] (M = the product of A's leading dims), truncated to A's type.

        Raises:
            BackendError: a target other than llvm-cpu, or a dynamic K or N.
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
        (``_o2``/``_o3`` with 2 or 3 ``splits``) on (ceil(N / 8), ceil(M / 8)) workgroups of 256 threads: a warp
        per output column and 8 rows of A, the dequantization inside the dot product (the kernel source's
        header); for an A of one row (static shape) the ``_t1`` variant, one row per workgroup. Push constants
        M, K, N, block_size, has_zp, and the first two split widths (i32).

        Raises:
            BackendError: a target other than cuda, a dynamic K or N, or K or the block size not a multiple of 8.
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
        variant = f"{t.el}_v{vec}" + ("_t1" if one_row else "") + (f"_o{outs}" if outs > 1 else "")
        kernel, name = f"matmul_int4_{variant}", f"matmul4_exec_{variant}"
        zp = "%in3" if t.has_zp else "%z"
        ztype = f"tensor<{t.N}x{t.nb}xi8>" if t.has_zp else "tensor<1xi8>"
        rows, dyn, _ = row_count(t.a, t.N)
        results = [row_count(t.a, w)[2] for w in t.widths]
        n0, n1 = (t.widths + [0, 0])[:2]
        # A and Y go to the kernel in their own shapes (a pointer is all it takes): reshapes around the dispatch
        # make iree-compile 3.13 fail in SinkReshapes ("failed to sink reshape ops") on a 6-layer model
        body = rows + f"""
    %tok = arith.constant {tokens} : index
    %gx = arith.constant {-(-t.N // (CUDA_THREADS // 32))} : index
    %gy = arith.ceildivui %m, %tok : index
    %z = arith.constant dense<0> : tensor<1xi8>
    %m32 = arith.index_cast %m : index to i32
    %k32 = arith.constant {t.K} : i32
    %n32 = arith.constant {t.N} : i32
    %bs32 = arith.constant {t.bs} : i32
    %zp32 = arith.constant {1 if t.has_zp else 0} : i32
    %n0 = arith.constant {n0} : i32
    %n1 = arith.constant {n1} : i32
    %y{":" + str(outs) if outs > 1 else ""} = flow.dispatch @{name}::@{kernel}[%gx, %gy](%in0, %in1, %in2, {zp}, %m32, %k32, %n32, %bs32, %zp32, %n0, %n1) :
        ({t.a.builtin}{dyn}, tensor<{t.N}x{t.Kp}xi8>, tensor<{t.N}x{t.nb}x{t.el}>, {ztype}, i32, i32, i32, i32, i32, i32, i32)
        -> ({", ".join(r + dyn for r in results)})
"""
        for i, (r, o) in enumerate(zip(results, t.outs)):
            body += f"    %out{i} = tensor.cast %y{'#' + str(i) if outs > 1 else ''} : {r} to {o.builtin}\n"
        return IreeLowering(body=body, module_items={name: _cuda_executable(name, obj, kernel, outs)})


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
    as the output type (``%out0``)."""

    def __init__(self, op: TorchOperator):
        a, b = op.operand_types[0], op.operand_types[1]
        self.a, self.outs = a, op.result_types
        self.K, self.N, self.bs = int(op.attrs["K"]), int(op.attrs["N"]), int(op.attrs["block_size"])
        self.widths = [int(w) for w in op.attrs.get("splits") or [self.N]]
        if sum(self.widths) != self.N or len(self.widths) != len(self.outs) or len(self.widths) > 3:
            raise BackendError(f"MatMulInt4 {op.where}: splits {self.widths} for N={self.N} and {len(self.outs)} "
                               "output(s); 1 to 3 widths summing to N, one per output, expected")
        if a.dims[-1] not in (None, self.K) or b.dims != [self.N, (self.K + 1) // 2]:
            raise BackendError(f"MatMulInt4 {op.where}: A {a.text} and B {b.text} do not fit K={self.K}, N={self.N}")
        if a.dims[-1] is None:
            raise BackendError(f"MatMulInt4 {op.where}: A's last dim (K) must be static, got {a.text}")
        self.Kp, self.nb = (self.K + 1) // 2, -(-self.K // self.bs)
        self.el = a.builtin_element
        self.has_zp = len(op.operand_types) > 3 and op.operand_types[3].element != "none"

    def collapse(self) -> str:
        return rows_view(self.a, self.K)

    def expand(self, y: str) -> str:
        """``%out<i>`` from the [M, N] result ``y``: one slice of columns per output, expanded to A's leading dims."""
        if len(self.widths) == 1:
            return rows_result(self.a, self.N, y, self.outs[0])
        el, lines, off = self.a.builtin_element, [], 0
        for i, (w, out) in enumerate(zip(self.widths, self.outs)):
            lines.append(f"    %ys{i} = tensor.extract_slice {y}[0, {off}] [%m, {w}] [1, 1] : tensor<?x{self.N}x{el}> to tensor<?x{w}x{el}>")
            lines.append(rows_result(self.a, w, f"%ys{i}", out, f"%out{i}"))
            off += w
        return "\n".join(lines)


def _cuda_executable(name: str, obj: str, kernel: str, outs: int) -> str:
    """The ``hal.executable.source`` declaring the PTX kernel: 4 bindings read, then ``outs`` written; 7 i32 push
    constants; workgroups of CUDA_THREADS threads on the grid the dispatch's workload gives."""
    bindings = kernel_bindings(4, outs)
    return (f"  hal.executable.source private @{name} <objects = <{{\n"
            f"      #hal.executable.target<\"cuda\", \"cuda-nvptx-fb\"> = [#hal.executable.object<{{path = \"{obj}\"}}>]}}>> {{\n"
            f"    hal.executable.export public @{kernel} ordinal(0)\n"
            f"        layout(#hal.pipeline.layout<constants = 7, bindings = [{bindings}]>)\n"
            f"        count(%device: !hal.device, %gx: index, %gy: index) -> (index, index, index) {{\n"
            f"      %c1 = arith.constant 1 : index\n      hal.return %gx, %gy, %c1 : index, index, index\n"
            f"    }} <workgroup_size = [{CUDA_THREADS} : index, 1 : index, 1 : index]>\n  }}")
