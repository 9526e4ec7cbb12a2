"""``matmul4``: a MatMul by a constant block-wise INT4 weight becomes ``ai.rewrite::MatMulInt4``.

Matches the dense form the ``quant4`` plugin writes (and any export of that form):
``MatMul(A, DequantizeLinear(codes, scales, zero_points, axis=0, block_size))`` with ``codes`` a UINT4 or INT4
initializer ``[K, N]``, ``scales`` ``[ceil(K / block_size), N]`` in A's dtype (f32/f16), ``zero_points`` a UINT4
initializer like the scales or absent, the dequantized weight read by that MatMul only and A of rank 2 or more
ending in K. Rule ``dense-int4-gemm``: the same weight in ``Gemm(A, DequantizeLinear(...), C)`` (alpha 1, beta 1,
no transA; with ``transB=1`` the codes are [N, K] blocked along axis 1: torch's Linear as transformers' exporter
writes it), C a constant bias of N elements becoming the op's addend. INT4 codes become ``code + 8`` with the
zero point 8 (the same values, ONNX DequantizeLinear-21); UINT4 codes without zero points get zero points 0.
The contract and lowerings: :mod:`rewrite.plugins.matmul4.op`.

Why: on IREE's cuda target the op's kernel reads each weight byte once per decode step with the dequantization
inside the dot product; iree-compile 3.13 materializes the dequantized weight of the DequantizeLinear form at
every call (BENCHMARKS.md, "Full-size decode on the H200"). Runs after ``quant4`` (whose form it reads) and
before ``legalize`` (which would decompose the DequantizeLinear).

Then the rule ``shared-input`` (:mod:`rewrite.plugins.matmul4.merge`) merges the MatMulInt4 nodes that read one
activation (query/key/value, gate/up) into one over their columns, with an output per member: one kernel
launch instead of several. Option ``merge`` (``--opt matmul4.merge=false``) turns it off. Then the rules
``swiglu`` and ``output-add`` (:mod:`rewrite.plugins.matmul4.epilogue`) move SwiGLU after merged gate/up
projections and bias or residual Adds after any output into the op, so the CUDA kernel applies them in its
store; option ``epilogue`` (``--opt matmul4.epilogue=false``) turns them off. Last, the rule ``rms-norm-prologue``
(:mod:`rewrite.plugins.matmul4.prologue`) moves an RMSNorm whose one reader is a MatMulInt4 into it (the input
norm before query/key/value), so on CUDA one launch normalizes the row and computes the product at decode; option
``prologue``: default true for IREE cuda, false elsewhere (the norm comes back in the other lowerings: nothing is
gained).
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
from rewrite.plugins.matmul4.epilogue import fuse_output_add, fuse_swiglu
from rewrite.plugins.matmul4.merge import merge_shared_input
from rewrite.plugins.matmul4.op import MatMulInt4
from rewrite.plugins.matmul4.prologue import fuse_norm_prologue
from rewrite.plugins.rmsnorm.op import CUDA_MAX_H

_FLOATS = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
_CODE_OFFSET = {TensorProto.UINT4: 0, TensorProto.INT4: 8}  #: code type -> added to reach 0..15


@rule("dense-int4-matmul")
def dense_int4_matmul(op, a, codes, scales, zero_point=Var("zero_point", optional=True)):
    """MatMul(A, DequantizeLinear(codes [K, N] 4-bit, scales, zero_point, axis=0, block_size)) -> MatMulInt4."""
    w = op.DequantizeLinear(codes, scales, zero_point, block_size=AttrVar("block_size"), _name="dq")
    return op.MatMul(a, w, _name="mm")


@rule("dense-int4-gemm")
def dense_int4_gemm(op, a, codes, scales, zero_point=Var("zero_point", optional=True), c=Var("c", optional=True)):
    """Gemm(A [M, K], DequantizeLinear(codes, scales, zero_point, block_size), C; alpha=1, beta=1, transA=0):
    codes [N, K] with transB=1 (blocks along axis 1: torch's Linear as transformers' exporter writes it) or [K, N]
    with transB=0 (axis 0) -> MatMulInt4, C (a bias of N elements) its addend. Gemm may round once after adding C;
    the op rounds the product to A's dtype, then adds (one rounding more: within f16's tolerance, exact in f32)."""
    w = op.DequantizeLinear(codes, scales, zero_point, block_size=AttrVar("block_size"), _name="dq")
    return op.Gemm(a, w, c, _name="mm")


def _check_int4(m, k_axis: int):
    """Fails the match unless its DequantizeLinear is a 4-bit [K, N] (``k_axis`` 0) or [N, K] (1) initializer
    blocked along K and its product reads A [..., K] of the scales' float type."""
    dq, mm = m.node("dq"), m.node("mm")
    codes, scales = m.graph.const(m["codes"]), m.graph.const(m["scales"])
    zp = m.graph.const(m["zero_point"]) if m.get("zero_point") else None
    cv, av = m.value("codes"), m.value("a")
    if codes is None or scales is None or (m.get("zero_point") and zp is None):
        return m.fail("codes, scales and zero points must be initializers", dq)
    if cv.dtype not in _CODE_OFFSET or codes.ndim != 2:
        return m.fail(f"codes '{m['codes']}' are {dtype_name(cv.dtype)} of rank {codes.ndim}; 4-bit "
                      f"{'[K, N]' if k_axis == 0 else '[N, K]'} expected", dq)
    if dq.attr("axis", 1) % 2 != k_axis:
        return m.fail(f"DequantizeLinear axis {dq.attr('axis', 1)}; blocks along K (axis {k_axis} of the weight) expected", dq)
    k, n = codes.shape if k_axis == 0 else codes.shape[::-1]
    bs = int(m.attr("block_size"))
    nb = -(-k // bs) if bs > 0 else 0
    want = (nb, n) if k_axis == 0 else (n, nb)
    if bs <= 0 or scales.shape != want or (zp is not None and zp.shape != want):
        return m.fail(f"scales {scales.shape} (zero points {None if zp is None else zp.shape}) do not fit codes "
                      f"{tuple(codes.shape)} with block_size {bs}", dq)
    if zp is not None and m.value("zero_point").dtype != TensorProto.UINT4:
        return m.fail("zero points must be UINT4 (the codes' type: DequantizeLinear-21)", dq)
    if av.dtype not in _FLOATS or av.dtype != m.value("scales").dtype:
        return m.fail(f"A is {dtype_name(av.dtype)}, scales {dtype_name(m.value('scales').dtype)}; one float type (f32/f16) expected", mm)
    if av.shape is None or len(av.shape) < 2 or av.shape[-1] not in (k, None):
        return m.fail(f"A '{m['a']}' has shape {av.shape}; rank 2 or more ending in K={k} expected", mm)
    if len(m.graph.uses(dq.outputs[0])) != 1 or m.graph.is_graph_output(dq.outputs[0]):
        return m.fail("the dequantized weight is read by more than this product", dq)
    return None


def _rewrite_int4(m, b, k_axis: int, addend: str = ""):
    """The MatMulInt4 of a checked match: codes packed as [N, ceil(K/2)], scales and zero points as [N, nb]."""
    codes, scales = m.graph.const(m["codes"]), m.graph.const(m["scales"])
    if k_axis == 0:
        codes, scales = codes.T, scales.T
    n, k = codes.shape
    offset = _CODE_OFFSET[m.value("codes").dtype]
    if m.get("zero_point"):
        zp = m.graph.const(m["zero_point"]).astype(np.uint8)
        zp = zp.T if k_axis == 0 else zp
    else:
        zp = np.full(scales.shape, 8 if offset else 0, np.uint8)
    packed = pack_int4((codes.astype(np.int16) + offset).astype(np.uint8))
    out = m.graph.values[m.node("mm").outputs[0]]
    ins = [m["a"], b.const(packed, "B"), b.const(np.ascontiguousarray(scales), "scales")]
    if not (offset and not m.get("zero_point")):  # absent zero points mean 8: the INT4 case
        ins.append(b.const(np.ascontiguousarray(zp), "zero_points"))
    if addend:
        ins += [""] * (4 - len(ins)) + [addend]
    return b.op("MatMulInt4", ins, domain=DOMAIN, K=int(k), N=int(n), block_size=int(m.attr("block_size")),
                dtype=out.dtype, shape=out.shape)


@dense_int4_matmul.check
def _(m):
    return _check_int4(m, 0)


@dense_int4_matmul.rewrite
def _(m, b):
    return _rewrite_int4(m, b, 0)


@dense_int4_gemm.check
def _(m):
    mm = m.node("mm")
    beta = mm.attr("beta", 1.0) if m.get("c") else 1.0  # without C, beta scales nothing
    if mm.attr("transA", 0) or mm.attr("alpha", 1.0) != 1.0 or beta != 1.0:
        return m.fail(f"Gemm transA={mm.attr('transA', 0)}, alpha={mm.attr('alpha', 1.0)}, beta={mm.attr('beta', 1.0)}; "
                      "0, 1 and 1 expected", mm)
    fail = _check_int4(m, 1 if mm.attr("transB", 0) else 0)
    if fail is not None:
        return fail
    if m.get("c"):
        c, out = m.value("c"), m.graph.values[mm.outputs[0]]
        n = out.shape[-1] if out.shape else None
        const = m.graph.const(m["c"])
        if const is None or c.dtype != m.value("a").dtype or const.size != n or const.shape[-1:] != (n,):
            return m.fail(f"Gemm's C '{m['c']}' is not a constant bias of N={n} elements of A's dtype", mm)
    return None


@dense_int4_gemm.rewrite
def _(m, b):
    addend = ""
    if m.get("c"):
        c = m.graph.const(m["c"])
        addend = m["c"] if c.ndim == 1 else b.const(c.reshape(-1), "bias")
    return _rewrite_int4(m, b, 1 if m.node("mm").attr("transB", 0) else 0, addend)


class MatMul4(Plugin):
    name = "dense-int4-matmul"
    short = "matmul4"
    # reads the DequantizeLinear form quant4 writes; legalize would decompose that DequantizeLinear
    runs_after = ("quant4",)
    runs_before = ("legalize",)
    description = "MatMul by a constant block-wise INT4 weight (quant4's dense form) -> MatMulInt4 (dequantization inside the dot product)"
    # the form it reads (DequantizeLinear with block_size) exists from opset 21, which quant4 moves opset 18-20
    # models to before this runs; below 21 without quant4 it finds nothing to match
    opset_range = (18, 28)
    kernels = (KernelObject("matmul_int4_f32/f16_v8/v32", "iree", "cuda", "kernels/matmul4_cuda.cu"),)

    @property
    def rules(self):
        return [dense_int4_matmul, dense_int4_gemm]

    def run(self, graph: Graph, report: PluginReport, ctx=None, *, dry_run: bool = False) -> None:
        """The rule, then :func:`merge_shared_input` unless the option ``merge`` is false, then
        :func:`fuse_swiglu` and :func:`fuse_output_add` unless the option ``epilogue`` is false, then
        :func:`fuse_norm_prologue` when the option ``prologue`` is true (default: for IREE cuda).

        Raises:
            RewriteError: an unknown option, or ``merge``, ``epilogue`` or ``prologue`` not a boolean."""
        opts = dict(((getattr(ctx, "options", None) or {}).get(self.short) or {}))
        unknown = sorted(set(opts) - {"merge", "epilogue", "prologue"})
        if unknown:
            raise RewriteError(f"matmul4: unknown option '{unknown[0]}'; options: merge, epilogue, prologue")
        cuda = ctx is not None and (getattr(ctx, "backend", None), getattr(ctx, "target", None)) == ("iree", "cuda")
        opts.setdefault("prologue", cuda)
        for name in ("merge", "epilogue", "prologue"):
            if not isinstance(opts.get(name, True), bool):
                raise RewriteError(f"matmul4: option {name}={opts[name]!r}; true or false expected")
        apply_rules(graph, self.rules, self.short, report, dry_run=dry_run, ctx=ctx)
        if opts.get("merge", True):
            merge_shared_input(graph, report, dry_run=dry_run)
        if opts.get("epilogue", True):
            fuse_swiglu(graph, report, dry_run=dry_run)
            fuse_output_add(graph, report, dry_run=dry_run)
        if opts["prologue"]:
            fuse_norm_prologue(graph, report, max_k=CUDA_MAX_H if cuda else None, dry_run=dry_run)

    @property
    def abstract_ops(self):
        return [MatMulInt4()]

    @property
    def cases(self):
        from rewrite.plugins.matmul4.cases import matmul4_cases

        return matmul4_cases()
