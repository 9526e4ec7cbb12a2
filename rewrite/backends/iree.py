"""The ``iree`` backend: IREE's ONNX importer, then iree-compile, run through iree.runtime.

Steps in the output folder: ``model.onnx`` (rewritten, with value_info on every value) -> ``model.mlir``
(+ ``model.irpa`` holding initializers of at least ``param_threshold`` elements) -> ``model.vmfb``.
Between import and compile the module is held through the MLIR bindings (:mod:`rewrite.backends.mlir`): the
abstract ops' lowerings are patched in (:mod:`rewrite.backends.iree_patch`), ``--stateful`` moves the KV cache
into module state (:mod:`rewrite.backends.iree_stateful`), and the module is verified before it is written.
Those modules import the compiler package and are imported only here, when lowering: running a folder needs
``iree-base-runtime`` alone, and so does writing one with ``--module-from`` (a module compiled on another machine
from the same rewritten graph, :mod:`rewrite.backends.iree_prebuilt`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from rewrite.backends.base import Manifest, check_feeds
from rewrite.backends.errors import IreeRuntimeError
from rewrite.backends.iree_argmax import OP_TYPE as ROW_ARGMAX
from rewrite.backends.iree_argmax import lower_row_argmax, use_row_argmax
from rewrite.backends.iree_import import RAW_PARAM_TYPES
from rewrite.backends.iree_prebuilt import graph_digest, host_cpu, reuse_module, write_params_index
from rewrite.backends.iree_toolchain import DRIVER_FOR_TARGET, IreeModule, compile_mlir, import_onnx
from rewrite.core import onnx_io, spill
from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.analysis import REDUCE_OPS, known_before_run
from rewrite.core.feeds import input_specs, specs_of
from rewrite.core.iree_lowering import PatchContext
from rewrite.core.kernels import DEFAULT_CUDA_ARCH
from rewrite.core.ir import Graph
from rewrite.errors import BackendError, InputError

#: decode calls queued ahead of the host by :meth:`IreeRunner.greedy_decode`: enough for the host to prepare the
#: next call while the device runs the current one, few enough to bound the memory of calls in flight
DECODE_WINDOW = 4
DEFAULT_PARAM_THRESHOLD = 4096  #: initializers with at least this many elements go to the .irpa
#: For --stateful modules. The importer's shape assertions ("Expected dim size > 0" per dynamic dim, torch-mlir)
#: become host branches that split a decode step into one command buffer, queue submission and transient
#: allocation per assertion (iree-compile 3.13: 12 submissions per call of a 2-layer seed form, one without). A
#: stateful module's only dynamic dim is the token count, checked by :class:`IreeRunner` instead (> 0, one size).
STRIP_ASSERTIONS = "--iree-opt-strip-assertions"


class IreeRunner:
    """A compiled module; inputs by name in graph-input order, outputs by name."""

    def __init__(self, folder: Path, manifest: Manifest):
        params = manifest.files.get("params")
        self.module = IreeModule(
            folder / manifest.files["vmfb"],
            params_path=(folder / params) if params else None,
            driver=DRIVER_FOR_TARGET[manifest.target],
        )
        self.function = manifest.entry_function
        self.input_specs = manifest.input_specs
        self.input_names = [s.name for s in self.input_specs]
        self.decoder = manifest.decoder_interface
        self.output_names = [d["name"] for d in manifest.outputs]
        self.state = manifest.state
        self.where = str(folder)
        self.defaults = _input_defaults(folder / manifest.model, [s.name for s in self.input_specs if s.default])
        self._positions: dict[int, dict] = {}  # position -> its inputs on the device (greedy_decode)
        self._mask = None  # the attention mask of ones on the device (greedy_decode)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Raises:
            InputError: :func:`check_feeds` refuses the feeds, or a stateful module is given an empty input
                (compiled without its shape assertions, :data:`STRIP_ASSERTIONS`)."""
        args = check_feeds(self.input_specs, feeds, self.where, self.decoder, self.defaults)
        if self.state:
            empty = next((n for n, a in args.items() if 0 in np.shape(a)), None)
            if empty is not None:
                raise InputError(f"{self.where}: input '{empty}' has shape {list(np.shape(args[empty]))}; a stateful "
                                 "module takes at least one token per call")
        outs = self.module(*args.values(), function=self.function)
        return dict(zip(self.output_names, outs))

    def reset(self) -> None:
        """Module state (a stateful KV cache) back to its initial zeros."""
        self.module.reset()

    @property
    def decodes_on_device(self) -> bool:
        """Whether :meth:`greedy_decode` can run: a stateful module with the ``next_token`` output (``rewrite apply
        --next-token``) whose inputs are ``input_ids``, int64 ``[1, 1]`` (compiled for one token per call:
        ``--dim <seq>=1``), ``seq_position``, and optionally ``position_ids`` ``[1, 1]`` and a static
        ``attention_mask`` ``[1, M]`` (transformers' exports; fed the position and ones, as
        :meth:`rewrite.generate.Generator.step` feeds them). A module with a dynamic token count records its
        command buffer at each call with the call's buffers, which the local-task driver refuses while an
        earlier call still holds the queue ("transient buffer has not been committed", iree-base-runtime 3.13)."""
        d = self.decoder
        if not self.state or d is None or d.next_token is None or d.next_token not in self.output_names:
            return False
        specs = {s.name: s for s in self.input_specs}
        optional = {d.position_ids, d.attention_mask} - {None}
        if d.seq_position is None or not {d.input_ids, d.seq_position} <= set(specs) <= {d.input_ids, d.seq_position} | optional:
            return False
        ids, pos_ids, mask = specs[d.input_ids], specs.get(d.position_ids), specs.get(d.attention_mask)
        return (ids.np_dtype == np.int64 and tuple(ids.shape) == (1, 1)
                and (pos_ids is None or tuple(pos_ids.shape) == (1, 1))
                and (mask is None or (len(mask.shape) == 2 and mask.shape[0] == 1 and isinstance(mask.shape[1], int)))
                and self.module.has_async(self.function))

    def greedy_decode(self, tokens: int | Sequence[int], position: int, count: int, window: int = DECODE_WINDOW
                      ) -> list[int]:
        """Calls on the device from ``position``: one per token of ``tokens`` (an int: one token), fed those tokens
        (a prompt, one token per call), then ``count - 1`` greedy decode calls, each fed the previous call's
        ``next_token`` output, which never leaves the device. Calls are queued ahead of the host
        (:meth:`IreeModule.submit`), the host waiting for the oldest once ``window`` more are queued; the
        ``next_token`` of the last given token's call and of each decode call is copied back right behind its call
        and read then. Returns those ``count`` tokens: the ones of feeding each argmax back from the host (ties go
        to the first index). When a call fails, the calls queued before it are waited for before the error is
        raised; the module's state then holds the rows of the calls that ran (reset it).

        Raises:
            InputError: the module cannot decode this way (:attr:`decodes_on_device` is False), ``tokens`` is
                not an int or a sequence of ints, no token is given or ``count`` < 1, a token is outside
                ``[0, vocab)``, or the calls would write past the state's positions.
            IreeRuntimeError: the runtime refused a call, or a call failed on the device.
        """
        if not self.decodes_on_device:
            raise InputError(f"{self.where}: greedy_decode needs a stateful module with a next_token output taking "
                             "one token per call (rewrite apply --stateful --next-token --dim <seq>=1)")
        single = isinstance(tokens, (int, np.integer)) and not isinstance(tokens, bool)
        if not single and (isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) or not all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in tokens)):
            raise InputError(f"{self.where}: greedy_decode takes token ids: an int or a sequence of ints, not {tokens!r}")
        given = [int(tokens)] if single else [int(t) for t in tokens]
        if not given or count < 1:
            raise InputError(f"{self.where}: greedy_decode needs at least one token and count >= 1 "
                             f"({len(given)} token(s), count {count})")
        vocab = self.decoder.vocab
        bad = next((t for t in given if vocab is not None and not 0 <= t < vocab), None)
        if bad is not None:
            raise InputError(f"{self.where}: token {bad} is outside the vocabulary [0, {vocab})")
        calls = len(given) + count - 1
        st = self.state[0]
        positions = st["shape"][1 + (st["axis"] if st.get("axis") is not None else 2)]
        if position < 0 or position + calls > positions:  # IREE's slice insert has no bounds check
            raise InputError(f"{self.where}: {calls} call(s) from position {position} exceed the state's "
                             f"{positions} positions")
        d, specs = self.decoder, {s.name: s for s in self.input_specs}
        nt = self.output_names.index(d.next_token)
        # every input is on the device before the first call is queued (an upload may wait for the queue's
        # work), each position's once per runner
        for p in range(position, position + calls):
            if p not in self._positions:
                self._positions[p] = {d.seq_position: self.module.upload(np.array([p], specs[d.seq_position].np_dtype))}
                if d.position_ids in specs:
                    self._positions[p][d.position_ids] = self.module.upload(np.array([[p]], specs[d.position_ids].np_dtype))
        if d.attention_mask in specs and self._mask is None:
            mask = specs[d.attention_mask]
            self._mask = self.module.upload(np.ones(mask.shape, mask.np_dtype))
        fed = [self.module.upload(np.array([[t]], np.int64)) for t in given]
        pending, out = [], []  # pending: (fence, read or None) of each queued call, oldest first
        try:
            for k in range(calls):
                ids = fed[k] if k < len(given) else ids
                feeds = {d.input_ids: ids, d.attention_mask: self._mask, **self._positions[position + k]}
                outs, done = self.module.submit([feeds[s.name] for s in self.input_specs], function=self.function)
                ids = outs[nt]
                pending.append((done, self.module.read_later(ids, done) if k >= len(given) - 1 else None))
                if len(pending) > window:
                    self._finish(pending.pop(0), out)
            for call in pending:
                self._finish(call, out)
        except BaseException:  # (an interrupt too) no call may still run on the state once this returns
            self.module.drain()
            raise
        return out

    def _finish(self, call: tuple, out: list[int]) -> None:
        """Wait for a queued call of :meth:`greedy_decode` (its fence, and the reader of its token or None): append
        its token to ``out``, or, a prompt call whose token is not wanted, wait for its fence.

        Raises:
            IreeRuntimeError: the call, or one queued before it, failed on the device.
        """
        done, read = call
        if read is not None:
            out.append(int(read()[0, 0]))
            return
        try:
            done.wait()
        except RuntimeError as e:
            first = next(iter(str(e).splitlines()), "") or type(e).__name__
            raise IreeRuntimeError(f"{self.module.vmfb_path}: a queued call failed: {first}") from None

    def read_state(self) -> dict[str, np.ndarray]:
        """Each state global's current value by name (manifest ``state``; empty for a stateless module)."""
        return {s["name"]: self.module(function=s["getter"])[0] for s in self.state}


