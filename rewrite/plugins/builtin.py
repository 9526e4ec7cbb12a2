"""Registers the built-in plugins with the plugin manager."""

from __future__ import annotations

from rewrite.hookspecs import hookimpl


@hookimpl
def rewrite_plugins():
    from rewrite.plugins.cast_roundtrip import CastRoundtrip
    from rewrite.plugins.legalize import Legalize

    return [CastRoundtrip(), Legalize()]
