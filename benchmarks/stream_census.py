"""What one call of a compiled IREE folder asks of the device, read from the compiler rather than timed: the
dispatches, copies and fills of the entry function's stream IR, and the bytes its copies move.

    python benchmarks/stream_census.py out_a/ out_b/ ...

Each folder is one ``rewrite apply --backend iree`` wrote (``model.mlir`` and ``compile.log``, whose first line is
the iree-compile command that built ``model.vmfb``). The command is run again with ``--compile-to=stream`` (the
phase after which the dispatches and transfers of a call are fixed: ``stream.cmd.dispatch``, ``stream.cmd.copy``,
``stream.cmd.fill`` in the entry function's ``stream.cmd.execute`` regions) and the entry function's commands are
counted. At decode each command is a launch on the GPU (IREE's CUDA HAL records them into one command buffer), so
the counts are the launches a step issues and the bytes are copy traffic a step pays for, whatever the GPU: they
need no GPU to measure. A folder compiled with ``--stateful`` shows the KV cache copies the stateful module makes
(BENCHMARKS.md, "attention on CUDA").
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path


def census(folder: Path, flags: list[str] = ()) -> dict:
    """Counts for the entry function of ``folder`` (see the module docstring), compiled with ``flags`` added (to try
    an iree-compile option without rebuilding the folder): ``dispatches``, ``copies``,
    ``fills``, ``copy_bytes``, ``big_copies`` (copies of at least 1 MiB) and their ``big_copy_bytes``.

    Raises:
        SystemExit: the folder has no compile.log / manifest, or iree-compile fails."""
    log, manifest = folder / "compile.log", folder / "manifest.json"
    if not log.exists() or not manifest.exists():
        raise SystemExit(f"error: {folder}: no compile.log or manifest.json (an iree folder of rewrite apply expected)")
    cmd = shlex.split(log.read_text().splitlines()[0])
    entry = json.loads(manifest.read_text())["entry_function"]
    out = folder / "census.stream.mlir"
    # the module and its output as the first command wrote them, relative to the folder; then only the phase
    argv = [cmd[0], cmd[1], "-o", out.name, *cmd[4:], *flags, "--compile-to=stream"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=folder)
    if proc.returncode != 0:
        raise SystemExit(f"error: {folder}: iree-compile --compile-to=stream failed: {proc.stderr.strip()[:400]}")
    text = out.read_text()
    out.unlink()
    start = text.find(f"util.func public @{entry}$async(")
    if start < 0:
        start = text.find(f"util.func public @{entry}(")
    if start < 0:
        raise SystemExit(f"error: {folder}: entry function @{entry} not found in the stream IR")
    end = text.find("util.func ", start + 10)
    body = text[start:end if end > 0 else len(text)]
    sizes = [int(n) for n in re.findall(r"stream\.cmd\.copy [^\n]*?, %c(\d+) :", body)]
    big = [n for n in sizes if n >= 1 << 20]
    return dict(dispatches=len(re.findall(r"stream\.cmd\.dispatch ", body)), copies=len(sizes),
                fills=len(re.findall(r"stream\.cmd\.fill ", body)), copy_bytes=sum(sizes), big_copies=len(big),
                big_copy_bytes=sum(big))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--flag", action="append", default=[], help="an iree-compile flag to add (repeatable)")
    args = ap.parse_args()
    print(f"{'folder':<40} {'dispatches':>10} {'copies':>7} {'fills':>6} {'launches':>9} {'MB copied':>10} {'>=1 MiB':>8}")
    for folder in args.folders:
        c = census(folder, args.flag)
        launches = c["dispatches"] + c["copies"] + c["fills"]
        print(f"{str(folder):<40} {c['dispatches']:>10} {c['copies']:>7} {c['fills']:>6} {launches:>9} "
              f"{c['copy_bytes'] / 1e6:>10.1f} {c['big_copies']:>8}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
