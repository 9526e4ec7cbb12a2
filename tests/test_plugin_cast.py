"""The ``cast`` plugin: Cast(Cast(x: T, to=W), to=T) -> x exactly when W holds every value of T.

Exact cases are checked bit for bit on ONNX Runtime against the original model, over every bit pattern of
8- and 16-bit types (NaN payloads, infinities, subnormals, -0) and over specials plus random bit patterns of
wider types. Lossy cases must leave the model byte-identical, and each comes with a witness: ONNX Runtime's
round trip really changes some input, so rewriting it would be wrong.
"""

from __future__ import annotations

import ctypes

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from rewrite.core import onnx_io
from rewrite.core.driver import run_plugin
from rewrite.core.shapes import infer_shapes
from rewrite.plugins.cast_roundtrip import CastRoundtrip

OPSET = 21
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# ------------------------------------------------------------------ helpers
def _model(nodes, inputs, outputs, inits=(), value_info=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits), value_info=list(value_info))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="tests")
    m.ir_version = 10
    onnx.checker.check_model(m, full_check=True)
    return m


def _roundtrip_model(t: int, w: int, n: int, back: int | None = None) -> onnx.ModelProto:
    """X: t[n] -> Cast(to=w) 'inner' -> Cast(to=back or t) 'outer' -> Y (a graph output)."""
    back = t if back is None else back
    return _model(
        [helper.make_node("Cast", ["X"], ["W"], to=w, name="inner"), helper.make_node("Cast", ["W"], ["Y"], to=back, name="outer")],
        [helper.make_tensor_value_info("X", t, [n])],
        [helper.make_tensor_value_info("Y", back, [n])],
    )


def _itemsize(t: int) -> int:
    return np.dtype(helper.tensor_dtype_to_np_dtype(t)).itemsize


def _stress_bits(t: int) -> np.ndarray:
    """Bit patterns of element type ``t`` (as unsigned ints of its size) that stress a Cast round trip.

    8- and 16-bit types: every pattern (all NaN payloads, both infinities, all subnormals, -0, extreme ints).
    Wider types: specials, extreme and boundary integers, and random bit patterns.
    """
    if t == TP.BOOL:
        return np.array([0, 1], np.uint8)
    size = _itemsize(t)
    u = _UINT_OF_SIZE[size]
    if size <= 2:
        return np.arange(2 ** (8 * size), dtype=np.uint64).astype(u)
    rng = np.random.default_rng(t)
    rand = rng.integers(0, 2**63, size=4096, dtype=np.uint64).astype(u) ^ rng.integers(0, 2, size=4096, dtype=np.uint64).astype(u) << (8 * size - 1)
    if t in (TP.FLOAT, TP.DOUBLE):
        f = np.float32 if t == TP.FLOAT else np.float64
        fi = np.finfo(f)
        special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, fi.tiny, -fi.tiny, fi.max, -fi.max,
                            fi.smallest_subnormal, -fi.smallest_subnormal, 1.0 + fi.eps, 2.0**24 + 2], f).view(u)
        payload_nans = np.array([0x7F800001, 0xFFC00001, 0x7FBFFFFF], np.uint32) if t == TP.FLOAT else np.array([0x7FF0000000000001], np.uint64)
        return np.concatenate([special, payload_nans.astype(u), rand])
    info = np.iinfo(helper.tensor_dtype_to_np_dtype(t))
    edges = [info.min, info.max, 0, 1, info.max - 1, info.min + 1, 2**24 + 1, 2**53 + 1]
    edges = np.array([int(v) % 2 ** (8 * size) for v in edges if info.min <= v <= info.max], np.uint64).astype(u)
    return np.concatenate([edges, rand])


def _run_bits(model: onnx.ModelProto, feeds: dict[str, tuple[int, np.ndarray]]) -> list[np.ndarray]:
    """Run on ONNX Runtime with feeds given as raw bits (any element type, bfloat16 included); returns each
    output's raw bits as unsigned ints of its element size."""
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ovs = {k: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(b), t) for k, (t, b) in feeds.items()}
    names = [o.name for o in model.graph.output]
    types = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    outs = []
    for name, ov in zip(names, sess.run_with_ort_values(names, ovs)):
        size = _itemsize(types[name])
        n = int(np.prod(ov.shape()))
        outs.append(np.frombuffer(ctypes.string_at(ov.data_ptr(), n * size), _UINT_OF_SIZE[size]).reshape(ov.shape()).copy())
    return outs


def _ser(g) -> bytes:
    return onnx_io.to_model(g).SerializeToString(deterministic=True)


def _strictly_valid(m: onnx.ModelProto) -> None:
    onnx.checker.check_model(m, full_check=True)
    onnx.shape_inference.infer_shapes(m, check_type=True, strict_mode=True)


