"""IREE's ONNX import, printed with locations: ``python -m rewrite.backends.iree_import`` takes the arguments of
``python -m iree.compiler.tools.import_onnx`` that :func:`rewrite.backends.iree_toolchain.import_onnx` passes
(an output file; with ``--externalize-params``, ``--save-params-to``) and runs the same steps (shape inference,
import, parameter externalization to an ``.irpa``, verification), but writes the module with its debug info. The importer names
every op's location after its ONNX node, so the patched module keeps them and iree-compile's errors say which
node an op came from instead of a line of the MLIR file.

Run as a subprocess by :func:`rewrite.backends.iree_toolchain.import_onnx` (a crash in the MLIR bindings cannot
take the caller down, and the memory of a large model is returned on exit).
"""

from __future__ import annotations

import importlib
import sys


def main(argv: list[str] | None = None) -> int:
    tool = importlib.import_module("iree.compiler.tools.import_onnx.__main__")  # the importer's own steps
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
        imp.save_params()
    return 0


if __name__ == "__main__":
    sys.exit(main())
