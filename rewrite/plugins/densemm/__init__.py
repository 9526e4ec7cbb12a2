"""``densemm``: a MatMul by a large constant float weight becomes ``ai.rewrite::DenseMatMul``.

Matches ``MatMul(A, W)`` with ``W`` a float initializer ``[K, N]`` of at least :data:`MIN_ELEMENTS` elements, or of
one column of at least :data:`MIN_GATE_K` rows (N = 1: Qwen1.5-MoE's sigmoid gate of the shared expert, [2048, 1]),
read by that MatMul only (a tied embedding is left alone: its transposed copy would double its bytes), and A of A's own float type (f32/f16), of rank 2 or more ending in K: the LM head of a model whose
other weights ``quant4`` made INT4 (``matmul4``), or every projection of a float model. The op keeps the weight
transposed, ``[N, K]``, rows along K. Contract and lowerings: :mod:`rewrite.plugins.densemm.op`.

Why: on IREE's cuda target the op's kernel reads each weight byte once per decode step; iree-compile 3.13 runs
the LM head MatMul of Qwen1.5-MoE at 230 GB/s on an H200, and its one-column shared-expert gate in 11 us a call
(BENCHMARKS.md, "Full-size decode on the H200"), where one warp reads the 4 KB in a few. Runs
after ``quant4`` (which quantizes what it can first), ``topk`` and ``moe`` (which read the router's MatMul).

Then the rule ``rms-norm-prologue`` (:mod:`rewrite.plugins.densemm.prologue`) moves an RMSNorm into the first float
product reading it (the post-attention norm into the router's MatMul, the final norm into the LM head), whose
second output is the normalized row for the norm's other readers: one launch for both at decode on CUDA; then
``merge-normed-products`` (:mod:`rewrite.plugins.densemm.merge`) gives such an op a second float product of the
normalized row as another output (Qwen1.5-MoE's shared-expert gate beside the router: one launch fewer per layer).
Options ``prologue`` and ``merge``: default true for IREE cuda, false elsewhere (the norm and the products come
back in the other lowerings).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.driver import apply_rules
from rewrite.core.ir import dtype_name
from rewrite.core.rules import rule
from rewrite.errors import RewriteError
from rewrite.plugins.base import KernelObject, Plugin
from rewrite.plugins.densemm.op import CUDA_K_MULTIPLE, DenseMatMul
from rewrite.plugins.densemm.merge import merge_normed_products
from rewrite.plugins.densemm.prologue import fuse_norm_prologue
from rewrite.plugins.rmsnorm.op import CUDA_MAX_H

MIN_ELEMENTS = 1 << 20  #: smaller weights (routers, [2048, 60] in Qwen1.5-MoE) stay MatMuls
MIN_GATE_K = 1024  #: a one-column weight this long or longer is taken too (a gate: iree-compile's matvec is slow)
_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)


@rule("dense-float-matmul")
def dense_float_matmul(op, a, w):
    """MatMul(A, W [K, N] float initializer) -> DenseMatMul(A, W^T)."""
    return op.MatMul(a, w, _name="mm")


@dense_float_matmul.check
def _(m):
    mm = m.node("mm")
    w, wv, av = m.graph.const(m["w"]), m.value("w"), m.value("a")
    if w is None or not wv.is_initializer:
        return m.fail(f"B '{m['w']}' is not an initializer", mm)
    if wv.dtype not in _FLOATS or w.ndim != 2:
        return m.fail(f"B '{m['w']}' is {dtype_name(wv.dtype)} of rank {w.ndim}; a float [K, N] weight expected", mm)
    if w.size < MIN_ELEMENTS and (w.shape[1] != 1 or w.shape[0] < MIN_GATE_K):
        return m.fail(f"B '{m['w']}' [{w.shape[0]}, {w.shape[1]}] has fewer than {MIN_ELEMENTS} elements and is not one "
                      f"column of at least {MIN_GATE_K}", mm)
    if m.ctx is not None and (m.ctx.backend, m.ctx.target) == ("iree", "cuda") and w.shape[0] % CUDA_K_MULTIPLE:
        return m.fail(f"K={w.shape[0]}: the CUDA kernel reads rows in multiples of {CUDA_K_MULTIPLE}", mm)
    if av.dtype != wv.dtype:
        return m.fail(f"A is {dtype_name(av.dtype)}, B {dtype_name(wv.dtype)}", mm)
    if av.shape is None or len(av.shape) < 2 or av.shape[-1] not in (w.shape[0], None):
        return m.fail(f"A '{m['a']}' has shape {av.shape}; rank 2 or more ending in K={w.shape[0]} expected", mm)
    if len(m.graph.uses(m["w"])) != 1:
        return m.fail(f"B '{m['w']}' is read elsewhere too (a tied embedding, a shared weight): not copied", mm)


@dense_float_matmul.rewrite
def _(m, b):
    w = m.graph.const(m["w"])
    out = m.graph.values[m.node("mm").outputs[0]]
    return b.op("DenseMatMul", [m["a"], b.const(np.ascontiguousarray(w.T), "weight")], domain=DOMAIN,
                dtype=out.dtype, shape=out.shape)


class DenseMM(Plugin):
    name = "dense-float-matmul"
    short = "densemm"
    # quant4 quantizes weights first; topk and moe read the router MatMul (small: never matched, but declared)
    runs_after = ("quant4", "topk", "moe")
    description = "MatMul by a large or one-column constant float weight (the LM head, a gate) -> DenseMatMul (a warp per column on CUDA)"
    opset_range = (13, 28)
    kernels = (KernelObject("dense_matmul[_o2]_f32/f16, dense_matmul_norm[_o2]_f32/f16", "iree", "cuda", "kernels/densemm_cuda.cu"),)

    @property
    def rules(self):
        return [dense_float_matmul]

    def run(self, graph, report, ctx=None, *, dry_run=False):
        """The rule, then :func:`fuse_norm_prologue` when the option ``prologue`` is true and
        :func:`merge_normed_products` when ``merge`` is (both by default for IREE cuda only).

        Raises:
            RewriteError: an unknown option, or one that is not a boolean."""
        opts = dict(((getattr(ctx, "options", None) or {}).get(self.short) or {}))
        if set(opts) - {"prologue", "merge"}:
            raise RewriteError(f"densemm: unknown option '{sorted(set(opts) - {'prologue', 'merge'})[0]}'; options: "
                               "prologue, merge")
        cuda = ctx is not None and (getattr(ctx, "backend", None), getattr(ctx, "target", None)) == ("iree", "cuda")
        prologue, merge = opts.get("prologue", cuda), opts.get("merge", cuda)
        for key, value in (("prologue", prologue), ("merge", merge)):
            if not isinstance(value, bool):
                raise RewriteError(f"densemm: option {key}={value!r}; true or false expected")
        apply_rules(graph, self.rules, self.short, report, dry_run=dry_run, ctx=ctx)
        if prologue:
            fuse_norm_prologue(graph, report, k_multiple=CUDA_K_MULTIPLE if cuda else 1, max_k=CUDA_MAX_H if cuda else None,
                               dry_run=dry_run)
        if merge:
            merge_normed_products(graph, report, dry_run=dry_run)

    @property
    def abstract_ops(self):
        return [DenseMatMul()]

    @property
    def cases(self):
        from rewrite.plugins.densemm.cases import densemm_cases

        return densemm_cases()
