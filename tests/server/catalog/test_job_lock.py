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
from pathlib import Path
from typing import Any

import pytest

from ckptd.catalog import _job_lock
from ckptd.catalog._job_lock import job_lock
from ckptd.catalog._part_commit import PartSaves
from ckptd.catalog._worker_client import InProcessWorker
from tests.support.forged_records import forge_claim, forge_part
from trainer_client.core._storage import Storage

STEP = 5


def _no_worker() -> InProcessWorker:
    return InProcessWorker(lambda _request: {"ok": False, "error": "nothing is written here"})


def _hold(root: str, hold_s: float, held: Any) -> None:
    with job_lock(Storage(root), "job") as got:
        if got:
            held.set()
        time.sleep(hold_s)


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
    ctx = multiprocessing.get_context("spawn")
    held = ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), 4.0, held))
    holder.start()
    try:
        assert held.wait(60)
        if paused:  # a leader stopped inside its commit or cleanup, its lock held
            os.kill(holder.pid or 0, signal.SIGSTOP)
        monkeypatch.setattr(_job_lock, "LOCK_WAIT_S", 0.5)
        started = time.monotonic()
        assert not saves.clean(found)  # the lock is held elsewhere: nothing deleted, the next run tries again
        assert 0.4 < time.monotonic() - started < 3.0
        assert staged.is_dir() and (tmp_path / "job" / ".ckptd" / "claims" / f"{STEP}.json").is_file()
        if paused:
            os.kill(holder.pid or 0, signal.SIGCONT)
    finally:
        holder.join(60)
    assert holder.exitcode == 0
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
    other = ctx.Process(target=_hold, args=(str(tmp_path), 0.0, held))
    other.start()
    assert held.wait(60)  # released: another process gets it at once
    other.join(60)
    assert (tmp_path / "job" / ".ckptd" / "lock").is_file()


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
    lock = root / "job" / ".ckptd" / "lock"
    if planted == "link_out":
        (tmp_path / "elsewhere").write_text("")
        lock.symlink_to(tmp_path / "elsewhere")
    elif planted == "link_in":
        (root / "other" / ".ckptd").mkdir(parents=True)
        (root / "other" / ".ckptd" / "lock").write_text("")
        lock.symlink_to(root / "other" / ".ckptd" / "lock")
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
    (root / "job" / ".ckptd" / "lock").mkdir(parents=True)
    app = app_over(root, tmp_path)
    with job_lock(Storage(str(root)), "job", wait_s=0.0) as got:
        assert not got
    with TestClient(app) as client:
        [trouble] = client.get("/readyz").json()["detail"]["job_locks"]
        assert trouble["job"] == "job" and trouble["state"] == "refused" and "a directory" in trouble["detail"]
        assert 'ckptd_job_lock_blocked_seconds{ckpt_job="job",reason="refused"}' in client.get("/metrics").text
        (root / "job" / ".ckptd" / "lock").rmdir()
        with job_lock(Storage(str(root)), "job", wait_s=0.0) as got:
            assert got
        assert "job_locks" not in client.get("/readyz").json()["detail"]
        assert "ckptd_job_lock_blocked_seconds{" not in client.get("/metrics").text
