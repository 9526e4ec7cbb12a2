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
    assert _rules(report) == {"grouped-attention": 2, "attention-reads-loaded-cache": 2, "attention-absorbs-rope": 2}
    mlir = (folder / "model.mlir").read_text()
    d = seed_form.seed_config("fp16", arch="qwen3_moe").head_dim
    # each layer's RoPE pair (Q's and K's norms and rotations) inside its attention: no RoPE dispatch is left
    dispatches = re.findall(rf"flow\.dispatch @attention_rope_exec::@grouped_attention_rope_f16_d{d}\[.*", mlir)
    assert len(dispatches) == 2 and "@rope2_exec" not in mlir and "@rope_exec" not in mlir
    # split-KV: its f32 scratch result, then the rotated K rows; the dispatch site the 12th push constant (the
    # 23rd operand, after 11 bindings), sites 0 and 1; both norms (flags 3)
    assert all(re.search(rf"-> \(tensor<1x\d+x1x{d}xf16>, tensor<\?xf32>\{{%\w+\}}, tensor<1x\d+x1x{d}xf16>\)", line)
               for line in dispatches)
    operands = [re.search(r"\]\(([^)]*)\)", line).group(1).split(", ") for line in dispatches]
    assert sorted(re.match(r"%c(\d+)_i32", ops[22]).group(1) for ops in operands) == ["0", "1"]
    assert all(ops[27] == "%c3_i32" for ops in operands)
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


