"""Tiny random decoders of every MoE family transformers ships, exported the ways users export them.

Each family gets a two-layer configuration with MoE in every layer where the architecture allows (hidden
64, 8 experts, vocabulary 512), so that an export takes seconds. `build` makes the model with decisive
routers (router weights drawn from N(0, 0.5): with the default std the top-k choice is rounding noise) and
the requested experts implementation; `export` writes one decode step with transformers' exporter
(``"hf"``: `qwen_moe.export_hf`) or ``torch.onnx.export(dynamo=True)`` (``"dynamo"``:
`qwen_moe.export_dynamo`), untouched.

CLI::

    python examples/moe_families.py --family mixtral --exporter dynamo --experts batched_mm --out out/mixtral
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

import qwen_moe

ROUTER_STD = 0.5
EXPORTERS = ("hf", "dynamo")
#: transformers' experts implementations: ``grouped_mm`` is its default, ``batched_mm`` gathers stacked weights
EXPERTS = ("batched_mm", "grouped_mm")

_COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, tie_word_embeddings=False)
_HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               layer_types=["linear_attention", "full_attention"])


def _configs() -> dict[str, Callable[[], transformers.PretrainedConfig]]:
    T = transformers
    c = _COMMON
    return {
        # softmax top-k, not renormalized, sigmoid-gated shared expert
        "qwen2_moe": lambda: T.Qwen2MoeConfig(**c, intermediate_size=128, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=4,
                                              norm_topk_prob=False, qkv_bias=True),
        # softmax top-k, renormalized
        "qwen3_moe": lambda: T.Qwen3MoeConfig(**c, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
        "qwen3_5_moe": lambda: T.Qwen3_5MoeTextConfig(**c, head_dim=16, moe_intermediate_size=32,
                                                      shared_expert_intermediate_size=32, num_experts=8,
                                                      num_experts_per_tok=2, **_HYBRID),
        "qwen3_next": lambda: T.Qwen3NextConfig(**c, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                                shared_expert_intermediate_size=32, num_experts=8,
                                                num_experts_per_tok=2, **_HYBRID),
        # top-k then softmax
        "mixtral": lambda: T.MixtralConfig(**c, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
        "olmoe": lambda: T.OlmoeConfig(**c, intermediate_size=32, num_experts=8, num_experts_per_tok=2),
        "flex_olmo": lambda: T.FlexOlmoConfig(**c, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                              pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "granitemoe": lambda: T.GraniteMoeConfig(**c, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
        "phimoe": lambda: T.PhimoeConfig(**c, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
        "jetmoe": lambda: T.JetMoeConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2,
                                         kv_channels=16, intermediate_size=32, num_local_experts=8,
                                         num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False),
        "hunyuan_v1_moe": lambda: T.HunYuanMoEV1Config(**c, head_dim=16, intermediate_size=32, num_experts=8,
                                                       moe_topk=2),
        "ernie4_5_moe": lambda: T.Ernie4_5_MoeConfig(**c, intermediate_size=128, moe_intermediate_size=32,
                                                     moe_num_experts=8, moe_k=2, moe_layer_start_index=0),
        "deepseek_v2": lambda: T.DeepseekV2Config(**{**c, "num_key_value_heads": 4}, intermediate_size=128,
                                                  moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                                                  num_experts_per_tok=2, first_k_dense_replace=0, kv_lora_rank=16,
                                                  q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                  v_head_dim=16),
        # sigmoid scores, selection bias, grouped top-k, routed scaling factor, shared experts
        "deepseek_v3": lambda: T.DeepseekV3Config(**{**c, "num_key_value_heads": 4}, intermediate_size=128,
                                                  moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                                                  num_experts_per_tok=2, n_group=2, topk_group=1,
                                                  first_k_dense_replace=0, q_lora_rank=32, kv_lora_rank=16,
                                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
        "dots1": lambda: T.Dots1Config(**c, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                       n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                                       topk_group=1, first_k_dense_replace=0),
        "glm4_moe": lambda: T.Glm4MoeConfig(**c, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                                            topk_group=1, first_k_dense_replace=0),
        # top-k then softmax, clamped SwiGLU with interleaved gate/up and expert biases
        "gpt_oss": lambda: T.GptOssConfig(**c, head_dim=16, intermediate_size=32, num_local_experts=8,
                                          num_experts_per_tok=2, sliding_window=16,
                                          layer_types=["sliding_attention", "full_attention"]),
        # hybrid Mamba / attention with MoE
        "jamba": lambda: T.JambaConfig(**c, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                       expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2,
                                       attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                                       use_mamba_kernels=False),
    }


FAMILIES = tuple(_configs())


def build(family: str, *, experts: str = "batched_mm", dtype: torch.dtype = torch.float32,
          seed: int = 0) -> transformers.PreTrainedModel:
    """The tiny random ``family`` causal LM in eval mode with the ``experts`` implementation.

    Raises:
        ValueError: unknown family or experts implementation.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; valid: {', '.join(FAMILIES)}")
    if experts not in EXPERTS:
        raise ValueError(f"unknown experts implementation {experts!r}; valid: {', '.join(EXPERTS)}")
    config = _configs()[family]()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(experts)
    model.config._experts_implementation = experts
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "router.weight", "block_sparse_moe.gate.weight")) or ".router." in name:
                param.normal_(0.0, ROUTER_STD)
        # biases initialised to zero (expert biases of gpt-oss, selection biases of DeepSeek-V3 and Ernie 4.5)
        # get random values, so that every check sees them at work
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if "bias" in name and tensor.is_floating_point() and tensor.numel() and not tensor.any():
                tensor.normal_(0.0, 0.1)
    return model.to(dtype).eval()


def export(model: transformers.PreTrainedModel, exporter: str, out_dir: str | Path) -> Path:
    """Export one decode step of ``model`` with ``exporter`` (``"hf"`` or ``"dynamo"``); returns the .onnx path."""
    if exporter == "hf":
        return qwen_moe.export_hf(model, out_dir)
    if exporter == "dynamo":
        return qwen_moe.export_dynamo(model, out_dir)
    raise ValueError(f"unknown exporter {exporter!r}; valid: {', '.join(EXPORTERS)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--exporter", choices=EXPORTERS, default="hf")
    parser.add_argument("--experts", choices=EXPERTS, default="batched_mm")
    parser.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    model = build(args.family, experts=args.experts, dtype=torch.float16 if args.dtype == "fp16" else torch.float32)
    print(export(model, args.exporter, args.out))


if __name__ == "__main__":
    main()
