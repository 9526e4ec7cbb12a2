"""``rmsnorm``: fuse the RMSNorm subgraph exporters emit into one ONNX ``RMSNormalization`` node.

Matched (any operand order of the commutative Add/Mul)::

    y = Mul(weight, Div(x, Sqrt(Add(ReduceMean(Pow(x, 2), axes=[-1]), eps))))
    y = Mul(weight, Mul(x, Reciprocal(Sqrt(Add(ReduceMean(Pow(x, 2), axes=[-1]), eps)))))

optionally with x first Cast to float32 (the compute type) and the normalized value Cast back to x's type
before the weight, as transformers' RMSNorm modules are exported (``hidden_states.to(torch.float32)``).

Replacement: ``RMSNormalization(x, weight, axis=-1, epsilon=eps)`` (ONNX spec, RMSNormalization-23:
``Y = X / Sqrt(ReduceMean(X^2, axes=[axis..]) + epsilon) * scale``, computed in ``stash_type`` = float32).

Target op, measured with onnxruntime 1.32 and iree-base-compiler 3.13:

* ONNX Runtime runs ``RMSNormalization`` (opset 23). It registers ``SimplifiedLayerNormalization`` only in the
  default ONNX domain (``com.microsoft::SimplifiedLayerNormalization`` is "not a registered function/op"),
  where ``onnx.checker`` rejects it as an unknown op, so the standard op is the one to emit.
* IREE's ONNX importer 3.13 does not lower ``RMSNormalization`` ("failed to legalize operation
  'torch.operator'"), so this plugin declares ``backends = ("ort",)`` and models need opset >= 23.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from rewrite.core.ir import dtype_name
from rewrite.core.pattern import AttrVar, Const, Or, subpattern
from rewrite.core.rules import rule
from rewrite.hookspecs import hookimpl
from rewrite.plugins.base import Plugin

FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)


@subpattern
def normalize(op, x):
    """x / Sqrt(ReduceMean(x^2) + eps), the division written as Div or as Mul by a Reciprocal, optionally
    computed in another float type (Cast to ``compute`` first, Cast to ``target`` after)."""
    xc = Or([op.Cast(x, to=AttrVar("compute"), _name="to_compute"), x])
    mean = op.ReduceMean(op.Pow(xc, Const("two", value=2.0)), Const("axes"), keepdims=AttrVar("keepdims", default=1), _name="mean")
    std = op.Sqrt(op.Add(mean, Const("eps")), _name="sqrt")
    normed = Or([op.Div(xc, std, _name="div"), op.Mul(xc, op.Reciprocal(std), _name="div")])
    return Or([op.Cast(normed, to=AttrVar("target"), _name="to_target"), normed])


@rule("rms-norm")
def rms_norm(op, x, weight):
    """weight * x / Sqrt(ReduceMean(x^2, -1) + eps) -> RMSNormalization(x, weight, axis=-1, epsilon=eps)."""
    return op.Mul(normalize(op, x, _scope="norm"), weight, _name="scale")


@rms_norm.check
def _(m):
    x, w = m.value("x"), m.value("weight")
    mean = m.node("norm.mean")
    if x.dtype not in FLOATS:
        return m.fail(f"'{m['x']}' is {dtype_name(x.dtype)}, not a float type", mean)
    if "norm.compute" in m and m.attr("norm.compute") not in (TensorProto.FLOAT, TensorProto.DOUBLE):
        return m.fail(f"normalization computed in {dtype_name(m.attr('norm.compute'))}, not FLOAT or DOUBLE", m.node("norm.to_compute"))
    out = m.graph.values[m.outputs[0]].dtype
    if w.dtype != x.dtype or out != x.dtype:
        return m.fail(f"x is {dtype_name(x.dtype)}, weight '{m['weight']}' {dtype_name(w.dtype)}, result {dtype_name(out)}: "
                      "RMSNormalization keeps one type", m.node("scale"))
    if x.shape is None or not isinstance(x.shape[-1], int):
        return m.fail(f"last dim of '{m['x']}' is unknown (run shape inference or pass --dim)", mean)
    axes = m.const("norm.axes").reshape(-1).tolist()
    if len(axes) != 1 or axes[0] not in (-1, len(x.shape) - 1):
        return m.fail(f"ReduceMean axes {axes} are not the last axis of rank {len(x.shape)}", mean)
    if m.attr("norm.keepdims") != 1:
        return m.fail("ReduceMean drops the reduced axis (keepdims=0)", mean)
    if m.const("norm.eps").size != 1:
        return m.fail(f"epsilon '{m['norm.eps']}' is not a scalar", m.node("norm.sqrt"))
    if w.shape != (x.shape[-1],):
        return m.fail(f"weight '{m['weight']}' has shape {w.type_str()}, RMSNormalization takes [{x.shape[-1]}]", m.node("scale"))


@rms_norm.rewrite
def _(m, b):
    x = m.value("x")
    eps = float(np.asarray(m.const("norm.eps")).reshape(-1)[0])
    return b.op("RMSNormalization", [m["x"], m["weight"]], axis=-1, epsilon=eps, dtype=x.dtype, shape=x.shape)


class RMSNormFusion(Plugin):
    name = "rmsnorm-fusion"
    short = "rmsnorm"
    description = "Fuse Pow/ReduceMean/Add/Sqrt/Div/Mul RMSNorm subgraphs into ONNX RMSNormalization (opset 23)"
    backends = ("ort",)
    opset_range = (23, 28)

    @property
    def rules(self):
        return [rms_norm]

    @property
    def cases(self):
        from rewrite_rmsnorm.cases import cases

        return cases()


@hookimpl
def rewrite_plugins():
    return [RMSNormFusion()]
