"""IREE toolchain for plain ONNX files: import to MLIR, compile to a .vmfb, run.

The three steps are separate on purpose, with files between them::

    import_onnx(model.onnx, model.mlir, params_path=model.irpa)   # torch-dialect MLIR text (+ weights)
    # seam: a later pass may rewrite model.mlir in place (e.g. patch custom kernels into it)
    compile_mlir(model.mlir, model.vmfb, target="llvm-cpu")
    IreeModule(model.vmfb, params_path=model.irpa, driver=DRIVER_FOR_TARGET["llvm-cpu"])(x)

Facts about the importer (iree-base-compiler 3.13) that callers rely on:

- The entry function is named after ``graph.name`` (quoted in MLIR when it is not a bare identifier,
  e.g. ``@"torch-jit.export 1"``); an empty graph name is rejected by the ONNX checker.
- Its arguments are the graph inputs in ``graph.input`` order, excluding inputs that are also
  initializers (those become constants); its results are ``graph.output`` in order.
- An intermediate value with no inferable type (typically a custom-domain op output without
  value_info) gets type ``!torch.none``; give such values a value_info. A graph output declared
  without a type or a shape is rejected by the ONNX checker that the importer runs first.
- Models with opset < 13 import but may not compile (``Unsqueeze`` with an ``axes`` attribute is not
  lowered); importing with ``opset_version=17`` converts them first and fixes that.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import iree.runtime as rt
import numpy as np

from rewrite.backends.errors import BackendError, IreeCompileError, IreeImportError, IreeRuntimeError
from rewrite.core import spill
from rewrite.core.stages import stage

__all__ = [
    "BackendError",
    "COMPILE_CACHE_ENV",
    "DRIVER_FOR_TARGET",
    "PARAMS_SCOPE",
    "ImportResult",
    "IreeCompileError",
    "IreeImportError",
    "IreeModule",
    "IreeRuntimeError",
    "compile_mlir",
    "entry_function_name",
    "import_onnx",
]

PARAMS_SCOPE = "model"
"""Scope of externalized parameters: the MLIR refers to ``#stream.parameter.named<"model"::NAME>``."""

_TARGET_FLAGS: dict[str, tuple[str, ...]] = {
    "llvm-cpu": (
        "--iree-hal-target-device=local",
        "--iree-hal-local-target-device-backends=llvm-cpu",
        # The .vmfb is built and run on the same machine; a generic CPU target is slower and only
        # trades the warning "defaulting to a generic CPU" for portability we do not need.
        "--iree-llvmcpu-target-cpu=host",
        # DWARF built from the module's locations differs between two compiles of one module (measured with
        # 3.13: 107 bytes of a tiny model's .vmfb); without it the output is reproducible
        "--iree-llvmcpu-debug-symbols=false",
    ),
    # dispatch creation at O3 fuses elementwise ops into the reductions and contractions around them (iree-compile
    # 3.13: a 2-layer Qwen1.5-MoE decode step in 48 dispatches instead of 56); at decode each dispatch is a launch.
    # Not --iree-opt-level=O3: its global optimization makes a router's 1x60x2048 MatMul a matvec reading the
    # [K, N] weight across rows, 52 us a call on an H200 instead of a few (BENCHMARKS.md, 2026-12-04)
    "cuda": ("--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80", "--iree-dispatch-creation-opt-level=O3"),
}

DRIVER_FOR_TARGET: dict[str, str] = {"llvm-cpu": "local-task", "cuda": "cuda"}
"""The runtime driver (for :class:`IreeModule`) that runs a module compiled for each target."""

_MAX_MESSAGE_CHARS = 400


