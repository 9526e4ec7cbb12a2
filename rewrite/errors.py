"""Errors raised by rewrite. Every message is one line that names the file, node or value at fault.

The CLI prints ``error: <message>`` for any :class:`RewriteError` and exits with status 2, so nothing
below should need a stack trace to be understood.
"""

from __future__ import annotations


class RewriteError(Exception):
    """Base class of every error rewrite raises on purpose (bad input, refused rewrite, backend failure)."""


class ModelLoadError(RewriteError):
    """The input is not a loadable ONNX model: not protobuf, truncated, or its external data is missing."""


class UnsupportedModelError(RewriteError):
    """The model is valid ONNX but uses something the selected plugins or backend cannot handle
    (an unknown domain, an opset outside a plugin's declared range)."""


class PluginError(RewriteError):
    """A plugin raised while rewriting; the graph was restored to its state before the plugin ran.

    Attributes:
        plugin: short name of the plugin.
        rule: name of the rule that was running, or None.
        node: name of the graph node the rule was matched at, or None.
    """

    def __init__(self, plugin: str, rule: str | None, node: str | None, cause: BaseException | str):
        self.plugin, self.rule, self.node = plugin, rule, node
        where = f"plugin '{plugin}'"
        if rule:
            where += f", rule '{rule}'"
        if node:
            where += f", at node '{node}'"
        msg = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"{where}: {msg} (graph left unchanged by this plugin)")


class UnknownPluginError(RewriteError):
    """A name given to ``--plugins`` is not registered."""


class PluginOrderError(RewriteError):
    """The ``runs_before`` / ``runs_after`` declarations of the selected plugins form a cycle."""


class InputError(RewriteError):
    """Feeds that do not fit the model's signature (missing, unexpected, wrong dtype or shape, token id
    outside the vocabulary); raised before any runtime sees them."""


class BackendError(RewriteError):
    """A backend failed to lower, compile or run a model."""


class VerificationError(RewriteError):
    """Outputs of a lowered model differ from the original beyond tolerance."""
