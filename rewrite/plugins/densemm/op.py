"""``ai.rewrite::DenseMatMul``: a MatMul by a large constant float weight, its reference and its lowerings.

Contract (inputs; K the reduction size, N the output size, float = f32 or f16, one type for all):

0. ``A`` float [..., K]
1. ``W`` float [N, K]: the weight with rows along K (torch.nn.Linear's layout; the ONNX MatMul's B transposed)
2. ``norm_weight`` float [K] (with the attribute ``norm_epsilon`` only): A is an RMSNorm's input (the
   ``rms-norm-prologue`` rule, :mod:`rewrite.plugins.densemm.prologue`)

Output ``Y`` [..., N] = A @ W^T, summed in float32, in A's dtype; with the attribute ``splits`` (two positive
widths summing to N: the ``merge-normed-products`` rule, :mod:`rewrite.plugins.densemm.merge`) two outputs instead,
``Y_1`` [..., splits[0]] and ``Y_2`` [..., splits[1]], Y's first and last columns. With ``norm_epsilon`` A is first
``RMSNorm(A, norm_weight, norm_epsilon)`` (ai.rewrite::RMSNorm's contract, :mod:`rewrite.plugins.rmsnorm.op`), and
an optional output after the products, ``A_normed`` [..., K], holds it (for the norm's other readers).

Lowerings: ONNX Runtime (CPU and CUDA) gets the MatMul back (B = W^T, an initializer again when W is one; a
``Split`` after it for ``splits``); IREE llvm-cpu a ``linalg.generic`` contraction (IREE's own code); IREE cuda one
dispatch of ``kernels/densemm_cuda.cu``, a warp per output column, so a decode step reads each weight byte once
(iree-compile 3.13 runs Qwen1.5-MoE's LM head MatMul, 151936 x 2048 f16, at 230 GB/s on an H200: BENCHMARKS.md,
"Full-size decode on the H200"); with ``norm_epsilon`` and one row of A the ``dense_matmul_norm`` kernel normalizes
the row in its prologue and writes ``A_normed`` (one launch for the norm and the product), a longer A's norm is a
dispatch of the RMSNorm kernel first; with ``splits`` the ``_o2`` kernels store the columns into the two outputs.
"""

from __future__ import annotations

import numpy as np

from rewrite.core.abstract_ops import AbstractOp
from rewrite.core.iree_lowering import (IreeLowering, PatchContext, TorchOperator, VTensor, kernel_bindings, row_count,
                                        rows_result, rows_view)
from rewrite.core.ir import Graph, Node
from rewrite.core.kernels import build_cuda_ptx, kernel_source
from rewrite.core.lowering import Lowering
from rewrite.core.rules import Builder
from rewrite.errors import BackendError
from rewrite.plugins.rmsnorm.op import (CUDA_MAX_H, RMSNorm, f32_bits, rms_norm_cuda_dispatch, rms_norm_onnx,
                                        rms_norm_rows_linalg)

CUDA_THREADS = 256  #: THREADS in kernels/densemm_cuda.cu: 8 warps, one output column each
CUDA_TOKENS = 8  #: TOKENS in kernels/densemm_cuda.cu: rows of A per workgroup
CUDA_K_MULTIPLE = 8  #: K the kernel takes: a multiple of this (16-byte loads of f16)


def split_widths(splits, n: int, where: str, outputs: int | None = None) -> list[int]:
    """The product outputs' widths: [N] without ``splits``, else its two widths; ``outputs`` (when given), the
    node's output count, must be theirs or one more (A_normed).

    Raises:
        ValueError: naming ``where``: ``splits`` not two positive widths summing to N, or another output count."""
    widths = [n] if splits is None else [int(v) for v in splits]
    if splits is not None and (len(widths) != 2 or min(widths) < 1 or sum(widths) != n):
        raise ValueError(f"{where}: splits {widths}; two positive widths summing to N={n} expected")
    if outputs is not None and not len(widths) <= outputs <= len(widths) + 1:
        raise ValueError(f"{where}: {outputs} output(s) for {len(widths)} product output(s) and an optional A_normed")
    return widths


