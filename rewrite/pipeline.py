"""``rewrite apply`` as a library call: load, check, refine shapes, run plugins, lower, write the folder.

Nothing is written unless every step succeeds: the folder is built in a temporary sibling directory and
moved into place at the end.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

from rewrite.backends import get_backend
from rewrite.backends.base import MANIFEST, Manifest
from rewrite.core import onnx_io
from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.driver import PluginReport, RewriteContext, run_plugin  # noqa: F401 (RewriteContext: re-exported)
from rewrite.core.interface import DecoderInterface, decoder_interface
from rewrite.core.ir import Graph
from rewrite.core.lowering import LoweringRegistry
from rewrite.core.next_token import add_next_token
from rewrite.core.shapes import infer_shapes
from rewrite.core.stages import stage
from rewrite.errors import BackendError, RewriteError, UnsupportedModelError
from rewrite.plugins.base import Plugin
from rewrite.plugins.manager import lowering_registry, select_plugins

#: Domains whose ops ONNX Runtime or the ONNX spec define; others must be model-local functions.
KNOWN_DOMAINS = frozenset({DOMAIN, "", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training", "ai.onnx.preview", "com.microsoft", "com.microsoft.nchwc", "org.pytorch.aten", "com.ms.internal.nhwc"})


def check_model(graph: Graph, plugins: list[Plugin], where: str) -> None:
    """Refuse models the plugins cannot handle.

    Raises:
        UnsupportedModelError: a node in an unknown domain (naming node and domain), or a default-domain
            opset outside a selected plugin's declared range.
    """
    local = {(f.domain, f.name) for f in graph.model_shell.functions}
    for n in graph.topo_nodes():
        if n.domain not in KNOWN_DOMAINS and (n.domain, n.op_type) not in local:
            raise UnsupportedModelError(f"{where}: node {n.describe()} is in unknown domain '{n.domain}' (no ONNX, ONNX Runtime or model-local definition)")
    opset = graph.opset("")
    if opset is None:
        raise UnsupportedModelError(f"{where}: no default-domain opset import")
    for p in plugins:
        lo, hi = p.opset_range
        if not lo <= opset <= hi:
            hint = (f" (onnx.version_converter.convert_version(model, {lo}) converts the model, or leave "
                    f"'{p.short}' out)" if opset < lo else "")
            raise UnsupportedModelError(f"{where}: opset {opset} is outside plugin '{p.short}' range {lo}..{hi}{hint}")


def check_output_folder(out_dir: Path, model_path: Path) -> None:
    """Raises RewriteError unless ``out_dir`` may be replaced: it must not exist, be empty, or be an earlier
    output folder (holding ``manifest.json``), and it must not hold the source model."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise RewriteError(f"{out_dir}: exists and is not a folder")
    if Path(model_path).resolve().is_relative_to(out_dir.resolve()):
        raise RewriteError(f"{out_dir}: holds the source model {model_path}; choose another output folder")
    if any(out_dir.iterdir()) and not (out_dir / MANIFEST).is_file():
        raise RewriteError(f"{out_dir}: not empty and not an output folder of 'rewrite apply' (no {MANIFEST}); refusing to replace it")


#: option keys read by the pipeline and the backends; every other key names a plugin whose options it holds
BACKEND_OPTIONS = frozenset({"stateful", "param_threshold", "ort_matmul_nbits", "cuda_sm", "module_from", "next_token"})


def check_options(options: dict, plugins: list[Plugin]) -> None:
    """Raises RewriteError for options addressed to a plugin that is not selected, or to one that takes none (a
    typo would otherwise be ignored silently)."""
    shorts = {p.short for p in plugins}
    for key in options:
        if key not in BACKEND_OPTIONS and key not in shorts:
            raise RewriteError(f"options given for plugin '{key}', which is not among --plugins ({', '.join(sorted(shorts)) or 'none'})")
    for p in plugins:
        if not p.takes_options and options.get(p.short):
            raise RewriteError(f"option '{p.short}.{sorted(options[p.short])[0]}': plugin '{p.short}' takes no options")


def rewrite_graph(graph: Graph, plugins: list[Plugin], ctx: RewriteContext, *, dry_run: bool = False) -> list[PluginReport]:
    """Refine shapes, then run each plugin all-or-nothing, in order; returns their reports."""
    with stage("shapes"):
        infer_shapes(graph, ctx.dims)
    reports = []
    for p in plugins:
        with stage(f"plugin {p.short}"):
            reports.append(run_plugin(graph, p, ctx, dry_run=dry_run))
            if not dry_run:
                graph.remove_unused_initializers()
                graph.release_spilled()  # the plugin's snapshot is gone: what it replaced cannot come back
    return reports


def abstract_ops_in(graph: Graph) -> dict[str, str]:
    """Each abstract op type in ``graph`` -> its first node's description (for messages), in graph order."""
    out: dict[str, str] = {}
    for n in sorted((n for n in graph.nodes.values() if n.domain == DOMAIN), key=lambda n: n.order):
        out.setdefault(n.op_type, f"at node {n.display_name!r}")
    return out


def _decoder_json(iface: DecoderInterface | None, manifest: Manifest) -> dict | None:
    """The lowered function's decode interface: pairs moved into module state (``--stateful``) are left out."""
    if iface is None:
        return None
    kept = {d["name"] for d in manifest.inputs}
    iface.pairs = [p for p in iface.pairs if p.past in kept]
    return iface.to_json()


