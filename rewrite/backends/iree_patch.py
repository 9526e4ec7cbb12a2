"""Patching abstract ops into the MLIR that IREE's ONNX importer produced.

The importer writes a custom-domain node as (attributes prefixed ``torch.onnx.``)::

    %1:2 = torch.operator "onnx.MoERouterTopK"(%0) {torch.onnx.k = 4 : si64} : (!torch.vtensor<[?,60],f32>) -> (!torch.vtensor<[?,4],f32>, !torch.vtensor<[?,4],si64>)

:func:`patch_module` finds each such line for a registered abstract op, asks the op for an
:class:`IreeLowering` and replaces the line with a ``func.call`` of a private wrapper function that converts
to builtin tensors (``torch_c.to_builtin_tensor``), runs the lowering's body (tensor ops, or a
``flow.dispatch`` of a ``stream.executable`` whose kernel object is linked statically, the route that works
on llvm-cpu in IREE 3.13: ``hal.dispatch.extern`` crashes iree-compile there), and converts back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rewrite.errors import BackendError

_OP_RE = re.compile(
    r'^(?P<indent>\s*)(?P<res>%[\w.$#-]+)(?::(?P<count>\d+))? = torch\.operator "onnx\.(?P<op>\w+)"\((?P<args>[^)]*)\)\s*'
    r"(?:\{(?P<attrs>.*)\}\s*)?:\s*\((?P<in_types>.*?)\)\s*->\s*(?P<out_types>.+?)\s*$",
    re.M,
)
_VT_RE = re.compile(r"!torch\.vtensor<\[([^\]]*)\],(\w+)>")

#: torch element type -> builtin (signless) element type (torch_c.to_builtin_tensor drops signedness)
BUILTIN_ELEMENT = {"f32": "f32", "f16": "f16", "bf16": "bf16", "f64": "f64", "si64": "i64", "si32": "i32", "si16": "i16",
                   "si8": "i8", "ui8": "i8", "i1": "i1", "ui16": "i16", "ui32": "i32", "ui64": "i64"}


def _split_types(s: str) -> list[str]:
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
        if text.strip() == "!torch.none":  # an absent optional input: element "none", no builtin tensor
            return cls([], "none", text.strip())
        m = _VT_RE.fullmatch(text.strip())
        if m is None:
            raise BackendError(f"abstract op operand has type {text}; expected a !torch.vtensor (missing value_info?)")
        dims = [None if d.strip() == "?" else int(d) for d in m.group(1).split(",") if d.strip()]
        return cls(dims, m.group(2), text.strip())

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
    """One imported abstract-op line, parsed."""

    op_type: str
    result: str  # SSA base name, e.g. %1
    num_results: int
    operands: list[str]
    attrs: dict[str, object]
    operand_types: list[VTensor]
    result_types: list[VTensor]
    line: str

    @property
    def results(self) -> list[str]:
        return [self.result] if self.num_results == 1 else [f"{self.result}#{k}" for k in range(self.num_results)]


def _parse_attrs(s: str | None) -> dict[str, object]:
    out: dict[str, object] = {}
    if not s:
        return out
    for m in re.finditer(r"torch\.onnx\.(\w+)\s*=\s*(\"[^\"]*\"|\[[^\]]*\]|[^,]+?)(?:\s*:\s*(\w+))?(?=,\s*torch\.onnx\.|$)", s):
        name, raw, ty = m.group(1), m.group(2).strip(), m.group(3)
        if raw.startswith('"'):
            out[name] = raw[1:-1]
        elif raw.startswith("["):
            out[name] = [float(x.split(":")[0]) if "." in x or "e" in x.lower() else int(x.split(":")[0]) for x in raw[1:-1].split(",") if x.strip()]
        elif ty and ty.startswith("f"):
            out[name] = float(raw)
        else:
            try:
                out[name] = int(raw)
            except ValueError:
                out[name] = float(raw)
    return out


def find_operators(mlir: str, op_types: set[str] | None = None) -> list[TorchOperator]:
    """Every ``torch.operator "onnx.<op_type>"`` line (restricted to ``op_types`` when given)."""
    ops = []
    for m in _OP_RE.finditer(mlir):
        if op_types is not None and m.group("op") not in op_types:
            continue
        args = [a.strip() for a in m.group("args").split(",") if a.strip()]
        outs = m.group("out_types").strip()
        ops.append(
            TorchOperator(
                op_type=m.group("op"),
                result=m.group("res"),
                num_results=int(m.group("count") or 1),
                operands=args,
                attrs=_parse_attrs(m.group("attrs")),
                operand_types=[VTensor.parse(t) for t in _split_types(m.group("in_types"))],
                result_types=[VTensor.parse(t) for t in _split_types(outs if outs.startswith("(") else f"({outs})")],
                line=m.group(0),
            )
        )
    return ops


@dataclass
class IreeLowering:
    """What an abstract op's IREE lowering returns.

    Attributes:
        body: MLIR statements of the wrapper function. Operand ``k`` is available as the builtin tensor
            ``%in{k}`` (and its dims as ``%in{k}_d{axis}`` index values for dynamic axes; an absent operand,
            ``!torch.none``, has neither); the body must define
            ``%out{k}`` builtin tensors of the result types.
        module_items: top-level MLIR (``stream.executable``, ``util.global``) keyed by a name, emitted once.
        kernel_objects: object files (absolute paths) the items reference, recorded in the manifest.
    """

    body: str
    module_items: dict[str, str] = field(default_factory=dict)
    kernel_objects: list[str] = field(default_factory=list)


@dataclass
class PatchContext:
    """Where and for what the module is being patched."""

    folder: Path
    target: str
    opset_version: int = 17
    _kernel_objects: list[str] = field(default_factory=list)


def _wrapper(name: str, op: TorchOperator, low: IreeLowering, opset: int) -> str:
    ins = ", ".join(f"%a{k}: {t.text}" for k, t in enumerate(op.operand_types))
    outs = ", ".join(t.text for t in op.result_types)
    lines = [f"  func.func private @{name}({ins}) -> ({outs}) attributes {{torch.onnx_meta.opset_version = {opset} : si64}} {{"]
    for k, t in enumerate(op.operand_types):
        if t.element == "none":
            continue
        lines.append(f"    %in{k} = torch_c.to_builtin_tensor %a{k} : {t.text} -> {t.builtin}")
        for ax, d in enumerate(t.dims):
            if d is None:
                lines.append(f"    %c{k}_{ax} = arith.constant {ax} : index")
                lines.append(f"    %in{k}_d{ax} = tensor.dim %in{k}, %c{k}_{ax} : {t.builtin}")
    lines.append(low.body.rstrip())
    rets = []
    for k, t in enumerate(op.result_types):
        lines.append(f"    %r{k} = torch_c.from_builtin_tensor %out{k} : {t.builtin} -> {t.text}")
        rets.append(f"%r{k}")
    lines.append(f"    return {', '.join(rets)} : {outs}")
    lines.append("  }")
    return "\n".join(lines)


def split_resources(mlir: str) -> tuple[str, str]:
    """``(module text, trailer)``: the importer may append a ``{-# dialect_resources ... #-}`` block after the
    module, so "the last ``}``" is not the module's end; patches must go into the first part."""
    k = mlir.find("\n{-#")
    return (mlir, "") if k < 0 else (mlir[:k + 1], mlir[k + 1:])


def patch_module(mlir: str, lowerers: dict[str, Callable[[TorchOperator, PatchContext], IreeLowering]], ctx: PatchContext) -> tuple[str, int]:
    """Replace every imported abstract op with a call to its lowering's wrapper.

    Returns (patched MLIR, number of ops patched). Raises BackendError when an op in ``lowerers`` cannot be
    lowered (the message names the op and the reason).
    """
    ops = find_operators(mlir, set(lowerers))
    if not ops:
        return mlir, 0
    m = re.search(r"torch\.onnx_meta\.opset_version = (\d+)", mlir)
    opset = int(m.group(1)) if m else ctx.opset_version
    items: dict[str, str] = {}
    wrappers: list[str] = []
    for k, op in enumerate(ops):
        try:
            low = lowerers[op.op_type](op, ctx)
        except BackendError:
            raise
        except Exception as e:  # a lowering bug must still name the op, not end in a traceback
            raise BackendError(f"IREE lowering of {op.op_type} ({op.result} = ...) failed: {type(e).__name__}: {e}") from e
        items.update(low.module_items)
        ctx._kernel_objects.extend(o for o in low.kernel_objects if o not in ctx._kernel_objects)
        name = f"rewrite_{op.op_type}_{k}"
        wrappers.append(_wrapper(name, op, low, opset))
        res = op.result if op.num_results == 1 else f"{op.result}:{op.num_results}"
        types_in = ", ".join(t.text for t in op.operand_types)
        types_out = ", ".join(t.text for t in op.result_types)
        indent = re.match(r"\s*", op.line).group(0)
        call = f"{indent}{res} = func.call @{name}({', '.join(op.operands)}) : ({types_in}) -> ({types_out})"
        mlir = mlir.replace(op.line, call, 1)
    module, trailer = split_resources(mlir)
    end = module.rstrip().rfind("}")
    mlir = module[:end] + "\n".join(items.values()) + "\n" + "\n".join(wrappers) + "\n" + module[end:] + trailer
    return mlir, len(ops)


def unlowered_ops(mlir: str, names: set[str]) -> list[str]:
    """Abstract op types still present as torch.operator after patching (should be none)."""
    return sorted({op.op_type for op in find_operators(mlir, names)})