def _rotary_layer(q_also_read: bool = False, t: int = 1, swapped: bool = False, k_out: bool = False,
                  k_feeds_attention: bool = False):
    """One layer's RoPE pair and attention as ``rope`` and ``attention`` leave them on IREE cuda before
    ``attention-absorbs-rope``, in the ai.rewrite domain (f32, Qwen3's two norms): RotaryEmbedding(Q, cos, sin,
    qw, K_new, kw) -> GroupedAttention(Yq, K, V, mask, Yk, V_new, position) -> Y, and the cache write
    KVCacheUpdate(K, Yk, position) -> K_out. ``q_also_read``: the rotated Q is a graph output too; ``t``: K_new's
    rows (Q has one); ``swapped``: the pair rotates K as X and Q as X2; ``k_out``: the rotated K is a graph output
    too; ``k_feeds_attention``: the attention's V_new is Identity(rotated K) (a reader of it the attention needs)."""
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    vi = lambda name, shape, ty=f: helper.make_tensor_value_info(name, ty, shape)  # noqa: E731
    pair = (["Knew", "cos", "sin", "kw", "Q", "qw"], ["Yk", "Yq"]) if swapped else (["Q", "cos", "sin", "qw", "Knew", "kw"], ["Yq", "Yk"])
    v_new = "Yk_copy" if k_feeds_attention else "Vnew"
    nodes = [helper.make_node("RotaryEmbedding", *pair, domain="ai.rewrite", name="rope", norm_epsilon=1e-6),
             helper.make_node("GroupedAttention", ["Yq", "K", "V", "mask", "Yk", v_new, "position"], ["Y"], domain="ai.rewrite",
                              name="attn", scale=0.125),
             helper.make_node("KVCacheUpdate", ["K", "Yk", "position"], ["K_out"], domain="ai.rewrite", axis=2)]
    if k_feeds_attention:
        nodes.insert(1, helper.make_node("Identity", ["Yk"], ["Yk_copy"], name="copy"))
    inputs = [vi("Q", [1, 8, 1, 64]), vi("cos", [1, 1, 1, 64]), vi("sin", [1, 1, 1, 64]), vi("qw", [64]),
              vi("Knew", [1, 2, t, 64]), vi("kw", [64]), vi("K", [1, 2, 16, 64]), vi("V", [1, 2, 16, 64]),
              vi("mask", [1, 1, 1, 16]), vi("Vnew", [1, 2, t, 64]), vi("position", [1], TensorProto.INT64)]
    outputs = [vi("Y", [1, 8, 1, 64]), vi("K_out", [1, 2, 16, 64])] + ([vi("Yq", [1, 8, 1, 64])] if q_also_read else []) \
        + ([vi("Yk", [1, 2, t, 64])] if k_out else [])
    g = helper.make_graph(nodes, "layer", inputs, outputs, value_info=[vi("Yq", [1, 8, 1, 64]), vi("Yk", [1, 2, t, 64]),
                                                                       vi("Yk_copy", [1, 2, t, 64])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.rewrite", 1)])


@pytest.mark.parametrize("swapped", [False, True])
def test_absorbed_rope_computes_what_the_pair_did(tmp_path, swapped):
    """attention-absorbs-rope on one layer: the pair and the attention become one GroupedAttention with the
    pair's inputs (cos, sin, both norm weights, norm_epsilon; Q's whichever of X and X2 it was) and two outputs,
    its second read by the cache write (and, swapped here, a graph output); lowered for ONNX Runtime, Y, the written
    cache and the rotated K equal the unabsorbed layer's within f32 rounding."""
    from rewrite.core import onnx_io
    from rewrite.core.driver import PluginReport
    from rewrite.plugins.attention.op import GroupedAttention
    from rewrite.plugins.attention.rotary import absorb_rotary
    from rewrite.plugins.kv_cache import KVCacheUpdate
    from rewrite.plugins.rope.op import RotaryEmbedding
    from rewrite.backends import load_runner
    from rewrite.testing.conformance import lower_graph

    rng = np.random.default_rng(0)
    ang = rng.uniform(0, 100, size=(1, 1, 1, 32)).astype(np.float32)
    feeds = {"Q": rng.standard_normal((1, 8, 1, 64)), "cos": np.cos(np.concatenate([ang, ang], -1)),
             "sin": np.sin(np.concatenate([ang, ang], -1)), "qw": 1 + 0.1 * rng.standard_normal(64),
             "Knew": rng.standard_normal((1, 2, 1, 64)), "kw": 1 + 0.1 * rng.standard_normal(64),
             "K": rng.standard_normal((1, 2, 16, 64)), "V": rng.standard_normal((1, 2, 16, 64)),
             "mask": np.where(np.arange(16) <= 5, 0.0, -np.inf).reshape(1, 1, 1, 16), "Vnew": rng.standard_normal((1, 2, 1, 64))}
    feeds = {k: np.asarray(v, np.float32) for k, v in feeds.items()} | {"position": np.array([5], np.int64)}
    ops = [GroupedAttention(), RotaryEmbedding(), KVCacheUpdate()]
    got = {}
    for absorbed in (False, True):
        graph = onnx_io.load(_rotary_layer(swapped=swapped, k_out=swapped))
        report = PluginReport("attention")
        assert absorb_rotary(graph, report, dry_run=not absorbed) == 1
        assert report.rules["attention-absorbs-rope"].matches == 1
        if absorbed:
            (attn,) = graph.nodes_by_op("GroupedAttention", "ai.rewrite")
            assert not graph.nodes_by_op("RotaryEmbedding", "ai.rewrite")
            assert attn.inputs == ["Q", "K", "V", "mask", "Knew", "Vnew", "position", "cos", "sin", "qw", "kw"]
            assert attn.attr("norm_epsilon") == pytest.approx(1e-6) and attn.attr("scale") == 0.125
            (write,) = graph.nodes_by_op("KVCacheUpdate", "ai.rewrite")
            assert write.inputs[1] == attn.outputs[1]
        runner = load_runner(lower_graph(graph, "ort", tmp_path / f"ort{absorbed}", ops))
        got[absorbed] = runner.run(feeds)
    for name in ("Y", "K_out") + (("Yk",) if swapped else ()):
        np.testing.assert_allclose(got[True][name], got[False][name], rtol=1e-5, atol=1e-5)
    assert float(np.abs(got[True]["K_out"][:, :, 5] - feeds["Knew"][:, :, 0]).max()) > 0.1  # the rows are rotated


@pytest.mark.parametrize("layer, why", [
    (dict(q_also_read=True), "the rotated Q 'Yq' is read by more than the attention"),
    (dict(t=2), "the same number of rows T"),
    (dict(k_feeds_attention=True), "the rotated K 'Yk' is read by 'copy' (Identity), which the attention depends on"),
])
def test_absorb_rope_refusals(layer, why):
    """The pair stays apart, with the reason, when its rotated Q is read elsewhere too (a graph output here),
    K_new's rows are not Q's (the tables' row r rotates new row r), or a reader of the rotated K feeds the attention
    (it would then read the attention's own output)."""
    from rewrite.core import onnx_io
    from rewrite.core.driver import PluginReport
    from rewrite.plugins.attention.rotary import absorb_rotary

    graph = onnx_io.load(_rotary_layer(**layer))
    report = PluginReport("attention")
    assert absorb_rotary(graph, report) == 0
    assert len(graph.nodes_by_op("RotaryEmbedding", "ai.rewrite")) == 1
    assert why in json.dumps(report.rules["attention-absorbs-rope"].to_json())


@pytest.mark.parametrize("options, absorbed", [({}, 1), ({"rope": True}, 1), ({"rope": False}, 0)])
def test_rope_option(options, absorbed):
    """The plugin on one layer for IREE cuda: attention-absorbs-rope runs by default and with rope=true, not with
    rope=false (the pair then stays its own launch); for IREE llvm-cpu it never runs."""
    from rewrite.core import onnx_io
    from rewrite.core.driver import PluginReport, RewriteContext
    from rewrite.plugins.attention import Attention

    for target, want in (("cuda", absorbed), ("llvm-cpu", 0)):
        graph = onnx_io.load(_rotary_layer())
        report = PluginReport("attention")
        Attention().run(graph, report, RewriteContext(backend="iree", target=target, options={"attention": options}))
        assert len(graph.nodes_by_op("RotaryEmbedding", "ai.rewrite")) == 1 - want
        assert report.rules.get("attention-absorbs-rope") is None or report.rules["attention-absorbs-rope"].matches == want


@pytest.mark.parametrize("options, message", [({"ropes": True}, "unknown option 'ropes'; options: rope"),
                                              ({"rope": 1}, "option rope=1; true or false expected")])
def test_rope_option_errors(options, message):
    """An unknown option, or rope not a boolean, is one line naming it, before anything is rewritten."""
    from rewrite.core import onnx_io
    from rewrite.core.driver import PluginReport, RewriteContext
    from rewrite.errors import RewriteError
    from rewrite.plugins.attention import Attention

    graph = onnx_io.load(_rotary_layer())
    with pytest.raises(RewriteError, match=re.escape(message)):
        Attention().run(graph, PluginReport("attention"), RewriteContext(backend="iree", target="cuda", options={"attention": options}))
    assert len(graph.nodes_by_op("RotaryEmbedding", "ai.rewrite")) == 1


@pytest.mark.parametrize("backend", ["ort", "iree"])
@pytest.mark.parametrize("case, message", [
    ("one_output", "1 output(s) with the rotary inputs; Y and K_rotated expected"),
    ("no_epsilon", "a norm weight without the attribute norm_epsilon"),
])
def test_rotary_inputs_outside_the_contract(tmp_path, backend, case, message):
    """A GroupedAttention with the rotary inputs but one output, or a norm weight without norm_epsilon, is refused
    by the lowering with one line naming the node (not an IndexError, not a NaN epsilon)."""
    from onnx import TensorProto, helper

    from rewrite.core import onnx_io
    from rewrite.errors import BackendError
    from rewrite.plugins.attention.op import GroupedAttention
    from rewrite.testing.conformance import lower_graph

    f = TensorProto.FLOAT
    vi = lambda name, shape, ty=f: helper.make_tensor_value_info(name, ty, shape)  # noqa: E731
    outs = ["Y"] if case == "one_output" else ["Y", "Kr"]
    attrs = {"scale": 0.125} | ({} if case == "no_epsilon" else {"norm_epsilon": 1e-6})
    node = helper.make_node("GroupedAttention", ["Q", "K", "V", "", "Knew", "Vnew", "position", "cos", "sin", "qw", ""], outs,
                            domain="ai.rewrite", name="attn", **attrs)
    inputs = [vi("Q", [1, 4, 1, 32]), vi("K", [1, 2, 8, 32]), vi("V", [1, 2, 8, 32]), vi("Knew", [1, 2, 1, 32]),
              vi("Vnew", [1, 2, 1, 32]), vi("position", [1], TensorProto.INT64), vi("cos", [1, 1, 1, 32]),
              vi("sin", [1, 1, 1, 32]), vi("qw", [32])]
    outputs = [vi("Y", [1, 4, 1, 32])] + ([vi("Kr", [1, 2, 1, 32])] if len(outs) > 1 else [])
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.rewrite", 1)])
    with pytest.raises(BackendError, match=re.escape(message)) as e:
        lower_graph(onnx_io.load(model), backend, tmp_path / backend, [GroupedAttention()])
    assert "attn" in str(e.value) and "\n" not in str(e.value).strip()
