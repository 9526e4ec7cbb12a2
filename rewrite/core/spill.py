"""Initializer data outside memory: external-data tensors read through memory maps, large new tensors spilled to disk.

A full-size MoE model is tens of gigabytes of weights on a machine with less memory than that. The graph IR keeps
every large tensor in a file and holds only its TensorProto with an external-data reference (ONNX IR spec,
"External Tensor Data"):

- tensors of the source model stay in the source's data files and are read through ``np.memmap`` on demand
  (`read_external`), never cached, so the pages a plugin touched are released when it drops the array;
- tensors a plugin creates of `SPILL_MIN_BYTES` or more are appended to one spill file per process
  (`spill_tensor`) as they are made, and the in-memory copy is dropped;
- the ranges of spilled tensors the graph no longer holds are given back to the file system (`release_unreferenced`,
  called where no snapshot of the graph can bring them back: after each plugin and each lowered op), so the file
  holds about the live tensors, not every tensor ever made (the full Qwen3-30B-A3B: two repackings of 14.5 GB of
  experts).

The spill folder (``rewrite-spill-<pid>-*`` in `spill_folder_parent`) is removed when the process exits (normally,
on an exception, or on SIGTERM/SIGHUP, which the command line turns into SystemExit); the folder of a process killed
outright is removed by the next process that spills. `onnx_io.save` stream-copies spilled tensors into the output's
data file.
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
#: element types whose ONNX bytes are not numpy's (4-bit codes two per byte, strings)
_PACKED = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4, onnx.TensorProto.FLOAT4E2M1, onnx.TensorProto.STRING)

_lock = threading.Lock()
_spill: dict[str, object] = {}


def spill_folder_parent() -> str:
    """Where spill folders are made: ``$REWRITE_SPILL_DIR``, else the system's temporary directory (on a machine
    whose ``/tmp`` is in memory, tmpfs, set it to a disk)."""
    return os.environ.get("REWRITE_SPILL_DIR") or tempfile.gettempdir()


def _spill_file() -> tuple[Path, object]:
    """(path, open binary file) of this process's spill file, created on first use (and stale folders of processes
    that died without cleaning up, SIGKILL or out of memory, removed).

    Raises:
        RewriteError: the folder or file cannot be made.
    """
    with _lock:
        if _spill.get("pid") != os.getpid():  # a forked child writes its own file
            parent = spill_folder_parent()
            _remove_stale(parent)
            try:
                folder = Path(tempfile.mkdtemp(prefix=f"rewrite-spill-{os.getpid()}-", dir=parent))
                path = folder / "spill.bin"
                f = open(path, "w+b")  # noqa: SIM115 - closed at exit
            except OSError as e:
                raise RewriteError(f"cannot create a spill file in {parent} ({e.strerror}); set REWRITE_SPILL_DIR "
                                   "to a folder with free space") from e
            _spill.update(pid=os.getpid(), folder=folder, path=path, file=f, ranges={})
            atexit.register(_remove, folder, os.getpid())
        return _spill["path"], _spill["file"]


def _remove_stale(parent: str) -> None:
    for d in Path(parent).glob("rewrite-spill-*-*"):
        try:
            pid = int(d.name.split("-")[2])
        except (IndexError, ValueError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:  # another user's live process
            pass


def _remove(folder: Path, pid: int) -> None:
    if os.getpid() != pid:
        return
    try:
        f = _spill.get("file")
        if f is not None and _spill.get("folder") == folder:
            f.close()
    except OSError:  # a full disk fails the close too; the folder goes all the same
        pass
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give ``[offset, offset + length)`` of the file back to the file system (Linux ``fallocate`` with
    ``PUNCH_HOLE | KEEP_SIZE``: reads return zeros); False where that is not available."""
    fallocate = _spill.get("fallocate")
    if fallocate is None:
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fallocate = libc.fallocate
            fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong)
        except (OSError, AttributeError):
            fallocate = False
        _spill["fallocate"] = fallocate
    return bool(fallocate) and fallocate(fd, 0x01 | 0x02, offset, length) == 0


def release_unreferenced(live: list[tuple[onnx.TensorProto, str]]) -> int:
    """Punch out the spill file's ranges that no tensor of ``live`` (``(TensorProto, base_dir)`` pairs: every
    initializer the caller still holds) refers to; returns the bytes released.

    Call it only where nothing else can still read a dropped tensor: a graph snapshot taken before the tensor was
    dropped would bring it back with its bytes gone (the rewrite driver restores snapshots when a plugin fails).
    """
    ranges = _spill.get("ranges")
    if not ranges or _spill.get("pid") != os.getpid():
        return 0
    held = {external_info(t)[1] for t, base_dir in live if is_spilled(t, base_dir)}
    released = 0
    with _lock:
        f = _spill["file"]
        for offset in [o for o in ranges if o not in held]:
            length = ranges.pop(offset)
            if _punch_hole(f.fileno(), offset, length):
                released += length
    return released


