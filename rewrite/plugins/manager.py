"""Finding plugins: the built-in ones plus every package registered under the entry-point group ``rewrite.plugins``."""

from __future__ import annotations

import functools

import pluggy

from rewrite import hookspecs
from rewrite.errors import UnknownPluginError
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


def select_plugins(names: list[str] | str) -> list[Plugin]:
    """Plugins for ``--plugins a,b`` in the order given.

    Raises:
        UnknownPluginError: a name is not registered; the message lists the available ones.
    """
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    avail = available_plugins()
    out = []
    for n in names:
        p = avail.get(n) or next((q for q in avail.values() if q.name == n), None)
        if p is None:
            raise UnknownPluginError(f"unknown plugin '{n}'; available: {', '.join(sorted(avail))}")
        out.append(p)
    return out