@dataclass(frozen=True)
class ImportResult:
    """What :func:`import_onnx` produced.

    Attributes:
        mlir_path: The torch-dialect MLIR text file.
        params_path: The .irpa holding the externalized initializers (scope :data:`PARAMS_SCOPE`),
            or None when externalization was not requested.
        entry_function: Name of the public ``func.func`` (the ONNX graph name), unquoted; the same
            name is the function to call in the compiled module.
        stderr: The importer's stderr (warnings such as "node without a valid type proto").
        param_spans: initializer name -> (offset, length) of its raw bytes in ``params_path`` (see
            :func:`rewrite.backends.iree_import.save_params`); empty without parameters.
        param_keys: (initializer name, parameter key) of every externalized initializer, in the order the
            importer created them; the compiled module looks each one up by its key in ``params_path``.
    """

    mlir_path: Path
    params_path: Path | None
    entry_function: str
    stderr: str
    param_spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    param_keys: list[tuple[str, str]] = field(default_factory=list)


def import_onnx(
    onnx_path: Path,
    mlir_path: Path,
    *,
    params_path: Path | None,
    param_threshold_elements: int = 1024,
    opset_version: int | None = None,
) -> ImportResult:
    """Import an ONNX model to torch-dialect MLIR with IREE's importer.

    Args:
        onnx_path: The model; external data is read from its directory.
        mlir_path: Where to write the MLIR text (overwritten; parent directories are created).
        params_path: When set, initializers with at least ``param_threshold_elements`` elements are
            written to this .irpa file (overwritten) under scope :data:`PARAMS_SCOPE` and the MLIR
            refers to them by name; smaller ones stay inline as constants. When None, every
            initializer is inlined into the MLIR (the file is then as large as the weights).
        param_threshold_elements: Minimum element count (not bytes) of an externalized initializer.
        opset_version: Convert the model to this default-domain opset before importing. The
            importer only converts upward: a value at or below the model's opset does nothing.

    Returns:
        An :class:`ImportResult`.

    Raises:
        IreeImportError: The importer failed (unreadable file, ONNX checker error, unsupported
            tensor type, crash) or its output has not exactly one public function. The message is
            one line naming ``onnx_path`` and the importer's key error line.
    """
    onnx_path, mlir_path = Path(onnx_path), Path(mlir_path)
    mlir_path.parent.mkdir(parents=True, exist_ok=True)
    # A failed run must not leave a previous run's output behind to be mistaken for this one.
    mlir_path.unlink(missing_ok=True)
    # A subprocess (rewrite.backends.iree_import: the importer's steps, printed with locations): a crash in
    # the MLIR C++ bindings cannot take our process down, and the memory of a large model (proto + MLIR
    # module) is returned on exit. The cost is about 0.5 s of interpreter and module start-up per import.
    cmd = [sys.executable, "-m", "rewrite.backends.iree_import", str(onnx_path), "-o", str(mlir_path)]
    if params_path is not None:
        params_path = Path(params_path)
        params_path.parent.mkdir(parents=True, exist_ok=True)
        params_path.unlink(missing_ok=True)
        cmd += [
            "--externalize-params",
            "--num-elements-threshold", str(param_threshold_elements),
            "--params-scope", PARAMS_SCOPE,
            "--save-params-to", str(params_path),
            "--param-spans-to", str(params_path) + ".spans.json",
        ]
    inlined = None
    if opset_version is not None:
        cmd += ["--opset-version", str(opset_version)]
    elif params_path is not None:
        # a model with external data takes the importer's large-model path: shape inference from the file,
        # external data never loaded whole (the in-memory path serializes the whole model and fails past
        # protobuf's 2 GB). On it the importer reads no external data for the small constants it inlines, so
        # those go inline in a copy first.
        inlined = _large_model_copy(onnx_path, param_threshold_elements)
        if inlined is not None:
            cmd[3] = str(inlined)
            cmd += ["--large-model"]
    try:
        with stage("iree import"):
            proc = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        if inlined is not None:
            inlined.unlink(missing_ok=True)
    if proc.returncode != 0 or not mlir_path.exists():
        raise IreeImportError(
            f"IREE ONNX import of {onnx_path} failed: {_failure_summary(proc.returncode, proc.stderr)}"
        )
    try:
        entry = entry_function_name(mlir_path.read_text())
    except ValueError as e:
        raise IreeImportError(f"IREE ONNX import of {onnx_path}: {e}") from None
    spans, keys = {}, []
    if params_path is not None:
        spans_file = Path(str(params_path) + ".spans.json")
        if spans_file.exists():
            written = json.loads(spans_file.read_text())
            spans = {k: (int(o), int(n)) for k, (o, n) in written["spans"].items()}
            keys = [(name, key) for name, key in written["keys"]]
            spans_file.unlink()
    return ImportResult(mlir_path, params_path, entry, proc.stderr, spans, keys)


