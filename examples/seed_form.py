"""The seed's static-cache ONNX form of a Qwen1.5-MoE-style decoder, built op by op.

The seed document (the Qwen1.5-MoE bring-up log, see ``docs/sources.md``) documents, in its "IR Guide" sections,
the ONNX graph its exporter produced for Qwen1.5-MoE-A2.7B INT4, and in items A1-A6 the
problems that graph raises for IREE.  This module rebuilds that graph form directly with
``onnx.helper`` (opset 21, IR version 10) at toy sizes, with random weights, so that graph
rewrites can be tested on exactly those patterns:

* A1  ``DequantizeLinear(block_size=128, axis=2)`` on UINT4 codes and UINT4 zero points,
      gathered per token *before* dequantization (gather-then-compute); the down
      projection's K = ``moe_intermediate`` (192 by default) ends in a partial block.
* A2  ``ReduceMean`` with ``axes`` as a constant input (opset-18 form).
* A4  the KV-cache index ``Expand`` whose shape comes through
      ``Where(Equal(Concat(...), -1), ones, Concat(...))`` so that ONNX shape inference
      cannot give it a static shape.
* A5  ``ScatterElements(past, Expand(Reshape(Cast(Add(seq_position, Range)))), update, axis=2)``.
* A6  the ``Cast(f16->f32) -> Cast(f32->f16)`` round trip after the attention Softmax and
      the router's ``Softmax -> Cast(f32) -> TopK``.

Dtype policy: every Cast the seed shows that changes a dtype (RMSNorm's f16<->f32, RoPE's
f32->f16, the Softmax round trip, the router's f16->f32 before TopK and the routing weights
back to f16) is emitted only in the ``fp16`` variant, where it changes the type; the ``fp32``
variant has none of them (an f32->f32 Cast is what an fp32 torch export does not emit, and a
round trip through another type would be a different pattern).  The one Cast kept in both is
the ``Cast(to=INT64)`` of the KV-cache position chain: A5's pattern names it.

Conventions: dense weights are stored ``[in, out]`` and used as ``MatMul(x, W)`` as in the seed;
stacked expert weights are ``[E, out, in]`` (the seed's ``[60, 2048, 1408]`` down projection)
and transposed after dequantization.  Expert codes are stored one code per byte as UINT8 (the
seed's ``ui8``) because ONNX ``Gather`` does not accept UINT4 in any opset; each gathered code
and zero-point tensor is then ``Cast`` to UINT4, so ``DequantizeLinear`` sees UINT4 inputs.

``arch="qwen3_moe"`` builds the same form for Qwen3-MoE (the seed's Qwen3-30B-A3B section: GQA, RMSNorm of each
query and key head before RoPE, no q/k/v bias, no shared expert, top-k weights renormalized to sum 1).

At the real sizes (``FULL``: Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B) :func:`export_seeded` writes the graph with its
weights as external data drawn tensor by tensor from ``examples/seeded_weights.py``'s counter-based generator,
the experts directly as INT4 codes, scales and zero points (never as floats); ``seeded_weights.py regenerate``
rebuilds the same data file from the graph on another machine.

API::

    model, weights = build_seed_model("fp16")        # weights: SeedWeights (config + float tensors)
    model, weights = build_seed_model("fp32", arch="qwen3_moe")
    save_seed_model(model, "out/seed_fp16.onnx")
    logits, presents = seed_reference(weights, input_ids, seq_position, past)   # PyTorch
    report = check_seed_model(model, weights)         # ORT vs reference, prefill + greedy decode

CLI: ``python examples/seed_form.py --dtype fp16 --out out/seed_fp16.onnx`` prints a JSON report;
``python examples/seed_form.py --arch qwen3_moe --size full --out out/qwen3_seed`` writes ``model.onnx`` and its
seeded ``model.onnx.data`` (32.7 GB) into that folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).parent))
import seeded_weights  # noqa: E402

OPSET = 21
IR_VERSION = 10
ROPE_THETA = 1_000_000.0  # Qwen1.5-MoE rope_theta
RMS_EPS = 1e-6  # Qwen1.5-MoE rms_norm_eps
UINT4_MAX = 15

_DTYPES = {
    "fp32": (np.float32, TensorProto.FLOAT, torch.float32),
    "fp16": (np.float16, TensorProto.FLOAT16, torch.float16),
}


@dataclass(frozen=True)
class SeedConfig:
    """Sizes and variant of the model; ``dtype`` is ``"fp32"`` or ``"fp16"`` (activations and float weights).

    ``qk_norm``: RMSNorm (weight ``[head_dim]``) of every query and key head before RoPE (Qwen3); ``attn_bias``:
    q/k/v projections with biases (Qwen1.5-MoE); ``norm_topk``: the top-k weights divided by their sum (Qwen3's
    ``norm_topk_prob``); ``shared_intermediate`` 0: no shared expert (Qwen3). ``router_std``: the std of the seeded
    router weights (`export_seeded`; ``seeded_weights`` module docstring).
    """

    dtype: str = "fp32"
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 64
    experts: int = 8
    top_k: int = 4
    moe_intermediate: int = 192
    shared_intermediate: int = 256
    vocab: int = 512
    max_seq: int = 64
    block_size: int = 128
    qk_norm: bool = False
    attn_bias: bool = True
    norm_topk: bool = False
    router_std: float = seeded_weights.ROUTER_STD

    @property
    def np_dtype(self) -> type:
        return _DTYPES[self.dtype][0]

    @property
    def onnx_dtype(self) -> int:
        return _DTYPES[self.dtype][1]

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype][2]

    @property
    def is_fp16(self) -> bool:
        return self.dtype == "fp16"

    @property
    def kv_shape(self) -> list[int]:
        """Shape of every ``past_*`` / ``present_*`` tensor: ``[1, kv_heads, max_seq, head_dim]``."""
        return [1, self.kv_heads, self.max_seq, self.head_dim]


#: the variants (``build_seed_model(arch=...)``): a config's fields; sizes not named keep the toy defaults
ARCHS: dict[str, dict] = {
    "qwen2_moe": {},  # Qwen1.5-MoE: the seed's form as documented
    "qwen3_moe": dict(kv_heads=2, experts=16, top_k=8, shared_intermediate=0, qk_norm=True, attn_bias=False,
                      norm_topk=True),
}

FULL_ROUTER_STD = seeded_weights.FULL_ROUTER_STD  #: the full-size routers' std (seeded_weights says why)
#: the real configurations (Hugging Face config.json of Qwen/Qwen1.5-MoE-A2.7B and Qwen/Qwen3-30B-A3B), static
#: cache of 256 positions
FULL: dict[str, dict] = {
    "qwen2_moe": dict(hidden=2048, layers=24, heads=16, kv_heads=16, head_dim=128, experts=60, top_k=4,
                      moe_intermediate=1408, shared_intermediate=5632, vocab=151936, max_seq=256,
                      router_std=FULL_ROUTER_STD),
    "qwen3_moe": dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8,
                      moe_intermediate=768, shared_intermediate=0, vocab=151936, max_seq=256,
                      router_std=FULL_ROUTER_STD),
}


def seed_config(dtype: str = "fp32", arch: str = "qwen2_moe", **overrides) -> SeedConfig:
    """The config of ``arch`` (`ARCHS`) with ``overrides`` (any `SeedConfig` field).

    Raises:
        ValueError: an unknown arch or dtype, heads not a multiple of kv_heads, or an odd head_dim.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch '{arch}' is not one of {', '.join(ARCHS)}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype '{dtype}' is not one of {', '.join(_DTYPES)}")
    cfg = SeedConfig(dtype, **{**ARCHS[arch], **overrides})
    if cfg.heads % cfg.kv_heads or cfg.head_dim % 2:
        raise ValueError("heads must be a multiple of kv_heads and head_dim even")
    return cfg


