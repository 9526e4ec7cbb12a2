"""Backends by name, and loading a lowered output folder for running."""

from __future__ import annotations

from pathlib import Path

from rewrite.backends.base import Backend, Manifest, Runner
from rewrite.errors import BackendError


def get_backend(name: str) -> Backend:
    """``ort`` or ``iree``. Raises BackendError for another name."""
    if name == "ort":
        from rewrite.backends.ort import OrtBackend

        return OrtBackend()
    if name == "iree":
        from rewrite.backends.iree import IreeBackend

        return IreeBackend()
    raise BackendError(f"unknown backend '{name}'; available: iree, ort")


def load_runner(folder: str | Path) -> Runner:
    """Load an output folder of ``rewrite apply`` for running. Raises BackendError if it is not one."""
    folder = Path(folder)
    m = Manifest.read(folder)
    return get_backend(m.backend).load(folder, m)
