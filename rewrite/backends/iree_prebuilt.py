"""An IREE output folder whose module was compiled on another machine: ``rewrite apply --module-from FOLDER``.

A machine without the IREE compiler (a GPU host that only has ``iree-base-runtime``) cannot import or compile,
but it can run the plugins and write the weights. A module compiled elsewhere from the same rewritten graph
refers to its weights by parameter key only (``#stream.parameter.named<"model"::"key">``), so it runs on weights
written here, as long as the graph is the same:

* when a folder is compiled, the backend records in ``params.json`` the parameter key of every externalized
  initializer (the importer's own names, :attr:`~rewrite.backends.iree_toolchain.ImportResult.param_keys`), the
  parameter threshold and the :func:`graph_digest` of the rewritten ``model.onnx``;
* :func:`reuse_module` checks that this machine's rewritten graph has the same digest and that the module was
  compiled with the same options (``--stateful``, the CUDA SM; for llvm-cpu, which builds for the compiling
  machine's CPU, the same CPU model), writes the ``.irpa`` from this machine's initializers under those keys, and
  takes the ``.vmfb`` and the compiled interface (entry function, arguments, results, module state) from the
  compiled folder.

Weights are not compared, only their names, shapes and element types: the point is to write weights that are too
large to carry (a model regenerated from a seed on the target machine, ``examples/seeded_weights.py``).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import onnx

from rewrite.backends.base import Manifest
from rewrite.backends.iree_toolchain import inline_importer_constants
from rewrite.core.onnx_io import clear_tensor_data
from rewrite.errors import BackendError

PARAMS_INDEX = "params.json"  #: file of a compiled iree folder: parameter keys, threshold, graph digest
_FORMAT = "rewrite-params/1"


def graph_digest(onnx_path: Path, param_threshold: int) -> str:
    """SHA-256 of what a compiled module depends on in ``onnx_path``: the graph (nodes, attributes, inputs,
    outputs, value_info in name order), the opset imports, model-local functions, and every initializer's name,
    dims and element type; the values only of initializers
    below ``param_threshold`` elements (the importer inlines those into the module as constants). The values of
    the externalized ones are left out: they live in the ``.irpa``, which the module reads at run time.

    Raises:
        BackendError: ``onnx_path`` cannot be read.
    """
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except (OSError, DecodeError) as e:
        raise BackendError(f"{onnx_path}: cannot read it for its graph digest ({e})") from e
    inline_importer_constants(model, onnx_path.parent, param_threshold)
    for t in model.graph.initializer:
        if math.prod(t.dims) >= param_threshold:
            clear_tensor_data(t)
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
    # value_info is a set of type annotations to the importer: its order does not change the module
    vis = sorted(model.graph.value_info, key=lambda v: v.name)
    del model.graph.value_info[:]
    model.graph.value_info.extend(vis)
    h = hashlib.sha256(model.graph.SerializeToString(deterministic=True))
    for part in (*model.opset_import, *model.functions):  # both change what the importer emits
        h.update(part.SerializeToString(deterministic=True))
    return h.hexdigest()


def host_cpu() -> str:
    """This machine's CPU as /proc/cpuinfo names it (``model name``, else ``platform.processor()``): what an
    llvm-cpu module, built for the compiling machine's CPU, is recorded as compiled for."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_params_index(folder: Path, keys: list[tuple[str, str]], param_threshold: int, digest: str) -> str:
    """Write ``params.json`` into a compiled folder (see the module docstring); returns its file name."""
    data = {"format": _FORMAT, "param_threshold": param_threshold, "graph_digest": digest,
            "keys": [list(k) for k in keys]}
    (folder / PARAMS_INDEX).write_text(json.dumps(data, indent=0) + "\n")
    return PARAMS_INDEX


