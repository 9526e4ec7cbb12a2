"""IREE stateful decode (llvm-cpu): the KV cache in util.globals, the function taking ids and position.

On the tiny Qwen1.5-MoE and Qwen3-MoE exports (fp32) and the seed form, greedy
tokens equal ONNX Runtime running the original model for 32 steps, logits within 1e-4 relative, and the
module's cache equals ORT's. ``topk`` replaces IREE's own router TopK, which is wrong inside these models.
"""

from __future__ import annotations


import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import qwen_moe
from rewrite.cli import cli
from rewrite.backends.iree_stateful import group_sizes
from rewrite.errors import BackendError, InputError
from rewrite.generate import GenerationError, Generator
from rewrite.pipeline import apply

PROMPT = [3, 141, 59, 26, 5]
STEPS = 32
MAX_SEQ = 40
#: a deep decoder: the fewest layers whose caches need two globals (17 layers = 34 caches, more than a global's
#: MAX_SLOTS_PER_GLOBAL = 32), each without the shared expert and the q/k/v biases (fewer dispatches to compile)
DEEP = dict(layers=17, hidden=64, heads=2, kv_heads=2, head_dim=32, experts=4, top_k=2, moe_intermediate=64,
            shared_intermediate=0, attn_bias=False, vocab=160, max_seq=16, block_size=32)


SOURCES = {"qwen2_moe": "qwen2_moe_tiny", "qwen3_moe": "qwen3_moe_tiny", "seed": "seed_fp32"}  #: name -> source fixture


@pytest.fixture(scope="module")
def _lowered_folders() -> dict:
    return {}


@pytest.fixture
def lowered(request, _lowered_folders, tmp_path_factory):
    """name -> (stateful IREE folder, ORT folder of the original model), each lowered once per module on first use:
    an xdist worker compiles only the models of the tests it runs."""

    class Lowered:
        def __getitem__(self, name):
            if name not in _lowered_folders:
                path = request.getfixturevalue(SOURCES[name])
                path = path[0] if name == "seed" else path
                base = tmp_path_factory.mktemp(name)
                plugins = "cast,legalize,topk,expand,kv"
                options = {"stateful": True} if name == "seed" else {"stateful": True, "kv": {"max_seq": MAX_SEQ}}
                apply(path, base / "iree", plugins=plugins, backend="iree", options=options)
                apply(path, base / "ort", backend="ort")
                _lowered_folders[name] = (base / "iree", base / "ort")
            return _lowered_folders[name]

    return Lowered()


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe", "seed"])
def test_stateful_iree_decodes_like_ort_on_the_original(lowered, name):
    folder, ort_folder = lowered[name]
    gen, ref_gen = Generator(folder), Generator(ort_folder)
    assert [d["name"] for d in gen.manifest.inputs if "past" in d["name"]] == []
    assert [d["name"] for d in gen.manifest.outputs] == ["logits"]
    (state,) = gen.manifest.state
    entries = [e["input"] for e in state["entries"]]
    assert len(entries) == 4 and state["shape"][0] == 4 and state["axis"] == 2
    # each layer's new rows go straight into the global: no whole-entry copy back at the end
    mlir = (folder / "model.mlir").read_text()
    # every present is written as its new rows (a write helper per cache), none copied back whole (no put helper)
    assert mlir.count("func.func private @rewrite_kv_state_write_") == 4 and "@rewrite_kv_state_put_" not in mlir
    ref = ref_gen.generate(PROMPT, STEPS)
    got = gen.generate(PROMPT, STEPS)
    assert got.tokens == ref.tokens
    rel = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got.logits, ref.logits))
    assert rel < 1e-4
    # the module's cache holds what ORT's caches hold; slots never written stay zero
    kv = gen.runner.read_state()[state["name"]]
    written = len(PROMPT) + STEPS - 1
    for k, past in enumerate(entries):
        r = ref_gen.past[past][:, :, :written]
        np.testing.assert_allclose(kv[k][:, :, :written], r, rtol=1e-4, atol=1e-5 * np.abs(r).max())
        assert not kv[k][:, :, written:].any()
    # generate() resets the state: the same prompt gives the same tokens again
    assert gen.generate(PROMPT, 4).tokens == ref.tokens[:4]


def test_position_guard_and_reset(lowered):
    gen = Generator(lowered["qwen2_moe"][0])
    gen.step(np.array([PROMPT]))
    with pytest.raises(GenerationError, match=f"position 5 \\+ 36 token\\(s\\) exceeds the cache's {MAX_SEQ} positions"):
        gen.step(np.arange(36)[None])
    with pytest.raises(GenerationError, match="need 41 cache positions; the cache has 40"):
        gen.generate(list(range(10)), 32)
    gen.reset()
    assert gen.position == 0 and not gen.runner.read_state()["rewrite_kv_state"].any()
    # compiled without the importer's shape assertions: an empty call is refused before the runtime sees it
    assert "--iree-opt-strip-assertions" in (lowered["qwen2_moe"][0] / "compile.log").read_text().splitlines()[0]
    with pytest.raises(InputError, match="input 'input_ids' has shape \\[1, 0\\]; a stateful module takes at least one token"):
        gen.step(np.zeros((1, 0), np.int64))