def _input_defaults(model_path: Path, names: list[str]) -> dict[str, np.ndarray]:
    """The initializer defaults of the inputs ``names``, read from the folder's ``model.onnx`` (the compiled
    module takes them as arguments: a call that leaves one out gets this value, as on ONNX Runtime)."""
    if not names:
        return {}
    model = onnx.load(str(model_path), load_external_data=False)
    by_name = {t.name: t for t in model.graph.initializer}
    return {n: numpy_helper.to_array(by_name[n], str(model_path.parent)) for n in names}


def _import_model(onnx_path: Path, graph: Graph) -> Path:
    """The file to import: ``onnx_path`` itself, or, when inputs have initializer defaults, a copy beside it
    without those initializers (IREE's importer would make them constants, so a caller could not override
    them); its external data references resolve to the same files."""
    defaults = set(graph.overridable_inputs())
    if not defaults:
        return onnx_path
    model = onnx.load(str(onnx_path), load_external_data=False)
    kept = [t for t in model.graph.initializer if t.name not in defaults]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    path = onnx_path.with_name(onnx_path.stem + ".import.onnx")
    onnx.save(model, str(path))
    return path


#: bytes; an external initializer the .irpa does not hold (below the parameter threshold) that is smaller than this
#: moves inline when the folder's model.onnx is pointed at the .irpa
_INLINE_MAX_BYTES = 1 << 20


