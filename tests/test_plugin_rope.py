"""The ``rope`` plugin on real graphs: one RotaryEmbedding per rotated tensor (Q and K of each layer) on
transformers' export of the tiny Qwen3-MoE and on the seed forms (Qwen3's q/k RMSNorm taken into the op, Qwen1.5's
plain RoPE), greedy tokens equal to ONNX Runtime on the original on both backends, and on IREE cuda the step's
dispatches counted from the compiler (shipped PTX, no GPU)."""

from __future__ import annotations

import json
import re

import onnx
import pytest

from rewrite.backends.iree_census import census
from rewrite.core import onnx_io
from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.driver import RewriteContext, run_plugin
from rewrite.core.shapes import infer_shapes
from rewrite.explain import preview
from rewrite.generate import Generator
from rewrite.pipeline import apply
from rewrite.plugins.rope import Rope

PROMPT = [11, 22, 33, 44, 55]


def _ropes(path) -> list[int]:
    """Input counts of the RotaryEmbedding ops the plugin makes of ``path`` (4: with the norm's weight)."""
    g = onnx_io.load(path)
    infer_shapes(g)
    run_plugin(g, Rope(), RewriteContext(backend="iree"))
    return [len(n.inputs) for n in g.nodes_by_op("RotaryEmbedding", DOMAIN)]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_transformers_export_decodes_like_the_original(qwen3_moe_tiny, tmp_path, backend):
    """transformers' Qwen3-MoE export: Q and K of both layers, each with its q_norm/k_norm taken in; 16 greedy tokens
    equal to ONNX Runtime on the original, logits within float32 tolerance."""
    assert _ropes(qwen3_moe_tiny) == [4, 4, 4, 4]
    plugins = "cast,rope,kv,attention,topk,moe" if backend == "ort" else "cast,rope,legalize,expand,kv,attention,topk,moe"
    m = apply(qwen3_moe_tiny, tmp_path / backend, plugins=plugins, backend=backend, options={"kv": {"max_seq": 32}})
    (report,) = [r for r in m.report if r["plugin"] == "rope"]
    assert report["matches"] == 4
    got = Generator(tmp_path / backend).generate(PROMPT, 16)
    ref = Generator.reference(qwen3_moe_tiny).generate(PROMPT, 16)
    assert got.tokens == ref.tokens
    assert max(float(abs(a - b).max() / abs(b).max()) for a, b in zip(got.logits, ref.logits)) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("arch, inputs", [("qwen3_moe", [4, 4, 4, 4]), ("qwen2_moe", [3, 3, 3, 3])])
def test_seed_form_fp16_on_iree(tmp_path, arch, inputs):
    """The fp16 seed forms (the rotation by Split, the norm between Casts to float32 and back in Qwen3): the
    original's greedy tokens on IREE llvm-cpu."""
    import seed_form

    model, _ = seed_form.build_seed_model("fp16", arch=arch)
    path = seed_form.save_seed_model(model, tmp_path / "seed.onnx")
    assert _ropes(path) == inputs
    apply(path, tmp_path / "iree", plugins="cast,rope,legalize,expand,kv,attention,topk,moe", backend="iree")
    assert Generator(tmp_path / "iree").generate(PROMPT, 8).tokens == Generator.reference(path).generate(PROMPT, 8).tokens


@pytest.mark.slow
def test_cuda_step_launches(seed_fp16_qwen3_cuda_step, tmp_path):
    """iree --target cuda, the stateful one-token step of the fp16 Qwen3 seed form: Q and K paired by
    rotary-embedding-pair, the pair then inside the layer's attention dispatch (attention-absorbs-rope), so no RoPE
    dispatch is left: 12 fewer dispatches per layer than iree-compile 3.13 makes of the q/k norms and RoPE with its
    own projections (11 with the pair's own dispatch)."""
    import seed_form

    # with rope: the shared folder of cast,rope,legalize,expand,kv,attention,topk,moe; without it, lowered here
    folder, m, with_rope = seed_fp16_qwen3_cuda_step
    assert sorted(m.plugins) == sorted(["cast", "rope", "legalize", "expand", "kv", "attention", "topk", "moe"])
    apply(folder.parent / "seed.onnx", tmp_path / "own", plugins="cast,legalize,expand,kv,attention,topk,moe",
          backend="iree", target="cuda", options={"stateful": True}, dims={"seq_len": 1})
    counts = {"rope": with_rope, "own": census(tmp_path / "own")}
    mlir = (folder / "model.mlir").read_text()
    layers = seed_form.seed_config("fp16", arch="qwen3_moe").layers
    assert "@rope2_exec::" not in mlir and "@rope_exec::" not in mlir
    assert len(re.findall(r"flow\.dispatch @attention_rope_exec::@grouped_attention_rope_f16_d\d+\[", mlir)) == layers
    assert counts["own"]["dispatches"] - counts["rope"]["dispatches"] == 12 * layers


def test_cuda_target_refuses_head_sizes_the_kernel_lacks(tmp_path):
    """For --target cuda the rule leaves a RoPE of head size 16 alone (the kernel is built for 32 to 256), with the
    reason; for llvm-cpu it matches."""
    from rewrite.plugins.rope.cases import rope_graph

    path = tmp_path / "d16.onnx"
    onnx.save(rope_graph(d=16), path)
    for target, matches in (("cuda", 0), ("llvm-cpu", 1)):
        (report,) = preview(path, "rope", backend="iree", target=target)
        assert report.to_json()["matches"] == matches
    assert "the CUDA kernel is built for (32, 64, 128, 256)" in json.dumps(preview(path, "rope", backend="iree", target="cuda")[0].to_json())
