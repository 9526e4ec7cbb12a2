"""Qwen Mixture-of-Experts LLMs with random weights: build, export one decode-step ONNX graph, check it on ORT.

Two architectures, each in three sizes (see `build_model`):

- ``qwen2_moe``: Qwen1.5-MoE-A2.7B (60 experts, top-4 without renormalisation, sigmoid-gated shared expert, qkv bias).
- ``qwen3_moe``: Qwen3-30B-A3B (128 experts, top-8 renormalised, GQA, QK-norm, no shared expert).

The export (`export_hf`) uses transformers' own ONNX exporter with dynamic sequence and past axes, so one graph serves
both the prefill (past length 0) and every decode step. `greedy_decode` drives such a graph through any
``run(feeds) -> outputs`` callable (ONNX Runtime, an IREE module, ...) with numpy arrays only.

The full-size models (`export_seeded`) are built on the meta device and get their weights from a seeded generator
(`seeded_weights`), written straight into the external data file, so they export on a machine with less memory than
their weights; another machine regenerates the same bytes from the weightless ``model.onnx``.

CLI::

    python examples/qwen_moe.py --arch qwen2_moe --size tiny --dtype fp32 --out out/qwen2_moe_tiny
    python examples/qwen_moe.py --arch qwen2_moe --size full --dtype fp16 --out out/qwen2_moe_full   # 28.6 GB, ~6 min
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir
import torch
import seeded_weights
import transformers
from transformers.exporters.exporter_onnx import OnnxConfig, OnnxExporter

ARCHS = ("qwen2_moe", "qwen3_moe")
SIZES = ("tiny", "mid", "full")

_MODEL_CLASSES = {
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
}

# Config overrides per (arch, size); everything not named keeps the transformers default of the config class.
# "tiny" is fixed: a bug report depends on exactly these values (plus seed 0 and the router redraw).
_CONFIGS: dict[tuple[str, str], dict] = {
    ("qwen2_moe", "tiny"): dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        shared_expert_intermediate_size=256, num_experts=8, num_experts_per_tok=4, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, norm_topk_prob=False, qkv_bias=True,
    ),
    ("qwen2_moe", "mid"): dict(
        vocab_size=4096, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
        shared_expert_intermediate_size=1024, num_experts=60, num_experts_per_tok=4, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, norm_topk_prob=False, qkv_bias=True,
    ),
    # Qwen/Qwen1.5-MoE-A2.7B config.json
    ("qwen2_moe", "full"): dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, norm_topk_prob=False, qkv_bias=True,
        max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643,
    ),
    ("qwen3_moe", "tiny"): dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=16,
        num_experts_per_tok=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        norm_topk_prob=True,
    ),
    ("qwen3_moe", "mid"): dict(
        vocab_size=4096, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512, num_experts=32,
        num_experts_per_tok=8, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        norm_topk_prob=True,
    ),
    # Qwen/Qwen3-30B-A3B config.json
    ("qwen3_moe", "full"): dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        norm_topk_prob=True, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, rms_norm_eps=1e-6,
        bos_token_id=151643, eos_token_id=151645,
    ),
}

ROUTER_STD = 0.5
# Above this many bytes of weights `export_hf` writes them to `model.onnx.data` (protobuf files stop at 2 GiB).
_INLINE_WEIGHTS_LIMIT = 1 << 30
_INLINE_SEEDED_LIMIT = 1 << 20  # bytes: a constant the exporter made, kept inside model.onnx
_KV_NAME = re.compile(r"layers\.(\d+)\.(keys|values)$")


def build_model(
    arch: str,
    size: str = "tiny",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> transformers.PreTrainedModel:
    """A randomly initialised Qwen MoE causal LM in eval mode, ready for `export_hf`.

    Args:
        arch: ``"qwen2_moe"`` (`Qwen2MoeForCausalLM`) or ``"qwen3_moe"`` (`Qwen3MoeForCausalLM`).
        size: ``"tiny"`` (tests), ``"mid"`` (benchmarks) or ``"full"`` (the real model's config).
        dtype: parameter dtype, e.g. ``torch.float32`` or ``torch.float16`` (fp16 runs on CPU too).
        seed: ``torch.manual_seed`` before construction; the same seed gives the same weights in every dtype.
        device: where the parameters live. ``"meta"`` builds the module tree without allocating any weight (the full
            qwen2_moe is 14.3 B parameters): such a model traces, e.g. ``OnnxExporter().export(model, sample,
            OnnxConfig(dynamic=True, optimize=False))`` exports the full graph (the optimizer fails on meta tensors),
            but its weights can't be saved, so `export_hf` refuses it.

    The weights are drawn in float32 and then cast to ``dtype`` (a real-device "full" model briefly needs its fp32
    size in memory). Unless on meta, every router weight (``*.mlp.gate.weight``, [num_experts, hidden]) is redrawn
    from N(0, 0.5) after construction: with the default std 0.02 the router is nearly uniform and top-k picks
    experts by rounding noise, which makes runtimes disagree on the selection.

    Experts use the ``batched_mm`` implementation (the eager per-expert loop does not export with dynamo) and
    attention the ``eager`` one.

    Raises:
        ValueError: unknown ``arch`` or ``size``.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; valid: {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid: {', '.join(SIZES)}")
    config_class, model_class = _MODEL_CLASSES[arch]
    config = config_class(**_CONFIGS[arch, size])
    config._attn_implementation = "eager"
    config._experts_implementation = "batched_mm"

    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(config)
    if model.device.type != "meta":
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.normal_(0.0, ROUTER_STD)
    return model.to(dtype).eval()


def _decode_sample(model: transformers.PreTrainedModel, past_len: int, seq_len: int, *, prefill: bool = True) -> dict:
    """Forward kwargs of one decode step: ``seq_len`` new tokens after ``past_len`` cached ones (random token ids).

    The cache comes from a real prefill of ``past_len`` tokens, so it has whatever layout the architecture uses
    (per-layer keys and values, DeepSeek's latent attention, hybrid models' convolution and recurrent states).
    A meta-device model (no weights to run), or ``prefill=False`` (a full-size model on CPU, where the prefill would
    read every weight), gets a DynamicCache of per-layer keys and values (zeros) instead.
    """
    config = model.config
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, past_len + seq_len), generator=generator).to(model.device)
    if model.device.type == "meta" or not prefill:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_shape = (1, config.num_key_value_heads, past_len, head_dim)
        cache = transformers.DynamicCache(config=config)
        for layer in range(config.num_hidden_layers):
            cache.update(*(torch.zeros(kv_shape, device=model.device, dtype=model.dtype) for _ in range(2)), layer)
    else:
        with torch.no_grad():
            cache = model(input_ids=ids[:, :past_len], use_cache=True).past_key_values
    total = past_len + seq_len
    return dict(
        input_ids=ids[:, past_len:],
        attention_mask=torch.ones(1, total, dtype=torch.int64, device=model.device),
        position_ids=torch.arange(past_len, total, device=model.device)[None],
        # The deprecated alias of `cache`: it names the graph inputs `past_key_values.*` and the outputs `cache.*`,
        # where `cache=` would give `input.cache.*` / `output.cache.*`.
        past_key_values=cache,
        use_cache=True,
    )


