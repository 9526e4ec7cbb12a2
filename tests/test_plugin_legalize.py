"""The ``legalize`` plugin: what IREE's ONNX importer needs, with the model's numerics unchanged.

Numerics on ONNX Runtime 1.32 (CPU), measured and asserted here:

* Blocked DequantizeLinear vs its decomposition ``(Cast(x) - expand(Cast(zp))) * expand(scale)`` is bit-exact,
  for f32 *and* f16 scales, overflow to inf and subnormal results included. Why: for 4- and 8-bit codes every
  ``x - zero_point`` (|.| <= 255) is exact in f16 (integers up to 2048) and f32, so both sides compute the
  same exact difference and round its product with the scale once (ORT's DequantizeLinear multiplies in f32
  and rounds to f16; its f16 Mul does the same, and an f16 x f16 product is exact in f32). So no tolerance,
  not even the 1 ulp one might expect for f16. NaN results (0 * inf scale) compare as NaN, not by payload.
* At its default optimization level ORT fuses a blocked 4-bit DequantizeLinear feeding a MatMul into
  com.microsoft MatMulNBits with ``accuracy_level=4`` (int8-quantized activations): 0.4-0.8 % relative error
  against exact arithmetic. The end-to-end reference below therefore runs the original with basic
  optimizations only (no fusion); the rewritten model has no DequantizeLinear left to fuse.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from rewrite.backends import load_runner
from rewrite.backends.iree_toolchain import IreeImportError, import_onnx
from rewrite.core import onnx_io
from rewrite.core.analysis import value_range
from rewrite.core.driver import run_plugin
from rewrite.core.shapes import infer_shapes
from rewrite.pipeline import apply
from rewrite.plugins.legalize import Legalize

OPSET = 21
FOUR_BIT = (TP.INT4, TP.UINT4)
RANGE = {TP.UINT4: (0, 15), TP.INT4: (-8, 7), TP.UINT8: (0, 255), TP.INT8: (-128, 127), TP.INT16: (-32768, 32767)}
NP = {TP.UINT4: np.uint8, TP.INT4: np.int8, TP.UINT8: np.uint8, TP.INT8: np.int8, TP.INT16: np.int16}
N = TP.DataType.Name

ort.set_default_logger_severity(3)  # ORT warns about constant-folding f16 Tile; not our concern


# ------------------------------------------------------------------ helpers
def _model(nodes, inputs, outputs, inits=(), value_info=(), opset=OPSET, name="g") -> onnx.ModelProto:
    g = helper.make_graph(nodes, name, inputs, outputs, list(inits), value_info=list(value_info))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="tests")
    m.ir_version = 10
    onnx.checker.check_model(m, full_check=True)
    return m


def _tensor(name: str, dt: int, arr: np.ndarray) -> onnx.TensorProto:
    if dt in FOUR_BIT:
        return helper.make_tensor(name, dt, list(arr.shape), np.asarray(arr).flatten().tolist())
    return numpy_helper.from_array(np.asarray(arr).astype(NP[dt]), name)


def _legalize(m: onnx.ModelProto):
    """What ``rewrite apply --plugins legalize`` does to the graph: infer shapes, run the plugin, drop dead
    initializers. Returns (graph, report, rewritten model)."""
    g = onnx_io.load(m)
    infer_shapes(g)
    rep = run_plugin(g, Legalize())
    g.remove_unused_initializers()
    return g, rep, onnx_io.to_model(g)


def _ser(g) -> bytes:
    return onnx_io.to_model(g).SerializeToString(deterministic=True)


def _ort(m: onnx.ModelProto, feeds: dict, *, fuse: bool = True) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not fuse:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _assert_bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    """Bit-exact, except that NaNs only need to be NaN (IEEE 754 leaves an invalid operation's payload open)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    u = {2: np.uint16, 4: np.uint32}[a.itemsize]
    same = (a.view(u) == b.view(u)) | (np.isnan(a) & np.isnan(b))
    assert same.all(), f"{(~same).sum()} of {a.size} differ, e.g. {a[~same][:4]} vs {b[~same][:4]}"


def _four_bit_left(m: onnx.ModelProto) -> list[str]:
    """Everything of a 4-bit type in ``m``: inputs, outputs, initializers, value_info after strict shape
    inference, Cast targets and Constant values."""
    inferred = onnx.shape_inference.infer_shapes(m, check_type=True, strict_mode=True)
    gp = inferred.graph
    found = [vi.name for vi in [*gp.input, *gp.output, *gp.value_info] if vi.type.tensor_type.elem_type in FOUR_BIT]
    found += [t.name for t in gp.initializer if t.data_type in FOUR_BIT]
    for n in gp.node:
        for a in n.attribute:
            if (n.op_type == "Cast" and a.name == "to" and a.i in FOUR_BIT) or (a.type == onnx.AttributeProto.TENSOR and a.t.data_type in FOUR_BIT):
                found.append(f"{n.op_type} {n.name or n.output[0]}")
    return found


def _ops(m: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in m.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


# ------------------------------------------------------------------ blocked DequantizeLinear
def _dq_case(xdt, zp, sdt, shape, axis, bs, src, seed):
    """A model with one DequantizeLinear(block_size=bs) and feeds.

    src: "init" (x an initializer), "input" (x a graph input), "gather" (x = Gather(codes, I) from a graph
    index; for 4-bit x, Gather of uint8/int8 codes then Cast to the 4-bit type, as Gather takes no 4-bit data).
    Scale and zero point are initializers; values cover each type's extremes and, for the scale, overflow,
    subnormal results, inf and NaN.
    """
    rng = np.random.default_rng(seed)
    lo, hi = RANGE[xdt]
    rank, ax = len(shape), axis % len(shape)
    x = rng.integers(lo, hi + 1, size=shape).astype(NP[xdt])
    x.flat[:2] = [lo, hi]
    sshape = list(shape)
    sshape[ax] = math.ceil(shape[ax] / bs)
    sdtype = np.float16 if sdt == TP.FLOAT16 else np.float32
    scale = (rng.lognormal(-4, 3, size=sshape) * rng.choice([-1, 1], size=sshape)).astype(sdtype)
    extremes = [65504, 6e-8, 3e-5, -300, np.inf, np.nan] if sdt == TP.FLOAT16 else [3.4e38, 1e-45, 1e-40, -2e38, np.inf, np.nan]
    k = min(len(extremes), scale.size)
    scale.flat[-k:] = extremes[:k]  # the last block too, which is the partial one when K % bs != 0
    inits = [numpy_helper.from_array(scale, "S")]
    dq_inputs = ["X", "S"]
    if zp:
        z = rng.integers(lo, hi + 1, size=sshape)
        z.flat[:2] = [hi, lo]
        inits.append(_tensor("Z", xdt, z))
        dq_inputs.append("Z")
    nodes, inputs, feeds = [], [], {}
    if src == "init":
        inits.append(_tensor("X", xdt, x))
    elif src == "input":
        inputs.append(helper.make_tensor_value_info("X", xdt, list(shape)))
        feeds["X"] = x
    else:
        codes = rng.integers(lo, hi + 1, size=(3, *shape)).astype(NP[xdt])
        codes[1] = x
        inits.append(numpy_helper.from_array(codes, "C"))
        if xdt in FOUR_BIT:
            nodes += [helper.make_node("Gather", ["C", "I"], ["G"], axis=0), helper.make_node("Cast", ["G"], ["X"], to=xdt)]
        else:
            nodes.append(helper.make_node("Gather", ["C", "I"], ["X"], axis=0))
        inputs.append(helper.make_tensor_value_info("I", TP.INT64, []))
        feeds["I"] = np.array(1, np.int64)
    nodes.append(helper.make_node("DequantizeLinear", dq_inputs, ["Y"], axis=axis, block_size=bs, name="dq"))
    m = _model(nodes, inputs, [helper.make_tensor_value_info("Y", sdt, list(shape))], inits)
    return m, feeds


# layout: (shape with "K" where the blocked axis is, axis)
LAYOUTS = [((4, 3, "K"), 0), ((2, "K", 3), 1), ((2, 3, "K"), 2), ((2, 3, "K"), -1), (("K", 3), 0), ((3, "K"), 1)]
LAYOUTS = [(tuple(d for d in s), a) for s, a in LAYOUTS]
_LAYOUT_IDS = ["3d-axis0", "3d-axis1", "3d-axis2", "3d-axis-1", "2d-axis0", "2d-axis1"]


def _dq_params():
    """Every x dtype x zero point x scale dtype x layout x divisibility x block size (576 cases); the source of x
    rotates so that each source meets every dtype, layout and block size."""
    out = []
    for xdt, zp, sdt, (li, (lay, axis)), div, (bi, bs) in itertools.product(
        (TP.UINT4, TP.INT4, TP.UINT8, TP.INT8), (True, False), (TP.FLOAT, TP.FLOAT16), enumerate(LAYOUTS), (True, False), enumerate((32, 64, 128))
    ):
        srcs = ("init", "gather") if xdt in FOUR_BIT else ("init", "input", "gather")
        src = srcs[(li + bi + div + zp) % len(srcs)]
        k = 2 * bs if div else 2 * bs + 5  # not divisible: a partial last block of 5
        shape = tuple(k if d == "K" else d for d in lay)
        ident = f"{N(xdt)}-{'zp' if zp else 'nozp'}-{N(sdt)}-{_LAYOUT_IDS[li]}-K{k}-bs{bs}-{src}"
        out.append(pytest.param(xdt, zp, sdt, shape, axis, bs, src, id=ident))
    return out


@pytest.mark.parametrize("xdt, zp, sdt, shape, axis, bs, src", _dq_params())
def test_blocked_dequantize_is_decomposed_exactly(xdt, zp, sdt, shape, axis, bs, src):
    m, feeds = _dq_case(xdt, zp, sdt, shape, axis, bs, src, seed=hash((xdt, zp, sdt, shape, axis, bs)) % 2**32)
    g, rep, out = _legalize(m)

    dq = rep.rules["dequantize-block"]
    assert dq.matches == 1 and dq.nodes_removed == 1 and not dq.refusals
    assert "DequantizeLinear" not in _ops(out)
    # a 4-bit x gathered from 8-bit codes: the decomposition's Cast(Cast(g, 4-bit), float) is folded
    assert rep.rules["exact-4bit-cast"].matches == (1 if src == "gather" and xdt in FOUR_BIT else 0)
    assert _four_bit_left(out) == []
    onnx.checker.check_model(out, full_check=True)
    (want,) = _ort(m, feeds)
    (got,) = _ort(out, feeds)
    _assert_bits_equal(got, want)


def test_dynamic_dims_before_the_axis_are_fine():
    m, _ = _dq_case(TP.INT8, True, TP.FLOAT16, (2, 69, 3), 1, 32, "init", seed=1)
    x = numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "X"))
    m.graph.initializer.remove(next(t for t in m.graph.initializer if t.name == "X"))
    m.graph.input.append(helper.make_tensor_value_info("X", TP.INT8, ["batch", 69, 3]))
    m.graph.output[0].CopyFrom(helper.make_tensor_value_info("Y", TP.FLOAT16, ["batch", 69, 3]))
    g, rep, out = _legalize(m)
    assert rep.rules["dequantize-block"].matches == 1 and "DequantizeLinear" not in _ops(out)
    _assert_bits_equal(_ort(out, {"X": x})[0], _ort(m, {"X": x})[0])


