"""What one call of a compiled IREE folder asks of the device, read from the compiler rather than timed.

The folder's iree-compile command (the first line of its ``compile.log``) is run again with
``--compile-to=stream``, the phase after which a call's dispatches and transfers are fixed, and the entry
function's ``stream.cmd.dispatch``, ``stream.cmd.copy`` and ``stream.cmd.fill`` commands are counted. At decode
each command is a launch on the GPU (IREE's CUDA HAL records them into one command buffer), so the counts are the
launches a step issues and the copy bytes are traffic a step pays for, on any GPU: they need no GPU to measure.
``benchmarks/stream_census.py`` prints them for several folders side by side.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Sequence

from rewrite.backends.errors import BackendError


def census(folder: str | Path, flags: Sequence[str] = ()) -> dict:
    """Count the commands of the entry function of the iree folder ``folder`` (``rewrite apply --backend iree``
    output: ``model.mlir``, ``compile.log``, ``manifest.json``), compiled with ``flags`` added (to try an
    iree-compile option without rebuilding the folder).

    Returns:
        ``dispatches``, ``copies``, ``fills`` (counts), ``bindings`` (of all dispatches together: IREE's CUDA driver
        resolves each from the call's binding table at every launch), ``copy_bytes`` and ``largest_copy`` (bytes; a
        copy whose size is known only at run time counts 0),
        ``big_copies`` (copies of at least 1 MiB) and their ``big_copy_bytes``.

    Raises:
        BackendError: the folder has no compile.log or manifest.json, iree-compile fails, or the entry function is
            not in its output."""
    folder = Path(folder)
    log, manifest = folder / "compile.log", folder / "manifest.json"
    if not log.exists() or not manifest.exists():
        raise BackendError(f"{folder}: no compile.log or manifest.json (an iree folder of rewrite apply expected)")
    cmd = shlex.split(log.read_text().splitlines()[0])  # [iree-compile, model.mlir, -o, model.vmfb, flags...]
    entry = json.loads(manifest.read_text())["entry_function"]
    out = folder / "census.stream.mlir"
    argv = [cmd[0], cmd[1], "-o", out.name, *cmd[4:], *flags, "--compile-to=stream"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=folder)
        if proc.returncode != 0:
            raise BackendError(f"{folder}: iree-compile --compile-to=stream failed: {proc.stderr.strip()[:400]}")
        text = out.read_text()
    finally:
        out.unlink(missing_ok=True)
    start = text.find(f"util.func public @{entry}$async(")
    if start < 0:
        start = text.find(f"util.func public @{entry}(")
    if start < 0:
        raise BackendError(f"{folder}: entry function @{entry} not found in the stream IR")
    end = text.find("util.func ", start + 10)
    body = text[start:end if end > 0 else len(text)]
    # sizes are index constants (%c1048576, %c1048576_3); a copy of a size known only at run time counts as 0 bytes
    copies = re.findall(r"stream\.cmd\.copy [^\n]*", body)
    sizes = [int(m.group(1)) if m else 0 for m in (re.search(r", %c(\d+)(?:_\d+)? :", c) for c in copies)]
    big = [n for n in sizes if n >= 1 << 20]
    # each dispatch's bindings are its lines "ro|rw|wo %resource[...]": the host resolves every one per launch
    bindings = len(re.findall(r"^\s*(?:ro|rw|wo) %", body, flags=re.M))
    return dict(dispatches=len(re.findall(r"stream\.cmd\.dispatch ", body)), copies=len(copies), bindings=bindings,
                fills=len(re.findall(r"stream\.cmd\.fill ", body)), copy_bytes=sum(sizes),
                largest_copy=max(sizes, default=0), big_copies=len(big), big_copy_bytes=sum(big))
