"""The ``attention`` plugin on real graphs: one GroupedAttention per layer on transformers' export of the tiny
Qwen3-MoE (grouped K/V heads, dynamic cache made static by ``kv``) and on the seed form (fp16, the Cast pair after
the Softmax), greedy tokens equal to ONNX Runtime on the original on both backends, and the CUDA lowering compiles
(shipped PTX, no GPU)."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest

from rewrite.explain import preview
from rewrite.generate import Generator
from rewrite.pipeline import apply

PROMPT = [11, 22, 33, 44, 55]
PLUGINS = {"ort": "cast,kv,attention,topk,moe", "iree": "cast,legalize,expand,kv,attention,topk,moe"}


def _rules(report: dict) -> dict[str, int]:
    """Matches by rule of one plugin's report (``apply``'s manifest entry or ``preview``'s JSON)."""
    return {r["rule"]: r["matches"] for r in report["rules"]}


def _count(folder, op_type: str) -> int:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return sum(n.op_type == op_type for n in model.graph.node)


@pytest.mark.slow
@pytest.mark.parametrize("backend, max_seq", [("ort", 32), ("iree", 32), ("iree", None)])
def test_transformers_export_decodes_like_the_original(qwen3_moe_tiny, tmp_path, backend, max_seq):
    """transformers' Qwen3-MoE export (4 query heads per K/V head, repeat_kv's Expand): one match per layer, no
    Softmax left on IREE (on ONNX Runtime the decomposition comes back), 16 greedy tokens equal to ONNX Runtime on
    the original and logits within float32 tolerance; with ``kv``'s static cache, and with the export's growing
    cache (S and the mask's last dim one symbolic dim, dynamic in the lowered module). The attention keeps reading
    the written cache (reading it as loaded plus the new rows is for IREE cuda: test_cuda_lowering_compiles)."""
    options = {"kv": {"max_seq": max_seq}} if max_seq else {}
    m = apply(qwen3_moe_tiny, tmp_path / backend, plugins=PLUGINS[backend], backend=backend, options=options)
    (report,) = [r for r in m.report if r["plugin"] == "attention"]
    assert _rules(report) == {"grouped-attention": 2, "attention-reads-loaded-cache": 0}
    if backend == "iree":
        assert _count(tmp_path / backend, "GroupedAttention") == 2 and _count(tmp_path / backend, "Softmax") == 0
    else:
        assert _count(tmp_path / backend, "GroupedAttention") == 0 and _count(tmp_path / backend, "Softmax") == 2
    got = Generator(tmp_path / backend).generate(PROMPT, 16)
    ref = Generator.reference(qwen3_moe_tiny).generate(PROMPT, 16)
    assert got.tokens == ref.tokens
    assert max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got.logits, ref.logits)) < 1e-4


@pytest.mark.slow
def test_seed_form_fp16_on_iree(tmp_path):
    """The seed form of Qwen3 in fp16 (grouped heads, a [1, 1, T, S] mask over the static cache, the Softmax's
    Cast pair): one match per layer and the original's greedy tokens on IREE llvm-cpu."""
    import seed_form

    model, _ = seed_form.build_seed_model("fp16", arch="qwen3_moe")
    path = seed_form.save_seed_model(model, tmp_path / "seed.onnx")
    m = apply(path, tmp_path / "iree", plugins=PLUGINS["iree"], backend="iree")
    (report,) = [r for r in m.report if r["plugin"] == "attention"]
    assert _rules(report) == {"grouped-attention": 2, "attention-reads-loaded-cache": 0}
    got = Generator(tmp_path / "iree").generate(PROMPT, 8)
    ref = Generator.reference(path).generate(PROMPT, 8)
    assert got.tokens == ref.tokens


