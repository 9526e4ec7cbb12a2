"""The lowering registry: how each abstract op reaches each (backend, target).

A :class:`Lowering` says that ``fn`` lowers abstract op ``op_type`` for ``backend`` on ``targets``. An
:class:`~rewrite.core.abstract_ops.AbstractOp` declares its own (:meth:`AbstractOp.lowerings`); a third-party
package adds more for an existing op, or for a new backend target, through the ``rewrite_lowerings`` pluggy
hook (:mod:`rewrite.hookspecs`), without touching the op. ``rewrite apply`` asks :meth:`LoweringRegistry.check`
before it lowers or writes anything, so a target without a lowering stops with one line naming the op and the
targets it has.

Signatures of ``fn`` by backend: ``ort``: ``fn(graph, node) -> None`` (replaces the node in the graph by ONNX
Runtime ops); ``iree``: ``fn(op: TorchOperator, ctx: PatchContext) -> IreeLowering`` (the MLIR replacing the
imported op; see :mod:`rewrite.backends.iree_patch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from rewrite.errors import RewriteError

#: every (backend, target) pair the backends know, in the order error messages list them
TARGETS: dict[str, tuple[str, ...]] = {"ort": ("cpu", "cuda"), "iree": ("llvm-cpu", "cuda")}


class LoweringError(RewriteError):
    """An abstract op in the graph has no lowering for the requested backend target, or two packages
    registered one for the same (op, backend, target)."""


@dataclass(frozen=True)
class Lowering:
    """``fn`` lowers ``op_type`` for ``backend`` on each of ``targets``; ``origin`` names who registered it
    (a plugin or package), for messages. ``replaces``: it takes the slot of another lowering registered for the same
    (op, backend, target), e.g. a package's own kernel for a built-in op (two that both replace are a conflict)."""

    op_type: str
    backend: str
    targets: tuple[str, ...]
    fn: Callable
    origin: str = ""
    replaces: bool = False

    def __post_init__(self):
        known = TARGETS.get(self.backend)
        if known is None:
            raise LoweringError(f"lowering of {self.op_type} ({self.origin or 'unknown origin'}): unknown backend "
                                f"'{self.backend}'; backends: {', '.join(TARGETS)}")
        bad = [t for t in self.targets if t not in known]
        if bad or not self.targets:
            raise LoweringError(f"lowering of {self.op_type} ({self.origin or 'unknown origin'}): backend '{self.backend}' "
                                f"has no target {', '.join(repr(t) for t in bad) or '(none given)'}; targets: {', '.join(known)}")


def _same(fn: Callable):
    """What makes two lowering functions the same: a method of two instances of one op class is one lowering."""
    f = getattr(fn, "__func__", None)
    return (type(fn.__self__), f) if f is not None else fn


class LoweringRegistry:
    """Lowerings by (op_type, backend, target).

    Raises:
        LoweringError: two lowerings claim the same (op_type, backend, target), neither or both with
            ``replaces`` (message names both origins).
    """

    def __init__(self, lowerings: Iterable[Lowering] = ()):
        self._by_key: dict[tuple[str, str, str], Lowering] = {}
        for low in lowerings:
            self.add(low)

    def add(self, low: Lowering) -> None:
        for t in low.targets:
            key = (low.op_type, low.backend, t)
            other = self._by_key.get(key)
            if other is not None and _same(other.fn) != _same(low.fn):
                if other.replaces == low.replaces:
                    raise LoweringError(f"two lowerings of {low.op_type} for {low.backend}:{t}: "
                                        f"{other.origin or 'unknown'} and {low.origin or 'unknown'}"
                                        f"{' (both replace)' if low.replaces else ''}")
                if other.replaces:  # the replacing one holds the slot, whichever came first
                    continue
            self._by_key[key] = low

    def all(self) -> list[Lowering]:
        """Every registered lowering once, in registration order."""
        return list({id(low): low for low in self._by_key.values()}.values())

    def get(self, op_type: str, backend: str, target: str) -> Lowering | None:
        return self._by_key.get((op_type, backend, target))

    def targets_of(self, op_type: str) -> list[str]:
        """``backend:target`` strings that ``op_type`` has a lowering for, in :data:`TARGETS` order."""
        return [f"{b}:{t}" for b, ts in TARGETS.items() for t in ts if (op_type, b, t) in self._by_key]

    def for_target(self, backend: str, target: str) -> dict[str, Callable]:
        """The lowering functions of every op that has one for ``backend:target``, by op_type."""
        return {op: low.fn for (op, b, t), low in self._by_key.items() if b == backend and t == target}

    def check(self, used: Mapping[str, str], backend: str, target: str) -> None:
        """Raises LoweringError, one line, for the first op of ``used`` (op_type -> a node that has it, for the
        message) without a lowering for ``backend:target``; names the targets it has."""
        for op_type, where in used.items():
            if self.get(op_type, backend, target) is None:
                has = self.targets_of(op_type)
                hint = "" if has else (" (a plugin registers an op's lowerings by listing it in its abstract_ops: "
                                       "docs/writing-a-plugin.md)")
                raise LoweringError(f"abstract op {op_type} ({where}) has no lowering for {backend}:{target}; "
                                    f"it has lowerings for {', '.join(has) if has else 'no target'}{hint}")