def test_several_dequantize_ops_exact_count_removed_and_per_axis_one_kept():
    rng = np.random.default_rng(3)
    w1 = rng.integers(0, 16, (40, 8))
    w2 = rng.integers(-8, 8, (8, 72))
    w3 = rng.integers(-128, 128, (4, 40)).astype(np.int8)
    m = _model(
        [
            helper.make_node("DequantizeLinear", ["W1", "S1", "Z1"], ["D1"], axis=0, block_size=16, name="dq1"),
            helper.make_node("DequantizeLinear", ["W2", "S2"], ["D2"], axis=1, block_size=32, name="dq2"),
            helper.make_node("DequantizeLinear", ["W3", "S3"], ["D3"], axis=0, block_size=0, name="dq_per_axis"),
            helper.make_node("MatMul", ["D1", "D2"], ["M"]),
            helper.make_node("MatMul", ["D3", "M"], ["Y"]),
        ],
        [],
        [helper.make_tensor_value_info("Y", TP.FLOAT, [4, 72])],
        [
            _tensor("W1", TP.UINT4, w1), numpy_helper.from_array(rng.random((3, 8)).astype(np.float32), "S1"),
            _tensor("Z1", TP.UINT4, rng.integers(0, 16, (3, 8))),
            _tensor("W2", TP.INT4, w2), numpy_helper.from_array(rng.random((8, 3)).astype(np.float32), "S2"),
            numpy_helper.from_array(w3, "W3"), numpy_helper.from_array(rng.random(4).astype(np.float32), "S3"),
        ],
    )
    g, rep, out = _legalize(m)
    dq = rep.rules["dequantize-block"]
    assert dq.matches == 2 and dq.nodes_removed == 2
    assert dq.refusals == {"block_size is 0 (per-tensor or per-axis DequantizeLinear lowers as is)": ["dq_per_axis"]}
    assert [n.name for n in out.graph.node if n.op_type == "DequantizeLinear"] == ["dq_per_axis"]
    assert rep.notes == ["re-encoded 3 4-bit initializers as 8-bit: W1, Z1, W2"]
    assert {t.name: t.data_type for t in out.graph.initializer if t.name in ("W1", "Z1", "W2")} == {"W1": TP.UINT8, "Z1": TP.UINT8, "W2": TP.INT8}
    assert _four_bit_left(out) == []
    np.testing.assert_array_equal(_ort(out, {}, fuse=False)[0], _ort(m, {}, fuse=False)[0])