def share_params(onnx_path: Path, params_path: Path, spans: dict[str, tuple[int, int]]) -> None:
    """Point the initializers of the folder's ``onnx_path`` at their bytes in the ``.irpa`` (ONNX external data
    with ``location`` = the ``.irpa``; ``spans``: name -> (offset, length) from the import), so the weights are on
    disk once, not in ``model.onnx.data`` and again in the ``.irpa``. External initializers the ``.irpa`` does not
    hold move inline when small, and those left in a link to a source data file (``onnx_io.save``'s
    ``link_source``) are copied into the folder's data file; a data file or link is deleted once nothing refers to
    it."""
    try:
        _share_params(onnx_path, params_path, spans)
    except OSError as e:
        raise BackendError(f"{onnx_path}: cannot point its initializers at {params_path.name} ({e})") from e


def _share_params(onnx_path: Path, params_path: Path, spans: dict[str, tuple[int, int]]) -> None:
    model = onnx.load(str(onnx_path), load_external_data=False)
    folder = onnx_path.parent
    old_files = {onnx_path.name + ".data"}  # onnx_io.save's data file, left empty where every tensor went to a link
    for t in model.graph.initializer:
        location = {e.key: e.value for e in t.external_data}.get("location") if t.data_location == onnx.TensorProto.EXTERNAL else None
        if location is not None:
            old_files.add(location)
        if t.name in spans:
            onnx_io.point_external(t, params_path.name, *spans[t.name])
        elif location is not None and (spill.external_info(t)[2] or _INLINE_MAX_BYTES) < _INLINE_MAX_BYTES:
            spill.inline_external(t, str(folder))  # (not onnx's reader: it refuses the source links)
    links = onnx_io.source_links(onnx_path, old_files)
    left = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
            and spill.external_info(t)[0] in links]
    if left:  # the output folder must not depend on the source model (nor share its file)
        _copy_into_data_file(left, folder, onnx_path.name + ".data")
    still = {e.value for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
             for e in t.external_data if e.key == "location"}
    onnx.save(model, str(onnx_path))
    for location in old_files - still - {params_path.name}:
        (folder / location).unlink(missing_ok=True)


