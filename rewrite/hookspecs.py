"""pluggy hook specifications of the ``rewrite`` project (specs only; implementations live in plugins).

A third-party package registers a module under the entry-point group ``rewrite.plugins``::

    [project.entry-points."rewrite.plugins"]
    rmsnorm = "my_package.rmsnorm"

and that module implements::

    from rewrite.hookspecs import hookimpl

    @hookimpl
    def rewrite_plugins():
        return [RMSNormFusion()]

A package may also (or only) add lowerings of existing abstract ops for more targets::

    @hookimpl
    def rewrite_lowerings():
        return [Lowering("MoERouterTopK", "iree", ("cuda",), lower_router_cuda, origin="my_package")]
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


@hookspec
def rewrite_lowerings() -> list:
    """Return :class:`rewrite.core.lowering.Lowering` objects for abstract ops of any package (a lowering for
    another backend target, say ``iree:cuda``, of a built-in op).

    :return: a list of lowerings; one (op, backend, target) may be claimed by one lowering only.
    """
