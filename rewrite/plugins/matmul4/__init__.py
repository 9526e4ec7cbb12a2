"""``matmul4``: a MatMul by a constant block-wise INT4 weight becomes ``ai.rewrite::MatMulInt4``.

Matches the dense form the ``quant4`` plugin writes (and any export of that form):
``MatMul(A, DequantizeLinear(codes, scales, zero_points, axis=0, block_size))`` with ``codes`` a UINT4 or INT4
initializer ``[K, N]``, ``scales`` ``[ceil(K / block_size), N]`` in A's dtype (f32/f16), ``zero_points`` a UINT4
initializer like the scales or absent, the dequantized weight read by that MatMul only and A of rank 2 or more
ending in K. INT4 codes become ``code + 8`` with the zero point 8 (the same values, ONNX DequantizeLinear-21);
UINT4 codes without zero points get zero points 0. The contract and lowerings: :mod:`rewrite.plugins.matmul4.op`.

Why: on IREE's cuda target the op's kernel reads each weight byte once per decode step with the dequantization
inside the dot product; iree-compile 3.13 materializes the dequantized weight of the DequantizeLinear form at
every call (BENCHMARKS.md, "Full-size decode on the H200"). Runs after ``quant4`` (whose form it reads) and
before ``legalize`` (which would decompose the DequantizeLinear).

Then the rule ``shared-input`` (:mod:`rewrite.plugins.matmul4.merge`) merges the MatMulInt4 nodes that read one
activation (query/key/value, gate/up) into one over their columns, with an output per member: one kernel
launch instead of several. Option ``merge`` (``--opt matmul4.merge=false``) turns it off.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.int4 import pack_int4
from rewrite.core.driver import PluginReport, apply_rules
from rewrite.core.ir import Graph, dtype_name
from rewrite.core.pattern import AttrVar, Var
from rewrite.core.rules import rule
from rewrite.errors import RewriteError
from rewrite.plugins.base import KernelObject, Plugin
from rewrite.plugins.matmul4.merge import merge_shared_input
from rewrite.plugins.matmul4.op import MatMulInt4

_FLOATS = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
_CODE_OFFSET = {TensorProto.UINT4: 0, TensorProto.INT4: 8}  #: code type -> added to reach 0..15


@rule("dense-int4-matmul")
def dense_int4_matmul(op, a, codes, scales, zero_point=Var("zero_point", optional=True)):
    """MatMul(A, DequantizeLinear(codes [K, N] 4-bit, scales, zero_point, axis=0, block_size)) -> MatMulInt4."""
    w = op.DequantizeLinear(codes, scales, zero_point, block_size=AttrVar("block_size"), _name="dq")
    return op.MatMul(a, w, _name="mm")


@dense_int4_matmul.check
def _(m):
    dq, mm = m.node("dq"), m.node("mm")
    codes, scales = m.graph.const(m["codes"]), m.graph.const(m["scales"])
    zp = m.graph.const(m["zero_point"]) if m.get("zero_point") else None
    cv, av = m.value("codes"), m.value("a")
    if codes is None or scales is None or (m.get("zero_point") and zp is None):
        return m.fail("codes, scales and zero points must be initializers", dq)
    if cv.dtype not in _CODE_OFFSET or codes.ndim != 2:
        return m.fail(f"codes '{m['codes']}' are {dtype_name(cv.dtype)} of rank {codes.ndim}; 4-bit [K, N] expected", dq)
    if dq.attr("axis", 1) not in (0, -2):
        return m.fail(f"DequantizeLinear axis {dq.attr('axis', 1)}; blocks along K (axis 0 of [K, N]) expected", dq)
    k, n = codes.shape
    bs = int(m.attr("block_size"))
    nb = -(-k // bs) if bs > 0 else 0
    if bs <= 0 or scales.shape != (nb, n) or (zp is not None and zp.shape != (nb, n)):
        return m.fail(f"scales {scales.shape} (zero points {None if zp is None else zp.shape}) do not fit codes [K={k}, N={n}] "
                      f"with block_size {bs}", dq)
    if zp is not None and m.value("zero_point").dtype != TensorProto.UINT4:
        return m.fail("zero points must be UINT4 (the codes' type: DequantizeLinear-21)", dq)
    if av.dtype not in _FLOATS or av.dtype != m.value("scales").dtype:
        return m.fail(f"A is {dtype_name(av.dtype)}, scales {dtype_name(m.value('scales').dtype)}; one float type (f32/f16) expected", mm)
    if av.shape is None or len(av.shape) < 2 or av.shape[-1] not in (k, None):
        return m.fail(f"A '{m['a']}' has shape {av.shape}; rank 2 or more ending in K={k} expected", mm)
    if len(m.graph.uses(dq.outputs[0])) != 1 or m.graph.is_graph_output(dq.outputs[0]):
        return m.fail("the dequantized weight is read by more than this MatMul", dq)


@dense_int4_matmul.rewrite
def _(m, b):
    codes, scales = m.graph.const(m["codes"]), m.graph.const(m["scales"])
    k, n = codes.shape
    offset = _CODE_OFFSET[m.value("codes").dtype]
    if m.get("zero_point"):
        zp = m.graph.const(m["zero_point"]).astype(np.uint8).T
    else:
        zp = np.full((scales.shape[0], n), 8 if offset else 0, np.uint8).T
    packed = pack_int4((codes.astype(np.int16) + offset).astype(np.uint8).T)
    m.graph.ensure_opset(DOMAIN)
    out = m.graph.values[m.node("mm").outputs[0]]
    ins = [m["a"], b.const(packed, "B"), b.const(np.ascontiguousarray(scales.T), "scales")]
    if not (offset and not m.get("zero_point")):  # absent zero points mean 8: the INT4 case
        ins.append(b.const(np.ascontiguousarray(zp), "zero_points"))
    return b.op("MatMulInt4", ins, domain=DOMAIN, K=int(k), N=int(n), block_size=int(m.attr("block_size")),
                dtype=out.dtype, shape=out.shape)


class MatMul4(Plugin):
    name = "dense-int4-matmul"
    short = "matmul4"
    # reads the DequantizeLinear form quant4 writes; legalize would decompose that DequantizeLinear
    runs_after = ("quant4",)
    runs_before = ("legalize",)
    description = "MatMul by a constant block-wise INT4 weight (quant4's dense form) -> MatMulInt4 (dequantization inside the dot product)"
    opset_range = (21, 28)
    kernels = (KernelObject("matmul_int4_f32/f16_v8/v32", "iree", "cuda", "kernels/matmul4_cuda.cu"),)

    @property
    def rules(self):
        return [dense_int4_matmul]

    def run(self, graph: Graph, report: PluginReport, ctx=None, *, dry_run: bool = False) -> None:
        """The rule, then :func:`merge_shared_input` unless the option ``merge`` is false.

        Raises:
            RewriteError: an unknown option, or ``merge`` not a boolean."""
        opts = dict(((getattr(ctx, "options", None) or {}).get(self.short) or {}))
        unknown = sorted(set(opts) - {"merge"})
        if unknown:
            raise RewriteError(f"matmul4: unknown option '{unknown[0]}'; options: merge")
        merge = opts.get("merge", True)
        if not isinstance(merge, bool):
            raise RewriteError(f"matmul4: option merge={merge!r}; true or false expected")
        apply_rules(graph, self.rules, self.short, report, dry_run=dry_run)
        if merge:
            merge_shared_input(graph, report, dry_run=dry_run)

    @property
    def abstract_ops(self):
        return [MatMulInt4()]

    @property
    def cases(self):
        from rewrite.plugins.matmul4.cases import matmul4_cases

        return matmul4_cases()
