"""``legalize``: put a model in the form IREE's ONNX importer (torch-mlir) lowers and iree-compile compiles.

What it rewrites, each measured against iree-base-compiler 3.13 on the example models:

* **DequantizeLinear with ``block_size``** (opset 21; seed 000 item A1, llvm/torch-mlir#4505): the importer
  has no blocked form. Decomposed into ``(Cast(x) - expand(Cast(zero_point))) * expand(scale)``, where
  ``expand`` repeats each block's parameter ``block_size`` times along ``axis`` (Unsqueeze, Tile, Reshape)
  and drops the padding of a partial last block with a Slice. ONNX spec, DequantizeLinear-21:
  ``y = (x - x_zero_point) * x_scale`` with ``x_scale`` indexed by ``i // block_size`` along ``axis``.
* **4-bit initializers and Constant values** (INT4/UINT4): the importer cannot read them at all ("Unhandled
  ONNX TensorProto data"). Re-encoded as INT8/UINT8 holding the same values (initializers, and the ``value`` of
  ``Constant`` / ``ConstantOfShape`` nodes); the types of values computed from them (Gather, Reshape, ...)
  are cleared for shape inference to redo. 4-bit sparse initializers and 4-bit tensors in other attributes
  are refused with an error naming them.
* **Casts to a 4-bit type of values that provably fit it** (the seed form stores expert codes as uint8,
  Gathers them, then Casts to UINT4 because Gather does not take 4-bit data): ``Cast(Cast(x, to=UINT4), to=T)``
  becomes ``Cast(x, to=T)`` when every element of ``x`` is proven to lie in the 4-bit range (it comes from
  initializers through data-movement ops only), so no 4-bit value reaches the importer.
* **Scatters with no update** (``ScatterND`` / ``ScatterElements`` whose ``updates`` have a static 0 in their
  shape): the identity on ``data`` (ONNX spec: only the positions ``indices`` name are written, and there are
  none). iree-compile 3.13 dies with SIGFPE in its AnnotateDispatches pass on the empty ``slice_scatter`` that
  Qwen3.5-MoE's interleaved rotary sections export to (``updates`` [0, T, 1]); the scatter is replaced by its
  ``data`` input.
* **ScatterND writing a run of whole rows** (indices ``[n, 1]`` known before the run: constants, or computed
  from static dims, e.g. ``Unsqueeze(Slice(Range(0, Gather(Shape(x), 2)), 1, 33, 3))``, naming the consecutive
  rows ``a .. a+n-1`` of a ``data`` whose first dim is static): ``Concat(data[:a], updates, data[a+n:])`` along
  axis 0, the same values (ONNX spec, ScatterND with ``reduction="none"``). iree-compile 3.13 fails on
  Qwen3.5-MoE's rotary ``slice_scatter`` (ScatterND of one row into ``data`` [2, T, 1]) with "LLVM Translation
  failed for operation: builtin.unrealized_conversion_cast".
* **Scatters into a splat other ops read too** (JetMoE scatters every layer's gates into one zeros tensor and
  adds its attention experts' outputs into another): iree-compile 3.13 writes the scatters into one buffer. Each
  gets a splat of the same value computed from its own indices, which the compiler cannot merge with the others
  (:mod:`rewrite.plugins.splat_scatter`).
* **TopK that sorts a whole axis of integers for its order** (K provably the axis's run-time length, the
  Values unread: JetMoE's attention experts sort their (token, expert) pairs so): iree-compile 3.13 cannot
  compile it ("expected no unbounded stack allocations"). Rewritten as the stable ranking it computes, from
  comparisons and sums (:mod:`rewrite.plugins.sort_topk`).
* **Reduce ops with axes as an input** (opset 18; seed item A2, llvm/torch-mlir#4506): importer 3.13
  lowers constant axes (initializer, Constant node, or a constant-foldable chain) for all ten Reduce ops,
  so nothing is rewritten; axes known only at run time cannot be lowered (iree-compile fails on
  ``torch.aten.sum.dim_IntList``) and are reported in the plugin notes, not touched.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from rewrite.core.analysis import REDUCE_OPS, known_before_run, value_range
from rewrite.core.ir import Graph, dtype_name
from rewrite.core.pattern import AttrVar, Var
from rewrite.core.rules import _FLOAT_FORMATS, _INT_RANGES, rule
from rewrite.core.shape_eval import known_value
from rewrite.errors import RewriteError
from rewrite.plugins.base import Plugin
from rewrite.plugins.sort_topk import full_sort_topk
from rewrite.plugins.splat_scatter import shared_splat_scatter_elements, shared_splat_scatter_nd

_WIDEN_4BIT = {TensorProto.INT4: (TensorProto.INT8, np.int8), TensorProto.UINT4: (TensorProto.UINT8, np.uint8)}


@rule("dequantize-block")
def dequantize_block(op, x, scale, zero_point=Var("zero_point", optional=True)):
    """DequantizeLinear(x, scale, zero_point, block_size>0) -> Cast/Sub/Mul with scales repeated per block."""
    return op.DequantizeLinear(x, scale, zero_point, block_size=AttrVar("block_size"), _name="dq")


@dequantize_block.check
def _(m):
    dq = m.node("dq")
    bs = m.attr("block_size")
    if bs <= 0:
        return m.fail("block_size is 0 (per-tensor or per-axis DequantizeLinear lowers as is)", dq)
    sv = m.value("scale")
    xv = m.value("x")
    rank = xv.rank if xv.rank is not None else sv.rank
    if rank is None:
        return m.fail(f"rank of '{m['x']}' is unknown (run shape inference)", dq)
    if sv.dtype is None:
        return m.fail(f"element type of scale '{m['scale']}' is unknown", dq)
    axis = dq.attr("axis", 1)
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        return m.fail(f"axis {dq.attr('axis', 1)} out of range for rank {rank}", dq)
    after = (xv.shape or sv.shape)[axis + 1 :] if axis + 1 < rank else ()
    if xv.shape is None and axis + 1 < rank or any(not isinstance(d, int) for d in after):
        return m.fail(f"dims of '{m['x']}' after axis {axis} must be static to rebuild the scale layout", dq)
    out_dt = dq.attr("output_dtype", 0) or sv.dtype
    if xv.dtype in _INT_RANGES and out_dt in _FLOAT_FORMATS:
        # The decomposition casts x and zero_point to the output type and subtracts there; DequantizeLinear
        # subtracts in integers and rounds once. Equal only when every x - zero_point is exact in that type.
        lo, hi = _INT_RANGES[xv.dtype]
        need = hi - lo if m.get("zero_point") else max(-lo, hi)
        if need > 2 ** (_FLOAT_FORMATS[out_dt][1] + 1):
            return m.fail(f"x - zero_point of {dtype_name(xv.dtype)} is not exact in {dtype_name(out_dt)}", dq)


@dequantize_block.rewrite
def _(m, b):
    dq = m.node("dq")
    bs = int(m.attr("block_size"))
    xv, sv = m.value("x"), m.value("scale")
    rank = xv.rank if xv.rank is not None else sv.rank
    axis = dq.attr("axis", 1)
    axis = axis + rank if axis < 0 else axis
    out_dt = dq.attr("output_dtype", 0) or sv.dtype
    k = xv.shape[axis] if xv.shape is not None else None
    tail = [int(d) for d in (xv.shape[axis + 1 :] if xv.shape is not None else ())]

    xf = b.op("Cast", [m["x"]], to=out_dt)  # (x's own type may be 4-bit, which no later op should read)

    def per_element(param: str) -> str:
        """[..., nb, ...] -> [..., K, ...]: each block's value repeated block_size times along axis."""
        u = b.op("Unsqueeze", [param, b.const([axis + 1], "axes", np.int64)])
        reps = [1] * (rank + 1)
        reps[axis + 1] = bs
        t = b.op("Tile", [u, b.const(reps, "repeats", np.int64)])
        r = b.op("Reshape", [t, b.const([0] * axis + [-1] + tail, "shape", np.int64)])
        if isinstance(k, int) and k % bs == 0:
            return r
        end = b.op("Shape", [xf], start=axis, end=axis + 1)  # partial last block: cut the padding
        return b.op("Slice", [r, b.const([0], "starts", np.int64), end, b.const([axis], "axes", np.int64)])

    if m.get("zero_point"):
        diff = b.op("Sub", [xf, per_element(b.op("Cast", [m["zero_point"]], to=out_dt))])
    else:
        diff = xf
    return b.op("Mul", [diff, per_element(m["scale"])], dtype=out_dt, shape=xv.shape)


