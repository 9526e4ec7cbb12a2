"""``rope``: rotary position embedding, with the per-head RMSNorm before it, becomes one ``ai.rewrite::RotaryEmbedding``.

Matches ``Add(Mul(X, cos), Mul(Concat(Neg(X2), X1, axis=-1), sin))`` where X1 and X2 are the halves of X along its
last axis (``Split`` into two, or two ``Slice`` ops at D/2): transformers' ``apply_rotary_pos_emb`` as its exporters
and the seed form write it (seed 000 "Rotary Position Embeddings"). When X is ``Transpose(perm=[0, 2, 1, 3])`` of
an RMSNorm over the head size (Qwen3's ``q_norm`` and ``k_norm``: ``[Cast(float32)] -> Pow(2) -> ReduceMean(-1) ->
Add(eps) -> Sqrt -> Div (or Reciprocal and Mul) -> [Cast back] -> Mul(weight [D])``, in float32), the norm joins
the op (the norm is per row of D, so it commutes with the Transpose, which moves before it). X [B, H, T, D] and cos,
sin [1 or B, 1, 1 or T, D] of one float type. The contract and the lowerings: :mod:`rewrite.plugins.rope.op`.

Why: iree-compile 3.13 runs each of these as several dispatches (the rotation's Split/Neg/Concat, the products;
the norm's cast, reduction and scaling): 4 launches per layer for Qwen1.5-MoE's Q and K, 8 for Qwen3-30B-A3B's,
where a decode step is bound by launches (BENCHMARKS.md, "Full-size decode on the H200"). Runs after ``cast``,
before ``legalize`` and ``kv`` (whose cache writes read the rotated keys). For IREE cuda, ``rotary-embedding-pair``
then makes each layer's Q and K rotation one op (:mod:`rewrite.plugins.rope.pair`), which the ``attention`` plugin
then takes into the layer's attention kernel where it can (:mod:`rewrite.plugins.attention.rotary`).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.ir import dtype_name
from rewrite.core.pattern import AttrVar, Const, Or
from rewrite.core.rules import rule
from rewrite.plugins.base import KernelObject, Plugin
from rewrite.plugins.rmsnorm.pattern import norm_refusal, rms_norm
from rewrite.plugins.rope.op import CUDA_HEAD_SIZES, RotaryEmbedding, check_shapes
from rewrite.plugins.rope.pair import pair_rotary_embeddings

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)
_INT64_MAX = np.iinfo(np.int64).max


def _cuda(m) -> bool:
    """The run lowers for IREE cuda."""
    return m.ctx is not None and (m.ctx.backend, m.ctx.target) == ("iree", "cuda")


@rule("rotary-embedding")
def rotary_embedding(op, x0, cos, sin):
    """``X * cos + rotate_half(X) * sin`` [after Transpose(RMSNorm(X0))] -> RotaryEmbedding(X, cos, sin[, weight])."""
    x = Or([op.Transpose(rms_norm(op, x0), perm=[0, 2, 1, 3], _name="norm_transpose"), x0])
    split = op.Split(x, axis=AttrVar("split_axis"), _outputs=2, _allow_other_inputs=True, _name="split")
    lo = Or([split[0], op.Slice(x, Const("lo_starts"), Const("lo_ends"), Const("lo_axes"), _allow_other_inputs=True, _name="lo")])
    hi = Or([split[1], op.Slice(x, Const("hi_starts"), Const("hi_ends"), Const("hi_axes"), _allow_other_inputs=True, _name="hi")])
    rot = op.Concat(op.Neg(hi, _name="neg"), lo, axis=AttrVar("concat_axis"), _name="concat")
    return op.Add(op.Mul(x, cos, _name="mul_cos"), op.Mul(rot, sin, _name="mul_sin"), _name="add")


def _last(axis: int, rank: int = 4) -> bool:
    return axis in (-1, rank - 1)


def _halves(m, d: int):
    """None when X's halves are [0, D/2) and [D/2, D) of the last axis (Split in two equal parts, or two Slices of
    step 1), else the refusal."""
    if "split" in m and ("lo" in m or "hi" in m):
        return m.fail("one half from the Split, the other from a Slice", m.node("split"))
    if "split" in m:
        node = m.node("split")
        given = len(node.inputs) > 1 and node.inputs[1]
        sizes = m.graph.const(node.inputs[1]) if given else None
        if given and sizes is None:
            return m.fail(f"the Split's sizes '{node.inputs[1]}' are not a constant", node)
        parts = node.attr("num_outputs")
        if not _last(m.attr("split_axis")) or (sizes is not None and list(np.asarray(sizes).ravel()) != [d // 2, d // 2]) \
                or (sizes is None and parts not in (None, 2)):
            return m.fail(f"the Split along axis {m.attr('split_axis')} is not two halves of the last axis", node)
        return None
    for tag, (start, end) in (("lo", (0, d // 2)), ("hi", (d // 2, d))):
        node = m.node(tag)
        given = len(node.inputs) > 4 and node.inputs[4]
        steps = m.graph.const(node.inputs[4]) if given else None
        if given and steps is None:
            return m.fail(f"the Slice's steps '{node.inputs[4]}' are not a constant", node)
        got = [np.asarray(m.const(f"{tag}_{k}")).ravel() for k in ("starts", "ends", "axes")]
        if any(g.size != 1 for g in got) or (steps is not None and list(np.asarray(steps).ravel()) != [1]):
            return m.fail(f"the Slice '{node.name}' takes more than one axis or a step", node)
        s, e, a = (int(g[0]) for g in got)
        e = d if e >= d or e == _INT64_MAX else e
        if not _last(a) or (s, e) != (start, end):
            return m.fail(f"the Slice '{node.name}' takes [{s}, {e}) of axis {a}; [{start}, {end}) of the last axis expected", node)
    return None


@rotary_embedding.check
def _(m):
    x0, cos, sin = m.value("x0"), m.value("cos"), m.value("sin")
    add = m.node("add")
    x = m.graph.values[m.node("norm_transpose").outputs[0]] if "norm_transpose" in m else x0
    if x.dtype not in _FLOATS or cos.dtype != x.dtype or sin.dtype != x.dtype:
        return m.fail(f"X {dtype_name(x.dtype)}, cos {dtype_name(cos.dtype)}, sin {dtype_name(sin.dtype)}: one of float32 "
                      "or float16 expected", add)
    if x.shape is None or cos.shape is None or sin.shape is None:
        return m.fail("X, cos or sin has no inferred shape", add)
    try:
        _, h, _, d = check_shapes(x.shape, cos.shape, sin.shape, None, f"RoPE at {add.name}")
    except ValueError as e:
        return m.fail(str(e), add)
    if not isinstance(h, int):
        return m.fail(f"X {x.shape}: the head count must be static", add)
    y = m.graph.values[m.outputs[0]].shape
    if y is None or len(y) != 4 or any(isinstance(a, int) and isinstance(c, int) and a != c for a, c in zip(y, x.shape)):
        return m.fail(f"the sum has shape {y}, not X's {x.shape} (cos or sin broadcast it)", add)
    if not _last(m.attr("concat_axis")):
        return m.fail(f"the Concat is along axis {m.attr('concat_axis')}, not the last", m.node("concat"))
    bad = _halves(m, d)
    if bad is not None:
        return bad
    if "norm_transpose" in m:
        bad = norm_refusal(m, x0, 3)
        if bad is not None:
            return bad
    if _cuda(m) and d not in CUDA_HEAD_SIZES:
        return m.fail(f"head size {d}: the CUDA kernel is built for {CUDA_HEAD_SIZES}", add)


@rotary_embedding.rewrite
def _(m, b):
    out = m.graph.values[m.outputs[0]]
    if "norm_transpose" not in m:
        return b.op("RotaryEmbedding", [m["x0"], m["cos"], m["sin"]], domain=DOMAIN, dtype=out.dtype, shape=out.shape)
    # the norm is per row of D: the Transpose moves before it, the norm joins the op
    x0 = m.value("x0")
    shape = [x0.shape[i] for i in (0, 2, 1, 3)]
    xt = b.op("Transpose", [m["x0"]], perm=[0, 2, 1, 3], dtype=x0.dtype, shape=shape)
    eps = float(np.asarray(m.const("eps")).reshape(-1)[0])
    return b.op("RotaryEmbedding", [xt, m["cos"], m["sin"], m["weight"]], domain=DOMAIN, norm_epsilon=eps,
                dtype=out.dtype, shape=out.shape)


class Rope(Plugin):
    name = "rotary-embedding"
    short = "rope"
    takes_options = False
    # cast drops Cast pairs first; legalize rewrites for IREE what is left (its Split/Slice forms among it); kv's
    # cache writes take the rotated keys as they are
    runs_after = ("cast",)
    runs_before = ("legalize", "kv")
    description = "Rotary position embedding (and the per-head RMSNorm before it) -> RotaryEmbedding"
    opset_range = (13, 28)
    kernels = (KernelObject("rotary_embedding_f32/f16_d32..256, rotary_embedding2_f32/f16_d32..256", "iree", "cuda",
                            "kernels/rope_cuda.cu"),)

    @property
    def rules(self):
        return [rotary_embedding]

    def run(self, graph, report, ctx=None, *, dry_run=False):
        """The rule, then for IREE cuda :func:`pair_rotary_embeddings` (a layer's Q and K in one op)."""
        super().run(graph, report, ctx, dry_run=dry_run)
        if ctx is not None and (ctx.backend, ctx.target) == ("iree", "cuda"):
            pair_rotary_embeddings(graph, report, dry_run=dry_run)

    @property
    def abstract_ops(self):
        return [RotaryEmbedding()]

    @property
    def cases(self):
        from rewrite.plugins.rope.cases import rope_cases

        return rope_cases()