def test_4bit_initializer_of_a_per_axis_dequantize_is_widened_with_its_zero_point():
    rng = np.random.default_rng(4)
    m = _model(
        [helper.make_node("DequantizeLinear", ["W", "S", "Z"], ["Y"], axis=1, name="dq")],
        [],
        [helper.make_tensor_value_info("Y", TP.FLOAT16, [5, 6])],
        [_tensor("W", TP.INT4, rng.integers(-8, 8, (5, 6))), numpy_helper.from_array(rng.random(6).astype(np.float16), "S"),
         _tensor("Z", TP.INT4, rng.integers(-8, 8, 6))],
    )
    g, rep, out = _legalize(m)
    assert rep.matches == 0 and _ops(out) == {"DequantizeLinear": 1}
    assert rep.notes == ["re-encoded 2 4-bit initializers as 8-bit: W, Z"]
    assert _four_bit_left(out) == []
    onnx.checker.check_model(out, full_check=True)
    _assert_bits_equal(_ort(out, {})[0], _ort(m, {})[0])


# ------------------------------------------------------------------ refusals
def test_per_axis_dequantize_is_untouched():
    for attrs in ({"block_size": 0}, {}):  # explicit 0, and the opset-13 form without the attribute
        m = _model(
            [helper.make_node("DequantizeLinear", ["X", "S"], ["Y"], axis=0, name="dq", **attrs)],
            [helper.make_tensor_value_info("X", TP.INT8, [4, 8])],
            [helper.make_tensor_value_info("Y", TP.FLOAT, [4, 8])],
            [numpy_helper.from_array(np.linspace(0.1, 1, 4).astype(np.float32), "S")],
        )
        g = onnx_io.load(m)
        infer_shapes(g)
        before = _ser(g)
        rep = run_plugin(g, Legalize())
        assert rep.matches == 0 and rep.notes == [] and _ser(g) == before
        refusals = rep.rules["dequantize-block"].refusals
        assert refusals == ({"block_size is 0 (per-tensor or per-axis DequantizeLinear lowers as is)": ["dq"]} if attrs else {})


