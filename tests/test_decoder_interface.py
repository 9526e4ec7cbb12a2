"""The decode interface is read from the graph, and feeds are checked against it before any runtime runs.

Covers: integer-named symbolic dims (transformers' exporter) read as static sizes; past/present pairing by
structure (growing Concat cache through Casts, static Scatter cache, fixed-size recurrent state, either input
naming); decoding a model without a cache by recomputing the prefix; malformed feeds refused with one
``error:`` line and exit status 2 on both backends, before ONNX Runtime or IREE sees them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from rewrite.backends.ort import OrtRunner
from rewrite.core import onnx_io
from rewrite.core.interface import cache_pairs, decoder_interface, exporter_static_dims, validate_feeds
from rewrite.errors import InputError
from rewrite.core.feeds import TensorSpec
from rewrite.core.shapes import infer_shapes
from rewrite.generate import Generator
from rewrite.pipeline import apply

VOCAB, HIDDEN = 11, 4


def rewrite_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rewrite.cli", *map(str, args)], capture_output=True, text=True)


def test_integer_named_dims_are_static_sizes():
    assert exporter_static_dims([(1, "4", "past", "32"), ("s", "4")]) == {"4": 4, "32": 32}
    assert exporter_static_dims([("batch", None, 7)]) == {}


def test_untouched_transformers_export_declares_numeric_named_kv_dims(qwen2_moe_tiny):
    """The fixture is saved exactly as transformers' exporter writes it; loading reads "4"/"32" as 4/32."""
    model = onnx.load(qwen2_moe_tiny, load_external_data=False)
    past = next(i for i in model.graph.input if i.name.startswith("past_key_values"))
    assert [d.dim_param for d in past.type.tensor_type.shape.dim][1::2] == ["4", "32"]
    graph = onnx_io.load(qwen2_moe_tiny)
    infer_shapes(graph)
    shape = graph.values[past.name].shape
    assert shape[1] == 4 and shape[3] == 32 and isinstance(shape[2], str)
    iface = decoder_interface(graph)
    assert iface.vocab == 512 and iface.input_ids == "input_ids"
    assert iface.position_ids == "position_ids" and iface.attention_mask == "attention_mask"
    assert len(iface.pairs) == 4 and {p.kind for p in iface.pairs} == {"kv-growing"} and {p.axis for p in iface.pairs} == {2}
    assert [(p.past, p.present) for p in iface.pairs][:2] == [
        ("past_key_values.layers.0.keys", "cache.layers.0.keys"), ("past_key_values.layers.0.values", "cache.layers.0.values")]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_verify_and_generate_need_no_inputs_on_an_untouched_export(request, qwen2_moe_tiny, tmp_path, backend):
    if backend == "iree":  # the same CLI apply as below, shared with test_end_to_end (one compile)
        r, out = request.getfixturevalue("qwen2_moe_tiny_iree_topk")
    else:
        out = tmp_path / backend
        r = rewrite_cli("apply", qwen2_moe_tiny, "--plugins", "cast", "--backend", backend, "-o", out)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    past = next(d for d in manifest["inputs"] if d["name"] == "past_key_values.layers.0.keys")
    assert past["shape"][1] == 4 and past["shape"][3] == 32
    assert manifest["decoder"]["vocab"] == 512 and len(manifest["decoder"]["pairs"]) == 4
    r = rewrite_cli("verify", qwen2_moe_tiny, out)
    assert r.returncode == 0 and "verify: PASS" in r.stdout, r.stdout + r.stderr
    r = rewrite_cli("generate", out, "--prompt-ids", "11,22,33,44,55", "--max-new-tokens", "6")
    assert r.returncode == 0, r.stderr
    tokens = [int(t) for t in r.stdout.strip().split(",")]
    assert tokens == _greedy_on_original(qwen2_moe_tiny, [11, 22, 33, 44, 55], 6)


def _greedy_on_original(path: Path, prompt: list[int], steps: int) -> list[int]:
    import qwen_moe

    sig = qwen_moe.decode_signature(path)
    session = OrtRunner(path, optimize="basic")
    tokens, _ = qwen_moe.greedy_decode(lambda f: session.run(f), sig.input_names, sig.output_names, prompt, steps,
                                       sig.kv_shape_per_layer, sig.dtype)
    return tokens


