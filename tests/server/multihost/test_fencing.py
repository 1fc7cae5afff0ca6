"""Writers fenced at storage (docs/multihost.md, section 5, "Fenced writers"), in one process with the interleaving
forced, on the GCS emulator: a leader whose cleanup passed its checks and is about to delete
an abandoned save, while a newer leader commits that save (its last part landed late), never deletes what was
committed (the newer leader's commit stands down, or the cleanup does); a restarted incarnation takes a dead one's
incomplete claim over at once on ``gs://`` too, deleting what the dead save left in place and nothing of the new
one's; retention deletes nothing once its sidecar no longer leads, nor while another process holds the job's
lock (a local root). The same with two OS processes and SIGSTOP:
``tests/system/test_fenced_leaders.py``."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptd.catalog import _job_lock
from ckptd.catalog._job_lock import job_lock
from ckptd.catalog._retention import Decision, collect
from ckptd.multihost._abandoned_parts import clean_abandoned_parts
from ckptd.multihost._part_commit import PartSaves
from ckptd.persist._worker_client import PersistWorkerError
from tests.server.multihost.test_forged_parts import Recorder
from tests.support.fenced_saves import JOB, STEP, committed_whole, data_file, finalizing_worker, land_part, lay_save
from tests.support.gcs_emulator import GcsEmulator
from tests.support.orbax_steps import training_metadata
from trainer_client.core._storage import Storage
from trainer_client.core.format._fates import read_fate
from trainer_client.core.format._parts import read_claim, step_path_for
from trainer_client.core.format._snapshot import SnapshotMeta
from trainer_client.core.protocol import StepState, TrainingMetadata

DEAD, LIVE = f"aa-{STEP}", f"bb-{STEP}"


@pytest.fixture
def storage(gcs_emulator: GcsEmulator) -> Storage:
    """A fresh root on the emulator. On a local root the job's flock excludes the two leaders, which one thread
    cannot show (the lock is re-entrant within it): ``tests/system/test_fenced_leaders.py`` does, with processes."""
    return Storage(gcs_emulator.gs(f"fencing-{uuid.uuid4().hex[:8]}"))


def _interpose(monkeypatch: pytest.MonkeyPatch, saves: PartSaves, name: str, act: Callable[[], Any]) -> list[Any]:
    """Run ``act`` once, just before ``saves``' storage first calls ``name`` (a pause of this leader there)."""
    done: list[Any] = []
    real = getattr(saves.storage, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(act())
        return real(*args, **kwargs)

    monkeypatch.setattr(saves.storage, name, wrapped)
    return done


@pytest.mark.parametrize("pause_at", ["remove", "create_new"])
def test_a_cleanup_past_its_checks_never_deletes_what_a_newer_leader_committed(
        storage: Storage, monkeypatch: pytest.MonkeyPatch, pause_at: str) -> None:
    """The old leader found save DEAD abandoned (part 1 missing) and passed its checks under the job's lock; it
    pauses before its first write (``create_new``: on ``gs://`` the fate record) or its first deletion. Meanwhile
    part 1 lands and the newer leader commits. Whatever the order, the step is committed whole or not at all."""
    lay_save(storage, DEAD, (0,))
    old = PartSaves(Storage(storage.url), Recorder(), sidecar="old-leader")
    new = PartSaves(Storage(storage.url), finalizing_worker(), sidecar="new-leader")
    [found] = old.abandoned(JOB, older_than_s=30.0)

    def newer_leader_commits() -> list[int]:
        land_part(new.storage, DEAD, 1)
        return new.commit_ready(JOB)

    committed = _interpose(monkeypatch, old, pause_at, newer_leader_commits)
    cleaned = old.clean(found)
    assert committed, "the newer leader never ran"
    if committed[0] == [STEP]:  # it committed first: the old leader stood down
        assert not cleaned and committed_whole(storage, DEAD)
    else:  # the old leader's decision stood: nothing was committed, the save is gone
        assert cleaned and not storage.exists(storage.join(JOB, str(STEP), "commit_success.txt"))
    assert read_fate(storage, JOB, STEP, DEAD) == ("commit" if committed[0] == [STEP] else "retire")


def test_a_commit_never_seals_a_save_a_cleanup_retired(storage: Storage) -> None:
    lay_save(storage, DEAD, (0,))
    old = PartSaves(storage, Recorder(), sidecar="old-leader")
    [found] = old.abandoned(JOB, older_than_s=30.0)
    assert old._decide(JOB, STEP, DEAD, "retire")  # the cleanup decided, then paused before deleting
    land_part(storage, DEAD, 1)
    new = PartSaves(Storage(storage.url), finalizing_worker(), sidecar="new-leader")
    assert new.commit_ready(JOB) == []  # the pass skips a retired save
    assert not new.commit(JOB, STEP, step_path_for(storage, JOB, STEP, DEAD))  # and a commit past it stands down
    assert not storage.exists(storage.join(JOB, str(STEP), "commit_success.txt"))
    assert old.clean(found)  # it goes on (a cleanup redone by the next leader would too)
    assert not storage.exists(data_file(storage, DEAD, 0))


def _meta(save_id: str, created_at: float) -> SnapshotMeta:
    training = TrainingMetadata.model_validate(training_metadata(STEP)["ckptd"])
    return SnapshotMeta(step=STEP, created_at=created_at, persist=True, nbytes=0, leaf_names=[], tree=[], arrays={},
                        training=training, process_index=1, process_count=2, save_id=save_id)


def test_a_dead_incarnations_claim_on_gcs_is_taken_over_at_once(storage: Storage) -> None:
    """No wait for ``save_timeout_s``: the dead save's in-place files are deleted, the claim names the new save,
    the dead save can never be committed, and the new save's parts then commit as one step."""
    lay_save(storage, DEAD, (0,), age_s=20.0)
    saves, worker = PartSaves(storage, Recorder()), Recorder()
    saves.worker = worker
    meta = _meta(LIVE, time.time() - 1.0)
    assert saves.state(JOB, meta) == "todo"  # not "claimed by another save"
    with pytest.raises(PersistWorkerError):  # the recorder writes nothing; the claim is taken before
        saves.persist_part(JOB, "/shm/job/7", meta)
    claim = read_claim(storage, JOB, STEP)
    assert claim is not None and claim.save_id == LIVE
    assert worker.asked and worker.asked[0]["step_url"] == storage.url_of(storage.join(JOB, str(STEP)))
    assert not storage.exists(data_file(storage, DEAD, 0))  # nothing of the dead save mixes with the new one
    assert read_fate(storage, JOB, STEP, DEAD) == "retire"
    for k in (0, 1):
        land_part(storage, LIVE, k)
    assert PartSaves(storage, finalizing_worker()).commit_ready(JOB) == [STEP]
    assert committed_whole(storage, LIVE)
    assert clean_abandoned_parts(storage, JOB, older_than_s=0.0) == []


def test_retention_deletes_nothing_once_its_sidecar_no_longer_leads(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    step = tmp_path / JOB / "3"
    step.mkdir(parents=True)
    decision = Decision(3, str(step), StepState.VERIFIED, "delete", ["not kept"])
    assert collect(storage, [decision], job=JOB, writes=lambda _job: False) == []
    assert step.is_dir()
    assert collect(storage, [decision], job=JOB, writes=lambda _job: True) == [decision]
    assert not step.exists()



def _hold(root: str, held: Any, release: Any) -> None:
    with job_lock(Storage(root), JOB) as got:
        if got:
            held.set()
        release.wait(60)


def test_retention_waits_for_another_process_holding_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local root: a commit in another process holds the job's flock; retention deletes nothing meanwhile."""
    storage = Storage(str(tmp_path))
    step = tmp_path / JOB / "3"
    step.mkdir(parents=True)
    decision = Decision(3, str(step), StepState.VERIFIED, "delete", ["not kept"])
    ctx = multiprocessing.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), held, release))
    holder.start()
    try:
        assert held.wait(60)
        monkeypatch.setattr(_job_lock, "LOCK_WAIT_S", 0.3)
        assert collect(storage, [decision], job=JOB, writes=lambda _job: True) == []
        assert step.is_dir()
    finally:
        release.set()
        holder.join(60)
    assert collect(storage, [decision], job=JOB, writes=lambda _job: True) == [decision]
    assert not step.exists()
