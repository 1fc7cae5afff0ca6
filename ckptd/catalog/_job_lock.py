"""The lock a job's commit and its cleanup of abandoned saves both hold (docs/multihost.md, section 5, "Commit
and cleanup exclude each other"): between the threads of one sidecar (a lock per job directory) and, on a
local root, between processes and sidecars sharing the root (``fcntl.flock`` on ``<job>/.ckptd/lock``), so a
leader paused inside a cleanup (SIGSTOP, a stalled host) while a newer leader took over can never delete a
save that one is committing: the newer leader waits for the lock, and gives up after ``LOCK_WAIT_S`` (its
next pass tries again) rather than stall behind a paused process for good. The holder checks again, under
the lock, that it still leads before it writes or deletes anything.

On ``gs://`` only the threads of one process are excluded; there a save's fate record fences the sidecars
(``trainer_client/core/format/_fates.py``, docs/multihost.md, section 5, "Fenced writers").
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from trainer_client.core._errors import UnsafePathError
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import JOB_LOCK

LOCK_WAIT_S = 10.0  # how long a commit or a cleanup waits for another process holding the job's lock
_POLL_S = 0.05

_guard = threading.Lock()
_locks: dict[str, threading.RLock] = {}
_files: dict[str, tuple[int, int]] = {}  # job directory -> (the flocked descriptor, how deep this thread holds it)


def _thread_lock(key: str) -> threading.RLock:
    with _guard:
        return _locks.setdefault(key, threading.RLock())


def _flock(path: str, wait_s: float) -> int | None:
    """A descriptor of ``path`` holding its exclusive ``flock``, or None when another holder kept it ``wait_s``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(_POLL_S)


@contextmanager
def job_lock(storage: Storage, job: str, wait_s: float | None = None) -> Iterator[bool]:
    """Hold ``job``'s lock; yields whether it is held (False: another process kept it ``wait_s``, by default
    ``LOCK_WAIT_S``: do nothing now). Re-entrant within a thread. A job ckptd may not write (read-only) takes
    only the threads' lock: nothing is written there."""
    key = storage.join(job)
    lock = _thread_lock(key)
    with lock:
        if storage.is_remote:
            yield True
            return
        held = _files.get(key)
        if held is None:
            try:
                path = storage.writable(storage.join(job, JOB_LOCK))
            except UnsafePathError:
                yield True
                return
            fd = _flock(path, LOCK_WAIT_S if wait_s is None else wait_s)
            if fd is None:
                yield False
                return
            held = (fd, 0)
        _files[key] = (held[0], held[1] + 1)
        try:
            yield True
        finally:
            fd, depth = _files.pop(key)
            if depth > 1:
                _files[key] = (fd, depth - 1)
            else:
                os.close(fd)  # releases the flock


__all__ = ["LOCK_WAIT_S", "job_lock"]