_4BIT_RANGE = {TensorProto.INT4: (-8, 7), TensorProto.UINT4: (0, 15)}


@rule("exact-4bit-cast")
def exact_4bit_cast(op, x):
    """Cast(Cast(x, to=INT4|UINT4), to=T) -> Cast(x, to=T) when x provably fits the 4-bit range."""
    narrow = op.Cast(x, to=AttrVar("narrow", check=lambda t: t in _4BIT_RANGE or "inner Cast is not to a 4-bit type"), _name="narrow")
    return op.Cast(narrow, to=AttrVar("target"), _name="widen")


@exact_4bit_cast.check
def _(m):
    lo, hi = _4BIT_RANGE[m.attr("narrow")]
    if m.value("x").dtype not in _INT_RANGES:  # a float in range may still be a non-integer that the Cast rounds
        return m.fail(f"'{m['x']}' is {dtype_name(m.value('x').dtype)}, not an integer type", m.node("narrow"))
    r = value_range(m.graph, m["x"])
    if r is None:
        return m.fail(f"values of '{m['x']}' are not provably within [{lo}, {hi}]", m.node("narrow"))
    if r[0] < lo or r[1] > hi:
        return m.fail(f"values of '{m['x']}' span [{r[0]:g}, {r[1]:g}], outside {dtype_name(m.attr('narrow'))}", m.node("narrow"))


