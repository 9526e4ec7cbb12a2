"""``rewrite verify``: compare a lowered output folder against the original model on ONNX Runtime CPU.

Errors per output: max absolute error, and relative error = max|got - ref| / max|ref| (a normwise
measure, so near-zero reference elements do not dominate). Tolerances by element type:
:data:`REL_TOL` (float32 1e-4, float16/bfloat16 1e-2), integers and booleans exact.

With ``float32=True`` (``verify --float32-reference``) each float16 output is also compared with the original's
float32 twin (:func:`rewrite.core.widen.widen_float16`: the same model without fp16's rounding): an output beyond
tolerance of the fp16 original still passes when it is within :func:`float32_bound` of the twin: twice the
original's own distance from it, at least the tolerance and at most `FLOAT32_CAP` tolerances. The lowering is then
about as exact as ONNX Runtime's fp16 evaluation of the original, and the difference is most likely rounding the
original amplifies (a near tie, a saturated softmax). Where the original's own distance is not finite (an fp16
overflow) nothing is loosened.

``locate`` exposes every intermediate value the rewritten graph shares (by name) with the original, floats
and integer indices alike, compiles that probe for the same backend, and names the first node in
topological order whose output differs beyond tolerance while all its probed inputs agree: the node
where the backend's result first goes wrong.
"""

from __future__ import annotations

import errno
import gc
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from rewrite.backends import get_backend, load_runner, needs_low_memory
from rewrite.backends.base import Manifest
from rewrite.backends.ort import NO_PREPACKING, OrtRunner
from rewrite.core import onnx_io
from rewrite.core.feeds import make_feeds
from rewrite.core.ir import Graph, dtype_name
from rewrite.core.shapes import infer_shapes
from rewrite.errors import RewriteError
from rewrite.plugins.manager import available_plugins, lowering_registry

REL_TOL = {onnx.TensorProto.FLOAT: 1e-4, onnx.TensorProto.DOUBLE: 1e-7, onnx.TensorProto.FLOAT16: 1e-2, onnx.TensorProto.BFLOAT16: 1e-2}


@dataclass
class Comparison:
    """Error of one tensor against its reference."""

    name: str
    dtype: str
    shape: tuple
    max_abs: float
    max_rel: float
    tol: float
    ok: bool
    mismatched: int = 0  # elements that differ (integer tensors)
    fp32_rel: float | None = None  # max_rel against the original's float32 twin (``float32=True``)
    reference_fp32_rel: float | None = None  # the original's own max_rel against its twin
    fp32_bound: float | None = None  # float32_bound(tol, reference_fp32_rel)

    def line(self) -> str:
        status = "ok  " if self.ok else "FAIL"
        extra = f"  ({self.mismatched} elements differ)" if self.mismatched else ""
        if self.fp32_rel is not None:
            extra += (f"  against float32: max_rel={self.fp32_rel:.3e} (bound {self.fp32_bound:.3e}), the original's "
                      f"{self.reference_fp32_rel:.3e}")
            if self.max_rel > self.tol and self.ok:
                extra += ": passes on the float32 twin"
            if self.reference_fp32_rel > self.tol:
                extra += "; the original itself is beyond tolerance of its float32 twin"
        return f"{status} {self.name:<40} {self.dtype:<8} {str(list(self.shape)):<18} max_abs={self.max_abs:.3e}  max_rel={self.max_rel:.3e}  tol={self.tol:g}{extra}"


#: Reference magnitude below which relative error is measured against this instead (near-zero outputs are
#: compared in absolute terms: tol * 1e-3).
SCALE_FLOOR = 1e-3
#: ``--float32-reference``: the most the float32 twin can loosen a tolerance, in tolerances (a reference farther
#: than that from its own float32 twin vouches for nothing)
FLOAT32_CAP = 5