def _copy_into_data_file(tensors: list[onnx.TensorProto], folder: Path, data_name: str) -> None:
    """Append the external bytes of ``tensors`` to ``folder/data_name`` (64-byte aligned, as ``onnx_io.save``
    writes it) and point them there."""
    with open(folder / data_name, "ab") as out:
        for t in tensors:
            location, offset, length = spill.external_info(t)
            out.write(b"\0" * ((-out.tell()) % 64))
            start = out.tell()
            onnx_io.copy_span(str(folder / location), offset, length, out, t.name)
            onnx_io.point_external(t, data_name, start, length)


#: iree-compile's flag that keeps float64 as float64 (its default demotes every f64 to f32)
KEEP_F64 = "--iree-input-demote-f64-to-f32=false"


def refuse_unsupported(graph: Graph) -> None:
    """Nodes IREE 3.13 is known not to compile, and graph inputs or outputs its runtime cannot pass, refused before
    importing with the node or value and the reason (its own error names an internal torch op, not the ONNX node).

    Raises:
        BackendError: a ``TopK`` with ``sorted=0`` (iree-compile: "failed to legalize operation
            'torch.constant.int'"); a Reduce op whose ``axes`` are known only at run time (iree-compile:
            "failed to legalize 'torch.aten.sum.dim_IntList'"); a graph input or output of strings (IREE has no
            string tensors: a module compiled from a pass-through string value cannot be called).
    """
    for name in (*graph.inputs, *graph.outputs):
        if graph.values[name].dtype == onnx.TensorProto.STRING:
            where = "input" if name in graph.inputs else "output"
            raise BackendError(f"graph {where} '{name}' is tensor(string): IREE has no string tensors (its runtime "
                               "cannot pass one to a module); lower this model with --backend ort")
    for n in graph.topo_nodes():
        if n.domain not in ("", "ai.onnx"):
            continue
        if n.op_type == "TopK" and n.attr("sorted", 1) == 0:
            raise BackendError(f"node {n.describe()}: TopK with sorted=0 is not supported by IREE's ONNX import "
                               "(iree-compile fails to legalize it); the topk plugin replaces grouped routers' "
                               "unsorted TopKs, other TopKs need sorted=1")
        if n.op_type in REDUCE_OPS and len(n.inputs) > 1 and n.inputs[1] and not known_before_run(graph, n.inputs[1]):
            hint = (" (a graph input with a default: --freeze-inputs makes it one)"
                    if graph.values[n.inputs[1]].overridable else "")
            raise BackendError(f"node {n.describe()}: axes '{n.inputs[1]}' are known only at run time, which IREE "
                               f"cannot lower (iree-compile fails to legalize the reduction); they must be a constant{hint}")


