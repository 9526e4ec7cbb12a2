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

Expensive work is shared: a case is rewritten once, whatever checks read it (:class:`CaseRun`); the numerics
checks of a plugin's cases read one model of them all, lowered once per backend, and a kernel check lowers its
samples as one model. Whatever differs there is lowered again on its own, and that is what a failure reports.
:func:`checks_for` lists the checks; the pytest plugin (:mod:`rewrite.testing.pytest_plugin`) turns each into one
test item.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import compose, helper

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
        self._together: dict[str, _LoweredTogether] = {}  # backend -> the lowering it shares with other cases

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


class _LoweredTogether:
    """The rewritten models of several cases of one plugin lowered as one model for ``backend`` (one import and
    compile, not one per case): each model's names and dim symbols prefixed ``c<j>_``, its nodes side by side with
    the others'. Cases that do not lower together (:func:`_lower_together`), or whose models cannot be merged
    (local functions, subgraphs, sparse initializers; another opset or IR version goes in another group), get
    None: they are lowered on their own.
    """

    def __init__(self, backend: str, workdir: Path, abstract_ops):
        self.backend, self.workdir, self.abstract_ops = backend, Path(workdir), list(abstract_ops)
        self.runs: list[CaseRun] = []
        self._outputs: dict[CaseRun, dict[str, np.ndarray] | None] = {}

    def outputs_of(self, run: CaseRun) -> dict[str, np.ndarray] | None:
        """``run``'s outputs from the shared model. The first call lowers ``run`` with the cases after it not yet
        lowered (those before it were checked elsewhere: pytest-xdist gives a worker consecutive items)."""
        if run not in self._outputs:
            todo = [r for r in self.runs[self.runs.index(run):] if r not in self._outputs]
            self._outputs.update(dict.fromkeys(todo))
            groups: dict[tuple, list] = {}
            for r in todo:
                try:
                    model, feeds = r.rewritten().model, r.feeds()
                except Exception:  # noqa: BLE001 - the case's own checks report it
                    continue
                subgraphs = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                for n in model.graph.node for a in n.attribute)
                if model.functions or model.graph.sparse_initializer or subgraphs:
                    continue
                key = (model.ir_version, tuple(sorted((o.domain, o.version) for o in model.opset_import)))
                groups.setdefault(key, []).append((self.runs.index(r), r, model, feeds))
            for items in groups.values():
                by_index = {it[0]: it for it in items}
                got = _lower_together(list(by_index), "c", lambda js: self._lower([by_index[j] for j in js]))
                self._outputs.update({by_index[j][1]: outs for j, outs in got.items()})
        return self._outputs[run]

    def _lower(self, items: list) -> dict[int, dict[str, np.ndarray]]:
        model = side_by_side({f"c{j}": m for j, _, m, _ in items})
        feeds = {f"c{j}_{k}": v for j, _, _, f in items for k, v in f.items()}
        folder = lower_graph(onnx_io.load(model), self.backend, self.workdir / "-".join(str(it[0]) for it in items),
                             self.abstract_ops)
        runner = load_runner(folder)
        got = runner.run({k: v for k, v in feeds.items() if k in runner.input_names})
        return {j: {o.name: got[f"c{j}_{o.name}"] for o in m.graph.output} for j, _, m, _ in items}


def side_by_side(models: dict[str, onnx.ModelProto], dim_param: Callable[[str, str], str] | None = None,
                 opset_imports: list | None = None) -> onnx.ModelProto:
    """One model running ``models`` side by side: each one's graph with its names prefixed ``<key>_``
    (``onnx.compose.add_prefix_graph``) and its dim symbols renamed ``dim_param(key, symbol)`` (default
    ``<key>_<symbol>``: every model keeps dims of its own), then their nodes, inputs, outputs, initializers and
    value_info one after another. Opset imports: ``opset_imports``, else the first model's; IR version the first's.
    The models must not have local functions, sparse initializers or subgraphs (the caller checks)."""
    rename = dim_param or (lambda key, sym: f"{key}_{sym}")
    graphs = []
    for key, model in models.items():
        g = compose.add_prefix_graph(model.graph, f"{key}_")
        for vi in [*g.input, *g.output, *g.value_info]:
            for d in vi.type.tensor_type.shape.dim:
                if d.dim_param:
                    d.dim_param = rename(key, d.dim_param)
        graphs.append(g)
    merged = helper.make_graph([n for g in graphs for n in g.node], "main_graph", [v for g in graphs for v in g.input],
                               [v for g in graphs for v in g.output], [t for g in graphs for t in g.initializer],
                               value_info=[v for g in graphs for v in g.value_info])
    first = next(iter(models.values()))
    return helper.make_model(merged, opset_imports=list(opset_imports or first.opset_import), ir_version=first.ir_version)