def test_dynamic_dims_after_the_axis_are_refused_with_a_reason():
    m = _model(
        [helper.make_node("DequantizeLinear", ["X", "S"], ["Y"], axis=1, block_size=4, name="dq")],
        [helper.make_tensor_value_info("X", TP.INT8, [2, 8, "M"]), helper.make_tensor_value_info("S", TP.FLOAT, [2, 2, "M"])],
        [helper.make_tensor_value_info("Y", TP.FLOAT, [2, 8, "M"])],
    )
    g = onnx_io.load(m)
    infer_shapes(g)
    before = _ser(g)
    rep = run_plugin(g, Legalize())
    assert rep.matches == 0 and _ser(g) == before
    assert rep.rules["dequantize-block"].refusals == {"dims of 'X' after axis 1 must be static to rebuild the scale layout": ["dq"]}


@pytest.mark.parametrize("sdt, zp, refused", [(TP.FLOAT16, True, True), (TP.FLOAT16, False, True), (TP.FLOAT, True, False)])
def test_16bit_codes_decompose_only_where_the_difference_is_exact(sdt, zp, refused):
    # int16 x - zero_point spans 65535: exact in f32, not in f16 (integers up to 2048), where the decomposition
    # would round before the multiply (measured: up to 78 % relative error), so it is refused.
    m, feeds = _dq_case(TP.INT16, zp, sdt, (3, 40), 1, 16, "input", seed=5)
    g, rep, out = _legalize(m)
    dq = rep.rules["dequantize-block"]
    if refused:
        assert dq.matches == 0 and _ops(out) == {"DequantizeLinear": 1}
        assert dq.refusals == {f"x - zero_point of INT16 is not exact in {N(sdt)}": ["dq"]}
    else:
        assert dq.matches == 1 and "DequantizeLinear" not in _ops(out)
        _assert_bits_equal(_ort(out, feeds)[0], _ort(m, feeds)[0])


