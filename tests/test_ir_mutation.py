"""The Graph mutation API: every edit keeps edges, port lists and the value table consistent, and the
edited graph writes out a valid model that ONNX Runtime runs with the expected results."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from rewrite.core import onnx_io
from rewrite.core.ir import IMPLICIT_PORT, SINK, SOURCE, Graph
from rewrite.errors import RewriteError

F = TensorProto.FLOAT
XV = np.array([-2.0, -0.5, 0.0, 1.5], np.float32)
W_DATA = np.array([1.0, 2.0, 3.0, 4.0], np.float32)


# ------------------------------------------------------------------ helpers
def _vi(name, shape=(4,), elem=F):
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


def _model(nodes, inputs, outputs, inits=(), value_info=(), opset=17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits), value_info=list(value_info))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="tests")
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _chain_model() -> onnx.ModelProto:
    """X -> relu -> A -> neg -> B -> add(B, W) -> Y."""
    return _model(
        [
            helper.make_node("Relu", ["X"], ["A"], name="relu"),
            helper.make_node("Neg", ["A"], ["B"], name="neg"),
            helper.make_node("Add", ["B", "W"], ["Y"], name="add"),
        ],
        [_vi("X")],
        [_vi("Y")],
        [numpy_helper.from_array(W_DATA, "W")],
        [_vi("A"), _vi("B"), _vi("Y")],
    )


def _ser(g: Graph) -> bytes:
    return onnx_io.to_model(g).SerializeToString(deterministic=True)


def _ops(g: Graph) -> list[tuple[str, str]]:
    return [(n.name, n.op_type) for n in g.topo_nodes()]


def _model_ops(m: onnx.ModelProto) -> list[tuple[str, str, list[str], list[str]]]:
    return [(n.name, n.op_type, list(n.input), list(n.output)) for n in m.graph.node]


def _checked_run(g: Graph, feeds: dict) -> tuple[onnx.ModelProto, list]:
    """to_model, full checker pass, then an ORT run."""
    m = onnx_io.to_model(g)
    onnx.checker.check_model(m, full_check=True)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 4
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return m, sess.run(None, feeds)


def _eq(a, b):
    np.testing.assert_array_equal(a, b, strict=True)


# ------------------------------------------------------------------ baseline
def test_loaded_graph_structure():
    g = onnx_io.load(_chain_model())
    relu, neg, add = (g.find_node(n) for n in ("relu", "neg", "add"))
    assert _ops(g) == [("relu", "Relu"), ("neg", "Neg"), ("add", "Add")]
    assert (g.inputs, g.outputs, g.initializers) == (["X"], ["Y"], ["W"])
    assert g.producer == {"W": (SOURCE, 0), "X": (SOURCE, 0), "A": (relu.id, 0), "B": (neg.id, 0), "Y": (add.id, 0)}
    assert g.uses("X") == [(relu.id, 0)]
    assert g.uses("A") == [(neg.id, 0)]
    assert g.uses("W") == [(add.id, 1)]
    assert g.uses("Y") == [(SINK, 0)]
    assert g.uses("nothing") == []
    assert g.producer_node("B") is neg and g.producer_node("X") is None and g.producer_node("W") is None
    assert g.consumers("B") == [add] and g.consumers("Y") == []
    assert g.summary() == {"Add": 1, "Neg": 1, "Relu": 1}
    assert len(g) == 3 and [n.name for n in g] == ["relu", "neg", "add"]
    assert g.values["A"].type_str() == "FLOAT[4]"
    _, (y,) = _checked_run(g, {"X": XV})
    _eq(y, -np.maximum(XV, 0) + W_DATA)


# ------------------------------------------------------------------ add_node / topo order
@pytest.mark.parametrize(
    "order, expected",
    [
        (None, ["relu", "neg", "abs", "add"]),  # default order (its id) is last; placed just before its consumer
        (0.5, ["relu", "abs", "neg", "add"]),
        (-1.0, ["abs", "relu", "neg", "add"]),
        (1.5, ["relu", "neg", "abs", "add"]),
    ],
)
def test_add_node_is_placed_by_order(order, expected):
    g = onnx_io.load(_chain_model())
    n = g.add_node("Abs", ["X"], ["C"], name="abs", order=order)
    assert n.order == (3.0 if order is None else order)
    assert g.producer["C"] == (n.id, 0) and g.values["C"].dtype is None
    assert sorted(g.uses("X")) == sorted([(g.find_node("relu").id, 0), (n.id, 0)])
    add = g.find_node("add")
    g.set_input(add, 1, "C")
    assert add.inputs == ["B", "C"] and g.uses("C") == [(add.id, 1)] and g.uses("W") == []
    assert [x.name for x in g.topo_nodes()] == expected
    assert g.remove_unused_initializers() == 1 and g.initializers == [] and "W" not in g.values
    m, (y,) = _checked_run(g, {"X": XV})
    assert [x[0] for x in _model_ops(m)] == expected
    assert [t.name for t in m.graph.initializer] == []
    _eq(y, -np.maximum(XV, 0) + np.abs(XV))


def test_topo_nodes_keeps_original_order_of_independent_nodes():
    m = _model(
        [
            helper.make_node("Neg", ["X"], ["P"], name="b"),
            helper.make_node("Relu", ["X"], ["Q"], name="a"),
            helper.make_node("Abs", ["X"], ["R"], name="c"),
            helper.make_node("Sum", ["R", "Q", "P"], ["Y"], name="sum"),
        ],
        [_vi("X")],
        [_vi("Y")],
    )
    g = onnx_io.load(m)
    assert [n.name for n in g.topo_nodes()] == ["b", "a", "c", "sum"]
    assert [n.order for n in g.topo_nodes()] == [0.0, 1.0, 2.0, 3.0]
    assert g.nodes_by_op("Neg") == [g.find_node("b")]
    assert onnx_io.to_model(g).graph.node[:] == m.graph.node[:]


def test_topo_nodes_reports_a_cycle():
    g = onnx_io.load(_chain_model())
    g.set_input(g.find_node("relu"), 0, "B")  # relu -> neg -> relu
    with pytest.raises(RewriteError, match=r"^graph has a cycle through node 'relu' \(Relu\)$"):
        g.topo_nodes()


def test_add_node_with_rule_tag_and_attributes():
    g = onnx_io.load(_chain_model())
    n = g.add_node(
        "LeakyRelu", ["A"], ["L"], name="leaky", attrs=[helper.make_attribute("alpha", 0.25)], order=0.5, rule="demo/leaky"
    )
    g.set_input(g.find_node("neg"), 0, "L")
    assert n.rule == "demo/leaky" and g.find_node("relu").rule is None
    assert n.attr("alpha") == 0.25 and n.attr("missing", 7) == 7
    m, (y,) = _checked_run(g, {"X": XV})
    node = m.graph.node[1]
    assert (node.name, node.op_type, list(node.input), list(node.output)) == ("leaky", "LeakyRelu", ["A"], ["L"])
    assert [(p.key, p.value) for p in node.metadata_props] == [("rewrite.rule", "demo/leaky")]
    _eq(y, -np.maximum(XV, 0) + W_DATA)  # LeakyRelu of a ReLU output is the identity


def test_add_node_refusals_leave_the_graph_untouched():
    g = onnx_io.load(_chain_model())
    before = _ser(g)
    with pytest.raises(RewriteError, match=r"^node 'bad' \(Add\): input 'nope' is never produced"):
        g.add_node("Add", ["X", "nope"], ["C"], name="bad")
    with pytest.raises(RewriteError, match=r"^node 'dup' \(Split\): output 'A' is already produced by another node$"):
        g.add_node("Split", ["X"], ["S1", "A"], name="dup")
    with pytest.raises(RewriteError, match=r"^node 'twice' \(Split\): output 'S' is already produced"):
        g.add_node("Split", ["X"], ["S", "S"], name="twice")
    for name in ("C", "S1", "S"):
        assert name not in g.values and name not in g.producer
    assert len(g.nodes) == 3 and _ser(g) == before
    with pytest.raises(RewriteError, match="value 'A' already exists"):
        g.add_value("A")


# ------------------------------------------------------------------ remove_node
def test_remove_node_refuses_while_outputs_are_used():
    g = onnx_io.load(_chain_model())
    with pytest.raises(RewriteError) as ei:
        g.remove_node(g.find_node("relu"))
    assert str(ei.value) == "cannot remove node 'relu' (Relu): its output 'A' is still used by 'neg' (Neg)"
    with pytest.raises(RewriteError) as ei:
        g.remove_node(g.find_node("add").id)
    assert str(ei.value) == "cannot remove node 'add' (Add): its output 'Y' is still used by the graph outputs"
    assert _ops(g) == [("relu", "Relu"), ("neg", "Neg"), ("add", "Add")]

    neg, relu = g.find_node("neg"), g.find_node("relu")
    g.set_input(neg, 0, "X")
    g.remove_node(relu)
    assert "A" not in g.values and "A" not in g.producer and relu.id not in g.nodes
    assert not g.nx.has_node(relu.id)
    assert _ops(g) == [("neg", "Neg"), ("add", "Add")]
    m, (y,) = _checked_run(g, {"X": XV})
    assert [v.name for v in m.graph.value_info] == ["B", "Y"]  # A's value_info went with A
    _eq(y, -XV + W_DATA)


# ------------------------------------------------------------------ set_input
def _clip_model() -> onnx.ModelProto:
    return _model(
        [helper.make_node("Clip", ["X", "lo", "hi"], ["Y"], name="clip")],
        [_vi("X")],
        [_vi("Y")],
        [numpy_helper.from_array(np.array(-1.0, np.float32), "lo"), numpy_helper.from_array(np.array(0.5, np.float32), "hi")],
    )


def test_set_input_empty_makes_optional_input_absent():
    g = onnx_io.load(_clip_model())
    clip = g.find_node("clip")
    g.set_input(clip, 2, "")
    assert clip.inputs == ["X", "lo", ""]
    assert g.uses("hi") == [] and g.uses("lo") == [(clip.id, 1)]
    assert g.remove_unused_initializers() == 1 and g.initializers == ["lo"]
    m, (y,) = _checked_run(g, {"X": XV})
    assert _model_ops(m) == [("clip", "Clip", ["X", "lo", ""], ["Y"])]
    _eq(y, np.maximum(XV, np.float32(-1.0)))
    g.set_input(clip, 1, "")  # both bounds absent
    assert g.remove_unused_initializers() == 1 and g.initializers == []
    _, (y,) = _checked_run(g, {"X": XV})
    _eq(y, XV)


def test_set_input_rewires_and_refuses_unknown_values():
    g = onnx_io.load(_chain_model())
    add = g.find_node("add")
    g.set_input(add, 1, "A")
    assert add.inputs == ["B", "A"]
    assert sorted(g.uses("A")) == sorted([(g.find_node("neg").id, 0), (add.id, 1)])
    assert g.uses("W") == []
    before = _ser(g)
    with pytest.raises(RewriteError, match=r"^node 'add' \(Add\): input 0 cannot read 'nope', which is never produced$"):
        g.set_input(add, 0, "nope")
    assert add.inputs == ["B", "A"] and g.uses("B") == [(add.id, 0)] and _ser(g) == before
    _, (y,) = _checked_run(g, {"X": XV})
    _eq(y, np.zeros(4, np.float32))  # -relu(x) + relu(x)


# ------------------------------------------------------------------ replace_all_uses
def test_replace_all_uses_of_an_intermediate():
    m = _model(
        [
            helper.make_node("Relu", ["X"], ["A"], name="relu"),
            helper.make_node("Neg", ["A"], ["B"], name="neg"),
            helper.make_node("Mul", ["A", "A"], ["C"], name="sq"),
            helper.make_node("Add", ["B", "C"], ["Y"], name="add"),
        ],
        [_vi("X")],
        [_vi("Y")],
    )
    g = onnx_io.load(m)
    g.add_node("Abs", ["X"], ["T"], name="abs", order=0.5)
    g.replace_all_uses("A", "T")
    neg, sq = g.find_node("neg"), g.find_node("sq")
    assert g.uses("A") == []
    assert sorted(g.uses("T")) == sorted([(neg.id, 0), (sq.id, 0), (sq.id, 1)])
    assert (neg.inputs, sq.inputs) == (["T"], ["T", "T"])
    assert [n.name for n in g.remove_dead_nodes([g.find_node("relu").id])] == ["relu"]
    out, (y,) = _checked_run(g, {"X": XV})
    assert _model_ops(out) == [
        ("abs", "Abs", ["X"], ["T"]),
        ("neg", "Neg", ["T"], ["B"]),
        ("sq", "Mul", ["T", "T"], ["C"]),
        ("add", "Add", ["B", "C"], ["Y"]),
    ]
    _eq(y, -np.abs(XV) + np.abs(XV) * np.abs(XV))
    g.replace_all_uses("T", "T")  # no-op
    assert _model_ops(onnx_io.to_model(g)) == _model_ops(out)


def test_replace_graph_output_by_node_output_renames_it():
    m = _chain_model()
    g = onnx_io.load(m)
    g.add_node("Sub", ["W", "A"], ["T"], name="sub", order=2.5)
    g.replace_all_uses("Y", "T")
    # the replacement takes the output's name; the old producer's output gets a fresh one
    assert g.outputs == ["Y"]
    assert g.find_node("sub").outputs == ["Y"] and g.find_node("add").outputs == ["Y__0"]
    assert "T" not in g.values and g.uses("Y") == [(SINK, 0)] and g.uses("Y__0") == []
    assert [n.name for n in g.remove_dead_nodes([g.find_node("add").id])] == ["add"]  # only candidates go
    assert [n.name for n in g.remove_dead_nodes([g.find_node("neg").id])] == ["neg"]
    out, (y,) = _checked_run(g, {"X": XV})
    assert _model_ops(out) == [("relu", "Relu", ["X"], ["A"]), ("sub", "Sub", ["W", "A"], ["Y"])]
    assert out.graph.output[0].SerializeToString() == m.graph.output[0].SerializeToString()
    # Y's value_info moved with the name (not left under the old producer's fresh name)
    assert [v.SerializeToString() for v in out.graph.value_info] == [v.SerializeToString() for v in m.graph.value_info if v.name != "B"]
    _eq(y, W_DATA - np.maximum(XV, 0))


def test_replace_graph_output_by_graph_input_bridges_with_identity():
    m = _chain_model()
    g = onnx_io.load(m)
    g.replace_all_uses("Y", "X")
    assert g.inputs == ["X"] and g.outputs == ["Y"]
    ident = g.find_node("Y_identity")
    assert (ident.op_type, ident.inputs, ident.outputs) == ("Identity", ["X"], ["Y"])
    assert g.find_node("add").outputs == ["Y__0"]
    assert [n.name for n in g.topo_nodes()] == ["Y_identity", "relu", "neg", "add"]
    assert [n.name for n in g.remove_dead_nodes([g.find_node(k).id for k in ("relu", "neg", "add")])] == ["add", "neg", "relu"]
    assert g.remove_unused_initializers() == 1
    out, (y,) = _checked_run(g, {"X": XV})
    assert _model_ops(out) == [("Y_identity", "Identity", ["X"], ["Y"])]
    assert [i.name for i in out.graph.input] == ["X"] and list(out.graph.initializer) == []
    assert out.graph.output[0].SerializeToString() == m.graph.output[0].SerializeToString()
    assert [v.SerializeToString() for v in out.graph.value_info] == [m.graph.value_info[2].SerializeToString()]
    assert out.graph.value_info[0].name == "Y"
    _eq(y, XV)


def test_replace_graph_output_by_initializer_or_other_output_bridges_with_identity():
    m = _model(
        [helper.make_node("Relu", ["X"], ["Y"], name="relu"), helper.make_node("Neg", ["X"], ["Z"], name="neg")],
        [_vi("X")],
        [_vi("Y"), _vi("Z")],
        [numpy_helper.from_array(W_DATA, "W")],
    )
    g = onnx_io.load(m)
    g.replace_all_uses("Y", "W")
    g.replace_all_uses("Z", "Y")  # Y is itself a graph output: Z may not take its name
    assert g.outputs == ["Y", "Z"]
    assert [(n.name, n.inputs, n.outputs) for n in g.nodes_by_op("Identity")] == [
        ("Y_identity", ["W"], ["Y"]),
        ("Z_identity", ["Y"], ["Z"]),
    ]
    assert [n.name for n in g.remove_dead_nodes(list(g.nodes))] == ["relu", "neg"]
    out, (y, z) = _checked_run(g, {"X": XV})
    assert _model_ops(out) == [("Y_identity", "Identity", ["W"], ["Y"]), ("Z_identity", "Identity", ["Y"], ["Z"])]
    _eq(y, W_DATA)
    _eq(z, W_DATA)


def test_replace_all_uses_refuses_an_unknown_replacement():
    g = onnx_io.load(_outer_read_model())
    before = _ser(g)
    with pytest.raises(RewriteError, match=r"^cannot replace 'A' by 'nope': 'nope' is never produced$"):
        g.replace_all_uses("A", "nope")
    assert _ser(g) == before


def test_set_type_decides_the_written_value_info():
    m = _chain_model()
    g = onnx_io.load(m)
    g.values["A"].set_type(F, (4,))  # unchanged: the ValueInfoProto as read is kept
    g.values["B"].set_type(F, ("n",))
    g.values["Y"].set_type(F, ("n",))
    out = onnx_io.to_model(g)
    vis = {v.name: v for v in out.graph.value_info}
    assert list(vis) == ["A", "B", "Y"]
    assert vis["A"].SerializeToString() == m.graph.value_info[0].SerializeToString()
    assert vis["B"] == _vi("B", ["n"]) and vis["Y"] == _vi("Y", ["n"])
    assert out.graph.output[0] == _vi("Y", ["n"])
    _, (y,) = _checked_run(g, {"X": XV})
    _eq(y, -np.maximum(XV, 0) + W_DATA)


def _outer_read_model() -> onnx.ModelProto:
    """A = relu(X); If(c) reads A in both branches; Loop body (with a nested If) reads A."""
    then_g = helper.make_graph([helper.make_node("Neg", ["A"], ["t"], name="t_neg")], "then", [], [_vi("t")])
    else_g = helper.make_graph([helper.make_node("Identity", ["A"], ["e"], name="e_id")], "else", [], [_vi("e")])
    nested_then = helper.make_graph([helper.make_node("Add", ["v_in", "A"], ["nt"], name="nt_add")], "nt", [], [_vi("nt")])
    nested_else = helper.make_graph([helper.make_node("Identity", ["v_in"], ["ne"], name="ne_id")], "ne", [], [_vi("ne")])
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="b_cond"),
            helper.make_node("If", ["cond_in"], ["v_out"], name="b_if", then_branch=nested_then, else_branch=nested_else),
        ],
        "body",
        [_vi("i", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL), _vi("v_in")],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("v_out")],
    )
    return _model(
        [
            helper.make_node("Relu", ["X"], ["A"], name="relu"),
            helper.make_node("If", ["c"], ["Z"], name="if", then_branch=then_g, else_branch=else_g),
            helper.make_node("Loop", ["M", "c", "X"], ["L"], name="loop", body=body),
        ],
        [_vi("X"), _vi("c", [], TensorProto.BOOL), _vi("M", [], TensorProto.INT64)],
        [_vi("Z"), _vi("L")],
    )


def _subgraph_inputs(attr: onnx.AttributeProto) -> list[list[str]]:
    out = []

    def walk(g):
        for n in g.node:
            out.append(list(n.input))
            for a in n.attribute:
                for s in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                    walk(s)

    walk(attr.g)
    return out


def test_replace_all_uses_renames_outer_reads_inside_subgraphs():
    m = _outer_read_model()
    original = m.SerializeToString(deterministic=True)
    g = onnx_io.load(m)
    if_n, loop = g.find_node("if"), g.find_node("loop")
    assert sorted(g.uses("A")) == sorted([(if_n.id, IMPLICIT_PORT), (loop.id, IMPLICIT_PORT)])
    g.add_node("Abs", ["X"], ["T"], name="abs", order=0.5)
    g.replace_all_uses("A", "T")
    assert g.uses("A") == []
    assert sorted(g.uses("T")) == sorted([(if_n.id, IMPLICIT_PORT), (loop.id, IMPLICIT_PORT)])
    assert _subgraph_inputs(if_n.attrs["then_branch"]) == [["T"]]
    assert _subgraph_inputs(if_n.attrs["else_branch"]) == [["T"]]
    # (helper.make_node sorts attributes by name: else_branch before then_branch)
    assert _subgraph_inputs(loop.attrs["body"]) == [["cond_in"], ["cond_in"], ["v_in"], ["v_in", "T"]]
    assert m.SerializeToString(deterministic=True) == original  # the source model's bodies are not edited
    assert [n.name for n in g.remove_dead_nodes([g.find_node("relu").id])] == ["relu"]
    for c in (True, False):
        out, (z, l_) = _checked_run(g, {"X": XV, "c": np.array(c), "M": np.array(3, np.int64)})
        _eq(z, -np.abs(XV) if c else np.abs(XV))
        _eq(l_, XV + 3 * np.abs(XV) if c else XV)
    assert [n.name for n in out.graph.node] == ["abs", "if", "loop"]


def test_outer_read_of_replaced_graph_input():
    g = onnx_io.load(_outer_read_model())
    g.add_node("Neg", ["X"], ["nx"], name="negx", order=-1)
    relu = g.find_node("relu")
    g.set_input(relu, 0, "nx")
    assert sorted(g.uses("X")) == sorted([(g.find_node("negx").id, 0), (g.find_node("loop").id, 2)])
    out, (z, _) = _checked_run(g, {"X": XV, "c": np.array(True), "M": np.array(1, np.int64)})
    assert [n.name for n in out.graph.node] == ["negx", "relu", "if", "loop"]
    _eq(z, -np.maximum(-XV, 0))


# ------------------------------------------------------------------ snapshot / restore
def _edit_everything(g: Graph) -> None:
    g.add_node("Abs", ["X"], ["T"], name="abs", order=0.5)
    g.replace_all_uses("A", "T")  # subgraph outer reads renamed
    g.remove_dead_nodes([g.find_node("relu").id])
    g.add_node("Neg", ["Z"], ["Z2"], name="negz", order=1.5)
    g.replace_all_uses("Z", "Z2")  # graph output renamed
    k = g.add_initializer("k", np.array(2.0, np.float32))
    g.add_node("Mul", ["X", k.name], ["X2"], name="mul", order=-1)
    g.set_input(g.find_node("loop"), 2, "X2")
    g.replace_all_uses("L", "X")  # graph output bridged by an Identity
    g.remove_dead_nodes([g.find_node("loop").id, g.find_node("mul").id])
    assert g.remove_unused_initializers() == 1
    g.values["T"].set_type(F, (4,))


def test_snapshot_restore_returns_to_identical_model():
    m = _outer_read_model()
    g = onnx_io.load(m)
    original = _ser(g)
    assert original == m.SerializeToString(deterministic=True)
    snap = g.snapshot()
    _edit_everything(g)
    assert [n.name for n in g.topo_nodes()] == ["L_identity", "abs", "if", "negz"]
    assert g.initializers == [] and g.outputs == ["Z", "L"]
    assert _ser(g) != original
    g.restore(snap)
    assert _ser(g) == original
    assert [n.name for n in g.topo_nodes()] == ["relu", "if", "loop"]
    assert sorted(g.uses("A")) == sorted([(g.find_node("if").id, IMPLICIT_PORT), (g.find_node("loop").id, IMPLICIT_PORT)])
    # the snapshot survives the restore: edit again, restore again
    _edit_everything(g)
    g.restore(snap)
    assert _ser(g) == original
    _, (z, l_) = _checked_run(g, {"X": XV, "c": np.array(True), "M": np.array(2, np.int64)})
    _eq(z, -np.maximum(XV, 0))
    _eq(l_, XV + 2 * np.maximum(XV, 0))


def test_snapshot_restore_after_failed_edits_and_renames():
    g = onnx_io.load(_chain_model())
    original = _ser(g)
    snap = g.snapshot()
    g.add_node("Abs", ["B"], ["T"], name="abs")
    g.replace_all_uses("Y", "T")
    g.remove_dead_nodes([g.find_node("add").id])
    with pytest.raises(RewriteError):
        g.remove_node(g.find_node("relu"))
    g.find_node("neg").name = "renamed"
    g.restore(snap)
    assert _ser(g) == original
    assert g.find_node("neg") is not None and g.find_node("renamed") is None


# ------------------------------------------------------------------ dead nodes, initializers
def test_remove_dead_nodes_is_transitive_within_candidates():
    m = _model(
        [
            helper.make_node("Relu", ["X"], ["A"], name="a"),
            helper.make_node("Neg", ["A"], ["B"], name="b"),
            helper.make_node("Abs", ["B"], ["C"], name="c"),
            helper.make_node("Sign", ["X"], ["D"], name="d"),
            helper.make_node("Identity", ["D"], ["Y"], name="keep"),
            helper.make_node("Exp", ["X"], ["E"], name="e"),
        ],
        [_vi("X")],
        [_vi("Y")],
    )
    g = onnx_io.load(m)
    ids = {n.name: n.id for n in g.nodes.values()}
    assert [n.name for n in g.remove_dead_nodes([ids["d"], ids["keep"]])] == []  # D and Y are used
    assert [n.name for n in g.remove_dead_nodes([ids["b"], ids["c"]])] == ["c", "b"]  # a is not a candidate
    assert [n.name for n in g.topo_nodes()] == ["a", "d", "keep", "e"]
    assert [n.name for n in g.remove_dead_nodes([ids["a"], ids["e"], ids["c"], 999])] == ["a", "e"]
    out, (y,) = _checked_run(g, {"X": XV})
    assert _model_ops(out) == [("d", "Sign", ["X"], ["D"]), ("keep", "Identity", ["D"], ["Y"])]
    _eq(y, np.sign(XV))


def test_add_initializer_and_remove_unused_initializers():
    m = _model(
        [helper.make_node("Add", ["X", "W"], ["Y"], name="add")],
        [_vi("X")],
        [_vi("Y"), _vi("K")],
        [numpy_helper.from_array(W_DATA, "W"), numpy_helper.from_array(W_DATA * 2, "K"), numpy_helper.from_array(W_DATA, "U")],
    )
    g = onnx_io.load(m)
    assert g.initializers == ["W", "K", "U"]
    v = g.add_initializer("W", np.array([10, 20, 30, 40], np.float32))  # name taken: a fresh one
    assert v.name == "W__0" and (v.dtype, v.shape) == (F, (4,)) and v.is_initializer
    assert g.producer["W__0"] == (SOURCE, 0) and g.initializers == ["W", "K", "U", "W__0"]
    _eq(g.const("W__0"), np.array([10, 20, 30, 40], np.float32))
    g.set_input(g.find_node("add"), 1, "W__0")
    # W and U are unused; K is a graph output and stays
    assert g.remove_unused_initializers() == 2
    assert g.initializers == ["K", "W__0"] and "W" not in g.values and "U" not in g.values
    assert g.remove_unused_initializers() == 0
    out, (y, k) = _checked_run(g, {"X": XV})
    assert [t.name for t in out.graph.initializer] == ["K", "W__0"]
    _eq(y, XV + np.array([10, 20, 30, 40], np.float32))
    _eq(k, W_DATA * 2)


def test_remove_unused_initializers_keeps_subgraph_reads_and_ir3_inputs():
    then_g = helper.make_graph([helper.make_node("Add", ["X", "S"], ["t"])], "then", [], [_vi("t")])
    else_g = helper.make_graph([helper.make_node("Identity", ["X"], ["e"])], "else", [], [_vi("e")])
    m = _model(
        [helper.make_node("If", ["c"], ["Y"], name="if", then_branch=then_g, else_branch=else_g)],
        [_vi("X"), _vi("c", [], TensorProto.BOOL), _vi("D")],  # D: an input with a default (IR < 4 style)
        [_vi("Y")],
        [numpy_helper.from_array(W_DATA, "S"), numpy_helper.from_array(W_DATA, "D"), numpy_helper.from_array(W_DATA, "U")],
    )
    g = onnx_io.load(m)
    assert g.uses("S") == [(g.find_node("if").id, IMPLICIT_PORT)] and g.uses("X") == [(g.find_node("if").id, IMPLICIT_PORT)]
    assert g.remove_unused_initializers() == 1 and g.initializers == ["S", "D"]
    out, (y,) = _checked_run(g, {"X": XV, "c": np.array(True)})
    assert [t.name for t in out.graph.initializer] == ["S", "D"] and [i.name for i in out.graph.input] == ["X", "c", "D"]
    _eq(y, XV + W_DATA)


# ------------------------------------------------------------------ Graph.const
def test_const_of_initializers_and_constant_nodes():
    nodes = [
        helper.make_node("Constant", [], ["ct"], value=numpy_helper.from_array(np.arange(6, dtype=np.int32).reshape(2, 3))),
        helper.make_node("Constant", [], ["cf"], value_float=1.5),
        helper.make_node("Constant", [], ["cfs"], value_floats=[1.5, -2.0]),
        helper.make_node("Constant", [], ["ci"], value_int=3),
        helper.make_node("Constant", [], ["cis"], value_ints=[3, -4]),
        helper.make_node("Constant", [], ["cs"], value_string="hi"),
        helper.make_node("Add", ["X", "W"], ["Y"], name="add"),
        helper.make_node("Identity", ["cf"], ["idf"], name="id"),
    ]
    m = _model(nodes, [_vi("X")], [_vi("Y"), _vi("idf", [])], [numpy_helper.from_array(W_DATA, "W")])
    g = onnx_io.load(m)
    expected = {
        "W": W_DATA,
        "ct": np.arange(6, dtype=np.int32).reshape(2, 3),
        "cf": np.array(1.5, np.float32),
        "cfs": np.array([1.5, -2.0], np.float32),
        "ci": np.array(3, np.int64),
        "cis": np.array([3, -4], np.int64),
    }
    for name, want in expected.items():
        _eq(g.const(name), want)
        assert g.const(name) is g.const(name)  # read once, then cached
    for name in ("cs", "X", "Y", "idf", "absent"):
        assert g.const(name) is None
    # Constant values feed ORT with exactly these types
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    _eq(sess.run(["idf"], {"X": XV})[0], expected["cf"])
