"""``ai.rewrite::Sort`` and the ``legalize`` rule ``full-sort-topk`` that writes it.

torch's ``sort`` exports as ``TopK(x, K)`` with ``K`` the length of the sorted axis, computed in the graph from
``Shape(x)`` (transformers' JetMoE sorts the (token, expert) pairs of its attention experts by expert id:
``TopK(view [2*T], K = Reshape(2*T), axis=0, largest=0, sorted=1)``). IREE's importer lowers a TopK of a K known
only at run time to ``iree_linalg_ext.topk`` with an unbounded stack allocation, which iree-compile 3.13 refuses
("'memref.alloca' op expected no unbounded stack allocations"). When ``K`` is proven equal to the axis' length
(:class:`rewrite.plugins.expand.SymbolicEvaluator`, for symbolic lengths too), the TopK is a sort, written as
``Sort``; any other TopK is left alone.

Contract: ``values, indices = Sort(x; axis, descending)``, ``x`` any float or integer type of any rank;
``values`` the elements of ``x`` sorted along ``axis`` (ascending, or descending when ``descending=1``),
``indices`` int64 their positions in ``x``; equal elements keep their order (the lower index first), as ONNX
TopK-11 specifies for its sorted output. Lowerings: ONNX Runtime gets ``TopK(x, Gather(Shape(x), [axis]))``
back; IREE (llvm-cpu and cuda) an ``iree_linalg_ext.sort`` of the values and an index iota along ``axis``, the
comparator ordering by value, then by index.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from rewrite.core.abstract_ops import DOMAIN, AbstractOp
from rewrite.core.iree_lowering import IreeLowering, PatchContext, TorchOperator
from rewrite.core.ir import Graph, Node
from rewrite.core.pattern import AttrVar
from rewrite.core.rules import Builder, rule
from rewrite.errors import BackendError
from rewrite.plugins.expand import SymbolicEvaluator


class Sort(AbstractOp):
    """The contract in the module docstring."""

    op_type = "Sort"
    ort_targets = ("cpu", "cuda")
    iree_targets = ("llvm-cpu", "cuda")

    def reference(self, attrs: dict, x: np.ndarray) -> list[np.ndarray]:
        """numpy stable sort; returns [values, indices int64]."""
        axis = int(attrs.get("axis", -1))
        key = -x.astype(np.float64) if attrs.get("descending", 0) else x
        idx = np.argsort(key, axis=axis, kind="stable").astype(np.int64)
        return [np.take_along_axis(x, idx, axis=axis), idx]

    def sample_inputs(self, rng: np.random.Generator) -> list[tuple[dict, list[np.ndarray]]]:
        """Conformance samples: int64 ids with ties ascending (JetMoE's case), f32 rows descending with ties, f16
        along axis 0 of a 3-D tensor."""
        ties = rng.standard_normal((3, 11)).astype(np.float32)
        ties[:, 5:8] = ties[:, :3]
        return [({"axis": 0, "descending": 0}, [rng.integers(0, 6, 23).astype(np.int64)]),
                ({"axis": 1, "descending": 1}, [ties]),
                ({"axis": 0, "descending": 0}, [rng.standard_normal((7, 2, 3)).astype(np.float16)])]

    def lower_ort(self, graph: Graph, node: Node) -> None:
        """``TopK(x, Gather(Shape(x), [axis]), axis, largest=descending, sorted=1)``."""
        x = node.inputs[0]
        b = Builder(graph, "lower/Sort", node.order, node.name)
        k = b.op("Gather", [b.op("Shape", [x]), b.const(np.array([int(node.attr("axis"))], np.int64), "axis")], axis=0,
                 dtype=TensorProto.INT64, shape=[1])
        values, indices = b.op("TopK", [x, k], outputs=2, axis=int(node.attr("axis")), largest=int(node.attr("descending")),
                               sorted=1, dtype=[graph.values[node.outputs[0]].dtype, TensorProto.INT64])
        for old, new in zip(node.outputs, (values, indices)):
            graph.values[new].set_type(graph.values[old].dtype, graph.values[old].shape)
        graph.replace_node(node, [values, indices])

    def lower_iree(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """``iree_linalg_ext.sort dimension(axis)`` of (a copy of x, iota along axis), ordered by value then index.
        The sort writes its operands in place, and iree-compile 3.13 lets it write into x's buffer when x is a
        view of a value other ops read too (JetMoE sorts a reshape of the router's expert ids, which its Slices
        read after): the copy is the sort's own. Both
        results held by a ``util.optimization_barrier``: when the graph reads only the indices (JetMoE), the
        values would otherwise be sorted in a stack buffer of the dynamic length, which iree-compile 3.13 refuses
        ("expected no unbounded stack allocations").

        Raises:
            BackendError: an element type without an order (bool), or ranks that do not match.
        """
        x = op.operand_types[0]
        r = len(x.dims)
        axis = int(op.attrs.get("axis", -1)) % max(r, 1)
        el = x.builtin_element
        if x.element == "i1" or r == 0:
            raise BackendError(f"Sort {op.where}: input {x.text}; a float or integer tensor of rank 1 or more expected")
        desc = bool(op.attrs.get("descending", 0))
        if el.startswith("f") or el == "bf16":
            before, equal = f"arith.cmpf {'ogt' if desc else 'olt'}", "arith.cmpf oeq"
        else:
            u = x.element.startswith("ui")
            before, equal = f"arith.cmpi {('ugt' if u else 'sgt') if desc else ('ult' if u else 'slt')}", "arith.cmpi eq"
        dims = ", ".join(f"d{k}" for k in range(r))
        dyn = [f"%in0_d{k}" for k, d in enumerate(x.dims) if d is None]
        idx_type = "tensor<" + "".join(("?" if d is None else str(d)) + "x" for d in x.dims) + "i64>"
        body = f"""    %se = tensor.empty({', '.join(dyn)}) : {idx_type}
    %iota = linalg.generic {{indexing_maps = [affine_map<({dims}) -> ({dims})>], iterator_types = [{', '.join(['"parallel"'] * r)}]}}
        outs(%se : {idx_type}) {{
    ^bb0(%o: i64):
      %i = linalg.index {axis} : index
      %ii = arith.index_cast %i : index to i64
      linalg.yield %ii : i64
    }} -> {idx_type}
    %ve = tensor.empty({', '.join(dyn)}) : {x.builtin}
    %values = linalg.generic {{indexing_maps = [affine_map<({dims}) -> ({dims})>, affine_map<({dims}) -> ({dims})>], iterator_types = [{', '.join(['"parallel"'] * r)}]}}
        ins(%in0 : {x.builtin}) outs(%ve : {x.builtin}) {{
    ^bb0(%v: {el}, %o: {el}):
      linalg.yield %v : {el}
    }} -> {x.builtin}
    %sorted:2 = iree_linalg_ext.sort dimension({axis}) outs(%values, %iota : {x.builtin}, {idx_type}) {{
    ^bb0(%a: {el}, %b: {el}, %ia: i64, %ib: i64):
      %first = {before}, %a, %b : {el}
      %same = {equal}, %a, %b : {el}
      %lower = arith.cmpi slt, %ia, %ib : i64
      %tie = arith.andi %same, %lower : i1
      %keep = arith.ori %first, %tie : i1
      iree_linalg_ext.yield %keep : i1
    }} -> {x.builtin}, {idx_type}
    %kv = util.optimization_barrier %sorted#0 : {x.builtin}
    %ki = util.optimization_barrier %sorted#1 : {idx_type}
"""
        # one barrier per result: one over both gets both one stream lifetime, and iree-compile 3.13 fails to
        # verify it when only one of them is a function result
        values, indices = "%kv", "%ki"
        if dyn:  # the barrier's results lose their dims' ties, which iree-compile's shape cleanup needs
            body += (f"    %tv = flow.tensor.tie_shape %kv : {x.builtin}{{{', '.join(dyn)}}}\n"
                     f"    %ti = flow.tensor.tie_shape %ki : {idx_type}{{{', '.join(dyn)}}}\n")
            values, indices = "%tv", "%ti"
        body += (f"    %out0 = tensor.cast {values} : {x.builtin} to {op.result_types[0].builtin}\n"
                 f"    %out1 = tensor.cast {indices} : {idx_type} to {op.result_types[1].builtin}\n")
        return IreeLowering(body=body)


SORT = Sort()


@rule("full-sort-topk")
def full_sort_topk(op, x, k):
    """TopK(x, K, axis, largest, sorted=1) with K proven equal to x's length along axis -> Sort(x)."""
    return op.TopK(x, k, axis=AttrVar("axis", default=-1), largest=AttrVar("largest", default=1),
                   sorted=AttrVar("sorted", default=1), _outputs=2, _name="topk")


@full_sort_topk.check
def _(m):
    topk = m.node("topk")
    if m.attr("sorted") != 1:
        return m.fail("TopK with sorted=0 (an unordered selection, not a sort)", topk)
    ev = SymbolicEvaluator(m.graph)
    shape, k = ev.shape(m["x"]), ev.vector(m["k"])
    if shape is None or not shape or m.value("x").shape is None or k is None or len(k) != 1:
        return m.fail(f"shape of '{m['x']}' or the value of K '{m['k']}' unknown", topk)
    axis = m.attr("axis") % len(shape)
    if shape[axis] is None or k[0] != shape[axis]:
        return m.fail(f"K ({k[0]}) not proven equal to the length of axis {axis} ({shape[axis]}): a selection, not a sort", topk)


@full_sort_topk.rewrite
def _(m, b):
    xv = m.value("x")
    m.graph.ensure_opset(DOMAIN)
    return list(b.op(Sort.op_type, [m["x"]], domain=DOMAIN, outputs=2, axis=m.attr("axis") % len(xv.shape),
                     descending=int(m.attr("largest")), dtype=[xv.dtype, TensorProto.INT64], shape=xv.shape))