# ------------------------------------------------------------------ exact-4bit-cast
def _seed_form_experts(codes: np.ndarray, zps: np.ndarray, reshape: bool):
    """Seed form: uint8 codes [E, N, K] and zero points gathered by expert index, each Cast to UINT4, then a
    blocked DequantizeLinear (axis -1, partial last block). Optionally a Reshape on the codes' path."""
    e, n, k = codes.shape
    nb = zps.shape[-1]
    rng = np.random.default_rng(6)
    nodes = [helper.make_node("Gather", ["codes", "expert"], ["g"], axis=0, name="gather_codes")]
    src = "g"
    if reshape:
        nodes.append(helper.make_node("Reshape", ["g", "shape"], ["g2"], name="reshape"))
        src = "g2"
    nodes += [
        helper.make_node("Cast", [src], ["q"], to=TP.UINT4, name="to_uint4"),
        helper.make_node("Gather", ["zps", "expert"], ["gz"], axis=0, name="gather_zp"),
        helper.make_node("Cast", ["gz"], ["qz"], to=TP.UINT4, name="zp_to_uint4"),
        helper.make_node("Gather", ["scales", "expert"], ["s"], axis=0, name="gather_scale"),
        helper.make_node("DequantizeLinear", ["q", "s", "qz"], ["w"], axis=-1, block_size=32, name="dq"),
        helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
    ]
    inits = [
        numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(zps, "zps"),
        numpy_helper.from_array((rng.random((e, n, nb)) * 0.05).astype(np.float32), "scales"),
        numpy_helper.from_array(np.array([n, k], np.int64), "shape"),
    ]
    m = _model(
        nodes,
        [helper.make_tensor_value_info("expert", TP.INT64, []), helper.make_tensor_value_info("x", TP.FLOAT, [2, n])],
        [helper.make_tensor_value_info("y", TP.FLOAT, [2, k])],
        inits,
        value_info=[helper.make_tensor_value_info("w", TP.FLOAT, [n, k])],
    )
    return m


def test_exact_4bit_cast_folds_codes_gathered_from_initializers():
    rng = np.random.default_rng(7)
    e, n, k = 3, 8, 72  # K = 72 = 2 blocks of 32 + a partial block of 8
    codes = rng.integers(0, 16, (e, n, k)).astype(np.uint8)
    zps = rng.integers(0, 16, (e, n, 3)).astype(np.uint8)
    for reshape in (False, True):
        m = _seed_form_experts(codes, zps, reshape)
        g, rep, out = _legalize(m)
        assert rep.rules["exact-4bit-cast"].matches == 2  # the codes and the zero points
        assert rep.rules["dequantize-block"].matches == 1
        assert _four_bit_left(out) == []
        assert g.find_node("to_uint4") is None and g.find_node("zp_to_uint4") is None
        onnx.checker.check_model(out, full_check=True)
        feeds = {"expert": np.array(2, np.int64), "x": rng.standard_normal((2, n)).astype(np.float32)}
        np.testing.assert_array_equal(_ort(out, feeds)[0], _ort(m, feeds, fuse=False)[0])


def _cast_pair_model(source_nodes, inputs, inits, x_name="x", narrow=TP.UINT4):
    return _model(
        [*source_nodes, helper.make_node("Cast", [x_name], ["q"], to=narrow, name="narrow"), helper.make_node("Cast", ["q"], ["y"], to=TP.FLOAT, name="widen")],
        inputs,
        [helper.make_tensor_value_info("y", TP.FLOAT, [4])],
        inits,
    )


def test_exact_4bit_cast_positive_plain():
    m = _cast_pair_model([helper.make_node("Gather", ["codes", "i"], ["x"], axis=0)],
                         [helper.make_tensor_value_info("i", TP.INT64, [4])],
                         [numpy_helper.from_array(np.array([0, 7, 15, 3, 9], np.uint8), "codes")])
    g, rep, out = _legalize(m)
    assert rep.rules["exact-4bit-cast"].matches == 1
    assert _ops(out) == {"Gather": 1, "Cast": 1} and _four_bit_left(out) == []
    feeds = {"i": np.array([2, 0, 4, 1], np.int64)}
    np.testing.assert_array_equal(_ort(out, feeds)[0], _ort(m, feeds)[0])


