"""Initializer data outside memory: external-data tensors read through memory maps, large new tensors spilled to disk.

A full-size MoE model is tens of gigabytes of weights on a machine with less memory than that. The graph IR keeps
every large tensor in a file and holds only its TensorProto with an external-data reference (ONNX IR spec,
"External Tensor Data"):

- tensors of the source model stay in the source's data files and are read through ``np.memmap`` on demand
  (`read_external`), never cached, so the pages a plugin touched are released when it drops the array;
- tensors a plugin creates of `SPILL_MIN_BYTES` or more are appended to one spill file per process
  (`spill_tensor`) as they are made, and the in-memory copy is dropped.

The spill folder is removed when the process exits (normally, on an exception, or on SIGTERM/SIGHUP, which the
command line turns into SystemExit); `onnx_io.save` stream-copies spilled tensors into the output's data file.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from rewrite.errors import RewriteError

#: bytes; a tensor a plugin creates at least this large goes to the spill file instead of memory
SPILL_MIN_BYTES = 16 << 20
_ALIGN = 4096  # page-aligned tensors: memory maps of them start on a page

_lock = threading.Lock()
_spill: dict[str, object] = {}


def _spill_file() -> tuple[Path, object]:
    """(path, open binary file) of this process's spill file, created on first use."""
    with _lock:
        if _spill.get("pid") != os.getpid():  # a forked child writes its own file
            folder = Path(tempfile.mkdtemp(prefix="rewrite-spill-"))
            path = folder / "spill.bin"
            _spill.update(pid=os.getpid(), folder=folder, path=path, file=open(path, "w+b"))  # noqa: SIM115
            atexit.register(_remove, folder, os.getpid())
        return _spill["path"], _spill["file"]


def _remove(folder: Path, pid: int) -> None:
    if os.getpid() == pid:
        f = _spill.get("file")
        if f is not None and _spill.get("folder") == folder:
            f.close()
        shutil.rmtree(folder, ignore_errors=True)


def spill_tensor(tensor: onnx.TensorProto) -> tuple[onnx.TensorProto, str]:
    """Move ``tensor``'s ``raw_data`` into the spill file.

    Returns:
        (a TensorProto of the same name, type and dims whose data is an external reference into the spill file,
        the folder its ``location`` is relative to). A tensor without ``raw_data`` is returned unchanged with "".

    Raises:
        RewriteError: the spill file cannot be written (disk full: the message names the folder).
    """
    if not tensor.HasField("raw_data"):
        return tensor, ""
    path, f = _spill_file()
    with _lock:
        try:
            f.seek(0, os.SEEK_END)
            start = f.tell()
            start += (-start) % _ALIGN
            f.seek(start)
            f.write(tensor.raw_data)
            f.flush()
        except OSError as e:
            raise RewriteError(f"initializer '{tensor.name}': cannot write {len(tensor.raw_data)} bytes to the spill "
                               f"file {path} ({e.strerror})") from e
    # a new message, not CopyFrom + ClearField: protobuf's arena would keep the copied raw_data until the message dies
    out = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims, doc_string=tensor.doc_string)
    out.metadata_props.extend(tensor.metadata_props)
    for key, val in (("location", path.name), ("offset", str(start)), ("length", str(len(tensor.raw_data)))):
        entry = out.external_data.add()
        entry.key, entry.value = key, val
    out.data_location = onnx.TensorProto.EXTERNAL
    return out, str(path.parent)


def is_spilled(tensor: onnx.TensorProto, base_dir: str) -> bool:
    """Whether ``tensor`` refers to this process's spill file (not to a source model's data)."""
    folder = _spill.get("folder")
    return (folder is not None and tensor.data_location == onnx.TensorProto.EXTERNAL and base_dir
            and Path(base_dir) == folder)


def external_info(tensor: onnx.TensorProto) -> tuple[str, int, int | None]:
    """(location, offset, length or None) of an external-data tensor."""
    info = {e.key: e.value for e in tensor.external_data}
    length = info.get("length")
    return info["location"], int(info.get("offset", 0)), None if length is None else int(length)


def read_external(tensor: onnx.TensorProto, base_dir: str) -> np.ndarray:
    """The data of an external-data ``tensor`` (location relative to ``base_dir``): a copy-on-write memory map for
    byte-aligned element types (writes stay private to the process), else (4-bit and string types) read whole.

    Raises:
        RewriteError: the file is missing or shorter than the tensor needs.
    """
    location, offset, length = external_info(tensor)
    path = os.path.join(base_dir, location)
    dims = tuple(int(d) for d in tensor.dims)
    try:
        np_dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
    except (KeyError, TypeError, ValueError):
        np_dtype = None
    packed = tensor.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4, onnx.TensorProto.FLOAT4E2M1,
                                  onnx.TensorProto.STRING)
    try:
        if np_dtype is None or packed:
            return numpy_helper.to_array(tensor, base_dir)
        need = int(np.prod(dims, dtype=np.int64)) * np_dtype.itemsize
        if length is not None and length != need:
            raise RewriteError(f"initializer '{tensor.name}': external data length {length} does not fit "
                               f"{dims} of {np_dtype}")
        if os.path.getsize(path) < offset + need:
            raise RewriteError(f"initializer '{tensor.name}': {location} ends before byte {offset + need}")
        if need == 0:
            return np.zeros(dims, np_dtype)
        return np.memmap(path, dtype=np_dtype, mode="c", offset=offset, shape=dims or (1,)).reshape(dims)
    except (OSError, ValueError) as e:
        raise RewriteError(f"initializer '{tensor.name}': cannot read its data ({e})") from e
