"""The plugin conformance kit: the checks every plugin passes, built from the cases it declares.

For a plugin and each of its :attr:`~rewrite.plugins.base.Plugin.cases` (see :mod:`rewrite.testing.cases`):

========== ======================================================================================
check      what it asserts
========== ======================================================================================
matches    positive: the plugin's rules fire exactly the declared number of times (total or per rule)
untouched  negative: nothing fires and the serialized model is byte-identical afterwards
numerics   positive, once per backend in ``case.backends`` and ``plugin.backends``: the rewritten model,
           lowered for that backend (ort: CPU; iree: llvm-cpu), computes the original's outputs (run on
           ONNX Runtime) within ``case.rtol`` or the dtype tolerance of :data:`rewrite.verify.REL_TOL`
idempotent positive: applying the plugin again to its own output matches nothing and changes no byte
checker    positive: the output passes ``onnx.checker.check_model(full_check=True)`` and strict shape
           inference
error      bad_input: the plugin raises a RewriteError whose message contains ``case.error``
========== ======================================================================================

and, for every abstract op the plugin declares that has a ``sample_inputs(rng)`` hook
(:class:`~rewrite.core.abstract_ops.AbstractOp`), a ``kernel`` check per backend: each sample, lowered as a
one-node model, equals ``reference()`` within the dtype tolerance.

Expensive work is shared: a case is rewritten once and lowered once per backend, whatever checks read it
(:class:`CaseRun`). :func:`checks_for` lists the checks; the pytest plugin
(:mod:`rewrite.testing.pytest_plugin`) turns each into one test item.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import helper

from rewrite.backends import get_backend, load_runner
from rewrite.backends.base import Manifest
from rewrite.core import onnx_io
from rewrite.core.abstract_ops import DOMAIN, AbstractOp
from rewrite.core.driver import PluginReport
from rewrite.core.feeds import make_feeds, specs_of
from rewrite.core.ir import Graph
from rewrite.errors import RewriteError
from rewrite.pipeline import RewriteContext, abstract_ops_in, check_model, rewrite_graph
from rewrite.plugins.manager import lowering_registry
from rewrite.plugins.base import Plugin
from rewrite.testing.cases import Case
from rewrite.verify import compare

#: Backend -> target the kit lowers for (the machines CI has: CPU only).
TARGETS = {"ort": "cpu", "iree": "llvm-cpu"}


class ConformanceFailure(AssertionError):
    """A conformance check failed; the message names plugin, case, check and what differed."""


@dataclass
class Rewritten:
    """A case's model after one plugin run: the graph, its report, and its serialization."""

    graph: Graph
    report: PluginReport
    model: onnx.ModelProto

    @property
    def bytes(self) -> bytes:
        return self.model.SerializeToString(deterministic=True)


class CaseRun:
    """One (plugin, case) pair; rewrites and lowers lazily, each at most once, for all its checks.

    Args:
        plugin: the plugin under test.
        case: one of its declared cases.
        workdir: a folder for the case's files (model, lowered output folders).
    """

    def __init__(self, plugin: Plugin, case: Case, workdir: Path):
        self.plugin, self.case, self.workdir = plugin, case, Path(workdir)
        self._memo: dict[str, object] = {}

    def _once(self, key: str, fn: Callable[[], object]):
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    @property
    def where(self) -> str:
        return f"plugin '{self.plugin.short}', case '{self.case.name}'"

    @property
    def source(self) -> Path:
        """The case's model written to disk (built once)."""

        def build() -> Path:
            self.workdir.mkdir(parents=True, exist_ok=True)
            p = self.workdir / "source.onnx"
            onnx.save(self.case.build(), p)
            return p

        return self._once("source", build)

    def _apply(self, graph: Graph) -> Rewritten:
        check_model(graph, [self.plugin], self.where)
        backend = "ort" if "ort" in self.plugin.backends else self.plugin.backends[0]  # one it rewrites for
        ctx = RewriteContext(backend=backend, dims=dict(self.case.dims), options=dict(self.case.options))
        (report,) = rewrite_graph(graph, [self.plugin], ctx)
        return Rewritten(graph, report, onnx_io.to_model(graph))

    def baseline(self) -> Rewritten:
        """The source model after loading and shape inference, before the plugin (what 'unchanged' means)."""

        def run() -> Rewritten:
            from rewrite.core.shapes import infer_shapes

            g = onnx_io.load(self.source)
            infer_shapes(g, self.case.dims)
            return Rewritten(g, PluginReport(self.plugin.short), onnx_io.to_model(g))

        return self._once("baseline", run)

    def rewritten(self) -> Rewritten:
        """The source after one plugin run."""
        return self._once("rewritten", lambda: self._apply(onnx_io.load(self.source)))

    def feeds(self) -> dict[str, np.ndarray]:
        if self.case.feeds is not None:
            return self.case.feeds(onnx.load(self.source))
        model = onnx.load(self.source)
        inits = {i.name for i in model.graph.initializer}
        return make_feeds([s for s in specs_of(model.graph.input) if s.name not in inits], self.case.dims, seed=0)

    def reference(self) -> dict[str, np.ndarray]:
        """The original model's outputs on ONNX Runtime CPU."""
        from rewrite.verify import reference_outputs

        return self._once("reference", lambda: reference_outputs(self.source, self.feeds()))

    def lowered(self, backend: str) -> dict[str, np.ndarray]:
        """Outputs of the rewritten model lowered for ``backend`` (one lowering/compile per backend)."""

        def run() -> dict[str, np.ndarray]:
            g = onnx_io.load(self.rewritten().model)  # a private copy: lowering mutates the graph
            folder = lower_graph(g, backend, self.workdir / backend, self.plugin.abstract_ops)
            feeds = self.feeds()
            runner = load_runner(folder)
            return runner.run({k: v for k, v in feeds.items() if k in runner.input_names})

        return self._once(f"lowered:{backend}", run)