@pytest.mark.parametrize("bad", [16, 200])
def test_exact_4bit_cast_refuses_out_of_range_initializer_values(bad):
    codes = np.array([0, 7, bad, 3, 15], np.uint8)
    m = _cast_pair_model([helper.make_node("Gather", ["codes", "i"], ["x"], axis=0)],
                         [helper.make_tensor_value_info("i", TP.INT64, [4])], [numpy_helper.from_array(codes, "codes")])
    g = onnx_io.load(m)
    infer_shapes(g)
    before = _ser(g)
    rep = run_plugin(g, Legalize())
    assert rep.matches == 0 and _ser(g) == before
    assert rep.rules["exact-4bit-cast"].refusals == {f"values of 'x' span [0, {bad}], outside UINT4": ["narrow"]}
    # and folding would indeed be wrong: the Cast to UINT4 changes the out-of-range value
    assert _ort(m, {"i": np.array([2, 0, 1, 3], np.int64)})[0][0] != bad


def test_exact_4bit_cast_refuses_a_runtime_input():
    m = _cast_pair_model([], [helper.make_tensor_value_info("x", TP.UINT8, [4])], [])
    g = onnx_io.load(m)
    before = _ser(g)
    rep = run_plugin(g, Legalize())
    assert rep.matches == 0 and _ser(g) == before
    assert rep.rules["exact-4bit-cast"].refusals == {"values of 'x' are not provably within [0, 15]": ["narrow"]}


@pytest.mark.parametrize("values", [[0.5, 3.7, 15.0, 0.0], [1.0, np.nan, 3.0, 4.0]], ids=["fractions", "nan"])
def test_exact_4bit_cast_refuses_float_sources(values):
    # In [0, 15] but not integers: Cast to UINT4 rounds (and NaN becomes 0), so Cast(x, to=FLOAT) is not the same.
    m = _cast_pair_model([helper.make_node("Identity", ["c"], ["x"])], [], [numpy_helper.from_array(np.array(values, np.float32), "c")])
    g = onnx_io.load(m)
    infer_shapes(g)
    before = _ser(g)
    rep = run_plugin(g, Legalize())
    assert rep.matches == 0 and _ser(g) == before
    assert rep.rules["exact-4bit-cast"].refusals == {"'x' is FLOAT, not an integer type": ["narrow"]}
    assert not np.array_equal(_ort(m, {})[0], np.array(values, np.float32), equal_nan=True)


def test_value_range_has_no_bounds_for_nan_data():
    m = _model([helper.make_node("Identity", ["c"], ["x"]), helper.make_node("Identity", ["d"], ["y"])], [],
               [helper.make_tensor_value_info("x", TP.FLOAT, [3]), helper.make_tensor_value_info("y", TP.UINT8, [3])],
               [numpy_helper.from_array(np.array([1, np.nan, 3], np.float32), "c"), numpy_helper.from_array(np.array([4, 1, 9], np.uint8), "d")])
    g = onnx_io.load(m)
    assert value_range(g, "x") is None
    assert value_range(g, "y") == (1.0, 9.0)


# ------------------------------------------------------------------ Reduce ops with axes as an input
def _reduce_model(axes_nodes, axes_inputs, axes_inits, op="ReduceSum"):
    return _model(
        [*axes_nodes, helper.make_node(op, ["X", "A"], ["Y"], keepdims=1, name="reduce")],
        [helper.make_tensor_value_info("X", TP.FLOAT, [2, 3, 4]), *axes_inputs],
        [helper.make_tensor_value_info("Y", TP.FLOAT, ["d0", "d1", "d2"])],
        axes_inits,
        opset=18,
    )