@pytest.mark.parametrize("backend", ["ort", "iree"])
@pytest.mark.parametrize("bad, message", [
    ("dtype", "input 'input_ids' is int32, expected int64"),
    ("rank", "input 'input_ids' has shape [3], expected rank 2"),
    ("static", "input 'past_key_0' has shape [1, 2, 5, 4], expected [1, 2, 6, 4] (axis 2)"),
    ("vocab", f"input 'input_ids' holds token id {VOCAB}, outside the vocabulary [0, {VOCAB})"),
    ("missing", "missing input 'seq_position'"),
])
def test_malformed_feeds_reach_no_runtime(static_cache_lowered, tmp_path, backend, bad, message):
    out = static_cache_lowered(backend)
    feeds = {"input_ids": np.array([[1, 2]], np.int64), "seq_position": np.array([0], np.int64),
             "past_key_0": np.zeros((1, 2, 6, 4), np.float32)}
    if bad == "dtype":
        feeds["input_ids"] = feeds["input_ids"].astype(np.int32)
    elif bad == "rank":
        feeds["input_ids"] = np.array([1, 2, 3], np.int64)
    elif bad == "static":
        feeds["past_key_0"] = np.zeros((1, 2, 5, 4), np.float32)
    elif bad == "vocab":
        feeds["input_ids"] = np.array([[1, VOCAB]], np.int64)
    else:
        del feeds["seq_position"]
    np.savez(tmp_path / "in.npz", **feeds)
    r = rewrite_cli("run", out, "--inputs", tmp_path / "in.npz")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


def test_symbolic_dims_must_agree_across_inputs():
    specs = [TensorSpec("a", TP.FLOAT, ("n", 2)), TensorSpec("b", TP.FLOAT, ("n",))]
    validate_feeds(specs, {"a": np.zeros((3, 2), np.float32), "b": np.zeros(3, np.float32)}, "m")
    with pytest.raises(InputError, match="input 'b' axis 0 is 4, but dim 'n' is 3 in 'a'"):
        validate_feeds(specs, {"a": np.zeros((3, 2), np.float32), "b": np.zeros(4, np.float32)}, "m")


# ---------------------------------------------------------------------------------------------------------
# Small decoders written by hand: logits = MatMul(CumSum(Embedding(ids) [+ cache contents]), W), so every
# logit depends on every earlier token and a wrong cache or a wrong prefix changes the tokens.