def export_hf(model: transformers.PreTrainedModel, out_dir: str | Path, *, past_len: int = 5,
              seq_len: int = 2) -> Path:
    """Export one decode step of ``model`` to ``out_dir/model.onnx`` with transformers' `OnnxExporter`.

    Traced with a sample of ``seq_len`` new tokens after a DynamicCache of ``past_len`` tokens, with
    ``OnnxConfig(dynamic=True)`` (onnxscript optimisation on, no ORT fusions). The sequence and past axes stay
    symbolic, so the graph runs a prefill (past length 0) as well as decode steps; batch is fixed at 1.

    Graph inputs (B=1, S new tokens, P past tokens, T = P+S, L layers, Hkv kv heads, D head dim; float = model dtype):

    - ``input_ids`` int64 [1, S]
    - ``attention_mask`` int64 [1, T] (its own symbolic axis; feed ones)
    - ``position_ids`` int64 [1, S] (P ... T-1)
    - ``past_key_values.layers.{i}.keys``, ``past_key_values.layers.{i}.values`` float [1, Hkv, P, D], i < L,
      in that order (keys, values of layer 0, then layer 1, ...)

    Graph outputs:

    - ``logits`` float [1, S, vocab]
    - ``cache.layers.{i}.keys``, ``cache.layers.{i}.values`` float [1, Hkv, T, D] (Concat(past, new) on axis 2)

    The graph is saved as the exporter wrote it: it names the static axes of the past inputs as symbolic dims "4",
    "32", ... (rewrite reads those as static sizes). Weights are stored inside the file unless they exceed 1 GiB, then in ``model.onnx.data`` next to it.

    Returns:
        The path of the written ``.onnx`` file.

    Raises:
        ValueError: ``model`` is on the meta device (nothing to save).
    """
    if model.device.type == "meta":
        raise ValueError("a meta-device model has no weights to save; export it with OnnxExporter().export(model, "
                         "sample, OnnxConfig(dynamic=True, optimize=False)) and write the weights yourself")
    sample = _decode_sample(model, past_len, seq_len)
    program = OnnxExporter().export(model, sample, OnnxConfig(dynamic=True)).program
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.onnx"
    weight_bytes = sum(value.const_value.nbytes for value in program.graph.initializers.values())
    external = f"{path.name}.data" if weight_bytes > _INLINE_WEIGHTS_LIMIT else None
    onnx_ir.save(program, str(path), external_data=external)
    return path


