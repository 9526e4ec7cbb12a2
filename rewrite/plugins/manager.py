"""Finding plugins: the built-in ones plus every package registered under the entry-point group ``rewrite.plugins``."""

from __future__ import annotations

import functools

import pluggy

from rewrite import hookspecs
from rewrite.core.lowering import Lowering, LoweringError, LoweringRegistry
from rewrite.errors import PluginOrderError, UnknownPluginError
from rewrite.plugins.base import Plugin

ENTRY_POINT_GROUP = "rewrite.plugins"


@functools.lru_cache(maxsize=1)
def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager: hookspecs added, built-ins registered, entry points loaded."""
    from rewrite.plugins import builtin

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(builtin, name="rewrite.builtin")
    pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    return pm


def available_plugins() -> dict[str, Plugin]:
    """All plugins by short name, built-ins first, then third-party in entry-point order.

    Raises:
        UnknownPluginError: two plugins claim the same short name.
    """
    out: dict[str, Plugin] = {}
    for batch in reversed(get_plugin_manager().hook.rewrite_plugins()):  # pluggy calls last-registered first
        for p in batch:
            if p.short in out and type(out[p.short]) is not type(p):
                raise UnknownPluginError(f"plugin short name '{p.short}' is claimed by both {out[p.short].name} and {p.name}")
            out[p.short] = p
    return out


def lowering_registry() -> LoweringRegistry:
    """Every lowering: those of the abstract ops of all available plugins (selected or not, so a graph rewritten
    in an earlier run can be lowered), then those of the ``rewrite_lowerings`` hook.

    Raises:
        LoweringError: two lowerings claim one (op, backend, target), or one names an unknown target.
    """
    reg = LoweringRegistry()
    for p in available_plugins().values():
        for op in p.abstract_ops:
            for low in op.lowerings():
                reg.add(low)
    for impl in get_plugin_manager().hook.rewrite_lowerings.get_hookimpls():  # each package's, to name it
        batch = impl.function()
        if not isinstance(batch, (list, tuple)) or not all(isinstance(low, Lowering) for low in batch):
            got = (f"a list holding a {type(next(x for x in batch if not isinstance(x, Lowering))).__name__}"
                   if isinstance(batch, (list, tuple)) else f"a {type(batch).__name__}")
            raise LoweringError(f"rewrite_lowerings() of {impl.plugin_name} returned {got}; "
                                "expected a list of rewrite.core.lowering.Lowering")
        for low in batch:
            reg.add(low)
    return reg


def select_plugins(names: list[str] | str) -> list[Plugin]:
    """Plugins for ``--plugins a,b`` in one canonical order, whatever the order given: the order their
    ``runs_before`` / ``runs_after`` declarations require, otherwise registration order (built-ins first, in
    :mod:`rewrite.plugins.builtin`'s order, then third-party plugins).

    Raises:
        UnknownPluginError: a name is not registered; the message lists the available ones.
        PluginOrderError: the declarations of the selected plugins contradict each other (names the cycle).
    """
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    avail = available_plugins()
    out = []
    for n in names:
        p = avail.get(n) or next((q for q in avail.values() if q.name == n), None)
        if p is None:
            raise UnknownPluginError(f"unknown plugin '{n}'; available: {', '.join(sorted(avail))}")
        if p not in out:
            out.append(p)
    rank = {q.short: i for i, q in enumerate(avail.values())}
    return _ordered(sorted(out, key=lambda p: rank[p.short]))


def _ordered(plugins: list[Plugin]) -> list[Plugin]:
    """Topological sort of ``plugins`` by their declared ``runs_before`` / ``runs_after``; among plugins free to
    run, the earliest in ``plugins`` goes first."""
    shorts = {p.short for p in plugins}
    after: dict[str, set[str]] = {p.short: set() for p in plugins}  # plugin -> those that must run before it
    for p in plugins:
        for q in p.runs_before:
            if q in shorts:
                after[q].add(p.short)
        for q in p.runs_after:
            if q in shorts:
                after[p.short].add(q)
    done: list[Plugin] = []
    left = list(plugins)
    while left:
        ready = next((p for p in left if after[p.short] <= {d.short for d in done}), None)
        if ready is None:
            cycle = ", ".join(f"{p.short} after {'/'.join(sorted(after[p.short] - {d.short for d in done}))}" for p in left)
            raise PluginOrderError(f"the selected plugins' order declarations contradict each other: {cycle}")
        done.append(ready)
        left.remove(ready)
    return done
