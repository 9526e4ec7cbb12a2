"""``ai.rewrite::RMSNorm``: root-mean-square layer normalization over the last axis, its reference and lowerings.

Contract (one float type, f32 or f16, for X and the weight):

0. ``X`` [..., H]
1. ``weight`` [H]

Attribute ``epsilon`` (float). Output ``Y`` of X's shape::

    Y = Cast(X / Sqrt(ReduceMean(X * X, axis=-1) + epsilon))  (in float32, rounded to X's type) * weight
                                                               (rounded to X's type)

transformers' RMSNorm of Llama, Qwen and the MoE families (``hidden_states.to(float32)``, the variance, ``rsqrt``,
``weight * hidden_states.to(input_dtype)``; seed 000 "1. RMSNorm"), as the ``norm`` plugin's rule finds it. The CUDA
kernel sums the squares in another order than ONNX Runtime's ReduceMean: within the conformance kit's tolerance,
not bit for bit.

Lowerings: ONNX Runtime gets the decomposition back; IREE llvm-cpu ``linalg.generic`` ops (the sum of squares per
row, then one elementwise op); IREE cuda one dispatch of ``kernels/rmsnorm_cuda.cu``, a workgroup per row (where
the norm's input comes from an elementwise op, iree-compile 3.13 runs it as a cast and a reduction, two dispatches:
BENCHMARKS.md).
"""

from __future__ import annotations

import struct

import numpy as np
from onnx import TensorProto

from rewrite.core.abstract_ops import AbstractOp
from rewrite.core.iree_lowering import IreeLowering, PatchContext, TorchOperator, cuda_executable_source
from rewrite.core.ir import Graph, Node
from rewrite.core.kernels import build_cuda_ptx, kernel_source
from rewrite.core.lowering import Lowering
from rewrite.core.rules import Builder
from rewrite.errors import BackendError

CUDA_THREADS = 256  #: THREADS in kernels/rmsnorm_cuda.cu
CUDA_MAX_H = 8192  #: THREADS * PER_THREAD in kernels/rmsnorm_cuda.cu: a row's elements a workgroup holds
CUDA_EXECUTABLE = "rmsnorm_exec"
CUDA_KERNELS = ["rms_norm_f16", "rms_norm_f32"]


def check_shapes(x, weight, where: str) -> int:
    """H from the operands' shapes (tuples, None for an unknown dim).

    Raises:
        ValueError: naming ``where``: X of rank 0 or an unknown last dim, or a weight not [H]."""
    if len(x) < 1 or not isinstance(x[-1], int) or list(weight) != [x[-1]]:
        raise ValueError(f"{where}: X {list(x)} and weight {list(weight)}; X [..., H] with a static H and weight [H] expected")
    return x[-1]


def _f32_bits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", float(v)))[0]


