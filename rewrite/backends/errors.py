"""Errors raised by the backends.

Every backend failure derives from :class:`BackendError`, so a caller can catch one type. The
messages are a single line naming the file involved and the tool's key diagnostic; full logs, where
a tool writes them, are kept in a file whose path the message names.
"""


from rewrite.errors import BackendError

__all__ = ["BackendError", "IreeCompileError", "IreeImportError", "IreeRuntimeError"]


class IreeImportError(BackendError):
    """IREE's ONNX importer rejected a model, or its output has no usable entry function."""


class IreeCompileError(BackendError):
    """``iree-compile`` failed on an MLIR file."""


class IreeRuntimeError(BackendError):
    """Loading a compiled IREE module or invoking one of its functions failed."""
