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
from typing import Callable

from rewrite.core.iree_lowering import IreeLowering, PatchContext, TorchOperator, VTensor, split_types
from rewrite.errors import BackendError

__all__ = ["IreeLowering", "PatchContext", "TorchOperator", "VTensor", "find_operators", "patch_module", "split_resources",
           "unlowered_ops"]

_OP_RE = re.compile(
    r'^(?P<indent>\s*)(?P<res>%[\w.$#-]+)(?::(?P<count>\d+))? = torch\.operator "onnx\.(?P<op>\w+)"\((?P<args>[^)]*)\)\s*'
    r"(?:\{(?P<attrs>.*)\}\s*)?:\s*\((?P<in_types>.*?)\)\s*->\s*(?P<out_types>.+?)\s*$",
    re.M,
)

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
                operand_types=[VTensor.parse(t) for t in split_types(m.group("in_types"))],
                result_types=[VTensor.parse(t) for t in split_types(outs if outs.startswith("(") else f"({outs})")],
                line=m.group(0),
            )
        )
    return ops


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