# ------------------------------------------------------------------ the type table
N = TP.DataType.Name
EXACT = [
    (TP.FLOAT16, TP.FLOAT), (TP.BFLOAT16, TP.FLOAT), (TP.FLOAT16, TP.DOUBLE), (TP.BFLOAT16, TP.DOUBLE), (TP.FLOAT, TP.DOUBLE),
    (TP.INT8, TP.INT16), (TP.INT8, TP.INT32), (TP.INT8, TP.INT64), (TP.UINT8, TP.INT16), (TP.UINT8, TP.UINT16),
    (TP.UINT8, TP.INT32), (TP.INT16, TP.INT32), (TP.UINT16, TP.INT32), (TP.UINT16, TP.UINT64), (TP.INT32, TP.INT64),
    (TP.UINT32, TP.INT64), (TP.INT16, TP.FLOAT), (TP.UINT16, TP.FLOAT), (TP.INT8, TP.FLOAT16), (TP.UINT8, TP.FLOAT16),
    (TP.INT8, TP.BFLOAT16), (TP.UINT8, TP.BFLOAT16), (TP.INT32, TP.DOUBLE), (TP.UINT32, TP.DOUBLE),
    (TP.BOOL, TP.INT8), (TP.BOOL, TP.FLOAT), (TP.BOOL, TP.FLOAT16),
]
LOSSY = [
    (TP.FLOAT, TP.FLOAT16), (TP.INT32, TP.INT8), (TP.FLOAT, TP.BFLOAT16), (TP.BFLOAT16, TP.FLOAT16), (TP.FLOAT16, TP.BFLOAT16),
    (TP.INT32, TP.FLOAT), (TP.INT64, TP.DOUBLE), (TP.INT16, TP.FLOAT16), (TP.UINT16, TP.FLOAT16), (TP.INT16, TP.BFLOAT16),
    (TP.UINT16, TP.BFLOAT16), (TP.DOUBLE, TP.FLOAT), (TP.INT64, TP.INT32), (TP.FLOAT, TP.INT32), (TP.FLOAT16, TP.INT32),
    (TP.INT8, TP.BOOL), (TP.UINT32, TP.FLOAT),
]
TABLE = [(t, w, 1) for t, w in EXACT] + [(t, w, 0) for t, w in LOSSY]


@pytest.mark.parametrize("t, w, matches", TABLE, ids=[f"{N(t)}->{N(w)}->{N(t)}" for t, w, _ in TABLE])
def test_roundtrip_table(t, w, matches):
    bits = _stress_bits(t)
    m = _roundtrip_model(t, w, len(bits))
    g = onnx_io.load(m)
    before = _ser(g)

    rep = run_plugin(g, CastRoundtrip())

    assert rep.rules["cast-roundtrip"].matches == matches
    (orig,) = _run_bits(m, {"X": (t, bits)})
    if matches:
        # the graph output keeps its name (an Identity from the graph input: an input cannot be renamed)
        assert [(n.op_type, n.inputs, n.outputs) for n in g.topo_nodes()] == [("Identity", ["X"], ["Y"])]
        out = onnx_io.to_model(g)
        assert [o.name for o in out.graph.output] == ["Y"] and out.graph.output[0].type.tensor_type.elem_type == t
        _strictly_valid(out)
        (new,) = _run_bits(out, {"X": (t, bits)})
        np.testing.assert_array_equal(new, orig)  # bit-exact, NaN payloads included
        if t == TP.BOOL:
            np.testing.assert_array_equal(orig != 0, bits != 0)
        else:
            np.testing.assert_array_equal(orig, bits)  # ... because ORT's round trip is the identity
    else:
        assert len(g.nodes) == 2 and g.summary() == {"Cast": 2}
        assert _ser(g) == before  # byte-identical
        assert rep.rules["cast-roundtrip"].refusals == {f"Cast {N(t)}->{N(w)} is lossy": ["inner"]}
        assert not np.array_equal(orig, bits), "witness: ORT's round trip changes some value"


def test_not_a_roundtrip_is_untouched():
    m = _roundtrip_model(TP.FLOAT16, TP.FLOAT, 4, back=TP.DOUBLE)  # f16 -> f32 -> f64: two widenings
    g = onnx_io.load(m)
    before = _ser(g)
    rep = run_plugin(g, CastRoundtrip())
    assert rep.matches == 0 and _ser(g) == before
    assert list(rep.rules["cast-roundtrip"].refusals) == ["not a round trip: FLOAT16->FLOAT->DOUBLE"]