class RMSNorm(AbstractOp):
    """The contract in the module docstring."""

    op_type = "RMSNorm"
    ort_targets = ("cpu", "cuda")

    def lowerings(self) -> list[Lowering]:
        return super().lowerings() + [Lowering(self.op_type, "iree", ("cuda",), self.lower_iree_cuda, origin=type(self).__module__)]

    def reference(self, attrs: dict, x, weight) -> list[np.ndarray]:
        """numpy evaluation of the contract, each ONNX op's result rounded to X's dtype; returns [Y].

        Raises:
            ValueError: shapes outside the contract (:func:`check_shapes`)."""
        check_shapes(x.shape, weight.shape, "RMSNorm")
        dt, f32 = x.dtype, np.float32
        xf = x.astype(f32)
        var = (xf * xf).mean(axis=-1, keepdims=True, dtype=f32)
        n = (xf / np.sqrt(var + np.float32(attrs["epsilon"]))).astype(dt)
        return [(n.astype(f32) * weight.astype(f32)).astype(dt)]

    def sample_inputs(self, rng: np.random.Generator) -> list[tuple[dict, list[np.ndarray]]]:
        """Conformance-kit samples: one row of Qwen's hidden size 2048 (decode), several rows of sizes that are
        not multiples of the workgroup, a rank-2 X, f32 and f16 (an f16 H that is not a multiple of 8: the CUDA
        kernel's element-wise path)."""
        def case(shape, dt, eps=1e-6):
            return {"epsilon": eps}, [(rng.standard_normal(shape) * 4).astype(dt), (1 + 0.1 * rng.standard_normal(shape[-1])).astype(dt)]
        return [case((1, 1, 2048), np.float16), case((1, 7, 2048), np.float16), case((2, 3, 100), np.float32, 1e-5),
                case((5, 4096), np.float32), case((1, 3, 8192), np.float16), case((2, 100), np.float16)]

    # ------------------------------------------------------------------ ORT
    def lower_ort(self, graph: Graph, node: Node) -> None:
        """The decomposition: ``[Cast(float32)] -> Mul(x, x) -> ReduceMean(-1) -> Add(eps) -> Sqrt -> Div -> [Cast
        back] -> Mul(weight)``."""
        x, weight = node.inputs[:2]
        xv = graph.values[x]
        try:
            check_shapes(xv.shape, graph.values[weight].shape, f"RMSNorm node {node.describe()}")
        except ValueError as e:
            raise BackendError(str(e)) from None
        dt, f32 = xv.dtype, TensorProto.FLOAT
        b = Builder(graph, "lower/RMSNorm", node.order, node.name)
        xf = b.op("Cast", [x], to=f32, dtype=f32) if dt != f32 else x
        sq = b.op("Mul", [xf, xf], dtype=f32)
        if (graph.opset() or 18) >= 18:
            var = b.op("ReduceMean", [sq, b.const(np.array([-1], np.int64), "axes")], keepdims=1, dtype=f32)
        else:  # before opset 18 ReduceMean takes its axes as an attribute
            var = b.op("ReduceMean", [sq], axes=[-1], keepdims=1, dtype=f32)
        eps = b.const(np.array(node.attr("epsilon"), np.float32), "eps")
        normed = b.op("Div", [xf, b.op("Sqrt", [b.op("Add", [var, eps], dtype=f32)], dtype=f32)], dtype=f32)
        normed = b.op("Cast", [normed], to=dt, dtype=dt) if dt != f32 else normed
        y = b.op("Mul", [normed, weight], dtype=dt, shape=xv.shape)
        graph.replace_node(node, [y])
        graph.remove_unused_initializers()

    # ----------------------------------------------------------------- IREE
    def lower_iree(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """llvm-cpu: X viewed as rows [M, H]; a ``linalg.generic`` summing each row's squares in f32, then one
        elementwise ``linalg.generic``.

        Raises:
            BackendError: a target other than llvm-cpu, or operands outside the contract."""
        if ctx.target != "llvm-cpu":
            raise BackendError(f"RMSNorm linalg lowering asked for target '{ctx.target}'")
        t = _Operands(op)
        el, f16, h = t.el, t.el == "f16", t.h
        rows = f"tensor<?x{h}x{el}>"
        ext = (lambda v: f"%{v}f = arith.extf %{v} : f16 to f32") if f16 else (lambda v: f"%{v}f = arith.addf %{v}, %zero : f32")  # noqa: E731
        eps = "0x%08X" % (_f32_bits(op.attrs["epsilon"]) & 0xFFFFFFFF)
        body = t.rows_view() + f"""    %zero = arith.constant 0.0 : f32
    %ss0 = tensor.empty(%m) : tensor<?xf32>
    %ss1 = linalg.fill ins(%zero : f32) outs(%ss0 : tensor<?xf32>) -> tensor<?xf32>
    %ss = linalg.generic {{indexing_maps = [affine_map<(r, h) -> (r, h)>, affine_map<(r, h) -> (r)>],
                          iterator_types = ["parallel", "reduction"]}}
        ins(%xr : {rows}) outs(%ss1 : tensor<?xf32>) {{
    ^bb0(%v: {el}, %acc: f32):
      {ext("v")}
      %sq = arith.mulf %vf, %vf : f32
      %r = arith.addf %acc, %sq : f32
      linalg.yield %r : f32
    }} -> tensor<?xf32>
    %eps = arith.constant {eps} : f32
    %hn = arith.constant {float(h)!r} : f32
    %w = tensor.cast %in1 : {t.w.builtin} to tensor<{h}x{el}>
    %y0 = tensor.empty(%m) : {rows}
    %y = linalg.generic {{indexing_maps = [affine_map<(r, h) -> (r, h)>, affine_map<(r, h) -> (r)>, affine_map<(r, h) -> (h)>,
                                           affine_map<(r, h) -> (r, h)>],
                          iterator_types = ["parallel", "parallel"]}}
        ins(%xr, %ss, %w : {rows}, tensor<?xf32>, tensor<{h}x{el}>) outs(%y0 : {rows}) {{
    ^bb0(%v: {el}, %sum: f32, %wv: {el}, %o: {el}):
      {ext("v")}
      {ext("wv")}
      %mean = arith.divf %sum, %hn : f32
      %a = arith.addf %mean, %eps : f32
      %s = math.sqrt %a : f32
      %q = arith.divf %vf, %s : f32
      {"%qh = arith.truncf %q : f32 to f16" + chr(10) + "      %qr = arith.extf %qh : f16 to f32" if f16 else "%qr = arith.addf %q, %zero : f32"}
      %p = arith.mulf %qr, %wvf : f32
      {"%out = arith.truncf %p : f32 to f16" if f16 else "%out = arith.addf %p, %zero : f32"}
      linalg.yield %out : {el}
    }} -> {rows}
""" + t.rows_result("%y")
        return IreeLowering(body=body)

    def lower_iree_cuda(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """One dispatch of ``kernels/rmsnorm_cuda.cu`` (PTX for ``ctx.cuda_arch``), ``rms_norm_<el>``: a workgroup of
        256 threads per row of X viewed as [M, H]. Bindings X, weight, Y; push constants M, H and the epsilon's
        float32 bits.

        Raises:
            BackendError: a target other than cuda, H over :data:`CUDA_MAX_H`, or operands outside the contract."""
        if ctx.target != "cuda":
            raise BackendError(f"RMSNorm CUDA lowering asked for target '{ctx.target}'")
        t = _Operands(op)
        if t.h > CUDA_MAX_H:
            raise BackendError(f"RMSNorm {op.where}: H={t.h}; the CUDA kernel holds rows of at most {CUDA_MAX_H}")
        obj = ctx.object_path(build_cuda_ptx(kernel_source(__file__, "rmsnorm_cuda.cu"), ctx.cuda_arch))
        rows = f"tensor<?x{t.h}x{t.el}>"
        body = t.rows_view() + f"""    %m32 = arith.index_cast %m : index to i32
    %h32 = arith.constant {t.h} : i32
    %eps32 = arith.constant {_f32_bits(op.attrs["epsilon"])} : i32
    %y = flow.dispatch @{CUDA_EXECUTABLE}::@rms_norm_{t.el}[%m](%xr, %in1, %m32, %h32, %eps32) :
        ({rows}{{%m}}, {t.w.builtin}, i32, i32, i32) -> {rows}{{%m}}
""" + t.rows_result("%y")
        return IreeLowering(body=body, module_items={CUDA_EXECUTABLE: cuda_executable_source(CUDA_EXECUTABLE, obj, CUDA_KERNELS, 2, 1, 3, CUDA_THREADS, grid=1)})


class _Operands:
    """An imported RMSNorm's operand types, H, and X viewed as rows.

    Raises:
        BackendError: operands outside the contract."""

    def __init__(self, op: TorchOperator):
        self.op = op
        self.x, self.w = op.operand_types[:2]
        try:
            self.h = check_shapes(self.x.dims, self.w.dims, f"RMSNorm {op.where}")
        except ValueError as e:
            raise BackendError(str(e)) from None
        if self.w.element != self.x.element or self.x.builtin_element not in ("f16", "f32"):
            raise BackendError(f"RMSNorm {op.where}: X {self.x.text}, weight {self.w.text}: one of f32 or f16 expected")
        self.el = self.x.builtin_element

    def rows_view(self) -> str:
        """MLIR defining ``%xr`` (X as ``tensor<?xHxel>``) and ``%m`` (its rows, index)."""
        x, h, el = self.x, self.h, self.el
        lines = ["    %c0 = arith.constant 0 : index"]
        if len(x.dims) == 1:
            lines.append(f"    %xe = tensor.expand_shape %in0 [[0, 1]] output_shape [1, {h}] : {x.builtin} into tensor<1x{h}x{el}>")
            lines.append(f"    %xr = tensor.cast %xe : tensor<1x{h}x{el}> to tensor<?x{h}x{el}>")
        else:
            lead = list(range(len(x.dims) - 1))
            lines.append(f"    %xc = tensor.collapse_shape %in0 [[{', '.join(map(str, lead))}], [{len(x.dims) - 1}]] : {x.builtin} into "
                         f"tensor<{'?' if None in x.dims[:-1] else int(np.prod(x.dims[:-1]))}x{h}x{el}>")
            lines.append(f"    %xr = tensor.cast %xc : tensor<{'?' if None in x.dims[:-1] else int(np.prod(x.dims[:-1]))}x{h}x{el}> "
                         f"to tensor<?x{h}x{el}>")
        lines.append(f"    %m = tensor.dim %xr, %c0 : tensor<?x{h}x{el}>")
        return "\n".join(lines) + "\n"

    def rows_result(self, y: str) -> str:
        """MLIR defining ``%out0`` (the result type) from ``y`` (``tensor<?xHxel>``)."""
        x, h, el = self.x, self.h, self.el
        if len(x.dims) == 1:
            return (f"    %yc = tensor.cast {y} : tensor<?x{h}x{el}> to tensor<1x{h}x{el}>\n"
                    f"    %yo = tensor.collapse_shape %yc [[0, 1]] : tensor<1x{h}x{el}> into {x.builtin}\n"
                    f"    %out0 = tensor.cast %yo : {x.builtin} to {self.op.result_types[0].builtin}\n")
        lead = list(range(len(x.dims) - 1))
        sizes = [str(x.dims[k]) if x.dims[k] is not None else f"%d{k}" for k in lead]  # literals where static
        lines = []
        for k in lead:
            if x.dims[k] is None:
                lines += [f"    %c{k}_i = arith.constant {k} : index", f"    %d{k} = tensor.dim %in0, %c{k}_i : {x.builtin}"]
        src = f"tensor<?x{h}x{el}>"
        if None not in x.dims[:-1]:  # a static row count: the collapsed type must say it
            src = f"tensor<{int(np.prod(x.dims[:-1]))}x{h}x{el}>"
            lines.append(f"    %ys = tensor.cast {y} : tensor<?x{h}x{el}> to {src}")
            y = "%ys"
        lines.append(f"    %yo = tensor.expand_shape {y} [[{', '.join(map(str, lead))}], [{len(x.dims) - 1}]] output_shape "
                     f"[{', '.join(sizes)}, {h}] : {src} into {x.builtin}")
        lines.append(f"    %out0 = tensor.cast %yo : {x.builtin} to {self.op.result_types[0].builtin}")
        return "\n".join(lines) + "\n"