#: IREE 3.13's CUDA codegen fails an ArgMax (its arg_compare dispatch: "'func.func' op failed to distribute") over
#: 512, 768, 1024, 1536, 2560, 4096, 8192, 16384, 32768, 65536, 102400 (DeepSeek's vocabulary) and 131072 values,
#: every one a multiple of this; it compiled 256, 500, 513, 1000, 3000, 4097, 20000, 32000, 128256, 151936 and
#: 201088 (fp16 and fp32, --iree-cuda-target=sm_80, with and without --iree-dispatch-creation-opt-level=O3), and
#: ran for minutes without end on 102401 and 102408, so padding the input is no way round it either
_CUDA_ARGMAX_BAD_MULTIPLE = 256
# An ArgMax over 151,936 values takes IREE 3.13's CUDA codegen about 73 us (one workgroup reduces the row). Written
# in two stages in the graph (Reshape to [1187, 128], the rows' ArgMax and ReduceMax or GatherElements, then the
# ArgMax of the rows' maxima) it took 18.5 ms on an H100 (BENCHMARKS.md): IREE fuses the first stage into the
# second's dispatch, which then reduces all 151,936 values serially. The backend's own kernel takes it instead
# (rewrite/backends/iree_argmax.py); these reductions remain for the ArgMaxes it does not take.