def test_unknown_element_type_is_refused_and_shape_inference_lifts_it():
    m = _model(
        [helper.make_node("Relu", ["X"], ["R"], name="relu"),
         helper.make_node("Cast", ["R"], ["W"], to=TP.FLOAT, name="inner"), helper.make_node("Cast", ["W"], ["Y"], to=TP.FLOAT16, name="outer")],
        [helper.make_tensor_value_info("X", TP.FLOAT16, [4])],
        [helper.make_tensor_value_info("Y", TP.FLOAT16, [4])],
    )
    g = onnx_io.load(m)
    before = _ser(g)
    rep = run_plugin(g, CastRoundtrip())
    assert rep.matches == 0 and _ser(g) == before
    assert "element type of 'R' is unknown (run shape inference)" in rep.rules["cast-roundtrip"].refusals
    infer_shapes(g)
    assert run_plugin(g, CastRoundtrip()).matches == 1
    assert g.summary() == {"Relu": 1}


# ------------------------------------------------------------------ seed-style fragment
def _softmax_fragment() -> tuple[onnx.ModelProto, dict]:
    """f16 attention: Softmax -> Cast(f32) -> Cast(f16) -> MatMul (item A6), and the router's Softmax -> Cast(f32)
    -> TopK, which is no round trip and stays."""
    rng = np.random.default_rng(0)
    v = rng.standard_normal((16, 8)).astype(np.float16)
    m = _model(
        [
            helper.make_node("Softmax", ["S"], ["P"], axis=-1, name="attn_softmax"),
            helper.make_node("Cast", ["P"], ["P32"], to=TP.FLOAT, name="attn_cast_f32"),
            helper.make_node("Cast", ["P32"], ["P16"], to=TP.FLOAT16, name="attn_cast_f16"),
            helper.make_node("MatMul", ["P16", "V"], ["O"], name="attn_matmul"),
            helper.make_node("Softmax", ["L"], ["RP"], axis=-1, name="router_softmax"),
            helper.make_node("Cast", ["RP"], ["RP32"], to=TP.FLOAT, name="router_cast"),
            helper.make_node("TopK", ["RP32", "k"], ["TV", "TI"], axis=-1, name="router_topk"),
        ],
        [helper.make_tensor_value_info("S", TP.FLOAT16, [2, 4, 16]), helper.make_tensor_value_info("L", TP.FLOAT16, [6, 8])],
        [helper.make_tensor_value_info("O", TP.FLOAT16, [2, 4, 8]), helper.make_tensor_value_info("TV", TP.FLOAT, [6, 2]),
         helper.make_tensor_value_info("TI", TP.INT64, [6, 2])],
        [numpy_helper.from_array(v, "V"), numpy_helper.from_array(np.array([2], np.int64), "k")],
    )
    s = (rng.standard_normal((2, 4, 16)) * 4).astype(np.float16)
    s[0, 0, :3] = [np.inf, -np.inf, 0]  # a row with an inf: NaN probabilities, carried through unchanged
    s[1, 2] = -65504
    feeds = {"S": s, "L": rng.standard_normal((6, 8)).astype(np.float16)}
    return m, feeds


def _ort(m: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(_UINT_OF_SIZE[a.itemsize]), b.view(_UINT_OF_SIZE[b.itemsize]))


def test_softmax_cast_roundtrip_in_f16_fragment():
    m, feeds = _softmax_fragment()
    g = onnx_io.load(m)
    infer_shapes(g)  # as `rewrite apply` does: the Softmax output's type comes from inference

    rep = run_plugin(g, CastRoundtrip())

    assert rep.rules["cast-roundtrip"].matches == 1 and rep.rules["cast-roundtrip"].nodes_removed == 2
    assert g.summary() == {"Softmax": 2, "Cast": 1, "MatMul": 1, "TopK": 1}
    assert g.find_node("attn_matmul").inputs == ["P", "V"]
    assert g.find_node("router_cast") is not None and g.find_node("attn_cast_f32") is None
    out = onnx_io.to_model(g)
    _strictly_valid(out)
    assert [o.name for o in out.graph.output] == ["O", "TV", "TI"]
    for a, b in zip(_ort(m, feeds), _ort(out, feeds)):
        _bits_equal(a, b)
    assert np.isnan(_ort(out, feeds)[0][0, 0]).all()  # the inf row really is in the data


def test_inner_cast_with_another_consumer_is_kept():
    m = _model(
        [
            helper.make_node("Cast", ["X"], ["W"], to=TP.FLOAT, name="inner"),
            helper.make_node("Cast", ["W"], ["Y"], to=TP.FLOAT16, name="outer"),
            helper.make_node("Neg", ["Y"], ["O16"], name="neg"),
            helper.make_node("Abs", ["W"], ["O32"], name="abs"),
        ],
        [helper.make_tensor_value_info("X", TP.FLOAT16, [65536])],
        [helper.make_tensor_value_info("O16", TP.FLOAT16, [65536]), helper.make_tensor_value_info("O32", TP.FLOAT, [65536])],
    )
    g = onnx_io.load(m)
    rep = run_plugin(g, CastRoundtrip())

    assert rep.rules["cast-roundtrip"].matches == 1 and rep.rules["cast-roundtrip"].nodes_removed == 1
    assert g.summary() == {"Abs": 1, "Cast": 1, "Neg": 1}
    assert g.find_node("inner") is not None and g.find_node("outer") is None
    assert g.find_node("neg").inputs == ["X"] and g.find_node("abs").inputs == ["W"]
    out = onnx_io.to_model(g)
    _strictly_valid(out)
    x = np.arange(65536, dtype=np.uint16).view(np.float16)  # every f16
    for a, b in zip(_ort(m, {"X": x}), _ort(out, {"X": x})):
        _bits_equal(a, b)


