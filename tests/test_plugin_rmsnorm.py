"""The ``norm`` plugin on real graphs: every RMSNorm of transformers' tiny Qwen3-MoE export and of the seed form
becomes one RMSNorm op (Qwen3's per-head q/k norms go to ``rope`` first, which runs before), greedy tokens equal to
ONNX Runtime on the original on both backends, and on IREE cuda one dispatch per norm (shipped PTX, no GPU)."""

from __future__ import annotations

import re

import pytest

from rewrite.backends.iree_census import census
from rewrite.generate import Generator
from rewrite.pipeline import apply

PROMPT = [11, 22, 33, 44, 55]


def _matches(m, plugin: str) -> int:
    (report,) = [r for r in m.report if r["plugin"] == plugin]
    return report["matches"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_transformers_export_decodes_like_the_original(qwen3_moe_tiny, tmp_path, backend):
    """transformers' Qwen3-MoE export (2 layers): the input and post-attention norms of each layer and the final
    norm (5); the q/k norms are rope's. 16 greedy tokens equal to ONNX Runtime on the original, logits within
    float32 tolerance."""
    plugins = "cast,rope,norm,kv,topk,moe" if backend == "ort" else "cast,rope,norm,legalize,expand,kv,topk,moe"
    m = apply(qwen3_moe_tiny, tmp_path / backend, plugins=plugins, backend=backend, options={"kv": {"max_seq": 32}})
    assert _matches(m, "norm") == 5 and _matches(m, "rope") == 4
    got = Generator(tmp_path / backend).generate(PROMPT, 16)
    ref = Generator.reference(qwen3_moe_tiny).generate(PROMPT, 16)
    assert got.tokens == ref.tokens
    assert max(float(abs(a - b).max() / abs(b).max()) for a, b in zip(got.logits, ref.logits)) < 1e-4


@pytest.mark.slow
def test_seed_form_fp16_cuda_step(tmp_path):
    """The fp16 Qwen1.5 seed form: 5 norms, the original's greedy tokens on IREE llvm-cpu; on IREE cuda (the
    stateful one-token step) one dispatch of the shipped kernel per norm, where iree-compile 3.13 runs each of these
    norms as two (a cast to float32, then the reduction with the scaling)."""
    import seed_form

    model, _ = seed_form.build_seed_model("fp16", arch="qwen2_moe")
    path = seed_form.save_seed_model(model, tmp_path / "seed.onnx")
    m = apply(path, tmp_path / "cpu", plugins="cast,norm,legalize,expand,kv,topk,moe", backend="iree")
    assert _matches(m, "norm") == 5
    assert Generator(tmp_path / "cpu").generate(PROMPT, 8).tokens == Generator.reference(path).generate(PROMPT, 8).tokens
    counts = {}
    for name, plugins in (("own", "cast,rope,legalize,expand,kv,attention,topk,moe"),
                          ("rms", "cast,rope,norm,legalize,expand,kv,attention,topk,moe")):
        apply(path, tmp_path / name, plugins=plugins, backend="iree", target="cuda", options={"stateful": True},
              dims={"seq_len": 1})
        counts[name] = census(tmp_path / name)
    mlir = (tmp_path / "rms" / "model.mlir").read_text()
    assert len(re.findall(r"flow\.dispatch @rmsnorm_exec::@rms_norm_f16\[", mlir)) == 5
    assert counts["own"]["dispatches"] - counts["rms"]["dispatches"] == 5
