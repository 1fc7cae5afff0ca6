"""A job's commit and its cleanup of abandoned saves exclude each other across processes on a local root
(``ckptd/catalog/_job_lock.py``, docs/multihost.md, section 5): a process holding the job's lock, running or
paused by SIGSTOP, keeps another process's cleanup from deleting anything until it lets go; the waiter gives
up after the wait it was allowed and deletes nothing; a cleanup whose sidecar no longer leads deletes nothing.
Real processes, files and ``flock``; the persist worker is never asked (nothing to write)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ckptd.catalog import _job_lock
from ckptd.catalog._job_lock import job_lock
from ckptd.multihost._part_commit import PartSaves
from ckptd.persist._worker_client import InProcessWorker
from tests.server.multihost.test_fencing import _hold as _hold_until  # holds the job "job" until told
from tests.support.forged_records import forge_claim, forge_part
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import JOB_LOCK

STEP = 5


def _no_worker() -> InProcessWorker:
    return InProcessWorker(lambda _request: {"ok": False, "error": "nothing is written here"})


def _take(root: str, held: Any) -> None:
    with job_lock(Storage(root), "job") as got:
        if got:
            held.set()


def _lock_path(root: Path, job: str = "job") -> Path:
    return root / job / JOB_LOCK


def _abandoned_save(root: Path) -> Path:
    """A save of STEP claimed a minute ago with host 1's part never written; its staged directory."""
    forge_claim(root, "job", STEP, created_at=time.time() - 60)
    return forge_part(root, "job", STEP, 0).parent.parent


@pytest.mark.parametrize("paused", [False, True])
def test_a_cleanup_waits_for_another_process_holding_the_job_even_paused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, paused: bool) -> None:
    staged = _abandoned_save(tmp_path)
    saves = PartSaves(Storage(str(tmp_path)), _no_worker())
    [found] = saves.abandoned("job", older_than_s=30.0)
    with _another_process(_hold_until, str(tmp_path)) as holder:
        if paused:  # a leader stopped inside its commit or cleanup, its lock held
            os.kill(holder, signal.SIGSTOP)
        try:
            monkeypatch.setattr(_job_lock, "LOCK_WAIT_S", 0.5)
            started = time.monotonic()
            # The holder lets go only once told, after this returns: a cleanup that waited for it rather than
            # giving up would never return False, however fast or slow the machine is.
            assert not saves.clean(found)  # the lock is held elsewhere: nothing deleted, the next run tries again
            # It waited its whole LOCK_WAIT_S first (a monotonic deadline, never early; a little under 0.5 for
            # the float sums). No upper bound: how long past the deadline it took is the machine's load.
            assert time.monotonic() - started >= 0.45
            assert staged.is_dir() and (tmp_path / "job" / ".ckptd" / "claims" / f"{STEP}.json").is_file()
        finally:
            if paused:
                os.kill(holder, signal.SIGCONT)
    assert saves.clean(found)  # let go: the cleanup goes ahead
    assert not staged.exists() and not (tmp_path / "job" / ".ckptd" / "claims" / f"{STEP}.json").exists()


def test_a_cleanup_whose_sidecar_no_longer_leads_deletes_nothing(tmp_path: Path) -> None:
    staged = _abandoned_save(tmp_path)
    leads = [True]
    saves = PartSaves(Storage(str(tmp_path)), _no_worker(), writes=lambda _job: leads[0])
    [found] = saves.abandoned("job", older_than_s=30.0)
    leads[0] = False  # the lease passed on between the look and the deletion (a pause, a slow storage)
    assert not saves.clean(found)
    assert staged.is_dir()