def test_two_chained_roundtrips_collapse_and_output_keeps_its_name():
    # f16 -> f32 -> f16 -> f64 -> f16, ending in a graph output read by nothing else
    m = _model(
        [
            helper.make_node("Cast", ["X"], ["A"], to=TP.FLOAT, name="c1"),
            helper.make_node("Cast", ["A"], ["B"], to=TP.FLOAT16, name="c2"),
            helper.make_node("Cast", ["B"], ["C"], to=TP.DOUBLE, name="c3"),
            helper.make_node("Cast", ["C"], ["Y"], to=TP.FLOAT16, name="c4"),
            helper.make_node("Relu", ["X"], ["R"], name="relu"),
            helper.make_node("Cast", ["R"], ["R32"], to=TP.FLOAT, name="c5"),
            helper.make_node("Cast", ["R32"], ["Z"], to=TP.FLOAT16, name="c6"),
        ],
        [helper.make_tensor_value_info("X", TP.FLOAT16, [65536])],
        [helper.make_tensor_value_info("Y", TP.FLOAT16, [65536]), helper.make_tensor_value_info("Z", TP.FLOAT16, [65536])],
        value_info=[helper.make_tensor_value_info("R", TP.FLOAT16, [65536])],
    )
    g = onnx_io.load(m)
    rep = run_plugin(g, CastRoundtrip())
    assert rep.rules["cast-roundtrip"].matches == 3
    assert g.summary() == {"Identity": 1, "Relu": 1}
    # the Relu's output took the name Z; Y, read from the graph input, is an Identity of it
    assert sorted((n.op_type, n.inputs, n.outputs) for n in g.topo_nodes()) == [("Identity", ["X"], ["Y"]), ("Relu", ["X"], ["Z"])]
    out = onnx_io.to_model(g)
    _strictly_valid(out)
    assert [o.name for o in out.graph.output] == ["Y", "Z"]
    x = np.arange(65536, dtype=np.uint16).view(np.float16)
    for a, b in zip(_ort(m, {"X": x}), _ort(out, {"X": x})):
        _bits_equal(a, b)


@pytest.mark.parametrize("build", ["fragment", "exact", "lossy"])
def test_second_application_changes_nothing(build):
    if build == "fragment":
        m, _ = _softmax_fragment()
    elif build == "exact":
        m = _roundtrip_model(TP.BFLOAT16, TP.FLOAT, 8)
    else:
        m = _roundtrip_model(TP.FLOAT, TP.FLOAT16, 8)
    g = onnx_io.load(m)
    infer_shapes(g)
    run_plugin(g, CastRoundtrip())
    once = _ser(g)
    rep = run_plugin(g, CastRoundtrip())
    assert rep.matches == 0 and rep.rules["cast-roundtrip"].nodes_removed == 0
    assert _ser(g) == once


def test_source_that_is_itself_a_graph_output_keeps_both_names():
    m = _model(
        [
            helper.make_node("Relu", ["X"], ["R"], name="relu"),
            helper.make_node("Cast", ["R"], ["W"], to=TP.FLOAT, name="inner"),
            helper.make_node("Cast", ["W"], ["Y"], to=TP.FLOAT16, name="outer"),
        ],
        [helper.make_tensor_value_info("X", TP.FLOAT16, [65536])],
        [helper.make_tensor_value_info("R", TP.FLOAT16, [65536]), helper.make_tensor_value_info("Y", TP.FLOAT16, [65536])],
    )
    g = onnx_io.load(m)
    infer_shapes(g)
    assert run_plugin(g, CastRoundtrip()).matches == 1
    assert sorted((n.op_type, n.inputs, n.outputs) for n in g.topo_nodes()) == [("Identity", ["R"], ["Y"]), ("Relu", ["X"], ["R"])]
    out = onnx_io.to_model(g)
    _strictly_valid(out)
    assert [o.name for o in out.graph.output] == ["R", "Y"]
    x = np.arange(65536, dtype=np.uint16).view(np.float16)
    for a, b in zip(_ort(m, {"X": x}), _ort(out, {"X": x})):
        _bits_equal(a, b)