class DenseMatMul(AbstractOp):
    """The contract in the module docstring."""

    op_type = "DenseMatMul"
    ort_targets = ("cpu", "cuda")

    def lowerings(self) -> list[Lowering]:
        return super().lowerings() + [Lowering(self.op_type, "iree", ("cuda",), self.lower_iree_cuda, origin=type(self).__module__)]

    def reference(self, attrs: dict, a, w, norm_weight=None) -> list[np.ndarray]:
        """numpy float32 evaluation of the contract: [Y] in A's dtype ([Y_1, Y_2] with ``splits``); with
        ``norm_epsilon`` A_normed after them.

        Raises:
            ValueError: ``norm_epsilon`` without a norm weight, or a norm weight without it; ``splits`` outside
                the contract."""
        if (attrs.get("norm_epsilon") is None) != (norm_weight is None):
            raise ValueError(f"DenseMatMul with attributes {attrs}: the norm weight (input 2) goes with norm_epsilon")
        widths = split_widths(attrs.get("splits"), w.shape[0], "DenseMatMul reference")
        an = a if norm_weight is None else RMSNorm().reference({"epsilon": attrs["norm_epsilon"]}, a, np.asarray(norm_weight))[0]
        y = (an.astype(np.float32) @ w.astype(np.float32).T).astype(a.dtype)
        ys = np.split(y, np.cumsum(widths)[:-1], axis=-1) if len(widths) > 1 else [y]
        return ys if norm_weight is None else [*ys, an]

    def sample_inputs(self, rng: np.random.Generator) -> list[tuple[dict, list[np.ndarray]]]:
        """Conformance-kit samples: rows not a multiple of 8, f16, a 3-D A, N not a multiple of the 8 warps; the
        RMSNorm prologue on one row (the CUDA kernel's own: a router's shape, N under a workgroup's 8 columns) and
        on several (a dispatch of the norm first)."""
        def case(m, k, n, dt, lead=(), norm=None):
            ins = [(rng.standard_normal((*lead, m, k)) * (3 if norm else 1)).astype(dt), (rng.standard_normal((n, k)) * 0.1).astype(dt)]
            if norm is None:
                return {}, ins
            return {"norm_epsilon": norm}, ins + [(1 + 0.1 * rng.standard_normal(k)).astype(dt)]
        def split(c, widths):
            return {**c[0], "splits": widths}, c[1]
        return [case(3, 64, 40, np.float32), case(9, 128, 77, np.float16), case(5, 256, 16, np.float16, lead=(2,)),
                case(1, 2048, 60, np.float16, lead=(1,), norm=1e-6), case(1, 64, 5, np.float32, norm=1e-5),
                case(4, 128, 24, np.float16, lead=(1,), norm=1e-6),
                # splits: a router and a one-column gate (Qwen1.5-MoE), on one row and on several
                split(case(1, 2048, 61, np.float16, lead=(1,), norm=1e-6), [60, 1]),
                split(case(3, 64, 13, np.float32, norm=1e-5), [8, 5]), split(case(10, 128, 21, np.float16), [20, 1])]

    def lower_ort(self, graph: Graph, node: Node) -> None:
        """``MatMul(A, W^T)``: W^T an initializer when W is one (the MatMul the rule replaced), else a Transpose;
        a ``Split`` after it for ``splits``; with ``norm_epsilon`` the RMSNorm before it
        (:func:`rewrite.plugins.rmsnorm.op.rms_norm_onnx`), its output also ``A_normed``.

        Raises:
            BackendError: the norm weight, ``norm_epsilon`` and an A_normed output not together, ``splits``
                outside the contract, or outputs other than the products and an optional A_normed."""
        a, w = node.inputs[:2]
        norm = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else ""
        where = f"DenseMatMul node {node.describe()}"
        c = graph.const(w)
        n = c.shape[0] if c is not None else (graph.values[w].shape or [None])[0]
        if not isinstance(n, int):  # W computed, its rows unknown: the widths are their own sum
            n = sum(int(v) for v in node.attr("splits") or [0])
        try:
            widths = split_widths(node.attr("splits"), n, where, len(node.outputs))
        except ValueError as e:
            raise BackendError(str(e)) from None
        if bool(norm) != (node.attr("norm_epsilon") is not None) or (len(node.outputs) > len(widths) and not norm):
            raise BackendError(f"{where}: the norm weight (input 2) and the output after the products (A_normed) go "
                               "with norm_epsilon")
        dt = graph.values[a].dtype
        b = Builder(graph, "lower/DenseMatMul", node.order, node.name)
        if norm:
            a = rms_norm_onnx(b, a, norm, float(node.attr("norm_epsilon")))
        wt = b.const(np.ascontiguousarray(c.T), "weight") if c is not None else b.op("Transpose", [w], perm=[1, 0], dtype=dt)
        shapes = [graph.values[o].shape for o in node.outputs]
        if len(widths) == 1:
            ys = [b.op("MatMul", [a, wt], dtype=dt, shape=shapes[0])]
        else:
            y = b.op("MatMul", [a, wt], dtype=dt)
            ys = list(b.op("Split", [y, b.const(np.array(widths, np.int64), "splits")], outputs=len(widths), axis=-1))
            for new, shape in zip(ys, shapes):
                graph.values[new].set_type(dt, shape)
        graph.replace_node(node, [*ys, a][:len(node.outputs)])
        graph.remove_unused_initializers()

    def lower_iree(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """llvm-cpu: one ``linalg.generic`` over [M, N, K] (M = the product of A's leading dims) summing in f32,
        then one truncating to f16 when A is f16 (with ``splits``, each output a ``tensor.extract_slice`` of its
        columns); with ``norm_epsilon`` the RMSNorm's two before them
        (:func:`rewrite.plugins.rmsnorm.op.rms_norm_rows_linalg`).

        Raises:
            BackendError: a target other than llvm-cpu, a dynamic K or N, or ``splits`` outside the contract.
        """
        if ctx.target != "llvm-cpu":
            raise BackendError(f"DenseMatMul linalg lowering asked for target '{ctx.target}'")
        a, k, n, el = _sizes(op)
        norm = _norm(op, k)
        f16 = el == "f16"
        ext = "%xf = arith.extf %x : f16 to f32\n      %wf = arith.extf %wv : f16 to f32\n      " if f16 else ""
        view = rows_view(a, k)
        if norm is not None:
            view = rows_view(a, k, "%a_in") + "\n" + rms_norm_rows_linalg("%a_in", "%m", k, el, "%in2", norm.builtin,
                                                                          op.attrs["norm_epsilon"], "%a")
        body = view + f"""
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
        y = "%yo" if f16 else "%y"
        widths = _widths(op, n)
        if len(widths) == 1:
            body += rows_result(a, n, y, op.result_types[0])
        else:  # splits: the columns of each output, sliced
            for i, (off, w) in enumerate(zip(np.cumsum([0, *widths[:-1]]), widths)):
                body += (f"    %ys{i} = tensor.extract_slice {y}[0, {off}] [%m, {w}] [1, 1] : tensor<?x{n}x{el}> to "
                         f"tensor<?x{w}x{el}>\n" + rows_result(a, w, f"%ys{i}", op.result_types[i], f"%out{i}") + "\n")
        if len(op.result_types) > len(widths):  # A_normed
            body += "\n" + rows_result(a, k, "%a", op.result_types[len(widths)], f"%out{len(widths)}")
        return IreeLowering(body=body)

    def lower_iree_cuda(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """One dispatch of ``kernels/densemm_cuda.cu`` (PTX for ``ctx.cuda_arch``), ``dense_matmul_<el>`` on
        (ceil(N / 8), ceil(M / 8)) workgroups of 256 threads: a warp per output column and 8 rows of A (the
        kernel source's header). Push constants M, K, N (i32). With ``norm_epsilon``: for one row of A,
        ``dense_matmul_norm_<el>`` (bindings A, W, the norm weight, Y, A_normed; the epsilon's float32 bits a
        fourth push constant); for more rows a dispatch of the RMSNorm kernel first
        (:func:`rewrite.plugins.rmsnorm.op.rms_norm_cuda_dispatch`), whose output is A_normed. With ``splits`` the
        ``_o2`` kernels (``dense_matmul_o2_<el>``, ``dense_matmul_norm_o2_<el>``): the two outputs bound in place of
        Y, the first width a last push constant.

        Raises:
            BackendError: a target other than cuda, a dynamic K or N, K not a multiple of 8, K over 8192 with
                ``norm_epsilon``, ``splits`` outside the contract, or a norm weight outside the contract.
        """
        if ctx.target != "cuda":
            raise BackendError(f"DenseMatMul CUDA lowering asked for target '{ctx.target}'")
        a, k, n, el = _sizes(op)
        if k % CUDA_K_MULTIPLE:
            raise BackendError(f"DenseMatMul on cuda: K={k}; the kernel takes a multiple of {CUDA_K_MULTIPLE}")
        obj = ctx.object_path(build_cuda_ptx(kernel_source(__file__, "densemm_cuda.cu"), ctx.cuda_arch))
        norm = _norm(op, k)
        if norm is not None and k > CUDA_MAX_H:
            raise BackendError(f"DenseMatMul {op.where}: K={k} with norm_epsilon; the CUDA kernels normalize rows of at most {CUDA_MAX_H}")
        widths = _widths(op, n)
        g = len(widths)
        o2, n0 = ("_o2", [f"    %n0 = arith.constant {widths[0]} : i32\n"]) if g == 2 else ("", [])
        rows, dyn, _ = row_count(a, n)
        results = [row_count(a, w)[2] for w in widths]
        outs = "".join(f"    %out{i} = tensor.cast %y#{i} : {r} to {op.result_types[i].builtin}\n" for i, r in enumerate(results))
        single = f"    %out0 = tensor.cast %y : {results[0]} to {op.result_types[0].builtin}\n"
        one_row = None not in a.dims[:-1] and int(np.prod(a.dims[:-1])) == 1
        name, kernel, items = f"densemm{o2}_exec_{el}", f"dense_matmul{o2}_{el}", {}
        a_in, normed_out = "%in0", ""
        if norm is not None and one_row:  # the norm in the kernel's prologue; A_normed its output after the products
            name, kernel = f"densemm_norm{o2}_exec_{el}", f"dense_matmul_norm{o2}_{el}"
            normed = row_count(a, k)[2]
            types = ", ".join(f"{r}{dyn}" for r in [*results, normed])
            body = rows + f"""
    %gx = arith.constant {-(-n // (CUDA_THREADS // 32))} : index
    %gy = arith.constant 1 : index
    %m32 = arith.index_cast %m : index to i32
    %k32 = arith.constant {k} : i32
    %n32 = arith.constant {n} : i32
    %eps32 = arith.constant {f32_bits(op.attrs["norm_epsilon"])} : i32
{"".join(n0)}    %y:{g + 1} = flow.dispatch @{name}::@{kernel}[%gx, %gy](%in0, %in1, %in2, %m32, %k32, %n32, %eps32{", %n0" if n0 else ""}) :
        ({a.builtin}{dyn}, tensor<{n}x{k}x{el}>, {norm.builtin}, i32, i32, i32, i32{", i32" if n0 else ""}) -> ({types})
""" + outs
            if len(op.result_types) > g:
                body += f"    %out{g} = tensor.cast %y#{g} : {normed} to {op.result_types[g].builtin}\n"
            return IreeLowering(body=body, module_items={name: _executable(name, kernel, obj, 3, g + 1, 4 + len(n0))})
        if norm is not None:  # several rows: the RMSNorm kernel's dispatch first, its output A_normed
            norm_body, items = rms_norm_cuda_dispatch(ctx, "%in0", f"{a.builtin}{dyn}", "%in2", norm.builtin, "%m", k, el,
                                                      op.attrs["norm_epsilon"], "%an")
            rows += "\n" + norm_body
            a_in = "%an"
            if len(op.result_types) > g:
                normed_out = f"    %out{g} = tensor.cast %an : {a.builtin} to {op.result_types[g].builtin}\n"
        # A and Y go to the kernel in their own shapes: no reshapes around the dispatch (see matmul4's lowering)
        types = ", ".join(f"{r}{dyn}" for r in results)
        types = f"({types})" if g > 1 else types
        body = rows + f"""
    %c8 = arith.constant {CUDA_TOKENS} : index
    %gx = arith.constant {-(-n // (CUDA_THREADS // 32))} : index
    %gy = arith.ceildivui %m, %c8 : index
    %m32 = arith.index_cast %m : index to i32
    %k32 = arith.constant {k} : i32
    %n32 = arith.constant {n} : i32
{"".join(n0)}    %y{f":{g}" if g > 1 else ""} = flow.dispatch @{name}::@{kernel}[%gx, %gy]({a_in}, %in1, %m32, %k32, %n32{", %n0" if n0 else ""}) :
        ({a.builtin}{dyn}, tensor<{n}x{k}x{el}>, i32, i32, i32{", i32" if n0 else ""}) -> {types}
""" + (outs if g > 1 else single) + normed_out
        items[name] = _executable(name, kernel, obj, 2, g, 3 + len(n0))
        return IreeLowering(body=body, module_items=items)


def _executable(name: str, kernel: str, obj: str, read_only: int, written: int, constants: int) -> str:
    """The ``hal.executable.source`` ``@name`` of one kernel of the PTX at ``obj`` on the (x, y) grid the dispatch's
    workload gives, workgroups of CUDA_THREADS threads."""
    return (f"  hal.executable.source private @{name} <objects = <{{\n"
            f"      #hal.executable.target<\"cuda\", \"cuda-nvptx-fb\"> = [#hal.executable.object<{{path = \"{obj}\"}}>]}}>> {{\n"
            f"    hal.executable.export public @{kernel} ordinal(0)\n"
            f"        layout(#hal.pipeline.layout<constants = {constants}, bindings = [{kernel_bindings(read_only, written)}]>)\n"
            f"        count(%device: !hal.device, %gx: index, %gy: index) -> (index, index, index) {{\n"
            f"      %c1 = arith.constant 1 : index\n      hal.return %gx, %gy, %c1 : index, index, index\n"
            f"    }} <workgroup_size = [{CUDA_THREADS} : index, 1 : index, 1 : index]>\n  }}")


def _widths(op: TorchOperator, n: int) -> list[int]:
    """The product outputs' widths of an imported DenseMatMul (:func:`split_widths`).

    Raises:
        BackendError: ``splits`` outside the contract, or results other than the widths and an optional A_normed."""
    try:
        return split_widths(op.attrs.get("splits"), n, f"DenseMatMul {op.where}", len(op.result_types))
    except ValueError as e:
        raise BackendError(str(e)) from None


def _norm(op: TorchOperator, k: int) -> VTensor | None:
    """The norm weight's type of an imported DenseMatMul with ``norm_epsilon``, else None.

    Raises:
        BackendError: the norm weight, ``norm_epsilon`` and the output after the products not together, or a weight not [K] of
            A's element type."""
    types = op.operand_types
    norm = types[2] if len(types) > 2 and types[2].element != "none" else None
    products = len(op.attrs.get("splits") or [0])
    if (norm is None) != (op.attrs.get("norm_epsilon") is None) or (len(op.result_types) > products and norm is None):
        raise BackendError(f"DenseMatMul {op.where}: the norm weight (input 2) and the output after the products "
                           "(A_normed) go with norm_epsilon")
    if norm is not None and (norm.dims != [k] or norm.element != types[0].element):
        raise BackendError(f"DenseMatMul {op.where}: norm weight {norm.text}; [{k}] of A's element type expected")
    return norm


def _sizes(op: TorchOperator):
    """(A's type, K, N, element type) of an imported DenseMatMul. Raises BackendError for dynamic K or N."""
    a, w = op.operand_types[0], op.operand_types[1]
    if len(w.dims) != 2 or None in w.dims or a.dims[-1] not in (None, w.dims[1]):
        raise BackendError(f"DenseMatMul {op.where}: W {w.text} must be a static [N, K] matching A {a.text}")
    if a.dims[-1] is None:
        raise BackendError(f"DenseMatMul {op.where}: A's last dim (K) must be static, got {a.text}")
    n, k = w.dims
    return a, k, n, a.builtin_element
