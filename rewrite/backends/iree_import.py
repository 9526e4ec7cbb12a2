"""IREE's ONNX import, printed with locations: ``python -m rewrite.backends.iree_import`` takes the arguments of
``python -m iree.compiler.tools.import_onnx`` that :func:`rewrite.backends.iree_toolchain.import_onnx` passes
(an output file; with ``--externalize-params``, ``--save-params-to``) and runs the same steps (shape inference,
import, parameter externalization to an ``.irpa``, verification), but writes the module with its debug info and
writes the ``.irpa`` from the external data file to file (`save_params`) instead of from arrays in memory. The importer names
every op's location after its ONNX node, so the patched module keeps them and iree-compile's errors say which
node an op came from instead of a line of the MLIR file.

Run as a subprocess by :func:`rewrite.backends.iree_toolchain.import_onnx` (a crash in the MLIR bindings cannot
take the caller down, and the memory of a large model is returned on exit).
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys

import onnx

from rewrite.core.spill import external_info
from rewrite.errors import BackendError


def main(argv: list[str] | None = None) -> int:
    tool = importlib.import_module("iree.compiler.tools.import_onnx.__main__")  # the importer's own steps
    argv = list(sys.argv[1:] if argv is None else argv)
    spans_path = None
    if "--param-spans-to" in argv:  # ours: each initializer's parameter key and where its bytes landed (JSON)
        k = argv.index("--param-spans-to")
        spans_path = argv[k + 1]
        del argv[k:k + 2]
    args = tool.parse_arguments(argv)
    model_proto = tool.load_onnx_model(args)
    context = tool.Context()
    model_info = tool.onnx_importer.ModelInfo(model_proto)
    m = model_info.create_module(context=context).operation
    if args.externalize_params:
        param_data = tool.ParamData(
            param_bit_threshold=None if args.param_gb_threshold is None else int(args.param_gb_threshold * 8 * 10**9),
            num_elements_threshold=args.num_elements_threshold,
            params_scope=args.params_scope,
            data_dir=str(args.data_dir) if args.data_dir is not None else str(args.input_file.parent),
            param_path=str(args.save_params_to) if args.save_params_to else None,
            input_index_threshold=args.externalize_inputs_threshold,
        )
        imp = tool.IREENodeImporter.define_function(model_info.main_graph, m, param_data)
    else:
        imp = tool.onnx_importer.NodeImporter.define_function(model_info.main_graph, m)
    imp.import_all()
    m.verify()
    with open(args.output_file, "w") as f:
        f.write(m.get_asm(enable_debug_info=True, assume_verified=True))
    if args.externalize_params and args.save_params:
        spans = save_params(imp.globals, imp._gi.initializer_map, param_data.data_dir, param_data.param_path)
        if spans_path is not None:
            with open(spans_path, "w") as f:
                json.dump({"spans": spans, "keys": [list(p) for p in imp.globals]}, f)
    return 0


#: element types whose ONNX raw bytes are the parameter's bytes (the importer writes numpy_helper.to_array's)
RAW_PARAM_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16,
              onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16,
              onnx.TensorProto.INT32, onnx.TensorProto.UINT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT64,
              onnx.TensorProto.BOOL}


def save_params(params: list[tuple[str, str]], initializers: dict[str, onnx.TensorProto], data_dir: str,
                param_path: str) -> dict[str, list[int]]:
    """Write the ``.irpa`` of the externalized initializers, as the importer's ``save_params`` does, without holding
    the weights in memory: each external-data initializer of a plain element type is added as a span of its data
    file (``ParameterIndex.add_from_file_handle``) and the runtime copies it file to file; others (inline or 4-bit)
    are read as arrays.

    Returns:
        ``{initializer name: [offset, length]}`` of the bytes in the ``.irpa`` that are the initializer's raw data
        (its ONNX external-data form; 4-bit types are stored unpacked and left out).

    Raises:
        BackendError: the archive could not be written (a full disk, mostly; a missing folder), with the bytes it
            needs and the space left there; a partial archive is removed.

    Args:
        params: (initializer name, parameter key) pairs, the importer's ``globals``.
        initializers: initializer protos by name (external data not loaded).
        data_dir: folder the external-data locations are relative to.
        param_path: the ``.irpa`` to write.
    """
    import os

    import iree.runtime as rt
    from onnx import numpy_helper

    index = rt.ParameterIndex()
    fds: dict[str, int] = {}
    total = 0  # bytes of parameter data the archive holds (its headers and alignment aside)
    try:
        for name, key in params:
            t = initializers[name]
            if t.data_location == onnx.TensorProto.EXTERNAL and t.data_type in RAW_PARAM_TYPES:
                location, offset, length = external_info(t)
                path = os.path.join(data_dir, location)
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                index.add_from_file_handle(key, rt.FileHandle.wrap_fd(fds[path]), length, offset)
                total += length
            else:
                array = numpy_helper.to_array(t, base_dir=data_dir)
                index.add_buffer(key, array)
                total += array.nbytes
        try:
            index.create_archive_file(param_path)
        except (RuntimeError, ValueError) as e:  # a full disk, mostly: one line, not the runtime's traceback
            if os.path.exists(param_path):  # a partial archive
                os.unlink(param_path)
            folder = os.path.dirname(os.path.abspath(param_path))
            while not os.path.isdir(folder):  # the space of the disk it would be on
                folder = os.path.dirname(folder)
            free = shutil.disk_usage(folder).free
            why = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            raise BackendError(f"cannot write the parameter archive {param_path} ({why}; it needs {total / 1e9:.2f} GB, "
                               f"{free / 1e9:.2f} GB free there)") from None
    finally:
        for fd in fds.values():
            os.close(fd)
    written = rt.ParameterIndex()
    written.load(param_path)
    where = {key: (entry.file_storage[1], entry.length) for key, entry in written.items()}
    return {name: list(where[key]) for name, key in params
            if key in where and initializers[name].data_type in RAW_PARAM_TYPES}


if __name__ == "__main__":
    sys.exit(main())
