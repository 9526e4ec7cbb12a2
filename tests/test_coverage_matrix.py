"""A slice of the coverage matrix (examples/coverage_matrix.py) in the test suite: real exports of several MoE
families through both exporters, one ``topk`` and one ``moe`` match per MoE layer, ``verify`` passing and greedy
tokens equal to ONNX Runtime on the original for 16 steps on ONNX Runtime and IREE llvm-cpu. The whole matrix,
with every family and the refusal reasons, is docs/coverage.md."""

from __future__ import annotations

import warnings

import pytest

import coverage_matrix

#: one row per router form, experts form and dtype path; examples/coverage_matrix.py runs every family, exporter
#: and dtype (docs/coverage.md), e.g. mixtral fp32 and olmoe through dynamo, whose paths these rows already take
FUSED = [
    ("qwen3_moe", "dynamo", "batched_mm", "fp32"),   # softmax top-k renormalized; Expand repeats the token rows
    ("mixtral", "hf", "batched_mm", "fp16"),         # softmax, top-k, renormalized; expert outputs cast to f32
                                                     # before the weighting: by value
    ("hunyuan_v1_moe", "hf", "batched_mm", "fp32"),  # Softmax over axis 1 of [T, E], TopK over axis -1
    ("deepseek_v2", "hf", "batched_mm", "fp32"),     # latent attention; softmax top-k router, shared experts
    ("glm4_moe", "dynamo", "batched_mm", "fp32"),    # deepseek_v3's router (below), with unsorted TopKs (sorted=0)
    ("ernie4_5_moe", "dynamo", "batched_mm", "fp32"),  # softmax scores, selection bias, clamped renormalization
    ("qwen2_moe", "hf", "grouped_mm", "fp32"),       # transformers' default experts: sorted tokens, a MatMul per expert
    ("olmoe", "hf", "grouped_mm", "fp32"),
    # fp16 exports that score the router in float32: the experts read the fp16 hidden state the router casts
    ("deepseek_v3", "hf", "batched_mm", "fp16"),     # sigmoid scores, selection bias, grouped top-k, scaling
    ("granitemoe", "hf", "batched_mm", "fp16"),      # raw top-k then softmax; the k expert outputs summed in float32
    # (their fp32 exports route the same way: examples/coverage_matrix.py runs them, docs/coverage.md)
]


@pytest.mark.slow
@pytest.mark.parametrize("family, exporter, experts, dtype", FUSED, ids=["-".join(p) for p in FUSED])
def test_family_fuses_exactly(tmp_path, family_export, family, exporter, experts, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = coverage_matrix.run_row(coverage_matrix.Row(family, exporter, experts, dtype), tmp_path, steps=16,
                                      exported=family_export(family, exporter, experts, dtype))
    assert row.moe_layers == 2
    assert (row.topk, row.moe) == (2, 2), row.reason
    assert row.verify == {"ort": "pass", "iree": "pass"}
    assert row.tokens == {"ort": "equal", "iree": "equal"}


@pytest.mark.slow
def test_sparsemixer_router_fuses_and_decodes_exactly(tmp_path, family_export):
    """PhiMoE's sparsemixer router selects with two masked ArgMax rounds, not a TopK: ``topk`` proves it equal to
    MoERouterTopK(mode=sparsemixer) on random logits, ``moe`` fuses the experts from its weights and ids (the
    routed cut), and the lowered models decode like the original on both backends."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = coverage_matrix.run_row(coverage_matrix.Row("phimoe", "hf", "batched_mm", "fp32"), tmp_path, steps=16,
                                      exported=family_export("phimoe", "hf"))
    assert row.moe_layers == 2
    assert (row.topk, row.moe) == (2, 2), row.reason
    assert row.verify == {"ort": "pass", "iree": "pass"} and row.tokens == {"ort": "equal", "iree": "equal"}


@pytest.mark.slow
def test_index_add_experts_fuse(tmp_path, family_export):
    """JetMoE sorts the (token, expert) pairs by expert, runs one Gemm per expert on its slice and adds the
    weighted outputs into the token rows with ``ScatterND(reduction="add")``: ``fused-moe-index-add`` proves it
    equal to FusedMoE (its integer division, ``Floor`` of floats cast from ids, is exact). Its attention experts
    (MoA) keep their routers fused by ``topk`` and their experts as they are. The MoA's sort of its pairs (a TopK
    of run-time K with its Values unread, which iree-compile cannot compile) becomes ``legalize``'s ranking
    (``full-sort-topk``), so IREE decodes it too."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = coverage_matrix.run_row(coverage_matrix.Row("jetmoe", "hf", "batched_mm", "fp32"), tmp_path, steps=16,
                                      exported=family_export("jetmoe", "hf"))
    assert row.moe_layers == 2
    assert (row.topk, row.moe) == (4, 2), row.reason  # 2 MoE routers and 2 attention-expert routers
    assert row.verify == {"ort": "pass", "iree": "pass"} and row.tokens == {"ort": "equal", "iree": "equal"}


@pytest.mark.slow
def test_export_that_ties_sliding_and_full_past_lengths_is_compared_as_far_as_it_decodes(tmp_path, family_export):
    """gpt-oss through ``torch.onnx.export(dynamo=True)`` declares every layer's past with one dim ``past``; its
    sliding-window layer stops growing at 15 positions while the full layer grows, and the graph then fails
    inside ONNX Runtime. ``generate`` stops before that call with the positions served, and the matrix compares
    the 12 tokens the export can decode."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = coverage_matrix.run_row(coverage_matrix.Row("gpt_oss", "dynamo", "batched_mm", "fp32"), tmp_path, steps=16,
                                      exported=family_export("gpt_oss", "dynamo"))
    assert (row.topk, row.moe) == (2, 2)
    assert row.reason.startswith("generate: after 16 positions the model returned 15 for 'past_key_values.0.key' and 16 "
                                 "for 'past_key_values.1.key'"), row.reason
    assert row.reason.endswith("(12 steps compared)")
    assert row.verify == {"ort": "pass", "iree": "pass"} and row.tokens == {"ort": "equal", "iree": "equal"}


@pytest.mark.slow
def test_export_with_a_fixed_token_count_is_verified_and_refused_by_generate(tmp_path, family_export):
    """Jamba through transformers' exporter fixes ``input_ids`` at 2 tokens per call (a dim named "2"):
    ``verify`` feeds that and passes on both backends; ``generate`` refuses a 5-token prefill with one line."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = coverage_matrix.run_row(coverage_matrix.Row("jamba", "hf", "batched_mm", "fp32"), tmp_path, steps=16,
                                      exported=family_export("jamba", "hf"))
    assert (row.topk, row.moe) == (2, 2)
    assert row.reason.startswith("generate: input 'input_ids' takes exactly 2 token(s) per call"), row.reason
    assert row.verify == {"ort": "pass", "iree": "pass"} and row.tokens == {}