def _i64(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


AXES = {
    # runtime: IREE cannot lower these (iree-compile: failed to legalize torch.aten.sum.dim_IntList)
    "graph-input": (True, [], [helper.make_tensor_value_info("A", TP.INT64, [1])], []),
    "concat-of-input": (True, [helper.make_node("Concat", ["a0", "B"], ["A"], axis=0)], [helper.make_tensor_value_info("B", TP.INT64, [1])], [_i64("a0", [0])]),
    "unsqueeze-of-input": (True, [helper.make_node("Unsqueeze", ["B", "z"], ["A"])], [helper.make_tensor_value_info("B", TP.INT64, [])], [_i64("z", [0])]),
    # constant: IREE lowers these
    "initializer": (False, [], [], [_i64("A", [2])]),
    "constant-node": (False, [helper.make_node("Constant", [], ["A"], value=_i64("v", [0, 2]))], [], []),
    "concat-of-constants": (False, [helper.make_node("Concat", ["a0", "a1"], ["A"], axis=0)], [], [_i64("a0", [0]), _i64("a1", [2])]),
    "neg-of-constant": (False, [helper.make_node("Neg", ["a0"], ["A"])], [], [_i64("a0", [-1])]),
    "size-of-static-shape": (False, [helper.make_node("Shape", ["X"], ["s"]), helper.make_node("Size", ["s"], ["n"]),
                                     helper.make_node("Sub", ["n", "one"], ["m"]), helper.make_node("Unsqueeze", ["m", "z"], ["A"])],
                             [], [_i64("one", 1), _i64("z", [0])]),
}


@pytest.mark.parametrize("case", list(AXES))
def test_reduce_axes_known_only_at_run_time_are_noted_and_left_alone(case):
    runtime, nodes, inputs, inits = AXES[case]
    m = _reduce_model(nodes, inputs, inits)
    g = onnx_io.load(m)
    infer_shapes(g)
    before = _ser(g)
    rep = run_plugin(g, Legalize())
    assert rep.matches == 0 and _ser(g) == before
    if runtime:
        assert rep.notes == ["1 Reduce op(s) take axes computed at run time, which IREE cannot lower; left alone: reduce"]
    else:
        assert rep.notes == []


# ------------------------------------------------------------------ end to end through IREE
def _qmatmul_model(tmp_path):
    """X [2, 80] @ DequantizeLinear(W: UINT4 [80, 8], block_size=32 along K: blocks 32, 32, 16; UINT4 zero points)."""
    rng = np.random.default_rng(8)
    k, n, bs = 80, 8, 32
    nb = math.ceil(k / bs)
    m = _model(
        [helper.make_node("DequantizeLinear", ["W", "S", "Z"], ["Wf"], axis=0, block_size=bs, name="dq"),
         helper.make_node("MatMul", ["X", "Wf"], ["Y"], name="mm")],
        [helper.make_tensor_value_info("X", TP.FLOAT, [2, k])],
        [helper.make_tensor_value_info("Y", TP.FLOAT, [2, n])],
        [_tensor("W", TP.UINT4, rng.integers(0, 16, (k, n))), numpy_helper.from_array((rng.random((nb, n)) * 0.1 + 0.01).astype(np.float32), "S"),
         _tensor("Z", TP.UINT4, rng.integers(0, 16, (nb, n)))],
        name="qmm",
    )
    path = tmp_path / "qmm.onnx"
    onnx.save(m, path)
    return m, path, {"X": rng.standard_normal((2, k)).astype(np.float32)}


def _rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_blocked_uint4_matmul_end_to_end_iree_and_ort(tmp_path):
    m, path, feeds = _qmatmul_model(tmp_path)
    (want,) = _ort(m, feeds, fuse=False)  # no MatMulNBits fusion: exact DequantizeLinear then MatMul

    with pytest.raises(IreeImportError, match="Unhandled ONNX TensorProto data"):
        import_onnx(path, tmp_path / "plain" / "qmm.mlir", params_path=None)

    manifest = apply(path, tmp_path / "iree", plugins="legalize", backend="iree")
    (report,) = manifest.report
    assert report["plugin"] == "legalize" and report["matches"] == 1
    assert report["notes"] == ["re-encoded 2 4-bit initializers as 8-bit: W, Z"]
    assert _four_bit_left(onnx.load(tmp_path / "iree" / "model.onnx")) == []
    got = load_runner(tmp_path / "iree").run(feeds)
    assert list(got) == ["Y"]
    assert _rel(got["Y"], want) < 1e-5

    apply(path, tmp_path / "ort", plugins="legalize", backend="ort")
    got_ort = load_runner(tmp_path / "ort").run(feeds)
    assert _rel(got_ort["Y"], want) < 1e-5


def test_4bit_constant_node_values_are_widened_for_iree_and_ort(tmp_path):
    """The same blocked UINT4 MatMul with its codes in a Constant node (not an initializer) and an INT4
    per-axis DequantizeLinear whose zero point is another Constant: both re-encoded, so the model still loads
    on ONNX Runtime and imports into IREE, with the numbers of the original."""
    rng = np.random.default_rng(9)
    k, n, bs = 80, 8, 32
    nb = math.ceil(k / bs)
    m = _model(
        [helper.make_node("Constant", [], ["W"], value=_tensor("Wc", TP.UINT4, rng.integers(0, 16, (k, n))), name="codes"),
         helper.make_node("DequantizeLinear", ["W", "S", "Z"], ["Wf"], axis=0, block_size=bs, name="dq"),
         helper.make_node("MatMul", ["X", "Wf"], ["Y0"], name="mm"),
         helper.make_node("Constant", [], ["Z2"], value=_tensor("zc", TP.INT4, rng.integers(-8, 8, 4)), name="zp2"),
         helper.make_node("DequantizeLinear", ["W2", "S2", "Z2"], ["W2f"], axis=1, name="dq2"),
         helper.make_node("MatMul", ["Y0", "W2f"], ["Y"], name="mm2")],
        [helper.make_tensor_value_info("X", TP.FLOAT, [2, k])],
        [helper.make_tensor_value_info("Y", TP.FLOAT, [2, 4])],
        [numpy_helper.from_array((rng.random((nb, n)) * 0.1 + 0.01).astype(np.float32), "S"),
         _tensor("Z", TP.UINT4, rng.integers(0, 16, (nb, n))), _tensor("W2", TP.INT4, rng.integers(-8, 8, (n, 4))),
         numpy_helper.from_array((rng.random(4) * 0.1 + 0.01).astype(np.float32), "S2")],
        name="qmm_const",
    )
    path = tmp_path / "qmm_const.onnx"
    onnx.save(m, path)
    feeds = {"X": rng.standard_normal((2, k)).astype(np.float32)}
    (want,) = _ort(m, feeds, fuse=False)
    manifest = apply(path, tmp_path / "iree", plugins="legalize", backend="iree")
    (report,) = manifest.report
    assert report["notes"] == ["re-encoded 2 4-bit initializers as 8-bit: Z, W2", "re-encoded 2 4-bit Constant values as 8-bit: W, Z2"]
    assert _four_bit_left(onnx.load(tmp_path / "iree" / "model.onnx")) == []
    assert _rel(load_runner(tmp_path / "iree").run(feeds)["Y"], want) < 1e-5
    apply(path, tmp_path / "ort", plugins="legalize", backend="ort")
    assert _rel(load_runner(tmp_path / "ort").run(feeds)["Y"], want) < 1e-5


def test_4bit_tensor_in_another_attribute_is_refused_naming_the_node():
    body = helper.make_graph([helper.make_node("Constant", [], ["c"], value=_tensor("t", TP.INT4, np.array([1, 2])))], "then",
                             [], [helper.make_tensor_value_info("c", TP.INT4, [2])])
    other = helper.make_graph([helper.make_node("Constant", [], ["d"], value=_tensor("u", TP.INT4, np.array([3, 4])))], "else",
                              [], [helper.make_tensor_value_info("d", TP.INT4, [2])])
    m = _model([helper.make_node("If", ["b"], ["y"], then_branch=body, else_branch=other, name="branch")],
               [helper.make_tensor_value_info("b", TP.BOOL, [])], [helper.make_tensor_value_info("y", TP.INT4, [2])])
    g = onnx_io.load(m)
    before = onnx_io.to_model(g).SerializeToString()
    with pytest.raises(Exception, match="node 'branch' \\(If\\): attribute '(then|else)_branch' holds a 4-bit tensor in its subgraph"):
        run_plugin(g, Legalize())
    assert onnx_io.to_model(g).SerializeToString() == before


def test_4bit_sparse_constant_is_refused_naming_the_node():
    values = _tensor("sv", TP.INT4, np.array([1, -2]))
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([0, 3], np.int64), "si"), [4])
    m = _model([helper.make_node("Constant", [], ["c"], sparse_value=sparse, name="sparse_codes"),
                helper.make_node("Cast", ["c"], ["y"], to=TP.INT8, name="cast")],
               [], [helper.make_tensor_value_info("y", TP.INT8, [4])])
    g = onnx_io.load(m)
    before = onnx_io.to_model(g).SerializeToString()
    with pytest.raises(Exception, match="node 'sparse_codes' \\(Constant\\): attribute 'sparse_value' holds a 4-bit sparse tensor"):
        run_plugin(g, Legalize())
    assert onnx_io.to_model(g).SerializeToString() == before