def compare(name: str, got: np.ndarray, ref: np.ndarray, rtol: float | None = None) -> Comparison:
    """Compare one tensor with its reference.

    Floats: ``max_rel = max|got - ref| / max(max|ref|, SCALE_FLOOR)`` against ``rtol`` (default by dtype,
    :data:`REL_TOL`); NaN matches NaN and an infinity the same infinity. Integers and booleans: exact, with
    the number of differing elements. A shape or dtype-kind mismatch fails with infinite error.
    """
    got, ref = np.asarray(got), np.asarray(ref)
    dt = onnx.helper.np_dtype_to_tensor_dtype(ref.dtype) if ref.dtype != object else 0
    kind = {"b": "b", "i": "i", "u": "i", "f": "f"}

    def kind_of(dtype: np.dtype) -> str | None:  # bfloat16 (ml_dtypes) has numpy kind "V"
        return "f" if dtype.kind == "V" and dtype.itemsize == 2 and "bfloat16" in str(dtype) else kind.get(dtype.kind)

    if got.shape != ref.shape or kind_of(got.dtype) != kind_of(ref.dtype):
        return Comparison(name, dtype_name(dt), ref.shape, float("inf"), float("inf"), 0.0, False)
    if kind_of(ref.dtype) != "f":
        diff = int(np.count_nonzero(got != ref))
        max_abs = float(np.abs(got.astype(np.float64) - ref.astype(np.float64)).max()) if diff else 0.0
        return Comparison(name, dtype_name(dt), ref.shape, max_abs, float(diff > 0), 0.0, diff == 0, diff)
    tol = rtol if rtol is not None else REL_TOL.get(dt, 1e-4)
    g64, r64 = got.astype(np.float64), ref.astype(np.float64)
    both_nan = np.isnan(g64) & np.isnan(r64)
    same_inf = np.isinf(r64) & (g64 == r64)
    with np.errstate(invalid="ignore"):
        d = np.where(both_nan | same_inf, 0.0, np.abs(g64 - r64))
    d = np.nan_to_num(d, nan=np.inf)
    max_abs = float(d.max()) if d.size else 0.0
    scale = float(np.max(np.abs(r64[np.isfinite(r64)]))) if np.isfinite(r64).any() else 1.0
    max_rel = max_abs / max(scale, SCALE_FLOOR) if max_abs else 0.0
    return Comparison(name, dtype_name(dt), ref.shape, max_abs, max_rel, tol, max_rel <= tol)


@dataclass
class Located:
    """The first node whose result differs from ONNX Runtime."""

    node: str
    op_type: str
    inputs: list[str]
    outputs: list[Comparison]
    probed: int

    def line(self) -> str:
        bad = [c for c in self.outputs if not c.ok]
        errs = ", ".join(f"'{c.name}' max_abs={c.max_abs:.3e} max_rel={c.max_rel:.3e}" + (f" ({c.mismatched} of {int(np.prod(c.shape))} elements differ)" if c.mismatched else "") for c in bad)
        return f"first differing node: '{self.node}' ({self.op_type}) inputs [{', '.join(self.inputs)}]: {errs}  [{self.probed} values probed]"


def reference_outputs(model_path: str | Path, feeds: dict[str, np.ndarray], outputs: list[str] | None = None, *,
                      low_memory: bool = False) -> dict[str, np.ndarray]:
    """Run the original model on ONNX Runtime CPU with the feeds it takes, at the "basic" optimization
    level (exact graph semantics: no approximate fusions such as MatMulNBits accuracy_level 4); ``low_memory``:
    prepacking off (:data:`rewrite.backends.ort.NO_PREPACKING`)."""
    r = OrtRunner(Path(model_path), optimize="basic", config=dict(NO_PREPACKING) if low_memory else None)
    return r.run({k: v for k, v in feeds.items() if k in r.input_names}, outputs)