def read_params_index(compiled: Path) -> dict:
    """The ``params.json`` of a compiled folder.

    Raises:
        BackendError: the folder has none (compiled before the file existed, or not an iree folder) or it is not
            readable.
    """
    p = compiled / PARAMS_INDEX
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise BackendError(f"--module-from {compiled}: no {PARAMS_INDEX} (the folder was not written by "
                           "'rewrite apply --backend iree' of this version; apply there again)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise BackendError(f"--module-from {compiled}: {PARAMS_INDEX} is not readable ({e})") from e
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise BackendError(f"--module-from {compiled}: {PARAMS_INDEX} has format {found!r}, expected {_FORMAT!r}")
    keys = data.get("keys")
    if (not isinstance(data.get("graph_digest"), str) or not isinstance(data.get("param_threshold"), int)
            or not isinstance(keys, list) or not all(isinstance(k, list) and len(k) == 2 for k in keys)):
        raise BackendError(f"--module-from {compiled}: {PARAMS_INDEX} lacks a graph_digest, a param_threshold or "
                           "a list of [initializer, key] pairs")
    return data


def _inside(compiled: Path, rel: str, where: str) -> Path:
    """``compiled / rel`` for a file name the compiled folder's manifest gives; refuses names that leave it."""
    if not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise BackendError(f"{where}: its manifest names the file {rel!r}, which is not inside the folder")
    return compiled / rel


def reuse_module(onnx_path: Path, folder: Path, manifest: Manifest, compiled: Path, *, stateful: bool,
                 cuda_sm: str) -> tuple[dict[str, tuple[int, int]], Path]:
    """Fill ``folder`` (holding this machine's rewritten ``onnx_path``) with the module compiled in ``compiled``.

    Everything is checked before anything is written. Then writes ``model.irpa`` from ``onnx_path``'s initializers
    under the compiled module's parameter keys, copies the ``.vmfb`` (and the kernel objects when present) and fills
    ``manifest``'s compiled interface from the compiled folder's manifest. ``cuda_sm``: the SM this apply would
    compile for (cuda).

    Returns:
        (initializer name -> (offset, length) of its bytes in the ``.irpa``, the ``.irpa`` path), for
        :func:`rewrite.backends.iree.share_params`.

    Raises:
        BackendError: ``compiled`` is not a compiled iree folder for ``manifest.target`` (or has no module, or
            its manifest names files outside it); it was compiled with other options (``--stateful``, the SM of
            ``--cuda-sm``, or, for llvm-cpu, on a machine with another CPU); its ``params.json`` is missing or
            malformed; its graph digest differs from this one's (other model, plugins, plugin options or version);
            an initializer it names is missing here.
    """
    from rewrite.backends.iree_import import save_params

    compiled = Path(compiled)
    theirs = Manifest.read(compiled)
    where = f"--module-from {compiled}"
    if theirs.backend != "iree" or theirs.target != manifest.target:
        raise BackendError(f"{where}: an {theirs.backend}/{theirs.target} folder; expected an iree/{manifest.target} one")
    vmfb = _inside(compiled, theirs.files.get("vmfb", ""), where) if theirs.files.get("vmfb") else None
    if vmfb is None or not vmfb.is_file():
        raise BackendError(f"{where}: has no compiled module ({theirs.files.get('vmfb') or 'no vmfb in its manifest'})")
    if bool(theirs.state) != stateful:
        raise BackendError(f"{where}: compiled {'with' if theirs.state else 'without'} --stateful; apply here "
                           f"{'with' if theirs.state else 'without'} it too")
    if manifest.target == "cuda" and theirs.target_options.get("cuda_sm") != cuda_sm:
        raise BackendError(f"{where}: compiled for {theirs.target_options.get('cuda_sm')}, here for {cuda_sm} "
                           "(--cuda-sm must be the same)")
    cpu = host_cpu()
    if manifest.target == "llvm-cpu" and theirs.target_options.get("host_cpu") != cpu:
        raise BackendError(f"{where}: compiled for the CPU {theirs.target_options.get('host_cpu')!r}, this machine's is "
                           f"{cpu!r} (llvm-cpu modules are built for the compiling machine's CPU)")
    objects = [(rel, _inside(compiled, rel, where)) for rel in theirs.kernel_objects]
    index = read_params_index(compiled)
    ours = graph_digest(onnx_path, int(index["param_threshold"]))
    if ours != index["graph_digest"]:
        raise BackendError(f"{where}: compiled from another rewritten graph (digest {index['graph_digest'][:12]}, "
                           f"here {ours[:12]}); the model, --plugins, --opt, --dim and --max-seq must be the same on "
                           "both machines")
    model = onnx.load(str(onnx_path), load_external_data=False)
    initializers = {t.name: t for t in model.graph.initializer}
    keys = [(name, key) for name, key in index["keys"]]
    missing = [name for name, _ in keys if name not in initializers]
    if missing:
        raise BackendError(f"{where}: parameter(s) {', '.join(missing[:4])} are not initializers of the rewritten graph")
    params_path = folder / "model.irpa"
    spans = {}
    if keys:
        spans = {k: (int(o), int(n)) for k, (o, n) in
                 save_params(keys, initializers, str(onnx_path.parent), str(params_path)).items()}
        manifest.files["params"] = params_path.name
    # only the module: the MLIR and compile log describe the other machine's compile
    shutil.copyfile(vmfb, folder / "model.vmfb")
    manifest.files["vmfb"] = "model.vmfb"
    manifest.kernel_objects = []  # those present (the module holds their code: they are not needed to run it)
    for rel, src in objects:
        if src.is_file():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, folder / rel)
            manifest.kernel_objects.append(rel)
    manifest.entry_function = theirs.entry_function
    manifest.inputs, manifest.outputs, manifest.state = theirs.inputs, theirs.outputs, theirs.state
    manifest.target_options = dict(theirs.target_options)
    shutil.copyfile(compiled / PARAMS_INDEX, folder / PARAMS_INDEX)
    manifest.files["param_index"] = PARAMS_INDEX
    return spans, params_path