@exact_4bit_cast.rewrite
def _(m, b):
    return b.op("Cast", [m["x"]], to=m.attr("target"), dtype=m.attr("target"), shape=m.value("x").shape)


def _empty_scatter_check(m):
    shape = m.value("updates").shape
    if shape is None or 0 not in shape:
        return m.fail(f"updates '{m['updates']}' are not statically empty (shape {shape})", m.node("scatter"))


@rule("empty-scatter-nd")
def empty_scatter_nd(op, data, indices, updates):
    """ScatterND(data, indices, updates) -> data when ``updates`` has a static 0 in its shape."""
    return op.ScatterND(data, indices, updates, _name="scatter")


@rule("empty-scatter-elements")
def empty_scatter_elements(op, data, indices, updates):
    """ScatterElements(data, indices, updates) -> data when ``updates`` has a static 0 in its shape."""
    return op.ScatterElements(data, indices, updates, _name="scatter")


def _scatter_data(m, b):
    return m["data"]


for _scatter in (empty_scatter_nd, empty_scatter_elements):
    _scatter.check(_empty_scatter_check)
    _scatter.rewrite(_scatter_data)


@rule("scatter-nd-rows")
def scatter_nd_rows(op, data, indices, updates):
    """ScatterND(data, indices [n, 1], updates) naming consecutive rows -> Concat(data[:a], updates, data[a+n:])."""
    return op.ScatterND(data, indices, updates, _name="scatter")


def _rows_written(m) -> tuple[int, int, int] | None:
    """(first row a, row count n, rows of data D) when the match writes rows a .. a+n-1 of D; else None."""
    scatter = m.node("scatter")
    if scatter.attr("reduction", "none") not in ("none", b"none"):
        return None
    idx = known_value(m.graph, m["indices"])
    shape = m.value("data").shape
    if idx is None or idx.ndim != 2 or idx.shape[1] != 1 or idx.shape[0] == 0 or not shape or not isinstance(shape[0], int):
        return None
    rows = [int(r) + shape[0] if r < 0 else int(r) for r in idx[:, 0]]
    if rows != list(range(rows[0], rows[0] + len(rows))) or rows[0] < 0 or rows[-1] >= shape[0]:
        return None
    return rows[0], len(rows), shape[0]


