"""pluggy hook specifications of the ``rewrite`` project (specs only; implementations live in plugins).

A third-party package registers a module under the entry-point group ``rewrite.plugins``::

    [project.entry-points."rewrite.plugins"]
    rmsnorm = "my_package.rmsnorm"

and that module implements::

    from rewrite.hookspecs import hookimpl

    @hookimpl
    def rewrite_plugins():
        return [RMSNormFusion()]
"""

from __future__ import annotations

import pluggy

PROJECT = "rewrite"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def rewrite_plugins() -> list:
    """Return the :class:`rewrite.plugins.base.Plugin` objects this module provides.

    :return: a list of plugin instances; their ``short`` names must be unique across all packages.
    """
