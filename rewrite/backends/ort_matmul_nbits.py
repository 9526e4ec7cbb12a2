"""ORT lowering of dense blocked 4-bit weights: ``DequantizeLinear -> MatMul`` to com.microsoft::MatMulNBits.

The ``quant4`` plugin leaves each dense weight as ``DequantizeLinear(codes: UINT4|INT4 [K, N] or [N, K],
scales, zero_points: UINT4, axis=<K axis>, block_size)`` read by a MatMul or Gemm (through a Transpose for
``[N, K]``). ONNX Runtime 1.32 runs that pair as a float dequantization plus a float MatMul at every call
(~4x slower than float, benchmarks/moe_cpu.py); its contrib op MatMulNBits (com.microsoft, opset 1; schema
from ``onnxruntime.capi.onnxruntime_pybind11_state.get_all_operator_schema()``) computes the same product on
the packed weight. Layout (that schema; ``onnxruntime/quantization/matmul_nbits_quantizer.py``):

* ``B``: uint8 ``[N, n_blocks, block_size / 2]``, the K axis of output column n blocked, two codes per byte,
  the even element in the low nibble; a partial last block (K not a multiple of block_size) is padded with
  that block's zero point, so the padding dequantizes to 0;
* ``scales``: ``[N, n_blocks]`` in A's dtype;
* ``zero_points``: uint8 ``[N, ceil(n_blocks / 2)]`` packed like B (each row padded on its own); INT4 codes
  (quant4 ``symmetric``) are stored as ``code + 8`` with no zero points: MatMulNBits' default is 8; UINT4
  codes without zero points (ONNX's default zero point is 0) get explicit zero points of 0;
* a block larger than ``ORT_MAX_BLOCK`` (64: faster on ORT 1.32's CPU kernel, see
  :mod:`rewrite.plugins.moe.lowering`) is split into blocks of 64 that share its scale and zero point (exact);
* attributes ``K``, ``N``, ``bits=4``, ``block_size``, ``accuracy_level=0``: A is neither quantized nor
  downcast, so the result is the float product of A and the dequantized weight (up to summation order).

Applied by :meth:`rewrite.backends.ort.OrtBackend.lower` only; the IREE backend keeps the ONNX form. Pairs
that do not fit are left as they are (not an error): the weight, scales or zero points not initializers,
the dequantized weight read by anything else, A or the scales not float32/float16, Gemm with ``transA``,
``alpha != 1`` or a bias that is not ``[N]`` with ``beta = 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from rewrite.core.ir import Graph, Node
from rewrite.core.rules import Builder
from rewrite.core.int4 import ORT_MAX_BLOCK, pack_int4

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)
_CODES = {TensorProto.UINT4: 0, TensorProto.INT4: 8}  # code type -> offset to MatMulNBits' unsigned codes


@dataclass
class _Pair:
    """One DequantizeLinear feeding the B input of ``mm`` (MatMul or Gemm); ``nk``: the weight is [N, K]."""

    dq: Node
    mm: Node
    between: Node | None  # the Transpose between them, if any
    nk: bool
    bias: str


def _only_use(graph: Graph, value: str) -> Node | None:
    """The single node reading ``value`` once, not as a graph output; None otherwise."""
    uses = graph.uses(value)
    if len(uses) != 1 or graph.is_graph_output(value) or uses[0][0] < 0:
        return None
    return graph.nodes[uses[0][0]]


def _is_init(graph: Graph, value: str) -> bool:
    return bool(value) and graph.values[value].is_initializer and not graph.values[value].overridable


def _match(graph: Graph, dq: Node) -> _Pair | None:
    """The pair ``dq`` heads, when MatMulNBits can compute it exactly (module docstring); None otherwise."""
    ins = list(dq.inputs) + [""] * (3 - len(dq.inputs))
    x, scale, zp = ins
    if not (_is_init(graph, x) and _is_init(graph, scale) and (not zp or _is_init(graph, zp))):
        return None
    codes_t, scale_t = graph.values[x].dtype, graph.values[scale].dtype
    bs = int(dq.attr("block_size", 0))
    if codes_t not in _CODES or scale_t not in _FLOATS or (zp and graph.values[zp].dtype != codes_t):
        return None
    if len(graph.values[x].initializer.dims) != 2 or bs < 16 or bs & (bs - 1) or dq.attr("output_dtype", scale_t) != scale_t:
        return None
    axis = int(dq.attr("axis", 1)) % 2
    user = _only_use(graph, dq.outputs[0])
    between = None
    if user is not None and user.op_type == "Transpose" and list(user.attr("perm", [1, 0])) == [1, 0]:
        between, user = user, _only_use(graph, user.outputs[0])
    if user is None or user.domain != "":
        return None
    w_in = (between or dq).outputs[0]
    if user.inputs[1] != w_in or graph.values[user.inputs[0]].dtype != scale_t or graph.values[user.inputs[0]].rank == 1:
        return None
    trans = between is not None
    bias = ""
    if user.op_type == "Gemm":
        if user.attr("transA", 0) or user.attr("alpha", 1.0) != 1.0:
            return None
        trans ^= bool(user.attr("transB", 0))
        if len(user.inputs) > 2 and user.inputs[2]:
            bias = user.inputs[2]
            c = graph.values[bias]
            n = graph.values[x].initializer.dims[1 - axis]
            if user.attr("beta", 1.0) != 1.0 or c.dtype != scale_t or c.shape is None or tuple(c.shape) != (n,):
                return None
    elif user.op_type != "MatMul":
        return None
    # the product reduces over the weight's K axis only when it is the blocked one
    if axis != (1 if trans else 0):
        return None
    return _Pair(dq, user, between, trans, bias)


def _pack(graph: Graph, p: _Pair) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int, int, int]:
    """(B, scales, zero_points or None, K, N, block_size) in the MatMulNBits layout (module docstring)."""
    x, scale = p.dq.inputs[0], p.dq.inputs[1]
    zp = p.dq.inputs[2] if len(p.dq.inputs) > 2 else ""
    offset = _CODES[graph.values[x].dtype]
    codes = graph.const(x).astype(np.int16) + offset
    scales = graph.const(scale)
    zps = graph.const(zp).astype(np.int16) + offset if zp else None
    if zps is None and offset == 0:  # an absent UINT4 zero point is 0 (ONNX DequantizeLinear); MatMulNBits' is 8
        zps = np.zeros(scales.shape, np.int16)
    if not p.nk:  # [K, N] -> [N, K]: MatMulNBits blocks each output column's K values
        codes, scales = codes.T, scales.T
        zps = None if zps is None else zps.T
    n, k = codes.shape
    bs = int(p.dq.attr("block_size"))
    if bs > ORT_MAX_BLOCK:  # both powers of two (_match): split each block, its scale and zero point repeated
        rep, bs = bs // ORT_MAX_BLOCK, ORT_MAX_BLOCK
        scales = np.repeat(scales, rep, axis=1)[:, : math.ceil(k / bs)]
        zps = None if zps is None else np.repeat(zps, rep, axis=1)[:, : math.ceil(k / bs)]
    nb = math.ceil(k / bs)
    pad = np.repeat(zps[:, -1:] if zps is not None else np.full((n, 1), 8, np.int16), nb * bs - k, axis=1)
    blocks = np.concatenate([codes, pad], axis=1).reshape(n, nb, bs)
    return (pack_int4(blocks), np.ascontiguousarray(scales), None if zps is None else pack_int4(zps), k, n, bs)


def lower_matmul_nbits(graph: Graph) -> int:
    """Replace every fitting ``DequantizeLinear -> [Transpose ->] MatMul|Gemm`` by one com.microsoft::MatMulNBits
    (module docstring), in node order; returns how many were replaced.

    The MatMulNBits output keeps the MatMul's dtype and shape; A of any rank >= 2 (``[..., M, K]``) is read as
    MatMul reads it. The replaced DequantizeLinear/Transpose nodes and their no-longer-read initializers are
    removed (as are any other initializers nothing reads). Deterministic: names come from the weight's initializer name.
    """
    count = 0
    for dq in graph.nodes_by_op("DequantizeLinear"):
        p = _match(graph, dq)
        if p is None:
            continue
        b_packed, scales, zps, k, n, bs = _pack(graph, p)
        hint = dq.inputs[0]
        b = Builder(graph, "lower/MatMulNBits", p.mm.order, hint)
        ins = [p.mm.inputs[0], b.const(b_packed, "B"), b.const(scales, "scales"), b.const(zps, "zero_points") if zps is not None else ""]
        if p.bias:
            ins += ["", p.bias]  # input 4, g_idx, is deprecated
        out_v = graph.values[p.mm.outputs[0]]
        out = b.op("MatMulNBits", ins, domain="com.microsoft", dtype=out_v.dtype, shape=out_v.shape,
                   K=k, N=n, bits=4, block_size=bs, accuracy_level=0)
        graph.replace_node(p.mm, [out])
        if p.between is not None:
            graph.remove_node(p.between)
        graph.remove_node(p.dq)
        count += 1
    if count:
        graph.ensure_opset("com.microsoft")
        graph.remove_unused_initializers()  # the 4-bit codes, now repacked: do not ship the weights twice
    return count