@scatter_nd_rows.check
def _(m):
    if _rows_written(m) is None:
        return m.fail(f"indices '{m['indices']}' are not a run of consecutive rows known before the run "
                      f"(or the reduction is not 'none', or the first dim of '{m['data']}' is not static)", m.node("scatter"))


@scatter_nd_rows.rewrite
def _(m, b):
    a, n, rows = _rows_written(m)
    dv = m.value("data")
    parts = []
    for lo, hi in ((0, a), (a + n, rows)):
        if hi > lo:
            part = b.op("Slice", [m["data"], b.const(np.array([lo], np.int64), "lo"), b.const(np.array([hi], np.int64), "hi"),
                                  b.const(np.array([0], np.int64), "axis")], dtype=dv.dtype, shape=(hi - lo, *dv.shape[1:]))
            parts.append(part)
        if lo == 0:
            parts.append(m["updates"])
    return b.op("Concat", parts, axis=0, dtype=dv.dtype, shape=dv.shape)


def widen_4bit_initializers(graph: Graph) -> list[str]:
    """Re-encode every 4-bit tensor the importer would meet as INT8/UINT8 with the same values: INT4/UINT4
    initializers and the ``value`` tensors of ``Constant`` and ``ConstantOfShape`` nodes; returns the names
    of the values re-encoded.

    Types of values computed from them through non-Cast, non-DequantizeLinear ops are cleared (their
    element type changes from 4 to 8 bits), for shape inference to recompute.

    Raises:
        RewriteError: a 4-bit sparse initializer, or a 4-bit tensor in another attribute (a subgraph's or
            an op's own), which this does not re-encode (named, with its node).
    """
    for sp in graph.passthrough.sparse_initializer:
        if sp.values.data_type in _WIDEN_4BIT:
            raise RewriteError(f"sparse initializer '{sp.values.name}' is {dtype_name(sp.values.data_type)}: "
                               "4-bit sparse tensors are not re-encoded; store it dense")
    constants = []  # every refusal before the first change
    for node in graph.topo_nodes():
        for attr in node.attrs.values():
            tensors = [attr.t] if attr.type == onnx.AttributeProto.TENSOR else list(attr.tensors)
            sparse = ([attr.sparse_tensor] if attr.type == onnx.AttributeProto.SPARSE_TENSOR else []) + list(attr.sparse_tensors)
            if any(sp.values.data_type in _WIDEN_4BIT for sp in sparse):
                raise RewriteError(f"node {node.describe()}: attribute '{attr.name}' holds a 4-bit sparse tensor, which is not re-encoded; store it dense")
            if any(_holds_4bit(sub) for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs))):
                raise RewriteError(f"node {node.describe()}: attribute '{attr.name}' holds a 4-bit tensor in its subgraph, which is not re-encoded")
            if not any(t.data_type in _WIDEN_4BIT for t in tensors):
                continue
            if node.op_type not in ("Constant", "ConstantOfShape") or attr.name != "value" or node.domain not in ("", "ai.onnx"):
                raise RewriteError(f"node {node.describe()}: attribute '{attr.name}' holds a 4-bit tensor, which is not re-encoded")
            constants.append(node)
    done = []
    for name in list(graph.initializers):
        v = graph.values[name]
        if v.dtype not in _WIDEN_4BIT:
            continue
        if v.overridable:
            raise RewriteError(f"graph input '{name}' is a 4-bit tensor with an initializer default; re-encoding it would "
                               "change the input's type (--freeze-inputs makes it a constant, which can be re-encoded)")
        graph.set_initializer_data(name, v.const().astype(_WIDEN_4BIT[v.dtype][1]))
        done.append(name)
        _clear_4bit_types_below(graph, name)
    for node in constants:
        t = node.attrs["value"].t
        data = onnx.numpy_helper.to_array(t).astype(_WIDEN_4BIT[t.data_type][1])
        wide = onnx.numpy_helper.from_array(data, t.name)
        node.attrs = {**node.attrs, "value": onnx.helper.make_attribute("value", wide)}  # a new dict: snapshots keep theirs
        out = graph.values[node.outputs[0]]
        out.set_type(wide.data_type, tuple(wide.dims) if node.op_type == "Constant" else out.shape)
        out._const_cache = None  # graph.const() reads the new attribute
        done.append(node.outputs[0])
        _clear_4bit_types_below(graph, node.outputs[0])
    return done


