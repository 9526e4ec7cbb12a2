"""Building plugin kernel objects, with a content-hashed cache.

CPU kernels are bare-metal C compiled for IREE's embedded ELF loader (no libc, no TLS, no stack
protector): ``gcc -ffreestanding -fPIC -fno-stack-protector -O2 -c``, linked into the executable through
``hal.executable.objects`` and called with the ``llvm.bareptr`` ABI (base pointer, then offset, per
memref). CUDA kernels are compiled with ``nvcc -ptx`` for one SM architecture (PTX for ``sm_80`` runs on
sm_80 and later through the driver's JIT); a package may ship the PTX beside the source (``<stem>.<arch>.ptx``,
first line ``// rewrite-kernel <digest>``) for machines without nvcc, used only while its digest matches the
source. Every object's file name carries a hash of the source and flags, so a changed source is rebuilt and an
unchanged one never is. The cache is ``$REWRITE_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/rewrite/kernels``, else
``~/.cache/rewrite/kernels``; output folders hold copies (:meth:`rewrite.backends.iree_patch.PatchContext.object_path`).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

from rewrite.errors import BackendError

CPU_FLAGS = ("-ffreestanding", "-fPIC", "-fno-stack-protector", "-fno-builtin", "-O3", "-c")
#: host architecture -> (IREE's embedded-ELF executable format, gcc flags): objects are built for the machine that
#: compiles the module, whose llvm-cpu target is its own CPU (``--iree-llvmcpu-target-cpu=host``)
CPU_TARGETS = {"x86_64": ("embedded-elf-x86_64", ("-march=x86-64-v2",)), "aarch64": ("embedded-elf-arm_64", ("-march=armv8-a",))}
NVCC_FLAGS = ("-ptx", "-O3")
DEFAULT_CUDA_ARCH = "sm_80"  #: PTX the H100/H200 (sm_90) and A100 (sm_80) drivers all JIT
PTX_HEADER = "// rewrite-kernel "  #: first line of a shipped PTX file, then the digest of its source and flags


def cache_dir() -> Path:
    """The kernel cache (see the module docstring), created if missing."""
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    d = Path(os.environ.get("REWRITE_KERNEL_CACHE") or Path(xdg) / "rewrite" / "kernels")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _digest(source: Path, flags: tuple[str, ...]) -> str:
    """Digest of ``source``, the files it includes by a quoted path relative to its folder (one level: a CUDA
    kernel that includes the C kernel it is built from, or the plugins' shared ``rewrite/plugins/kernels/*.h``),
    and ``flags``."""
    text = source.read_bytes()
    included = [source.parent / m.decode() for m in re.findall(rb'^\s*#\s*include\s+"([^"]+)"', text, flags=re.M)]
    data = text + b"".join(p.read_bytes() for p in included if p.is_file())
    return hashlib.sha256(data + " ".join(flags).encode()).hexdigest()[:16]


def kernel_source(module_file: str, name: str) -> Path:
    """``kernels/<name>`` beside the module ``module_file`` (pass ``__file__``): a plugin's kernel sources are
    package data in its own folder. Raises BackendError when it is missing (a package built without them)."""
    p = Path(module_file).resolve().parent / "kernels" / name
    if not p.is_file():
        raise BackendError(f"kernel source {p} not found (is the package installed with its kernels/ data?)")
    return p


def _host_cpu() -> tuple[str, tuple[str, ...]]:
    machine = platform.machine().lower().replace("arm64", "aarch64").replace("amd64", "x86_64")
    if machine not in CPU_TARGETS:
        raise BackendError(f"llvm-cpu kernels are built for {', '.join(CPU_TARGETS)}; this machine is {platform.machine()}")
    return CPU_TARGETS[machine]


def cpu_executable_target() -> str:
    """``#hal.executable.target<"llvm-cpu", "embedded-elf-<arch>">`` for this machine: the key under which a
    lowering lists its CPU kernel objects in ``hal.executable.objects``.

    Raises:
        BackendError: a host architecture without kernel flags (:data:`CPU_TARGETS`).
    """
    return f'#hal.executable.target<"llvm-cpu", "{_host_cpu()[0]}">'


def build_cpu_object(source: Path, *, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile a C kernel to an object for IREE llvm-cpu static linking; returns the cached object's path.

    Raises:
        BackendError: no C compiler, or the compiler failed (first error line).
    """
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BackendError("no C compiler found (set CC or install gcc) to build plugin kernels")
    flags = CPU_FLAGS + _host_cpu()[1] + tuple(extra_flags)
    digest = _digest(source, flags)
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


def source_nvcc_flags(source: Path) -> tuple[str, ...]:
    """The nvcc flags a kernel source asks for itself, on a ``// nvcc-flags: ...`` line among its first 30 lines
    (so that the lowering, a shipped PTX and its check build it the same way)."""
    for line in source.read_text().splitlines()[:30]:
        if line.startswith("// nvcc-flags:"):
            return tuple(line.split(":", 1)[1].split())
    return ()


def build_cuda_ptx(source: Path, arch: str = DEFAULT_CUDA_ARCH, *, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile a CUDA kernel to PTX for ``arch`` (``nvcc -ptx -arch=<arch> -O3`` and the source's own
    :func:`source_nvcc_flags`; ``$NVCC`` or ``nvcc`` on the PATH); returns the cached file's path. Without nvcc, the PTX shipped beside the source
    (``<stem>.<arch>.ptx``, see the module docstring) is used when its digest matches.

    Raises:
        BackendError: no nvcc and no matching shipped PTX, or nvcc failed (first error line).
    """
    flags = (*NVCC_FLAGS, *source_nvcc_flags(source), f"-arch={arch}", *extra_flags)
    digest = _digest(source, flags)
    out = cache_dir() / f"{source.stem}-{digest}.{arch}.ptx"
    if out.is_file():
        return out
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    if nvcc is None:
        shipped = source.with_name(f"{source.stem}.{arch}.ptx")
        if shipped.is_file() and shipped.read_text().split("\n", 1)[0] == PTX_HEADER + digest:
            shutil.copyfile(shipped, out)
            return out
        why = f"{shipped.name} was built from another version of the source" if shipped.is_file() else f"no {shipped.name} ships with it"
        raise BackendError(f"building kernel {source.name} for {arch} needs nvcc (set NVCC or put it on the PATH); {why}")
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    r = subprocess.run([nvcc, *flags, str(source), "-o", str(tmp)], capture_output=True, text=True)
    if r.returncode != 0:
        first = next((l for l in r.stderr.splitlines() if "error" in l), r.stderr.strip().splitlines()[0] if r.stderr.strip() else "failed")
        raise BackendError(f"building kernel {source.name} with nvcc failed: {first}")
    tmp.write_text(PTX_HEADER + digest + "\n" + tmp.read_text())
    tmp.replace(out)
    return out


def ship_cuda_ptx(source: Path, arch: str = DEFAULT_CUDA_ARCH) -> Path:
    """Build the PTX of ``source`` with nvcc and write it beside the source as ``<stem>.<arch>.ptx``, for a
    package to ship to machines without nvcc. Raises BackendError like :func:`build_cuda_ptx`."""
    if not (os.environ.get("NVCC") or shutil.which("nvcc")):
        raise BackendError("shipping a PTX file needs nvcc")
    shipped = source.with_name(f"{source.stem}.{arch}.ptx")
    shutil.copyfile(build_cuda_ptx(source, arch), shipped)
    return shipped
