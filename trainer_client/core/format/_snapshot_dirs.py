"""A job's directory of host-memory snapshots (``<shm_dir>/<job>/``): which snapshots it holds, which of them
is the newest whole one, and when each may go.

Its own module because it is about the snapshots of a job together, over time, where
``trainer_client/core/format/_snapshot.py`` is about one snapshot (its record, whether it is intact, its bytes).
The trainer (``MemoryTier``) and ckptd (its snapshot keeper) share these rules: only directories named by a step
are finished snapshots (``complete_snapshots``; a writer works under ``<step>.tmp-<pid>``), what writers that are
gone left behind is dropped (``drop_leftovers``), a snapshot ckptd must persist stays until it is marked persisted
(``mark_persisted``, ``evictable``) or superseded (``mark_superseded``: a newer snapshot marked persist took its
place while a persist was still running; it is then kept only as a memory-only snapshot is), and eviction goes
oldest first (``evict_oldest``). Both directories are
checked private before anything in them is believed (``check_job_dir``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import time
from pathlib import Path

from pydantic import ValidationError

from trainer_client.core._errors import UnsafePathError
from trainer_client.core.format._files import (
    SNAPSHOT_PERSISTED_FILE,
    SNAPSHOT_SPARE_PREFIX,
    SNAPSHOT_SUPERSEDED_FILE,
)
from trainer_client.core.format._private_files import check_private_dir, is_real_dir, read_private, write_private
from trainer_client.core.format._snapshot import SnapshotMeta, problems, read_meta

_log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^[0-9]{1,19}$")


def job_dir(shm_dir: str | os.PathLike[str], job: str) -> Path:
    return Path(shm_dir) / job


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: a number no pid is (a name anyone could write)
        return False
    except PermissionError:
        return True
    return True


_UNFINISHED = re.compile(r"^[0-9]{1,19}\.tmp-([0-9]+)$")  # a snapshot its writer (that pid) had not finished


def drop_leftovers(base: str | os.PathLike[str], *, older_than_s: float | None = None) -> int:
    """Delete what writers that are gone left in a job's snapshot directory ``base``: their spare files and
    the snapshots they were still writing (``<step>.tmp-<pid>``). Gone means: the process no longer exists
    (judged in this PID namespace), or, with ``older_than_s``, the entry was not renewed for that long
    (ckptd's view: a sidecar need not see the trainer's PIDs; a live writer loses at most its spare's head
    start). Returns how many entries were deleted."""
    dropped = 0
    try:
        entries = list(Path(base).iterdir())
    except OSError:
        return 0
    now = time.time()
    for path in entries:
        unfinished = _UNFINISHED.match(path.name)
        if unfinished:
            pid = unfinished.group(1)
        elif path.name.startswith(SNAPSHOT_SPARE_PREFIX):
            pid = path.name[len(SNAPSHOT_SPARE_PREFIX):].removesuffix(".part")
        else:
            continue
        try:
            if older_than_s is not None:
                gone = now - path.stat().st_mtime > older_than_s
            else:
                gone = pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid))
            if not gone:
                continue
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            dropped += 1
        except OSError:
            continue
    return dropped


def check_job_dir(shm_dir: str | os.PathLike[str], job: str) -> Path | None:
    """The job's snapshot directory after checking it and ``shm_dir`` are private (``UnsafePathError``
    otherwise); None when either does not exist."""
    base = job_dir(shm_dir, job)
    try:
        check_private_dir(shm_dir)
        check_private_dir(base)
    except FileNotFoundError:
        return None
    return base


def complete_snapshots(shm_dir: str | os.PathLike[str], job: str) -> list[Path]:
    """Snapshot directories of a job named by a step (finished writing), oldest step first. Links are never
    snapshots; ``UnsafePathError`` when the shm or job directory is not private (``check_job_dir``)."""
    base = check_job_dir(shm_dir, job)
    if base is None:
        return []
    dirs = [p for p in base.iterdir() if _STEP_DIR.match(p.name) and is_real_dir(p)]
    return sorted(dirs, key=lambda p: int(p.name))


def newest_whole(
    shm_dir: str | os.PathLike[str] | None, job: str, *, at_most: int | None = None
) -> tuple[Path, SnapshotMeta] | None:
    """The newest snapshot of ``job`` that is whole (and not beyond ``at_most``), with its metadata."""
    if shm_dir is None:
        return None
    try:
        held = complete_snapshots(shm_dir, job)
    except UnsafePathError as exc:  # never resume from what someone else could have written
        _log.warning("not using the memory tier of %s: %s", job, exc)
        return None
    for path in reversed(held):
        if at_most is not None and int(path.name) > at_most:
            continue
        if not problems(path):
            meta = read_meta(path)
            if not meta.is_part:  # one host's part is whole only if every host's is (docs/multihost.md)
                return path, meta
    return None


def is_persisted(path: str | os.PathLike[str]) -> bool:
    return Path(path, SNAPSHOT_PERSISTED_FILE).is_file()


def mark_persisted(path: str | os.PathLike[str], step_url: str) -> None:
    record = json.dumps({"path": step_url, "persisted_at": time.time()}).encode()
    write_private(Path(path, SNAPSHOT_PERSISTED_FILE), record)


_MAX_MARK_BYTES = 64 << 10  # a persisted mark is a path and a time


def persisted_time(path: str | os.PathLike[str]) -> float | None:
    """When ckptd marked the snapshot ``path`` persisted (wall time, ``mark_persisted``'s); None while it has not,
    or when the mark holds no finite time (anyone who can write the directory can write one: an integer no float
    holds, or an infinite time, would otherwise be an OverflowError or an infinite persist cost)."""
    try:
        at = json.loads(read_private(Path(path, SNAPSHOT_PERSISTED_FILE), max_bytes=_MAX_MARK_BYTES))["persisted_at"]
        at = float(at) if isinstance(at, int | float) and not isinstance(at, bool) else None
    except (OSError, ValueError, KeyError, TypeError, OverflowError, UnsafePathError):
        return None
    return at if at is not None and math.isfinite(at) else None


def is_superseded(path: str | os.PathLike[str]) -> bool:
    return Path(path, SNAPSHOT_SUPERSEDED_FILE).is_file()


def mark_superseded(path: str | os.PathLike[str], by_step: int) -> None:
    """Record that ckptd will not persist the snapshot ``path``: the newer snapshot of step ``by_step``, marked
    persist too, took its place while a persist was still running. It is evicted like a memory-only snapshot (oldest
    first, beyond the limit, never the newest), not at once."""
    record = json.dumps({"by_step": by_step, "superseded_at": time.time()}).encode()
    write_private(Path(path, SNAPSHOT_SUPERSEDED_FILE), record)


def unmark_superseded(path: str | os.PathLike[str]) -> None:
    """Take back ``mark_superseded``: the snapshot that took its place was found damaged and dropped, so this one
    is to be persisted after all (the mark itself is removed, never what a link in its place points to)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(Path(path, SNAPSHOT_SUPERSEDED_FILE))


def evictable(path: Path) -> bool:
    """A snapshot may be dropped once nothing still needs it from memory alone: it was never to be persisted, it
    is persisted, or ckptd superseded it with a newer one."""
    try:
        meta = read_meta(path)
    except (OSError, ValueError, ValidationError):
        return True
    return not meta.persist or is_persisted(path) or is_superseded(path)


def evict(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def evict_oldest(held: list[Path], keep_at_most: int, *, never: Path | None = None) -> int:
    """Evict the oldest evictable snapshots of ``held`` (oldest first; they leave the list too) until at most
    ``keep_at_most`` remain or none may go; ``never`` is never evicted. Returns how many were evicted."""
    evicted = 0
    while len(held) > keep_at_most:
        victim = next((p for p in held if p != never and evictable(p)), None)
        if victim is None:
            break
        evict(victim)
        held.remove(victim)
        evicted += 1
    return evicted

__all__ = [
    "check_job_dir",
    "complete_snapshots",
    "drop_leftovers",
    "evict",
    "evict_oldest",
    "evictable",
    "is_persisted",
    "is_superseded",
    "job_dir",
    "mark_persisted",
    "mark_superseded",
    "newest_whole",
]
