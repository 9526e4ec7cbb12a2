"""Building plugin kernel objects, with a content-hashed cache.

CPU kernels are bare-metal C compiled for IREE's embedded ELF loader (no libc, no TLS, no stack
protector): ``gcc -ffreestanding -fPIC -fno-stack-protector -O2 -c``, linked into the executable through
``hal.executable.objects`` and called with the ``llvm.bareptr`` ABI (base pointer, then offset, per
memref). The object's file name carries a hash of the source and flags, so a changed source is rebuilt and
an unchanged one never is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from rewrite.errors import BackendError

KERNEL_ROOT = Path(__file__).resolve().parents[2] / "plugin_kernels"
CPU_FLAGS = ("-ffreestanding", "-fPIC", "-fno-stack-protector", "-fno-builtin", "-O3", "-march=x86-64-v2", "-c")


def cache_dir() -> Path:
    """``$REWRITE_KERNEL_CACHE`` or ``~/.cache/rewrite/kernels``."""
    d = Path(os.environ.get("REWRITE_KERNEL_CACHE", Path.home() / ".cache" / "rewrite" / "kernels"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def kernel_source(plugin: str, name: str) -> Path:
    """``plugin_kernels/<plugin>/<name>``; raises BackendError when it is missing."""
    p = KERNEL_ROOT / plugin / name
    if not p.is_file():
        raise BackendError(f"kernel source {p} not found")
    return p


def build_cpu_object(source: Path, *, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile a C kernel to an object for IREE llvm-cpu static linking; returns the cached object's path.

    Raises:
        BackendError: no C compiler, or the compiler failed (first error line).
    """
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BackendError("no C compiler found (set CC or install gcc) to build plugin kernels")
    flags = CPU_FLAGS + tuple(extra_flags)
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    obj = cache_dir() / f"{source.stem}-{digest}.o"
    if obj.is_file():
        return obj
    tmp = obj.with_suffix(f".{os.getpid()}.tmp.o")
    r = subprocess.run([cc, *flags, str(source), "-o", str(tmp)], capture_output=True, text=True)
    if r.returncode != 0:
        first = next((l for l in r.stderr.splitlines() if "error" in l), r.stderr.strip().splitlines()[0] if r.stderr.strip() else "failed")
        raise BackendError(f"building kernel {source.name} failed: {first}")
    tmp.replace(obj)
    return obj
