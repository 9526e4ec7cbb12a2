"""The tiny Qwen3-MoE decoder exported by optimum (``optimum-cli export onnx``), the exporter most users run.

optimum-onnx 0.1.0 needs transformers < 4.58 and exports through ``torch.onnx.export`` (TorchScript): its patch
of Qwen3-MoE's block loops over every expert, one module each (NonZero of the expert's mask, the expert's three
MatMuls, ``ScatterElements`` of its rows into zeros, a chain of Adds), unlike transformers' own exporter. Run in
an environment of its own (the project's needs transformers 5)::

    python -m venv /tmp/ov && . /tmp/ov/bin/activate
    pip install "transformers>=4.57,<4.58" optimum-onnx==0.1.0 onnx onnxruntime torch
    python examples/optimum_export.py --out /tmp/optimum_qwen3_moe

``tests/data/optimum_qwen3_moe_tiny.onnx`` is the ``model.onnx`` this wrote with transformers 4.57.6,
optimum-onnx 0.1.0 and torch 2.14.1, untouched.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

#: the configuration of ``moe_families``' qwen3_moe (hidden 64, 8 experts, top-2 renormalized, vocabulary 512)
CONFIG = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, tie_word_embeddings=False, head_dim=16, intermediate_size=128,
              moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
ROUTER_STD = 0.5  #: router weights drawn from N(0, 0.5), as moe_families does: decisive top-k choices


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder of the export (model.onnx)")
    args = parser.parse_args(argv)
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**CONFIG))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, ROUTER_STD)
    checkpoint = args.out.with_name(args.out.name + ".hf")
    model.eval().save_pretrained(checkpoint)
    subprocess.run([sys.executable, "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", str(checkpoint),
                    "--task", "text-generation-with-past", str(args.out)], check=True)
    print(args.out / "model.onnx")


if __name__ == "__main__":
    main()
