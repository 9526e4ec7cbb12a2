"""Patching abstract ops into the module that IREE's ONNX importer produced, through the MLIR bindings.

The importer writes a custom-domain node as a ``torch.operator`` whose ``name`` is ``"onnx.<op_type>"``, with
the node's attributes prefixed ``torch.onnx.`` and its location named after the node::

    %1:2 = torch.operator "onnx.MoERouterTopK"(%0) {torch.onnx.k = 4 : si64} : (!torch.vtensor<[?,60],f32>) -> (...) loc("router")

:func:`patch_module` finds each such op of a lowered op type structurally (:mod:`rewrite.backends.mlir`), reads
its typed attributes and operand types into a :class:`~rewrite.core.iree_lowering.TorchOperator`, asks the
lowering for an :class:`~rewrite.core.iree_lowering.IreeLowering`, parses a private wrapper function (converting
to builtin tensors with ``torch_c.to_builtin_tensor``, the lowering's body: tensor ops, or a ``flow.dispatch``
of an executable whose kernel object is linked in, and back) and the lowering's module items in the module's
context, and replaces the op by a ``func.call`` of the wrapper. A body that does not parse or verify is an
error naming the ONNX node, before iree-compile runs.
"""

from __future__ import annotations

from typing import Callable

from iree.compiler import ir

from rewrite.backends.mlir import MlirModule, node_of
from rewrite.core.iree_lowering import IreeLowering, PatchContext, TorchOperator, VTensor
from rewrite.errors import BackendError

__all__ = ["IreeLowering", "PatchContext", "TorchOperator", "VTensor", "abstract_ops", "find_operators", "patch_module",
           "unlowered_ops"]

ATTR_PREFIX = "torch.onnx."  #: how the importer prefixes a node's attributes


def _value(attr: ir.Attribute):
    """A Python value for an imported attribute: int, float, str, or a list of them."""
    attr = attr.maybe_downcast() if hasattr(attr, "maybe_downcast") else attr
    if isinstance(attr, ir.BoolAttr):
        return int(attr.value)
    if isinstance(attr, ir.IntegerAttr):
        return int(attr.value)
    if isinstance(attr, ir.FloatAttr):
        return float(attr.value)
    if isinstance(attr, ir.StringAttr):
        return attr.value
    if isinstance(attr, ir.ArrayAttr):
        return [_value(a) for a in attr]
    return str(attr)


def _operator(op: ir.Operation, op_type: str) -> TorchOperator:
    attrs = {}
    for k in range(len(op.attributes)):
        na = op.attributes[k]
        if na.name.startswith(ATTR_PREFIX):
            attrs[na.name[len(ATTR_PREFIX):]] = _value(na.attr)
    return TorchOperator(op_type=op_type, node=node_of(op), attrs=attrs,
                         operand_types=[VTensor.parse(str(v.type)) for v in op.operands],
                         result_types=[VTensor.parse(str(r.type)) for r in op.results])


def abstract_ops(mod: MlirModule, op_types: set[str] | None = None) -> list[tuple[ir.Operation, TorchOperator]]:
    """Every imported ``torch.operator "onnx.<op_type>"`` (of ``op_types`` when given), with its reading.

    Raises:
        BackendError: an operand or result that is not a typed tensor (the message names the op and its node).
    """
    out = []
    for op in mod.walk("torch.operator"):
        name = ir.StringAttr(op.attributes["name"]).value
        if not name.startswith("onnx."):
            continue
        op_type = name[len("onnx."):]
        if op_types is None or op_type in op_types:
            try:
                out.append((op, _operator(op, op_type)))
            except BackendError as e:
                raise BackendError(f"{op_type} at node '{node_of(op)}': {e}") from None
    return out


def find_operators(mlir: str, op_types: set[str] | None = None) -> list[TorchOperator]:
    """:func:`abstract_ops` of a module's text, readings only (for tests and tools)."""
    return [t for _, t in abstract_ops(MlirModule(mlir, "MLIR"), op_types)]


def _opset(mod: MlirModule, default: int) -> int:
    """The default-domain opset the importer records on its functions (the torch pipeline wants it on every one)."""
    for op in mod.walk("func.func"):
        if "torch.onnx_meta.opset_version" in op.attributes:
            return int(_value(op.attributes["torch.onnx_meta.opset_version"]))
    return default


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


def patch_module(mod: MlirModule, lowerers: dict[str, Callable[[TorchOperator, PatchContext], IreeLowering]],
                 ctx: PatchContext) -> int:
    """Replace every imported abstract op of ``lowerers`` in ``mod`` by a call of its lowering's wrapper;
    returns how many were replaced.

    Raises:
        BackendError: a lowering refuses or fails, or what it returns does not parse (the message names the op
            and its ONNX node).
    """
    found = abstract_ops(mod, set(lowerers))
    if not found:
        return 0
    opset = _opset(mod, ctx.opset_version)
    for k, (op, top) in enumerate(found):
        what = f"IREE lowering of {top.op_type} {top.where}"
        name = f"rewrite_{top.op_type}_{k}"
        try:
            low = lowerers[top.op_type](top, ctx)
            if not isinstance(low, IreeLowering):
                raise TypeError(f"returned {type(low).__name__}, not an IreeLowering")
            # the wrapper with the items it references: a piece that verifies alone, so its errors are this op's
            piece = "\n".join([*low.module_items.values(), _wrapper(name, top, low, opset)])
        except BackendError as e:
            raise BackendError(str(e) if top.where in str(e) else f"{what}: {e}") from None
        except Exception as e:  # a lowering bug must still name the node, not end in a traceback
            raise BackendError(f"{what} failed: {type(e).__name__}: {e}") from e
        mod.add(piece, what)
        mod.replace_with_call(op, name)
    return len(found)


def unlowered_ops(mod: MlirModule, names: set[str]) -> list[str]:
    """Abstract op types still present as torch.operator after patching (should be none)."""
    return sorted({t.op_type for _, t in abstract_ops(mod, names)})
