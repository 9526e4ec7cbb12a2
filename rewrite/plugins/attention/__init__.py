"""``attention``: the attention core of each layer becomes one ``ai.rewrite::GroupedAttention``.

Matches ``MatMul(Softmax(Add(Mul(MatMul(Q, Transpose(K', perm=[0, 1, 3, 2])), scale), mask), axis=-1), V')``
(the Add when there is a mask, the Mul when the scale is not 1, the ``Cast(float32) -> Cast(back)`` pair after the
Softmax of fp16 exports optional), or with the scores as torch's ``scaled_dot_product_attention`` decomposes them
(transformers' default attention): ``MatMul(Mul(Q, sqrt(scale)), Mul(Reshape(Transpose(Reshape(K', [N, S, D]),
[0, 2, 1]), [B, H, D, S]), sqrt(scale)))``, the scale then the product of the two constants (float32 only: in
float16 the unscaled product could overflow where the scaled operands do not; and with
``torch.onnx.export(dynamo=True)``, ``Where(IsNaN(P), 0, P)`` after the Softmax: attribute ``nan_rows_zero``; not
on IREE cuda, whose kernel lacks it), where ``K'`` and ``V'`` are the K/V heads repeated per query group,
``Reshape(Expand(Unsqueeze(K, 2), [B, Hkv, G, S, D]), [B, Hq, S, D])`` (transformers' ``repeat_kv``; seed 000
"2. Self-Attention"), or K and V themselves (Hq = Hkv). Q, K, V [B, H, ., D] f32 or f16, a scalar ``scale``.
The contract and the lowerings: :mod:`rewrite.plugins.attention.op`.

A second rule, ``attention-reads-loaded-cache`` (``--backend iree --target cuda`` only), takes a GroupedAttention whose K and V
are ``kv``'s ``KVCacheUpdate(past, rows, position)`` and gives it ``past`` with the rows apart (inputs ``K_new``,
``V_new``, ``position``; the written caches read by nothing else but graph outputs), moving the two cache writes
after every other node: each attention then reads the cache
as the step loaded it, and iree-compile, with every write after every read, writes the state in place instead of
copying a cache slice per attention (with iree-compile's own RoPE fused into the write, the write would still run
early: the stateful writes keep their rows' producer apart, ``rewrite.backends.iree_stateful``).

A third, ``attention-absorbs-rope`` (IREE cuda only, :mod:`rewrite.plugins.attention.rotary`), gives the
attention its layer's RoPE pair: the kernel rotates Q and the new K rows itself, one launch fewer per layer
(``--opt attention.rope=false`` keeps them apart).

Why: IREE's own lowering materializes the repeated K and V of every layer (Qwen3-30B-A3B: 0.58 ms of a 4.72 ms
decode step on an H200, in 96 launches) and runs the scores, softmax and product as separate dispatches; the CUDA
kernel reads each K/V head once for its query group. Runs after ``kv`` (whose static cache the K and V are) and
``cast``, before ``legalize``.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.ir import dtype_name
from rewrite.core.pattern import AttrVar, Const, Or, Var
from rewrite.core.rules import rule
from rewrite.errors import RewriteError
from rewrite.plugins.attention.op import CUDA_HEAD_SIZES, GroupedAttention, check_shapes
from rewrite.plugins.attention.rotary import absorb_rotary
from rewrite.plugins.base import KernelObject, Plugin

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)


def _cuda(m) -> bool:
    """The run lowers for IREE cuda (whose kernel lacks some forms the rule takes)."""
    return m.ctx is not None and (m.ctx.backend, m.ctx.target) == ("iree", "cuda")


def _repeated(op, cache, tag: str):
    """``cache`` [B, Hkv, S, D] with each head repeated G times, [B, Hkv * G, S, D], or ``cache`` itself."""
    grouped = op.Expand(op.Unsqueeze(cache, Const(f"{tag}_axes", value=[2])), Var(f"{tag}_grouped"), _name=f"{tag}_expand")
    return Or([op.Reshape(grouped, Var(f"{tag}_shape"), _name=f"{tag}_repeat"), cache])


@rule("grouped-attention")
def grouped_attention(op, q, k, v, mask):
    """Scores, scale, mask, Softmax and the product with V -> GroupedAttention(Q, K, V, mask)."""
    keys = _repeated(op, k, "k")
    # torch's scaled_dot_product_attention as the exporters decompose it (transformers' default attention):
    # Q and K^T each times sqrt(scale), K^T a Transpose of K' viewed as [B * H, S, D]
    kt3 = op.Reshape(op.Transpose(op.Reshape(keys, Var("k3_shape"), _name="k3"), perm=[0, 2, 1], _name="k3t"),
                     Var("kt_shape"), _name="kt")
    sdpa = op.MatMul(op.Mul(q, Const("q_scale"), _name="q_mul"), op.Mul(kt3, Const("k_scale"), _name="k_mul"), _name="qk")
    scores = Or([op.MatMul(q, op.Transpose(keys, perm=[0, 1, 3, 2]), _name="qk"), sdpa])
    scaled = Or([op.Mul(scores, Const("scale"), _name="scale_mul"), scores])  # no Mul: a scale of 1 (GraniteMoE's multiplier)
    masked = Or([op.Add(scaled, mask, _name="mask_add"), scaled])
    probs = op.Softmax(masked, axis=AttrVar("axis", default=-1), _name="softmax")
    probs = Or([op.Cast(op.Cast(probs, to=TensorProto.FLOAT, _name="wide"), to=AttrVar("narrow"), _name="narrow"), probs])
    # dynamo=True's decomposition of scaled_dot_product_attention zeroes NaN probabilities
    probs = Or([op.Where(op.IsNaN(probs, _name="isnan"), Const("nan_zero"), probs, _name="nan_guard"), probs])
    return op.MatMul(probs, _repeated(op, v, "v"), _name="pv")


def _group(m, tag: str, cache: list) -> int | str:
    """G for the repeat of ``tag`` (1 when the cache is read as it is), or a refusal: the Unsqueeze at 2, the
    Expand to [B, Hkv, G, S, D] and the Reshape to [B, Hkv * G, S, D] as their inferred shapes say."""
    if f"{tag}_repeat" not in m:
        return 1
    ex, rep = m.node(f"{tag}_expand"), m.node(f"{tag}_repeat")
    five, four = m.graph.values[ex.outputs[0]].shape, m.graph.values[rep.outputs[0]].shape
    if five is None or four is None or len(five) != 5 or len(four) != 4 or not isinstance(five[2], int):
        return m.fail(f"the repeat of {tag} has shapes {five} -> {four}; [B, Hkv, G, S, D] -> [B, Hkv * G, S, D] expected", ex)
    g = five[2]
    want5 = [cache[0], cache[1], g, cache[2], cache[3]]
    hq = cache[1] * g if isinstance(cache[1], int) else None
    if list(five) != want5 or list(four) != [cache[0], hq, cache[2], cache[3]]:
        return m.fail(f"the repeat of {tag} {cache} goes through {list(five)} to {list(four)}; expected {want5} and "
                      f"{[cache[0], hq, cache[2], cache[3]]}", rep)
    return g


def _transposed_view(m, keys: list):
    """None when ``Reshape(Transpose(Reshape(K', [N, S, D]), [0, 2, 1]), [B, H, D, S])`` is K' [B, H, S, D]
    transposed over its last two axes (the inferred shapes say so: the leading dims are merged and split back
    in row-major order), else the refusal."""
    three = m.graph.values[m.node("k3").outputs[0]].shape
    four = m.graph.values[m.node("kt").outputs[0]].shape
    if three is None or four is None or len(three) != 3 or len(keys) != 4 or list(three[1:]) != keys[2:] \
            or list(four) != [keys[0], keys[1], keys[3], keys[2]] or None in keys[1:]:
        return m.fail(f"the keys {keys} go through {three} to {four}; [N, S, D] and [B, H, D, S] expected", m.node("kt"))
    return None


@grouped_attention.check
def _(m):
    q, k, v = m.value("q"), m.value("k"), m.value("v")
    mask = m.value("mask") if "mask" in m else None
    qk = m.node("qk")
    if q.dtype not in _FLOATS or any(x.dtype != q.dtype for x in (k, v, mask) if x is not None):
        types = ", ".join(f"{n} {dtype_name(x.dtype)}" for n, x in (("Q", q), ("K", k), ("V", v), ("mask", mask)) if x is not None)
        return m.fail(f"{types}: one of float32 or float16 expected", qk)
    if "narrow" in m and m.attr("narrow") != q.dtype:
        return m.fail(f"the Cast pair after the Softmax ends in {dtype_name(m.attr('narrow'))}, not {dtype_name(q.dtype)}", m.node("narrow"))
    if any(x.shape is None or len(x.shape) != 4 for x in (q, k, v)):
        return m.fail(f"Q {q.shape}, K {k.shape}, V {v.shape}: rank 4 [B, H, ., D] expected", qk)
    if m.attr("axis") not in (-1, 3):
        return m.fail(f"Softmax over axis {m.attr('axis')}, not the key positions (-1)", m.node("softmax"))
    for name, node in (("scale", "scale_mul"), ("q_scale", "q_mul"), ("k_scale", "k_mul")):
        if node in m and (m.const(name) is None or m.const(name).size != 1):
            return m.fail(f"scale '{m[name]}' is not a scalar", m.node(node))
    if "nan_guard" in m:
        zero = m.const("nan_zero")
        if zero is None or zero.size != 1 or float(np.asarray(zero).reshape(-1)[0]) != 0.0:
            return m.fail(f"the Where after IsNaN sets '{m['nan_zero']}', not 0", m.node("nan_guard"))
        if _cuda(m):
            return m.fail("the NaN guard after the Softmax: the CUDA kernel does not zero NaN rows", m.node("nan_guard"))
    if "kt" in m:
        if q.dtype != TensorProto.FLOAT:
            # Q and K^T each scaled, then multiplied: one scale after the product would round the unscaled
            # product to the type first, which can overflow float16 where the original does not
            return m.fail(f"scores of {dtype_name(q.dtype)} Q and K^T each scaled before the MatMul: only float32 "
                          "folds the two scales into one", qk)
        keys = k.shape if "k_repeat" not in m else m.graph.values[m.node("k_repeat").outputs[0]].shape
        if keys is None:
            return m.fail("the repeated keys have no inferred shape", m.node("k_repeat"))
        bad = _transposed_view(m, list(keys))
        if bad is not None:
            return bad
    gk, gv = _group(m, "k", list(k.shape)), _group(m, "v", list(v.shape))
    if not isinstance(gk, int):
        return gk
    if not isinstance(gv, int):
        return gv
    if gk != gv or not isinstance(q.shape[1], int) or not isinstance(k.shape[1], int) or q.shape[1] != k.shape[1] * gk:
        return m.fail(f"Q {q.shape} with K {k.shape} repeated {gk} times and V {v.shape} {gv} times: query heads must be "
                      "the K/V heads times one group", qk)
    try:
        check_shapes(q.shape, k.shape, v.shape, None if mask is None else mask.shape, f"attention at {qk.name}")
    except ValueError as e:
        return m.fail(str(e), qk)
    if q.shape[3] is None:
        return m.fail(f"Q {q.shape}: the head size must be static", qk)
    if _cuda(m) and q.shape[3] not in CUDA_HEAD_SIZES:
        return m.fail(f"head size {q.shape[3]}: the CUDA kernel is built for {CUDA_HEAD_SIZES}", qk)


@grouped_attention.rewrite
def _(m, b):
    out = m.graph.values[m.outputs[0]]
    ins = [m["q"], m["k"], m["v"]] + ([m["mask"]] if "mask" in m else [])
    scale = 1.0
    for name, node in (("scale", "scale_mul"), ("q_scale", "q_mul"), ("k_scale", "k_mul")):
        if node in m:
            scale *= float(np.asarray(m.const(name)).reshape(-1)[0])
    guard = {"nan_rows_zero": 1} if "nan_guard" in m else {}
    return b.op("GroupedAttention", ins, domain=DOMAIN, scale=scale, **guard, dtype=out.dtype, shape=out.shape)


@rule("attention-reads-loaded-cache")
def reads_loaded_cache(op, q, k_past, k_rows, v_past, v_rows, position):
    """GroupedAttention over KVCacheUpdate(past, rows, position) -> GroupedAttention(Q, past, ..., rows, position)."""
    keys = op.KVCacheUpdate(k_past, k_rows, position, _domain=DOMAIN, axis=AttrVar("k_axis"), _name="k_write")
    values = op.KVCacheUpdate(v_past, v_rows, position, _domain=DOMAIN, axis=AttrVar("v_axis"), _name="v_write")
    return op.GroupedAttention(q, keys, values, _domain=DOMAIN, _allow_other_inputs=True, _name="attn")


@reads_loaded_cache.check
def _(m):
    attn = m.node("attn")
    if m.ctx is None or (m.ctx.backend, m.ctx.target) != ("iree", "cuda"):
        # ONNX Runtime writes a copy of the cache either way, and the llvm-cpu lowering inserts the rows into a copy:
        # reading the written cache costs nothing more there
        return m.fail("the cache as loaded plus the new rows pays on IREE cuda only (its kernel reads the rows apart; "
                      "the writes then happen in place)", attn)
    if len(attn.inputs) > 4:
        return m.fail("the attention already reads the cache as loaded", attn)
    for name in ("k_write", "v_write"):
        present = m.node(name).outputs[0]
        others = [c for c in m.graph.consumers(present) if c.op_type != "GroupedAttention"]
        if others:
            # a write another node reads cannot be the step's last op: it would stay early, and the gain with it
            return m.fail(f"the written cache '{present}' is also read by {others[0].describe()}", m.node(name))
    past = m.value("k_past")
    rank = len(past.shape) if past.shape is not None else 0
    if rank != 4 or m.attr("k_axis") % 4 != 2 or m.attr("v_axis") % 4 != 2:
        return m.fail(f"cache writes along axes {m.attr('k_axis')} and {m.attr('v_axis')} of rank {rank}: the "
                      "positions axis 2 of [B, Hkv, S, D] expected", m.node("k_write"))


@reads_loaded_cache.rewrite
def _(m, b):
    attn = m.node("attn")
    out = m.graph.values[m.outputs[0]]
    mask = attn.inputs[3] if len(attn.inputs) > 3 else ""
    ins = [m["q"], m["k_past"], m["v_past"], mask, m["k_rows"], m["v_rows"], m["position"]]
    # the cache writes after every other node: iree-compile then writes the state in place once the step's reads
    # are done, instead of copying the cache slice each attention reads (BENCHMARKS.md, the stream census)
    last = max(n.order for n in m.graph.nodes.values())
    for name in ("k_write", "v_write"):
        m.node(name).order = last + 1 + m.node(name).order * 1e-9
    guard = {"nan_rows_zero": attn.attr("nan_rows_zero")} if "nan_rows_zero" in attn.attrs else {}
    return b.op("GroupedAttention", ins, domain=DOMAIN, scale=attn.attr("scale"), **guard, dtype=out.dtype, shape=out.shape)


class Attention(Plugin):
    name = "grouped-attention"
    short = "attention"
    # kv makes the static cache the K and V are read from; cast drops the Softmax's Cast pair; legalize rewrites
    # for IREE what is left
    runs_after = ("kv", "cast")
    runs_before = ("legalize",)
    description = "Attention core (QK^T, scale, mask, Softmax, PV; grouped K/V heads) -> GroupedAttention"
    opset_range = (13, 28)
    kernels = (KernelObject("grouped_attention[_rope]_f32/f16_d32..256", "iree", "cuda", "kernels/attention_cuda.cu"),)

    @property
    def rules(self):
        return [grouped_attention, reads_loaded_cache]

    def run(self, graph, report, ctx=None, *, dry_run=False):
        """The rules, then for IREE cuda :func:`absorb_rotary` (a layer's RoPE pair into its attention) unless the
        option ``rope`` is false.

        Raises:
            RewriteError: an unknown option, or ``rope`` not a boolean."""
        opts = dict(((getattr(ctx, "options", None) or {}).get(self.short) or {}))
        unknown = sorted(set(opts) - {"rope"})
        if unknown:
            raise RewriteError(f"attention: unknown option '{unknown[0]}'; options: rope")
        if not isinstance(opts.get("rope", True), bool):
            raise RewriteError(f"attention: option rope={opts['rope']!r}; true or false expected")
        super().run(graph, report, ctx, dry_run=dry_run)
        if ctx is not None and (ctx.backend, ctx.target) == ("iree", "cuda") and opts.get("rope", True):
            absorb_rotary(graph, report, dry_run=dry_run)

    @property
    def abstract_ops(self):
        return [GroupedAttention()]

    @property
    def cases(self):
        from rewrite.plugins.attention.cases import attention_cases

        return attention_cases()