def test_the_lock_is_reentrant_in_a_thread_and_released_after(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    (tmp_path / "job").mkdir()
    with job_lock(storage, "job") as outer, job_lock(storage, "job") as inner:
        assert outer and inner
    ctx = multiprocessing.get_context("spawn")
    held = ctx.Event()
    other = ctx.Process(target=_take, args=(str(tmp_path), held))
    other.start()
    assert held.wait(60)  # released: another process gets it at once
    other.join(60)
    assert _lock_path(tmp_path).is_file()


def _refused(root: Path) -> list[dict[str, Any]]:
    return [t.as_dict() for t in _job_lock.lock_troubles(str(root)) if t.state == "refused"]


@pytest.mark.parametrize("planted", ["link_out", "link_in", "directory"])
def test_a_link_or_a_directory_at_the_lock_path_is_refused_and_nothing_is_deleted(
        tmp_path: Path, planted: str, caplog: pytest.LogCaptureFixture) -> None:
    """Fencing is never silently off: a symbolic link at ``<job>/.ckptd/lock`` (out of the root, or to another
    job's lock inside it) or a directory there is refused with an error naming it, the job's lock is not held
    (so the cleanup deletes nothing), and the refusal is reported (``lock_troubles``: /readyz, /metrics)."""
    root = tmp_path / "root"
    root.mkdir()
    staged = _abandoned_save(root)
    saves = PartSaves(Storage(str(root)), _no_worker())
    [found] = saves.abandoned("job", older_than_s=30.0)
    lock = _lock_path(root)
    if planted == "link_out":
        (tmp_path / "elsewhere").write_text("")
        lock.symlink_to(tmp_path / "elsewhere")
    elif planted == "link_in":
        _lock_path(root, "other").parent.mkdir(parents=True)
        _lock_path(root, "other").write_text("")
        lock.symlink_to(_lock_path(root, "other"))
    else:
        lock.mkdir()
    with job_lock(Storage(str(root)), "job", wait_s=0.0) as got:
        assert got is False
    assert not saves.clean(found)
    assert staged.is_dir() and (root / "job" / ".ckptd" / "claims" / f"{STEP}.json").is_file()
    what = "directory" if planted == "directory" else "symbolic link"
    assert any(r.levelname == "ERROR" and str(lock) in r.getMessage() and what in r.getMessage()
               for r in caplog.records)
    [refusal] = _refused(root)
    assert refusal["job"] == "job" and what in refusal["detail"]
    if planted == "directory":
        lock.rmdir()
    else:
        lock.unlink()
    assert saves.clean(found)  # the operator removed it: the next pass takes the lock and goes ahead
    assert not staged.exists() and _refused(root) == []


def test_a_refused_lock_is_on_readyz_and_metrics_until_it_is_taken_again(tmp_path: Path) -> None:
    """An operator sees a job whose commits stopped on its lock without reading the logs: ``/readyz`` names the
    path and why, ``ckptd_job_lock_blocked_seconds{reason="refused"}`` counts; both clear once it is taken."""
    from fastapi.testclient import TestClient

    from tests.support.server import app_over

    root = tmp_path / "root"
    _lock_path(root).mkdir(parents=True)
    app = app_over(root, tmp_path)
    with job_lock(Storage(str(root)), "job", wait_s=0.0) as got:
        assert not got
    with TestClient(app) as client:
        [trouble] = client.get("/readyz").json()["detail"]["job_locks"]
        assert trouble["job"] == "job" and trouble["state"] == "refused" and "a directory" in trouble["detail"]
        assert 'ckptd_job_lock_blocked_seconds{ckpt_job="job",reason="refused"}' in client.get("/metrics").text
        _lock_path(root).rmdir()
        with job_lock(Storage(str(root)), "job", wait_s=0.0) as got:
            assert got
        assert "job_locks" not in client.get("/readyz").json()["detail"]
        assert "ckptd_job_lock_blocked_seconds{" not in client.get("/metrics").text


def test_the_lock_file_is_its_owners_alone(tmp_path: Path) -> None:
    """``flock`` needs no write access: a lock file others may open is one any local user can hold. It is made
    ``0600`` by this sidecar's user, whatever the umask."""
    old = os.umask(0)
    try:
        with job_lock(Storage(str(tmp_path)), "job") as got:
            assert got
    finally:
        os.umask(old)
    info = _lock_path(tmp_path).stat()
    assert info.st_mode & 0o777 == 0o600 and info.st_uid == os.geteuid()


def _read_and_hold(path: str, held: Any, release: Any) -> None:
    """A local user who may only read the root: opens the lock read-only and holds its flock."""
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    held.set()
    release.wait(60)


def test_a_reader_holding_the_old_world_readable_lock_stops_no_writer(tmp_path: Path) -> None:
    """The lock used to be ``<job>/.ckptd/lock``, created ``0644``; a reader who opened it (then or before an
    upgrade) and holds its flock blocked every commit. That file is no writer's lock any more: the cleanup goes
    ahead while the reader still holds it, and two writers still exclude each other."""
    staged = _abandoned_save(tmp_path)
    legacy = tmp_path / "job" / ".ckptd" / "lock"
    legacy.write_text("")
    legacy.chmod(0o644)
    saves = PartSaves(Storage(str(tmp_path)), _no_worker())
    [found] = saves.abandoned("job", older_than_s=30.0)
    with _another_process(_read_and_hold, str(legacy)):
        with job_lock(Storage(str(tmp_path)), "job", wait_s=0.0) as got:
            assert got
            assert _tries_in_another_process(tmp_path) == 0  # a second writer does not get the job meanwhile
        assert saves.clean(found)
        assert not staged.exists()


def _try(root: str, got: Any) -> None:
    with job_lock(Storage(root), "job", wait_s=0.0) as held:
        got.value = 1 if held else 0


def _tries_in_another_process(root: Path) -> int:
    """1 when another process takes the job's lock at once, 0 when it finds it held."""
    ctx = multiprocessing.get_context("spawn")
    got = ctx.Value("i", -1)
    other = ctx.Process(target=_try, args=(str(root), got))
    other.start()
    other.join(60)
    return int(got.value)


@contextmanager
def _another_process(target: Callable[..., None], *args: object) -> Iterator[int]:
    """``target(*args, held, release)`` running in another process, inside (its pid) once it set ``held``; told to
    return (``release``) on the way out."""
    ctx = multiprocessing.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    other = ctx.Process(target=target, args=(*args, held, release))
    other.start()
    try:
        assert held.wait(60)
        yield other.pid or 0
    finally:
        release.set()
        other.join(60)
    assert other.exitcode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another local user")
def test_another_local_user_cannot_open_the_lock(tmp_path: Path) -> None:
    """A real other user (``nobody``) who may read the whole root cannot open the job's lock, so cannot hold it;
    with the old ``0644`` lock they could (and every multi-host commit of the job stopped)."""
    import subprocess
    import sys
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="ckptd-lock-", dir="/tmp"))
    try:
        root.chmod(0o755)  # readable by all, writable by its owner only: a shared root
        with job_lock(Storage(str(root)), "job") as got:
            assert got
        for d in (root / "job", root / "job" / ".ckptd"):
            d.chmod(0o755)
        probe = ("import fcntl, os, sys\n"
                 "try:\n    fd = os.open(sys.argv[1], os.O_RDONLY)\nexcept PermissionError:\n    print('refused')\n"
                 "else:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n    print('held')\n")
        for python in (os.path.realpath(sys.executable), "/usr/bin/python3"):  # one that user may run
            try:
                out = subprocess.run([python, "-c", probe, str(_lock_path(root))], user=65534, group=65534,
                                     capture_output=True, text=True, timeout=60, check=True)
            except (PermissionError, FileNotFoundError):
                continue
            assert out.stdout.strip() == "refused"
            break
        else:
            pytest.skip("no Python interpreter that user 65534 may run")
    finally:
        import shutil

        shutil.rmtree(root)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_lock_file_of_another_user_is_refused_loudly(tmp_path: Path) -> None:
    """No writer of the root made a lock file another user owns (all of them run as one user): it is refused
    like a link, never trusted, never taken over silently."""
    lock = _lock_path(tmp_path)
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    lock.chmod(0o600)
    os.chown(lock, 65534, 65534)
    with job_lock(Storage(str(tmp_path)), "job", wait_s=0.0) as got:
        assert not got
    [refusal] = _refused(tmp_path)
    assert "owned by uid 65534" in refusal["detail"]


def test_a_lock_held_past_the_bound_is_reported_not_waited_on_silently(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Another process (a paused leader, a stuck one) holds the job's lock: after ``LOCK_REPORT_S`` of failed
    tries a warning names the path, ``lock_troubles`` (``/readyz``, ``/metrics``) says ``held``; once the holder
    lets go the next try takes it and the report clears. The bound is set to 0 here: no clock is waited on."""
    monkeypatch.setattr(_job_lock, "LOCK_REPORT_S", 0.0)
    with _another_process(_hold_until, str(tmp_path)):
        with job_lock(Storage(str(tmp_path)), "job", wait_s=0.0) as got:
            assert not got
        [trouble] = [t.as_dict() for t in _job_lock.lock_troubles(str(tmp_path))]
        assert trouble["state"] == "held" and trouble["job"] == "job"
        assert any(r.levelname == "WARNING" and str(_lock_path(tmp_path)) in r.getMessage() for r in caplog.records)
    with job_lock(Storage(str(tmp_path)), "job", wait_s=0.0) as got:
        assert got
    assert _job_lock.lock_troubles(str(tmp_path)) == []