def _holds_4bit(g: onnx.GraphProto) -> bool:
    """A 4-bit initializer or attribute tensor, dense or sparse, anywhere in ``g``, nested subgraphs included."""
    if any(t.data_type in _WIDEN_4BIT for t in g.initializer) or any(sp.values.data_type in _WIDEN_4BIT for sp in g.sparse_initializer):
        return True
    for n in g.node:
        for a in n.attribute:
            if any(t.data_type in _WIDEN_4BIT for t in ([a.t] if a.HasField("t") else []) + list(a.tensors)):
                return True
            if any(sp.values.data_type in _WIDEN_4BIT for sp in ([a.sparse_tensor] if a.HasField("sparse_tensor") else []) + list(a.sparse_tensors)):
                return True
            if any(_holds_4bit(sub) for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs)):
                return True
    return False


def _clear_4bit_types_below(graph: Graph, value: str) -> None:
    """Clear the stale 4-bit types downstream of ``value`` until a Cast or a DequantizeLinear."""
    stack = [value]
    while stack:
        for c in graph.consumers(stack.pop()):
            if c.op_type in ("Cast", "DequantizeLinear"):
                continue
            for o in c.outputs:
                if o and graph.values[o].dtype in _WIDEN_4BIT:
                    graph.values[o].set_type(None, None)
                    stack.append(o)