@pytest.mark.slow
def test_cuda_lowering_compiles(seed_fp16_qwen3_cuda_step):
    """iree --target cuda on the fp16 Qwen3 seed form: one dispatch of the shipped PTX kernel per layer for its
    head size, the mask's strides found at run time, and the module compiles (no GPU). In the stateful step
    iree-compile copies no cache at all: each attention reads the cache as loaded plus the new rows, and the
    writes come after every read (IREE's own attention makes it copy the global before each layer's write, an
    attention reading the written cache a slot per layer: BENCHMARKS.md, "attention on CUDA")."""
    import seed_form

    # a decode step, with rope: the rotated keys then come from a kernel iree-compile cannot fuse into the cache
    # write, so the write stays after the reads (a dynamic step, or one with IREE's own RoPE fused into the write,
    # copies the whole state global once instead): the plugins cast,rope,legalize,expand,kv,attention,topk,moe
    folder, m, counts = seed_fp16_qwen3_cuda_step
    (report,) = [r for r in m.report if r["plugin"] == "attention"]
    assert _rules(report) == {"grouped-attention": 2, "attention-reads-loaded-cache": 2}
    mlir = (folder / "model.mlir").read_text()
    d = seed_form.seed_config("fp16", arch="qwen3_moe").head_dim
    dispatches = re.findall(rf"flow\.dispatch @attention_exec::@grouped_attention_f16_d{d}\[.*", mlir)
    assert len(dispatches) == 2
    # split-KV: its f32 scratch result and the dispatch site as the last push constant, sites 0 and 1
    assert all(re.search(rf"-> \(tensor<1x\d+x1x{d}xf16>, tensor<\?xf32>", line) for line in dispatches)
    assert sorted(re.search(r", %c(\d+)_i32(?:_\d+)?\) :", line).group(1) for line in dispatches) == ["0", "1"]
    assert any(k.startswith("kernels/attention_cuda-") for k in m.kernel_objects)
    assert (folder / "model.vmfb").stat().st_size > 0
    # the 4 cache writes (K and V of 2 layers, consecutive slots of one global) are one state-rows dispatch
    assert len(re.findall(r"flow\.dispatch @rewrite_state_rows_m4::@state_rows_m4\[", mlir)) == 1
    assert "call @rewrite_kv_state_write_" not in mlir and mlir.count("call @rewrite_kv_state_rows_") == 1
    assert any(k.startswith("kernels/state_rows_cuda-") for k in m.kernel_objects)
    (state,) = m.state
    slot_bytes = int(np.prod(state["shape"][1:])) * 2  # one cache (K or V of a layer), f16
    assert counts["copy_bytes"] < slot_bytes  # what is left: a few hundred bytes of RoPE tables
    assert counts["bindings"] >= counts["dispatches"] + 5  # every dispatch reads one at least; the state rows 6


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["hf", "dynamo"])
def test_sdpa_export_decodes_like_the_original(tmp_path, exporter):
    """transformers' default attention (torch's scaled_dot_product_attention, which the exporters decompose into
    Q and K^T each scaled by sqrt(scale), K^T through a [B * H, S, D] view; dynamo=True adds a Where(IsNaN) after
    the Softmax) on a tiny Llama: one match per layer and 16 greedy tokens equal to ONNX Runtime on the original,
    on both backends; for IREE cuda the NaN guard, which the kernel lacks, is refused at the match."""
    import warnings

    import moe_families
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)  # head size 32: one the CUDA kernel takes
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        assert model.config._attn_implementation == "sdpa"
        path = moe_families.export(model, exporter, tmp_path / "export")
    ref = Generator.reference(path).generate(PROMPT, 16).tokens
    for backend, plugins in (("ort", "attention"), ("iree", "legalize,attention")):
        m = apply(path, tmp_path / backend, plugins=plugins, backend=backend)
        assert [r["matches"] for r in m.report if r["plugin"] == "attention"] == [2]
        assert Generator(tmp_path / backend).generate(PROMPT, 16).tokens == ref
    (cuda,) = preview(path, "attention", backend="iree", target="cuda")
    (rule,) = [r for r in cuda.to_json()["rules"] if r["rule"] == "grouped-attention"]
    assert rule["matches"] == (2 if exporter == "hf" else 0)
    assert exporter == "hf" or "the CUDA kernel does not zero NaN rows" in json.dumps(rule["refusals"])


def test_cuda_target_refuses_head_sizes_the_kernel_lacks(tmp_path):
    """For --target cuda the rule leaves an attention core of head size 16 alone (the kernel is built for 32, 64,
    128 and 256), with the reason; for llvm-cpu it matches."""
    from rewrite.plugins.attention.cases import attention_core

    path = tmp_path / "d16.onnx"
    onnx.save(attention_core(d=16), path)
    for target, matches in (("cuda", 0), ("llvm-cpu", 1)):
        (report,) = preview(path, "attention", backend="iree", target=target)
        assert _rules(report.to_json())["grouped-attention"] == matches
    assert "the CUDA kernel is built for (32, 64, 128, 256)" in json.dumps(preview(path, "attention", backend="iree", target="cuda")[0].to_json())


def test_cuda_splits_of_a_decode_row():
    """Split-KV on the CUDA kernel: a decode row's key positions over CUDA_SPLIT_WORKGROUPS // (B * Hq) workgroups
    (the seeds' models: 4 for Qwen3-30B-A3B's 32 query heads, 8 for Qwen1.5-MoE's 16), never fewer positions than
    warps per workgroup, and one split for prefill rows or more rows than the tickets cover."""
    from rewrite.plugins.attention.op import CUDA_SPLIT_ROWS, cuda_splits

    assert cuda_splits(1, 32, 1, 256) == 4 and cuda_splits(1, 16, 1, 4096) == 8
    assert cuda_splits(1, 4, 1, 32) == 2  # a tiny model's 32-slot cache: 16 warps a split
    assert cuda_splits(1, 4, 1, 8) == 1
    assert cuda_splits(1, 32, 128, 256) == 1  # prefill: its rows fill the GPU already
    assert cuda_splits(2, 200, 1, 4096) == 1  # 400 rows: no workgroups left to split over
    assert cuda_splits(CUDA_SPLIT_ROWS, 1, 1, 4096) == 1 and cuda_splits(64, 1, 1, 4096) == 2