def default_feeds(folder: Path, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Feeds for the lowered function's inputs (static after ``--dim`` overrides), see :mod:`rewrite.core.feeds`."""
    m = Manifest.read(folder)
    return make_feeds(m.input_specs, m.dims, seed=seed)


def describe_comparison(model_path: str | Path, folder: str | Path, *, low_memory: bool = False) -> str:
    """One line saying what ``verify`` compares: the folder as its manifest says it runs (backend, target, the
    ONNX Runtime session of an ``ort`` folder, with ``low_memory`` its weights kept memory-mapped, the plugins
    applied and which of them change outputs by design) against ``model_path`` on ONNX Runtime CPU at the basic
    level.

    Raises:
        BackendError: ``folder`` holds no readable manifest.
    """
    m = Manifest.read(Path(folder))
    how = f"{m.backend}/{m.target}"
    if m.session:
        cfg = "".join(f", {k}={v}" for k, v in sorted(m.session.get("config", {}).items()))
        how += f", ONNX Runtime session level {m.session.get('optimize')}{cfg}"
        if low_memory:
            how += ", weights memory-mapped (prepacking off: --low-memory)"
    plugins = available_plugins()
    lossy = [p for p in m.plugins if p in plugins and plugins[p].lossy]
    used = ", ".join(m.plugins) or "none"
    note = f" ({', '.join(lossy)} change outputs by design: compare with the model they produced)" if lossy else ""
    return f"verify: {folder} ({how}; plugins: {used}{note}) against {model_path} on ONNX Runtime CPU, basic level"


def verify(model_path: str | Path, folder: str | Path, *, feeds: dict[str, np.ndarray] | None = None,
           rtol: float | None = None, seed: int = 0, low_memory: bool | None = None,
           float32: bool = False) -> list[Comparison]:
    """Compare every output of ``folder``'s lowered model with the original on ONNX Runtime.

    One model is loaded at a time (the lowered one is released before the original is loaded), so a full-size
    pair needs the memory of the larger, not of both; ``low_memory`` (default: by size, see
    :func:`rewrite.backends.load_runner`) keeps the folder's weights memory-mapped. ``float32``: also against the
    original's float32 twin (module docstring, :func:`judge_with_float32`)."""
    folder = Path(folder)
    _check_same_interface(model_path, folder)
    if low_memory is None:
        low_memory = needs_low_memory(folder)
    runner = load_runner(folder, low_memory=low_memory)
    feeds = feeds if feeds is not None else default_feeds(folder, seed=seed)
    got = runner.run(feeds)
    names = list(runner.output_names)
    del runner
    gc.collect()  # the lowered session's weights go before the original's are mapped
    ref = reference_outputs(model_path, feeds, low_memory=low_memory)
    res = [compare(n, got[n], ref[n], rtol) for n in names if n in ref]
    narrow = [c.name for c in res if c.dtype == "FLOAT16"]
    if float32 and narrow:
        twin = float32_outputs(model_path, feeds, narrow, low_memory=low_memory)
        res = [judge_with_float32(c, got[c.name], ref[c.name], twin[c.name]) if c.name in twin else c for c in res]
    return res


def float32_outputs(model_path: str | Path, feeds: dict[str, np.ndarray], outputs: list[str], *,
                    low_memory: bool = False) -> dict[str, np.ndarray]:
    """``outputs`` of the float32 twin of ``model_path`` (:func:`rewrite.core.widen.widen_float16`) on ONNX Runtime
    CPU at the basic level, fed ``feeds`` with float16 arrays as float32. The twin is written beside the model
    (only its widened tensors: the rest is read where it is) under a hidden name and removed afterwards; where that
    folder cannot be written, into a temporary folder (every external tensor copied).

    Raises:
        RewriteError: the model cannot be widened (see ``widen_float16``).
    """
    from rewrite.core.widen import widen_float16

    model_path = Path(model_path)
    tmp = twin = None
    try:
        try:  # a name no other run takes; a killed run leaves it behind, hidden
            fd, name = tempfile.mkstemp(dir=model_path.parent, prefix=f".{model_path.stem}.float32-", suffix=".onnx")
            os.close(fd)
            twin = Path(name)
            widen_float16(model_path, twin)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise RewriteError(f"{model_path}: cannot write its float32 twin beside it ({e})") from e
            if twin is not None:
                twin.unlink(missing_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix="rewrite-float32-"))
            twin = widen_float16(model_path, tmp / "model.onnx")
        wide = {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in feeds.items()}
        return reference_outputs(twin, wide, outputs, low_memory=low_memory)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        elif twin is not None:
            for f in (twin, twin.with_name(twin.name + ".data")):
                f.unlink(missing_ok=True)


def float32_bound(tol: float, reference_fp32_rel: float) -> float:
    """How far from the float32 twin an fp16 output may be (module docstring): ``2 x reference_fp32_rel`` clamped to
    ``[tol, FLOAT32_CAP x tol]``; ``tol`` where the original's own distance is not finite (NaN counts as not)."""
    if not np.isfinite(reference_fp32_rel):
        return tol
    return min(max(tol, 2 * reference_fp32_rel), FLOAT32_CAP * tol)


def judge_with_float32(c: Comparison, got: np.ndarray, ref: np.ndarray, twin: np.ndarray) -> Comparison:
    """``c`` (``got`` against the fp16 ``ref``) with both measured against the float32 ``twin``: ``fp32_rel``,
    ``reference_fp32_rel`` and ``fp32_bound`` set, and ``ok`` also when ``got`` is within :func:`float32_bound` of
    the twin. An output or original that is not finite where the twin is (inf or NaN: ``compare`` counts those as
    infinitely or maximally far) gets no loosening."""
    g = compare(c.name, np.asarray(got, np.float32), twin, c.tol)
    r = compare(c.name, np.asarray(ref, np.float32), twin, c.tol)
    finite = lambda x: x.max_abs < np.finfo(np.float64).max  # noqa: E731  (compare maps inf to the largest float)
    r_rel = r.max_rel if finite(r) else float("inf")
    c.fp32_rel, c.reference_fp32_rel, c.fp32_bound = g.max_rel, r_rel, float32_bound(c.tol, r_rel)
    c.ok = c.ok or (finite(g) and g.max_rel <= c.fp32_bound)
    return c