@contextlib.contextmanager
def registered_lowerings(lowerings):
    """Within the block, ``lowerings`` (:class:`rewrite.core.lowering.Lowering`) are registered through the
    ``rewrite_lowerings`` hook as an installed package's would be; for tests of lowerings not installed."""
    from rewrite.hookspecs import hookimpl
    from rewrite.plugins.manager import get_plugin_manager

    class _Package:
        @hookimpl
        def rewrite_lowerings(self):
            return list(lowerings)

    pm = get_plugin_manager()
    pkg = _Package()
    pm.register(pkg)
    try:
        yield
    finally:
        pm.unregister(pkg)


def lower_graph(graph: Graph, backend: str, folder: Path, abstract_ops=()) -> Path:
    """Lower ``graph`` for ``backend`` (target from :data:`TARGETS`) into ``folder`` (replaced); returns it.

    The lowerings of ``abstract_ops`` are added to the registered ones (a plugin under test need not be
    installed). Raises BackendError when lowering or compiling fails, LoweringError when an op of the graph
    has no lowering for the target.
    """
    from rewrite.core.shapes import infer_shapes

    folder = Path(folder)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    infer_shapes(graph)
    target = TARGETS[backend]
    registry = lowering_registry()
    for op in abstract_ops:
        for low in op.lowerings():
            registry.add(low)
    registry.check(abstract_ops_in(graph), backend, target)
    manifest = Manifest(backend=backend, target=target, source_model="")
    get_backend(backend).lower(graph, folder, manifest, options={}, lowerings=registry.for_target(backend, target))
    manifest.write(folder)
    return folder


@dataclass(frozen=True)
class Check:
    """One conformance check: ``run()`` raises :class:`ConformanceFailure` (or the plugin's error) if it fails."""

    plugin: str
    case: str
    name: str
    run: Callable[[], None] = field(compare=False, repr=False)

    @property
    def id(self) -> str:
        return f"{self.plugin}/{self.case}/{self.name}"


def _fail(run: CaseRun, check: str, msg: str) -> None:
    raise ConformanceFailure(f"{run.where}, check '{check}': {msg}")


def _counts(report: PluginReport) -> dict[str, int]:
    return {name: r.matches for name, r in report.rules.items()}


def check_matches(run: CaseRun) -> None:
    want = run.case.matches
    rep = run.rewritten().report
    if isinstance(want, dict):
        got = {k: v for k, v in _counts(rep).items() if v or k in want}
        if got != want:
            _fail(run, "matches", f"expected matches per rule {want}, got {got}")
    elif rep.matches != want:
        _fail(run, "matches", f"expected {want} matches, got {rep.matches} ({_counts(rep)})")


def check_untouched(run: CaseRun) -> None:
    got = run.rewritten()
    if got.report.matches:
        _fail(run, "untouched", f"expected no match, got {_counts(got.report)}")
    if got.bytes != run.baseline().bytes:
        _fail(run, "untouched", "the model changed although nothing matched")


def check_numerics(run: CaseRun, backend: str) -> None:
    ref = run.reference()
    got = run.lowered(backend)
    missing = sorted(set(ref) - set(got))
    if missing:
        _fail(run, f"numerics-{backend}", f"output '{missing[0]}' missing from the rewritten model")
    bad = [c for c in (compare(n, got[n], ref[n], run.case.rtol) for n in ref) if not c.ok]
    if bad:
        _fail(run, f"numerics-{backend}", "; ".join(c.line() for c in bad))


