"""ArgMax over the last axis as one dispatch of the backend's own CUDA kernel (``kernels/argmax_cuda.cu``).

The next token of ``rewrite apply --next-token`` is an ArgMax over a vocabulary's logits. IREE 3.13's CUDA codegen
reduces it in one workgroup (``arg_compare``: 73 us a token for 151,936 values on an H100) or does not compile it
at all (a static multiple of 256 values: :data:`rewrite.backends.iree._CUDA_ARGMAX_BAD_MULTIPLE`); written in two
stages in the graph it became slower still (BENCHMARKS.md). For ``--target cuda`` the backend replaces such an
ArgMax by the op ``ai.rewrite::RowArgMax`` before import (:func:`use_row_argmax`) and lowers it to a workgroup of
:data:`ARGMAX_THREADS` threads per row (:func:`lower_row_argmax`).

RowArgMax's contract: input X [..., N] float16 or float32 with a static shape, attribute ``keepdims`` (0 or 1);
output int64, X's shape with the last axis removed (keepdims 0) or 1 (keepdims 1): the lowest index of each row's
maximum, ONNX ArgMax with ``axis=-1`` and ``select_last_index=0`` (ONNX operator spec, ArgMax); -0 and +0 tie; NaN
ranks below every number, so a row's maximum is that of its numbers and a row of NaNs gives 0. (The spec leaves
NaN open: ONNX Runtime's CPU ArgMax also skips a NaN after the first element, but returns 0 for a row whose first
element is NaN; numpy returns the first NaN's index.) ArgMaxes this does not take (a symbolic dim, another axis or
type, ``select_last_index=1``) stay IREE's.
"""

from __future__ import annotations

import math

import onnx

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.iree_lowering import IreeLowering, PatchContext, TorchOperator, cuda_executable_source
from rewrite.core.ir import Graph
from rewrite.core.kernels import build_cuda_ptx, kernel_source
from rewrite.errors import BackendError

OP_TYPE = "RowArgMax"
ARGMAX_THREADS = 1024  #: THREADS in kernels/argmax_cuda.cu
EXECUTABLE = "rewrite_row_argmax"
_KERNELS = ["row_argmax_f16", "row_argmax_f32"]
_ELEMENTS = {onnx.TensorProto.FLOAT16: "f16", onnx.TensorProto.FLOAT: "f32"}
#: the shortest row taken (a vocabulary's); shorter ArgMaxes stay IREE's, which compiles every size below 512
MIN_ROW = 256


def use_row_argmax(graph: Graph) -> int:
    """Replace each ArgMax that RowArgMax computes (the reduced axis the last, ``select_last_index=0``, X float16
    or float32 with a static shape, rows of at least :data:`MIN_ROW` values) by ``ai.rewrite::RowArgMax`` with the
    same input, output and ``keepdims``. Returns the count replaced; others are left to IREE."""
    replaced = 0
    for n in graph.nodes_by_op("ArgMax"):
        src = graph.values[n.inputs[0]]
        shape = src.shape
        if n.attr("select_last_index", 0) or shape is None or not shape or src.dtype not in _ELEMENTS:
            continue
        if n.attr("axis", 0) % len(shape) != len(shape) - 1:
            continue
        if not all(isinstance(d, int) for d in shape) or shape[-1] < MIN_ROW:
            continue
        keep = int(n.attr("keepdims", 1))
        name = graph.fresh_name(f"{n.name or 'argmax'}_row")
        node = graph.add_node(OP_TYPE, [src.name], [name], name=name, order=n.order, domain=DOMAIN,
                              attrs=[onnx.helper.make_attribute("keepdims", keep)])
        out_shape = tuple(shape[:-1]) + ((1,) if keep else ())
        graph.values[node.outputs[0]].set_type(onnx.TensorProto.INT64, out_shape)
        graph.replace_node(n, [node.outputs[0]])  # a graph output keeps its name (the next token's)
        replaced += 1
    if replaced:
        graph.ensure_opset(DOMAIN)  # the importer rejects a node of an undeclared domain
    return replaced


def lower_row_argmax(op: TorchOperator, ctx: PatchContext) -> IreeLowering:
    """One dispatch of ``kernels/argmax_cuda.cu`` (PTX for ``ctx.cuda_arch``), ``row_argmax_<el>``: X viewed as
    [rows, N], one workgroup of :data:`ARGMAX_THREADS` threads per row; bindings X and Y [rows] int64, push
    constants rows and N.

    Raises:
        BackendError: a target other than cuda, or X not a static float16 or float32 tensor."""
    if ctx.target != "cuda":
        raise BackendError(f"RowArgMax {op.where}: lowered for cuda only, asked for '{ctx.target}'")
    x, y = op.operand_types[0], op.result_types[0]
    el = x.builtin_element
    if el not in ("f16", "f32") or not x.dims or not all(isinstance(d, int) for d in x.dims):
        raise BackendError(f"RowArgMax {op.where}: X {x.text}; a static float16 or float32 tensor expected")
    n, rows = x.dims[-1], math.prod(x.dims[:-1])
    obj = ctx.object_path(build_cuda_ptx(kernel_source(__file__, "argmax_cuda.cu"), ctx.cuda_arch))
    body = f"    %x2 = flow.tensor.reshape %in0 : {x.builtin} -> tensor<{rows}x{n}x{el}>\n" \
           f"    %gx = arith.constant {rows} : index\n" \
           f"    %rows32 = arith.constant {rows} : i32\n" \
           f"    %n32 = arith.constant {n} : i32\n" \
           f"    %y = flow.dispatch @{EXECUTABLE}::@row_argmax_{el}[%gx](%x2, %rows32, %n32) :\n" \
           f"        (tensor<{rows}x{n}x{el}>, i32, i32) -> tensor<{rows}xi64>\n" \
           f"    %out0 = flow.tensor.reshape %y : tensor<{rows}xi64> -> {y.builtin}\n"
    return IreeLowering(body=body, module_items={
        EXECUTABLE: cuda_executable_source(EXECUTABLE, obj, _KERNELS, 1, 1, 2, ARGMAX_THREADS, grid=1)})
