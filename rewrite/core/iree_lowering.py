"""What an abstract op's IREE lowering receives and returns (the contract between plugins and the ``iree``
backend): the imported op (:class:`TorchOperator`, its operand and result types as :class:`VTensor`), where it is
being lowered (:class:`PatchContext`), and the MLIR that replaces it (:class:`IreeLowering`); plus
:func:`kernel_bindings`, the binding list of an extern kernel's layout; :func:`insert_rows_mlir`, the KV-cache row
write (its position read on the device) that the KVCacheUpdate lowering and the stateful module share; and
:func:`rows_view` / :func:`rows_result` / :func:`row_count`, the [M, K] view of a MatMul's A, the [..., N] result
and the row count M that the dense-MatMul lowerings share.

The backend (:mod:`rewrite.backends.iree_patch`) finds the ops and splices the lowerings in.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rewrite.core.kernels import DEFAULT_CUDA_ARCH
from rewrite.errors import BackendError

KERNELS_DIR = "kernels"  #: kernel objects' folder inside an output folder

#: torch element type -> builtin (signless) element type (torch_c.to_builtin_tensor drops signedness)
BUILTIN_ELEMENT = {"f32": "f32", "f16": "f16", "bf16": "bf16", "f64": "f64", "si64": "i64", "si32": "i32", "si16": "i16",
                   "si8": "i8", "ui8": "i8", "i1": "i1", "ui16": "i16", "ui32": "i32", "ui64": "i64"}


def split_types(s: str) -> list[str]:
    """Split a comma list of MLIR types, respecting <...> and [...] nesting."""
    out, depth, cur = [], 0, ""
    for ch in s.strip().strip("()"):
        if ch in "<[(":
            depth += 1
        elif ch in ">])":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


@dataclass
class VTensor:
    """A ``!torch.vtensor`` type: dims (int or None for ``?``) and torch element type."""

    dims: list[int | None]
    element: str
    text: str

    @classmethod
    def parse(cls, text: str) -> "VTensor":
        """From a type's text: ``!torch.vtensor<[?,60],f32>``, or ``!torch.none`` (an absent optional input:
        element "none", no builtin tensor).

        Raises:
            BackendError: anything else (a value without value_info is imported untyped).
        """
        t = text.strip()
        if t == "!torch.none":
            return cls([], "none", t)
        head, tail = "!torch.vtensor<[", ">"
        dims_text, sep, element = t[len(head):-len(tail)].rpartition("],") if t.startswith(head) and t.endswith(tail) else ("", "", "")
        try:
            dims = [None if d.strip() == "?" else int(d) for d in dims_text.split(",") if d.strip()]
        except ValueError:
            sep = ""
        if not sep or not element.isidentifier():
            raise BackendError(f"abstract op operand has type {text}; expected a !torch.vtensor (missing value_info?)")
        return cls(dims, element, t)

    @property
    def builtin(self) -> str:
        """``tensor<?x60xf32>``"""
        el = BUILTIN_ELEMENT.get(self.element)
        if el is None:
            raise BackendError(f"no builtin element type for torch type {self.element}")
        return "tensor<" + "".join(("?" if d is None else str(d)) + "x" for d in self.dims) + el + ">"

    @property
    def builtin_element(self) -> str:
        return BUILTIN_ELEMENT[self.element]


@dataclass
class TorchOperator:
    """One imported abstract op, as a lowering reads it: ``op_type`` (without the importer's ``onnx.`` prefix),
    ``node`` (the ONNX node it came from: its location's name, "" when the module has none), ``attrs`` (the
    node's attributes: int, float, str or lists of them), and its operand and result types."""

    op_type: str
    node: str
    attrs: dict[str, object]
    operand_types: list[VTensor]
    result_types: list[VTensor]

    @property
    def where(self) -> str:
        """``at node 'name'`` for messages."""
        return f"at node '{self.node}'" if self.node else "(at a node without a location)"


@dataclass
class IreeLowering:
    """What an abstract op's IREE lowering returns.

    Attributes:
        body: MLIR statements of the wrapper function. Operand ``k`` is available as the builtin tensor
            ``%in{k}`` (and its dims as ``%in{k}_d{axis}`` index values for dynamic axes; an absent operand,
            ``!torch.none``, has neither); the body must define
            ``%out{k}`` builtin tensors of the result types.
        module_items: top-level MLIR (``stream.executable``, ``util.global``) keyed by a name, emitted once.
            Kernel objects are named by the path :meth:`PatchContext.object_path` returns.
    """

    body: str
    module_items: dict[str, str] = field(default_factory=dict)


@dataclass
class PatchContext:
    """Where and for what the module is being patched: the output ``folder``, the IREE ``target``, for ``cuda``
    the SM architecture, and the apply's options (a plugin's lowering choices)."""

    folder: Path
    target: str
    opset_version: int = 17
    cuda_arch: str = DEFAULT_CUDA_ARCH  #: the SM the module is compiled for (``apply --cuda-sm``): build PTX for it
    #: the apply's options: a plugin's own under its short name (``--opt moe.launches=2`` -> {"moe": {"launches": 2}})
    options: dict = field(default_factory=dict)
    _kernel_objects: list[str] = field(default_factory=list)
    _sites: dict[str, int] = field(default_factory=dict)

    def next_site(self, key: str) -> int:
        """0, 1, 2, ... on successive calls with the same ``key`` (an executable's name) in this module: a number
        per dispatch site, for kernels that keep per-site state in their module's own memory (``moe_fused``'s
        counters)."""
        n = self._sites.get(key, 0)
        self._sites[key] = n + 1
        return n

    def object_path(self, obj: Path) -> str:
        """Copy the kernel object ``obj`` (a built, cached file: :mod:`rewrite.core.kernels`) into the folder's
        ``kernels/`` and return the path to write in ``#hal.executable.object<{path = ...}>``: relative to the
        folder, where iree-compile runs, so the folder can move. Recorded in the manifest's ``kernel_objects``."""
        obj = Path(obj)
        rel = f"{KERNELS_DIR}/{obj.name}"
        dest = self.folder / rel
        if not dest.is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(obj, dest)
        if rel not in self._kernel_objects:
            self._kernel_objects.append(rel)
        return rel



def kernel_bindings(read_only: int, written: int) -> str:
    """The ``bindings = [...]`` entries of an extern kernel's ``#hal.pipeline.layout``: ``read_only`` bindings the
    kernel only reads, then ``written`` bindings it writes, in the kernel's argument order.

    Each binding is ``Indirect``: iree-compile (``--iree-hal-indirect-command-buffers``, on by default in 3.13) then
    binds the call's transient buffers through the binding table of ``hal.device.queue.execute.indirect``, so a
    call with static shapes records its command buffer once at module load (``--iree-hal-memoization``) and replays
    it; without ``Indirect`` the kernel's operands are captured directly and the command buffer is recorded in
    every call (one VM call per dispatch: microseconds each, hundreds per decode step).
    """
    return ", ".join(['#hal.pipeline.binding<storage_buffer, "ReadOnly|Indirect">'] * read_only
                     + ["#hal.pipeline.binding<storage_buffer, Indirect>"] * written)


def insert_rows_mlir(tag: str, dest: str, dest_type: str, lead: list[str], upd: str, upd_type: VTensor, pos: str,
                     pos_type: VTensor, seq: int | str, axis: int, out: str) -> str:
    """MLIR statements defining ``out = dest`` with ``upd`` written at rows ``off .. off + n`` of ``axis``, the
    unit dims before it at the ``lead`` offsets (e.g. a state slot): the KVCacheUpdate contract on builtin tensors.

    ``dest`` has type ``dest_type`` (rank ``len(lead) + rank(upd)``; the ``lead`` offsets are MLIR index literals
    over unit dims); ``upd`` is ``upd_type`` with ``n`` rows at ``axis``; ``pos`` holds one i64 (type
    ``pos_type``, shape ``[1]`` or ``[]``); ``seq`` is the number of rows ``S`` (int, or an index SSA value).
    ``off = pos`` (``pos + S`` when negative) clamped to ``[0, S - n]``. SSA names are prefixed ``%{tag}_``.

    The write is an ``iree_linalg_ext.scatter`` of ``upd``'s rows (the dims up to ``axis`` flattened, the dims
    after it the scattered slice) at indices computed on the device from ``pos``. A ``tensor.insert_slice`` at
    ``off`` would need ``pos`` on the host: iree-compile 3.13 then reads it back in every call (a queue copy and a
    fence wait) and the call's command buffer depends on it, so it is recorded anew each call instead of once
    (``--iree-hal-memoization``).
    """
    t = f"%{tag}"
    dims = upd_type.dims
    if 0 in dims:  # no rows: dest unchanged (iree-compile 3.13 dies with SIGFPE on a scatter of a static 0 rows)
        return f"    {out} = tensor.cast {dest} : {dest_type} to {dest_type}"
    el = upd_type.builtin_element
    depth = len(lead) + axis + 1
    lines = [f"{t}_c0 = arith.constant 0 : index"]
    for k, d in enumerate(dims):  # each dim of upd as an index value %{tag}_d<k>
        if d is None:
            lines += [f"{t}_ci{k} = arith.constant {k} : index", f"{t}_d{k} = tensor.dim {upd}, {t}_ci{k} : {upd_type.builtin}"]
        else:
            lines.append(f"{t}_d{k} = arith.constant {d} : index")
    s_ref = seq if isinstance(seq, str) else f"{t}_s"
    if not isinstance(seq, str):
        lines.append(f"{t}_s = arith.constant {seq} : index")
    rows_static = None not in dims[:axis + 1]
    m = str(int(np.prod(dims[:axis + 1]))) if rows_static else "?"
    rest = "".join(("?" if d is None else str(d)) + "x" for d in dims[axis + 1:])
    rows_type = f"tensor<{m}x{rest}{el}>"
    groups = [list(range(axis + 1))] + [[k] for k in range(axis + 1, len(dims))]
    lines.append(f"{t}_u = tensor.collapse_shape {upd} [{', '.join('[' + ', '.join(map(str, g)) + ']' for g in groups)}] : "
                 f"{upd_type.builtin} into {rows_type}")
    idx_type = f"tensor<{m}x{depth}xi32>"
    if rows_static:
        lines.append(f"{t}_ie = tensor.empty() : {idx_type}")
    else:
        lines += [f"{t}_m = tensor.dim {t}_u, {t}_c0 : {rows_type}", f"{t}_ie = tensor.empty({t}_m) : {idx_type}"]
    index = f"[{t}_c0]" if pos_type.dims else "[]"
    body = [f"{t}_r = linalg.index 0 : index", f"{t}_c = linalg.index 1 : index",
            f"{t}_p64 = tensor.extract {pos}{index} : {pos_type.builtin}",
            f"{t}_p = arith.index_cast {t}_p64 : i64 to index",
            f"{t}_neg = arith.cmpi slt, {t}_p, {t}_c0 : index",
            f"{t}_pw = arith.addi {t}_p, {s_ref} : index",
            f"{t}_pn = arith.select {t}_neg, {t}_pw, {t}_p : index",
            f"{t}_last = arith.subi {s_ref}, {t}_d{axis} : index",
            f"{t}_hi = arith.minsi {t}_pn, {t}_last : index",
            f"{t}_off = arith.maxsi {t}_hi, {t}_c0 : index"]
    # row r -> its coordinates over upd's dims 0..axis (the last fastest), then the index vector
    # [lead..., coords before axis..., off + coord at axis]
    comp, q = {}, f"{t}_r"
    for k in range(axis, -1, -1):
        body += [f"{t}_x{k} = arith.remui {q}, {t}_d{k} : index", f"{t}_q{k} = arith.divui {q}, {t}_d{k} : index"]
        comp[len(lead) + k] = f"{t}_x{k}"
        q = f"{t}_q{k}"
    body.append(f"{t}_row = arith.addi {t}_off, {t}_x{axis} : index")
    comp[len(lead) + axis] = f"{t}_row"
    for j, literal in enumerate(lead):
        body.append(f"{t}_l{j} = arith.constant {literal} : index")
        comp[j] = f"{t}_l{j}"
    value = comp[depth - 1]
    for j in range(depth - 2, -1, -1):
        body += [f"{t}_k{j} = arith.constant {j} : index", f"{t}_is{j} = arith.cmpi eq, {t}_c, {t}_k{j} : index",
                 f"{t}_v{j} = arith.select {t}_is{j}, {comp[j]}, {value} : index"]
        value = f"{t}_v{j}"
    body += [f"{t}_vi = arith.index_cast {value} : index to i32", f"linalg.yield {t}_vi : i32"]
    lines.append(f"{t}_idx = linalg.generic {{indexing_maps = [affine_map<(r, c) -> (r, c)>], iterator_types = "
                 f"[\"parallel\", \"parallel\"]}} outs({t}_ie : {idx_type}) {{\n  ^bb0({t}_o: i32):\n      "
                 + "\n      ".join(body) + f"\n    }} -> {idx_type}")
    lines.append(f"{out} = iree_linalg_ext.scatter dimension_map = [{', '.join(map(str, range(depth)))}] unique_indices(true) "
                 f"ins({t}_u, {t}_idx : {rows_type}, {idx_type}) outs({dest} : {dest_type}) {{\n  ^bb0({t}_a: {el}, {t}_b: {el}):\n"
                 f"      iree_linalg_ext.yield {t}_a : {el}\n    }} -> {dest_type}")
    return "\n".join("    " + line for line in lines)


def rows_view(a: VTensor, k: int, name: str = "%a") -> str:
    """MLIR statements viewing operand 0 (``%in0``, type ``a`` = [..., K], rank >= 2, K static) as ``name``
    ``tensor<?xKxel>`` with ``%m`` (index) rows: the leading dims collapsed.

    Raises:
        BackendError: rank below 2.
    """
    dims, el = a.dims, a.builtin_element
    if len(dims) < 2:
        raise BackendError(f"a MatMul's A must have rank 2 or more, got {a.text}")
    rows = f"tensor<?x{k}x{el}>"
    lines = ["    %mc0 = arith.constant 0 : index"]
    if len(dims) == 2:
        lines.append(f"    {name} = tensor.cast %in0 : {a.builtin} to {rows}")
    else:
        m = "?" if None in dims[:-1] else str(int(np.prod(dims[:-1])))
        col = f"tensor<{m}x{k}x{el}>"
        lines.append(f"    %acs = tensor.collapse_shape %in0 [[{', '.join(map(str, range(len(dims) - 1)))}], [{len(dims) - 1}]] : "
                     f"{a.builtin} into {col}")
        lines.append(f"    {name} = tensor.cast %acs : {col} to {rows}")
    lines.append(f"    %m = tensor.dim {name}, %mc0 : {rows}")
    return "\n".join(lines)


def rows_result(a: VTensor, n: int, y: str, out: VTensor, result: str = "%out0") -> str:
    """MLIR statements defining ``result`` (type ``out``, [..., N]) from ``y`` ``tensor<?xNxel>``: the rows of
    :func:`rows_view` expanded back to A's leading dims (``%in0_d<axis>`` for dynamic ones), then cast. Other SSA
    names are prefixed by ``result``, so several results can be expanded in one body."""
    dims, el = a.dims[:-1], a.builtin_element
    lines, sizes = [], []
    for i, d in enumerate(dims):
        if d is None:
            sizes.append(f"%in0_d{i}")
        else:
            lines.append(f"    {result}_d{i} = arith.constant {d} : index")
            sizes.append(f"{result}_d{i}")
    mid = "tensor<" + "?x" * len(dims) + f"{n}x{el}>"
    groups = "[" + ", ".join(map(str, range(len(dims)))) + f"], [{len(dims)}]"
    lines.append(f"    {result}_e = tensor.expand_shape {y} [{groups}] output_shape [{', '.join(sizes)}, {n}] : tensor<?x{n}x{el}> into {mid}")
    lines.append(f"    {result} = tensor.cast {result}_e : {mid} to {out.builtin}")
    return "\n".join(lines)


def row_count(a: VTensor, n: int) -> tuple[str, str, str]:
    """For a ``flow.dispatch`` that takes operand 0 (``%in0``, [..., K]) as it is and returns [..., N]: (MLIR
    statements defining ``%m``, the product of the leading dims as an index; the ``{...}`` list of ``%in0``'s
    dynamic dims, ``%in0_d<axis>``, which the result shares; the result's builtin type)."""
    dims = a.dims[:-1]
    static = int(np.prod([d for d in dims if d is not None])) if dims else 1
    dynamic = [f"%in0_d{i}" for i, d in enumerate(dims) if d is None]
    if not dynamic:
        lines = [f"    %m = arith.constant {static} : index"]
    else:
        lines, last = [f"    %m_s = arith.constant {static} : index"], "%m_s"
        for j, d in enumerate(dynamic):
            name = "%m" if j == len(dynamic) - 1 else f"%m_{j}"
            lines.append(f"    {name} = arith.muli {last}, {d} : index")
            last = name
    result = "tensor<" + "".join(("?" if d is None else str(d)) + "x" for d in dims) + f"{n}x{a.builtin_element}>"
    return "\n".join(lines), (f"{{{', '.join(dynamic)}}}" if dynamic else ""), result


def dispatch_dims(k: int, ty: VTensor) -> str:
    """The ``{%in<k>_d<axis>, ...}`` list of operand ``k``'s dynamic dims that ``flow.dispatch`` takes after its type
    ("" when static)."""
    dyn = [f"%in{k}_d{a}" for a, d in enumerate(ty.dims) if d is None]
    return "{" + ", ".join(dyn) + "}" if dyn else ""


def operand_dim(op: TorchOperator, k: int, axis: int, name: str) -> str:
    """An MLIR statement defining ``name`` (index) as dim ``axis`` of operand ``k``: a constant, or its dynamic dim
    ``%in<k>_d<axis>`` (``%c0`` must be defined)."""
    d = op.operand_types[k].dims[axis]
    return f"    {name} = arith.constant {d} : index" if d is not None else f"    {name} = arith.addi %in{k}_d{axis}, %c0 : index"


def cuda_executable_source(name: str, obj: str, kernels: list[str], read_only: int, written: int, constants: int,
                           threads: int, grid: int = 3) -> str:
    """The ``hal.executable.source`` ``@name`` declaring each of ``kernels`` (exports in that order) of the PTX at
    ``obj``: ``read_only`` then ``written`` bindings (:func:`kernel_bindings`), ``constants`` i32 push constants,
    workgroups of ``threads`` threads on the grid the dispatch's workload gives (``grid`` 3: its (x, y, z); 1: its x,
    y = z = 1)."""
    if grid == 3:
        count = ("        count(%device: !hal.device, %gx: index, %gy: index, %gz: index) -> (index, index, index) {\n"
                 "      hal.return %gx, %gy, %gz : index, index, index\n")
    else:
        count = ("        count(%device: !hal.device, %gx: index) -> (index, index, index) {\n"
                 "      %one = arith.constant 1 : index\n      hal.return %gx, %one, %one : index, index, index\n")
    exports = [f"    hal.executable.export public @{kernel} ordinal({ordinal})\n"
               f"        layout(#hal.pipeline.layout<constants = {constants}, bindings = [{kernel_bindings(read_only, written)}]>)\n"
               + count + f"    }} <workgroup_size = [{threads} : index, 1 : index, 1 : index]>"
               for ordinal, kernel in enumerate(kernels)]
    return (f"  hal.executable.source private @{name} <objects = <{{\n"
            f"      #hal.executable.target<\"cuda\", \"cuda-nvptx-fb\"> = [#hal.executable.object<{{path = \"{obj}\"}}>]}}>> {{\n"
            + "\n".join(exports) + "\n  }")