def check_idempotent(run: CaseRun) -> None:
    from rewrite.core.shapes import infer_shapes

    g = onnx_io.load(run.rewritten().model)
    infer_shapes(g, run.case.dims)  # types of the values the first run created: not a change by the plugin
    before = onnx_io.to_model(g).SerializeToString(deterministic=True)
    again = run._apply(g)
    if again.report.matches:
        _fail(run, "idempotent", f"a second run matched again: {_counts(again.report)}")
    if again.bytes != before:
        _fail(run, "idempotent", "a second run changed the model")


def check_checker(run: CaseRun) -> None:
    model = run.rewritten().model
    try:
        onnx.checker.check_model(model, full_check=True)
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        _fail(run, "checker", " ".join(line.strip() for line in str(e).strip().splitlines())[:400])


def check_error(run: CaseRun) -> None:
    try:
        run._apply(onnx_io.load(run.source))
    except RewriteError as e:
        if run.case.error not in str(e):
            _fail(run, "error", f"expected an error containing {run.case.error!r}, got {str(e)!r}")
        if "\n" in str(e).strip():
            _fail(run, "error", f"the error message is not one line: {str(e)!r}")
        return
    _fail(run, "error", f"expected a RewriteError containing {run.case.error!r}, nothing was raised")


def check_kernel(op: AbstractOp, backend: str, workdir: Path, seed: int = 0) -> None:
    """Lower each ``op.sample_inputs(rng)`` sample as a one-node model for ``backend``; compare with ``reference``.
    A sample input ``None`` is an absent optional input (``""`` in the node, ``None`` to ``reference``).

    Raises ConformanceFailure naming op, sample (attrs and input shapes) and the differing output.
    """
    rng = np.random.default_rng(seed)
    for k, (attrs, inputs) in enumerate(op.sample_inputs(rng)):
        inputs = [None if x is None else np.asarray(x) for x in inputs]
        ref = [np.asarray(r) for r in op.reference(attrs, *inputs)]
        model = single_op_model(op, attrs, inputs, ref)
        folder = lower_graph(onnx_io.load(model), backend, Path(workdir) / f"{op.op_type}-{backend}-{k}", [op])
        runner = load_runner(folder)
        got = runner.run({f"in{i}": x for i, x in enumerate(inputs) if x is not None})
        for i, r in enumerate(ref):
            c = compare(f"out{i}", got[f"out{i}"], r)
            if not c.ok:
                shapes = [None if x is None else list(x.shape) for x in inputs]
                raise ConformanceFailure(f"abstract op {op.op_type} on {backend}, sample {k} (attrs {attrs}, input shapes {shapes}): {c.line()}")


def single_op_model(op: AbstractOp, attrs: dict, inputs: list[np.ndarray | None], outputs: list[np.ndarray]) -> onnx.ModelProto:
    """A model of one ``op`` node with ``attrs``: graph inputs ``in<i>`` of the ``inputs``' types and shapes (``""``
    in the node for a None), outputs ``out<i>`` typed as ``outputs``."""
    def vi(name: str, a: np.ndarray) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))

    names = ["" if x is None else f"in{i}" for i, x in enumerate(inputs)]
    node = helper.make_node(op.op_type, names, [f"out{i}" for i in range(len(outputs))], domain=op.domain, name=op.op_type, **attrs)
    g = helper.make_graph([node], "main_graph", [vi(n, x) for n, x in zip(names, inputs) if n],
                          [vi(f"out{i}", r) for i, r in enumerate(outputs)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])


def checks_for(plugin: Plugin, workdir: Path) -> list[Check]:
    """Every conformance check of ``plugin``, in a stable order: per case (declaration order) then kernels.

    Checks of one case share a :class:`CaseRun`, so the case is rewritten once and compiled once per backend.
    """
    out: list[Check] = []
    workdir = Path(workdir)
    for case in plugin.cases:
        run = CaseRun(plugin, case, workdir / _safe(plugin.short) / _safe(case.name))

        def add(name: str, fn: Callable, *args) -> None:
            out.append(Check(plugin.short, case.name, name, lambda fn=fn, args=args: fn(*args)))

        if case.kind == "positive":
            add("matches", check_matches, run)
            for be in case.backends:
                if be in plugin.backends:
                    add(f"numerics-{be}", check_numerics, run, be)
            add("idempotent", check_idempotent, run)
            add("checker", check_checker, run)
        elif case.kind == "negative":
            add("untouched", check_untouched, run)
        elif case.kind == "bad_input":
            add("error", check_error, run)
        else:
            raise RewriteError(f"plugin '{plugin.short}': case '{case.name}' has unknown kind '{case.kind}'")
    for op in plugin.abstract_ops:
        if getattr(op, "sample_inputs", None) is None:
            continue
        for be in plugin.backends:
            out.append(Check(plugin.short, f"op-{op.op_type}", f"kernel-{be}", lambda op=op, be=be: check_kernel(op, be, workdir / _safe(plugin.short) / "kernels")))
    return out


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)

