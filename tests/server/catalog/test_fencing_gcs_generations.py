"""Retention's deletions on ``gs://`` act only on what they were decided on (docs/gcs.md, "Fencing on gs://"), on
the GCS emulator, the interleaving forced in one process:

* a newer lease epoch written between the decision and the deletion (a follower that took over early) stops it,
  though the old leader's own clock still says it leads;
* a good step saved again in place between the listing and the deletion is kept whole, and the refusal is a
  ``retention_refused`` event of the job;
* an abandoned step a restarted save began writing again in place is kept;
* a cleanup of an abandoned multi-host save whose decider paused past the save timeout (so the next leader redid
  it, and the step number passed to a new save, committed since) deletes nothing of the new save;
* a dead incarnation's part record landing in place after the takeover (its sidecar checked the claim just before)
  is cleared by the new save's host, as listed, so the new save is committed, not kept out for good;
* every DELETE names the generation listed, the commit marker first: what real GCS enforces and the emulator does
  not (fake-gcs-server ignores ``ifGenerationMatch`` on a DELETE: measured here too), seen on the wire through a
  recording proxy.

Each test failed on the code before: retention deleted the step with one recursive delete and a lease check in
memory only."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from bench.gcs_requests import logging_proxy
from ckptd.catalog._catalog import Catalog
from ckptd.catalog._retention import Decision, RetentionPolicy, collect, decide, record_retention
from ckptd.events._events import EventStore
from ckptd.lease._lease import Lease, LeaseBoard
from ckptd.multihost import _in_place
from ckptd.multihost._part_commit import PartSaves
from tests.server.multihost.test_fencing import _meta
from tests.server.multihost.test_fencing_gcs_gaps import _writing
from tests.server.multihost.test_forged_parts import Recorder
from tests.support.fenced_saves import (
    STEP,
    committed_whole,
    data_file,
    finalizing_worker,
    land_part,
    lay_save,
    part_record,
)
from tests.support.gcs_emulator import GcsEmulator
from trainer_client.core._generations import listed_generations
from trainer_client.core._storage import Storage, join_path
from trainer_client.core.format._files import COMMIT_MARKER
from trainer_client.core.format._parts import read_claim, read_part, take_over_claim
from trainer_client.core.format._steps import inspect_step
from trainer_client.core.protocol import CheckpointInfo, StepState

JOB = "job"
DATA = "default/ocdbt.process_0/d/abc"


@pytest.fixture
def storage(gcs_emulator: GcsEmulator) -> Storage:
    return Storage(gcs_emulator.gs(f"generations-{uuid.uuid4().hex[:8]}"))


def _good_step(storage: Storage, step: int, data: bytes = b"saved once") -> CheckpointInfo:
    step_dir = storage.join(JOB, str(step))
    storage.fs.pipe_file(join_path(step_dir, DATA), data)
    assert storage.create_new(join_path(step_dir, COMMIT_MARKER), b"committed")
    return CheckpointInfo(step=step, state=StepState.VERIFIED, path=storage.url_of(step_dir), committed_at=time.time())


def _deletions(infos: list[CheckpointInfo], policy: RetentionPolicy) -> list[Decision]:
    return [d for d in decide(infos, policy) if d.action == "delete"]


def _objects(storage: Storage, step: int) -> dict[str, bytes]:
    storage.invalidate()
    step_dir = storage.join(JOB, str(step))
    return {name[len(step_dir) + 1:]: storage.fs.cat_file(name) for name in listed_generations(storage, step_dir)}


def test_a_newer_epoch_on_storage_stops_a_deletion_its_leader_still_thinks_it_may_make(
        storage: Storage, tmp_path: Path) -> None:
    """Sidecar A leads epoch 0 (``ttl_s`` 300); a follower configured with a shorter ``ttl_s`` (1 s, its own clock
    advanced) takes epoch 1 after A's retention decided to delete step 3. A's lease, asked in memory, still says it
    leads; asked of storage (``Catalog.writes_confirmed``, what ``prune`` hands ``collect``) it does not: step 3
    stays."""
    catalog = Catalog(storage, tmp_path / "a.sqlite3")
    catalog.lease = LeaseBoard(storage, 300.0, jobs=lambda: [JOB], holder="a")
    catalog.lease.tick()
    assert catalog.writes(JOB)
    stale = _deletions([_good_step(storage, 3), _good_step(storage, 5)], RetentionPolicy(keep_last=1))
    assert [d.step for d in stale] == [3]

    now = [0.0]
    follower = Lease(storage, catalog.lease.directory(JOB), "b", ttl_s=1.0, clock=lambda: now[0])
    follower.tick()  # sees epoch 0 and its beat
    now[0] += 2.0
    follower.tick()  # unchanged for its ttl_s: takes epoch 1
    assert follower.leads() and follower.epoch == 1

    assert catalog.writes(JOB), "A's own clock still says it leads: only storage knows better"
    assert collect(storage, stale, job=JOB, writes=catalog.writes_confirmed) == []
    assert COMMIT_MARKER in _objects(storage, 3)


def _resave_in_place(gcs_emulator: GcsEmulator, storage: Storage, step: int) -> None:
    """A trainer (another process: its own gcsfs client) saves ``step`` again in place, as Orbax's commit-file
    path does: every object rewritten, the marker last."""
    other = gcs_emulator.other_writer()
    step_dir = storage.join(JOB, str(step))
    other.pipe(join_path(step_dir, DATA), b"saved again")
    other.pipe(join_path(step_dir, COMMIT_MARKER), b"committed again")


def _paused_before_acting(act: Callable[[], Any]) -> tuple[Callable[[str], bool], list[Any]]:
    """A lease check for ``collect`` that runs ``act`` once, under the job's lock, after retention listed the step
    and before it deletes anything (a leader paused there), then says it leads; and what ``act`` returned."""
    done: list[Any] = []

    def writes(_job: str) -> bool:
        if not done:
            done.append(act())
        return True
    return writes, done


def test_a_good_step_saved_again_while_retention_paused_is_kept_and_the_refusal_recorded(
        storage: Storage, gcs_emulator: GcsEmulator) -> None:
    """Retention decided to delete step 3 (keep the last 1 of 3 and 5) and listed it; paused there, a trainer saved
    step 3 again in place. The step is kept as the trainer left it; the refusal is logged and recorded."""
    stale = _deletions([_good_step(storage, 3), _good_step(storage, 5)], RetentionPolicy(keep_last=1))
    writes, done = _paused_before_acting(lambda: _resave_in_place(gcs_emulator, storage, 3))
    refused: list[Decision] = []
    assert collect(storage, stale, job=JOB, writes=writes, refused=refused) == []
    assert done == [None]
    assert _objects(storage, 3) == {DATA: b"saved again", COMMIT_MARKER: b"committed again"}
    [refusal] = refused
    assert refusal.step == 3 and "changed since it was listed" in refusal.reasons[-1]

    events = EventStore(storage)
    assert record_retention(events, [], refused) == 1
    [event] = [e for e in events.load(JOB) if e.kind == "retention_refused"]
    assert event.step == 3 and "kept by retention" in event.detail


def test_an_abandoned_step_a_restarted_save_writes_again_in_place_is_kept(
        storage: Storage, gcs_emulator: GcsEmulator) -> None:
    """The catalog judged ``<job>/9`` abandoned (a dead save's stray object, past the save timeout); before
    retention lists it, the restarted trainer's Orbax cleared the prefix and began saving step 9 there again.
    Those objects are younger than the save timeout: the step is a save in progress, not deleted."""
    step_dir = storage.join(JOB, "9")
    storage.fs.pipe_file(join_path(step_dir, "stray"), b"left by a dead save")
    storage.invalidate()
    [entry] = [e for e in storage.list_dir(storage.join(JOB)) if e.name == "9"]
    found = inspect_step(storage, entry, save_timeout_s=0.0, now=time.time() + 1.0)
    assert found is not None
    [decision] = _deletions([found.to_info(storage)], RetentionPolicy())
    assert decision.state is StepState.ABANDONED

    other = gcs_emulator.other_writer()
    other.rm(join_path(step_dir, "stray"))
    other.pipe(join_path(step_dir, "_CHECKPOINT_METADATA"), b'{"init_timestamp_nsecs": 1}')
    other.pipe(join_path(step_dir, DATA), b"the restarted save")
    refused: list[Decision] = []
    assert collect(storage, [decision], job=JOB, writes=lambda _job: True, save_timeout_s=3600.0,
                   refused=refused) == []
    assert _objects(storage, 9) == {"_CHECKPOINT_METADATA": b'{"init_timestamp_nsecs": 1}', DATA: b"the restarted save"}
    assert "written less than 3600s ago" in refused[0].reasons[-1]


def test_every_delete_names_the_listed_generation_and_the_marker_goes_first(
        storage: Storage, gcs_emulator: GcsEmulator) -> None:
    """What only real GCS enforces: the emulator deletes an object whatever ``ifGenerationMatch`` says (shown
    first), so the precondition is checked on the wire, through a recording proxy: one DELETE per listed object,
    each with its listed generation, ``commit_success.txt`` first."""
    import gcsfs

    stray = storage.join(JOB, "stray")
    storage.fs.pipe_file(stray, b"x")
    assert storage.remove(stray, if_generation=1), "fake-gcs-server now honours ifGenerationMatch on DELETE"

    stale = _deletions([_good_step(storage, 3), _good_step(storage, 5)], RetentionPolicy(keep_last=1))
    listed = listed_generations(storage, storage.join(JOB, "3"))
    with logging_proxy(gcs_emulator.url) as proxy:
        fs = gcsfs.GCSFileSystem(token="anon", endpoint_url=proxy.url, skip_instance_cache=True)
        through = Storage(storage.url, fs=fs)
        assert [d.step for d in collect(through, stale, job=JOB, writes=lambda _job: True)] == [3]
    deletes = [urlsplit(line.split(" ", 1)[1]) for line in proxy.requests if line.startswith("DELETE ")]
    sent = [(unquote(u.path.split("/o/", 1)[1]), parse_qs(u.query).get("ifGenerationMatch")) for u in deletes]
    bucket = gcs_emulator.bucket + "/"
    expected = {name.removeprefix(bucket): [str(obj.generation)] for name, obj in listed.items()}
    assert dict(sent) == expected and len(sent) == len(expected) == 2
    assert sent[0][0].endswith(f"/3/{COMMIT_MARKER}")
    assert _objects(storage, 3) == {} and COMMIT_MARKER in _objects(storage, 5)


def test_a_cleanup_redone_while_its_decider_was_paused_never_deletes_the_next_save_of_the_step(
        storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old leader found save DEAD of step 7 abandoned (host 1's part missing), retired it and paused before its
    first deletion, past the save timeout. The newer leader redid the cleanup (DEAD's files, then its claim); the
    restarted incarnation claimed step 7, both parts of its save LIVE landed and the newer leader committed it.
    Let go, the old leader finds what it listed gone: it deletes nothing, and step 7 stays LIVE's, whole."""
    dead, live = f"aa-{STEP}", f"bb-{STEP}"
    lay_save(storage, dead, (0,))
    old = PartSaves(Storage(storage.url), Recorder(), sidecar="old-leader", redo_after_s=0.0)
    [found] = old.abandoned(JOB, older_than_s=30.0)

    def redone_and_saved_again() -> bool:
        new = PartSaves(Storage(storage.url), finalizing_worker(), sidecar="new-leader", redo_after_s=0.0)
        [again] = new.abandoned(JOB, older_than_s=30.0)
        assert new.clean(again)
        lay_save(storage, live, (0, 1), age_s=0.0)
        return new.commit_ready(JOB) == [STEP] and committed_whole(storage, live)

    real = _in_place.delete_as_listed
    done: list[bool | None] = []

    def paused(*args: Any, **kwargs: Any) -> Any:
        if not done:  # the old leader's first deletion (the newer leader's own deletions pass straight through)
            done.append(None)
            done[0] = redone_and_saved_again()
        return real(*args, **kwargs)

    monkeypatch.setattr(_in_place, "delete_as_listed", paused)
    cleaned = old.clean(found)
    assert committed_whole(storage, live), "the old leader deleted the step the new save committed"
    assert not cleaned and done == [True]
    claim = read_claim(storage, JOB, STEP)
    assert claim is not None and claim.save_id == live


def test_a_dead_incarnations_record_landing_after_the_takeover_is_cleared_for_the_new_save(
        storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host 1's sidecar of the dead incarnation wrote its part of DEAD in place and found the claim still DEAD's;
    right then the restarted incarnation took the claim over (DEAD retired, its files deleted) and the late record
    of DEAD landed in ``<job>/7/ckptd_parts/``. The new save's host 1 finds a record of a retired save where its
    own goes: it deletes that one as listed and creates its own, and step 7 is committed from LIVE's parts."""
    dead, live = f"aa-{STEP}", f"bb-{STEP}"
    lay_save(storage, dead, (0,), age_s=20.0)
    late = PartSaves(Storage(storage.url), _writing(json.loads(part_record(dead, 1))), sidecar="host1-dead")
    real_create = late.storage.create_new
    taken: list[bool] = []

    def record_after_the_takeover(path: str, data: bytes) -> bool:
        if path.endswith("ckptd_parts/process_1.json") and not taken:  # past its check, about to create
            claim = read_claim(storage, JOB, STEP)
            taken.append(claim is not None and take_over_claim(Storage(storage.url), JOB, STEP, claim, live, 2))
        return real_create(path, data)

    monkeypatch.setattr(late.storage, "create_new", record_after_the_takeover)
    assert late.persist_part(JOB, "/shm/job/7", _meta(dead, time.time() - 30.0)) == "written"
    step_dir = storage.join(JOB, str(STEP))
    late_record = read_part(storage, step_dir, 1)
    assert taken == [True] and late_record is not None and late_record.save_id == dead

    def host1_data() -> None:  # what its worker writes before the record: the part's data file
        assert storage.create_new(data_file(storage, live, 1), b"part 1 of LIVE")

    host1 = PartSaves(Storage(storage.url), _writing(json.loads(part_record(live, 1)), host1_data),
                      sidecar="host1-live")
    assert host1.persist_part(JOB, "/shm/job/7", _meta(live, time.time())) == "written"
    record = read_part(storage, step_dir, 1)
    assert record is not None and record.save_id == live
    land_part(storage, live, 0)
    assert PartSaves(storage, finalizing_worker()).commit_ready(JOB) == [STEP]
    assert committed_whole(storage, live)
