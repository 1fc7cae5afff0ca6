"""What the sidecar's processes use, exported with its metrics so that the container's limits can be sized
from what ckptd really uses (docs/operations.md, "Sizing the sidecar").

prometheus_client's ``ProcessCollector`` exports the standard ``process_*`` families of ckptd's own process:
resident memory, CPU seconds, open and maximum file descriptors, start time (Linux only, from /proc).
``ProcessTreeCollector`` adds what it leaves out, from /proc too:

* ``ckptd_process_threads``: ckptd's OS threads (uvicorn's, the handler pool's, the background ones);
* ckptd's child processes. The persist worker (``python -m ckptd.persist._persist_worker``, with jax and
  Orbax) runs beside ckptd in the same container, so the container's memory limit must hold both:
  ``ckptd_child_processes`` and ``ckptd_child_resident_memory_bytes`` (the live descendants), and
  ``ckptd_child_cpu_seconds_total`` (the CPU time of every descendant, the exited ones' included, so the
  counter only rises while ckptd runs).

Elsewhere than Linux (no /proc) neither collector exports anything.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PROC = Path("/proc")
MAX_DEPTH = 4  # a persist worker is a child; nothing of ckptd goes deeper
MAX_DESCENDANTS = 256  # /proc is the kernel's, but a bound keeps a fork storm from making scrapes slow
# /proc/<pid>/stat fields (proc(5), 1-based) as indexes into what follows the command name (from field 3)
_UTIME, _STIME, _CUTIME, _CSTIME, _THREADS, _RSS = (14 - 3, 15 - 3, 16 - 3, 17 - 3, 20 - 3, 24 - 3)


@dataclass(frozen=True)
class _Stat:
    cpu_seconds: float  # user + system
    children_cpu_seconds: float  # of the children it has reaped
    threads: int
    rss_bytes: int


def _ticks_and_page() -> tuple[float, int]:
    try:
        return float(os.sysconf("SC_CLK_TCK")), int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 100.0, 4096


_TICKS, _PAGE = _ticks_and_page()


def _stat(pid: int) -> _Stat | None:
    """A process's /proc/<pid>/stat, or None when it is gone (it may exit at any moment) or unreadable."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    try:
        return _Stat(cpu_seconds=(int(fields[_UTIME]) + int(fields[_STIME])) / _TICKS,
                     children_cpu_seconds=(int(fields[_CUTIME]) + int(fields[_CSTIME])) / _TICKS,
                     threads=int(fields[_THREADS]), rss_bytes=int(fields[_RSS]) * _PAGE)
    except (IndexError, ValueError):
        return None


def _children(pid: int) -> list[int]:
    """The live children of ``pid``: a child started by any of its threads is listed under that thread."""
    found: list[int] = []
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def descendants(pid: int) -> list[int]:
    """The live descendants of ``pid``, breadth first, at most ``MAX_DEPTH`` deep and ``MAX_DESCENDANTS``."""
    found: list[int] = []
    level = [pid]
    for _ in range(MAX_DEPTH):
        level = [child for parent in level for child in _children(parent)][: MAX_DESCENDANTS - len(found)]
        found += level
        if not level:
            break
    return found


class ProcessTreeCollector(Collector):
    """ckptd's thread count and its descendants' processes, memory and CPU, read at each scrape."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid  # None: the process collecting (tests pass another)

    def describe(self) -> Iterable[Metric]:
        return _families()

    def collect(self) -> Iterable[Metric]:
        pid = os.getpid() if self.pid is None else self.pid
        own = _stat(pid)
        if own is None:  # no /proc: not Linux
            return []
        children = [s for s in map(_stat, descendants(pid)) if s is not None]
        values = (own.threads, len(children), sum(c.rss_bytes for c in children),
                  own.children_cpu_seconds + sum(c.cpu_seconds + c.children_cpu_seconds for c in children))
        families = _families()
        for family, value in zip(families, values, strict=True):
            family.add_metric([], value)
        return families


def _families() -> list[GaugeMetricFamily | CounterMetricFamily]:
    return [
        GaugeMetricFamily("ckptd_process_threads", "OS threads of the ckptd process"),
        GaugeMetricFamily("ckptd_child_processes", "live child processes of ckptd (the persist worker)"),
        GaugeMetricFamily("ckptd_child_resident_memory_bytes", "resident memory of ckptd's live child processes"),
        CounterMetricFamily("ckptd_child_cpu_seconds",
                            "user and system CPU time of ckptd's child processes, the exited ones' included"),
    ]


__all__ = ["MAX_DEPTH", "MAX_DESCENDANTS", "ProcessTreeCollector", "descendants"]
