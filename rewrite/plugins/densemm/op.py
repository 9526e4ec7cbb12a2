"""``ai.rewrite::DenseMatMul``: a MatMul by a large constant float weight, its reference and its lowerings.

Contract (inputs; K the reduction size, N the output size, float = f32 or f16, one type for all):

0. ``A`` float [..., K]
1. ``W`` float [N, K]: the weight with rows along K (torch.nn.Linear's layout; the ONNX MatMul's B transposed)

Output ``Y`` [..., N] = A @ W^T, summed in float32, in A's dtype.

Lowerings: ONNX Runtime (CPU and CUDA) gets the MatMul back (B = W^T, an initializer again when W is one); IREE
llvm-cpu a ``linalg.generic`` contraction (IREE's own code); IREE cuda one dispatch of ``kernels/densemm_cuda.cu``,
a warp per output column, so a decode step reads each weight byte once (iree-compile 3.13 runs Qwen1.5-MoE's LM
head MatMul, 151936 x 2048 f16, at 230 GB/s on an H200: BENCHMARKS.md, "Full-size decode on the H200").
"""

from __future__ import annotations

import numpy as np

from rewrite.core.abstract_ops import AbstractOp
from rewrite.core.iree_lowering import IreeLowering, PatchContext, TorchOperator, kernel_bindings, row_count, rows_result, rows_view
from rewrite.core.ir import Graph, Node
from rewrite.core.kernels import build_cuda_ptx, kernel_source
from rewrite.core.lowering import Lowering
from rewrite.core.rules import Builder
from rewrite.errors import BackendError

CUDA_THREADS = 256  #: THREADS in kernels/densemm_cuda.cu: 8 warps, one output column each
CUDA_TOKENS = 8  #: TOKENS in kernels/densemm_cuda.cu: rows of A per workgroup
CUDA_K_MULTIPLE = 8  #: K the kernel takes: a multiple of this (16-byte loads of f16)


