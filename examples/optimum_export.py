"""Tiny MoE decoders exported by optimum (``optimum-cli export onnx``), the exporter most users run.

optimum-onnx 0.1.0 needs transformers < 4.58 and exports through ``torch.onnx.export`` (TorchScript), with its
own patches of the MoE blocks, unlike transformers' own exporter:

* ``qwen3_moe``: a loop over every expert, one module each (NonZero of the expert's mask, the expert's three
  MatMuls, ``ScatterElements`` of its rows into zeros, a chain of Adds);
* ``gpt_oss``: every expert on every token (batched MatMuls over the stacked weights), weighted by the routing
  scattered into zeros [T, E], summed over the experts;
* ``deepseek_v3``: a loop like Qwen3-MoE's that keeps only the experts the dummy input routes to (a traced ``if``
  per expert; optimum's own validation reports the difference): not an MoE over all experts, which ``moe`` refuses.

Run in an environment of its own (the project's needs transformers 5)::

    python -m venv /tmp/ov && . /tmp/ov/bin/activate
    pip install "transformers>=4.57,<4.58" optimum-onnx==0.1.0 onnx onnxruntime torch
    python examples/optimum_export.py --family qwen3_moe --out /tmp/optimum_qwen3_moe

``tests/data/optimum_<family>_tiny.onnx`` are the ``model.onnx`` files this wrote with transformers 4.57.6,
optimum-onnx 0.1.0 and torch 2.14.1, untouched. The DeepSeek-V3 export differs from run to run (optimum's dummy
input is random, and with it the experts kept); the file there kept 7 of 8 experts in layer 0 and 4 in layer 1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

_COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, tie_word_embeddings=False)
#: the configurations of ``moe_families`` (hidden 64, 8 experts, vocabulary 512)
CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(_COMMON, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "gpt_oss": ("GptOssConfig", dict(_COMMON, head_dim=16, intermediate_size=32, num_local_experts=8,
                                     num_experts_per_tok=2, sliding_window=16,
                                     layer_types=["sliding_attention", "full_attention"])),
    "deepseek_v3": ("DeepseekV3Config", dict(_COMMON, num_key_value_heads=4, intermediate_size=128,
                                              moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                              n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=0,
                                              kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                              qk_nope_head_dim=8, v_head_dim=8)),
}
ROUTER_STD = 0.5  #: router weights drawn from N(0, 0.5), as moe_families does: decisive top-k choices


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(CONFIGS), default="qwen3_moe")
    parser.add_argument("--out", type=Path, required=True, help="folder of the export (model.onnx)")
    args = parser.parse_args(argv)
    import torch
    import transformers

    config_class, config = CONFIGS[args.family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "router.weight")):
                param.normal_(0.0, ROUTER_STD)
            # zero-initialised biases (gpt-oss's experts') get random values, so that the checks see them at work
            if "bias" in name and param.is_floating_point() and not param.any():
                param.normal_(0.0, 0.1)
    checkpoint = args.out.with_name(args.out.name + ".hf")
    model.eval().save_pretrained(checkpoint)
    subprocess.run([sys.executable, "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", str(checkpoint),
                    "--task", "text-generation-with-past", str(args.out)], check=True)
    print(args.out / "model.onnx")


if __name__ == "__main__":
    main()