def test_cli_generate_matches_the_python_api(lowered):
    folder, ort_folder = lowered["seed"]
    res = CliRunner().invoke(cli, ["generate", str(folder), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "8"])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[0] == ",".join(map(str, Generator(ort_folder).generate(PROMPT, 8).tokens))


def test_stateful_needs_a_static_cache(qwen2_moe_tiny, tmp_path):
    with pytest.raises(BackendError, match="a static, unchanged type is needed"):
        apply(qwen2_moe_tiny, tmp_path / "x", plugins="topk", backend="iree", options={"stateful": True})
    assert not (tmp_path / "x").exists()


def test_a_negative_cache_axis_is_the_same_axis(lowered, tmp_path):
    """A KVCacheUpdate written with ``axis=-2`` (the op normalizes it against the cache's rank, as the
    ScatterElements it replaces does) moves into module state on the same sequence axis: the same tokens."""
    import onnx

    folder, ort_folder = lowered["qwen2_moe"]
    model = onnx.load(folder / "model.onnx")  # the rewritten graph, KVCacheUpdate still abstract
    updates = [n for n in model.graph.node if n.op_type == "KVCacheUpdate"]
    assert updates
    for n in updates:
        (axis,) = [a for a in n.attribute if a.name == "axis"]
        assert axis.i == 2
        axis.i = -2
    onnx.save(model, tmp_path / "negative.onnx")
    m = apply(tmp_path / "negative.onnx", tmp_path / "iree", backend="iree", options={"stateful": True})
    assert m.state[0]["axis"] == 2
    assert Generator(tmp_path / "iree").generate(PROMPT, 8).tokens == Generator(ort_folder).generate(PROMPT, 8).tokens


@given(n=st.integers(1, 600), cap=st.integers(1, 64))
@settings(max_examples=300, derandomize=True, deadline=None)
def test_group_sizes_are_distinct_and_fewest(n, cap):
    """Cache slots split into globals: sizes sum to ``n``, at most ``cap``, strictly decreasing (no two globals
    share a type), and no fewer groups could do it (``g`` distinct sizes <= cap hold at most ``g*cap - g(g-1)/2``)."""
    most = cap * (cap + 1) // 2
    if n > most:
        with pytest.raises(ValueError, match=f"{n} slots do not fit"):
            group_sizes(n, cap)
        return
    sizes = group_sizes(n, cap)
    assert sum(sizes) == n and sizes[0] <= cap and sizes[-1] >= 1
    assert all(a > b for a, b in zip(sizes, sizes[1:]))
    g = len(sizes) - 1
    assert g * cap - g * (g - 1) // 2 < n


def _decodes_like_ort_with_its_caches(folder, source, manifest, steps: int) -> None:
    """The stateful folder's greedy tokens after PROMPT equal ONNX Runtime's on ``source`` for ``steps`` steps, its
    logits within 1e-4 relative, and every global of ``manifest.state`` holds the original's cache rows written so
    far (rtol 1e-4)."""
    gen, ref_gen = Generator(folder), Generator.reference(source)
    got, ref = gen.generate(PROMPT, steps), ref_gen.generate(PROMPT, steps)
    assert got.tokens == ref.tokens
    assert max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got.logits, ref.logits)) < 1e-4
    state, written = gen.runner.read_state(), len(PROMPT) + steps - 1
    for s in manifest.state:
        for k, e in enumerate(s["entries"]):
            r = ref_gen.past[e["input"]][:, :, :written]
            np.testing.assert_allclose(state[s["name"]][k][:, :, :written], r, rtol=1e-4, atol=1e-5 * np.abs(r).max())


@pytest.mark.slow
def test_a_deep_decoder_keeps_its_cache_in_several_globals(tmp_path):
    """17 layers = 34 caches, more than the 32 slots of one global (MAX_SLOTS_PER_GLOBAL: in one global of 60 caches,
    a 30-layer decoder, iree-compile 3.13 fails with "failed to solve for usage analysis"): split into globals of 18
    and 16 slots it compiles, decodes ORT's greedy tokens and holds ORT's caches."""
    import seed_form

    model, _ = seed_form.build_seed_model("fp32", **DEEP)
    path = seed_form.save_seed_model(model, tmp_path / "deep.onnx")
    m = apply(path, tmp_path / "iree", plugins="cast,legalize,topk,expand,kv", backend="iree", options={"stateful": True})
    assert [(s["name"], s["shape"][0], len(s["entries"])) for s in m.state] == [("rewrite_kv_state", 18, 18), ("rewrite_kv_state_1", 16, 16)]
    pasts = [e["input"] for s in m.state for e in s["entries"]]
    assert pasts == [f"past_{kind}_{i}" for i in range(17) for kind in ("key", "value")]
    _decodes_like_ort_with_its_caches(tmp_path / "iree", path, m, 8)