def _large_model_copy(onnx_path: Path, max_elements: int) -> Path | None:
    """None when ``onnx_path`` has no external data; else a copy beside it whose external initializers of fewer
    than ``max_elements`` elements (those the importer inlines as constants) hold their data, the others still
    referring to the same files."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    if not any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        return None
    inline_importer_constants(model, onnx_path.parent, max_elements)
    path = onnx_path.with_name(onnx_path.stem + ".large-import.onnx")
    onnx.save(model, str(path))
    return path


def inline_importer_constants(model, base_dir: Path, max_elements: int) -> None:
    """Load into ``model`` (an ``onnx.ModelProto`` read without external data) the data of its external
    initializers of fewer than ``max_elements`` elements: those the importer inlines into the module as constants
    (the others it externalizes as parameters)."""
    import onnx

    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL and int(np.prod(t.dims, dtype=np.int64)) < max_elements:
            spill.inline_external(t, str(base_dir))  # (not onnx's reader: it refuses the backend's source links)


def entry_function_name(mlir_text: str) -> str:
    """Return the name of the only public ``func.func`` of a module (read through the MLIR bindings).

    Usable on the importer's output and on MLIR patched after import, as long as added helper
    functions are ``private``.

    Raises:
        ValueError: There is no public function, or more than one, or the text does not parse.
    """
    from iree.compiler import ir

    from rewrite.backends.mlir import MlirModule
    from rewrite.errors import BackendError

    try:
        mod = MlirModule(mlir_text, "MLIR")
    except BackendError as e:
        raise ValueError(str(e)) from None
    names = [ir.StringAttr(op.attributes["sym_name"]).value for op in mod.body.operations
             if op.operation.name == "func.func" and ("sym_visibility" not in op.attributes
                                                      or ir.StringAttr(op.attributes["sym_visibility"]).value == "public")]
    if len(names) != 1:
        raise ValueError(f"expected exactly one public func.func, found {len(names)}: {names}")
    return names[0]


def compile_mlir(
    mlir_path: Path,
    vmfb_path: Path,
    *,
    target: str = "llvm-cpu",
    extra_flags: Sequence[str] = (),
) -> None:
    """Compile MLIR (torch dialect from the importer, or anything iree-compile accepts) to a .vmfb.

    Args:
        mlir_path: The MLIR text file.
        vmfb_path: Where to write the module (overwritten; parent directories are created).
        target: ``"llvm-cpu"`` (this machine's CPU, ``--iree-llvmcpu-target-cpu=host``) or
            ``"cuda"`` (``--iree-cuda-target=sm_80``; compiling needs no GPU). Run the result with
            the driver ``DRIVER_FOR_TARGET[target]``.
        extra_flags: More iree-compile flags. A ``--name=value`` flag whose name is one of the
            target's defaults replaces that default (e.g. ``--iree-cuda-target=sm_90``): a repeated
            flag is not last-wins in iree-compile (two ``--iree-cuda-target`` flags fail with
            "missing GPU target").

    The full compiler output, preceded by the command line, is written to ``compile.log`` next to
    ``vmfb_path`` (overwritten by every compile into that directory). iree-compile runs in ``mlir_path``'s
    folder: relative object paths in the MLIR (``#hal.executable.object<{path = "kernels/x.o"}>``) resolve there.

    With the environment variable ``REWRITE_IREE_COMPILE_CACHE`` naming a folder, a module compiled before from the
    same inputs (:func:`_compile_key`) is copied from there instead of compiled again (``compile.log``: the command,
    the compiler output of that compile, then a line naming the cache entry), and a new one is stored there with
    its output. Flags that make iree-compile write other files (``dump``) bypass the cache; a cache that cannot be
    written to is skipped, not an error.

    Raises:
        ValueError: ``target`` is unknown.
        IreeCompileError: iree-compile failed; the one-line message names ``mlir_path``, the first
            ``error:`` line and the log file.
    """
    if target not in _TARGET_FLAGS:
        raise ValueError(f"unknown IREE target {target!r}; expected one of {sorted(_TARGET_FLAGS)}")
    mlir_path, vmfb_path = Path(mlir_path), Path(vmfb_path)
    vmfb_path.parent.mkdir(parents=True, exist_ok=True)
    vmfb_path.unlink(missing_ok=True)
    overridden = {flag.split("=", 1)[0] for flag in extra_flags}
    flags = [f for f in _TARGET_FLAGS[target] if f.split("=", 1)[0] not in overridden] + list(extra_flags)
    # run in the MLIR's folder with relative paths: kernel objects the MLIR names relative to its folder
    # resolve there, and neither the log nor the module's locations record where the folder was made
    cmd = [_iree_compile_binary(), mlir_path.name, "-o", os.path.relpath(vmfb_path, mlir_path.parent), *flags]
    log_path = vmfb_path.parent / "compile.log"
    cache = os.environ.get(COMPILE_CACHE_ENV)
    key = _compile_key(cmd[0], mlir_path, flags) if cache and not any("dump" in f for f in flags) else None
    cached = Path(os.path.abspath(cache)) / f"{key}.vmfb" if key else None
    if cached is not None and cached.is_file() and cached.with_suffix(".log").is_file():
        shutil.copyfile(cached, vmfb_path)
        log_path.write_text(" ".join(cmd) + "\n\n" + cached.with_suffix(".log").read_text()
                            + f"\n(not compiled again: the module of compile-cache entry {key})\n")
        return
    with stage("iree compile"):
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=mlir_path.parent)
    log_path.write_text(" ".join(cmd) + "\n\n" + proc.stdout + proc.stderr)
    if proc.returncode != 0 or not vmfb_path.exists():
        raise IreeCompileError(
            f"iree-compile ({target}) of {mlir_path} failed: "
            f"{_failure_summary(proc.returncode, proc.stderr)} [full log: {log_path}]"
        )
    if cached is not None:
        _store(cached, vmfb_path, proc.stdout + proc.stderr)


def _store(cached: Path, vmfb_path: Path, output: str) -> None:
    """The module at ``cached`` (its compiler output beside it, ``.log``), each file whole or not at all: a copy
    renamed into place, the log first (a module is read only with its log). A cache that cannot be written is
    skipped: the compile itself succeeded."""
    parts = []
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        for dest, write in ((cached.with_suffix(".log"), lambda f: f.write(output.encode())),
                            (cached, lambda f: f.write(vmfb_path.read_bytes()))):
            fd, part = tempfile.mkstemp(dir=cached.parent, prefix=f".{cached.stem[:16]}-", suffix=".part")
            parts.append(part)
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.replace(part, dest)
    except OSError:
        for part in parts:
            Path(part).unlink(missing_ok=True)


#: environment variable: a folder of compiled modules that :func:`compile_mlir` reuses by their inputs
COMPILE_CACHE_ENV = "REWRITE_IREE_COMPILE_CACHE"


def _compile_key(tool: str, mlir_path: Path, flags: Sequence[str]) -> str:
    """SHA-256 (hex) of what iree-compile's output depends on: the compiler (its package's version, the binary's
    path, size and modification time), the flags (with a ``--iree-llvmcpu-target-cpu*=host`` flag, this machine's
    architecture and CPU model and feature lines of /proc/cpuinfo), the MLIR text and the bytes of every file it
    names with ``path = "..."`` (kernel objects, relative to its folder)."""
    from iree.compiler import version as compiler_version

    h = hashlib.sha256()
    st = os.stat(tool)
    h.update(f"{compiler_version.VERSION}\0{compiler_version.REVISIONS}\0{tool}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    h.update("\0".join(flags).encode())
    if any(f.startswith("--iree-llvmcpu-target-cpu") and f.endswith("=host") for f in flags):
        cpuinfo = Path("/proc/cpuinfo")
        lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
        cpu = {ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU implementer", "CPU part",
                                                    "CPU variant"))}
        h.update("\n".join([platform.machine(), platform.processor(), *sorted(cpu)]).encode())
    text = mlir_path.read_bytes()
    h.update(text)
    for name in sorted(set(re.findall(rb'path = "([^"]+)"', text))):
        named = mlir_path.parent / name.decode()
        h.update(b"\0" + name + b"\0" + (named.read_bytes() if named.is_file() else b"(missing)"))
    return h.hexdigest()


def _iree_compile_binary() -> str:
    # The binary shipped inside the iree-base-compiler wheel: independent of PATH, and it skips the
    # pyenv/console-script shim that `iree-compile` on PATH may be. Imported here: running a compiled module
    # needs only iree-base-runtime.
    from iree.compiler.tools.binaries import find_tool

    return find_tool("iree-compile")


def _failure_summary(returncode: int, log: str) -> str:
    """The key line of a failed tool's output: its first MLIR ``error:`` diagnostic (``at node 'n': ...`` when it
    is located at an ONNX node; after a target backend's ``ERROR:`` line when it has no location), else the last
    Python exception line (with an ONNX checker ``==> Context:`` line appended), else the last
    non-empty line; or the signal that killed it. At most ``_MAX_MESSAGE_CHARS`` characters."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    lines = [line.rstrip() for line in log.splitlines() if line.strip()]
    key = next((line.strip() for line in lines if re.search(r"(^|\s)error:", line)), None)
    target = next((line.strip() for line in lines if line.startswith("ERROR: ")), None)
    named = _NODE_DIAGNOSTIC_RE.match(key) if key else None
    if named:  # an op located at its ONNX node (the importer names locations after nodes; "" when unnamed)
        key = f"at node '{named.group(1)}': {named.group(2)}" if named.group(1) else f"error: {named.group(2)}"
    elif key is not None and key.startswith("<unknown>") and target:  # a target backend's own message says more
        key = f"{target}; {key}"
    if key is None:
        exc = [i for i, line in enumerate(lines) if _EXCEPTION_LINE_RE.match(line)]
        if exc:
            i = exc[-1]
            key = _EXCEPTION_LINE_RE.sub(r"\1", lines[i])
            if i + 1 < len(lines) and lines[i + 1].startswith("==> Context:"):
                key += "; " + lines[i + 1].removeprefix("==> ")
        elif lines:
            key = lines[-1]
        else:
            key = f"exit status {returncode}, no output"
    return key if len(key) <= _MAX_MESSAGE_CHARS else key[: _MAX_MESSAGE_CHARS - 3] + "..."


#: an MLIR diagnostic at a name location: ``<unknown>:0: error: loc("node"): message``
_NODE_DIAGNOSTIC_RE = re.compile(r'^<unknown>:0: error: loc\("((?:[^"\\]|\\.)*)"\): (.*)$')

# `pkg.mod.SomeError: message`, unindented, closing a Python traceback; group 1 drops the module path.
_EXCEPTION_LINE_RE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception|Exit)(?::\s.*)?)$")