def _append(name: str, data) -> tuple[Path, int, int]:
    """Append ``data`` (bytes-like) to the spill file at a page boundary; (path, offset, length)."""
    path, f = _spill_file()
    view = memoryview(data).cast("B")
    with _lock:
        try:
            f.seek(0, os.SEEK_END)
            start = f.tell()
            start += (-start) % _ALIGN
            f.seek(start)
            f.write(view)
            f.flush()
            _spill.setdefault("ranges", {})[start] = view.nbytes
        except OSError as e:
            raise RewriteError(f"initializer '{name}': cannot write {view.nbytes} bytes to the spill file {path} "
                               f"({e.strerror}); set REWRITE_SPILL_DIR to a folder with free space") from e
    return path, start, view.nbytes


def _external_proto(name: str, data_type: int, dims, path: Path, start: int, length: int) -> onnx.TensorProto:
    out = onnx.TensorProto(name=name, data_type=data_type, dims=dims)
    for key, val in (("location", path.name), ("offset", str(start)), ("length", str(length))):
        entry = out.external_data.add()
        entry.key, entry.value = key, val
    out.data_location = onnx.TensorProto.EXTERNAL
    return out


def spill_array(name: str, array: np.ndarray) -> tuple[onnx.TensorProto, str] | None:
    """Write ``array``'s bytes to the spill file without another copy in memory, for element types whose numpy
    bytes are ONNX's raw data (not 4-bit, string or object); None for others (use `spill_tensor`).

    Returns:
        (an external-data TensorProto named ``name``, the folder its ``location`` is relative to).
    """
    try:
        data_type = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
    except (KeyError, TypeError, ValueError):
        return None
    if data_type in _PACKED or array.dtype.hasobject or array.dtype.byteorder == ">":
        return None
    path, start, length = _append(name, np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    return _external_proto(name, data_type, array.shape, path, start, length), str(path.parent)


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
    path, start, length = _append(tensor.name, tensor.raw_data)
    # a new message, not CopyFrom + ClearField: protobuf's arena would keep the copied raw_data until the message dies
    out = _external_proto(tensor.name, tensor.data_type, tensor.dims, path, start, length)
    out.doc_string = tensor.doc_string
    out.metadata_props.extend(tensor.metadata_props)
    return out, str(path.parent)


def is_spilled(tensor: onnx.TensorProto, base_dir: str) -> bool:
    """Whether ``tensor`` refers to this process's spill file (not to a source model's data)."""
    folder = _spill.get("folder")
    return bool(folder is not None and tensor.data_location == onnx.TensorProto.EXTERNAL and base_dir
                and Path(base_dir) == folder)


def external_info(tensor: onnx.TensorProto) -> tuple[str, int, int | None]:
    """(location, offset, length) of an external-data tensor; without a ``length`` key (optional in ONNX) the
    length its dims and element type need, or None for 4-bit and string types."""
    info = {e.key: e.value for e in tensor.external_data}
    length = info.get("length")
    if length is None and tensor.data_type not in _PACKED:
        try:
            item = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
            length = int(np.prod(tensor.dims, dtype=np.int64)) * item
        except (KeyError, TypeError, ValueError):
            length = None
    elif length is None:
        n = int(np.prod(tensor.dims, dtype=np.int64))
        length = (n + 1) // 2 if tensor.data_type != onnx.TensorProto.STRING else None
    return info["location"], int(info.get("offset", 0)), None if length is None else int(length)


def inline_external(tensor: onnx.TensorProto, base_dir: str) -> None:
    """Move an external-data ``tensor``'s bytes (location relative to ``base_dir``) into its ``raw_data`` (ONNX
    external data holds exactly the raw_data bytes: onnx docs, "External Data"), read by offset and length with a
    plain file read: onnx's own reader refuses files with several hard links or behind a symbolic link, which the
    IREE backend's links to a source data file are (``onnx_io.save``'s ``link_source``).

    Raises:
        RewriteError: the file is missing or ends before the tensor's bytes do, or the tensor's length is unknown
            (a string tensor without a ``length`` key).
    """
    location, offset, length = external_info(tensor)
    if length is None:
        raise RewriteError(f"initializer '{tensor.name}': external data without a length ({location})")
    path = os.path.join(base_dir, location)
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
    except OSError as e:
        raise RewriteError(f"initializer '{tensor.name}': cannot read {path} ({e.strerror or e})") from e
    if len(data) != length:
        raise RewriteError(f"initializer '{tensor.name}': {path} ends before byte {offset + length}")
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.DEFAULT
    tensor.raw_data = data


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
    packed = tensor.data_type in _PACKED
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