class Legalize(Plugin):
    name = "legalize-iree-import"
    short = "legalize"
    takes_options = False
    description = ("Rewrite what IREE's importer or compiler rejects: blocked DequantizeLinear, 4-bit initializers, "
                   "empty scatters, ScatterND of whole rows, scatters into a shared splat, run-time sorts of integers written as TopK")
    opset_range = (13, 28)
    # ONNX Runtime reads what this plugin rewrites; decomposing DequantizeLinear there would lose MatMulNBits/QMoE
    backends = ("iree",)
    # topk and moe fuse INT4 experts from the DequantizeLinear form into ops that keep the 4-bit weights
    runs_after = ("topk", "moe")

    @property
    def rules(self):
        return [dequantize_block, exact_4bit_cast, empty_scatter_nd, empty_scatter_elements, scatter_nd_rows,
                shared_splat_scatter_elements, shared_splat_scatter_nd, full_sort_topk]

    @property
    def cases(self):
        from onnx import helper, numpy_helper

        from rewrite.core.cases import negative, positive

        def model(nodes, inputs, out, inits=(), opset=21, more_outputs=()):
            g = helper.make_graph(nodes, "main_graph", inputs, [out, *more_outputs], list(inits))
            return lambda: helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)

        rng = np.random.default_rng(0)
        codes = numpy_helper.from_array(rng.integers(0, 16, (3, 8, 6)).astype(np.uint8), "codes")
        scale = numpy_helper.from_array(rng.uniform(0.01, 0.1, (3, 2, 6)).astype(np.float32), "scale")
        zp = numpy_helper.from_array(rng.integers(0, 16, (3, 2, 6)).astype(np.uint8), "zp")
        idx = helper.make_tensor_value_info("expert", TensorProto.INT64, [1])
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6])
        # the seed's expert weights: uint8 codes Gathered, Cast to UINT4, blocked DequantizeLinear, MatMul
        seed_form = model([
            helper.make_node("Gather", ["codes", "expert"], ["g1"], axis=0),
            helper.make_node("Squeeze", ["g1", "ax0"], ["g"]),
            helper.make_node("Cast", ["g"], ["q"], to=TensorProto.UINT4),
            helper.make_node("Gather", ["zp", "expert"], ["gz1"], axis=0),
            helper.make_node("Squeeze", ["gz1", "ax0"], ["gz"]),
            helper.make_node("Cast", ["gz"], ["qz"], to=TensorProto.UINT4),
            helper.make_node("Gather", ["scale", "expert"], ["s1"], axis=0),
            helper.make_node("Squeeze", ["s1", "ax0"], ["s"]),
            helper.make_node("DequantizeLinear", ["q", "s", "qz"], ["w"], axis=0, block_size=4, name="dq"),
            helper.make_node("MatMul", ["x", "w"], ["y"]),
        ], [x, idx], y, [codes, scale, zp, numpy_helper.from_array(np.array([0], np.int64), "ax0")])
        per_axis = model(
            [helper.make_node("DequantizeLinear", ["q8", "s8"], ["y"], axis=0, name="dq")],
            [helper.make_tensor_value_info("q8", TensorProto.INT8, [4, 8])], helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8]),
            [numpy_helper.from_array(np.linspace(0.1, 1, 4).astype(np.float32), "s8")],
        )
        dynamic_after_axis = model(
            [helper.make_node("DequantizeLinear", ["q8", "s8"], ["y"], axis=1, block_size=4, name="dq")],
            [helper.make_tensor_value_info("q8", TensorProto.INT8, [2, 8, "M"]), helper.make_tensor_value_info("s8", TensorProto.FLOAT, [2, 2, "M"])],
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, "M"]),
        )
        runtime_axes = model(
            [helper.make_node("ReduceSum", ["r", "axes"], ["y"], keepdims=1, name="reduce")],
            [helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 3, 4]), helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None), opset=18,
        )
        # Qwen3.5-MoE's rotary sections (transformers 5.24 through its exporter): slice_scatter along the last
        # axis of [1, T, 2] as a ScatterND over the transposed [2, T, 1], indices from Range(0, dim 2) sliced
        # with step 3; row 1 is written, then the empty slice from row 2 on
        def rows(start):
            return [helper.make_node("Slice", ["r", start, "end", "ax0", "step3"], [f"i{start}"]),
                    helper.make_node("Unsqueeze", [f"i{start}", "ax1"], [f"idx{start}"])]
        t = helper.make_tensor_value_info
        slice_scatter = model([
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Gather", ["shape", "two"], ["n"], axis=0),
            helper.make_node("Range", ["zero", "n", "one"], ["r"]),
            *rows("one1"), *rows("two1"),
            helper.make_node("Transpose", ["x"], ["data"], perm=[2, 1, 0]),
            helper.make_node("Transpose", ["u"], ["upd"], perm=[2, 1, 0]),
            helper.make_node("ScatterND", ["data", "idxone1", "upd"], ["s1"], name="row"),
            helper.make_node("Slice", ["x", "two1", "end", "two1", "step3"], ["empty"]),  # [1, T, 0]
            helper.make_node("Transpose", ["empty"], ["upd0"], perm=[2, 1, 0]),
            helper.make_node("ScatterND", ["s1", "idxtwo1", "upd0"], ["s2"], name="empty_rows"),
            helper.make_node("Transpose", ["s2"], ["y"], perm=[2, 1, 0]),
        ], [t("x", TensorProto.FLOAT, [1, "T", 2]), t("u", TensorProto.FLOAT, [1, "T", 1])], t("y", TensorProto.FLOAT, [1, "T", 2]),
            [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("two", 2), ("zero", 0), ("one", 1),
             ("one1", [1]), ("two1", [2]), ("end", [33]), ("ax0", [0]), ("ax1", [1]), ("step3", [3]))], opset=18)
        runtime_indices = model(
            [helper.make_node("ScatterND", ["d", "i", "v"], ["y"], name="scatter")],
            [t("d", TensorProto.FLOAT, [4, 3]), t("i", TensorProto.INT64, [1, 1]), t("v", TensorProto.FLOAT, [1, 3])],
            t("y", TensorProto.FLOAT, [4, 3]))
        # IREE 3.13 writes both scatters into the one zeros tensor they read (JetMoE's per-layer gates)
        def splat_scatters(shared=True, nd=False):
            scatter = (lambda d, i, u, o: helper.make_node("ScatterND", [d, i, u], [o], reduction="add")) if nd else \
                (lambda d, i, u, o: helper.make_node("ScatterElements", [d, i, u], [o], axis=1))
            nodes = [helper.make_node("Shape", ["u1"], ["rows"], start=0, end=1),
                     helper.make_node("Concat", ["rows", "width"], ["shape"], axis=0),
                     helper.make_node("Expand", ["zero", "shape"], ["z"]), scatter("z", "i1", "u1", "s1")]
            nodes.append(scatter("z", "i2", "u2", "s2") if shared else helper.make_node("Add", ["s1", "s1"], ["s2"]))
            width, cols = (4, 1) if nd else (8, 2)
            ins = [t(n, ty, ["T", cols if n[0] == "i" else (4 if nd else 2)]) for n, ty in
                   (("i1", TensorProto.INT64), ("u1", TensorProto.FLOAT), ("i2", TensorProto.INT64), ("u2", TensorProto.FLOAT))]
            return model(nodes, ins, t("s1", TensorProto.FLOAT, ["T", width]),
                         [numpy_helper.from_array(np.array(0.5, np.float32), "zero"), numpy_helper.from_array(np.array([width], np.int64), "width")],
                         opset=18, more_outputs=[t("s2", TensorProto.FLOAT, ["T", width])])

        def scatter_feeds(m):
            r = np.random.default_rng(3)
            return {"i1": np.array([[0, 3], [1, -2], [5, 7]], np.int64), "u1": r.random((3, 2)).astype(np.float32),
                    "i2": np.array([[4, 6], [0, 1], [2, 2]], np.int64), "u2": r.random((3, 2)).astype(np.float32)}

        def index_add_feeds(m):  # rows added into, some twice (JetMoE's index_add)
            r = np.random.default_rng(5)
            return {"i1": np.array([[0], [2], [0], [1]], np.int64), "u1": r.random((4, 4)).astype(np.float32),
                    "i2": np.array([[3], [3], [1], [0]], np.int64), "u2": r.random((4, 4)).astype(np.float32)}

        def sort_model(dtype, shape, axis, largest, k_axis=None, k=None, k_slice=False, opset=18, values_out=False):
            """TopK over axis ``axis`` whose Values nobody reads (unless ``values_out``); K the length of axis
            ``k_axis`` (default ``axis``) from the shape at run time (JetMoE's Gather form, or a 3-input Slice),
            or the constant ``k``."""
            ka = (axis if k_axis is None else k_axis) % len(shape)
            if k is not None:
                nodes, inits = [], [numpy_helper.from_array(np.array([k], np.int64), "k")]
            elif k_slice:
                nodes = [helper.make_node("Shape", ["ids"], ["shape"]),
                         helper.make_node("Slice", ["shape", "k_axis", "k_end"], ["len"])]
                inits = [numpy_helper.from_array(np.array([ka], np.int64), "k_axis"),
                         numpy_helper.from_array(np.array([ka + 1], np.int64), "k_end")]
            else:
                nodes = [helper.make_node("Shape", ["ids"], ["shape"]),
                         helper.make_node("Gather", ["shape", "k_axis"], ["len0"], axis=0),
                         helper.make_node("Reshape", ["len0", "one1"], ["len"])]
                inits = [numpy_helper.from_array(np.array(ka, np.int64), "k_axis"),
                         numpy_helper.from_array(np.array([1], np.int64), "one1")]
            nodes.append(helper.make_node("TopK", ["ids", "len" if k is None else "k"], ["vals", "order"], axis=axis,
                                          largest=largest, name="sort"))
            return model(nodes, [t("ids", dtype, shape)], t("order", TensorProto.INT64, None), inits, opset=opset,
                         more_outputs=[t("vals", dtype, None)] if values_out else [])

        def sort_feeds(dtype, shape):
            def feeds(m):  # few distinct keys: many ties, which keep their index order
                return {"ids": np.random.default_rng(7).integers(0, 4, shape).astype(dtype)}
            return feeds
        return [
            positive("jetmoe-expert-sort", sort_model(TensorProto.INT64, ["N"], 0, 0), matches={"full-sort-topk": 1},
                     feeds=sort_feeds(np.int64, (11,))),
            positive("expert-sort-opset-13", sort_model(TensorProto.INT64, ["N"], 0, 0, opset=13),
                     matches={"full-sort-topk": 1}, feeds=sort_feeds(np.int64, (9,))),
            positive("rows-sorted-descending", sort_model(TensorProto.INT32, ["B", "N", 2], -2, 1),
                     matches={"full-sort-topk": 1}, feeds=sort_feeds(np.int32, (3, 6, 2))),
            positive("k-sliced-from-the-shape", sort_model(TensorProto.UINT8, ["B", "N"], 1, 0, k_slice=True),
                     matches={"full-sort-topk": 1}, feeds=sort_feeds(np.uint8, (2, 7))),
            negative("k-another-axis-length", sort_model(TensorProto.INT64, ["B", "N"], 1, 1, k_axis=0)),
            negative("static-k-sort", sort_model(TensorProto.INT64, [3, 6], 1, 1, k=6)),
            negative("k-from-a-static-shape", sort_model(TensorProto.INT64, [3, 6], 1, 1)),
            negative("sort-values-read", sort_model(TensorProto.INT64, ["N"], 0, 0, values_out=True)),
            negative("sort-of-floats", sort_model(TensorProto.FLOAT, ["N"], 0, 0)),
            positive("scatters-into-one-splat", splat_scatters(), matches={"shared-splat-scatter-elements": 2}, feeds=scatter_feeds),
            positive("index-adds-into-one-splat", splat_scatters(nd=True), matches={"shared-splat-scatter-nd": 2},
                     feeds=index_add_feeds),
            negative("one-scatter-into-a-splat", splat_scatters(shared=False)),
            positive("rotary-slice-scatter", slice_scatter, matches={"scatter-nd-rows": 1, "empty-scatter-nd": 1},
                     feeds=lambda m: {n: np.random.default_rng(2).standard_normal((1, 5, c)).astype(np.float32)
                                      for n, c in (("x", 2), ("u", 1))}),
            negative("scatter-nd-indices-at-run-time", runtime_indices),
            positive("seed-form-uint4-blocked-dequantize", seed_form, matches={"dequantize-block": 1, "exact-4bit-cast": 2},
                     feeds=lambda m: {"x": np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32), "expert": np.array([2], np.int64)}),
            negative("per-axis-dequantize", per_axis),
            negative("dequantize-dynamic-dims-after-axis", dynamic_after_axis),
            negative("reduce-axes-at-run-time", runtime_axes),
        ]

    def run(self, graph, report, ctx=None, *, dry_run=False):
        super().run(graph, report, ctx, dry_run=dry_run)
        if dry_run:
            return
        widened = widen_4bit_initializers(graph)
        for kind, names in (("initializers", [w for w in widened if w in graph.initializers]),
                            ("Constant values", [w for w in widened if w not in graph.initializers])):
            if names:
                report.notes.append(f"re-encoded {len(names)} 4-bit {kind} as 8-bit: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
        runtime_axes = [
            n.display_name for t in REDUCE_OPS for n in graph.nodes_by_op(t)
            if len(n.inputs) > 1 and n.inputs[1] and not known_before_run(graph, n.inputs[1])
        ]
        if runtime_axes:
            report.notes.append(
                f"{len(runtime_axes)} Reduce op(s) take axes computed at run time, which IREE cannot lower; left alone: {', '.join(runtime_axes[:8])}"
            )
