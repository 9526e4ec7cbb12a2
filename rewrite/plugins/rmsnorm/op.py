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
CUDA_MAX_H = 8192  #: THREADS * PER_THREAD in kernels/rmsnorm_cuda.cu (a row's elements a workgroup holds); RMS_NORM_MAX_K
#: in kernels/cuda_rows.h (the row matmul4's and densemm's prologues normalize into shared memory)
CUDA_EXECUTABLE = "rmsnorm_exec"
CUDA_KERNELS = ["rms_norm_f16", "rms_norm_f32"]


def check_shapes(x, weight, where: str) -> int:
    """H from the operands' shapes (tuples, None for an unknown dim).

    Raises:
        ValueError: naming ``where``: X of rank 0 or an unknown last dim, or a weight not [H]."""
    if len(x) < 1 or not isinstance(x[-1], int) or list(weight) != [x[-1]]:
        raise ValueError(f"{where}: X {list(x)} and weight {list(weight)}; X [..., H] with a static H and weight [H] expected")
    return x[-1]


def f32_bits(v: float) -> int:
    """The bits of ``v`` as a float32, as a signed 32-bit integer (how a push constant carries an epsilon)."""
    return struct.unpack("<i", struct.pack("<f", float(v)))[0]


def rms_norm_onnx(b: Builder, x: str, weight: str, epsilon: float) -> str:
    """The contract in standard ONNX ops, built with ``b`` after X (f32 or f16 [..., H]) and weight ([H], X's type):
    ``[Cast(float32)] -> Mul(x, x) -> ReduceMean(-1) -> Add(eps) -> Sqrt -> Div -> [Cast back] -> Mul(weight)``
    (ReduceMean's axes an attribute before opset 18). Returns Y's value name (X's dtype and shape)."""
    graph = b.graph
    xv = graph.values[x]
    dt, f32 = xv.dtype, TensorProto.FLOAT
    xf = b.op("Cast", [x], to=f32, dtype=f32) if dt != f32 else x
    sq = b.op("Mul", [xf, xf], dtype=f32)
    if (graph.opset() or 18) >= 18:
        var = b.op("ReduceMean", [sq, b.const(np.array([-1], np.int64), "axes")], keepdims=1, dtype=f32)
    else:  # before opset 18 ReduceMean takes its axes as an attribute
        var = b.op("ReduceMean", [sq], axes=[-1], keepdims=1, dtype=f32)
    eps = b.const(np.array(epsilon, np.float32), "eps")
    normed = b.op("Div", [xf, b.op("Sqrt", [b.op("Add", [var, eps], dtype=f32)], dtype=f32)], dtype=f32)
    normed = b.op("Cast", [normed], to=dt, dtype=dt) if dt != f32 else normed
    return b.op("Mul", [normed, weight], dtype=dt, shape=xv.shape)