class IreeModule:
    """A compiled IREE module loaded for one driver, with state that persists across calls.

    Args:
        vmfb_path: The compiled module.
        params_path: The .irpa written by :func:`import_onnx`, required when the module was imported
            with externalized parameters (scope :data:`PARAMS_SCOPE`). The file is memory-mapped.
        driver: ``"local-task"`` for ``llvm-cpu`` modules, ``"cuda"`` for ``cuda`` modules (see
            :data:`DRIVER_FOR_TARGET`). The device is shared by all modules of a process.

    One VM context is kept for the object's life, so ``util.global`` state (e.g. a KV cache) carries
    from one call to the next; :meth:`reset` starts a fresh context with initial state.

    Raises:
        IreeRuntimeError: The driver has no device, or the module or parameter file cannot be loaded.
    """

    def __init__(self, vmfb_path: Path, *, params_path: Path | None = None, driver: str = "local-task"):
        self.vmfb_path = Path(vmfb_path)
        self.params_path = None if params_path is None else Path(params_path)
        self.driver = driver
        try:
            self._device = rt.get_device(driver)  # cached per process: a device can serve many contexts
            self._instance = rt.VmInstance()
            self._main = rt.VmModule.mmap(self._instance, str(self.vmfb_path))
            modules = []
            if self.params_path is not None:
                index = rt.ParameterIndex()
                index.load(str(self.params_path))
                provider = index.create_provider(scope=PARAMS_SCOPE)
                modules.append(rt.create_io_parameters_module(self._instance, provider))
            modules += [rt.create_hal_module(self._instance, self._device), self._main]
        except (RuntimeError, ValueError, OSError) as e:
            raise IreeRuntimeError(
                f"cannot load {self.vmfb_path} (params {self.params_path}, driver {driver}): {_first_line(e)}"
            ) from None
        self._modules = modules  # dependencies before the module that imports them
        self._timeline: list | None = None  # [semaphore, last value] ordering submit()'s calls
        self._read_slots: dict[int, list] = {}  # byte size -> free (host buffer, semaphore, value) of read_later
        self._async_fns: dict[str, object] = {}  # function name -> its NAME$async (or None)
        # `__init` runs once per context; `NAME$async` is the fence-taking twin of `NAME`.
        self.function_names: tuple[str, ...] = tuple(
            n for n in self._main.function_names if not n.startswith("__") and "$" not in n
        )
        """The callable functions (for an imported ONNX model: its graph name)."""
        self.reset()

    def reset(self) -> None:
        """Discard all module state: the next call sees ``util.global`` values at their initial values. Calls
        still queued by :meth:`submit` are waited for first (their errors ignored), and :meth:`submit` starts a
        new timeline (a semaphore that saw a failed call stays failed)."""
        self.drain()
        self._timeline = None
        try:
            self._context = rt.VmContext(self._instance, modules=self._modules)
        except (RuntimeError, ValueError) as e:  # e.g. parameters needed but no params_path given
            raise IreeRuntimeError(
                f"cannot start {self.vmfb_path} (params {self.params_path}): {_first_line(e)}"
            ) from None
        self._invokers: dict[str, rt.FunctionInvoker] = {}  # invokers are bound to one context

    def __call__(self, *inputs: np.ndarray | int | float, function: str | None = None) -> list[np.ndarray]:
        """Run a function and return its results as host numpy arrays.

        Args:
            inputs: One value per function argument, in argument order (for an imported ONNX
                model: ``graph.input`` order without initializers, all tensors).

                - Tensor arguments take an ``np.ndarray`` whose dtype equals the declared element
                  type exactly; nothing is cast (float64 into an f32 argument fails). ``bool`` and
                  ``int8`` are interchangeable (IREE stores i1 as a byte). Any memory layout is
                  accepted, and zero-size dimensions (e.g. an empty KV past ``[1, 4, 0, 32]``)
                  work. A numpy scalar (``np.float32(1)``) is taken as a 0-d array.
                - Scalar arguments (``i64``/``f32`` rather than ``tensor<...>``; hand-written MLIR
                  only, the importer never emits them) take a Python ``int`` or ``float``: the
                  runtime refuses numpy scalars and 0-d arrays there.
            function: Which of :attr:`function_names` to call; may be omitted when there is only one.

        Returns:
            A list with one array per result (a one-element list for a single result), each a copy
            owned by the caller, so later calls that update module state cannot change it.

        Raises:
            TypeError: An input is neither a numpy array, a numpy scalar, nor a Python int/float.
            ValueError: ``function`` is missing and ambiguous, or unknown.
            IreeRuntimeError: The runtime rejected the call (wrong arity, dtype or static shape) or
                the function failed; the message is one line.
        """
        name = self._resolve_function(function)
        args = []
        for i, x in enumerate(inputs):
            if isinstance(x, np.generic):
                x = np.asarray(x)
            # bool is an int subclass but would silently become an i64 scalar: refuse it.
            if not isinstance(x, (np.ndarray, int, float)) or isinstance(x, bool):
                raise TypeError(f"input {i} of {name} is a {type(x).__name__}; pass a numpy array with an explicit dtype")
            args.append(x)
        invoker = self._invokers.get(name)
        if invoker is None:
            invoker = self._invokers[name] = rt.FunctionInvoker(
                self._context, self._device, self._main.lookup_function(name)
            )
        try:
            results = invoker(*args)
        except (RuntimeError, ValueError) as e:
            signature = ", ".join(f"{a.dtype}{list(a.shape)}" if isinstance(a, np.ndarray) else repr(a) for a in args)
            raise IreeRuntimeError(f"{self.vmfb_path}: {name}({signature}) failed: {_first_line(e)}") from None
        # Without ABI reflection (the importer emits none) the invoker returns None, one array, or a tuple.
        if results is None:
            results = ()
        elif not isinstance(results, tuple):
            results = (results,)
        return [self._to_host(r) for r in results]

    def _to_host(self, result) -> np.ndarray:
        """A host copy of one result. A device-local buffer (CUDA) is copied into a host-local staging buffer
        kept for the module's life (:meth:`read_later`), then out of it, instead of page-locked host memory allocated
        and freed by the driver in every call (a decode step of Qwen1.5-MoE-A2.7B on an H200 took 9.5 ms with
        that, 8.6 ms without, together with the one-row MatMulInt4 kernels: BENCHMARKS.md). Not
        ``DeviceArray.to_host``, which registers a fresh numpy array with the driver (``import_host_allocation``):
        CUDA registers whole pages, so a second small result whose array shares a page with a still-registered one
        fails with ``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`` (seen on an H200 with iree-base-runtime 3.13,
        depending on where numpy placed the arrays)."""
        view = getattr(result, "_buffer_view", None)
        if view is None or result._is_mappable():
            return np.array(result.to_host(), copy=True)  # host-visible (local-task): mapped, then copied
        out = self.read_later(view)()
        raw = out.dtype
        override = getattr(result, "_override_dtype", None)  # bool results: stored as bytes
        return out.astype(override) if override is not None and override != raw else out

    def upload(self, array: np.ndarray) -> "rt.HalBufferView":
        """A device copy of ``array`` (its dtype and shape) for :meth:`submit`.

        Raises:
            IreeRuntimeError: the dtype has no IREE element type, or the device cannot allocate it.
        """
        try:
            return rt.asdevicearray(self._device, np.ascontiguousarray(array))._buffer_view
        except (RuntimeError, ValueError) as e:
            raise IreeRuntimeError(f"{self.vmfb_path}: cannot upload a {array.dtype}{list(array.shape)} array: "
                                   f"{_first_line(e)}") from None

    def submit(self, inputs: list["rt.HalBufferView"], *, function: str | None = None
               ) -> tuple[list["rt.HalBufferView"], "rt.HalFence"]:
        """Queue one call of ``function`` through its fence-taking twin (``NAME$async``, IREE's async-external
        ABI) and return without waiting for it: its results (device buffer views, valid once the returned fence
        is reached) and that fence. Each call's queue work waits for the previous :meth:`submit`'s, so calls
        that share module state (a stateful KV cache) run in submission order while the host queues the next.

        Args:
            inputs: one device buffer view per argument (:meth:`upload`, or an earlier call's result).

        Raises:
            ValueError: ``function`` is missing and ambiguous, or unknown.
            IreeRuntimeError: the module has no ``NAME$async`` function, or the runtime rejected the call.
        """
        name = self._resolve_function(function)
        fn = self._async_function(name)
        if fn is None:
            raise IreeRuntimeError(f"{self.vmfb_path}: no {name}$async function (compiled without the async-external ABI)")
        if self._timeline is None:
            self._timeline = [self._device.create_semaphore(0), 0]
        sem, value = self._timeline
        args = rt.VmVariantList(len(inputs) + 2)
        for view in inputs:
            args.push_ref(view)
        signal = rt.HalFence.create_at(sem, value + 1)
        args.push_ref(rt.HalFence.create_at(sem, value))
        args.push_ref(signal)
        results = rt.VmVariantList(4)
        try:
            self._context.invoke(fn, args, results)
        except (RuntimeError, ValueError) as e:
            raise IreeRuntimeError(f"{self.vmfb_path}: {name}$async failed: {_first_line(e)}") from None
        self._timeline[1] = value + 1
        return [results.get_as_object(i, rt.HalBufferView) for i in range(results.size)], signal

    def has_async(self, function: str | None = None) -> bool:
        """Whether ``function`` has the fence-taking twin :meth:`submit` calls (``NAME$async``)."""
        return self._async_function(self._resolve_function(function)) is not None

    def _async_function(self, name: str):
        if name not in self._async_fns:  # looked up once: submit() is on the decode loop's path
            self._async_fns[name] = self._main.lookup_function(f"{name}$async")
        return self._async_fns[name]

    def drain(self) -> None:
        """Wait until every call queued by :meth:`submit` has finished; a failed call's error is ignored here
        (it was or will be reported by the read that waits for it)."""
        if self._timeline is not None:
            sem, value = self._timeline
            try:
                rt.HalFence.create_at(sem, value).wait()
            except RuntimeError:
                pass

    def read_later(self, view: "rt.HalBufferView", after: "rt.HalFence | None" = None) -> Callable[[], np.ndarray]:
        """Queue a copy of ``view`` (a :meth:`submit` result; a finished call's result without ``after``) into
        host-local memory once ``after`` is reached and return a function that waits for that copy and returns
        the array (the view's element type). The copy is queued now, right behind the call that writes ``view``,
        so reading it does not wait for calls submitted later. Host buffers and their semaphores are reused once
        read (pinned allocations cost the driver more than the copy)."""
        source = view.get_buffer()
        size = source.byte_length()
        free = self._read_slots.setdefault(size, [])
        if free:
            host, sem, value = free.pop()
        else:
            host = self._device.allocator.allocate_buffer(
                memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
                allowed_usage=int(rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED),
                allocation_size=size,
            )
            sem, value = self._device.create_semaphore(0), 0
        if after is None:
            after = rt.HalFence.create_at(sem, value)  # already reached
        try:
            self._device.queue_copy(source, host, wait_semaphores=after,
                                    signal_semaphores=rt.HalFence.create_at(sem, value + 1))
        except RuntimeError as e:
            raise IreeRuntimeError(f"{self.vmfb_path}: cannot queue a result's copy: {_first_line(e)}") from None
        dtype = rt.HalElementType.map_to_dtype(view.element_type)
        shape = list(view.shape)

        def wait() -> np.ndarray:
            try:
                rt.HalFence.create_at(sem, value + 1).wait()
            except RuntimeError as e:  # a queued call that failed on the device is reported here
                raise IreeRuntimeError(f"{self.vmfb_path}: a queued call failed: {_first_line(e)}") from None
            out = np.array(host.map().asarray(shape, dtype), copy=True)
            free.append((host, sem, value + 1))
            return out

        return wait

    @property
    def device(self) -> "rt.HalDevice":
        """The HAL device the module runs on (for ``iree.runtime.asdevicearray``)."""
        return self._device

    def invoker(self, function: str | None = None) -> "rt.FunctionInvoker":
        """The runtime's invoker of ``function`` in this module's context: it takes device arrays
        (``iree.runtime.asdevicearray(module.device, a)``) and returns device arrays, copying nothing to or
        from the host; for timing a module without the transfers :meth:`__call__` makes."""
        name = self._resolve_function(function)
        if name not in self._invokers:
            self._invokers[name] = rt.FunctionInvoker(self._context, self._device, self._main.lookup_function(name))
        return self._invokers[name]

    def _resolve_function(self, function: str | None) -> str:
        if function is None:
            if len(self.function_names) != 1:
                raise ValueError(f"{self.vmfb_path} has functions {list(self.function_names)}; pass function=")
            return self.function_names[0]
        if function not in self.function_names:
            raise ValueError(f"{self.vmfb_path} has no function {function!r}; it has {list(self.function_names)}")
        return function


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line if len(line) <= _MAX_MESSAGE_CHARS else line[: _MAX_MESSAGE_CHARS - 3] + "..."
