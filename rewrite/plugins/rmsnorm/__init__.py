"""``norm``: RMSNorm over the last axis becomes one ``ai.rewrite::RMSNorm``.

Matches transformers' RMSNorm as its exporters and the seed form write it (seed 000 "1. RMSNorm"): ``[Cast(float32)]
-> Pow(2) -> ReduceMean(-1) -> Add(eps) -> Sqrt -> Div (or Reciprocal and Mul) -> [Cast back] -> Mul(weight [H])``,
computed in float32, of f32 or f16 X [..., H]. The contract and the lowerings: :mod:`rewrite.plugins.rmsnorm.op`.

Why: where the norm's input comes from an elementwise op (the residual sum after the MoE block), iree-compile 3.13
runs it as a cast and a reduction, two dispatches, in a decode step bound by its launches (BENCHMARKS.md,
"Full-size decode on the H200"). Runs after ``rope`` (which takes Qwen3's per-head q/k norms into its own op) and
``cast``, before ``legalize``.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.ir import dtype_name
from rewrite.core.rules import rule
from rewrite.plugins.base import KernelObject, Plugin
from rewrite.plugins.rmsnorm.op import CUDA_MAX_H, RMSNorm, check_shapes
from rewrite.plugins.rmsnorm.pattern import norm_refusal, rms_norm

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)


@rule("rms-norm")
def rms_norm_rule(op, x):
    """RMSNorm(X) over the last axis -> RMSNorm(X, weight)."""
    return rms_norm(op, x)


@rms_norm_rule.check
def _(m):
    x = m.value("x")
    node = m.node("norm_weight")
    if x.dtype not in _FLOATS:
        return m.fail(f"X is {dtype_name(x.dtype)}: float32 or float16 expected", node)
    if x.shape is None or len(x.shape) < 1 or not isinstance(x.shape[-1], int):
        return m.fail(f"X '{m['x']}' has shape {x.shape}: a static last dim expected", node)
    bad = norm_refusal(m, x, len(x.shape) - 1)
    if bad is not None:
        return bad
    try:
        check_shapes(x.shape, m.value("weight").shape, f"RMSNorm at {node.name}")
    except ValueError as e:
        return m.fail(str(e), node)
    if m.ctx is not None and (m.ctx.backend, m.ctx.target) == ("iree", "cuda") and x.shape[-1] > CUDA_MAX_H:
        return m.fail(f"H={x.shape[-1]}: the CUDA kernel holds rows of at most {CUDA_MAX_H}", node)


@rms_norm_rule.rewrite
def _(m, b):
    out = m.graph.values[m.outputs[0]]
    eps = float(np.asarray(m.const("eps")).reshape(-1)[0])
    return b.op("RMSNorm", [m["x"], m["weight"]], domain=DOMAIN, epsilon=eps, dtype=out.dtype, shape=out.shape)


class RmsNorm(Plugin):
    name = "rms-norm"
    short = "norm"
    takes_options = False
    # rope takes the per-head norms before RoPE into its own op first; legalize rewrites for IREE what is left
    runs_after = ("cast", "rope")
    runs_before = ("legalize",)
    description = "RMSNorm over the last axis -> RMSNorm (a workgroup per row on CUDA)"
    opset_range = (13, 28)
    kernels = (KernelObject("rms_norm_f32/f16", "iree", "cuda", "kernels/rmsnorm_cuda.cu"),)

    @property
    def rules(self):
        return [rms_norm_rule]

    @property
    def abstract_ops(self):
        return [RMSNorm()]

    @property
    def cases(self):
        from rewrite.plugins.rmsnorm.cases import rmsnorm_cases

        return rmsnorm_cases()
