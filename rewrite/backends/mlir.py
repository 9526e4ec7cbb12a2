"""MLIR modules through the bindings iree-base-compiler ships (``iree.compiler.ir``): the IREE backend parses the
importer's module, finds ops structurally, reads their typed attributes and operand types, adds functions and
executables parsed in the module's own context, rewires uses, verifies the result and only then prints it
(with its locations: each imported op's is the ONNX node's name) for iree-compile.

Nothing here edits MLIR text; text is only ever parsed whole, as a module.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from iree.compiler import ir
from iree.compiler.dialects import func

from rewrite.errors import BackendError


def _diagnostic(e: ir.MLIRError) -> str:
    """The first error of an MLIRError, with its location, on one line."""
    diags = getattr(e, "error_diagnostics", None) or []
    if diags:
        d = diags[0]
        return f"{d.location}: {d.message}".replace("\n", " ")
    return str(e).strip().splitlines()[-1] if str(e).strip() else "invalid MLIR"


def node_of(op: ir.Operation) -> str:
    """The ONNX node an imported op came from (the importer names each op's location after its node), or "".
    A name location nested in another name location (``loc("a"("b"))``) gives the outer name; other location
    kinds give ""."""
    loc = op.location
    for _ in range(4):
        try:
            return loc.name_str
        except (ValueError, AttributeError, TypeError):
            pass
        try:
            loc = loc.child_loc
        except (ValueError, AttributeError, TypeError):
            return ""
    return ""


class MlirModule:
    """One parsed module and its context.

    Raises:
        BackendError: the text does not parse (``where`` and the first diagnostic in the message).
    """

    def __init__(self, text: str, where: str):
        self.where = where
        self.context = ir.Context()
        try:
            self.module = ir.Module.parse(text, self.context)
        except ir.MLIRError as e:
            raise BackendError(f"{where}: the MLIR does not parse: {_diagnostic(e)}") from None

    @property
    def body(self) -> ir.Block:
        return self.module.body

    def walk(self, name: str | None = None) -> Iterator[ir.Operation]:
        """Every op (named ``name``, when given) in the module, in pre-order."""
        found: list[ir.Operation] = []

        def visit(op):
            if name is None or op.name == name:
                found.append(op)
            return ir.WalkResult.ADVANCE

        self.module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
        return iter(found)

    def function(self, name: str) -> ir.Operation:
        """The top-level ``func.func @name``.

        Raises:
            BackendError: there is none.
        """
        for op in self.body.operations:
            if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == name:
                return op.operation
        raise BackendError(f"{self.where}: no function @{name}")

    def add(self, text: str, what: str, *, first: bool = False) -> None:
        """Parse ``text`` (top-level ops: functions, executables, globals; the piece must verify on its own, so
        it holds what its functions reference) in this module's context and append its ops to the module. An
        op defining a symbol the module has is left out when it is the same op (an executable that two
        lowerings share), and refused otherwise. ``first``: put the ops at the module's start instead;
        ``util.global`` ops always go there (a global must precede its uses for iree-compile's stream conversion).

        Raises:
            BackendError: ``text`` does not parse or verify, or redefines a symbol differently (``what`` names
                whose text it is, for the message).
        """
        try:  # named after ``what``: its ops' locations, and iree-compile's errors in them, say whose they are
            piece = ir.Operation.parse("module {\n" + text + "\n}", source_name=what, context=self.context)
        except ir.MLIRError as e:
            raise BackendError(f"{what}: its MLIR does not parse: {_diagnostic(e)}") from None
        existing = {ir.StringAttr(op.attributes["sym_name"]).value: op.operation for op in self.body.operations
                    if "sym_name" in op.attributes}
        placed = None  # with ``first``: the last op put at the start, to keep the piece's order
        for op in list(piece.regions[0].blocks[0].operations):
            op = op.operation
            sym = ir.StringAttr(op.attributes["sym_name"]).value if "sym_name" in op.attributes else None
            if sym in existing:
                if op.get_asm(assume_verified=True) != existing[sym].get_asm(assume_verified=True):  # locations aside
                    raise BackendError(f"{what}: defines @{sym} differently from the module's @{sym}")
                continue
            at_start = first or op.name == "util.global"  # a global precedes its uses (stream conversion)
            if at_start and placed is not None:  # (move_* take the op from the piece's block themselves)
                op.move_after(placed)
                placed = op
            elif at_start and len(self.body.operations):
                op.move_before(self.body.operations[0].operation)
                placed = op
            else:
                op.detach_from_parent()
                self.body.append(op)

    def replace_with_call(self, op: ir.Operation, callee: str, operands: Sequence[ir.Value] | None = None) -> ir.Operation:
        """Replace ``op`` by ``func.call @callee(operands or op's operands)`` with op's result types, at op's
        place and location; every use of op's results now uses the call's. Returns the call."""
        with ir.InsertionPoint(op), op.location:
            call = func.CallOp([r.type for r in op.results], ir.FlatSymbolRefAttr.get(callee),
                               list(op.operands if operands is None else operands))
        for old, new in zip(op.results, call.results):
            old.replace_all_uses_with(new)
        op.erase()
        return call.operation

    def verify(self, what: str) -> None:
        """Raises BackendError (``what`` and the first diagnostic, with its location) unless the module verifies."""
        try:
            self.module.operation.verify()
        except ir.MLIRError as e:
            raise BackendError(f"{what}: the module does not verify: {_diagnostic(e)}") from None

    def text(self) -> str:
        """The module's text with its locations (iree-compile's errors then name the ONNX node)."""
        return self.module.operation.get_asm(enable_debug_info=True, assume_verified=True)