_TORCH_ELEM_TYPES = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
                     torch.bfloat16: onnx.TensorProto.BFLOAT16}


def export_seeded(arch: str, size: str, dtype: torch.dtype, out_dir: str | Path, *, seed: int = 0,
                  past_len: int = 5, seq_len: int = 2, threads: int | None = None) -> Path:
    """`export_hf` for a model of any size: weights from `seeded_weights`, written straight into the external data.

    The model is built on the meta device (no weight in memory); every parameter's bytes are generated into
    ``out_dir/model.onnx.data`` (`seeded_weights.write`, keyed by (``seed``, parameter name)), and the parameters
    become views of that file, memory-mapped. transformers' `OnnxExporter` then exports the graph exactly as
    `export_hf` does (``OnnxConfig(dynamic=True)``, the onnxscript optimizer included). Every initializer that is a
    parameter unchanged is written as an external-data reference to its bytes in that file, so the data is written
    once (28.6 GB for the fp16 Qwen1.5-MoE-A2.7B) and never copied; `seeded_weights.regenerate` rebuilds the same
    file from ``model.onnx`` on another machine. The sample cache is zeros instead of a prefill (which would read
    every weight), so the export needs little more memory than the graph.

    Args:
        arch, size: as `build_model`; ``size="full"`` is the real configuration.
        dtype: ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``.
        seed: weight seed (not the same weights as `build_model` with this seed: those come from torch's generator).
            At full size the routers are drawn with `seeded_weights.FULL_ROUTER_STD` (recorded in the metadata).

    Returns:
        The path of ``model.onnx``.

    Raises:
        ValueError: the exporter wrote an initializer that is neither a parameter unchanged nor small (its bytes
            could not be regenerated from the seed), or a parameter or buffer stayed on the meta device.
    """
    if dtype not in _TORCH_ELEM_TYPES:
        raise ValueError(f"dtype {dtype} is not generated; valid: {', '.join(map(str, _TORCH_ELEM_TYPES))}")
    model = build_model(arch, size, dtype, seed, device="meta")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path, data = out_dir / "model.onnx", out_dir / "model.onnx.data"
    params = list(model.named_parameters())
    slots = seeded_weights.layout((name, p.shape, _TORCH_ELEM_TYPES[p.dtype]) for name, p in params)
    if data.exists():
        data.unlink()
    router_std = seeded_weights.FULL_ROUTER_STD if size == "full" else seeded_weights.ROUTER_STD
    nbytes = seeded_weights.write(data, slots, seed, threads=threads, router_std=router_std)
    storage = torch.from_file(str(data), shared=True, size=nbytes, dtype=torch.uint8)
    with torch.no_grad():
        for slot, (name, param) in zip(slots, params):
            owner, _, attr = name.rpartition(".")
            view = storage[slot.offset:slot.offset + slot.length].view(param.dtype).view(param.shape)
            setattr(model.get_submodule(owner), attr, torch.nn.Parameter(view, requires_grad=False))
        for name, module in list(model.named_modules()):
            if any(b.is_meta for b in module.buffers(recurse=False)):  # the rotary embedding's inv_freq
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, type(module)(config=model.config).to(dtype))
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"still on the meta device after loading the seeded weights: {left[:5]}")

    sample = _decode_sample(model, past_len, seq_len, prefill=False)
    program = OnnxExporter().export(model, sample, OnnxConfig(dynamic=True)).program
    by_ptr = {storage.data_ptr() + s.offset: s for s in slots}
    derived: dict[str, tuple[str, tuple[int, ...]]] = {}
    end = nbytes
    for name, value in program.graph.initializers.items():
        tensor = value.const_value
        raw = getattr(tensor, "raw", None)
        slot = by_ptr.get(raw.data_ptr()) if isinstance(raw, torch.Tensor) else None
        if slot is not None and raw.is_contiguous() and raw.numel() * raw.element_size() == slot.length:
            if name != slot.name:
                raise ValueError(f"initializer '{name}' holds parameter '{slot.name}': regenerating it by name "
                                 f"would give other values")
            offset, length = slot.offset, slot.length
        elif tensor is not None and tensor.nbytes > _INLINE_SEEDED_LIMIT:
            # a constant the exporter made from a parameter (a copy, or a transpose its optimizer folded): appended to the
            # data file, and recorded as (parameter, permutation) so that `seeded_weights.regenerate` rebuilds it
            array = tensor.numpy()
            source = _find_transpose(array, model, slots)
            if source is None:
                raise ValueError(f"initializer '{name}' ({tensor.nbytes} bytes) is neither a parameter nor a "
                                 f"transposed parameter; its bytes could not be regenerated from the seed")
            derived[name] = source
            length = array.nbytes
            if source[1] == tuple(range(array.ndim)):  # a copy: the parameter's own bytes
                offset = next(s.offset for s in slots if s.name == source[0])
            else:
                offset = end
                with open(data, "r+b") as f:
                    f.seek(offset)
                    f.write(array.tobytes())
                end = offset + length + (-length) % seeded_weights.ALIGN
        else:
            continue
        value.const_value = onnx_ir.ExternalTensor(data.name, offset, length, tensor.dtype, shape=tensor.shape,
                                                   name=name, base_dir=str(out_dir))
    used_ranges = {(v.const_value.offset, v.const_value.length) for v in program.graph.initializers.values()
                   if isinstance(v.const_value, onnx_ir.ExternalTensor)}
    used = max((offset + length for offset, length in used_ranges), default=0)
    program.metadata_props[seeded_weights.METADATA_KEY] = seeded_weights.metadata(seed, derived, router_std)
    # serialized before the unused parameters are zeroed: constants kept inline may still be views of them
    onnx.save(onnx_ir.serde.serialize_model(program), str(path))
    del program, model, params, sample, storage, by_ptr
    gc.collect()  # no view of the memory map may outlive the truncation (SIGBUS)
    seeded_weights.zero_ranges(data, [(s.offset, s.length) for s in slots if (s.offset, s.length) not in used_ranges])
    os.truncate(data, used + (-used) % seeded_weights.ALIGN)  # as long as `regenerate` makes it
    return path


