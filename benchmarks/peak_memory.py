"""Run a command and print the peak memory of its process tree, split into anonymous and file-backed pages.

``ru_maxrss`` (what ``/usr/bin/time`` prints) counts the pages of memory-mapped weight files a process has read;
those are page cache the kernel drops under pressure, not memory the process needs. For a model whose weights
are memory-mapped, the figure that must not grow with the weights is the anonymous part. This samples
``/proc/<pid>/status`` (``RssAnon``, ``RssFile``; Linux) of the command and its descendants every 0.1 s.

    python benchmarks/peak_memory.py -- rewrite verify big.onnx big_ort/
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path


def _tree(root: int) -> list[int]:
    """``root`` and its live descendants (from /proc/*/stat parent ids)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _kib(pid: int) -> tuple[int, int]:
    """(RssAnon, RssFile) of ``pid`` in KiB; zeros for a process that is gone."""
    anon = file = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1])
            elif line.startswith("RssFile:"):
                file = int(line.split()[1])
    except OSError:
        pass
    return anon, file


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command given")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    peak_anon = peak_file = peak_total = 0
    while proc.poll() is None:
        sizes = [_kib(p) for p in _tree(proc.pid)]
        anon, file = sum(a for a, _ in sizes), sum(f for _, f in sizes)
        peak_anon, peak_file, peak_total = max(peak_anon, anon), max(peak_file, file), max(peak_total, anon + file)
        time.sleep(0.1)
    wall = time.monotonic() - t0
    gib = 1 << 20
    print(f"peak_memory: exit {proc.returncode}, {wall:.1f} s; peak anonymous {peak_anon / gib:.2f} GiB, peak file-backed "
          f"{peak_file / gib:.2f} GiB, peak resident {peak_total / gib:.2f} GiB (process tree, sampled every 0.1 s)",
          file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