def rms_norm_rows_linalg(x: str, m: str, h: int, el: str, weight: str, weight_type: str, epsilon: float, y: str) -> str:
    """MLIR statements defining ``y`` (``tensor<?xHxel>``) = the contract over the rows of ``x``
    (``tensor<?xHxel>`` with ``m`` rows, an index value), ``weight`` an operand of type ``weight_type`` ([H],
    ``el``): a ``linalg.generic`` summing each row's squares in f32, then one elementwise ``linalg.generic``. Other
    SSA names are prefixed by ``y``, so the statements can sit in any body."""
    f16, p = el == "f16", y
    rows = f"tensor<?x{h}x{el}>"
    ext = (lambda v: f"{p}_{v}f = arith.extf %{v} : f16 to f32") if f16 else (lambda v: f"{p}_{v}f = arith.addf %{v}, {p}_zero : f32")  # noqa: E731
    eps = "0x%08X" % (f32_bits(epsilon) & 0xFFFFFFFF)
    rounded = (f"{p}_qh = arith.truncf {p}_q : f32 to f16\n      {p}_qr = arith.extf {p}_qh : f16 to f32" if f16
               else f"{p}_qr = arith.addf {p}_q, {p}_zero : f32")
    out = f"{p}_out = arith.truncf {p}_p : f32 to f16" if f16 else f"{p}_out = arith.addf {p}_p, {p}_zero : f32"
    return f"""    {p}_zero = arith.constant 0.0 : f32
    {p}_ss0 = tensor.empty({m}) : tensor<?xf32>
    {p}_ss1 = linalg.fill ins({p}_zero : f32) outs({p}_ss0 : tensor<?xf32>) -> tensor<?xf32>
    {p}_ss = linalg.generic {{indexing_maps = [affine_map<(r, h) -> (r, h)>, affine_map<(r, h) -> (r)>],
                          iterator_types = ["parallel", "reduction"]}}
        ins({x} : {rows}) outs({p}_ss1 : tensor<?xf32>) {{
    ^bb0(%v: {el}, %acc: f32):
      {ext("v")}
      {p}_sq = arith.mulf {p}_vf, {p}_vf : f32
      {p}_r = arith.addf %acc, {p}_sq : f32
      linalg.yield {p}_r : f32
    }} -> tensor<?xf32>
    {p}_eps = arith.constant {eps} : f32
    {p}_hn = arith.constant {float(h)!r} : f32
    {p}_w = tensor.cast {weight} : {weight_type} to tensor<{h}x{el}>
    {p}_y0 = tensor.empty({m}) : {rows}
    {y} = linalg.generic {{indexing_maps = [affine_map<(r, h) -> (r, h)>, affine_map<(r, h) -> (r)>, affine_map<(r, h) -> (h)>,
                                           affine_map<(r, h) -> (r, h)>],
                          iterator_types = ["parallel", "parallel"]}}
        ins({x}, {p}_ss, {p}_w : {rows}, tensor<?xf32>, tensor<{h}x{el}>) outs({p}_y0 : {rows}) {{
    ^bb0(%v: {el}, %sum: f32, %wv: {el}, %o: {el}):
      {ext("v")}
      {ext("wv")}
      {p}_mean = arith.divf %sum, {p}_hn : f32
      {p}_a = arith.addf {p}_mean, {p}_eps : f32
      {p}_s = math.sqrt {p}_a : f32
      {p}_q = arith.divf {p}_vf, {p}_s : f32
      {rounded}
      {p}_p = arith.mulf {p}_qr, {p}_wvf : f32
      {out}
      linalg.yield {p}_out : {el}
    }} -> {rows}
"""


def rms_norm_cuda_dispatch(ctx: PatchContext, x: str, x_type: str, weight: str, weight_type: str, m: str, h: int,
                           el: str, epsilon: float, y: str) -> tuple[str, dict[str, str]]:
    """(MLIR statements defining ``y``, of ``x_type``, the module items they need): one dispatch of
    ``kernels/rmsnorm_cuda.cu`` (PTX for ``ctx.cuda_arch``), ``rms_norm_<el>`` on ``m`` (an index value) workgroups
    of 256 threads, a row of H = ``h`` each. ``x``: any shape of ``m`` rows of ``h`` (``x_type`` with its dynamic
    dims, ``tensor<...>{...}``); bindings X, weight, Y; push constants M, H and the epsilon's float32 bits. Other SSA
    names are prefixed by ``y``."""
    obj = ctx.object_path(build_cuda_ptx(kernel_source(__file__, "rmsnorm_cuda.cu"), ctx.cuda_arch))
    body = f"""    {y}_m32 = arith.index_cast {m} : index to i32
    {y}_h32 = arith.constant {h} : i32
    {y}_eps32 = arith.constant {f32_bits(epsilon)} : i32
    {y} = flow.dispatch @{CUDA_EXECUTABLE}::@rms_norm_{el}[{m}]({x}, {weight}, {y}_m32, {y}_h32, {y}_eps32) :
        ({x_type}, {weight_type}, i32, i32, i32) -> {x_type}
"""
    return body, {CUDA_EXECUTABLE: cuda_executable_source(CUDA_EXECUTABLE, obj, CUDA_KERNELS, 2, 1, 3, CUDA_THREADS, grid=1)}


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
        """The decomposition (:func:`rms_norm_onnx`)."""
        x, weight = node.inputs[:2]
        xv = graph.values[x]
        try:
            check_shapes(xv.shape, graph.values[weight].shape, f"RMSNorm node {node.describe()}")
        except ValueError as e:
            raise BackendError(str(e)) from None
        b = Builder(graph, "lower/RMSNorm", node.order, node.name)
        graph.replace_node(node, [rms_norm_onnx(b, x, weight, float(node.attr("epsilon")))])
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
        body = t.rows_view() + rms_norm_rows_linalg("%xr", "%m", t.h, t.el, "%in1", t.w.builtin, op.attrs["epsilon"], "%y")
        return IreeLowering(body=body + t.rows_result("%y"))

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
        rows = f"tensor<?x{t.h}x{t.el}>"
        body, items = rms_norm_cuda_dispatch(ctx, "%xr", f"{rows}{{%m}}", "%in1", t.w.builtin, "%m", t.h, t.el,
                                             op.attrs["epsilon"], "%y")
        return IreeLowering(body=t.rows_view() + body + t.rows_result("%y"), module_items=items)


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
