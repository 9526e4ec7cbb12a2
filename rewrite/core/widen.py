"""An fp16 model's float32 twin: the same graph, every FLOAT16 made FLOAT.

float32 holds every float16 value exactly, so the twin computes the same model (the same weights, the same INT4
codes and scales, the same ops in the same order) without fp16's rounding of each intermediate. It is the
higher-precision reference that tells a runtime's fp16 rounding apart from a wrong graph: a model with random
weights decided by near ties (a vocabulary of 151,936 random logits leaves its top two a few percent of the
largest apart) changes its greedy tokens under any fp16 evaluation order, ONNX Runtime's own fusions included.

What changes (ONNX IR spec, "Tensor element types"): initializers (external data streamed tensor by tensor into
one new data file, never the whole model in memory), tensor attributes (``Constant``, ``ConstantOfShape``), the
element-type attributes ``to`` (``Cast``), ``dtype`` (``EyeLike``, the ``Random*`` ops) and ``output_dtype``
(``DequantizeLinear`` from opset 23), and the element type of graph inputs, outputs and value_info, in subgraphs
too. Everything else is copied as it was; bfloat16 stays bfloat16.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from rewrite.core import spill
from rewrite.core.onnx_io import point_external, read_model
from rewrite.errors import RewriteError

F16, F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
_TYPE_ATTRS = {"to", "dtype", "output_dtype"}  #: INT attributes that name an element type
_ALIGN = 64  #: byte alignment of each tensor in the new data file


def _widen_type(t: onnx.TypeProto) -> None:
    kind = t.WhichOneof("value")
    if kind == "tensor_type" and t.tensor_type.elem_type == F16:
        t.tensor_type.elem_type = F32
    elif kind in ("sequence_type", "optional_type"):
        _widen_type(getattr(t, kind).elem_type)
    elif kind == "map_type":
        _widen_type(t.map_type.value_type)


def _widen_inline(t: onnx.TensorProto, where: str = "") -> None:
    if t.data_location == onnx.TensorProto.EXTERNAL:
        raise RewriteError(f"{where}: the FLOAT16 attribute tensor '{t.name}' keeps its data outside the model; "
                           f"widening those is not supported")
    t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))


def _widen_graph(g: onnx.GraphProto, where: str) -> list[onnx.TensorProto]:
    """Widen ``g``'s inline tensors, types and attributes in place (subgraphs too); returns its initializers with
    external data (subgraphs' too), for the caller to stream into the new data file."""
    streamed = []
    if any(s.values.data_type == F16 for s in g.sparse_initializer):
        raise RewriteError(f"{where}: graph '{g.name}' has a sparse FLOAT16 initializer; widening those is not supported")
    for t in g.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            streamed.append(t)
        elif t.data_type == F16:
            _widen_inline(t)
    for v in [*g.input, *g.output, *g.value_info]:
        _widen_type(v.type)
    return streamed + _widen_nodes(g.node, where)


def _widen_nodes(nodes, where: str) -> list[onnx.TensorProto]:
    """Widen the attributes of ``nodes`` (a graph's or a model-local function's) in place; returns the external
    initializers of their subgraphs (`_widen_graph`)."""
    streamed = []
    for n in nodes:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.INT and a.name in _TYPE_ATTRS and a.i == F16:
                a.i = F32
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == F16:
                _widen_inline(a.t, f"{where}: node '{n.name}'")
            elif a.type == onnx.AttributeProto.TENSORS:
                for t in a.tensors:
                    if t.data_type == F16:
                        _widen_inline(t, f"{where}: node '{n.name}'")
            elif a.type == onnx.AttributeProto.GRAPH:
                streamed += _widen_graph(a.g, where)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sub in a.graphs:
                    streamed += _widen_graph(sub, where)
            elif a.type == onnx.AttributeProto.TYPE_PROTO:
                _widen_type(a.tp)
    return streamed


def widen_float16(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write ``dst``, the float32 twin of the ONNX model ``src`` (see the module docstring), with its external data
    in ``<dst name>.data`` beside it. In ``src``'s own folder only the widened tensors are written there: every other
    external tensor stays where it is, read through its location as before (a full-size model's INT4 experts are
    not copied); elsewhere every external tensor is copied into the new file.

    Args:
        src: an ONNX file; its external data (relative to its folder) is read one tensor at a time.
        dst: the new model file (its folder is created); must not be ``src``.

    Returns:
        ``dst`` as a Path.

    Raises:
        ModelLoadError: ``src`` is not a readable ONNX model.
        RewriteError: ``dst`` is ``src``; a sparse FLOAT16 initializer; a FLOAT16 attribute tensor with external
            data; an external tensor whose data file is missing or shorter than its offset and length say; in
            ``src``'s folder, a data file of ``src`` named as the twin's (``<dst name>.data``). Nothing of the twin
            is left behind.
    """
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise RewriteError(f"{src}: the float32 twin must be written to another file")
    model = read_model(src)
    streamed = _widen_graph(model.graph, str(src))
    for f in model.functions:
        streamed += _widen_nodes(f.node, f"{src}: function '{f.name}'")
        for v in getattr(f, "value_info", ()):  # (FunctionProto.value_info: IR version 10)
            _widen_type(v.type)
    dst.parent.mkdir(parents=True, exist_ok=True)
    data = dst.with_name(dst.name + ".data")
    if dst.parent.resolve() == src.parent.resolve():
        if any(spill.external_info(t)[0] == data.name for t in streamed):
            raise RewriteError(f"{src}: its external data file {data.name} is where the float32 twin's would go")
        streamed = [t for t in streamed if t.data_type == F16]
    # the float16 tensors get new float32 data; every other external tensor is copied into the same new file
    try:
        pos = _write_data(src, data, streamed)
        onnx.save(model, str(dst))
    except BaseException:  # an error or a signal leaves no half-written twin
        for f in (data, dst):
            f.unlink(missing_ok=True)
        raise
    if pos == 0:
        data.unlink()
    return dst


def _write_data(src: Path, data: Path, streamed: list[onnx.TensorProto]) -> int:
    """Write ``streamed``'s bytes into ``data`` (float16 ones as float32), pointing each tensor there; returns the
    bytes written."""
    pos = 0
    with open(data, "wb") as out:
        for t in streamed:
            location, offset, length = spill.external_info(t)
            path = src.parent / location
            if length is None or not path.is_file() or path.stat().st_size < offset + length:
                raise RewriteError(f"{src}: external data of '{t.name}' ({location}, offset {offset}, length "
                                   f"{length}) is missing or ends early")
            raw = np.fromfile(path, dtype=np.uint8, count=length, offset=offset)
            if t.data_type == F16:
                raw = raw.view(np.float16).astype(np.float32).view(np.uint8)
                t.data_type = F32
            pad = -pos % _ALIGN
            out.write(b"\0" * pad)
            pos += pad
            raw.tofile(out)
            point_external(t, data.name, pos, raw.nbytes)
            pos += raw.nbytes
    return pos
