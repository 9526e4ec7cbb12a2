"""The plugin object: what the plugin manager registers and ``rewrite apply --plugins`` selects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Sequence

from rewrite.core.driver import PluginReport, apply_rules
from rewrite.core.ir import Graph
from rewrite.core.rules import Rule

if TYPE_CHECKING:
    from rewrite.core.driver import RewriteContext


@dataclass(frozen=True)
class KernelObject:
    """A compiled kernel a plugin ships for one backend target (path relative to the plugin's package folder)."""

    name: str
    backend: str
    target: str
    path: str


class Plugin:
    """Base class of rewrite plugins.

    Subclasses set the class attributes and usually only ``rules``; override :meth:`run` for passes that are
    not pattern rewrites.

    Attributes:
        name: descriptive name (``cast-roundtrip``).
        short: the name used with ``--plugins`` (``cast``).
        description: one line for ``rewrite plugins``.
        rules: the plugin's rules, in registration order.
        backends: backends the plugin rewrites for. For any other backend ``apply`` does not run it and
            says so in its report (``legalize``: iree only).
        opset_range: (min, max) default-domain opset the rules were written for; outside it ``apply`` refuses.
        kernels: kernel objects the plugin ships.
        runs_before, runs_after: short names of plugins this one must run before / after when both are
            selected; ``--plugins`` in any order then gives the same result (`rewrite.plugins.manager.select_plugins`).
        lossy: the plugin changes outputs by design (``quant4``); ``verify`` says so when a folder used it.
        takes_options: False where the plugin reads no ``--opt``: ``apply`` then refuses options given to it (a
            plugin that reads options checks their keys itself).
    """

    name: ClassVar[str] = ""
    short: ClassVar[str] = ""
    description: ClassVar[str] = ""
    backends: ClassVar[tuple[str, ...]] = ("ort", "iree")
    opset_range: ClassVar[tuple[int, int]] = (7, 28)
    kernels: ClassVar[Sequence[KernelObject]] = ()
    runs_before: ClassVar[tuple[str, ...]] = ()
    runs_after: ClassVar[tuple[str, ...]] = ()
    lossy: ClassVar[bool] = False
    takes_options: ClassVar[bool] = True

    @property
    def rules(self) -> list[Rule]:
        return []

    @property
    def abstract_ops(self) -> list:
        """:class:`rewrite.core.abstract_ops.AbstractOp` instances this plugin's rules create."""
        return []

    @property
    def cases(self) -> list:
        """:class:`rewrite.core.cases.Case` objects the conformance kit runs for this plugin."""
        return []

    def run(self, graph: Graph, report: PluginReport, ctx: "RewriteContext | None" = None, *, dry_run: bool = False) -> None:
        """Rewrite ``graph`` in place, recording what happened in ``report``. Default: apply :attr:`rules`."""
        apply_rules(graph, self.rules, self.short, report, dry_run=dry_run, ctx=ctx)

    def __repr__(self) -> str:
        return f"<plugin {self.short} ({self.name})>"