def test_caches_of_two_types_get_globals_of_their_own(tmp_path, family_export):
    """DeepSeek-V3's MLA caches (transformers' export): keys [1, 1, S, 16] (no-rope and rope head dims), values
    [1, 1, S, 8]. The keys share one global and the values another; the step decodes ORT's greedy tokens on the
    original (logits within 1e-4 relative) and the globals hold the original's caches."""
    path = family_export("deepseek_v3")
    m = apply(path, tmp_path / "iree", plugins="kv,topk,moe", backend="iree", options={"stateful": True, "kv": {"max_seq": 24}})
    assert [(s["name"], s["shape"], [e["input"] for e in s["entries"]]) for s in m.state] == [
        ("rewrite_kv_state", [2, 1, 1, 24, 16], ["past_key_values.layers.0.keys", "past_key_values.layers.1.keys"]),
        ("rewrite_kv_state_1", [2, 1, 1, 24, 8], ["past_key_values.layers.0.values", "past_key_values.layers.1.values"])]
    _decodes_like_ort_with_its_caches(tmp_path / "iree", path, m, 12)


@pytest.mark.slow
def test_a_deep_decoder_writes_its_cache_rows_in_few_dispatches_on_cuda(tmp_path):
    """On CUDA, with the attention reading the new rows apart from the cache as loaded, the row writes of up to 14
    consecutive slots of a global are one dispatch of the state-rows kernel (IREE's CUDA driver takes 16 bindings:
    the rows, the position and the global): 34 caches in globals of 18 and 16 slots are written by 4 dispatches
    (14 + 4, 14 + 2), in place (no copy of a global), and no scatter is left. Compiled, not run."""
    import re

    import seed_form
    from rewrite.backends.iree_census import census

    model, _ = seed_form.build_seed_model("fp16", **DEEP)
    path = seed_form.save_seed_model(model, tmp_path / "deep.onnx")
    m = apply(path, tmp_path / "cuda", plugins="cast,rope,legalize,topk,expand,kv,attention", backend="iree", target="cuda",
              options={"stateful": True}, dims={"seq_len": 1})
    assert [s["shape"][0] for s in m.state] == [18, 16]
    mlir = (tmp_path / "cuda" / "model.mlir").read_text()
    calls = re.findall(r"call @rewrite_kv_state_rows_\d+\(", mlir)
    kernels = sorted(int(x) for x in re.findall(r"flow\.dispatch @rewrite_state_rows_m(\d+)::", mlir))
    assert len(calls) == 4 and kernels == [2, 4, 14, 14]
    assert "call @rewrite_kv_state_write_" not in mlir
    counts = census(tmp_path / "cuda")
    assert counts["copy_bytes"] < int(np.prod(m.state[0]["shape"][1:])) * 2  # less than one cache: no global copied


def test_a_static_decode_step_records_its_command_buffer_once(seed_fp32, tmp_path):
    """With one token per call (static shapes), the step's command buffer is recorded once at module load and
    replayed (iree-compile's memoization): the KV cache write reads the position on the device (no host readback
    in the step), and the extern kernels bind their buffers indirectly. Checked in the VM module iree-compile
    makes of the folder's MLIR with the folder's own flags, and the step still decodes ORT's tokens."""
    import re
    import subprocess

    from iree.compiler.tools.binaries import find_tool

    folder = tmp_path / "t1"
    apply(seed_fp32[0], folder, plugins="cast,legalize,topk,expand,kv", backend="iree", dims={"seq_len": 1},
          options={"stateful": True})
    flags = (folder / "compile.log").read_text().split("\n", 1)[0].split()[4:]  # after "<tool> model.mlir -o model.vmfb"
    vm = tmp_path / "vm.mlir"
    subprocess.run([find_tool("iree-compile"), str(folder / "model.mlir"), *flags, "--compile-to=vm", "-o", str(vm)],
                   check=True, cwd=folder, capture_output=True)
    text = vm.read_text()
    step = re.search(r"vm\.func private @\w+\$async\(.*?\n    }\n", text, re.S).group(0)
    init = re.search(r"vm\.func private @__init\(.*?\n    }\n", text, re.S).group(0)
    assert "_memoize_apply()" in init and "hal.command_buffer.create" not in step
    assert "hal.device.queue.execute.indirect" in step and "hal.fence.await" not in step and "hal.buffer.load" not in step
    gen, got = Generator(folder), []
    for t in PROMPT:  # one token per call: the prompt too
        logits = gen.step(np.array([[t]]))
    for _ in range(8):
        got.append(int(np.argmax(logits[0, -1])))
        logits = gen.step(np.array([[got[-1]]]))
    assert got == Generator.reference(seed_fp32[0]).generate(PROMPT, 8).tokens
