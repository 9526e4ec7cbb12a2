"""The ``ort`` backend: the rewritten graph as an ONNX file run by ONNX Runtime.

Abstract ops that plugins create are lowered by their plugin's ORT lowering (contrib ops such as
com.microsoft QMoE) before the file is written, and dense blocked 4-bit DequantizeLinear -> MatMul pairs become
com.microsoft MatMulNBits (:mod:`rewrite.backends.ort_matmul_nbits`); everything else is standard ONNX.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort

from rewrite.backends.base import Manifest, check_feeds
from rewrite.backends.ort_matmul_nbits import lower_matmul_nbits
from rewrite.core import onnx_io
from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.feeds import input_specs, specs_of
from rewrite.core.interface import DecoderInterface
from rewrite.core.ir import Graph
from rewrite.core.shapes import SKELETON_MAX_BYTES
from rewrite.core.stages import stage
from rewrite.errors import BackendError, RewriteError


#: ORT graph optimization levels by name. "basic" keeps the graph's exact semantics; "all" fuses weight-only
#: QDQ MatMuls (per-tensor, per-channel and blocked 4- and 8-bit DequantizeLinear->MatMul) into MatMulNBits
#: with the accuracy level of the session config entry ``session.qdq_matmulnbits_accuracy_level``, by default
#: 4, which quantizes activations to int8 (0.4-0.8 % relative error). References for verification use "basic".
OPT_LEVELS = {
    "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}

#: the session an ``ort`` output folder runs with (recorded in its manifest): every optimization, with the
#: MatMulNBits that ORT fuses from QDQ MatMuls keeping float activations (accuracy level 0), so the folder
#: computes what ``verify`` checked (measured: 0.4-0.7 % relative error at the default level 4, 0 at level 0)
FOLDER_SESSION = {"optimize": "all", "config": {"session.qdq_matmulnbits_accuracy_level": "0"}}

#: execution providers by target, in ORT's priority order (nodes the CUDA EP lacks a kernel for run on CPU)
PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}

#: sessions of ``--target cuda`` folders: the "basic" level (exact graph semantics), since the fusions of the
#: higher levels on the CUDA EP are not what ``verify`` checks on a CPU machine
CUDA_FOLDER_SESSION = {"optimize": "basic", "config": {}}


def folder_session(target: str) -> dict:
    """The session (``optimize``, ``config``, ``providers``) a folder for ``target`` records and runs with."""
    base = CUDA_FOLDER_SESSION if target == "cuda" else FOLDER_SESSION
    return {"optimize": base["optimize"], "config": dict(base["config"]), "providers": list(PROVIDERS[target])}


#: session config entry that keeps initializers as loaded: ONNX Runtime otherwise copies the weights of
#: MatMulNBits, QMoE and MatMul into prepacked buffers (anonymous memory as large as the weights; measured on the
#: full Qwen3-30B-A3B folder: 17.8 GB with it, 1.5 GB without, at 10 times the time per call)
NO_PREPACKING = {"session.disable_prepacking": "1"}


def ort_session(model_path: str | Path, *, threads: int = 0, optimize: str = "all",
                config: dict[str, str] | None = None, providers: list[str] | None = None) -> ort.InferenceSession:
    """An InferenceSession at optimization level ``optimize`` (see :data:`OPT_LEVELS`) with session config
    entries ``config`` (ORT's ``SessionOptions.add_session_config_entry``; :data:`NO_PREPACKING` keeps external
    weights memory-mapped) on ``providers`` (default CPU).

    Raises BackendError with ORT's first message line on failure, naming an unknown level, or naming an
    execution provider this onnxruntime build lacks (the CUDA EP needs onnxruntime-gpu)."""
    if optimize not in OPT_LEVELS:
        raise BackendError(f"{model_path}: ONNX Runtime optimization level {optimize!r}, expected one of {', '.join(OPT_LEVELS)}")
    providers = list(providers or PROVIDERS["cpu"])
    missing = [p for p in providers if p not in ort.get_available_providers()]
    if missing:
        raise BackendError(f"{model_path}: needs ONNX Runtime's {missing[0]}, which this onnxruntime lacks (it has "
                           f"{', '.join(ort.get_available_providers())}); CUDA needs the onnxruntime-gpu package")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    so.graph_optimization_level = OPT_LEVELS[optimize]
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, str(value))
    try:
        session = ort.InferenceSession(str(model_path), so, providers=providers)
    except Exception as e:  # onnxruntime raises its own exception types
        raise BackendError(f"{model_path}: ONNX Runtime cannot load it: {str(e).splitlines()[0][:300]}") from e
    if session.get_providers()[0] != providers[0]:  # ORT falls back to CPU with only a warning
        raise BackendError(f"{model_path}: ONNX Runtime could not start {providers[0]} (it runs on "
                           f"{', '.join(session.get_providers())}); check the GPU, the CUDA libraries (import torch first)")
    return session


class OrtRunner:
    """Runs an ONNX file on ONNX Runtime (CPU execution provider unless ``providers`` says otherwise)."""

    def __init__(self, model_path: Path, *, threads: int = 0, optimize: str = "all",
                 decoder: DecoderInterface | None = None, config: dict[str, str] | None = None,
                 providers: list[str] | None = None):
        self.path = model_path
        self.session = ort_session(model_path, threads=threads, optimize=optimize, config=config, providers=providers)
        self.decoder = decoder
        self.input_specs = input_specs(onnx_io.read_model(model_path))
        self.input_names = [s.name for s in self.input_specs]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        args = check_feeds(self.input_specs, feeds, str(self.path), self.decoder)
        names = outputs or self.output_names
        bf16 = any(a.dtype == ml_dtypes.bfloat16 for a in args.values()) or any(
            o.type == "tensor(bfloat16)" for o in self.session.get_outputs() if o.name in names)
        try:
            if not bf16:
                return dict(zip(names, self.session.run(names, args)))
            # ONNX Runtime's numpy conversion knows no bfloat16: its values go through OrtValues
            res = self.session.run_with_ort_values(names, {n: _ort_value(a) for n, a in args.items()})
        except Exception as e:
            raise BackendError(f"{self.path}: ONNX Runtime failed: {str(e).splitlines()[0][:300]}") from e
        return {n: _from_ort_value(v) for n, v in zip(names, res)}


def _ort_value(a: np.ndarray) -> ort.OrtValue:
    """An OrtValue of ``a``; a bfloat16 array (ml_dtypes) as its bits, typed BFLOAT16."""
    a = np.require(a, requirements="C")  # (not ascontiguousarray: it makes a scalar [1])
    if a.dtype == ml_dtypes.bfloat16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint16), onnx.TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(a)


def _from_ort_value(v: ort.OrtValue) -> np.ndarray:
    """A CPU OrtValue as a numpy array; a bfloat16 tensor copied out as ml_dtypes.bfloat16."""
    if v.data_type() != "tensor(bfloat16)":
        return v.numpy()
    if v.device_name().lower() != "cpu":  # (run_with_ort_values copies outputs to the CPU unless bound elsewhere)
        raise BackendError(f"a bfloat16 output on {v.device_name()}: expected it on the CPU")
    shape = v.shape()
    n = int(np.prod(shape))
    bits = np.frombuffer((ctypes.c_uint16 * n).from_address(v.data_ptr()), np.uint16) if n else np.zeros(0, np.uint16)
    return bits.copy().view(ml_dtypes.bfloat16).reshape(shape)


def lower_abstract_ops(graph: Graph, lowerings: dict) -> int:
    """Replace every abstract op by its ONNX Runtime lowering (``lowerings``: op_type -> ``fn(graph, node)``, see
    :mod:`rewrite.core.lowering`); returns how many were lowered.

    Raises BackendError naming the node when an op has no lowering."""
    count = 0
    for node in sorted((n for n in graph.nodes.values() if n.domain == DOMAIN), key=lambda n: n.order):
        lower = lowerings.get(node.op_type)
        if lower is None:
            raise BackendError(f"node {node.describe()}: no ONNX Runtime lowering registered for abstract op {node.op_type}")
        try:
            lower(graph, node)
        except RewriteError:
            raise
        except Exception as e:  # a lowering bug must still name the node, not end in a traceback
            raise BackendError(f"node {node.describe()}: ONNX Runtime lowering of {node.op_type} failed: {type(e).__name__}: {e}") from e
        count += 1
        graph.release_spilled()  # layouts a lowering repacked (no snapshot is held while lowering)
    left = [n for n in graph.nodes.values() if n.domain == DOMAIN]
    if left:
        raise BackendError(f"node {left[0].describe()}: still an abstract op after ONNX Runtime lowering")
    return count


#: bytes of weights above which the apply-time load check runs on the weightless skeleton (weights as graph
#: inputs of the same type): a session of the whole model would need memory for all of them
CHECK_WEIGHTS_MAX_BYTES = 2 << 30


def check_loads(graph: Graph, path: Path, session: dict) -> None:
    """Fail at apply time, not at run time, if ONNX Runtime cannot load the folder's model ``path`` (on CPU: this
    machine may have no GPU). Models with more than :data:`CHECK_WEIGHTS_MAX_BYTES` of weights are checked as
    their skeleton (``onnx_io.to_model(skeleton_bytes=...)``): ops, attributes, types and shapes are checked as for
    the whole model; the weights' data is not read (``onnx_io.save`` checked each external span as it copied it).

    Raises:
        BackendError: ORT's first message line.
    """
    weights = sum(onnx_io.tensor_nbytes(graph.values[n].initializer) for n in graph.initializers)
    if weights <= CHECK_WEIGHTS_MAX_BYTES:
        ort_session(path, optimize=session["optimize"], config=session["config"])
        return
    skeleton = path.with_name(".ort-check.onnx")
    try:
        try:
            onnx.save(onnx_io.to_model(graph, skeleton_bytes=SKELETON_MAX_BYTES), str(skeleton))
        except OSError as e:
            raise BackendError(f"{skeleton}: cannot write the load-check skeleton ({e.strerror})") from e
        ort_session(skeleton, optimize=session["optimize"], config=session["config"])
    except BackendError as e:
        raise BackendError(str(e).replace(str(skeleton), str(path))) from None
    finally:
        skeleton.unlink(missing_ok=True)


class OrtBackend:
    name = "ort"
    targets = ("cpu", "cuda")

    def lower(self, graph: Graph, folder: Path, manifest: Manifest, *, options: dict, lowerings: dict) -> None:
        """``lowerings``: op_type -> ORT lowering function for ``manifest.target``."""
        lower_abstract_ops(graph, lowerings)
        if options.get("ort_matmul_nbits", True):  # backend option: keep DequantizeLinear->MatMul when False
            lower_matmul_nbits(graph)  # dense 4-bit DequantizeLinear -> MatMul: ORT runs that pair unfused
            graph.release_spilled()
        path = folder / manifest.model
        onnx_io.save(graph, path)
        model = onnx_io.to_model(graph)
        manifest.inputs = [s.to_json() for s in input_specs(model)]
        manifest.outputs = [s.to_json() for s in specs_of(model.graph.output)]
        manifest.session = folder_session(manifest.target)
        with stage("ort session check"):
            check_loads(graph, path, manifest.session)

    def load(self, folder: Path, manifest: Manifest, *, low_memory: bool = False) -> OrtRunner:
        """The folder's model in the session its manifest records (:data:`FOLDER_SESSION` when it records none);
        ``low_memory`` adds :data:`NO_PREPACKING`."""
        session = manifest.session or FOLDER_SESSION
        config = {**session.get("config", {}), **(NO_PREPACKING if low_memory else {})}
        return OrtRunner(folder / manifest.model, decoder=manifest.decoder_interface, optimize=session.get("optimize", "all"),
                         config=config, providers=session.get("providers"))
