"""A leader SIGSTOPped mid-cleanup while a follower takes the lease over and commits, then SIGCONTed: nothing
committed is lost (docs/multihost.md, section 5, "Fenced writers"). Two OS processes, each with its own lease
(``ckptd/lease/_lease.py``, a real lease on the root) and its own ``PartSaves``, on a local root and on the GCS
emulator:

* the old leader finds save ``aa-7`` abandoned (host 1's part missing past the save timeout), passes its checks
  and stops itself (SIGSTOP) at its first deletion;
* host 1's part lands late, so the save is whole; the follower's lease expires the old leader's and it commits;
* the old leader is let go (SIGCONT) and runs on.

Then step 7 is either committed with every file of both parts, or was never committed. On a local root the
job's flock, held by the stopped leader, keeps the follower from committing until it is let go; on ``gs://`` no
lock spans the two, and the save's fate record decides (``trainer_client/core/format/_fates.py``).

The same with the old leader stopped mid-commit (finalized, its manifest in hand): the follower leaves the commit
to it while it may still write (the flock; on ``gs://`` the fate it decided, until older than the redo delay),
then redoes it; the step's manifest describes the files there.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ckptd.catalog import _job_lock
from ckptd.lease._lease import Lease, lease_directory
from ckptd.multihost import _part_commit
from ckptd.multihost._abandoned_parts import clean_abandoned_parts
from ckptd.multihost._part_commit import PartSaves
from tests.server.multihost.test_fencing_gcs_gaps import _manifest_holds as manifest_holds
from tests.server.multihost.test_fencing_gcs_gaps import _merging_worker as merging_worker
from tests.support.fenced_saves import JOB, STEP, committed_whole, finalizing_worker, land_part, lay_save
from tests.support.gcs_emulator import GcsEmulator
from trainer_client.core._storage import Storage
from trainer_client.core.format import _fates
from trainer_client.core.format._fates import read_fate_record
from trainer_client.core.format._files import COMMIT_MARKER
from trainer_client.core.format._parts import read_claim

TTL_S = 1.0
SAVE = f"aa-{STEP}"


def _keep_ticking(lease: Lease, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            lease.tick()
            stop.wait(lease.ttl_s / 4)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _lead(storage: Storage, holder: str, timeout_s: float = 30.0) -> Lease:
    lease = Lease(storage, lease_directory(storage, JOB), holder, TTL_S)
    deadline = time.monotonic() + timeout_s
    while not lease.leads():
        assert time.monotonic() < deadline, f"{holder} never led"
        lease.tick()
        time.sleep(TTL_S / 8)
    return lease


def _old_leader(url: str, pause_at: str, stopped_at: str, done: Any) -> None:
    """Lead, then clean the abandoned save; SIGSTOP this process at its first ``pause_at`` (``remove``: a deletion,
    ``create_new``: a create-only write) of the job's files, the lease's aside."""
    storage = Storage(url)
    lease = _lead(storage, "old-leader")
    _keep_ticking(lease, threading.Event())
    real = getattr(Storage, pause_at)

    def pausing(self: Storage, path: Any, *args: Any, **kwargs: Any) -> Any:
        if "/.ckptd/leader" not in str(path) and not os.path.exists(stopped_at):
            Path(stopped_at).write_text(str(path))
            os.kill(os.getpid(), signal.SIGSTOP)  # paused past its checks (the job's lock held)
        return real(self, path, *args, **kwargs)

    setattr(Storage, pause_at, pausing)
    cleaned = clean_abandoned_parts(storage, JOB, older_than_s=30.0, writes=lambda _job: lease.leads())
    done.put([d.path for d in cleaned])


_SPAWN = multiprocessing.get_context("spawn")


def _stopped_old_leader(target: Callable[..., None], args: tuple[Any, ...], stopped_at: str,
                        where: str) -> BaseProcess:
    """The old leader, ``target(*args)`` in a process of its own, once it stopped itself at ``where``."""
    old = _SPAWN.Process(target=target, args=args)
    old.start()
    deadline = time.monotonic() + 60
    while not os.path.exists(stopped_at):
        if not old.is_alive() or time.monotonic() >= deadline:
            old.kill()
            raise AssertionError(f"the old leader never reached {where}")
        time.sleep(0.05)
    return old


@pytest.fixture
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "root")
    gcs: GcsEmulator = request.getfixturevalue("gcs_emulator")
    return gcs.gs(f"fenced-{uuid.uuid4().hex[:8]}")


# a local cleanup creates nothing (the flock alone fences it): its one stop is its first deletion
@pytest.mark.parametrize(("root", "pause_at"), [("local", "remove"), ("gcs", "remove"), ("gcs", "create_new")],
                         indirect=["root"])
def test_a_leader_stopped_mid_cleanup_loses_nothing_a_newer_leader_committed(
        root: str, pause_at: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``remove``: stopped at its first deletion; ``create_new``: at its first write, which on ``gs://`` is the
    save's fate record (locally the cleanup writes nothing: the flock alone fences it)."""
    storage = Storage(root)
    lay_save(storage, SAVE, (0,))
    monkeypatch.setattr(_job_lock, "LOCK_WAIT_S", 1.0)  # the follower's commit gives up sooner on a held flock
    stopped_at = str(tmp_path / "stopped")
    done = _SPAWN.Queue()
    old = _stopped_old_leader(_old_leader, (root, pause_at, stopped_at, done), stopped_at, "its deletion")
    stop = threading.Event()
    try:
        print(f"[fenced] old leader stopped before deleting {Path(stopped_at).read_text()}")
        land_part(storage, SAVE, 1)  # host 1's part, late: the save is whole now
        lease = _lead(storage, "new-leader")  # the old leader's beat stopped: the follower takes over
        _keep_ticking(lease, stop)
        saves = PartSaves(storage, finalizing_worker(), writes=lambda _job: lease.leads(), sidecar="new-leader")
        committed = saves.commit_ready(JOB)
        print(f"[fenced] the new leader committed {committed} while the old one was stopped")
        if committed:
            assert committed_whole(storage, SAVE)
        os.kill(old.pid or 0, signal.SIGCONT)
        cleaned = done.get(timeout=60)
        old.join(60)
        assert old.exitcode == 0
        print(f"[fenced] the old leader, let go, deleted {cleaned}")
        committed += saves.commit_ready(JOB)  # the next pass of the new leader
    finally:
        stop.set()
        if old.is_alive():
            os.kill(old.pid or 0, signal.SIGCONT)
            old.kill()
    storage.invalidate()
    marker = storage.exists(storage.join(JOB, str(STEP), COMMIT_MARKER))
    if committed:  # nothing committed is lost
        assert marker and committed_whole(storage, SAVE)
    else:  # never committed: the old leader's decision stood, the save and its claim are gone
        assert not marker and cleaned and read_claim(storage, JOB, STEP) is None
    # who won: the fate record on gs:// (the first to decide), the flock held by the stopped leader locally
    assert bool(committed) == (pause_at == "create_new"), (committed, cleaned)


