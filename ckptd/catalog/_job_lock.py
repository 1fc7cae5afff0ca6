"""The lock a job's commit and its cleanup of abandoned saves both hold (docs/multihost.md, section 5, "Commit
and cleanup exclude each other"): between the threads of one sidecar (a lock per job directory) and, on a
local root, between processes and sidecars sharing the root (``fcntl.flock`` on ``<job>/.ckptd/job.lock``), so a
leader paused inside a cleanup (SIGSTOP, a stalled host) while a newer leader took over can never delete a
save that one is committing: the newer leader waits for the lock, and gives up after ``LOCK_WAIT_S`` (its
next pass tries again) rather than stall behind a paused process for good. The holder checks again, under
the lock, that it still leads before it writes or deletes anything.

Only a writer of the root can hold the lock. ``flock`` needs no write access, so a lock file others may open
is one any local user who can read the root can hold, stopping every commit of the job: the file is created
``0600`` by the sidecar's user (every writer of a root runs as one user), and one that another user owns or
others may open is no writer's lock. The old lock (``<job>/.ckptd/lock``, created ``0644``, perhaps held by a
reader since) is not used any more.

Fencing is never silently off: whatever stands at the lock path that is not such a file (a symbolic link,
wherever it leads; a directory; a FIFO; a file of another user or open to others), or that cannot be opened,
is refused: ``job_lock`` then yields False (nothing is committed, cleaned or deleted in that job), logs an
error naming the path once, and ``lock_troubles`` reports it (``/readyz``, ``ckptd_job_lock_blocked_seconds``
on ``/metrics``) until a pass takes the lock again. A lock held by another process is waited on
``LOCK_WAIT_S`` per try; once tries have failed for ``LOCK_REPORT_S`` it is reported the same way (a warning,
``held``) rather than waited on silently.

On ``gs://`` only the threads of one process are excluded; there a save's fate record fences the sidecars
(``trainer_client/core/format/_fates.py``, docs/multihost.md, section 5, "Fenced writers").
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from trainer_client.core import CkptdError, SaidOnce, Storage, UnsafePathError
from trainer_client.core.format import JOB_LOCK

LOCK_WAIT_S = 10.0  # how long a commit or a cleanup waits for another process holding the job's lock
LOCK_REPORT_S = 60.0  # a job's lock held elsewhere this long (tries failing all along) is reported
_POLL_S = 0.05

_log = logging.getLogger(__name__)
_guard = threading.Lock()
_locks: dict[str, threading.RLock] = {}
_files: dict[str, tuple[int, int]] = {}  # job directory -> (the flocked descriptor, how deep this thread holds it)
_said = SaidOnce()


@dataclass(frozen=True)
class LockTrouble:
    """Why a job's lock was not taken: ``refused`` (what stands at its path is no lock a writer made) or ``held``
    (by another process, past ``LOCK_REPORT_S``)."""

    job: str
    path: str
    state: Literal["refused", "held"]
    detail: str
    since: float  # time.monotonic() when first seen

    def as_dict(self, now: float | None = None) -> dict[str, str | float]:
        now = time.monotonic() if now is None else now
        return {"job": self.job, "path": self.path, "state": self.state, "detail": self.detail,
                "seconds": round(max(0.0, now - self.since), 3)}


_troubles: dict[str, LockTrouble] = {}  # lock path -> its trouble now (reported)
_waiting: dict[str, float] = {}  # lock path -> when a try first found it held elsewhere (not yet reported)


class _Refused(CkptdError):
    """What stands at the lock path is refused (the message says what and why); caught in this module, never
    raised past ``job_lock``."""


def _thread_lock(key: str) -> threading.RLock:
    with _guard:
        return _locks.setdefault(key, threading.RLock())


def _refusal(path: str, exc: OSError) -> str:
    """What an ``OSError`` opening the lock says about what stands at ``path``."""
    if exc.errno == errno.ELOOP or os.path.islink(path):
        return f"a symbolic link (to {os.readlink(path) if os.path.islink(path) else '?'})"
    if exc.errno == errno.EISDIR or os.path.isdir(path):
        return "a directory"
    return f"not openable ({exc.strerror or exc})"


def _open(path: str) -> int:
    """A descriptor of the plain file at ``path`` (created if absent); ``_Refused`` for anything else."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY,
                     0o600)
    except OSError as exc:
        raise _Refused(_refusal(path, exc)) from exc
    info = os.fstat(fd)
    why = None
    if not stat.S_ISREG(info.st_mode):
        why = f"not a plain file (mode {stat.filemode(info.st_mode)})"
    elif info.st_uid != os.geteuid():
        why = (f"a file owned by uid {info.st_uid}, not by this sidecar's user (uid {os.geteuid()}), as every "
               "writer of the root is")
    elif info.st_mode & 0o077:
        why = (f"a file other users may open (mode {stat.filemode(info.st_mode)}), so may hold: no writer made it "
               "(ckptd makes it 0600)")
    if why is not None:
        os.close(fd)
        raise _Refused(why)
    return fd


