"""The persist worker as the benchmarks run it (``ServeWorker``), and where a persist's time goes:
``python -m bench.persist_phases --serve ...`` is ckptd's persist worker
(``ckptd.persist._persist_worker``, unchanged, same arguments) with a timer around each phase, its answers
carrying them under ``phases``; ``install()`` puts the same timers into this process for the in-process
persist. ``bench.io`` uses it with ``BENCH_PERSIST_PHASES=1`` (docs/benchmarks.md, "persist phases").

Phases, in seconds from the request's start: ``check`` (every shard's XXH3 through the snapshot's map: in
a thread beside the write since it overlaps it), ``start`` (the arrays made from the map and Orbax's save
started), ``write`` (from then until Orbax's finalize hands over: tensorstore's writes and fsyncs),
``manifest`` (the CRC32C pass reading the step back and the manifest written), ``sync`` (the tree's fsync),
``commit`` (after that until the save is committed), plus the process's CPU time and page faults.
"""

from __future__ import annotations

import functools
import gc
import resource
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptd.config import DEFAULT_PERSIST_NICE
from ckptd.persist._worker_client import WORKER_MODULE, PersistSnapshot, PersistWorkerClient

_events: list[tuple[str, float, float]] = []
_t0 = [0.0]
_lock = threading.Lock()


def _timed(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)
    if getattr(original, "_bench_timed", False):
        return

    @functools.wraps(original)
    def inner(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            with _lock:
                _events.append((label, start - _t0[0], time.perf_counter() - _t0[0]))

    inner._bench_timed = True  # type: ignore[attr-defined]
    setattr(owner, name, inner)


def install() -> None:
    """Time the persist path's phases in this process (idempotent)."""
    import ckptd.persist._persist_worker as worker
    import trainer_client.checkpoint_io._checkpointer as checkpointing

    _timed(worker, "damaged_shards", "check")
    for name in ("problems", "read_meta", "map_data", "snapshot_arrays"):  # the parts of "start"
        _timed(worker, name, f"start.{name}")
    _timed(checkpointing.Checkpointer, "__init__", "start.checkpointer")
    _timed(checkpointing.Checkpointer, "save_with_metadata", "start")
    _timed(checkpointing.Checkpointer, "_before_commit", "before_commit")
    _timed(checkpointing, "build_manifest", "crc")
    _timed(checkpointing, "write_manifest", "write_manifest")
    _timed(checkpointing, "sync_tree", "sync")


# The kernel's memory work during a persist, machine-wide (the benchmark runs one thing at a time): direct
# reclaim (allocstall_*, pgscan_direct), compaction stalls and transparent huge pages faulted in, each of
# which the allocating process pays in system CPU.
_VMSTAT = ("allocstall", "pgscan_direct", "compact_stall", "thp_fault_alloc")


def vmstat() -> dict[str, float]:
    counts = dict.fromkeys(_VMSTAT, 0.0)
    try:
        lines = Path("/proc/vmstat").read_text().splitlines()
    except OSError:
        return counts
    for line in lines:
        name, _, value = line.partition(" ")
        for key in _VMSTAT:
            if name == key or name.startswith(key + "_"):
                counts[key] += float(value)
    return counts


Started = tuple[float, resource.struct_rusage, dict[str, float]]

_gc_seconds = [0.0, 0.0]  # total time in Python's garbage collector; when the running collection started


def _gc_timer(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _gc_seconds[1] = time.perf_counter()
    else:
        _gc_seconds[0] += time.perf_counter() - _gc_seconds[1]


if _gc_timer not in gc.callbacks:
    gc.callbacks.append(_gc_timer)


def begin() -> Started:
    with _lock:
        _events.clear()
    _t0[0] = time.perf_counter()
    _gc_seconds[0] = 0.0
    return _t0[0], resource.getrusage(resource.RUSAGE_SELF), vmstat()


def end(started: Started) -> dict[str, float]:
    """The phases of the persist since ``begin``."""
    total = time.perf_counter() - started[0]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with _lock:
        spans: dict[str, tuple[float, float]] = {}
        for label, a, b in _events:
            spans.setdefault(label, (a, b))

    def length(label: str) -> float:
        a, b = spans.get(label, (0.0, 0.0))
        return b - a

    start = spans.get("start", (0.0, 0.0))
    before = spans.get("before_commit", (start[1], start[1]))
    return {
        "total": total,
        "check": length("check"),
        "start": start[1],
        "write": before[0] - start[1],
        "manifest": length("crc") + length("write_manifest"),
        "sync": length("sync"),
        "commit": total - before[1],
        **{label: length(label) for label in spans if label.startswith("start.")},
        "cpu_user": usage.ru_utime - started[1].ru_utime,
        "cpu_system": usage.ru_stime - started[1].ru_stime,
        "page_faults": float(usage.ru_minflt - started[1].ru_minflt),
        "involuntary_switches": float(usage.ru_nivcsw - started[1].ru_nivcsw),
        "gc": _gc_seconds[0],
        **{f"vm_{key}": value - started[2][key] for key, value in vmstat().items()},
    }


class ServeWorker:
    """``python -m ckptd.persist._persist_worker --serve``, as ckptd's SnapshotKeeper runs it: one long-lived child
    for all snapshots, a JSON request line and a JSON answer line per snapshot. With ``phases`` (the default;
    ``BENCH_PERSIST_PHASES=0`` turns it off) the same worker through ``bench.persist_phases``, which times
    each phase of a persist and sends the times with its answer (``last_phases``). ``nice``: ckptd's default
    (``CKPTD_PERSIST_NICE``) unless ``BENCH_PERSIST_NICE`` says otherwise (to measure what it costs)."""

    def __init__(self, phases: bool = True, nice: int = DEFAULT_PERSIST_NICE) -> None:
        # the same arguments as SnapshotKeeper's worker: niced, compression off
        self.worker = PersistWorkerClient(nice=nice, module="bench.persist_phases" if phases else WORKER_MODULE)
        self.last_phases: dict[str, float] = {}

    def persist(self, snapshot: Path, job_dir: Path) -> str:
        answer = self.worker.exchange(PersistSnapshot(snapshot=str(snapshot), job_url=str(job_dir)))
        if not answer.ok or answer.path is None:
            raise RuntimeError(f"persist worker failed: {answer.error}")
        self.last_phases = dict((answer.model_extra or {}).get("phases") or {})
        return answer.path

    def close(self) -> None:
        self.worker.close(60.0)


def main(argv: list[str] | None = None) -> int:
    import ckptd.persist._persist_worker as worker

    install()
    handle: Callable[..., dict[str, Any]] = worker.handle

    def timed_handle(request: object, compression: bool = False) -> dict[str, Any]:
        started = begin()
        answer = handle(request, compression)
        answer["phases"] = end(started)
        return answer

    worker.handle = timed_handle
    return worker.main(argv)


if __name__ == "__main__":
    sys.exit(main())