def cuda_argmax_as_reductions(graph: Graph) -> int:
    """Replace each ArgMax that IREE's CUDA codegen may not compile (its reduced dim a static multiple of
    :data:`_CUDA_ARGMAX_BAD_MULTIPLE` of at least twice that; ``select_last_index=0``) with reductions it compiles
    for any size: ``m = ReduceMax(x)`` (kept dims), ``i = ReduceMin(Where(x == m, iota, N))``, ``Min(i, N - 1)``.
    The first index of the maximum, as ONNX ArgMax with ``select_last_index=0`` returns it (ONNX operator spec,
    ArgMax), ties and all -inf rows included; the ``Min`` keeps a row with a NaN (no element equal to its
    maximum) inside ``[0, N)``, where ArgMax gives some index too. Returns the count replaced. (The next token's
    ArgMax, ``rewrite apply --next-token``, is taken before this by the backend's own kernel when its shape is
    static: :func:`rewrite.backends.iree_argmax.use_row_argmax`; this meets one with a symbolic dim.)
    """
    opset = graph.opset("") or 1
    if opset < 13:  # ReduceMax/ReduceMin over int64 and Where's broadcasting as used here
        return 0
    replaced = 0
    for n in graph.nodes_by_op("ArgMax"):
        src = graph.values[n.inputs[0]]
        shape = src.shape
        if n.attr("select_last_index", 0) or shape is None:
            continue
        axis = n.attr("axis", 0) % len(shape)
        size = shape[axis]
        if not isinstance(size, int) or size < 2 * _CUDA_ARGMAX_BAD_MULTIPLE or size % _CUDA_ARGMAX_BAD_MULTIPLE:
            continue
        base = n.name or "argmax"
        keep = n.attr("keepdims", 1)

        def const(hint: str, array: np.ndarray) -> str:
            return graph.add_initializer(graph.fresh_name(f"{base}_{hint}"), array).name

        def reduce(op: str, x: str, keepdims: int, name: str) -> str:
            if opset >= 18:  # axes became an input
                graph.add_node(op, [x, const("axes", np.array([axis], np.int64))], [name], name=name, order=n.order,
                               attrs=[onnx.helper.make_attribute("keepdims", keepdims)])
            else:
                graph.add_node(op, [x], [name], name=name, order=n.order,
                               attrs=[onnx.helper.make_attribute("axes", [axis]),
                                      onnx.helper.make_attribute("keepdims", keepdims)])
            return name

        kept_shape = tuple(1 if i == axis else d for i, d in enumerate(shape))
        m = reduce("ReduceMax", src.name, 1, graph.fresh_name(f"{base}_max"))
        graph.values[m].set_type(src.dtype, kept_shape)
        eq = graph.fresh_name(f"{base}_is_max")
        graph.add_node("Equal", [src.name, m], [eq], name=eq, order=n.order)
        graph.values[eq].set_type(onnx.TensorProto.BOOL, shape)
        iota = const("iota", np.arange(size, dtype=np.int64).reshape((size,) + (1,) * (len(shape) - 1 - axis)))
        cand = graph.fresh_name(f"{base}_index")
        graph.add_node("Where", [eq, iota, const("none", np.array(size, np.int64))], [cand], name=cand, order=n.order)
        graph.values[cand].set_type(onnx.TensorProto.INT64, shape)
        first = reduce("ReduceMin", cand, keep, graph.fresh_name(f"{base}_first"))
        out_shape = kept_shape if keep else tuple(d for i, d in enumerate(shape) if i != axis)
        graph.values[first].set_type(onnx.TensorProto.INT64, out_shape)
        index = graph.fresh_name(f"{base}_clamped")
        graph.add_node("Min", [first, const("last", np.array(size - 1, np.int64))], [index], name=index, order=n.order)
        graph.values[index].set_type(onnx.TensorProto.INT64, out_shape)
        graph.replace_node(n, [index])  # a graph output keeps its name (the next token's)
        replaced += 1
    return replaced


