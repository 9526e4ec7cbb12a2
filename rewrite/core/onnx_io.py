"""Loading ONNX files into the graph IR and writing them back, losslessly.

* :func:`load` reads only the protobuf: external data (models over 2 GB) stays on disk and is read one
  tensor at a time when a rule asks for a constant, or stream-copied by :func:`save`.
* :func:`save` writes nodes in their original order (new nodes where the node they replace stood), and
  every field the IR does not model (metadata, functions, training info, value_info, node doc strings)
  as it was read. ``save(load(m)) == m`` for any model ONNX can parse (tested on onnx's node test suite).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from rewrite.core import spill
from rewrite.core.ir import SINK, SOURCE, Graph, Value
from rewrite.core.stages import stage
from rewrite.errors import ModelLoadError, RewriteError

#: Initializers at least this many bytes go to the external data file when a model must use one.
EXTERNAL_MIN_BYTES = 1024
_PROTOBUF_LIMIT = 2**31 - 1


def _type_of(vi: onnx.ValueInfoProto) -> tuple[int | None, tuple | None, onnx.TypeProto | None]:
    t = vi.type
    if t.HasField("tensor_type"):
        tt = t.tensor_type
        shape = None
        if tt.HasField("shape"):
            shape = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param if d.HasField("dim_param") else None)
                for d in tt.shape.dim
            )
        return (tt.elem_type or None), shape, None
    if t.WhichOneof("value") is None:
        return None, None, None
    return None, None, t


def _model_shell(model: onnx.ModelProto) -> onnx.ModelProto:
    """Copy of every ModelProto field except the graph (the graph can be gigabytes)."""
    shell = onnx.ModelProto()
    for fd, val in model.ListFields():
        if fd.name == "graph":
            continue
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
        if repeated:
            getattr(shell, fd.name).extend(val)
        elif fd.type == fd.TYPE_MESSAGE:
            getattr(shell, fd.name).CopyFrom(val)
        else:
            setattr(shell, fd.name, val)
    return shell


def external_locations(model: onnx.ModelProto) -> set[str]:
    """The external-data ``location`` of every initializer of ``model`` that keeps its bytes outside the file."""
    return {e.value for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
            for e in t.external_data if e.key == "location"}


def _check_external_data(model: onnx.ModelProto, base_dir: str, where: str) -> None:
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        # ONNX external data lives beside the model (onnx.external_data_helper): a relative path, no way out
        if loc and (os.path.isabs(loc) or os.path.normpath(loc).split(os.sep)[0] == os.pardir):
            raise ModelLoadError(f"{where}: initializer '{t.name}' has its external data at '{loc}', outside the "
                                 f"model's folder; expected a path relative to {base_dir or '.'} inside it")
        path = os.path.join(base_dir, loc)
        if not loc or not os.path.isfile(path):
            raise ModelLoadError(f"{where}: initializer '{t.name}' needs external data file '{loc}', not found in {base_dir or '.'}")
        need = int(info.get("offset", 0)) + int(info.get("length", 0))
        if os.path.getsize(path) < need:
            raise ModelLoadError(
                f"{where}: external data file '{loc}' is {os.path.getsize(path)} bytes, initializer '{t.name}' needs {need}"
            )


def read_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Parse an ONNX file without loading its external data.

    Raises:
        ModelLoadError: the file is missing, is not ONNX protobuf, is truncated, or has no graph.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeWarning, ValueError) as e:
        raise ModelLoadError(f"{path}: not a readable ONNX model ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'parse failed'})") from e
    if not model.HasField("graph") or (len(model.graph.node) == 0 and len(model.graph.output) == 0):
        raise ModelLoadError(f"{path}: not an ONNX model (no graph found; truncated or another file type?)")
    return model


def load(source: str | os.PathLike | onnx.ModelProto, *, base_dir: str | None = None) -> Graph:
    """Build a :class:`Graph` from an ONNX file or ModelProto.

    Args:
        source: path of a ``.onnx`` file, or a ModelProto already in memory.
        base_dir: directory for external data locations (default: the file's directory).

    Raises:
        ModelLoadError: unreadable, truncated or inconsistent file; missing external data.
    """
    if isinstance(source, onnx.ModelProto):
        model, where = source, "<model>"
        base_dir = base_dir or ""
    else:
        model, where = read_model(source), str(source)
        base_dir = base_dir if base_dir is not None else str(Path(source).parent)
    _check_external_data(model, base_dir, where)
    try:
        return _from_model(model, base_dir)
    except RewriteError as e:
        raise ModelLoadError(f"{where}: {e}") from e


def _from_model(model: onnx.ModelProto, base_dir: str) -> Graph:
    g = Graph()
    gp = model.graph
    g.model_shell = _model_shell(model)
    g.name, g.doc_string = gp.name, gp.doc_string
    g.passthrough.sparse_initializer.extend(gp.sparse_initializer)
    g.passthrough.quantization_annotation.extend(gp.quantization_annotation)
    g.passthrough.metadata_props.extend(gp.metadata_props)
    for f in ("name", "doc_string"):  # proto2 presence: remember an explicitly empty name/doc_string
        if gp.HasField(f):
            setattr(g.passthrough, f, getattr(gp, f))
    for t in gp.initializer:
        if t.name in g.values:
            raise RewriteError(f"initializer '{t.name}' is defined twice")
        g.values[t.name] = Value(name=t.name, dtype=t.data_type or None, shape=tuple(t.dims), initializer=t, base_dir=base_dir)
        g.producer[t.name] = (SOURCE, 0)
        g.initializers.append(t.name)
    for sp in gp.sparse_initializer:  # kept verbatim; registered so readers resolve
        name = sp.values.name
        g.values.setdefault(name, Value(name=name, dtype=sp.values.data_type, shape=tuple(sp.dims)))
        g.producer.setdefault(name, (SOURCE, 0))
    for vi in gp.input:
        dt, shape, other = _type_of(vi)
        if vi.name in g.values:  # an initializer listed as an input: its default from IR 4 on, a weight before
            v = g.values[vi.name]
            v.info, v.overridable = vi, v.is_initializer and model.ir_version >= 4
        else:
            g.values[vi.name] = Value(name=vi.name, dtype=dt, shape=shape, info=vi, non_tensor_type=other)
            g.producer[vi.name] = (SOURCE, 0)
        g.inputs.append(vi.name)
    for k, np_ in enumerate(gp.node):
        extra = onnx.NodeProto()
        extra.CopyFrom(np_)
        for f in ("input", "output", "attribute", "name", "op_type", "domain"):
            extra.ClearField(f)
        for f in ("name", "domain"):  # proto2 presence: an explicit empty name/domain is written back as read
            if np_.HasField(f) and not getattr(np_, f):
                setattr(extra, f, "")
        g.add_node(
            np_.op_type,
            list(np_.input),
            list(np_.output),
            domain=np_.domain,
            name=np_.name,
            attrs=list(np_.attribute),
            extra=extra,
            order=float(k),
        )
    for vi in gp.value_info:
        v = g.values.get(vi.name)
        if v is not None and g.producer.get(vi.name, (None,))[0] == SOURCE:
            # value_info of a graph input or initializer: kept verbatim (the value's type is its declaration's)
            g.passthrough.value_info.append(vi)
            g.value_info_order.append(vi.name)
            continue
        if v is None:  # value_info for a name nothing produces: keep it verbatim
            v = Value(name=vi.name)
            g.values[vi.name] = v
        dt, shape, other = _type_of(vi)
        v.dtype, v.shape, v.non_tensor_type, v.info = dt, shape, other, vi
        g.value_info_order.append(vi.name)
    for k, vi in enumerate(gp.output):
        if vi.name not in g.producer:
            raise RewriteError(f"graph output '{vi.name}' is never produced")
        v = g.values[vi.name]
        if vi.name not in g.value_info_order and vi.name not in g.inputs and v.initializer is None:
            dt, shape, other = _type_of(vi)
            v.dtype, v.shape, v.non_tensor_type, v.info = dt, shape, other, vi
        g.output_infos[vi.name] = vi
        g.outputs.append(vi.name)
        g._connect(vi.name, SINK, k)
    return g


def _type_as_loaded(v: Value, out_vi: onnx.ValueInfoProto) -> bool:
    """Whether ``v`` still has the type it had when loaded, so the graph output's ValueInfoProto as read fits.

    The output's own declaration may be less precise than the value_info or input declaration the value took
    its type from; :meth:`Value.set_type` drops ``v.info`` when a rule changes the type.
    """
    cur = (v.dtype, v.shape)
    if _type_of(out_vi)[:2] == cur:
        return True
    if v.info is not None:
        return _type_of(v.info)[:2] == cur
    t = v.initializer
    return t is not None and ((t.data_type or None), tuple(t.dims)) == cur


def to_model(g: Graph, *, skeleton_bytes: int | None = None) -> onnx.ModelProto:
    """Write the graph back to a ModelProto (initializer protos are shared, not copied).

    With ``skeleton_bytes``, initializers larger than that (or held in external data) are written as graph
    inputs of the same type and shape, without their data: a skeleton for shape inference, which needs only
    their types, however large the model."""
    model = onnx.ModelProto()
    model.CopyFrom(g.model_shell)
    gp = model.graph
    if g.name or g.passthrough.HasField("name"):
        gp.name = g.name
    if g.doc_string or g.passthrough.HasField("doc_string"):
        gp.doc_string = g.doc_string
    written: set[str] = set()
    for name in g.inputs:
        vi = g.values[name].to_value_info() or onnx.ValueInfoProto(name=name)
        gp.input.append(vi)
    for name in g.initializers:
        v = g.values[name]
        t = v.initializer
        if skeleton_bytes is not None and v.overridable:
            continue  # a default is not a constant: inference must not fold it (the input declares its type)
        if skeleton_bytes is not None and (t.data_location == onnx.TensorProto.EXTERNAL or tensor_nbytes(t) > skeleton_bytes):
            if name not in g.inputs:
                gp.input.append(onnx.helper.make_tensor_value_info(name, t.data_type, list(t.dims)))
            continue
        gp.initializer.append(t)
    gp.sparse_initializer.extend(g.passthrough.sparse_initializer)
    for n in g.topo_nodes():
        np_ = gp.node.add()
        np_.CopyFrom(n.extra)
        np_.input.extend(n.inputs)
        np_.output.extend(n.outputs)
        if n.name:
            np_.name = n.name
        np_.op_type = n.op_type
        if n.domain:
            np_.domain = n.domain
        np_.attribute.extend(n.attrs.values())
        written.update(o for o in n.outputs if o)
    for name in g.outputs:
        v = g.values[name]
        vi = g.output_infos.get(name)
        if vi is None or vi.name != name or not _type_as_loaded(v, vi):
            vi = v.to_value_info() or onnx.ValueInfoProto(name=name)
        gp.output.append(vi)
    seen = set(g.value_info_order)
    source_vis: dict[str, list[onnx.ValueInfoProto]] = {}
    for vi in g.passthrough.value_info:
        source_vis.setdefault(vi.name, []).append(vi)
    for name in g.value_info_order:
        v = g.values.get(name)
        if v is not None and g.producer.get(name, (None,))[0] == SOURCE:
            if source_vis.get(name):
                gp.value_info.append(source_vis[name].pop(0))
        elif v is not None and (name in written or name not in g.producer):
            vi = v.to_value_info()
            if vi is not None:
                gp.value_info.append(vi)
    # types learned by inference or set by rules, for values the source had no value_info for
    outs = set(g.outputs)
    # not set order: nodes a rule inserts may share an order number, so the name breaks ties (a byte-identical file)
    for name in sorted(written - seen - outs, key=lambda x: (g.nodes[g.producer[x][0]].order, g.producer[x][1], x)):
        vi = g.values[name].to_value_info()
        if vi is not None and g.values[name].info is None:
            gp.value_info.append(vi)
    gp.quantization_annotation.extend(g.passthrough.quantization_annotation)
    gp.metadata_props.extend(g.passthrough.metadata_props)
    return model


#: the TensorProto fields that can hold a tensor's values (besides external data)
TENSOR_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")


def clear_tensor_data(t: onnx.TensorProto) -> None:
    """Remove a tensor's values from every field that can hold them (``raw_data`` or a typed field such as
    ``float_data`` or ``int32_data``, which ``onnx.helper.make_tensor`` fills); name, dims and type stay."""
    for f in TENSOR_DATA_FIELDS:
        t.ClearField(f)


def tensor_nbytes(t: onnx.TensorProto) -> int:
    """Bytes of a tensor's data: its external length (the ``length`` key, else what its dims and type need), or the
    serialized size of data held inside the model."""
    if t.data_location == onnx.TensorProto.EXTERNAL:
        return spill.external_info(t)[2] or 0
    return t.ByteSize()


def save(g: Graph, path: str | os.PathLike, *, external: bool | None = None, rebase_spilled: bool = False,
         link_source: Callable[[onnx.TensorProto], bool] | None = None) -> Path:
    """Write the graph to ``path``.

    Initializers whose data is in an external file of the source are stream-copied (64 MiB at a time) into
    ``<name>.data`` beside ``path``, never loaded whole. ``external=None`` uses an external data file when the
    source had one or the model would pass protobuf's 2 GB limit; True/False force it.

    ``rebase_spilled``: afterwards the graph's tensors held in the spill file refer to their copies in the written
    data file, and the spill file's ranges are given back (:meth:`Graph.release_spilled`): the plugins' tensors are
    on disk once, not twice, while a backend goes on from the saved model (the full Qwen3-30B-A3B: 14.5 GB of
    repacked experts). The graph then reads them from ``<name>.data``, which must stay where it was written.

    ``link_source``: the initializers still in a source model's data file for which it returns True are not
    copied; each such source data file gets a link beside ``path`` (``<name>.source<k>.data``: a hard link, else a
    symbolic link; where neither can be made, its tensors are copied) and they keep their offsets in it. For a
    caller that reads them by file range and re-points them at once (the IREE backend writes the ``.irpa`` from
    this model, then :func:`rewrite.backends.iree.share_params` drops the links). onnx's own external-data reader
    refuses links (a "hardlink attack"): such a model is read with :func:`rewrite.core.spill.inline_external`
    and the ``.irpa`` writer's file ranges. The full Qwen3-30B-A3B without ``moe``
    keeps 32.8 GB of seed-form experts that would otherwise be on disk three times (source, copy, ``.irpa``) at
    the peak. :func:`source_links` names the links of a saved model.

    Returns the path written. Raises RewriteError when the target directory cannot be written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = to_model(g)
    inits = model.graph.initializer
    has_ext = any(t.data_location == onnx.TensorProto.EXTERNAL for t in inits)
    # the spill file holds what plugins made, not what the source had: it alone does not make the output external
    source_ext = any(t.data_location == onnx.TensorProto.EXTERNAL and not spill.is_spilled(t, g.values[t.name].base_dir)
                     for t in inits)
    total = sum(tensor_nbytes(t) for t in inits)
    use_ext = external if external is not None else (source_ext or total > _PROTOBUF_LIMIT // 2)
    if not use_ext:
        if has_ext:  # forced inline: read the external tensors
            for k, t in enumerate(inits):
                if t.data_location == onnx.TensorProto.EXTERNAL:
                    inits[k].CopyFrom(onnx.numpy_helper.from_array(g.values[t.name].const(), t.name))
        onnx.save(model, str(path))
        return path
    data_name = path.name + ".data"
    fd, tmp_data = tempfile.mkstemp(dir=path.parent, prefix=".rewrite-", suffix=".data")
    try:
        _write_external(g, model, path, data_name, fd, total, link_source)
        shutil.move(tmp_data, path.parent / data_name)
        if rebase_spilled:
            _rebase_spilled(g, model, str(path.parent))
    except OSError as e:  # a full disk, mostly: one line, not a traceback from inside the copy
        free = shutil.disk_usage(path.parent).free
        raise RewriteError(f"cannot write {path} and its {total / 1e9:.2f} GB of external data ({e.strerror}; "
                           f"{free / 1e9:.2f} GB free there)") from e
    finally:
        if os.path.exists(tmp_data):
            os.unlink(tmp_data)
    return path


def _rebase_spilled(g: Graph, saved: onnx.ModelProto, folder: str) -> None:
    """Point ``g``'s spilled initializers at their external copies in ``saved`` (written to ``folder``) and give the
    spill file's ranges back."""
    written = {t.name: t for t in saved.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    for name in g.initializers:
        v = g.values[name]
        if name in written and spill.is_spilled(v.initializer, v.base_dir):
            t = onnx.TensorProto()
            t.CopyFrom(written[name])
            v.initializer, v.base_dir = t, folder
    g.release_spilled()


def copy_span(path: str, offset: int, length: int, out, name: str) -> None:
    """Stream ``length`` bytes of the file ``path`` from ``offset`` into the open binary file ``out``, 64 MiB at a
    time (``name``: the tensor they are, for the error).

    Raises:
        RewriteError: the file ends before ``offset + length``.
    """
    with open(path, "rb") as f:
        f.seek(offset)
        while length > 0:
            chunk = f.read(min(length, 64 << 20))
            if not chunk:
                raise RewriteError(f"external data of '{name}' ends early in {path}")
            out.write(chunk)
            length -= len(chunk)


def point_external(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make ``t`` an external-data tensor of ``length`` bytes at ``offset`` in the file ``location`` (relative to
    its model's folder), its inline data cleared (onnx's set_external_data refuses tensors without raw_data)."""
    clear_tensor_data(t)
    del t.external_data[:]
    for key, val in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, val
    t.data_location = onnx.TensorProto.EXTERNAL


_SOURCE_LINK = ".source{}.data"  #: `save`'s links to source data files: ``<model file name>.source<k>.data``


def source_links(model_path: Path, locations) -> set[str]:
    """Those of ``locations`` (external-data locations of the model at ``model_path``) that are links
    :func:`save` made with ``link_source`` to a source model's data file."""
    prefix, suffix = Path(model_path).name + ".source", ".data"
    return {loc for loc in locations
            if loc.startswith(prefix) and loc.endswith(suffix) and loc[len(prefix):-len(suffix)].isdigit()}


def _link(source: str, folder: Path, name: str) -> bool:
    """Make ``folder/name`` a hard link to the file ``source``, or a symbolic link where a hard link cannot be made
    (another file system, ``fs.protected_hardlinks``); False where neither can (then the caller copies)."""
    dst = folder / name
    dst.unlink(missing_ok=True)
    try:
        os.link(source, dst)
    except OSError:
        try:
            os.symlink(os.path.abspath(source), dst)
        except OSError:
            return False
    return True


def _write_external(g: Graph, model: onnx.ModelProto, path: Path, data_name: str, fd: int, total: int,
                    link_source: Callable[[onnx.TensorProto], bool] | None = None) -> None:
    """`save`'s external-data branch: stream every large tensor into the open file ``fd`` (named ``data_name``
    once moved beside ``path``), point ``model``'s initializers at it, and write ``path``. With ``link_source``,
    tensors in a source model's data file are pointed at a link to that file instead (:func:`save`)."""
    inits = model.graph.initializer
    links: dict[str, str | None] = {}  # real path of a source data file -> its link's name
    with os.fdopen(fd, "wb") as out, stage("save", total=total, unit="B") as advance:
        for t in inits:
            advance(tensor_nbytes(t))
            src = g.values[t.name]
            if t.data_location == onnx.TensorProto.EXTERNAL:
                location, off, length = spill.external_info(t)
                if (link_source is not None and length is not None and not spill.is_spilled(t, src.base_dir)
                        and link_source(t)):
                    real = os.path.realpath(os.path.join(src.base_dir, location))
                    if real not in links:  # None where no link can be made there: the tensor is copied below
                        name = path.name + _SOURCE_LINK.format(len(links))
                        links[real] = name if _link(real, path.parent, name) else None
                    if links[real] is not None:
                        point_external(t, links[real], off, length)
                        continue
                length = length or 0
                start = out.tell()
                copy_span(os.path.join(src.base_dir, location), off, length, out, t.name)
            elif t.ByteSize() >= EXTERNAL_MIN_BYTES and t.HasField("raw_data"):
                start = out.tell()
                out.write(t.raw_data)
                length = len(t.raw_data)
            else:
                continue
            point_external(t, data_name, start, length)
            pad = (-out.tell()) % 64  # keep tensors 64-byte aligned for mmap users
            out.write(b"\0" * pad)
    onnx.save(model, str(path))