def _check_same_interface(model_path: str | Path, folder: Path) -> None:
    """Raises RewriteError when the lowered function's inputs are not the original's (a static or stateful
    KV cache changes them): such folders are compared by decoding, with ``rewrite generate``."""
    m = Manifest.read(folder)
    original = {i.name for i in onnx_io.read_model(model_path).graph.input}
    lowered = {d["name"] for d in m.inputs}
    if m.state or not lowered <= original:
        new = sorted(lowered - original)
        why = "its KV cache lives in the module state" if m.state else f"it takes input(s) the original does not: {', '.join(new)}"
        raise RewriteError(f"{folder}: cannot compare output by output with {model_path}: {why}; compare greedy decoding with 'rewrite generate'")


def locate(model_path: str | Path, folder: str | Path, *, feeds: dict[str, np.ndarray] | None = None,
           rtol: float | None = None, seed: int = 0, work_dir: str | Path | None = None) -> Located | None:
    """Find the first node of the lowered model whose output differs from ONNX Runtime (see module doc).

    Returns None when every probed value agrees. Raises RewriteError if the probe cannot be built.
    """
    folder = Path(folder)
    _check_same_interface(model_path, folder)
    manifest = Manifest.read(folder)
    feeds = feeds if feeds is not None else default_feeds(folder, seed=seed)
    lowered = onnx_io.load(folder / manifest.model)
    original = onnx_io.load(model_path)
    infer_shapes(lowered)
    infer_shapes(original)
    probe_names = _probe_values(lowered, original)
    if not probe_names:
        return None
    tmp = Path(tempfile.mkdtemp(prefix="rewrite-locate-", dir=work_dir))
    try:
        orig_probe = _with_outputs(original, probe_names)
        onnx_io.save(orig_probe, tmp / "original_probe.onnx")
        ref = reference_outputs(tmp / "original_probe.onnx", feeds, probe_names)
        low_probe = _with_outputs(lowered, probe_names)
        pfolder = tmp / "lowered_probe"
        pfolder.mkdir()
        pm = Manifest(backend=manifest.backend, target=manifest.target, source_model=manifest.source_model)
        get_backend(manifest.backend).lower(low_probe, pfolder, pm, options={},
                                            lowerings=lowering_registry().for_target(manifest.backend, manifest.target))
        pm.write(pfolder)
        got = load_runner(pfolder).run({k: feeds[k] for k in [d["name"] for d in pm.inputs] if k in feeds})  # defaults: left out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    probed = set(probe_names)
    # an f32 value computed from f16 inputs carries f16 rounding: judge intermediates at the model's
    # lowest float precision
    floor = max((REL_TOL.get(v.dtype, 0.0) for v in lowered.values.values() if v.dtype in REL_TOL), default=0.0)
    bad_values = {}
    for n in probe_names:
        own = REL_TOL.get(lowered.values[n].dtype, 1e-4)
        tol = rtol if rtol is not None else (own if n in lowered.outputs else max(own, floor))  # outputs: as verify judges them
        bad_values[n] = compare(n, got[n], ref[n], tol)
    for node in lowered.topo_nodes():
        outs = [bad_values[o] for o in node.outputs if o in probed]
        if not outs or all(c.ok for c in outs):
            continue
        if all(bad_values[i].ok for i in node.inputs if i in probed):
            return Located(node.name, node.op_type, [i for i in node.inputs if i], outs, len(probe_names))
    return None


def _probe_values(lowered: Graph, original: Graph) -> list[str]:
    """Tensors computed in both graphs (intermediates and graph outputs) with a known element type, in the
    lowered graph's topological order."""
    names = []
    for n in lowered.topo_nodes():
        if n.has_subgraphs():
            continue
        for o in n.outputs:
            v = lowered.values.get(o)
            ov = original.values.get(o)
            if not o or v is None or ov is None or v.dtype is None or v.shape is None:
                continue
            if original.producer_node(o) is None or ov.dtype != v.dtype:
                continue
            names.append(o)
    return names


def _with_outputs(graph: Graph, names: list[str]) -> Graph:
    """A copy of ``graph`` (via ONNX) whose outputs also include ``names`` (typed from value_info)."""
    model = onnx_io.to_model(graph)
    present = {o.name for o in model.graph.output}
    infos = {vi.name: vi for vi in model.graph.value_info}
    for n in names:
        if n in present:
            continue
        vi = infos.get(n) or graph.values[n].to_value_info()
        if vi is None:
            raise RewriteError(f"value '{n}' has no type; cannot expose it")
        model.graph.output.append(vi)
    base = next((v.base_dir for v in graph.values.values() if v.base_dir), "")
    return onnx_io.load(model, base_dir=base)