def _lower_together(keys: list[int], tag: str, lower: Callable[[list[int]], dict], tries: int = 4) -> dict:
    """``lower(group)`` (the results of a group of ``keys`` lowered as one model, by key) for as many of ``keys``
    as lower together: a group whose lowering fails naming one of its members (``<tag><key>_`` in the message,
    e.g. two lowerings that define one symbol differently) is tried again without it, and those left out form
    the next group. A compile failure (each retry would cost one), a failure naming none, or ``tries`` failures
    end sharing. Keys missing from the result are for the caller to lower alone, where their own errors show."""
    from rewrite.backends.errors import IreeCompileError

    done: dict = {}
    todo = list(keys)
    while len(todo) >= 2:
        group, left = todo, []
        while len(group) >= 2:
            try:
                done.update(lower(group))
                break
            except Exception as e:  # noqa: BLE001 - alone, the member's own error shows
                tries -= 1
                named = next((int(k) for k in re.findall(rf"(?<![\w-]){tag}(\d+)_", str(e)) if int(k) in group), None)
                if named is None or isinstance(e, IreeCompileError) or tries <= 0:
                    return done
                group = [k for k in group if k != named]
                left.append(named)
        todo = left
    return done


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
    shared = run._together[backend].outputs_of(run) if backend in run._together else None
    if shared is not None and all(n in shared and compare(n, shared[n], ref[n], run.case.rtol).ok for n in ref):
        return
    got = run.lowered(backend)  # the case's own model: what a failure reports
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

    The samples are first lowered together, a node each in one model (one import and compile, not one per
    sample; :func:`_lower_together`); a sample that fails there, or did not lower with the others, is checked on
    its own, so what is reported is always that of the sample's one-node model.

    Raises ConformanceFailure naming op, sample (attrs and input shapes) and the differing output.
    """
    rng = np.random.default_rng(seed)
    workdir = Path(workdir)
    samples = []
    for attrs, inputs in op.sample_inputs(rng):
        inputs = [None if x is None else np.asarray(x) for x in inputs]
        samples.append((attrs, inputs, [np.asarray(r) for r in op.reference(attrs, *inputs)]))
    together = _lower_together(list(range(len(samples))), "s",
                               lambda ks: _run_samples_together(op, backend, workdir, samples, ks))
    for k, (attrs, inputs, ref) in enumerate(samples):
        if k in together and all(compare(f"out{i}", together[k][f"out{i}"], r).ok for i, r in enumerate(ref)):
            continue
        model = single_op_model(op, attrs, inputs, ref)
        folder = lower_graph(onnx_io.load(model), backend, workdir / f"{op.op_type}-{backend}-{k}", [op])
        runner = load_runner(folder)
        got = runner.run({f"in{i}": x for i, x in enumerate(inputs) if x is not None})
        for i, r in enumerate(ref):
            c = compare(f"out{i}", got[f"out{i}"], r)
            if not c.ok:
                shapes = [None if x is None else list(x.shape) for x in inputs]
                raise ConformanceFailure(f"abstract op {op.op_type} on {backend}, sample {k} (attrs {attrs}, input shapes {shapes}): {c.line()}")


def _run_samples_together(op: AbstractOp, backend: str, workdir: Path, samples: list, ks: list[int]) -> dict[int, dict]:
    """Sample ``k`` -> its outputs ``out<i>``, for the samples ``ks`` lowered for ``backend`` as one model of a node
    per sample (node ``s<k>_<op_type>``, inputs ``s<k>_in<i>``, outputs ``s<k>_out<i>``)."""
    nodes, inputs, outputs = [], [], []
    for k in ks:
        attrs, ins, ref = samples[k]
        one = single_op_model(op, attrs, ins, ref)
        rename = {v.name: f"s{k}_{v.name}" for v in [*one.graph.input, *one.graph.output]}
        for n in one.graph.node:
            n.name = f"s{k}_{n.name}"
            n.input[:] = [rename.get(x, x) for x in n.input]
            n.output[:] = [rename[x] for x in n.output]
        for v in [*one.graph.input, *one.graph.output]:
            v.name = rename[v.name]
        nodes += one.graph.node
        inputs += one.graph.input
        outputs += one.graph.output
    model = helper.make_model(helper.make_graph(nodes, "main_graph", inputs, outputs), opset_imports=list(one.opset_import))
    folder = lower_graph(onnx_io.load(model), backend, workdir / f"{op.op_type}-{backend}-{'-'.join(map(str, ks))}", [op])
    runner = load_runner(folder)
    got = runner.run({f"s{k}_in{i}": x for k in ks for i, x in enumerate(samples[k][1]) if x is not None})
    return {k: {f"out{i}": got[f"s{k}_out{i}"] for i in range(len(samples[k][2]))} for k in ks}


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

    Checks of one case share a :class:`CaseRun`, so the case is rewritten once and compiled once per backend; the
    numerics checks of a backend first read the outputs of the plugin's cases lowered together (one compile for
    them all, :class:`_LoweredTogether`), and a case whose outputs differ there is lowered on its own.
    """
    out: list[Check] = []
    workdir = Path(workdir)
    together = {be: _LoweredTogether(be, workdir / _safe(plugin.short) / f"together-{be}", plugin.abstract_ops)
                for be in plugin.backends}
    for case in plugin.cases:
        run = CaseRun(plugin, case, workdir / _safe(plugin.short) / _safe(case.name))

        def add(name: str, fn: Callable, *args) -> None:
            out.append(Check(plugin.short, case.name, name, lambda fn=fn, args=args: fn(*args)))

        if case.kind == "positive":
            add("matches", check_matches, run)
            for be in case.backends:
                if be in plugin.backends:
                    together[be].runs.append(run)
                    run._together[be] = together[be]
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

