"""``--next-token``: the greedy next token as a graph output, and decode steps kept on the device.

The seed form (fp32): a one-token stateful IREE module (llvm-cpu) decoded on the device, several calls in flight,
gives the tokens of the host's argmax loop on the same folder and of ONNX Runtime on the original model; the ORT
backend's ``next_token`` equals the logits' argmax; bad graphs are refused with the graph left as it was; on
``--target cuda`` the ArgMax over a 512-token vocabulary, which IREE's CUDA codegen fails, compiles as reductions.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from rewrite.backends.iree import DECODE_WINDOW, cuda_argmax_as_reductions
from rewrite.backends.iree_argmax import OP_TYPE as ROW_ARGMAX
from rewrite.backends.iree_argmax import use_row_argmax
from rewrite.cli import cli
from rewrite.core import onnx_io
from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.ir import Graph
from rewrite.core.next_token import NEXT_TOKEN, add_next_token
from rewrite.errors import InputError, RewriteError
from rewrite.generate import GenerationError, Generator
from rewrite.pipeline import apply

PROMPT = [3, 141, 59, 26, 5]
STEPS = 3 * DECODE_WINDOW + 2  #: more decode calls than the window holds, and not a multiple of it
PLUGINS = "cast,legalize,topk,expand,kv"


@pytest.fixture(scope="module")
def _folders(seed_fp32, tmp_path_factory) -> dict:
    return {"base": tmp_path_factory.mktemp("next_token"), "source": seed_fp32[0]}


@pytest.fixture
def folders(_folders):
    """name -> folder: ``t1`` (stateful, one token per call, --next-token), ``dyn`` (stateful, any token count,
    --next-token), ``ort`` (the original model on ORT, --next-token); each lowered once per module on first use, so
    that an xdist worker lowers only those of the tests it runs."""
    opts = {"stateful": True, "next_token": True}
    make = {"t1": lambda path, out: apply(path, out, plugins=PLUGINS, backend="iree", options=opts, dims={"seq_len": 1}),
            "dyn": lambda path, out: apply(path, out, plugins=PLUGINS, backend="iree", options=opts),
            "ort": lambda path, out: apply(path, out, backend="ort", options={"next_token": True})}

    class Folders:
        def __getitem__(self, name):
            if name not in _folders:
                make[name](_folders["source"], _folders["base"] / name)
                _folders[name] = _folders["base"] / name
            return _folders[name]

    return Folders()


def test_the_graph_gets_one_argmax_and_a_slice_only_for_many_tokens(seed_fp32, tmp_path):
    for dims, slices in (({}, 1), ({"seq_len": 1}, 0)):
        graph = onnx_io.load(seed_fp32[0])
        if dims:
            from rewrite.core.shapes import infer_shapes

            infer_shapes(graph, dims)
        before = len(graph.nodes)
        assert add_next_token(graph) == NEXT_TOKEN
        ops = [n.op_type for n in graph.nodes.values()]
        assert len(graph.nodes) == before + 1 + slices
        assert ops.count("ArgMax") == 1 and graph.outputs[-1] == NEXT_TOKEN
        v = graph.values[NEXT_TOKEN]
        assert v.dtype == onnx.TensorProto.INT64 and v.shape == (1, 1)


def _state(graph):
    return len(graph.nodes), list(graph.outputs), sorted(graph.values), list(graph.initializers)


def test_bad_graphs_are_refused_unchanged(seed_fp32, tmp_path):
    graph = onnx_io.load(seed_fp32[0])
    before = _state(graph)
    with pytest.raises(RewriteError, match="the graph has no 'scores' output"):
        add_next_token(graph, "scores")
    assert _state(graph) == before
    with pytest.raises(RewriteError, match=r"output 'present_key_0' is FLOAT\[1,4,64,64\]; expected float, float16 or "
                                           r"double logits \[batch, seq, vocab\]"):
        add_next_token(graph, "present_key_0")
    assert _state(graph) == before
    add_next_token(graph)
    after = _state(graph)
    with pytest.raises(RewriteError, match="already has a value named 'next_token'"):
        add_next_token(graph)
    assert _state(graph) == after and after[0] == before[0] + 2 and after[1] == before[1] + [NEXT_TOKEN]
    # integer "logits"
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.INT64, [1, 2, 8])
    y = onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.INT64, [1, 2, 8])
    model = onnx.helper.make_model(onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["logits"])], "g", [x], [y]))
    onnx.save(model, tmp_path / "int.onnx")
    graph = onnx_io.load(tmp_path / "int.onnx")
    before = _state(graph)
    with pytest.raises(RewriteError, match=r"output 'logits' is INT64\[1,2,8\]"):
        add_next_token(graph)
    assert _state(graph) == before


def test_only_our_argmax_is_taken_for_the_next_token(tmp_path):
    """An output named next_token that is not the greedy token of the last position (kept dims, another axis)
    is not recorded as one: generate would feed it back as input_ids."""
    from rewrite.core.interface import decoder_interface

    ids = onnx.helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, [1, 1])
    logits = onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [1, 1, 8])
    table = onnx.numpy_helper.from_array(np.arange(64, dtype=np.float32).reshape(8, 8), "table")
    for attrs, shape, taken in (({"axis": -1, "keepdims": 0}, [1, 1], True), ({"axis": -1, "keepdims": 1}, [1, 1, 1], False),
                                ({"axis": 1, "keepdims": 0}, [1, 8], False)):
        nodes = [onnx.helper.make_node("Gather", ["table", "input_ids"], ["logits"]),
                 onnx.helper.make_node("ArgMax", ["logits"], ["next_token"], **attrs)]
        out = onnx.helper.make_tensor_value_info("next_token", onnx.TensorProto.INT64, shape)
        model = onnx.helper.make_model(onnx.helper.make_graph(nodes, "g", [ids], [logits, out], [table]))
        onnx.save(model, tmp_path / "m.onnx")
        iface = decoder_interface(onnx_io.load(tmp_path / "m.onnx"))
        assert (iface.next_token == NEXT_TOKEN) is taken, attrs


def _argmax_graph(n: int, dtype=onnx.TensorProto.FLOAT16, opset: int = 17, **attrs) -> Graph:
    x = onnx.helper.make_tensor_value_info("x", dtype, [1, 1, n])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT64, [1, 1])
    node = onnx.helper.make_node("ArgMax", ["x"], ["y"], axis=-1, keepdims=0, **attrs)
    model = onnx.helper.make_model(onnx.helper.make_graph([node], "g", [x], [y]),
                                   opset_imports=[onnx.helper.make_opsetid("", opset)])
    return onnx_io.load(model)


@pytest.mark.parametrize("opset", [17, 18])
def test_an_argmax_iree_cuda_cannot_compile_becomes_reductions(opset):
    """cuda_argmax_as_reductions: an ArgMax over a static multiple of 256 values (512 here; IREE 3.13's CUDA codegen
    fails it) becomes ReduceMax, Equal, Where, ReduceMin, Min: the output keeps its name, and ONNX Runtime gives the
    original's index for random rows, a row with a tie, an all -inf row and a row with a NaN is kept in range;
    other sizes and select_last_index=1 are left alone."""
    import onnxruntime as ort

    g = _argmax_graph(512, opset=opset)
    assert cuda_argmax_as_reductions(g) == 1
    assert [n.op_type for n in g.topo_nodes()] == ["ReduceMax", "Equal", "Where", "ReduceMin", "Min"]
    assert g.outputs == ["y"] and g.producer_node("y").op_type == "Min"
    rewritten = ort.InferenceSession(onnx_io.to_model(g).SerializeToString(), providers=["CPUExecutionProvider"])
    plain = ort.InferenceSession(onnx_io.to_model(_argmax_graph(512, opset=opset)).SerializeToString(),
                                 providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal((1, 1, 512)).astype(np.float16) for _ in range(4)]
    rows += [np.full((1, 1, 512), 3, np.float16), np.full((1, 1, 512), -np.inf, np.float16)]
    rows[-2][0, 0, 7] = rows[-2][0, 0, 300] = 5  # a tie: the first index
    for x in rows:
        got, want = rewritten.run(None, {"x": x})[0], plain.run(None, {"x": x})[0]
        assert got.dtype == np.int64 and got.tolist() == want.tolist() == [[int(np.argmax(x[0, 0]))]]
    nan = rows[0].copy()
    nan[0, 0, 9] = np.nan
    assert 0 <= int(rewritten.run(None, {"x": nan})[0][0, 0]) < 512
    for kept in (_argmax_graph(500), _argmax_graph(256), _argmax_graph(512, select_last_index=1)):
        assert cuda_argmax_as_reductions(kept) == 0 and [n.op_type for n in kept.topo_nodes()] == ["ArgMax"]


def test_next_token_compiles_for_cuda(seed_fp32, tmp_path):
    """The seed form's 512-token vocabulary: --next-token on --target cuda compiles (iree-compile failed to
    distribute IREE's own ArgMax of it), the next token one dispatch of the backend's row_argmax kernel."""
    m = apply(seed_fp32[0], tmp_path / "cuda", plugins=PLUGINS, backend="iree", target="cuda",
              options={"stateful": True, "next_token": True}, dims={"seq_len": 1})
    assert m.decoder["next_token"] == NEXT_TOKEN  # recorded before lowering: the device decode finds it
    assert (tmp_path / "cuda" / "model.vmfb").stat().st_size > 0
    g = onnx_io.load(tmp_path / "cuda" / "model.onnx")
    assert not g.nodes_by_op("ArgMax") and g.producer_node(NEXT_TOKEN).op_type == ROW_ARGMAX
    mlir = (tmp_path / "cuda" / "model.mlir").read_text()
    assert mlir.count("flow.dispatch @rewrite_row_argmax::@row_argmax_f32") == 1 and "onnx.ArgMax" not in mlir
    assert any(o.startswith("kernels/argmax_cuda") for o in m.kernel_objects)


def _argmax_node_graph(shape, dtype=onnx.TensorProto.FLOAT16, **attrs) -> Graph:
    x = onnx.helper.make_tensor_value_info("x", dtype, shape)
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT64, None)
    node = onnx.helper.make_node("ArgMax", ["x"], ["y"], **attrs)
    model = onnx.helper.make_model(onnx.helper.make_graph([node], "g", [x], [y]),
                                   opset_imports=[onnx.helper.make_opsetid("", 17)])
    return onnx_io.load(model)


def test_an_argmax_alone_compiles_for_cuda_with_the_row_kernel(tmp_path):
    """A graph whose only op is the ArgMax (no plugin declares the ai.rewrite domain): the backend declares it
    for RowArgMax, and the module compiles with one dispatch of row_argmax."""
    onnx.save(onnx_io.to_model(_argmax_graph(151936)), tmp_path / "m.onnx")
    apply(tmp_path / "m.onnx", tmp_path / "out", backend="iree", target="cuda")
    assert (tmp_path / "out" / "model.vmfb").stat().st_size > 0
    assert (tmp_path / "out" / "model.mlir").read_text().count("@row_argmax_f16[") == 1


@pytest.mark.parametrize("shape, dtype, attrs, taken, out_shape", [
    ([1, 1, 151936], onnx.TensorProto.FLOAT16, dict(axis=-1, keepdims=0), True, (1, 1)),
    ([2, 3, 512], onnx.TensorProto.FLOAT, dict(axis=2), True, (2, 3, 1)),  # keepdims defaults to 1
    ([4, 1000], onnx.TensorProto.FLOAT16, dict(axis=1, keepdims=0), True, (4,)),
    ([1, 1, 151936], onnx.TensorProto.FLOAT16, dict(axis=-1, keepdims=0, select_last_index=1), False, None),
    ([1, 512, 4], onnx.TensorProto.FLOAT16, dict(axis=1, keepdims=0), False, None),  # not the last axis
    ([1, 1, 100], onnx.TensorProto.FLOAT16, dict(axis=-1, keepdims=0), False, None),  # a short row
    (["b", 1, 512], onnx.TensorProto.FLOAT16, dict(axis=-1, keepdims=0), False, None),  # a symbolic dim
    ([1, 1, 512], onnx.TensorProto.DOUBLE, dict(axis=-1, keepdims=0), False, None),
])
def test_row_argmax_takes_the_last_axis_of_static_float_rows(shape, dtype, attrs, taken, out_shape):
    """use_row_argmax: which ArgMaxes become ai.rewrite::RowArgMax (same input, the output keeping its name and
    getting ArgMax's shape), and which are left to IREE."""
    g = _argmax_node_graph(shape, dtype, **attrs)
    assert use_row_argmax(g) == int(taken)
    (node,) = g.topo_nodes()
    if not taken:
        assert node.op_type == "ArgMax"
        return
    assert (node.op_type, node.domain, node.inputs, g.outputs) == (ROW_ARGMAX, DOMAIN, ["x"], ["y"])
    assert g.opset(DOMAIN) is not None  # declared: the importer rejects a node of an undeclared domain
    assert node.attr("keepdims") == attrs.get("keepdims", 1)
    assert g.values["y"].shape == out_shape and g.values["y"].dtype == onnx.TensorProto.INT64


def test_ort_next_token_is_the_argmax_of_the_last_position(folders):
    gen = Generator(folders["ort"])
    assert gen.interface.next_token == NEXT_TOKEN and not gen.decodes_on_device
    out = gen.runner.run({gen.interface.input_ids: np.array([PROMPT], np.int64),
                          gen.interface.seq_position: np.array([0], np.int64), **gen.past})
    assert out[NEXT_TOKEN].shape == (1, 1) and out[NEXT_TOKEN].dtype == np.int64
    assert int(out[NEXT_TOKEN][0, 0]) == int(np.argmax(out["logits"][0, -1]))


def test_device_decode_gives_the_host_loop_and_ort_tokens(folders):
    ref = Generator.reference(folders["source"]).generate(PROMPT[:1], STEPS).tokens
    assert not Generator(folders["t1"]).decodes_on_device  # llvm-cpu: the host's loop unless asked
    gen = Generator(folders["t1"], device_decode=True)
    assert gen.decodes_on_device and gen.manifest.decoder["next_token"] == NEXT_TOKEN
    on_device = gen.generate(PROMPT[:1], STEPS, logits=False)
    assert on_device.logits == [] and on_device.tokens == ref
    host = gen.generate(PROMPT[:1], STEPS)
    assert host.tokens == ref and len(host.logits) == STEPS
    # decode() from a prefilled position, in two pieces: the positions carry over
    gen.reset()
    for t in PROMPT:
        logits = gen.step(np.array([[t]], np.int64))
    first = int(np.argmax(logits[0, -1]))
    tokens = gen.decode(first, 5)
    tokens += gen.decode(tokens[-1], STEPS - 5)
    assert gen.position == len(PROMPT) + STEPS
    assert [first] + tokens[:-1] == Generator.reference(folders["source"]).generate(PROMPT, STEPS).tokens


def test_a_prompt_is_queued_on_the_device(folders):
    """prefill_token on the device: a prompt longer than the window, one queued call per token, only the last
    call's token read: the token of the host's prefill, the position advanced by the prompt; greedy_decode with
    a prompt and more steps continues as decode() does."""
    prompt = PROMPT + PROMPT[::-1] + [7]
    gen = Generator(folders["t1"], device_decode=True)
    want = gen.generate(prompt, 4).tokens
    gen.reset()
    assert gen.prefill_token(prompt) == want[0] and gen.position == len(prompt)
    assert gen.decode(want[0], 3) == want[1:]
    gen.reset()
    assert gen.runner.greedy_decode(prompt, 0, 4) == want
    with pytest.raises(InputError, match="at least one token and count >= 1"):
        gen.runner.greedy_decode([], 0, 1)
    with pytest.raises(InputError, match="token 9999 is outside"):
        gen.runner.greedy_decode([1, 9999], 0, 1)
    for bad in (True, "12", [1.5], np.array(3)):
        with pytest.raises(InputError, match="token ids"):
            gen.runner.greedy_decode(bad, 0, 1)
    with pytest.raises(InputError, match="count >= 1"):
        gen.runner.greedy_decode(prompt, 0, 0)
    with pytest.raises(GenerationError, match="empty prompt"):
        gen.prefill_token([])


def test_a_one_token_module_prefills_a_prompt_token_by_token(folders):
    """generate() on a module compiled for one token per call feeds the prompt one call per token: the tokens of
    ONNX Runtime on the original, both decode loops; replay() gives the prompt's last position first."""
    ref = Generator.reference(folders["source"])
    want = ref.generate(PROMPT, 6)
    gen = Generator(folders["t1"], device_decode=True)
    assert gen.generate(PROMPT, 6, logits=False).tokens == want.tokens
    got = gen.generate(PROMPT, 6)
    assert got.tokens == want.tokens and got.logits[0].shape == (1, 1, 512)
    np.testing.assert_allclose(got.logits[0][0, -1], want.logits[0][0, -1], rtol=1e-4, atol=1e-4 * np.abs(want.logits[0]).max())
    replayed = gen.replay(PROMPT, want.tokens)
    assert len(replayed) == 6 and replayed[0].shape == (1, 1, 512)


def test_a_transformers_export_decodes_on_the_device(qwen3_moe_tiny, tmp_path):
    """transformers' export of the tiny Qwen3-MoE (growing cache, attention_mask and position_ids): ``kv`` makes
    a static cache with the token count fixed to one (``--dim s70=1``), and the stateful module decodes on the
    device, fed the position ids and the mask of ones there: ONNX Runtime's tokens on the original, 20 steps."""
    m = apply(qwen3_moe_tiny, tmp_path / "t1", plugins=PLUGINS, backend="iree", dims={"s70": 1},
              options={"stateful": True, "next_token": True, "kv": {"max_seq": 40}})
    assert [d["name"] for d in m.inputs] == ["input_ids", "attention_mask", "position_ids", "seq_position"]
    assert [d["shape"] for d in m.inputs] == [[1, 1], [1, 40], [1, 1], [1]]
    gen = Generator(tmp_path / "t1", device_decode=True)
    assert gen.decodes_on_device
    ref = Generator.reference(qwen3_moe_tiny).generate(PROMPT, 20).tokens
    assert gen.generate(PROMPT, 20, logits=False).tokens == ref
    assert gen.generate(PROMPT, 20).tokens == ref


def test_a_module_taking_any_token_count_decodes_on_the_host(folders):
    gen = Generator(folders["dyn"])
    assert gen.interface.next_token == NEXT_TOKEN and not gen.decodes_on_device
    assert gen.generate(PROMPT, 6, logits=False).tokens == gen.generate(PROMPT, 6).tokens


def test_device_decode_guards(folders):
    gen = Generator(folders["t1"], device_decode=True)
    gen.step(np.array([[3]], np.int64))
    with pytest.raises(GenerationError, match=f"position 1 \\+ {gen.max_seq} decode step\\(s\\) exceeds the cache's"):
        gen.decode(3, gen.max_seq)
    assert gen.position == 1
    with pytest.raises(InputError, match="token 512 is outside the vocabulary \\[0, 512\\)"):
        gen.decode(512, 2)
    # the runner checks the state's positions itself too
    with pytest.raises(InputError, match=f"2 call\\(s\\) from position {gen.max_seq - 1} exceed the state's {gen.max_seq} positions"):
        gen.runner.greedy_decode(3, gen.max_seq - 1, 2)
    # the cache filled exactly: every position written, the last call's token included
    tokens = gen.decode(3, gen.max_seq - 1)
    assert len(tokens) == gen.max_seq - 1 and gen.position == gen.max_seq
    with pytest.raises(GenerationError, match="exceeds the cache's"):
        gen.decode(tokens[-1], 1)


@pytest.mark.parametrize("count", [1, 2, DECODE_WINDOW, DECODE_WINDOW + 1])
def test_short_device_decodes(folders, count):
    gen = Generator(folders["t1"], device_decode=True)
    ref = gen.generate(PROMPT[:1], count + 1).tokens
    gen.reset()
    first = int(np.argmax(gen.step(np.array([PROMPT[:1]], np.int64))[0, -1]))
    assert [first] + gen.decode(first, count) == ref


def test_a_failed_call_resets_the_generator(folders, monkeypatch):
    """A call that fails mid-decode: the calls queued before it are waited for, the error is raised, and the
    generator is reset, so the next generation gives the same tokens as ever."""
    from rewrite.backends.errors import IreeRuntimeError
    from rewrite.backends.iree_toolchain import IreeModule

    gen = Generator(folders["t1"], device_decode=True)
    ref = gen.generate(PROMPT[:1], STEPS, logits=False).tokens
    real, calls = IreeModule.submit, []

    def failing(self, *a, **kw):
        calls.append(1)
        if len(calls) == DECODE_WINDOW + 2:
            raise IreeRuntimeError("injected failure")
        return real(self, *a, **kw)

    monkeypatch.setattr(IreeModule, "submit", failing)
    with pytest.raises(IreeRuntimeError, match="injected failure"):
        gen.generate(PROMPT[:1], STEPS, logits=False)
    assert gen.position == 0
    monkeypatch.setattr(IreeModule, "submit", real)
    assert gen.generate(PROMPT[:1], STEPS, logits=False).tokens == ref
    # the same mid-prompt: a prompt longer than the window, failing at its sixth call
    prompt = PROMPT + PROMPT[::-1]
    want = gen.generate(prompt, 3, logits=False).tokens
    calls.clear()
    monkeypatch.setattr(IreeModule, "submit", failing)
    with pytest.raises(IreeRuntimeError, match="injected failure"):
        gen.generate(prompt, 3, logits=False)
    assert gen.position == 0 and len(calls) == DECODE_WINDOW + 2
    monkeypatch.setattr(IreeModule, "submit", real)
    assert gen.generate(prompt, 3, logits=False).tokens == want


def test_cli(seed_fp32, folders, tmp_path):
    res = CliRunner().invoke(cli, ["apply", str(seed_fp32[0]), "--next-token", "-o", str(tmp_path / "ort"), "--quiet"])
    assert res.exit_code == 0, res.output
    assert Generator(tmp_path / "ort").interface.next_token == NEXT_TOKEN
    ref = Generator.reference(folders["source"]).generate([3], STEPS).tokens
    for flag, on_device in (("--device-decode", True), (None, False), ("--host-decode", False)):
        res = CliRunner().invoke(cli, ["generate", str(folders["t1"]), "--prompt-ids", "3", "--max-new-tokens", str(STEPS),
                                       *([flag] if flag else [])])
        assert res.exit_code == 0, res.output
        assert res.output.splitlines()[0] == ",".join(map(str, ref))
        assert ("decode steps on the device" in res.output) is on_device, flag
    # --compare on the one-token folder: a five-token prompt, each call's logits against the reference's
    res = CliRunner().invoke(cli, ["generate", str(folders["t1"]), "--prompt-ids", ",".join(map(str, PROMPT)),
                                   "--max-new-tokens", "4", "--compare", str(folders["source"])])
    assert res.exit_code == 0, res.output
    assert "compare: PASS" in res.output and "4 of 4 tokens equal" in res.output
    # --device-decode on a folder that cannot: said, and the host's loop gives the tokens
    res = CliRunner().invoke(cli, ["generate", str(folders["dyn"]), "--prompt-ids", "3", "--max-new-tokens", "4", "--device-decode"])
    assert res.exit_code == 0, res.output
    assert "--device-decode: this folder decodes on the host" in res.output