def _flock(path: str, wait_s: float) -> int | None:
    """A descriptor of ``path`` holding its exclusive ``flock``, or None when another holder kept it ``wait_s``."""
    fd = _open(path)
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


def _refuse(job: str, path: str, what: str) -> None:
    detail = (f"{path} is {what}, not the job's lock file: ckptd takes no lock through it, so it commits, cleans "
              f"and deletes nothing in job {job!r} until it is removed (docs/multihost.md, section 5)")
    with _guard:
        known = _troubles.get(path)
        if known is None or known.state != "refused" or known.detail != detail:
            _troubles[path] = LockTrouble(job, path, "refused", detail, time.monotonic())
    if _said.first(path, detail):
        _log.error("%s", detail)


def _held_elsewhere(job: str, path: str) -> None:
    """A try found the lock at ``path`` held by another process: reported once tries failed ``LOCK_REPORT_S``."""
    now = time.monotonic()
    with _guard:
        since = _waiting.setdefault(path, now)
        if now - since < LOCK_REPORT_S or path in _troubles:
            return
        detail = (f"{path} is held by another process (lsof or fuser names it) and was not taken for "
                  f"{now - since:.0f} s: nothing is committed, cleaned or deleted in job {job!r} meanwhile "
                  "(docs/multihost.md, section 5)")
        _troubles[path] = LockTrouble(job, path, "held", detail, since)
    _log.warning("%s", detail)


def _settled(path: str) -> None:
    """The lock at ``path`` was taken: whatever was reported about it is over."""
    with _guard:
        _waiting.pop(path, None)
        gone = _troubles.pop(path, None)
    if gone is not None:
        _said.first(path, "")  # said again if it comes back
        _log.info("the lock %s of job %r is taken again (%s for %.0f s before)", path, gone.job, gone.state,
                  time.monotonic() - gone.since)


def lock_troubles(root: str | None = None) -> list[LockTrouble]:
    """The jobs (under ``root``, or all) whose lock is refused now, or held elsewhere past ``LOCK_REPORT_S``,
    oldest first."""
    prefix = None if root is None else root.rstrip("/") + "/"
    with _guard:
        found = [t for path, t in _troubles.items() if prefix is None or path.startswith(prefix)]
    return sorted(found, key=lambda t: t.since)


@contextmanager
def job_lock(storage: Storage, job: str, wait_s: float | None = None) -> Iterator[bool]:
    """Hold ``job``'s lock; yields whether it is held (False: another process kept it ``wait_s``, by default
    ``LOCK_WAIT_S``, or what stands at its path is refused: do nothing now). Re-entrant within a thread. A job
    ckptd may not write (read-only, or its directory a link out of the root) takes only the threads' lock:
    nothing is written there."""
    key = storage.join(job)
    lock = _thread_lock(key)
    with lock:
        if storage.is_remote:
            yield True
            return
        held = _files.get(key)
        if held is None:
            if storage.write_refusal(key) is not None:
                yield True  # nothing under the job is ever written (every write refuses): nothing to fence
                return
            path = storage.join(job, JOB_LOCK)
            try:
                storage.writable(path)
                fd = _flock(path, LOCK_WAIT_S if wait_s is None else wait_s)
            except UnsafePathError:  # a link on the way leads out of the root
                _refuse(job, path, f"a symbolic link (to {os.readlink(path)}) leading out of the checkpoint root"
                        if os.path.islink(path) else "behind a symbolic link leading out of the checkpoint root")
                yield False
                return
            except _Refused as exc:
                _refuse(job, path, str(exc))
                yield False
                return
            if fd is None:
                _held_elsewhere(job, path)
                yield False
                return
            _settled(path)
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


__all__ = ["LOCK_REPORT_S", "LOCK_WAIT_S", "LockTrouble", "job_lock", "lock_troubles"]