class DenseMatMul(AbstractOp):
    """The contract in the module docstring."""

    op_type = "DenseMatMul"
    ort_targets = ("cpu", "cuda")

    def lowerings(self) -> list[Lowering]:
        return super().lowerings() + [Lowering(self.op_type, "iree", ("cuda",), self.lower_iree_cuda, origin=type(self).__module__)]

    def reference(self, attrs: dict, a, w) -> list[np.ndarray]:
        """numpy float32 evaluation of the contract; returns [Y] in A's dtype."""
        return [(a.astype(np.float32) @ w.astype(np.float32).T).astype(a.dtype)]

    def sample_inputs(self, rng: np.random.Generator) -> list[tuple[dict, list[np.ndarray]]]:
        """Conformance-kit samples: rows not a multiple of 8, f16, a 3-D A, N not a multiple of the 8 warps."""
        def case(m, k, n, dt, lead=()):
            return {}, [rng.standard_normal((*lead, m, k)).astype(dt), (rng.standard_normal((n, k)) * 0.1).astype(dt)]
        return [case(3, 64, 40, np.float32), case(9, 128, 77, np.float16), case(5, 256, 16, np.float16, lead=(2,))]

    def lower_ort(self, graph: Graph, node: Node) -> None:
        """``MatMul(A, W^T)``: W^T an initializer when W is one (the MatMul the rule replaced), else a Transpose."""
        a, w = node.inputs[:2]
        dt = graph.values[a].dtype
        b = Builder(graph, "lower/DenseMatMul", node.order, node.name)
        c = graph.const(w)
        wt = b.const(np.ascontiguousarray(c.T), "weight") if c is not None else b.op("Transpose", [w], perm=[1, 0], dtype=dt)
        y = b.op("MatMul", [a, wt], dtype=dt, shape=graph.values[node.outputs[0]].shape)
        graph.replace_node(node, [y])
        graph.remove_unused_initializers()

    def lower_iree(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """llvm-cpu: one ``linalg.generic`` over [M, N, K] (M = the product of A's leading dims) summing in f32,
        then one truncating to f16 when A is f16.

        Raises:
            BackendError: a target other than llvm-cpu, or a dynamic K or N.
        """
        if ctx.target != "llvm-cpu":
            raise BackendError(f"DenseMatMul linalg lowering asked for target '{ctx.target}'")
        a, k, n, el = _sizes(op)
        f16 = el == "f16"
        ext = "%xf = arith.extf %x : f16 to f32\n      %wf = arith.extf %wv : f16 to f32\n      " if f16 else ""
        body = rows_view(a, k) + f"""
    %zero = arith.constant 0.0 : f32
    %y0 = tensor.empty(%m) : tensor<?x{n}xf32>
    %y1 = linalg.fill ins(%zero : f32) outs(%y0 : tensor<?x{n}xf32>) -> tensor<?x{n}xf32>
    %y = linalg.generic {{indexing_maps = [affine_map<(i, j, l) -> (i, l)>, affine_map<(i, j, l) -> (j, l)>, affine_map<(i, j, l) -> (i, j)>],
                         iterator_types = ["parallel", "parallel", "reduction"]}}
        ins(%a, %in1 : tensor<?x{k}x{el}>, tensor<{n}x{k}x{el}>) outs(%y1 : tensor<?x{n}xf32>) {{
    ^bb0(%x: {el}, %wv: {el}, %acc: f32):
      {ext}%p = arith.mulf {"%xf, %wf" if f16 else "%x, %wv"} : f32
      %r = arith.addf %acc, %p : f32
      linalg.yield %r : f32
    }} -> tensor<?x{n}xf32>
"""
        if f16:
            body += f"""    %yo0 = tensor.empty(%m) : tensor<?x{n}xf16>
    %yo = linalg.generic {{indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>], iterator_types = ["parallel", "parallel"]}}
        ins(%y : tensor<?x{n}xf32>) outs(%yo0 : tensor<?x{n}xf16>) {{
    ^bb0(%v: f32, %o: f16):
      %vt = arith.truncf %v : f32 to f16
      linalg.yield %vt : f16
    }} -> tensor<?x{n}xf16>
"""
        return IreeLowering(body=body + rows_result(a, n, "%yo" if f16 else "%y", op.result_types[0]))

    def lower_iree_cuda(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """One dispatch of ``kernels/densemm_cuda.cu`` (PTX for ``ctx.cuda_arch``), ``dense_matmul_<el>`` on
        (ceil(N / 8), ceil(M / 8)) workgroups of 256 threads: a warp per output column and 8 rows of A (the
        kernel source's header). Push constants M, K, N (i32).

        Raises:
            BackendError: a target other than cuda, a dynamic K or N, or K not a multiple of 8.
        """
        if ctx.target != "cuda":
            raise BackendError(f"DenseMatMul CUDA lowering asked for target '{ctx.target}'")
        a, k, n, el = _sizes(op)
        if k % CUDA_K_MULTIPLE:
            raise BackendError(f"DenseMatMul on cuda: K={k}; the kernel takes a multiple of {CUDA_K_MULTIPLE}")
        obj = ctx.object_path(build_cuda_ptx(kernel_source(__file__, "densemm_cuda.cu"), ctx.cuda_arch))
        name, kernel = f"densemm_exec_{el}", f"dense_matmul_{el}"
        rows, dyn, result = row_count(a, n)
        # A and Y go to the kernel in their own shapes: no reshapes around the dispatch (see matmul4's lowering)
        body = rows + f"""
    %c8 = arith.constant {CUDA_TOKENS} : index
    %gx = arith.constant {-(-n // (CUDA_THREADS // 32))} : index
    %gy = arith.ceildivui %m, %c8 : index
    %m32 = arith.index_cast %m : index to i32
    %k32 = arith.constant {k} : i32
    %n32 = arith.constant {n} : i32
    %y = flow.dispatch @{name}::@{kernel}[%gx, %gy](%in0, %in1, %m32, %k32, %n32) :
        ({a.builtin}{dyn}, tensor<{n}x{k}x{el}>, i32, i32, i32) -> {result}{dyn}
    %out0 = tensor.cast %y : {result} to {op.result_types[0].builtin}
"""
        bindings = kernel_bindings(2, 1)
        exe = (f"  hal.executable.source private @{name} <objects = <{{\n"
               f"      #hal.executable.target<\"cuda\", \"cuda-nvptx-fb\"> = [#hal.executable.object<{{path = \"{obj}\"}}>]}}>> {{\n"
               f"    hal.executable.export public @{kernel} ordinal(0)\n"
               f"        layout(#hal.pipeline.layout<constants = 3, bindings = [{bindings}]>)\n"
               f"        count(%device: !hal.device, %gx: index, %gy: index) -> (index, index, index) {{\n"
               f"      %c1 = arith.constant 1 : index\n      hal.return %gx, %gy, %c1 : index, index, index\n"
               f"    }} <workgroup_size = [{CUDA_THREADS} : index, 1 : index, 1 : index]>\n  }}")
        return IreeLowering(body=body, module_items={name: exe})


def _sizes(op: TorchOperator):
    """(A's type, K, N, element type) of an imported DenseMatMul. Raises BackendError for dynamic K or N."""
    a, w = op.operand_types[0], op.operand_types[1]
    if len(w.dims) != 2 or None in w.dims or a.dims[-1] not in (None, w.dims[1]):
        raise BackendError(f"DenseMatMul {op.where}: W {w.text} must be a static [N, K] matching A {a.text}")
    if a.dims[-1] is None:
        raise BackendError(f"DenseMatMul {op.where}: A's last dim (K) must be static, got {a.text}")
    n, k = w.dims
    return a, k, n, a.builtin_element