#: file in a staging folder naming the host and process that write it ("<host> <pid>"; a folder whose process
#: is gone from this host is stale)
STAGING_OWNER = ".owner-pid"


def _owner() -> str:
    return f"{socket.gethostname()} {os.getpid()}"


def remove_stale_staging(out_dir: Path) -> list[Path]:
    """Remove the staging folders (``.<out name>-*`` beside ``out_dir``) of ``apply`` runs of this host whose
    process no longer exists (killed with SIGKILL, or a machine that went down); returns them. Folders of live
    runs, of other hosts (a shared file system) and folders without an owner file are left alone."""
    removed = []
    host = socket.gethostname()
    for d in out_dir.parent.glob(f".{glob.escape(out_dir.name)}-*"):
        try:
            their_host, pid = (d / STAGING_OWNER).read_text().rsplit(" ", 1)
            pid = int(pid)
        except (OSError, ValueError):
            continue
        if their_host == host and not _process_exists(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _umask() -> int:
    """The process's file mode creation mask: from /proc/self/status where Linux gives it (setting it to read
    it, POSIX's only way, would briefly change it for every thread), else set and set back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def apply(
    model_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    plugins: list[str] | str = (),
    backend: str = "ort",
    target: str | None = None,
    dims: dict[str, int] | None = None,
    options: dict | None = None,
    freeze_inputs: bool = False,
    before_lowering: Callable[[list[PluginReport]], None] | None = None,
) -> Manifest:
    """Rewrite ``model_path`` with ``plugins`` and lower it for ``backend`` into ``out_dir``.

    ``before_lowering`` (optional) is called with the plugins' reports once they ran, before anything is lowered
    or written: an exception it raises ends ``apply`` there (``rewrite apply --expect`` stops so when a plugin
    matched fewer times than expected, instead of after a compile).

    Graph inputs that have an initializer as their default stay inputs a caller may override (their data is no
    constant to the plugins); ``freeze_inputs`` makes them constants and removes them from the interface
    (recorded in the manifest's ``frozen_inputs``).

    Returns the written manifest. Raises RewriteError (with a one-line message) on bad input, a failing
    plugin or a failing backend; ``out_dir`` is then left as it was.
    """
    be = get_backend(backend)
    target = target or be.targets[0]
    if target not in be.targets:
        raise RewriteError(f"backend '{backend}' has no target '{target}'; targets: {', '.join(be.targets)}")
    selected = select_plugins(list(plugins) if not isinstance(plugins, str) else plugins)
    check_options(options or {}, selected)
    with stage("load"):
        graph = onnx_io.load(model_path)
    frozen = graph.freeze_inputs() if freeze_inputs else []
    check_model(graph, selected, str(model_path))
    ctx = RewriteContext(backend=backend, target=target, dims=dict(dims or {}), options=dict(options or {}))
    reports = rewrite_graph(graph, selected, ctx)
    if before_lowering is not None:
        before_lowering(reports)
    if ctx.options.get("next_token"):
        add_next_token(graph)
    used = abstract_ops_in(graph)
    lowerings = lowering_registry() if used else LoweringRegistry()  # (a graph without abstract ops needs none)
    lowerings.check(used, backend, target)  # before anything is written
    with stage("shapes"):
        infer_shapes(graph)  # types for the values the plugins created, which the IREE importer needs
    out_dir = Path(out_dir)
    check_output_folder(out_dir, Path(model_path))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    (tmp / STAGING_OWNER).write_text(_owner())
    try:
        manifest = Manifest(
            backend=backend,
            target=target,
            source_model=str(Path(model_path).resolve()),
            plugins=[p.short for p in selected],
            dims=ctx.dims,
            frozen_inputs=frozen,
            report=[r.to_json() for r in reports],
        )
        iface = decoder_interface(graph)  # before lowering: abstract ops still say which axis a cache is written on
        try:
            with stage(f"lower {backend}/{target}"):
                be.lower(graph, tmp, manifest, options=ctx.options, lowerings=lowerings.for_target(backend, target))
        except BackendError as e:
            if not (tmp / "compile.log").exists():  # name the requested folder, not the staging one that goes
                raise BackendError(str(e).replace(str(tmp), str(out_dir)) + f" (the lowered model; {out_dir} not "
                                   "written)" if str(tmp) in str(e) else str(e)) from e
            # a failed compile is debugged from its MLIR and log: keep them beside the requested folder
            kept = out_dir.parent / f"{out_dir.name}.failed"
            shutil.rmtree(kept, ignore_errors=True)
            (tmp / STAGING_OWNER).unlink(missing_ok=True)
            tmp.rename(kept)
            raise BackendError(str(e).replace(str(tmp), str(kept)) + f" (model, MLIR and log kept in {kept})") from e
        manifest.decoder = _decoder_json(iface, manifest)
        manifest.write(tmp)
        (tmp / STAGING_OWNER).unlink()
        tmp.chmod(0o777 & ~_umask())  # mkdtemp's folder is private (0700); the output is an ordinary folder
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
        shutil.rmtree(out_dir.parent / f"{out_dir.name}.failed", ignore_errors=True)  # an earlier failure's, now stale
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest
