"""``expand``: Expand output shapes recovered symbolically (seed A4), never inventing a static dim."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from rewrite.core import onnx_io
from rewrite.core.driver import run_plugin
from rewrite.core.shapes import infer_shapes
from rewrite.plugins.expand import ExpandShapes, Sym, a4_expand_model, broadcast, runtime_expand_model


def _load(model: onnx.ModelProto, tmp_path):
    p = tmp_path / "m.onnx"
    onnx.save(model, p)
    g = onnx_io.load(p)
    infer_shapes(g)
    return g


def test_seed_form_kv_index_expand_gets_its_true_shape(seed_fp32):
    path, _ = seed_fp32
    g = onnx_io.load(path)
    infer_shapes(g)
    expands = g.nodes_by_op("Expand")
    # onnx inference leaves every dim of the A4 Expand anonymous
    assert all(all(isinstance(d, str) and d.startswith("unk__") for d in g.values[n.outputs[0]].shape) for n in expands)
    rep = run_plugin(g, ExpandShapes())
    assert rep.matches == 2
    assert [g.values[n.outputs[0]].shape for n in expands] == [(1, 4, "seq_len", 64)] * 2
    # the scatter's indices now visibly match its updates' layout: one index per element, not per position
    for s in g.nodes_by_op("ScatterElements"):
        assert g.values[s.inputs[1]].shape == (1, 4, "seq_len", 64)


def test_where_minus_one_takes_the_input_dim_and_runtime_shapes_stay_unknown(tmp_path):
    g = _load(a4_expand_model(), tmp_path)
    assert run_plugin(g, ExpandShapes()).matches == 1
    assert g.values["y"].shape == (1, 4, "seq", 8)  # -1 -> 1 -> the input's "seq"

    g = _load(runtime_expand_model(), tmp_path)
    before = g.values["y"].shape
    rep = run_plugin(g, ExpandShapes())
    assert rep.matches == 0 and g.values["y"].shape == before
    assert list(rep.rules["expand-shape"].refusals) == ["shape operand not evaluable symbolically"]


@pytest.mark.parametrize("y_dim,matches", [("m", 1), (None, 0)])
def test_a_dim_read_from_a_runtime_shape_stays_symbolic(tmp_path, y_dim, matches):
    """Expand(x [1, 8], Concat(Shape(y)[0], [8])): dim 0 is y's, symbolic or unknown, never an int."""
    nodes = [
        helper.make_node("Shape", ["y"], ["ys"]),
        helper.make_node("Gather", ["ys", "zero"], ["d0"], axis=0),
        helper.make_node("Concat", ["d0", "eight"], ["shape"], axis=0),
        helper.make_node("Equal", ["shape", "m1"], ["eq"]),
        helper.make_node("Where", ["eq", "ones", "shape"], ["shape2"]),
        helper.make_node("Expand", ["x", "shape2"], ["out"]),
    ]
    inits = [helper.make_tensor("zero", TensorProto.INT64, [1], [0]), helper.make_tensor("eight", TensorProto.INT64, [1], [8]),
             helper.make_tensor("m1", TensorProto.INT64, [1], [-1]), helper.make_tensor("ones", TensorProto.INT64, [2], [1, 1])]
    gr = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8]),
                                        helper.make_tensor_value_info("y", TensorProto.FLOAT, [y_dim])],
                           [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], initializer=inits)
    g = _load(helper.make_model(gr, opset_imports=[helper.make_opsetid("", 18)]), tmp_path)
    rep = run_plugin(g, ExpandShapes())
    assert rep.matches == matches
    shape = g.values["out"].shape
    assert shape[1] == 8 and not isinstance(shape[0], int)
    assert shape[0] == "m" if y_dim else shape[0] is None or shape[0].startswith("unk__")


def test_broadcast_rules():
    n, m = Sym(name="n"), Sym(name="m")
    assert broadcast([1, 1, n, 1], [1, 4, n, 8]) == [1, 4, n, 8]
    assert broadcast([3, n], [1]) == [3, n]
    assert broadcast([n], [m]) == [None]  # two different runtime sizes: not resolvable
    assert broadcast([None], [5]) == [5]  # a valid broadcast to 5 gives 5 whatever the unknown is
    assert broadcast([None], [n]) == [None]