@dataclass
class SeedWeights:
    """The weights a :func:`seed_reference` run needs.

    ``tensors`` maps initializer-style names to arrays in the model dtype, except
    ``rope.inv_freq`` (float32 ``[head_dim/2]``).  The routed experts appear *dequantized*:
    ``layers.{i}.mlp.experts.{gate,up,down}_proj.weight`` ``[E, out, in]`` equal, bit for bit,
    what the graph's ``DequantizeLinear`` computes from the stored UINT4 codes.
    """

    config: SeedConfig
    tensors: dict[str, np.ndarray]


# --------------------------------------------------------------------------- quantization


def quantize_uint4_blockwise(
    w: np.ndarray, block_size: int, scale_dtype: type
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric round-to-nearest UINT4 quantization in blocks along the last axis.

    ``w`` ``[..., K]`` float -> ``codes`` uint8 ``[..., K]`` (values 0..15), ``scales``
    ``scale_dtype`` ``[..., ceil(K / block_size)]`` and ``zero_points`` uint8 (0..15) of the
    same shape; the last block may be partial.  Each block's range is widened to contain 0
    so its zero point is representable.  The scale is rounded to ``scale_dtype`` before the
    codes are computed, so the codes are optimal for the scale the graph actually holds.
    """
    n_blocks = math.ceil(w.shape[-1] / block_size)
    codes = np.empty(w.shape, np.uint8)
    scales = np.empty((*w.shape[:-1], n_blocks), scale_dtype)
    zero_points = np.empty((*w.shape[:-1], n_blocks), np.uint8)
    for b in range(n_blocks):
        block = w[..., b * block_size : (b + 1) * block_size].astype(np.float32)
        lo = np.minimum(block.min(-1), 0.0)
        hi = np.maximum(block.max(-1), 0.0)
        scale = ((hi - lo) / UINT4_MAX).astype(scale_dtype).astype(np.float32)
        scale = np.where(scale > 0, scale, 1.0)
        zp = np.clip(np.round(-lo / scale), 0, UINT4_MAX)
        q = np.clip(np.round(block / scale[..., None]) + zp[..., None], 0, UINT4_MAX)
        codes[..., b * block_size : (b + 1) * block_size] = q
        scales[..., b] = scale
        zero_points[..., b] = zp
    return codes, scales, zero_points


def dequantize_uint4_blockwise(
    codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, block_size: int
) -> np.ndarray:
    """``DequantizeLinear(codes, scales, zero_points, axis=-1, block_size)`` in numpy.

    ``(code - zero_point) * scale`` with scale and zero point repeated ``block_size`` times
    along the last axis and cut to K; returned in ``scales.dtype``.  The product is exact in
    float32 (a 5-bit integer times an f16/f32 scale), so the one rounding to ``scales.dtype``
    matches ONNX Runtime's kernel.
    """
    k = codes.shape[-1]
    zp = np.repeat(zero_points.astype(np.float32), block_size, axis=-1)[..., :k]
    scale = np.repeat(scales.astype(np.float32), block_size, axis=-1)[..., :k]
    return ((codes.astype(np.float32) - zp) * scale).astype(scales.dtype)


# --------------------------------------------------------------------------- weights


def _random_weights(cfg: SeedConfig, seed: int) -> dict[str, np.ndarray]:
    """Float32 weights scaled so activations stay O(1).

    Projections have std 1/sqrt(fan_in); the router has std 0.5 so its logits (std ~8) make
    the top-k choice decisive and robust to f16 rounding.
    """
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w = {}
    for name, shape, _ in weight_specs(cfg):
        fan_in = shape[0] if len(shape) == 2 else shape[-1]  # dense [in, out]; experts [E, out, in]
        if name == "embed_tokens.weight":
            w[name] = normal(shape, 1.0)
        elif name.endswith("norm.weight"):
            w[name] = 1.0 + normal(shape, 0.1)
        elif name.endswith("_proj.bias"):
            w[name] = normal(shape, 0.1)
        elif name.endswith("mlp.gate.weight"):
            w[name] = normal(shape, 0.5)
        else:
            w[name] = normal(shape, fan_in**-0.5)
    return w


def weight_specs(cfg: SeedConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """Every weight of the model as ``(name, shape, kind)``, in one fixed order: ``kind`` ``"float"`` (stored in the
    model dtype; dense weights ``[in, out]``) or ``"experts"`` (a stack ``[E, out, in]`` stored as INT4 codes, scales
    and zero points: ``{name without .weight}.qweight`` / ``.scales`` / ``.zero_points``)."""
    h, d, e, mi, si = cfg.hidden, cfg.head_dim, cfg.experts, cfg.moe_intermediate, cfg.shared_intermediate
    specs = [("embed_tokens.weight", (cfg.vocab, h), "float")]
    for i in range(cfg.layers):
        p = f"layers.{i}"
        specs.append((f"{p}.input_layernorm.weight", (h,), "float"))
        for name, n_heads in (("q", cfg.heads), ("k", cfg.kv_heads), ("v", cfg.kv_heads)):
            specs.append((f"{p}.self_attn.{name}_proj.weight", (h, n_heads * d), "float"))
            if cfg.attn_bias:
                specs.append((f"{p}.self_attn.{name}_proj.bias", (n_heads * d,), "float"))
        if cfg.qk_norm:
            specs += [(f"{p}.self_attn.q_norm.weight", (d,), "float"), (f"{p}.self_attn.k_norm.weight", (d,), "float")]
        specs.append((f"{p}.self_attn.o_proj.weight", (cfg.heads * d, h), "float"))
        specs.append((f"{p}.post_attention_layernorm.weight", (h,), "float"))
        specs.append((f"{p}.mlp.gate.weight", (h, e), "float"))
        specs += [(f"{p}.mlp.experts.gate_proj.weight", (e, mi, h), "experts"),
                  (f"{p}.mlp.experts.up_proj.weight", (e, mi, h), "experts"),
                  (f"{p}.mlp.experts.down_proj.weight", (e, h, mi), "experts")]
        if si:
            specs += [(f"{p}.mlp.shared_expert.gate_proj.weight", (h, si), "float"),
                      (f"{p}.mlp.shared_expert.up_proj.weight", (h, si), "float"),
                      (f"{p}.mlp.shared_expert.down_proj.weight", (si, h), "float"),
                      (f"{p}.mlp.shared_expert_gate.weight", (h, 1), "float")]
    specs += [("norm.weight", (h,), "float"), ("lm_head.weight", (h, cfg.vocab), "float")]
    return specs


# --------------------------------------------------------------------------- graph building


class _GraphBuilder:
    """Collects nodes and initializers; node names follow the torch exporter's ``/scope/Op_n``."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._scopes: list[str] = []
        self._names: Counter[str] = Counter()
        self._consts: dict[tuple, str] = {}

    @contextlib.contextmanager
    def scope(self, name: str):
        self._scopes.append(name)
        try:
            yield
        finally:
            self._scopes.pop()

    def op(self, op_type: str, *inputs: str, outputs: int | list[str] = 1, **attrs):
        """Append one node; returns its output name, or a list of names for several outputs."""
        base = "/" + "/".join([*self._scopes, op_type])
        n = self._names[base]
        self._names[base] += 1
        name = base if n == 0 else f"{base}_{n}"
        if isinstance(outputs, int):
            outputs = [f"{name}_output_{j}" for j in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outputs, name=name, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def const(self, value, dtype: type = np.int64) -> str:
        """A (deduplicated) constant initializer; ``value`` scalar or list."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            self._consts[key] = self.weight(f"const_{len(self._consts)}", array)
        return self._consts[key]

    def dims(self, x: str, *axes: int) -> list[str]:
        """1-D int64 ``[1]`` tensors holding ``x.shape[axis]``: Shape -> Gather -> Unsqueeze."""
        shape = self.op("Shape", x)
        return [self.op("Unsqueeze", self.op("Gather", shape, self.const(a), axis=0), self.const([0])) for a in axes]


def rms_norm(b: _GraphBuilder, x: str, weight: str, cfg: SeedConfig) -> str:
    """Seed "1. RMSNorm": ``[1, seq, H]`` -> ``[1, seq, H]`` in the model dtype.

    ``Cast(f32) -> Pow 2 -> ReduceMean(axes=[-1] as an input, keepdims) -> Add eps -> Sqrt ->
    Div -> Cast(back) -> Mul weight``; the two Casts only in fp16 (see the module docstring).
    """
    xf = b.op("Cast", x, to=TensorProto.FLOAT) if cfg.is_fp16 else x
    var = b.op("ReduceMean", b.op("Pow", xf, b.const(2.0, np.float32)), b.const([-1]), keepdims=1)
    normed = b.op("Div", xf, b.op("Sqrt", b.op("Add", var, b.const(RMS_EPS, np.float32))))
    if cfg.is_fp16:
        normed = b.op("Cast", normed, to=cfg.onnx_dtype)
    return b.op("Mul", normed, weight)


def rotary_embedding(b: _GraphBuilder, positions: str, cfg: SeedConfig) -> tuple[str, str]:
    """Seed "Rotary Position Embeddings": positions ``[seq]`` int64 -> (cos, sin) ``[1, 1, seq, hd]``.

    ``Cast(f32) -> Unsqueeze -> MatMul(inv_freq [1, hd/2, 1], pos [1, 1, seq]) -> Transpose ->
    Concat(doubled) -> Cos/Sin -> Cast(model dtype, fp16 only) -> Reshape [1, 1, seq, hd]``.
    """
    inv_freq = b.weight("rope.inv_freq", _inv_freq(cfg).reshape(1, -1, 1))
    pos = b.op("Unsqueeze", b.op("Cast", positions, to=TensorProto.FLOAT), b.const([0, 1]))
    freqs = b.op("Transpose", b.op("MatMul", inv_freq, pos), perm=[0, 2, 1])
    emb = b.op("Concat", freqs, freqs, axis=-1)
    out = []
    for fn in ("Cos", "Sin"):
        t = b.op(fn, emb)
        if cfg.is_fp16:
            t = b.op("Cast", t, to=cfg.onnx_dtype)
        out.append(b.op("Reshape", t, b.const([1, 1, -1, cfg.head_dim])))
    return out[0], out[1]


def apply_rope(b: _GraphBuilder, x: str, cos: str, sin: str) -> str:
    """``x * cos + rotate_half(x) * sin`` on ``[1, heads, seq, hd]``; rotate_half = Split/Neg/Concat."""
    x1, x2 = b.op("Split", x, axis=3, num_outputs=2, outputs=2)
    rotated = b.op("Concat", b.op("Neg", x2), x1, axis=3)
    return b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin))


def causal_mask(b: _GraphBuilder, positions: str, seq_end: str, cfg: SeedConfig) -> str:
    """Seed "Attention Computation" mask: additive bias ``[1, 1, seq, max_seq]`` (0 or -inf).

    A cache slot ``j`` is visible to the query at position ``p`` iff
    ``LessOrEqual(j, p) And Less(j, seq_end)`` with ``seq_end = seq_position + seq``.
    """
    slots = b.const(np.arange(cfg.max_seq).reshape(1, -1))
    query_pos = b.op("Reshape", positions, b.const([-1, 1]))
    visible = b.op("And", b.op("LessOrEqual", slots, query_pos), b.op("Less", slots, seq_end))
    bias = b.op("Where", visible, b.const(0.0, cfg.np_dtype), b.const(-np.inf, cfg.np_dtype))
    return b.op("Reshape", bias, b.const([1, 1, -1, cfg.max_seq]))


def kv_cache_update(
    b: _GraphBuilder, positions: str, seq_1d: str, updates: dict[str, tuple[str, str]], cfg: SeedConfig
) -> list[str]:
    """Seed "KV Cache Update" + A4/A5: ``ScatterElements(past, indices, update, axis=2)`` per entry.

    ``updates`` maps an output name (``present_key_i``) to ``(past, update [1, kv, seq, hd])``.
    ``indices = Expand(Reshape(Cast(positions, INT64), [1, 1, -1, 1]), shape)`` where ``shape``
    is the torch exporter's ``expand(-1, kv_heads, seq, head_dim)``:
    ``Where(Equal(Concat([-1], [kv], seq, [hd]), -1), ones, Concat(...))`` -> ``[1, kv, seq, hd]``,
    a value ONNX shape inference does not propagate through Equal/Where.  The int64 -> int64
    Cast is the no-op ``.long()`` the seed's A5 pattern names.  One index tensor serves the key
    and value scatters of a layer.
    """
    idx = b.op("Reshape", b.op("Cast", positions, to=TensorProto.INT64), b.const([1, 1, -1, 1]))
    sizes = b.op("Concat", b.const([-1]), b.const([cfg.kv_heads]), seq_1d, b.const([cfg.head_dim]), axis=0)
    shape = b.op("Where", b.op("Equal", sizes, b.const(-1)), b.const([1, 1, 1, 1]), sizes)
    indices = b.op("Expand", idx, shape)
    return [b.op("ScatterElements", past, indices, upd, axis=2, outputs=[name]) for name, (past, upd) in updates.items()]


def attention(b: _GraphBuilder, x: str, i: int, rope: tuple[str, str], mask: str, positions: str, cfg: SeedConfig):
    """Seed "2. Self-Attention": ``x`` ``[1, seq, H]`` -> ``[1, seq, H]``; writes ``present_{key,value}_{i}``.

    Q/K/V ``MatMul + bias (Qwen1.5) -> Reshape([1, seq, n, hd], shape from Shape/Gather/Concat) ->
    [RMSNorm over hd, Q and K, Qwen3] -> Transpose``; RoPE on Q, K; the KV cache scatter; ``MatMul(Q, Transpose(K_cache)) -> Mul
    1/sqrt(hd) -> Add mask -> Softmax -> [Cast f32 -> Cast f16, fp16 only] -> MatMul(V_cache)
    -> Transpose -> Reshape [1, seq, heads*hd] -> MatMul(W_o)``.  With ``kv_heads < heads`` the
    cache is repeated per query group (Unsqueeze/Expand/Reshape) before the two MatMuls.
    """
    p = f"layers.{i}.self_attn"
    batch_1d, seq_1d = b.dims(x, 0, 1)

    def heads(name: str, n: int) -> str:
        y = b.op("MatMul", x, f"{p}.{name}_proj.weight")
        if cfg.attn_bias:
            y = b.op("Add", y, f"{p}.{name}_proj.bias")
        shape = b.op("Concat", batch_1d, seq_1d, b.const([n]), b.const([cfg.head_dim]), axis=0)
        y = b.op("Reshape", y, shape)
        if cfg.qk_norm and name in ("q", "k"):  # Qwen3: RMSNorm over head_dim of [1, seq, n, hd], before RoPE
            y = rms_norm(b, y, f"{p}.{name}_norm.weight", cfg)
        return b.op("Transpose", y, perm=[0, 2, 1, 3])

    q = apply_rope(b, heads("q", cfg.heads), *rope)
    k = apply_rope(b, heads("k", cfg.kv_heads), *rope)
    v = heads("v", cfg.kv_heads)
    key_cache, value_cache = kv_cache_update(
        b, positions, seq_1d, {f"present_key_{i}": (f"past_key_{i}", k), f"present_value_{i}": (f"past_value_{i}", v)}, cfg
    )
    if cfg.heads != cfg.kv_heads:
        grouped = b.const([1, cfg.kv_heads, cfg.heads // cfg.kv_heads, cfg.max_seq, cfg.head_dim])

        def repeat_kv(cache: str) -> str:
            repeated = b.op("Expand", b.op("Unsqueeze", cache, b.const([2])), grouped)
            return b.op("Reshape", repeated, b.const([1, cfg.heads, cfg.max_seq, cfg.head_dim]))

        key_cache, value_cache = repeat_kv(key_cache), repeat_kv(value_cache)
    scores = b.op("MatMul", q, b.op("Transpose", key_cache, perm=[0, 1, 3, 2]))
    scores = b.op("Add", b.op("Mul", scores, b.const(cfg.head_dim**-0.5, cfg.np_dtype)), mask)
    probs = b.op("Softmax", scores, axis=-1)
    if cfg.is_fp16:
        probs = b.op("Cast", b.op("Cast", probs, to=TensorProto.FLOAT), to=cfg.onnx_dtype)
    ctx = b.op("Transpose", b.op("MatMul", probs, value_cache), perm=[0, 2, 1, 3])
    ctx = b.op("Reshape", ctx, b.op("Concat", batch_1d, seq_1d, b.const([cfg.heads * cfg.head_dim]), axis=0))
    return b.op("MatMul", ctx, f"{p}.o_proj.weight")


def moe(b: _GraphBuilder, h: str, i: int, cfg: SeedConfig) -> str:
    """Seed "Router" + "Expert Computation (INT4 QDQ, gather-then-compute)": ``[seq, H]`` -> ``[seq, H]``.

    Router ``MatMul [H, E] -> Softmax(-1) -> Cast(f32, fp16 only) -> TopK(k)``; values are not
    renormalized (Qwen1.5-MoE; Qwen3: ``Div(values, ReduceSum(values))``) and are Cast back to the model dtype
    (fp16 only).  For each of
    gate/up/down: ``Gather`` codes / scales / zero points by ``Reshape(indices, [-1])`` ->
    ``Cast(UINT4)`` codes and zero points -> ``DequantizeLinear(axis=2, block_size)`` ->
    ``Transpose [0, 2, 1]``.  Hidden ``Unsqueeze -> Tile [1, k, 1] -> Reshape [seq*k, 1, H]``;
    SwiGLU ``Mul(Mul(g, Sigmoid(g)), up)``; down MatMul; weighted sum
    ``MatMul(Reshape(values, [seq, 1, k]), Reshape(expert_out, [seq, k, H]))``.
    """
    p = f"layers.{i}.mlp"
    probs = b.op("Softmax", b.op("MatMul", h, f"{p}.gate.weight"), axis=-1)
    if cfg.is_fp16:
        probs = b.op("Cast", probs, to=TensorProto.FLOAT)
    values, indices = b.op("TopK", probs, b.const([cfg.top_k]), axis=-1, outputs=2)
    if cfg.norm_topk:  # Qwen3: routing_weights /= routing_weights.sum(-1, keepdim=True), in float32
        values = b.op("Div", values, b.op("ReduceSum", values, b.const([-1]), keepdims=1))
    if cfg.is_fp16:
        values = b.op("Cast", values, to=cfg.onnx_dtype)
    flat_indices = b.op("Reshape", indices, b.const([-1]))

    def expert_weight(proj: str) -> str:
        e = f"{p}.experts.{proj}_proj"
        codes = b.op("Gather", f"{e}.qweight", flat_indices, axis=0)
        scales = b.op("Gather", f"{e}.scales", flat_indices, axis=0)
        zeros = b.op("Gather", f"{e}.zero_points", flat_indices, axis=0)
        w = b.op(
            "DequantizeLinear",
            b.op("Cast", codes, to=TensorProto.UINT4),
            scales,
            b.op("Cast", zeros, to=TensorProto.UINT4),
            axis=2,
            block_size=cfg.block_size,
        )
        return b.op("Transpose", w, perm=[0, 2, 1])

    gate_w, up_w, down_w = (expert_weight(proj) for proj in ("gate", "up", "down"))
    tiled = b.op("Tile", b.op("Unsqueeze", h, b.const([1])), b.const([1, cfg.top_k, 1]))
    tiled = b.op("Reshape", tiled, b.const([-1, 1, cfg.hidden]))
    gate = b.op("MatMul", tiled, gate_w)
    act = b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), b.op("MatMul", tiled, up_w))
    expert_out = b.op("MatMul", act, down_w)
    weighted = b.op(
        "MatMul",
        b.op("Reshape", values, b.const([-1, 1, cfg.top_k])),
        b.op("Reshape", expert_out, b.const([-1, cfg.top_k, cfg.hidden])),
    )
    return b.op("Reshape", weighted, b.const([-1, cfg.hidden]))


def shared_expert(b: _GraphBuilder, h: str, i: int) -> str:
    """Seed "Shared Expert": ``[seq, H]`` -> ``Sigmoid(h @ W_g[H, 1]) * down(SiLU(h @ W_gate) * (h @ W_up))``."""
    p = f"layers.{i}.mlp.shared_expert"
    gate = b.op("Sigmoid", b.op("MatMul", h, f"layers.{i}.mlp.shared_expert_gate.weight"))
    g = b.op("MatMul", h, f"{p}.gate_proj.weight")
    act = b.op("Mul", b.op("Mul", g, b.op("Sigmoid", g)), b.op("MatMul", h, f"{p}.up_proj.weight"))
    return b.op("Mul", gate, b.op("MatMul", act, f"{p}.down_proj.weight"))


def decoder_layer(b: _GraphBuilder, x: str, i: int, rope, mask: str, positions: str, cfg: SeedConfig) -> str:
    """One layer, ``[1, seq, H]`` -> ``[1, seq, H]``: pre-norm attention and pre-norm MoE (routed experts, plus the
    shared expert where the config has one), both residual."""
    with b.scope("self_attn"):
        attn = attention(b, rms_norm(b, x, f"layers.{i}.input_layernorm.weight", cfg), i, rope, mask, positions, cfg)
    x = b.op("Add", x, attn)
    with b.scope("mlp"):
        h = rms_norm(b, x, f"layers.{i}.post_attention_layernorm.weight", cfg)
        h = b.op("Reshape", h, b.const([-1, cfg.hidden]))
        out = moe(b, h, i, cfg)
        if cfg.shared_intermediate:
            out = b.op("Add", out, shared_expert(b, h, i))
        out = b.op("Reshape", out, b.op("Shape", x))
    return b.op("Add", x, out)


def _inv_freq(cfg: SeedConfig) -> np.ndarray:
    return (1.0 / ROPE_THETA ** (np.arange(0, cfg.head_dim, 2, dtype=np.float32) / cfg.head_dim)).astype(np.float32)


def build_seed_model(dtype: str = "fp32", *, arch: str = "qwen2_moe", seed: int = 0,
                     **sizes) -> tuple[onnx.ModelProto, SeedWeights]:
    """Build the static-cache decoder graph with its weights inline and return ``(model, weights)``.

    Inputs: ``input_ids`` int64 ``[1, "seq_len"]``, ``seq_position`` int64 ``[1]`` (cache write
    offset), ``past_key_{i}`` / ``past_value_{i}`` ``[1, kv_heads, max_seq, head_dim]``.
    Outputs: ``logits`` ``[1, "seq_len", vocab]``, ``present_key_{i}`` / ``present_value_{i}``
    like the pasts.  Floats are in ``dtype`` (fp32 / fp16).  Expert weights are stored as UINT4
    codes (one per uint8 byte) with scales in ``dtype`` and UINT4 zero points (one per uint8);
    ``weights`` holds everything else in ``dtype`` and the experts dequantized.

    Args:
        arch: ``"qwen2_moe"`` (the seed's Qwen1.5-MoE form) or ``"qwen3_moe"`` (`ARCHS`).
        seed: seed of the float weights (numpy's default generator), quantized for the experts.
        sizes: `SeedConfig` fields overriding the arch's (``hidden``, ``layers``, ``heads``, ...).

    Raises:
        ValueError: see `seed_config`.
    """
    cfg = seed_config(dtype, arch, **sizes)
    float_weights = _random_weights(cfg, seed)
    b = _GraphBuilder()
    tensors: dict[str, np.ndarray] = {"rope.inv_freq": _inv_freq(cfg)}
    for name, w in float_weights.items():
        if ".experts." in name:
            codes, scales, zeros = quantize_uint4_blockwise(w, cfg.block_size, cfg.np_dtype)
            base = name.removesuffix(".weight")
            b.weight(f"{base}.qweight", codes)
            b.weight(f"{base}.scales", scales)
            b.weight(f"{base}.zero_points", zeros)
            tensors[name] = dequantize_uint4_blockwise(codes, scales, zeros, cfg.block_size)
        else:
            tensors[name] = w.astype(cfg.np_dtype)
            b.weight(name, tensors[name])
    return _build_graph(b, cfg), SeedWeights(cfg, tensors)


def _build_graph(b: _GraphBuilder, cfg: SeedConfig) -> onnx.ModelProto:
    """The model around the weights ``b`` already holds (or refers to), named as `weight_specs` names them."""
    with b.scope("model"):
        x = b.op("Gather", "embed_tokens.weight", "input_ids", axis=0)
        seq = b.op("Gather", b.op("Shape", "input_ids"), b.const(1), axis=0)
        positions = b.op("Add", "seq_position", b.op("Range", b.const(0), seq, b.const(1)))
        rope = rotary_embedding(b, positions, cfg)
        mask = causal_mask(b, positions, b.op("Add", "seq_position", seq), cfg)
        for i in range(cfg.layers):
            with b.scope(f"layers.{i}"):
                x = decoder_layer(b, x, i, rope, mask, positions, cfg)
        x = rms_norm(b, x, "norm.weight", cfg)
        b.op("MatMul", x, "lm_head.weight", outputs=["logits"])

    def kv(prefix: str) -> list[onnx.ValueInfoProto]:
        return [helper.make_tensor_value_info(f"{prefix}_{kind}_{i}", cfg.onnx_dtype, cfg.kv_shape)
                for i in range(cfg.layers) for kind in ("key", "value")]  # fmt: skip

    graph = helper.make_graph(
        b.nodes,
        "seed_form_qwen_moe",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "seq_len"]),
            helper.make_tensor_value_info("seq_position", TensorProto.INT64, [1]),
            *kv("past"),
        ],
        [helper.make_tensor_value_info("logits", cfg.onnx_dtype, [1, "seq_len", cfg.vocab]), *kv("present")],
        initializer=b.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="rewrite.examples.seed_form")
    model.ir_version = IR_VERSION
    return model


#: byte alignment of each tensor in a seeded data file: ONNX Runtime maps page-aligned external data instead of
#: reading it into memory
PAGE = 4096


def seeded_slots(cfg: SeedConfig) -> list[seeded_weights.TensorSlot]:
    """The external-data layout of `export_seeded`: every weight of `weight_specs` in the model dtype, each expert
    stack as ``.qweight`` UINT8 ``[E, out, in]`` (one code per byte), ``.scales`` ``[E, out, ceil(in / block)]``
    in the model dtype and ``.zero_points`` UINT8 like the scales; `PAGE`-aligned."""
    tensors = []
    for name, shape, kind in weight_specs(cfg):
        if kind == "float":
            tensors.append((name, shape, cfg.onnx_dtype))
            continue
        base, blocks = name.removesuffix(".weight"), (*shape[:-1], math.ceil(shape[-1] / cfg.block_size))
        tensors += [(f"{base}.qweight", shape, TensorProto.UINT8), (f"{base}.scales", blocks, cfg.onnx_dtype),
                    (f"{base}.zero_points", blocks, TensorProto.UINT8)]
    return seeded_weights.layout(tensors, align=PAGE)


def export_seeded(arch: str, out_dir: str | Path, *, dtype: str = "fp16", seed: int = 0, threads: int | None = None,
                  progress=None, **sizes) -> Path:
    """Write the seed form of ``arch`` with seeded weights: ``out_dir/model.onnx`` (the graph, a few MB) and
    ``out_dir/model.onnx.data`` (every weight, drawn by `seeded_weights` from (``seed``, tensor name) and written
    tensor by tensor, so memory stays at a few chunks per thread whatever the size).

    The experts are drawn directly as INT4 codes, scales and zero points (`seeded_weights.init_kind`), the form the
    seed's models ship in; the seed is recorded in the model's metadata, so ``python examples/seeded_weights.py
    regenerate model.onnx`` rebuilds the identical data file from the graph alone.

    Args:
        arch: ``"qwen2_moe"`` or ``"qwen3_moe"``.
        dtype: ``"fp16"`` or ``"fp32"``: float weights, scales and activations.
        sizes: `SeedConfig` fields; ``**FULL[arch]`` gives the real model (Qwen3-30B-A3B: 32.7 GB of data).
        progress: called with each tensor's byte length once it is written.

    Returns:
        The path of ``model.onnx``.

    Raises:
        ValueError: see `seed_config`.
    """
    cfg = seed_config(dtype, arch, **sizes)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path, data = out_dir / "model.onnx", out_dir / "model.onnx.data"
    slots = seeded_slots(cfg)
    seeded_weights.write(data, slots, seed, threads=threads, progress=progress, router_std=cfg.router_std)
    b = _GraphBuilder()
    for slot in slots:
        tensor = TensorProto(name=slot.name, data_type=slot.elem_type, dims=slot.shape,
                             data_location=TensorProto.EXTERNAL)
        for key, value in (("location", data.name), ("offset", str(slot.offset)), ("length", str(slot.length))):
            tensor.external_data.add(key=key, value=value)
        b.initializers.append(tensor)
    model = _build_graph(b, cfg)
    model.graph.name = f"seed_form_{arch}"
    helper.set_model_props(model, {seeded_weights.METADATA_KEY: seeded_weights.metadata(seed, {}, cfg.router_std)})
    onnx.save(model, str(path))
    return path


def save_seed_model(model: onnx.ModelProto, path: str | Path) -> Path:
    """Write ``model`` to ``path`` (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def inferred_shapes(model: onnx.ModelProto, op_type: str) -> list[list[int | str | None]]:
    """Output shapes ONNX shape inference (``data_prop=True``) gives every ``op_type`` node.

    One list per node, in graph order; a dim is an int, a symbol (str) or None (unknown), and
    an output whose rank is unknown gives ``[]``.
    """
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    types = {vi.name: vi.type.tensor_type for vi in [*inferred.graph.value_info, *inferred.graph.output]}
    shapes = []
    for node in inferred.graph.node:
        if node.op_type == op_type:
            t = types.get(node.output[0])
            dims = t.shape.dim if t is not None and t.HasField("shape") else []
            shapes.append([d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in dims])
    return shapes


# --------------------------------------------------------------------------- PyTorch reference


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm computed in float32, cast back to ``x.dtype``, times ``weight``."""
    xf = x.float()
    return (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS)).to(x.dtype) * weight


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on ``[1, heads, seq, hd]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def ref_attention(x, w, i, cos, sin, mask, seq_position, past, cfg: SeedConfig):
    """Attention on ``x`` ``[1, seq, H]`` with the static cache ``past = (key, value)``."""
    p = f"layers.{i}.self_attn"
    seq = x.shape[1]

    def heads(name, n):
        y = x @ w[f"{p}.{name}_proj.weight"]
        if cfg.attn_bias:
            y = y + w[f"{p}.{name}_proj.bias"]
        y = y.reshape(1, seq, n, cfg.head_dim)
        if cfg.qk_norm and name in ("q", "k"):
            y = ref_rms_norm(y, w[f"{p}.{name}_norm.weight"])
        return y.transpose(1, 2)

    q = ref_rope(heads("q", cfg.heads), cos, sin)
    k = ref_rope(heads("k", cfg.kv_heads), cos, sin)
    v = heads("v", cfg.kv_heads)
    key_cache, value_cache = past[0].clone(), past[1].clone()
    key_cache[:, :, seq_position : seq_position + seq] = k
    value_cache[:, :, seq_position : seq_position + seq] = v
    rep = cfg.heads // cfg.kv_heads
    keys, values = key_cache.repeat_interleave(rep, dim=1), value_cache.repeat_interleave(rep, dim=1)
    scores = (q @ keys.transpose(2, 3)) * torch.tensor(cfg.head_dim**-0.5, dtype=x.dtype) + mask
    ctx = (torch.softmax(scores, dim=-1) @ values).transpose(1, 2).reshape(1, seq, cfg.heads * cfg.head_dim)
    return ctx @ w[f"{p}.o_proj.weight"], key_cache, value_cache


def ref_moe(h: torch.Tensor, w, i, cfg: SeedConfig) -> torch.Tensor:
    """Routed experts on ``h`` ``[seq, H]``: softmax in the model dtype, then float top-k, renormalized in float32
    where the config says so."""
    p = f"layers.{i}.mlp"
    probs = torch.softmax(h @ w[f"{p}.gate.weight"], dim=-1).float()
    values, indices = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.norm_topk:
        values = values / values.sum(-1, keepdim=True)
    flat = indices.reshape(-1)
    gate_w, up_w, down_w = (w[f"{p}.experts.{n}_proj.weight"][flat].transpose(1, 2) for n in ("gate", "up", "down"))
    tiled = h.unsqueeze(1).repeat_interleave(cfg.top_k, dim=0)  # [seq*k, 1, H], token-major
    g = tiled @ gate_w
    expert_out = (g * torch.sigmoid(g) * (tiled @ up_w)) @ down_w
    weighted = values.to(h.dtype).reshape(-1, 1, cfg.top_k) @ expert_out.reshape(-1, cfg.top_k, cfg.hidden)
    return weighted.reshape(-1, cfg.hidden)


def ref_shared_expert(h: torch.Tensor, w, i) -> torch.Tensor:
    """Sigmoid-gated SwiGLU shared expert on ``h`` ``[seq, H]``."""
    p = f"layers.{i}.mlp.shared_expert"
    g = h @ w[f"{p}.gate_proj.weight"]
    act = g * torch.sigmoid(g) * (h @ w[f"{p}.up_proj.weight"])
    return torch.sigmoid(h @ w[f"layers.{i}.mlp.shared_expert_gate.weight"]) * (act @ w[f"{p}.down_proj.weight"])


def seed_reference(
    weights: SeedWeights,
    input_ids: np.ndarray,
    seq_position: int,
    past: list[tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """The model's math in PyTorch (CPU, model dtype) on the dequantized weights.

    ``input_ids`` int64 ``[1, seq]``, ``seq_position`` the cache write offset,
    ``past[i] = (key, value)`` ``[1, kv_heads, max_seq, head_dim]``.  Returns ``logits``
    ``[1, seq, vocab]`` and the updated ``presents`` as numpy arrays in the model dtype.
    RMSNorm and RoPE tables are computed in float32 as in the graph; the graph's f16->f32->f16
    round trip after the attention Softmax is the identity and is left out.
    """
    cfg = weights.config
    w = {k: torch.from_numpy(v) for k, v in weights.tensors.items()}
    ids = torch.from_numpy(np.asarray(input_ids, np.int64))
    seq = ids.shape[1]
    positions = seq_position + torch.arange(seq)
    freqs = torch.outer(positions.float(), w["rope.inv_freq"])
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (t.to(cfg.torch_dtype).reshape(1, 1, seq, cfg.head_dim) for t in (emb.cos(), emb.sin()))
    slots = torch.arange(cfg.max_seq)
    visible = (slots[None, :] <= positions[:, None]) & (slots[None, :] < seq_position + seq)
    mask = torch.where(visible, 0.0, -torch.inf).to(cfg.torch_dtype).reshape(1, 1, seq, cfg.max_seq)

    x = w["embed_tokens.weight"][ids]
    presents = []
    for i in range(cfg.layers):
        layer_past = tuple(torch.from_numpy(np.asarray(t)) for t in past[i])
        h = ref_rms_norm(x, w[f"layers.{i}.input_layernorm.weight"])
        attn, key_cache, value_cache = ref_attention(h, w, i, cos, sin, mask, seq_position, layer_past, cfg)
        presents.append((key_cache.numpy(), value_cache.numpy()))
        x = x + attn
        h = ref_rms_norm(x, w[f"layers.{i}.post_attention_layernorm.weight"]).reshape(-1, cfg.hidden)
        out = ref_moe(h, w, i, cfg)
        if cfg.shared_intermediate:
            out = out + ref_shared_expert(h, w, i)
        x = x + out.reshape(x.shape)
    logits = ref_rms_norm(x, w["norm.weight"]) @ w["lm_head.weight"]
    return logits.numpy(), presents


# --------------------------------------------------------------------------- check


def greedy(step, cfg: SeedConfig, prompt: np.ndarray, steps: int):
    """Prefill ``prompt`` [1, n] int64 at position 0 with zero caches, then decode ``steps`` tokens one at a time.

    ``step(ids, position, past) -> (logits, presents)`` runs one call (see :func:`runner_step`). Returns (the
    ``steps`` generated token ids, the logits of every call, the presents of every call)."""
    past = [tuple(np.zeros(cfg.kv_shape, cfg.np_dtype) for _ in range(2)) for _ in range(cfg.layers)]
    ids, position, tokens, all_logits, all_presents = prompt, 0, [], [], []
    for _ in range(steps + 1):
        logits, past = step(ids, position, past)
        all_logits.append(logits)
        all_presents.append(past)
        position += ids.shape[1]
        tokens.append(int(np.argmax(logits[0, -1])))
        ids = np.array([[tokens[-1]]], np.int64)
    return tokens[:steps], all_logits, all_presents


def runner_step(run, cfg: SeedConfig):
    """A decode step for :func:`greedy` from any runtime: ``run(feeds by input name) -> outputs by name``.

    Feeds ``input_ids`` [1, n] int64, ``seq_position`` [1] int64 and each layer's ``past_key_{i}`` /
    ``past_value_{i}`` [1, H_kv, max_seq, head_dim]; returns (logits [1, n, vocab], [(present key, value)] per layer).
    """

    def step(ids, position, past):
        feeds = {"input_ids": ids, "seq_position": np.array([position], np.int64)}
        for i, (key, value) in enumerate(past):
            feeds[f"past_key_{i}"], feeds[f"past_value_{i}"] = key, value
        out = run(feeds)
        return out["logits"], [(out[f"present_key_{i}"], out[f"present_value_{i}"]) for i in range(cfg.layers)]

    return step


def check_seed_model(model: onnx.ModelProto, weights: SeedWeights, *, steps: int = 6, prompt_len: int = 5) -> dict:
    """Run ``model`` on ONNX Runtime (CPU) and :func:`seed_reference` side by side.

    A fixed random prompt of ``prompt_len`` tokens is prefilled at ``seq_position`` 0 with
    zero caches, then ``steps`` greedy tokens are decoded one per call, each runtime feeding
    back its own tokens and caches.  Returns ``max_abs`` / ``max_rel`` logits error over all
    calls (``rel = max|ort - ref| / max|ref|``), ``present_max_abs`` (KV caches) and both token
    lists (``ort_tokens``, ``ref_tokens``, the prompt excluded).
    """
    cfg = weights.config
    if prompt_len + steps > cfg.max_seq:
        raise ValueError(f"prompt_len + steps must fit in max_seq={cfg.max_seq}")
    options = ort.SessionOptions()
    options.log_severity_level = 3  # fp16 Where on CPU warns that it cannot be constant folded
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    output_names = [o.name for o in model.graph.output]
    ort_step = runner_step(lambda feeds: dict(zip(output_names, session.run(output_names, feeds))), cfg)

    def ref_step(ids, position, past):
        return seed_reference(weights, ids, position, past)

    prompt = np.random.default_rng(0).integers(cfg.vocab, size=(1, prompt_len), dtype=np.int64)
    ort_tokens, ort_logits, ort_presents = greedy(ort_step, cfg, prompt, steps)
    ref_tokens, ref_logits, ref_presents = greedy(ref_step, cfg, prompt, steps)
    a = np.concatenate([l.astype(np.float64).ravel() for l in ort_logits])
    r = np.concatenate([l.astype(np.float64).ravel() for l in ref_logits])
    present_err = max(
        float(np.abs(po.astype(np.float64) - pr.astype(np.float64)).max())
        for step_o, step_r in zip(ort_presents, ref_presents)
        for layer_o, layer_r in zip(step_o, step_r)
        for po, pr in zip(layer_o, layer_r)
    )
    max_abs = float(np.abs(a - r).max())
    return {
        "dtype": cfg.dtype,
        "max_abs": max_abs,
        "max_rel": max_abs / float(np.abs(r).max()),
        "present_max_abs": present_err,
        "ort_tokens": ort_tokens,
        "ref_tokens": ref_tokens,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), default="qwen2_moe")
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny",
                        help="tiny: the toy sizes, weights inline, checked against PyTorch (a JSON report); full: the "
                             "real configuration (FULL) with seeded weights written to --out/model.onnx.data")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp16")
    parser.add_argument("--out", type=Path, default=Path("out/seed_fp16.onnx"),
                        help="tiny: the .onnx file; full: the folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="full: writer threads (default: every core)")
    parser.add_argument("--layers", type=int, default=None,
                        help="full: this many decoder layers instead of the real count (the real layer shapes, less weight)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=NUMBER",
                        help="full: a SeedConfig field instead of the real one (repeatable; e.g. experts=8 keeps the real "
                             "attention and KV cache shapes with little expert weight)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=5)
    args = parser.parse_args(argv)
    if args.size == "full":
        sizes = {**FULL[args.arch], **({"layers": args.layers} if args.layers else {})}
        for item in args.set:
            key, _, value = item.partition("=")
            kind = type(FULL[args.arch].get(key))
            try:
                sizes[key] = kind(value) if kind in (int, float) else None
            except ValueError:
                sizes[key] = None
            if sizes[key] is None:
                parser.error(f"--set {item}: FIELD=NUMBER with FIELD one of {', '.join(FULL[args.arch])}")
        path = export_seeded(args.arch, args.out, dtype=args.dtype, seed=args.seed, threads=args.threads, **sizes)
        data = path.parent / "model.onnx.data"
        report = {"path": str(path), "data_bytes": data.stat().st_size,
                  "regenerate": f"python examples/seeded_weights.py regenerate {path}"}
        print(json.dumps(report, indent=2))
        return report
    model, weights = build_seed_model(args.dtype, arch=args.arch, seed=args.seed)
    path = save_seed_model(model, args.out)
    report = {
        "path": str(path),
        "op_counts": dict(sorted(Counter(n.op_type for n in model.graph.node).items())),
        "inferred_shapes": {op: inferred_shapes(model, op) for op in ("Expand", "ScatterElements")},
        "check": check_seed_model(model, weights, steps=args.steps, prompt_len=args.prompt_len),
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