def _decoder(path: Path, kind: str, input_prefix: str = "past_key_values") -> Path:
    rng = np.random.default_rng(1)
    embed = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float16).astype(np.float32)  # exact in an fp16 cache
    inits = [numpy_helper.from_array(embed, "embed"),
             numpy_helper.from_array(rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32), "lm_head"),
             numpy_helper.from_array(np.array(1, np.int64), "one_axis"),
             numpy_helper.from_array(np.array([1], np.int64), "one_1d")]
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["h"], name="embed_gather")]
    inputs = [helper.make_tensor_value_info("input_ids", TP.INT64, [1, "s"])]
    outputs = [helper.make_tensor_value_info("logits", TP.FLOAT, [1, "s", VOCAB])]
    if kind == "nocache":
        nodes.append(helper.make_node("CumSum", ["h", "one_axis"], ["c"], name="prefix_sum"))
    elif kind == "growing":  # cache holds the embeddings so far, as [1, 1, past, HIDDEN], fp16 behind Casts
        past, present = f"{input_prefix}.layers.0.keys", f"{'output.cache' if input_prefix == 'input.cache' else 'present'}.layers.0.keys"
        inputs.append(helper.make_tensor_value_info(past, TP.FLOAT16, [1, 1, "past", HIDDEN]))
        outputs.append(helper.make_tensor_value_info(present, TP.FLOAT16, [1, 1, "total", HIDDEN]))
        nodes += [
            helper.make_node("Unsqueeze", ["h", "one_1d"], ["h4"], name="to_heads"),
            helper.make_node("Cast", [past], ["past32"], to=TP.FLOAT, name="past_up"),
            helper.make_node("Concat", ["past32", "h4"], ["all32"], axis=2, name="kv_concat"),
            helper.make_node("Cast", ["all32"], [present], to=TP.FLOAT16, name="present_down"),
            helper.make_node("ReduceSum", ["all32", "one_1d"], ["all3"], keepdims=0, name="drop_heads"),
            helper.make_node("CumSum", ["all3", "one_axis"], ["c_all"], name="prefix_sum"),
            helper.make_node("Shape", ["h"], ["s_shape"], start=1, end=2, name="new_len"),
            helper.make_node("Neg", ["s_shape"], ["neg_s"], name="neg_len"),
            helper.make_node("Slice", ["c_all", "neg_s", "big", "one_1d"], ["c"], name="keep_new"),
        ]
        inits.append(numpy_helper.from_array(np.array([1 << 30], np.int64), "big"))
    elif kind == "state":  # a recurrent state [1, HIDDEN]: running sum of embeddings (hybrid models' style)
        inputs.append(helper.make_tensor_value_info("past_conv.0", TP.FLOAT, [1, HIDDEN]))
        outputs.append(helper.make_tensor_value_info("present_conv.0", TP.FLOAT, [1, HIDDEN]))
        nodes += [
            helper.make_node("CumSum", ["h", "one_axis"], ["cs"], name="prefix_sum"),
            helper.make_node("Unsqueeze", ["past_conv.0", "one_1d"], ["st"], name="state_seq"),
            helper.make_node("Add", ["cs", "st"], ["c"], name="add_state"),
            helper.make_node("ReduceSum", ["h", "one_1d"], ["hs"], keepdims=0, name="sum_new"),
            helper.make_node("Add", ["past_conv.0", "hs"], ["present_conv.0"], name="next_state"),
        ]
    nodes.append(helper.make_node("MatMul", ["c", "lm_head"], ["logits"], name="head"))
    graph = helper.make_graph(nodes, "decoder", inputs, outputs, inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


@pytest.fixture
def static_cache_model(tmp_path) -> Path:
    """A static cache ``past_key_0`` [1, 2, 6, 4] written at ``seq_position`` by ScatterElements along axis 2
    (the seed form's KV update); logits [1, s, VOCAB] read the whole cache."""
    return _static_cache_model(tmp_path / "static.onnx")


@pytest.fixture(scope="module")
def static_cache_lowered(tmp_path_factory):
    """``backend`` -> the static-cache model applied for that backend, lowered once per module (the cases that
    use it only read the folder)."""
    folders = {}

    def lowered(backend: str) -> Path:
        if backend not in folders:
            work = tmp_path_factory.mktemp(f"static_cache_{backend}")
            apply(_static_cache_model(work / "static.onnx"), work / backend, backend=backend)
            folders[backend] = work / backend
        return folders[backend]

    return lowered


def _static_cache_model(path: Path) -> Path:
    rng = np.random.default_rng(2)
    const = lambda name, value: numpy_helper.from_array(np.array(value, np.int64), name)  # noqa: E731
    inits = [numpy_helper.from_array(rng.standard_normal((VOCAB, 8)).astype(np.float32), "embed"),
             numpy_helper.from_array(rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32), "lm_head"),
             const("heads_shape", [1, -1, 2, 4]), const("zero", 0), const("one", 1), const("idx_shape", [1, 1, -1, 1]),
             const("seq_axes", [1, 2]), const("head_axis", [1])]
    nodes = [
        helper.make_node("Gather", ["embed", "input_ids"], ["h"], name="embed_gather"),            # [1, s, 8]
        helper.make_node("Reshape", ["h", "heads_shape"], ["hr"], name="split_heads"),              # [1, s, 2, 4]
        helper.make_node("Transpose", ["hr"], ["upd"], perm=[0, 2, 1, 3], name="to_cache_layout"),  # [1, 2, s, 4]
        helper.make_node("Shape", ["input_ids"], ["s_1d"], start=1, end=2, name="seq_len"),
        helper.make_node("Squeeze", ["s_1d"], ["s_len"], name="seq_len_scalar"),
        helper.make_node("Squeeze", ["seq_position"], ["pos"], name="pos_scalar"),
        helper.make_node("Range", ["zero", "s_len", "one"], ["offs"], name="offsets"),
        helper.make_node("Add", ["offs", "pos"], ["where"], name="positions"),
        helper.make_node("Reshape", ["where", "idx_shape"], ["idx4"], name="idx_view"),
        helper.make_node("Shape", ["upd"], ["upd_shape"], name="upd_shape"),
        helper.make_node("Expand", ["idx4", "upd_shape"], ["idx"], name="idx_expand"),
        helper.make_node("ScatterElements", ["past_key_0", "idx", "upd"], ["present_key_0"], axis=2, name="kv_write"),
        helper.make_node("ReduceSum", ["present_key_0", "seq_axes"], ["pooled"], keepdims=0, name="pool"),  # [1, 4]
        helper.make_node("Unsqueeze", ["pooled", "head_axis"], ["pooled3"], name="pooled3"),               # [1, 1, 4]
        helper.make_node("ReduceSum", ["upd", "head_axis"], ["new"], keepdims=0, name="sum_heads"),        # [1, s, 4]
        helper.make_node("Add", ["new", "pooled3"], ["c"], name="mix"),
        helper.make_node("MatMul", ["c", "lm_head"], ["logits"], name="head"),
    ]
    inputs = [helper.make_tensor_value_info("input_ids", TP.INT64, [1, "s"]),
              helper.make_tensor_value_info("seq_position", TP.INT64, [1]),
              helper.make_tensor_value_info("past_key_0", TP.FLOAT, [1, 2, 6, 4])]
    outputs = [helper.make_tensor_value_info("logits", TP.FLOAT, [1, "s", VOCAB]),
               helper.make_tensor_value_info("present_key_0", TP.FLOAT, [1, 2, 6, 4])]
    graph = helper.make_graph(nodes, "static_decoder", inputs, outputs, inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def _pairs(path: Path):
    graph = onnx_io.load(path)
    infer_shapes(graph)
    return [(p.past, p.present, p.kind, p.axis) for p in cache_pairs(graph)]


def test_pairs_found_by_structure(tmp_path, static_cache_model):
    assert _pairs(_decoder(tmp_path / "g.onnx", "growing")) == [
        ("past_key_values.layers.0.keys", "present.layers.0.keys", "kv-growing", 2)]
    assert _pairs(_decoder(tmp_path / "c.onnx", "growing", "input.cache")) == [
        ("input.cache.layers.0.keys", "output.cache.layers.0.keys", "kv-growing", 2)]
    assert _pairs(_decoder(tmp_path / "s.onnx", "state")) == [("past_conv.0", "present_conv.0", "state", None)]
    assert _pairs(static_cache_model) == [("past_key_0", "present_key_0", "kv-static", 2)]
    assert _pairs(_decoder(tmp_path / "n.onnx", "nocache")) == []


def _reference_greedy(run, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding by running the full sequence each step (what every cache must reproduce)."""
    ids, out = list(prompt), []
    for _ in range(steps):
        logits = run(np.array([ids], np.int64))
        out.append(int(logits[0, -1].argmax()))
        ids.append(out[-1])
    return out


@pytest.mark.parametrize("kind", ["nocache", "growing", "state"])
def test_generate_drives_each_interface_like_a_full_recompute(tmp_path, kind):
    model = _decoder(tmp_path / f"{kind}.onnx", kind, "input.cache")
    apply(model, tmp_path / "out", backend="ort")
    gen = Generator(tmp_path / "out")
    assert gen.recompute == (kind == "nocache") and gen.max_seq is None
    got = gen.generate([3, 1, 4], 6).tokens
    session = OrtRunner(model, optimize="basic")

    def full(ids):
        feeds = {"input_ids": ids}
        for p in gen.interface.pairs:  # an empty cache / zero state, then the whole sequence at once
            spec = gen.specs[p.past]
            feeds[p.past] = np.zeros([0 if not isinstance(d, int) else d for d in spec.shape], spec.np_dtype)
        return session.run(feeds)["logits"]

    assert got == _reference_greedy(full, [3, 1, 4], 6)


def _window_model(path: Path, static: bool) -> Path:
    """present = Slice(Concat(Slice(past), new), last W) along axis 2: a convolution state when the past's length
    is static, a sliding-window KV cache when it is symbolic."""
    const = lambda name, value: numpy_helper.from_array(np.array(value, np.int64), name)  # noqa: E731
    past_len = 3 if static else "p"
    nodes = [
        helper.make_node("Slice", ["past.0", "minus_w", "big", "axis2"], ["kept"], name="trim_past"),
        helper.make_node("Concat", ["kept", "new"], ["joined"], axis=2, name="window_concat"),
        helper.make_node("Slice", ["joined", "minus_w", "big", "axis2"], ["present.0"], name="keep_last"),
    ]
    graph = helper.make_graph(
        nodes, "window",
        [helper.make_tensor_value_info("past.0", TP.FLOAT, [1, 4, past_len, 2]),
         helper.make_tensor_value_info("new", TP.FLOAT, [1, 4, 1, 2])],
        [helper.make_tensor_value_info("present.0", TP.FLOAT, [1, 4, past_len if static else None, 2])],
        [const("minus_w", [-3]), const("big", [1 << 30]), const("axis2", [2])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_windows_pair_as_state_or_sliding_cache(tmp_path):
    assert _pairs(_window_model(tmp_path / "conv.onnx", static=True)) == [("past.0", "present.0", "state", None)]
    assert _pairs(_window_model(tmp_path / "swa.onnx", static=False)) == [("past.0", "present.0", "kv-growing", 2)]