def _find_transpose(array: np.ndarray, model: torch.nn.Module,
                    slots: Sequence[seeded_weights.TensorSlot]) -> tuple[str, tuple[int, ...]] | None:
    """(parameter name, perm) such that ``array == parameter.permute(perm)`` (the identity for a copy), or None."""
    import itertools

    params = dict(model.named_parameters())
    unsigned = {2: (np.uint16, torch.uint16), 4: (np.uint32, torch.uint32)}  # bit patterns: bfloat16 has no numpy type
    if array.dtype.itemsize not in unsigned:
        return None
    np_bits, torch_bits = unsigned[array.dtype.itemsize]
    array = array.view(np_bits)
    for slot in slots:
        if math.prod(slot.shape) != array.size or len(slot.shape) != array.ndim:
            continue
        param = params[slot.name].detach()
        if param.element_size() != array.dtype.itemsize:
            continue
        source = param.view(torch_bits).numpy()
        for perm in itertools.permutations(range(array.ndim)):
            if tuple(slot.shape[i] for i in perm) != array.shape:
                continue
            view = source.transpose(perm)
            first_row = (0,) * (array.ndim - 1)  # a cheap test before the whole comparison (no copy of the view)
            if np.array_equal(view[first_row][:64], array[first_row][:64]) and np.array_equal(view, array):
                return slot.name, perm
    return None