class IreeBackend:
    name = "iree"
    targets = ("llvm-cpu", "cuda")

    def lower(self, graph: Graph, folder: Path, manifest: Manifest, *, options: dict, lowerings: dict) -> None:
        """``lowerings``: op_type -> IREE lowering function for ``manifest.target``."""
        refuse_unsupported(graph)
        if manifest.target == "cuda":
            if use_row_argmax(graph):  # the next token's ArgMax: a kernel of the backend's own
                lowerings = {**lowerings, ROW_ARGMAX: lower_row_argmax}
            cuda_argmax_as_reductions(graph)
        onnx_path = folder / manifest.model
        if not graph.name:  # the importer names the entry function after the graph and rejects ""
            graph.name = "main_graph"
        threshold = int(options.get("param_threshold", DEFAULT_PARAM_THRESHOLD))
        # the .irpa is written from it, then share_params points it there: the weights on disk once, not twice;
        # the source's parameters (read by file range into the .irpa) are linked, not copied, not a third time
        onnx_io.save(graph, onnx_path, rebase_spilled=True,
                     link_source=lambda t: t.data_type in RAW_PARAM_TYPES and math.prod(t.dims) >= threshold)
        model = onnx_io.to_model(graph)
        manifest.inputs = [s.to_json() for s in input_specs(model)]  # the entry function's arguments
        manifest.outputs = [s.to_json() for s in specs_of(model.graph.output)]
        sm = str(options.get("cuda_sm", DEFAULT_CUDA_ARCH))
        if not (sm.startswith("sm_") and sm[3:].isdigit()):
            raise BackendError(f"--cuda-sm {sm}: expected an NVIDIA SM architecture such as sm_80 or sm_90")
        if options.get("module_from"):
            spans, params_path = reuse_module(onnx_path, folder, manifest, Path(options["module_from"]),
                                              stateful=bool(options.get("stateful")), cuda_sm=sm)
            share_params(onnx_path, params_path, spans)  # (with no spans: what is left in source links copied)
            return
        digest = graph_digest(onnx_path, threshold)  # before share_params points the initializers at the .irpa
        import_path = _import_model(onnx_path, graph)
        try:
            res = import_onnx(
                import_path,
                folder / "model.mlir",
                params_path=folder / "model.irpa",
                param_threshold_elements=threshold,
            )
        finally:
            if import_path != onnx_path:
                import_path.unlink(missing_ok=True)
        manifest.files["param_index"] = write_params_index(folder, res.param_keys, threshold, digest)
        share_params(onnx_path, res.params_path, res.param_spans)
        from rewrite.backends.iree_patch import patch_module, unlowered_ops
        from rewrite.backends.iree_stateful import make_module_stateful
        from rewrite.backends.mlir import MlirModule

        used = {n.op_type for n in graph.nodes.values() if n.domain == DOMAIN}
        missing = sorted(used - set(lowerings))
        if missing:
            raise BackendError(f"no IREE lowering for {manifest.target} registered for abstract op(s) {', '.join(missing)}")
        mod = MlirModule(res.mlir_path.read_text(), str(res.mlir_path))
        ctx = PatchContext(folder=folder, target=manifest.target, cuda_arch=sm, options=options)
        if used:
            patch_module(mod, {t: lowerings[t] for t in used}, ctx)
            left = unlowered_ops(mod, used)
            if left:
                raise BackendError(f"abstract op(s) {', '.join(left)} left in {res.mlir_path} after lowering")
        if options.get("stateful"):
            make_module_stateful(mod, res.entry_function, manifest, graph, ctx)
        if ctx._kernel_objects:
            manifest.kernel_objects = list(ctx._kernel_objects)
        if used or options.get("stateful"):
            mod.verify(f"{res.mlir_path} after the lowerings{' and --stateful' if options.get('stateful') else ''}")
            res.mlir_path.write_text(mod.text())
        flags = [f"--iree-cuda-target={sm}"] if manifest.target == "cuda" else []
        if options.get("stateful"):
            flags.append(STRIP_ASSERTIONS)
        if any(v.dtype == onnx.TensorProto.DOUBLE for v in graph.values.values()):
            # iree-compile demotes f64 to f32 by default, the entry function's signature included: a module whose
            # f64 results come back with half their bytes, which the runtime cannot view (float64 graphs only, so
            # the others keep their compile cache)
            flags.append(KEEP_F64)
        compile_mlir(res.mlir_path, folder / "model.vmfb", target=manifest.target, extra_flags=flags)
        if manifest.target == "cuda":
            manifest.target_options = {"cuda_sm": sm}
        else:  # llvm-cpu builds for this machine's CPU (--iree-llvmcpu-target-cpu=host)
            manifest.target_options = {"host_cpu": host_cpu()}
        manifest.entry_function = res.entry_function
        manifest.files.update(mlir="model.mlir", vmfb="model.vmfb", compile_log="compile.log")
        if res.params_path is not None:
            manifest.files["params"] = res.params_path.name

    def load(self, folder: Path, manifest: Manifest, *, low_memory: bool = False) -> IreeRunner:
        """(``low_memory`` changes nothing: the runtime reads the ``.irpa`` parameters through its file index.)"""
        return IreeRunner(folder, manifest)
