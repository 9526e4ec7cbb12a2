"""``onnx_io.load`` followed by ``onnx_io.to_model`` / ``onnx_io.save`` is lossless.

* every node test case of ``onnx.backend.test.case.node`` and every model file of ``onnx/backend/test/data``
  round-trips to the same deterministic serialization (where it would not, the failure says whether ONNX
  Runtime's outputs differ too: identical bytes need no run);
* external data is never read by load/save, and is copied next to the saved model;
* unreadable files and missing or short external data raise :class:`ModelLoadError` naming what is wrong;
* If/Loop bodies reading outer-scope values register those reads as uses (``IMPLICIT_PORT``);
* functions, metadata, doc strings, value_info and proto2 field presence survive.
"""

from __future__ import annotations

import ctypes
import difflib
import glob
import json
import os
import shutil
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from rewrite.core import onnx_io
from rewrite.core.ir import IMPLICIT_PORT, SINK
from rewrite.errors import ModelLoadError

ONNX_ROOT = os.path.dirname(onnx.__file__)
DATA_DIR = os.path.join(ONNX_ROOT, "backend", "test", "data")
LIGHT_PREFIX = "onnx/backend/test/data/light/"


# ------------------------------------------------------------------ helpers
def _ser(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString(deterministic=True)


def _text_diff(a: onnx.ModelProto, b: onnx.ModelProto, limit: int = 80) -> str:
    lines = list(difflib.unified_diff(str(a).splitlines(True), str(b).splitlines(True), "original", "round-tripped", n=3))
    more = f"\n... ({len(lines) - limit} more diff lines)" if len(lines) > limit else ""
    return "".join(lines[:limit]) + more


def _assert_same_bytes(original: onnx.ModelProto, result: onnx.ModelProto, feed_sets: list[dict] | None = None) -> bytes:
    """Fail unless both serialize to the same bytes; when they differ, the message also says whether ONNX
    Runtime's outputs for ``feed_sets`` differ (run only then: identical bytes are one model run twice)."""
    before, after = _ser(original), _ser(result)
    if before != after:
        verdict = _ort_verdict(before, after, feed_sets) if feed_sets else "no inputs to run it on"
        pytest.fail(f"round trip changed the model ({verdict}):\n" + _text_diff(original, result), pytrace=False)
    return after


def _session(model: bytes | str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _ortvalue_of(x: np.ndarray, elem_type: int) -> ort.OrtValue:
    """An OrtValue for a tensor numpy cannot hand to ORT (bfloat16, float8, int4, ...): its ONNX bytes, copied."""
    raw = numpy_helper.from_array(x).raw_data  # packed the way ONNX (and ORT) lay sub-byte types out
    ov = ort.OrtValue.ortvalue_from_shape_and_type(list(x.shape), elem_type)
    assert ov.tensor_size_in_bytes() == len(raw)
    ctypes.memmove(ov.data_ptr(), raw, len(raw))
    return ov


def _fetch(ov: ort.OrtValue):
    """An output numpy cannot represent, as (ONNX element type, shape, bytes)."""
    try:
        return ov.numpy()
    except Exception:  # noqa: BLE001
        return ("raw", ov.element_type(), tuple(ov.shape()), ctypes.string_at(ov.data_ptr(), ov.tensor_size_in_bytes()))


_ML_DTYPE_NAMES = ("bfloat16", "float8", "float4", "int4", "uint4", "int2", "uint2")


def _run(model: bytes | str, feeds: dict) -> list:
    sess = _session(model)
    if not any(isinstance(x, np.ndarray) and x.dtype.name.startswith(_ML_DTYPE_NAMES) for x in feeds.values()):
        try:
            return sess.run(None, feeds)
        except RuntimeError as e:
            if "No corresponding Numpy type" not in str(e):
                raise
    # tensors of types numpy lacks: feed and fetch OrtValues
    graph = (onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(model, load_external_data=False)).graph
    types = {i.name: i.type for i in graph.input}
    ov_feeds = {}
    for name, x in feeds.items():
        if isinstance(x, np.ndarray) and x.dtype.name.startswith(_ML_DTYPE_NAMES):
            ov_feeds[name] = _ortvalue_of(x, types[name].tensor_type.elem_type)
        elif isinstance(x, np.ndarray):
            ov_feeds[name] = ort.OrtValue.ortvalue_from_numpy(x)
        else:
            raise NotImplementedError(f"input '{name}': {type(x).__name__} next to a tensor type numpy lacks")
    return [_fetch(v) for v in sess.run_with_ort_values(None, ov_feeds)]


def _assert_same_outputs(ref, got, where: str = "output") -> None:
    """Exact equality (NaNs equal NaNs) of ORT results: arrays, sequences (lists), optionals (None), maps."""
    if ref is None:
        assert got is None, f"{where}: expected None, got {type(got).__name__}"
    elif isinstance(ref, np.ndarray):
        assert isinstance(got, np.ndarray), f"{where}: expected an array, got {type(got).__name__}"
        assert (got.dtype, got.shape) == (ref.dtype, ref.shape), f"{where}: {got.dtype}{got.shape} != {ref.dtype}{ref.shape}"
        np.testing.assert_array_equal(got, ref, err_msg=where, strict=True)
    elif isinstance(ref, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(ref), f"{where}: sequence of {len(ref)} expected"
        for k, (r, g) in enumerate(zip(ref, got)):
            _assert_same_outputs(r, g, f"{where}[{k}]")
    elif isinstance(ref, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(ref), f"{where}: map keys differ"
        for k in ref:
            _assert_same_outputs(ref[k], got[k], f"{where}[{k!r}]")
    else:
        assert type(got) is type(ref), f"{where}: {type(got).__name__} != {type(ref).__name__}"
        assert got == ref or (got != got and ref != ref), f"{where}: {got!r} != {ref!r}"


def test_output_comparison_is_exact_and_nan_aware():
    nan = np.array([1.0, np.nan, -0.0], np.float32)
    _assert_same_outputs(nan, nan.copy())
    _assert_same_outputs([nan, None, {"k": nan}], [nan.copy(), None, {"k": nan.copy()}])
    _assert_same_outputs(("raw", 16, (2,), b"ab"), ("raw", 16, (2,), b"ab"))
    for other in (nan.astype(np.float64), nan[:2], np.array([1.0, np.nan, 1e-7], np.float32), [nan], None):
        with pytest.raises(AssertionError):
            _assert_same_outputs(nan, other)
    with pytest.raises(AssertionError):
        _assert_same_outputs(("raw", 16, (2,), b"ab"), ("raw", 16, (2,), b"ac"))
    with pytest.raises(AssertionError):
        _assert_same_outputs([nan, nan], [nan])


def _as_feed(x):
    """A test-data input as ORT takes it (TensorProto and numpy scalars become arrays, sequences lists)."""
    if isinstance(x, TensorProto):
        return numpy_helper.to_array(x)
    if isinstance(x, (list, tuple)):
        return [_as_feed(i) for i in x]
    if x is None or isinstance(x, dict):
        return x
    return np.asarray(x)


def _ort_verdict(original: bytes, roundtripped: bytes, feed_sets: list[dict]) -> str:
    """Whether ONNX Runtime gives the two models the same outputs, as a phrase for a failure message."""
    try:
        refs = [_run(original, feeds) for feeds in feed_sets]
    except Exception as e:  # noqa: BLE001 - ORT refusing the original is part of the verdict, not an error
        return f"ONNX Runtime cannot run the original: {type(e).__name__}"
    try:
        for feeds, ref in zip(feed_sets, refs):
            got = _run(roundtripped, feeds)
            assert len(got) == len(ref)
            for k, (r, g) in enumerate(zip(ref, got)):
                _assert_same_outputs(r, g, f"output {k}")
    except Exception as e:  # noqa: BLE001 - an assertion or an ORT refusal of the result
        return f"and ONNX Runtime's outputs differ: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"
    return "ONNX Runtime's outputs are the same"


# ------------------------------------------------------------ onnx node test cases
def _collect_node_cases():
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return collect_testcases()


NODE_CASES = _collect_node_cases()


def test_node_case_count():
    assert len(NODE_CASES) == 1884
    assert len({c.name for c in NODE_CASES}) == len(NODE_CASES)


@pytest.mark.parametrize("case", NODE_CASES, ids=[c.name for c in NODE_CASES])
def test_node_case_roundtrip(case):
    model = case.model
    before = _ser(model)
    result = onnx_io.to_model(onnx_io.load(model))
    assert _ser(model) == before, "load() modified the ModelProto it was given"
    names = [vi.name for vi in model.graph.input]
    feed_sets = [{n: _as_feed(x) for n, x in zip(names, inputs)} for inputs, _outputs in case.data_sets]
    _assert_same_bytes(model, result, feed_sets)


# ------------------------------------------------------------ model files under onnx/backend/test/data
def _model_file_params() -> list:
    params, light_used = [], set()
    for suite in sorted(os.listdir(DATA_DIR)):
        suite_dir = os.path.join(DATA_DIR, suite)
        if suite == "light" or not os.path.isdir(suite_dir):
            continue
        for test in sorted(os.listdir(suite_dir)):
            params.append(pytest.param(os.path.join(suite_dir, test), id=f"{suite}/{test}"))
            meta = os.path.join(suite_dir, test, "data.json")
            if os.path.isfile(meta):
                url = json.load(open(meta)).get("url", "")
                if url.startswith(LIGHT_PREFIX):
                    light_used.add(url[len(LIGHT_PREFIX):])
    # light models not already reached through a 'real' test's data.json
    for f in sorted(glob.glob(os.path.join(DATA_DIR, "light", "*.onnx"))):
        if os.path.basename(f) not in light_used:
            params.append(pytest.param(f, id=f"light/{os.path.basename(f)}"))
    return params


MODEL_FILES = _model_file_params()


def _read_pb(path: str, type_proto: onnx.TypeProto):
    data = open(path, "rb").read()
    kind = type_proto.WhichOneof("value")
    if kind == "sequence_type":
        p = onnx.SequenceProto()
        p.ParseFromString(data)
        return numpy_helper.to_list(p)
    if kind == "optional_type":
        p = onnx.OptionalProto()
        p.ParseFromString(data)
        return numpy_helper.to_optional(p)
    if kind == "map_type":
        p = onnx.MapProto()
        p.ParseFromString(data)
        return numpy_helper.to_dict(p)
    t = TensorProto()
    t.ParseFromString(data)
    return numpy_helper.to_array(t)


def _index(path: str) -> int:
    return int(os.path.basename(path).rsplit("_", 1)[1].split(".")[0])


def _model_path_and_feeds(entry: str) -> tuple[str, list[dict] | None]:
    """The model file of a test directory (or a light model file) and its input sets (None: none usable)."""
    if entry.endswith(".onnx"):
        return entry, None
    path = os.path.join(entry, "model.onnx")
    if not os.path.isfile(path):
        meta = os.path.join(entry, "data.json")
        url = json.load(open(meta)).get("url", "") if os.path.isfile(meta) else ""
        light = os.path.join(DATA_DIR, "light", url[len(LIGHT_PREFIX):]) if url.startswith(LIGHT_PREFIX) else ""
        if not light or not os.path.isfile(light):
            pytest.skip(f"model.onnx absent ({'data.json points to ' + url if url else 'no data.json'})")
        return light, None
    model = onnx.load(path, load_external_data=False)
    feed_sets = []
    for ds in sorted(glob.glob(os.path.join(entry, "test_data_set_*"))):
        files = sorted(glob.glob(os.path.join(ds, "input_*.pb")), key=_index)
        feed_sets.append({model.graph.input[_index(f)].name: _read_pb(f, model.graph.input[_index(f)].type) for f in files})
    return path, feed_sets


def _dummy_feeds(model: onnx.ModelProto) -> list[dict] | None:
    """Inputs like onnx's backend runner makes for the light models: arange / n, float inputs only."""
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or tt.elem_type != TensorProto.FLOAT:
            return None
        shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in tt.shape.dim)
        n = int(np.prod(shape))
        feeds[vi.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
    return [feeds]


@pytest.mark.parametrize("entry", MODEL_FILES)
def test_model_file_roundtrip(entry):
    path, feed_sets = _model_path_and_feeds(entry)
    original = onnx.load(path, load_external_data=False)
    result = onnx_io.to_model(onnx_io.load(path))
    _assert_same_bytes(original, result, feed_sets if feed_sets is not None else _dummy_feeds(original))


def test_model_file_inventory():
    ids = [p.id for p in MODEL_FILES]
    suites = {i.split("/")[0] for i in ids}
    assert {"pytorch-converted", "pytorch-operator", "simple", "real"} <= suites
    assert len(ids) == len(set(ids))
    assert len(glob.glob(os.path.join(DATA_DIR, "*", "*", "model.onnx"))) <= len(ids)


# ------------------------------------------------------------ external data
def _mlp_model(rng: np.random.Generator) -> onnx.ModelProto:
    w1 = rng.standard_normal((8, 64)).astype(np.float32)
    b1 = rng.standard_normal(64).astype(np.float32)
    w2 = rng.standard_normal((64, 4)).astype(np.float32)
    scale = np.array(0.5, np.float32)
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["h0"], name="mm1"),
        helper.make_node("Add", ["h0", "B1"], ["h1"], name="add1"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu"),
        helper.make_node("MatMul", ["h2", "W2"], ["h3"], name="mm2"),
        helper.make_node("Mul", ["h3", "scale"], ["Y"], name="scale"),
    ]
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "W1"), (b1, "B1"), (w2, "W2"), (scale, "scale"))]
    g = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4, 4])], inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="test")
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _mlp_reference(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    w = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    return (np.maximum(x @ w["W1"] + w["B1"], 0) @ w["W2"]) * w["scale"]


def _save_external(m: onnx.ModelProto, path: str, location: str = "weights.data") -> None:
    m = onnx.ModelProto.FromString(m.SerializeToString())  # onnx.save converts the model it is given in place
    onnx.save(m, path, save_as_external_data=True, all_tensors_to_one_file=True, location=location, size_threshold=0)


@pytest.fixture
def external_model(tmp_path):
    rng = np.random.default_rng(0)
    m = _mlp_model(rng)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    d1 = tmp_path / "src"
    d1.mkdir()
    _save_external(m, str(d1 / "model.onnx"))
    return m, x, d1


def _forbid_data_reads(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("tensor data was read")

    monkeypatch.setattr(onnx.numpy_helper, "to_array", boom)
    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_tensor", boom)
    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_model", boom)


def test_external_data_roundtrip_through_files(external_model, tmp_path, monkeypatch):
    m, x, d1 = external_model
    src = d1 / "model.onnx"
    assert sorted(os.listdir(d1)) == ["model.onnx", "weights.data"]
    expected = _run(str(src), {"X": x})[0]
    np.testing.assert_allclose(expected, _mlp_reference(m, x), rtol=1e-5, atol=1e-5)

    with monkeypatch.context() as mp:
        _forbid_data_reads(mp)
        g = onnx_io.load(src)
        assert g.initializers == ["W1", "B1", "W2", "scale"]
        for name in g.initializers:
            v = g.values[name]
            assert v._const_cache is None
            assert v.initializer.data_location == TensorProto.EXTERNAL
            assert not v.initializer.HasField("raw_data")
            assert {e.key: e.value for e in v.initializer.external_data}["location"] == "weights.data"
        # the in-memory round trip is the file's protobuf, external references included
        assert _ser(onnx_io.to_model(g)) == _ser(onnx.load(str(src), load_external_data=False))
        d2 = tmp_path / "dst"
        out = onnx_io.save(g, d2 / "copy.onnx")
        for name in g.initializers:
            assert g.values[name]._const_cache is None, f"save read '{name}'"

    assert out == d2 / "copy.onnx"
    assert sorted(os.listdir(d2)) == ["copy.onnx", "copy.onnx.data"]
    shutil.rmtree(d1)  # the copy must not reference the old directory

    saved = onnx.load(str(out), load_external_data=False)
    assert [t.name for t in saved.graph.initializer] == ["W1", "B1", "W2", "scale"]
    for t in saved.graph.initializer:
        assert t.data_location == TensorProto.EXTERNAL
        assert {e.key: e.value for e in t.external_data}["location"] == "copy.onnx.data"
    got = _run(str(out), {"X": x})
    assert len(got) == 1
    _assert_same_outputs(expected, got[0])

    # the copied data is right, tensor by tensor, and the reloaded graph reads it lazily
    g2 = onnx_io.load(out)
    assert all(g2.values[n]._const_cache is None for n in g2.initializers)
    for t in m.graph.initializer:
        data = g2.const(t.name)
        np.testing.assert_array_equal(data, numpy_helper.to_array(t), strict=True)
        # a memory map per call, never kept: a model larger than memory is read one tensor at a time
        assert isinstance(data, np.memmap) and g2.values[t.name]._const_cache is None
    full = onnx.load(str(out))
    assert _ser(full.graph.node[0]) == _ser(m.graph.node[0])
    assert [numpy_helper.to_array(t).tolist() for t in full.graph.initializer] == [
        numpy_helper.to_array(t).tolist() for t in m.graph.initializer
    ]


def test_external_data_const_reads_one_tensor(external_model):
    m, _, d1 = external_model
    g = onnx_io.load(d1 / "model.onnx")
    b1 = g.const("B1")
    np.testing.assert_array_equal(b1, numpy_helper.to_array(m.graph.initializer[1]), strict=True)
    # a copy-on-write map of B1's bytes alone: nothing else read, nothing cached, writes stay private
    info = {e.key: e.value for e in g.values["B1"].initializer.external_data}
    assert isinstance(b1, np.memmap) and b1.offset == int(info["offset"]) and b1.nbytes == int(info["length"])
    assert b1.filename == str((d1 / "weights.data").resolve())
    assert all(g.values[n]._const_cache is None for n in g.initializers)
    b1[...] = 7
    np.testing.assert_array_equal(g.const("B1"), numpy_helper.to_array(m.graph.initializer[1]), strict=True)


def test_inline_model_saved_with_external_data(tmp_path):
    m = _mlp_model(np.random.default_rng(1))
    g = onnx_io.load(m)
    out = onnx_io.save(g, tmp_path / "ext.onnx", external=True)
    saved = onnx.load(str(out), load_external_data=False)
    big = {t.name for t in saved.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert big == {t.name for t in m.graph.initializer if t.ByteSize() >= onnx_io.EXTERNAL_MIN_BYTES}
    assert big == {"W1", "W2"}
    x = np.ones((4, 8), np.float32)
    _assert_same_outputs(_run(_ser(m), {"X": x})[0], _run(str(out), {"X": x})[0])
    # and back inline
    out2 = onnx_io.save(onnx_io.load(out), tmp_path / "inline" / "m.onnx", external=False)
    assert os.listdir(out2.parent) == ["m.onnx"]
    assert _ser(onnx.load(str(out2))) == _ser(m)


def test_missing_external_data_file(external_model):
    _, _, d1 = external_model
    os.remove(d1 / "weights.data")
    with pytest.raises(ModelLoadError) as ei:
        onnx_io.load(d1 / "model.onnx")
    msg = str(ei.value)
    assert "\n" not in msg
    assert "'W1'" in msg and "weights.data" in msg and str(d1 / "model.onnx") in msg


def test_truncated_external_data_file(external_model):
    m, _, d1 = external_model
    data = d1 / "weights.data"
    size = os.path.getsize(data)
    saved = onnx.load(str(d1 / "model.onnx"), load_external_data=False)
    ends = {t.name: sum(int(e.value) for e in t.external_data if e.key in ("offset", "length")) for t in saved.graph.initializer}
    assert max(ends.values()) == size
    cut = ends["W1"] + 4  # W1 still complete, B1 cut short
    with open(data, "r+b") as f:
        f.truncate(cut)
    with pytest.raises(ModelLoadError) as ei:
        onnx_io.load(d1 / "model.onnx")
    msg = str(ei.value)
    assert "\n" not in msg
    assert "'B1'" in msg and "weights.data" in msg and f"is {cut} bytes" in msg


def _assert_load_error_names(path) -> str:
    with pytest.raises(ModelLoadError) as ei:
        onnx_io.load(path)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    assert msg.startswith(str(path)), msg
    return msg


def test_not_onnx_random_bytes(tmp_path):
    p = tmp_path / "random.onnx"
    p.write_bytes(np.random.default_rng(123).bytes(4096))
    _assert_load_error_names(p)


def test_not_onnx_text_file(tmp_path):
    p = tmp_path / "notes.onnx"
    p.write_text("This is a text file.\nIt is not an ONNX model.\n" * 20)
    _assert_load_error_names(p)


def test_truncated_onnx_file(tmp_path):
    m = _mlp_model(np.random.default_rng(2))
    full = tmp_path / "full.onnx"
    onnx.save(m, str(full))
    data = full.read_bytes()
    p = tmp_path / "half.onnx"
    p.write_bytes(data[: len(data) // 2])
    msg = _assert_load_error_names(p)
    assert "not a readable ONNX model" in msg


def test_empty_and_missing_files(tmp_path):
    p = tmp_path / "empty.onnx"
    p.write_bytes(b"")
    _assert_load_error_names(p)
    assert "no such file" in _assert_load_error_names(tmp_path / "absent.onnx")


# ------------------------------------------------------------ subgraphs reading outer values
def _control_flow_model() -> onnx.ModelProto:
    f = TensorProto.FLOAT
    one = numpy_helper.from_array(np.array([1.0, 1.0, 1.0], np.float32), "one")
    then_g = helper.make_graph(
        [helper.make_node("Add", ["Y", "one"], ["t_out"], name="then_add")], "then", [],
        [helper.make_tensor_value_info("t_out", f, [3])], [one],
    )
    else_g = helper.make_graph(
        [helper.make_node("Neg", ["Y"], ["e_out"], name="else_neg")], "else", [],
        [helper.make_tensor_value_info("e_out", f, [3])],
    )
    # Loop body: v += Y; and a nested If reading the graph-level initializer S (outer of the outer)
    inner_then = helper.make_graph(
        [helper.make_node("Mul", ["v_in", "S"], ["it"], name="inner_mul")], "inner_then", [],
        [helper.make_tensor_value_info("it", f, [3])],
    )
    inner_else = helper.make_graph(
        [helper.make_node("Identity", ["v_in"], ["ie"], name="inner_id")], "inner_else", [],
        [helper.make_tensor_value_info("ie", f, [3])],
    )
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond"),
            helper.make_node("If", ["cond_in"], ["scaled"], name="body_if", then_branch=inner_then, else_branch=inner_else),
            helper.make_node("Add", ["scaled", "Y"], ["v_out"], name="body_add"),
        ],
        "body",
        [
            helper.make_tensor_value_info("iter", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_in", f, [3]),
        ],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("v_out", f, [3])],
    )
    nodes = [
        helper.make_node("Relu", ["X"], ["Y"], name="relu"),
        helper.make_node("If", ["c"], ["Z"], name="if", then_branch=then_g, else_branch=else_g),
        helper.make_node("Loop", ["M", "c", "X"], ["L"], name="loop", body=body),
    ]
    g = helper.make_graph(
        nodes,
        "control_flow",
        [
            helper.make_tensor_value_info("X", f, [3]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("M", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("Z", f, [3]), helper.make_tensor_value_info("L", f, [3])],
        [numpy_helper.from_array(np.array(2.0, np.float32), "S")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _control_flow_reference(x, c, m):
    y = np.maximum(x, 0)
    z = y + 1 if c else -y
    v = x.copy()
    for _ in range(m if c else 0):  # the loop condition starts as c and stays c
        v = v * 2 + y
    return z, v


def test_subgraph_outer_reads_are_uses():
    m = _control_flow_model()
    g = onnx_io.load(m)
    if_id, loop_id = g.find_node("if").id, g.find_node("loop").id
    assert sorted(g.uses("Y")) == sorted([(if_id, IMPLICIT_PORT), (loop_id, IMPLICIT_PORT)])
    assert [n.name for n in g.consumers("Y")] == ["if", "loop"]
    assert g.uses("S") == [(loop_id, IMPLICIT_PORT)]  # read two scopes down, inside the body's If
    assert sorted(g.uses("X")) == sorted([(g.find_node("relu").id, 0), (loop_id, 2)])
    assert g.uses("Z") == [(SINK, 0)] and g.uses("L") == [(SINK, 1)]
    # the bodies are kept whole: same protos as in the source
    assert _ser(g.find_node("loop").attrs["body"]) == _ser(m.graph.node[2].attribute[0])
    assert [n.name for n in g.topo_nodes()] == ["relu", "if", "loop"]
    # Y cannot be removed while the bodies read it
    with pytest.raises(Exception, match="'relu'.*'Y'.*'if'"):
        g.remove_node(g.find_node("relu"))


def test_subgraph_model_roundtrip_and_runs():
    m = _control_flow_model()
    after = _assert_same_bytes(m, onnx_io.to_model(onnx_io.load(m)))
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    for c in (True, False):
        feeds = {"X": x, "c": np.array(c), "M": np.array(3, np.int64)}
        ref, got = _run(_ser(m), feeds), _run(after, feeds)
        for r, o in zip(ref, got):
            _assert_same_outputs(r, o)
        z, l_ = _control_flow_reference(x, c, 3)
        np.testing.assert_allclose(got[0], z, rtol=0, atol=0)
        np.testing.assert_allclose(got[1], l_, rtol=1e-6)


# ------------------------------------------------------------ everything else ONNX carries
def _rich_model() -> onnx.ModelProto:
    f = TensorProto.FLOAT
    # a model-local function with an attribute parameter, doc string and its own opset import
    fn = helper.make_function(
        "local.fns", "ScaledRelu", ["a"], ["b"],
        [
            helper.make_node("Constant", [], ["s"], value_float=1.0, name="const_s"),
            helper.make_node("Relu", ["a"], ["r"], name="fn_relu"),
            helper.make_node("Mul", ["r", "s"], ["b"], name="fn_mul"),
        ],
        [helper.make_opsetid("", 17)],
        attributes=["alpha"],
    )
    fn.doc_string = "relu then scale"
    fp = fn.metadata_props.add()
    fp.key, fp.value = "fn_key", "fn_value"
    fn2 = helper.make_function(
        "local.fns", "Twice", ["a"], ["b"],
        [helper.make_node("ScaledRelu", ["a"], ["t"], domain="local.fns"), helper.make_node("Add", ["t", "t"], ["b"])],
        [helper.make_opsetid("", 17), helper.make_opsetid("local.fns", 1)],
    )
    n1 = helper.make_node("ScaledRelu", ["X"], ["h"], domain="local.fns", name="call1", doc_string="calls a function")
    mp = n1.metadata_props.add()
    mp.key, mp.value = "node_key", "node_value"
    n2 = helper.make_node("Twice", ["h"], ["h2"], domain="local.fns", name="call2")
    n3 = helper.make_node("Add", ["h2", "bias"], ["Y"], name="")  # name explicitly empty
    n3.domain = ""  # domain explicitly empty
    g = helper.make_graph(
        [n1, n2, n3], "rich",
        [helper.make_tensor_value_info("X", f, ["N", 3], doc_string="input doc")],
        [helper.make_tensor_value_info("Y", f, ["N", 3], doc_string="output doc")],
        [numpy_helper.from_array(np.array([0.5, -1.0, 2.0], np.float32), "bias")],
        doc_string="graph doc",
        value_info=[helper.make_tensor_value_info("h", f, ["N", 3]), helper.make_tensor_value_info("h2", f, None)],
    )
    gm = g.metadata_props.add()
    gm.key, gm.value = "graph_key", "graph_value"
    m = helper.make_model(
        g,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local.fns", 1)],
        functions=[fn, fn2],
        producer_name="rewrite-tests",
        producer_version="0.1",
        domain="org.example",
        model_version=7,
        doc_string="model doc",
    )
    m.ir_version = 10
    helper.set_model_props(m, {"author": "tests", "license": "none"})
    onnx.checker.check_model(m)
    return m


def test_functions_metadata_docstrings_roundtrip():
    m = _rich_model()
    g = onnx_io.load(m)
    assert [n.name for n in g.topo_nodes()] == ["call1", "call2", ""]
    assert g.opset("") == 17 and g.opset("local.fns") == 1
    assert g.find_node("call1").extra.doc_string == "calls a function"
    after = _assert_same_bytes(m, onnx_io.to_model(g))
    x = np.array([[-1.0, 0.0, 3.0], [2.0, -2.0, 0.25]], np.float32)
    ref, got = _run(_ser(m), {"X": x}), _run(after, {"X": x})
    _assert_same_outputs(ref[0], got[0])
    np.testing.assert_array_equal(got[0], 2 * np.maximum(x, 0) + np.array([0.5, -1.0, 2.0], np.float32))


def test_file_roundtrip_inline(tmp_path):
    m = _rich_model()
    src = tmp_path / "rich.onnx"
    onnx.save(m, str(src))
    out = onnx_io.save(onnx_io.load(src), tmp_path / "out" / "rich.onnx")
    assert os.listdir(out.parent) == ["rich.onnx"]
    assert out.read_bytes() == src.read_bytes()


def _vi(name, shape=None, elem=TensorProto.FLOAT, **kw):
    return helper.make_tensor_value_info(name, elem, shape, **kw)


def _edge_models():
    """Small models exercising corners of the format; ids name the corner."""
    X, Y = _vi("X", [2]), _vi("Y", [2])
    W = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "W")
    relu = helper.make_node("Relu", ["X"], ["Y"])
    out = []

    g = onnx.GraphProto()  # no graph name at all
    g.node.append(relu)
    g.input.append(X)
    g.output.append(Y)
    out.append(("graph_without_name", helper.make_model(g)))

    g = helper.make_graph([relu], "g", [X], [Y])
    g.doc_string = ""  # explicitly empty
    out.append(("graph_empty_doc_string", helper.make_model(g)))

    m = helper.make_model(helper.make_graph([relu], "g", [X], [Y]))
    m.doc_string = ""
    m.producer_name = ""
    out.append(("model_empty_strings", m))

    n = helper.make_node("Relu", ["X"], ["Y"], name="", domain="")
    out.append(("node_empty_name_and_domain", helper.make_model(helper.make_graph([n], "g", [X], [Y]))))

    nodes = [helper.make_node("Relu", ["X"], ["Z"]), helper.make_node("Add", ["Z", "W"], ["Y"])]
    vis = [_vi("Y", [2]), _vi("W", [2]), _vi("X", [2]), _vi("Z")]
    out.append(("value_info_for_inputs_and_initializers", helper.make_model(helper.make_graph(nodes, "g", [X], [Y], [W], value_info=vis))))

    vis = [_vi("X", ["n"])]  # differs from the input's declaration
    out.append(("value_info_differs_from_input", helper.make_model(helper.make_graph([relu], "g", [X], [Y], value_info=vis))))

    out.append(("output_less_precise_than_value_info", helper.make_model(helper.make_graph([relu], "g", [X], [_vi("Y")], value_info=[_vi("Y", [2])]))))
    out.append(("output_differs_from_value_info", helper.make_model(helper.make_graph([relu], "g", [X], [Y], value_info=[_vi("Y", ["n"])]))))
    out.append(("input_is_also_output", helper.make_model(helper.make_graph([relu], "g", [X], [Y, _vi("X")]))))
    out.append(("initializer_is_output", helper.make_model(helper.make_graph([relu], "g", [X], [Y, _vi("W")], [W]))))
    out.append(("same_output_twice", helper.make_model(helper.make_graph([relu], "g", [X], [Y, Y]))))
    out.append(("untyped_output", helper.make_model(helper.make_graph([relu], "g", [X], [onnx.ValueInfoProto(name="Y")]))))
    out.append(("ir3_input_with_initializer", helper.make_model(helper.make_graph(
        [helper.make_node("Add", ["X", "W"], ["Y"])], "g", [_vi("W", [2]), X], [Y], [W]))))
    drop = helper.make_node("Dropout", ["X"], ["Y", ""])
    out.append(("empty_optional_output", helper.make_model(helper.make_graph([drop], "g", [X], [Y]))))
    sp = helper.make_sparse_tensor(numpy_helper.from_array(np.array([1.0], np.float32), "S"), numpy_helper.from_array(np.array([1], np.int64)), [2])
    g = helper.make_graph([helper.make_node("Add", ["X", "S"], ["Y"])], "g", [X], [Y])
    g.sparse_initializer.append(sp)
    out.append(("sparse_initializer", helper.make_model(g)))
    g = helper.make_graph([relu], "g", [X], [Y])
    qa = g.quantization_annotation.add()
    qa.tensor_name = "Y"
    e = qa.quant_parameter_tensor_names.add()
    e.key, e.value = "SCALE_TENSOR", "W"
    out.append(("quantization_annotation", helper.make_model(g)))
    m = helper.make_model(helper.make_graph([relu], "g", [X], [Y]))
    m.training_info.add().algorithm.name = "train"
    out.append(("training_info", m))
    seq = helper.make_node("SequenceConstruct", ["X", "X"], ["S"])
    out.append(("sequence_output", helper.make_model(helper.make_graph([seq], "g", [X], [helper.make_tensor_sequence_value_info("S", TensorProto.FLOAT, [2])]))))
    return out


EDGE_MODELS = _edge_models()


@pytest.mark.parametrize("model", [m for _, m in EDGE_MODELS], ids=[i for i, _ in EDGE_MODELS])
def test_format_corners_roundtrip(model):
    _assert_same_bytes(model, onnx_io.to_model(onnx_io.load(model)))