class _DecodeStep(torch.nn.Module):
    """``(input_ids, attention_mask, position_ids, *past) -> (logits, *present)`` around a causal LM, so that
    ``torch.onnx.export`` sees flat tensors (past/present: keys and values of layer 0, then layer 1, ...)."""

    def __init__(self, model: transformers.PreTrainedModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        cache = transformers.DynamicCache(config=self.model.config)
        for layer in range(len(past) // 2):
            cache.update(past[2 * layer], past[2 * layer + 1], layer)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits, *present)


def export_dynamo(model: transformers.PreTrainedModel, out_dir: str | Path, *, past_len: int = 5,
                  seq_len: int = 2) -> Path:
    """Export one decode step of ``model`` with ``torch.onnx.export(..., dynamo=True)`` to ``out_dir/model.onnx``,
    saved as the exporter writes it.

    Graph inputs: ``input_ids`` int64 [1, S], ``attention_mask`` int64 [1, T], ``position_ids`` int64 [1, S],
    ``past_key_values.{i}.key`` / ``.value`` float [1, Hkv, P, D]; outputs ``logits`` [1, S, vocab] and
    ``present.{i}.key`` / ``.value`` [1, Hkv, T, D] (S, P, T symbolic; the batch is fixed at 1).

    Raises:
        ValueError: ``model`` is on the meta device.
    """
    if model.device.type == "meta":
        raise ValueError("a meta-device model has no weights to save")
    sample = _decode_sample(model, past_len, seq_len)
    past = [t for layer in sample["past_key_values"].layers for t in (layer.keys, layer.values)]
    layers = len(past) // 2
    names = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    seq, total, past_dim = torch.export.Dim("seq"), torch.export.Dim("total"), torch.export.Dim("past")
    dynamic = ({1: seq}, {1: total}, {1: seq}, tuple({2: past_dim} for _ in past))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.onnx"
    with torch.no_grad():
        program = torch.onnx.export(
            _DecodeStep(model).eval(), (sample["input_ids"], sample["attention_mask"], sample["position_ids"], *past),
            input_names=["input_ids", "attention_mask", "position_ids", *names],
            output_names=["logits", *(n.replace("past_key_values", "present") for n in names)],
            dynamo=True, dynamic_shapes=dynamic)
    program.save(str(path))
    return path


@dataclass(frozen=True)
class DecodeSignature:
    """What `greedy_decode` needs to know about a decode-step graph.

    Attributes:
        input_names: graph input names, in graph order.
        output_names: graph output names, in graph order.
        kv_shape_per_layer: (num_kv_heads, head_dim) of every past key/value input [1, Hkv, P, D].
        dtype: numpy dtype of the past key/value inputs (the model's float dtype).
    """

    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    kv_shape_per_layer: tuple[int, int]
    dtype: np.dtype


def decode_signature(onnx_path: str | Path) -> DecodeSignature:
    """Read the `DecodeSignature` of a graph written by `export_hf` (weights are not loaded)."""
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    past = [value for value in graph.input if _KV_NAME.search(value.name)]
    if not past:
        raise ValueError(f"{onnx_path} has no past key/value inputs (names ending in layers.N.keys/values)")
    tensor_type = past[0].type.tensor_type
    # static sizes, or symbolic dims named like integers (transformers' exporter writes the fixed axes that way)
    dims = [d.dim_value if d.HasField("dim_value") else (int(d.dim_param) if d.dim_param.isdigit() else d.dim_param)
            for d in tensor_type.shape.dim]
    if len(dims) != 4 or not (isinstance(dims[1], int) and isinstance(dims[3], int)):
        raise ValueError(f"{past[0].name} should be [1, num_kv_heads, past, head_dim] with static heads and "
                         f"head_dim, got {dims}")
    return DecodeSignature(
        input_names=tuple(value.name for value in graph.input),
        output_names=tuple(value.name for value in graph.output),
        kv_shape_per_layer=(dims[1], dims[3]),
        dtype=np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)),
    )


def present_to_past(input_names: Sequence[str], output_names: Sequence[str]) -> dict[str, str]:
    """Map each present key/value output to the past input it feeds next step, by its ``layers.N.keys|values`` tail.

    Works for ``cache.*``, ``present.*`` or ``output.cache.*`` outputs and ``past_key_values.*`` or ``input.cache.*``
    inputs. Raises ValueError unless the outputs cover every past input exactly once.
    """
    past_by_key = {_KV_NAME.search(name).groups(): name for name in input_names if _KV_NAME.search(name)}
    mapping = {name: past_by_key.get(_KV_NAME.search(name).groups())
               for name in output_names if _KV_NAME.search(name)}
    if None in mapping.values() or sorted(mapping.values()) != sorted(past_by_key.values()):
        raise ValueError(f"present outputs {sorted(mapping)} do not match past inputs {sorted(past_by_key.values())}")
    return mapping


def make_feeds(input_names: Sequence[str], input_ids: np.ndarray, past: Mapping[str, np.ndarray],
               past_len: int) -> dict[str, np.ndarray]:
    """Feeds for one step of a decode-step graph.

    Args:
        input_names: the graph's input names; only these are fed.
        input_ids: int64 [1, S], the new tokens.
        past: past key/value arrays [1, Hkv, past_len, D] by input name.
        past_len: P, number of tokens already in ``past``.

    Returns:
        ``input_ids``; ``attention_mask`` = ones int64 [1, P+S]; ``position_ids`` = arange(P, P+S) int64 [1, S]; and
        ``past``, restricted to ``input_names``.

    Raises:
        ValueError: an input of the graph is neither one of those three nor in ``past``.
    """
    seq_len = input_ids.shape[1]
    available = dict(past)
    available.update(
        input_ids=np.asarray(input_ids, dtype=np.int64),
        attention_mask=np.ones((1, past_len + seq_len), dtype=np.int64),
        position_ids=np.arange(past_len, past_len + seq_len, dtype=np.int64)[None],
    )
    missing = [name for name in input_names if name not in available]
    if missing:
        raise ValueError(f"no value for graph inputs {missing}")
    return {name: available[name] for name in input_names}


def greedy_decode(
    run: Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]],
    input_names: Sequence[str],
    output_names: Sequence[str],
    prompt_ids: Sequence[int],
    steps: int,
    kv_shape_per_layer: tuple[int, int],
    dtype: np.dtype | type,
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy generation of ``steps`` tokens through a decode-step graph (batch 1), runtime-agnostic.

    The first call is a prefill of the whole prompt on an empty past (arrays [1, Hkv, 0, D]); each later call feeds
    the last generated token with the previous call's present outputs as past inputs (mapped by `present_to_past`).

    Args:
        run: runs the graph: feeds by input name -> outputs by output name (at least ``logits`` and the presents).
        input_names: graph input names (``input_ids``, ``attention_mask``, ``position_ids``, past keys/values).
        output_names: graph output names (``logits`` [1, S, vocab] and present keys/values [1, Hkv, P+S, D]).
        prompt_ids: the prompt's token ids (at least one).
        steps: number of tokens to generate (>= 1): one prefill call and ``steps - 1`` decode calls.
        kv_shape_per_layer: (Hkv, D) of every past key/value.
        dtype: dtype of the past keys/values (np.float32, np.float16, ...).

    Returns:
        (generated token ids, the ``logits`` returned by each call: [1, len(prompt), vocab] then [1, 1, vocab] each).
    """
    if not prompt_ids or steps < 1:
        raise ValueError(f"need a non-empty prompt and steps >= 1, got {len(prompt_ids)} tokens, steps={steps}")
    if "logits" not in output_names:
        raise ValueError(f"no 'logits' among the graph outputs {list(output_names)}")
    mapping = present_to_past(input_names, output_names)
    num_kv_heads, head_dim = kv_shape_per_layer
    past = {name: np.zeros((1, num_kv_heads, 0, head_dim), dtype=dtype) for name in mapping.values()}
    past_len = 0
    new_ids = np.asarray([prompt_ids], dtype=np.int64)
    tokens, all_logits = [], []
    for _ in range(steps):
        outputs = run(make_feeds(input_names, new_ids, past, past_len))
        logits = np.asarray(outputs["logits"])
        all_logits.append(logits)
        tokens.append(int(logits[0, -1].argmax()))
        past = {past_name: np.asarray(outputs[present_name]) for present_name, past_name in mapping.items()}
        past_len += new_ids.shape[1]
        new_ids = np.asarray([[tokens[-1]]], dtype=np.int64)
    return tokens, all_logits


def _torch_greedy(model: transformers.PreTrainedModel, prompt_ids: list[int],
                  steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Reference for `greedy_decode`: the same loop on the PyTorch model with its own DynamicCache."""
    tokens, all_logits = [], []
    cache = None
    new_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=new_ids, cache=cache, use_cache=True)
            cache = out.cache
            all_logits.append(out.logits.numpy())
            tokens.append(int(out.logits[0, -1].argmax()))
            new_ids = torch.tensor([[tokens[-1]]])
    return tokens, all_logits