REDO_S = 6.0  # the newer leader's ``redo_after_s`` here: a commit another decided is left to it this long


def _old_committer(url: str, stopped_at: str, done: Any) -> None:
    """Lead, then commit the whole save; SIGSTOP this process as it is about to write the step's manifest (its
    finalize done, past every check)."""
    storage = Storage(url)
    lease = _lead(storage, "old-leader")
    _keep_ticking(lease, threading.Event())
    real = _part_commit.write_manifest

    def pausing(*args: Any, **kwargs: Any) -> None:
        if not os.path.exists(stopped_at):
            Path(stopped_at).write_text("ckptd_manifest.json")
            os.kill(os.getpid(), signal.SIGSTOP)
        real(*args, **kwargs)

    _part_commit.write_manifest = pausing  # type: ignore[assignment]
    saves = PartSaves(storage, merging_worker(), writes=lambda _job: lease.leads(), sidecar="old-leader")
    done.put(saves.commit_ready(JOB))


@pytest.mark.parametrize("root", ["local", "gcs"], indirect=True)
def test_a_leader_stopped_mid_commit_leaves_a_step_whose_manifest_holds(
        root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old leader finalized the whole save and stopped with its manifest in hand; the follower takes the lease
    over. Its commit would merge again (other bytes): it stands down while the old one may still write (locally
    the stopped leader's flock, on ``gs://`` the fate record the old leader decided, younger than ``REDO_S``). Let
    go, the old leader writes its manifest and finds it no longer leads; the follower commits after ``REDO_S``. The
    step is committed once, and its manifest describes the files there (else: quarantined at its next check)."""
    storage = Storage(root)
    lay_save(storage, SAVE, (0, 1))
    monkeypatch.setattr(_job_lock, "LOCK_WAIT_S", 1.0)
    stopped_at = str(tmp_path / "stopped")
    done = _SPAWN.Queue()
    old = _stopped_old_leader(_old_committer, (root, stopped_at, done), stopped_at, "its manifest")
    # On gs://, this process's fates clock is the test's: the old leader's decision is as old as the test says,
    # young at the first commit, REDO_S old at the redo, however long taking the lease over took (with the real
    # clock a slow machine could pass REDO_S first: "too slow to show the wait").
    decided = read_fate_record(storage, JOB, STEP, SAVE) if storage.is_remote else None
    assert not isinstance(decided, str) and (decided is not None or not storage.is_remote), decided
    now = [time.time() if decided is None else decided.at]
    monkeypatch.setattr(_fates, "time", SimpleNamespace(time=lambda: now[0]))
    stop = threading.Event()
    try:
        lease = _lead(storage, "new-leader")
        _keep_ticking(lease, stop)
        saves = PartSaves(storage, merging_worker(), writes=lambda _job: lease.leads(), sidecar="new-leader",
                          redo_after_s=REDO_S)
        meanwhile = saves.commit_ready(JOB)  # the old leader may still write: left to it
        os.kill(old.pid or 0, signal.SIGCONT)
        print(f"[fenced] the old leader, let go, reported {done.get(timeout=60)}")
        old.join(60)
        assert old.exitcode == 0
        now[0] += REDO_S + 0.5
        redone = saves.commit_ready(JOB)  # the redo, once the old leader's decision is old enough
    finally:
        stop.set()
        if old.is_alive():
            os.kill(old.pid or 0, signal.SIGCONT)
            old.kill()
    assert committed_whole(storage, SAVE)
    assert manifest_holds(storage, storage.join(JOB, str(STEP)))
    assert (meanwhile, redone) == ([], [STEP])
