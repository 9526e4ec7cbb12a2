"""What an abstract op's IREE lowering receives and returns (the contract between plugins and the ``iree``
backend): the imported op (:class:`TorchOperator`, its operand and result types as :class:`VTensor`), where it is
being lowered (:class:`PatchContext`), and the MLIR that replaces it (:class:`IreeLowering`); plus
:func:`insert_rows_mlir`, the KV-cache row write that the KVCacheUpdate lowering and the stateful module share,
and :func:`rows_view` / :func:`rows_result` / :func:`row_count`, the [M, K] view of a MatMul's A, the [..., N]
result and the row count M that the dense-MatMul lowerings share.

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
    """Where and for what the module is being patched: the output ``folder``, the IREE ``target`` and, for
    ``cuda``, the SM architecture."""

    folder: Path
    target: str
    opset_version: int = 17
    cuda_arch: str = DEFAULT_CUDA_ARCH  #: the SM the module is compiled for (``apply --cuda-sm``): build PTX for it
    _kernel_objects: list[str] = field(default_factory=list)

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



def insert_rows_mlir(tag: str, dest: str, dest_type: str, lead: list[str], upd: str, upd_type: VTensor, pos: str,
                     pos_type: VTensor, seq: int | str, axis: int, out: str) -> str:
    """MLIR statements defining ``out = tensor.insert_slice upd into dest[*lead, .., off, ..]``: the
    KVCacheUpdate contract on builtin tensors.

    ``dest`` has type ``dest_type`` (rank ``len(lead) + rank(upd)``; the ``lead`` offsets, e.g. a state slot, are
    MLIR index literals over unit dims); ``upd`` is ``upd_type`` with ``n`` rows at ``axis``; ``pos`` holds one
    i64; ``seq`` is the number of rows ``S`` (int, or an index SSA value). ``off = pos`` (``pos + S`` when
    negative) clamped to ``[0, S - n]`` (out-of-bounds ``insert_slice`` is undefined behaviour). SSA names
    are prefixed ``%{tag}_``.
    """
    t = f"%{tag}"
    lines = [f"{t}_c0 = arith.constant 0 : index"]
    sizes = ["1"] * len(lead)
    for k, d in enumerate(upd_type.dims):
        if d is None:
            lines += [f"{t}_ci{k} = arith.constant {k} : index", f"{t}_d{k} = tensor.dim {upd}, {t}_ci{k} : {upd_type.builtin}"]
        sizes.append(str(d) if d is not None else f"{t}_d{k}")
    s_ref = seq if isinstance(seq, str) else f"{t}_s"
    if not isinstance(seq, str):
        lines.append(f"{t}_s = arith.constant {seq} : index")
    n = upd_type.dims[axis]
    n_ref = f"{t}_d{axis}" if n is None else f"{t}_n"
    if n is not None:
        lines.append(f"{t}_n = arith.constant {n} : index")
    index = f"[{t}_c0]" if pos_type.dims else "[]"
    offsets = ", ".join([*lead, *(f"{t}_off" if k == axis else "0" for k in range(len(upd_type.dims)))])
    lines += [
        f"{t}_p64 = tensor.extract {pos}{index} : {pos_type.builtin}",
        f"{t}_p = arith.index_cast {t}_p64 : i64 to index",
        f"{t}_neg = arith.cmpi slt, {t}_p, {t}_c0 : index",
        f"{t}_pw = arith.addi {t}_p, {s_ref} : index",
        f"{t}_pn = arith.select {t}_neg, {t}_pw, {t}_p : index",
        f"{t}_last = arith.subi {s_ref}, {n_ref} : index",
        f"{t}_hi = arith.minsi {t}_pn, {t}_last : index",
        f"{t}_off = arith.maxsi {t}_hi, {t}_c0 : index",
        f"{out} = tensor.insert_slice {upd} into {dest}[{offsets}] [{', '.join(sizes)}] [{', '.join('1' for _ in sizes)}] : {upd_type.builtin} into {dest_type}",
    ]
    return "\n".join("    " + line for line in lines)


def rows_view(a: VTensor, k: int) -> str:
    """MLIR statements viewing operand 0 (``%in0``, type ``a`` = [..., K], rank >= 2, K static) as ``%a``
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
        lines.append(f"    %a = tensor.cast %in0 : {a.builtin} to {rows}")
    else:
        m = "?" if None in dims[:-1] else str(int(np.prod(dims[:-1])))
        col = f"tensor<{m}x{k}x{el}>"
        lines.append(f"    %acs = tensor.collapse_shape %in0 [[{', '.join(map(str, range(len(dims) - 1)))}], [{len(dims) - 1}]] : "
                     f"{a.builtin} into {col}")
        lines.append(f"    %a = tensor.cast %acs : {col} to {rows}")
    lines.append(f"    %m = tensor.dim %a, %mc0 : {rows}")
    return "\n".join(lines)


def rows_result(a: VTensor, n: int, y: str, out: VTensor) -> str:
    """MLIR statements defining ``%out0`` (type ``out``, [..., N]) from ``y`` ``tensor<?xNxel>``: the rows of
    :func:`rows_view` expanded back to A's leading dims (``%in0_d<axis>`` for dynamic ones), then cast."""
    dims, el = a.dims[:-1], a.builtin_element
    lines, sizes = [], []
    for i, d in enumerate(dims):
        if d is None:
            sizes.append(f"%in0_d{i}")
        else:
            lines.append(f"    %yd{i} = arith.constant {d} : index")
            sizes.append(f"%yd{i}")
    mid = "tensor<" + "?x" * len(dims) + f"{n}x{el}>"
    groups = "[" + ", ".join(map(str, range(len(dims)))) + f"], [{len(dims)}]"
    lines.append(f"    %ye = tensor.expand_shape {y} [{groups}] output_shape [{', '.join(sizes)}, {n}] : tensor<?x{n}x{el}> into {mid}")
    lines.append(f"    %out0 = tensor.cast %ye : {mid} to {out.builtin}")
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
