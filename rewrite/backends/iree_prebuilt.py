"""An IREE output folder whose module was compiled on another machine: ``rewrite apply --module-from FOLDER``.

A machine without the IREE compiler (a GPU host that only has ``iree-base-runtime``) cannot import or compile,
but it can run the plugins and write the weights. A module compiled elsewhere from the same rewritten graph
refers to its weights by parameter key only (``#stream.parameter.named<"model"::"key">``), so it runs on weights
written here, as long as the graph is the same:

* when a folder is compiled, the backend records in ``params.json`` the parameter key of every externalized
  initializer (the importer's own names, :attr:`~rewrite.backends.iree_toolchain.ImportResult.param_keys`), the
  parameter threshold and the :func:`graph_digest` of the rewritten ``model.onnx``;
* :func:`reuse_module` checks that this machine's rewritten graph has the same digest, writes the ``.irpa`` from
  this machine's initializers under those keys, and takes the ``.vmfb`` and the compiled interface (entry
  function, arguments, results, module state, kernel objects) from the compiled folder.

Weights are not compared, only their names, shapes and element types: the point is to write weights that are too
large to carry (a model regenerated from a seed on the target machine, ``examples/seeded_weights.py``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import onnx

from rewrite.backends.base import Manifest
from rewrite.errors import BackendError

PARAMS_INDEX = "params.json"  #: file of a compiled iree folder: parameter keys, threshold, graph digest
_FORMAT = "rewrite-params/1"


def graph_digest(onnx_path: Path, param_threshold: int) -> str:
    """SHA-256 of what a compiled module depends on in ``onnx_path``: the graph (nodes, attributes, inputs,
    outputs, value_info) and every initializer's name, dims and element type; the values only of initializers
    below ``param_threshold`` elements (the importer inlines those into the module as constants). The values of
    the externalized ones are left out: they live in the ``.irpa``, which the module reads at run time.

    Raises:
        BackendError: ``onnx_path`` cannot be read.
    """
    from onnx.external_data_helper import load_external_data_for_tensor

    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except (OSError, DecodeError) as e:
        raise BackendError(f"{onnx_path}: cannot read it for its graph digest ({e})") from e
    for t in model.graph.initializer:
        elements = 1
        for d in t.dims:
            elements *= d
        if elements < param_threshold:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                load_external_data_for_tensor(t, str(onnx_path.parent))
                t.data_location = onnx.TensorProto.DEFAULT
                del t.external_data[:]
        else:
            t.ClearField("raw_data")
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
    # value_info is a set of type annotations to the importer: its order does not change the module
    vis = sorted(model.graph.value_info, key=lambda v: v.name)
    del model.graph.value_info[:]
    model.graph.value_info.extend(vis)
    return hashlib.sha256(model.graph.SerializeToString(deterministic=True)).hexdigest()


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
    if data.get("format") != _FORMAT:
        raise BackendError(f"--module-from {compiled}: {PARAMS_INDEX} has format {data.get('format')!r}, expected {_FORMAT!r}")
    return data


def reuse_module(onnx_path: Path, folder: Path, manifest: Manifest, compiled: Path, *, stateful: bool,
                 cuda_sm: str | None) -> tuple[dict[str, tuple[int, int]], Path]:
    """Fill ``folder`` (holding this machine's rewritten ``onnx_path``) with the module compiled in ``compiled``.

    Writes ``model.irpa`` from ``onnx_path``'s initializers under the compiled module's parameter keys, copies
    the ``.vmfb`` (and the MLIR, compile log and kernel objects when present) and fills ``manifest``'s compiled
    interface from the compiled folder's manifest.

    Returns:
        (initializer name -> (offset, length) of its bytes in the ``.irpa``, the ``.irpa`` path), for
        :func:`rewrite.backends.iree.share_params`.

    Raises:
        BackendError: ``compiled`` is not a compiled iree folder for ``manifest.target``; it was compiled with
            other options (``--stateful``, ``--cuda-sm``); its graph digest differs from this one's (other
            model, plugins, plugin options or version); an initializer it names is missing here.
    """
    from rewrite.backends.iree_import import save_params

    compiled = Path(compiled)
    theirs = Manifest.read(compiled)
    where = f"--module-from {compiled}"
    if theirs.backend != "iree" or theirs.target != manifest.target or "vmfb" not in theirs.files:
        raise BackendError(f"{where}: a {theirs.backend}/{theirs.target} folder; expected a compiled iree/{manifest.target} one")
    if bool(theirs.state) != stateful:
        raise BackendError(f"{where}: compiled {'with' if theirs.state else 'without'} --stateful; apply here "
                           f"{'with' if theirs.state else 'without'} it too")
    if cuda_sm is not None and theirs.target_options.get("cuda_sm") != cuda_sm:
        raise BackendError(f"{where}: compiled for {theirs.target_options.get('cuda_sm')}, not --cuda-sm {cuda_sm}")
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
        raise BackendError(f"{where}: parameter(s) {', '.join(missing[:4])} are not initializers of {onnx_path}")
    params_path = folder / "model.irpa"
    spans = {}
    if keys:
        spans = {k: (int(o), int(n)) for k, (o, n) in
                 save_params(keys, initializers, str(onnx_path.parent), str(params_path)).items()}
    for role in ("vmfb", "mlir", "compile_log"):
        name = theirs.files.get(role)
        if name and (compiled / name).is_file():
            shutil.copyfile(compiled / name, folder / name)
            manifest.files[role] = name
    if "vmfb" not in manifest.files:
        raise BackendError(f"{where}: its {theirs.files['vmfb']} is missing")
    manifest.kernel_objects = []  # those present (the module holds their code: they are not needed to run it)
    for rel in theirs.kernel_objects:
        if (compiled / rel).is_file():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(compiled / rel, folder / rel)
            manifest.kernel_objects.append(rel)
    manifest.entry_function = theirs.entry_function
    manifest.inputs, manifest.outputs, manifest.state = theirs.inputs, theirs.outputs, theirs.state
    manifest.target_options = dict(theirs.target_options)
    shutil.copyfile(compiled / PARAMS_INDEX, folder / PARAMS_INDEX)
    manifest.files["param_index"] = PARAMS_INDEX
    if keys:
        manifest.files["params"] = params_path.name
    return spans, params_path
