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
