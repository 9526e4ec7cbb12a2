"""Backends by name, and loading a lowered output folder for running."""

from __future__ import annotations

import os
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


def load_runner(folder: str | Path, *, low_memory: bool | None = None) -> Runner:
    """Load an output folder of ``rewrite apply`` for running. Raises BackendError if it is not one.

    ``low_memory`` (see :meth:`Backend.load`): None decides by size, True when the folder's files take more than
    :data:`LOW_MEMORY_SHARE` of the memory available now (a runtime's copies of the weights would not fit beside
    what else runs)."""
    folder = Path(folder)
    m = Manifest.read(folder)
    if low_memory is None:
        low_memory = needs_low_memory(folder)
    return get_backend(m.backend).load(folder, m, low_memory=low_memory)


#: share of the available memory a folder's weights may take before runners keep them memory-mapped
LOW_MEMORY_SHARE = 0.4


def available_memory() -> int:
    """Bytes of memory available to a new allocation now: ``MemAvailable`` of /proc/meminfo (Linux), else the
    physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def needs_low_memory(folder: str | Path) -> bool:
    """Whether the files of ``folder`` (its weights) take more than :data:`LOW_MEMORY_SHARE` of
    :func:`available_memory`."""
    folder = Path(folder)
    if not folder.is_dir():
        return False  # (loading it says what is wrong)
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    return size > LOW_MEMORY_SHARE * available_memory()
