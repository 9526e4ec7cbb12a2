"""Stages of long work (load, each plugin, save, import, compile): wall time, memory, and progress to show.

Code that does long work opens a stage and reports its progress; whoever runs it (the command line) installs a
`Listener` to draw progress bars, or none. Both sides meet through a context variable, so no function between
them takes a progress argument::

    with stage("save", total=nbytes, unit="B") as advance:
        for chunk in ...:
            advance(len(chunk))

Each finished stage becomes a `StageRecord`: seconds, the resident set size at its end and the process's peak
resident set size so far (``getrusage``'s ``ru_maxrss``: a stage that raised it shows the new peak), and the peak of
finished child processes (iree-compile, IREE's importer) the same way. A child's peak is at least this process's
resident size when it was forked: Linux counts the child's pages from the fork, before it execs.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field


@dataclass
class StageRecord:
    """One finished stage.

    Attributes:
        name: e.g. ``load``, ``plugin quant4``, ``save``, ``iree import``, ``iree compile``.
        seconds: wall time.
        rss_mb: this process's resident set size at the end of the stage, MiB.
        peak_rss_mb: this process's peak resident set size since it started, at the end of the stage, MiB.
        children_peak_rss_mb: the largest peak resident set size of a finished child process, MiB.
        done, total, unit: progress reached, out of ``total`` (None: not counted), in ``unit`` (``B``, ``tensors``).
    """

    name: str
    seconds: float
    rss_mb: float
    peak_rss_mb: float
    children_peak_rss_mb: float
    done: int = 0
    total: int | None = None
    unit: str = ""

    def to_json(self) -> dict:
        return asdict(self)


class Listener:
    """Receives stage events (the command line draws progress bars from them). The default does nothing."""

    def started(self, name: str, total: int | None, unit: str) -> None:
        """A stage began; ``total`` is None when its progress is not counted."""

    def advanced(self, name: str, done: int) -> None:
        """The stage reached ``done`` units."""

    def finished(self, record: StageRecord) -> None:
        """The stage ended (normally or by an exception)."""


@dataclass
class Recorder:
    """The stages run while it is installed (`recording`), in the order they finished, with a `Listener`."""

    listener: Listener = field(default_factory=Listener)
    records: list[StageRecord] = field(default_factory=list)


_current: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("rewrite_stages", default=None)


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def _peak_mb(who: int) -> float:
    kb = resource.getrusage(who).ru_maxrss  # kilobytes on Linux
    return kb / 1024


@contextlib.contextmanager
def recording(listener: Listener | None = None) -> Iterator[Recorder]:
    """Install a `Recorder` for the stages run inside the ``with`` block."""
    rec = Recorder(listener or Listener())
    token = _current.set(rec)
    try:
        yield rec
    finally:
        _current.reset(token)


@contextlib.contextmanager
def stage(name: str, total: int | None = None, unit: str = "") -> Iterator[Callable[[int], None]]:
    """Time ``name``; yields ``advance(n)`` to report ``n`` more units of ``total`` done. Without a recorder
    installed it only yields a no-op."""
    rec = _current.get()
    if rec is None:
        yield lambda n: None
        return
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        rec.listener.advanced(name, done)

    rec.listener.started(name, total, unit)
    start = time.perf_counter()
    try:
        yield advance
    finally:
        record = StageRecord(name, round(time.perf_counter() - start, 3), round(_rss_mb(), 1),
                             round(_peak_mb(resource.RUSAGE_SELF), 1), round(_peak_mb(resource.RUSAGE_CHILDREN), 1),
                             done, total, unit)
        rec.records.append(record)
        rec.listener.finished(record)