def check_export(model: transformers.PreTrainedModel, onnx_path: str | Path, *, steps: int = 4,
                 prompt_len: int = 5) -> dict:
    """Compare greedy generation on the PyTorch model with the export on ONNX Runtime (CPU EP).

    Both start with a prefill of a random prompt (``prompt_len`` ids from seed 0) on an empty cache, then decode
    ``steps - 1`` more tokens, each feeding back the presents (ORT side: `greedy_decode`).

    Returns:
        ``max_abs_logits``: max |ort - torch| over the logits of every call (prefill and decode positions);
        ``max_rel_logits``: that divided by max |torch logits|;
        ``tokens_torch``, ``tokens_ort``: the generated ids.
    """
    import onnxruntime as ort

    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    tokens_torch, logits_torch = _torch_greedy(model, prompt, steps)

    signature = decode_signature(onnx_path)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    output_names = list(signature.output_names)

    def run(feeds):
        return dict(zip(output_names, session.run(output_names, feeds)))

    tokens_ort, logits_ort = greedy_decode(run, signature.input_names, output_names, prompt, steps,
                                           signature.kv_shape_per_layer, signature.dtype)
    max_abs = max(float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())
                  for a, b in zip(logits_ort, logits_torch))
    max_ref = max(float(np.abs(b.astype(np.float64)).max()) for b in logits_torch)
    return dict(max_abs_logits=max_abs, max_rel_logits=max_abs / max_ref,
                tokens_torch=tokens_torch, tokens_ort=tokens_ort)


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=ARCHS, default="qwen2_moe")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--dtype", choices=list(_DTYPES), default="fp32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True, help="directory for model.onnx")
    parser.add_argument("--weights", choices=("torch", "seeded"), default=None,
                        help="torch: build_model's weights, then a greedy check against PyTorch (default below full "
                             "size); seeded: export_seeded, weights written from --seed tensor by tensor (default "
                             "for --size full; no PyTorch check)")
    args = parser.parse_args(argv)
    weights = args.weights or ("seeded" if args.size == "full" else "torch")
    if weights == "seeded":
        path = export_seeded(args.arch, args.size, _DTYPES[args.dtype], args.out, seed=args.seed)
        data = path.with_name(path.name + ".data")
        print(json.dumps(dict(onnx=str(path), data=str(data), data_bytes=data.stat().st_size,
                              regenerate=f"python examples/seeded_weights.py regenerate {path}"), indent=1))
        return
    model = build_model(args.arch, args.size, _DTYPES[args.dtype], args.seed)
    path = export_hf(model, args.out)
    print(json.dumps(dict(onnx=str(path), **check_export(model, path, steps=args.steps)), indent=1))


if __name__ == "__main__":
    main()
