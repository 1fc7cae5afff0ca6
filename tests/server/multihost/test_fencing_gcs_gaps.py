"""The writes a stale leader or a dead incarnation's sidecar could still make on ``gs://`` past the fate records
(docs/multihost.md, section 5, "Fenced writers", "What a stale writer can still do"), on the GCS emulator, the
interleaving forced in one process as ``test_fencing.py`` does:

* retention's deletion of an uncommitted step directory, decided while a save of that step was incomplete, never
  deletes it once a newer leader committed that save (its last part landed late) or a restarted incarnation's save
  of the same step number;
* a verified step a stale retention deletes is one the newer leader's policy deletes too (harmless);
* a cleanup another leader retired and left half-way is not redone before the save timeout, so the step number is
  not given to a new save while the first cleaner may still delete its files;
* a dead incarnation's part landing after a restarted incarnation took its claim over leaves no part record, and a
  part file it overwrote after the new save's record is never committed;
* a commit another leader decided is left to it until the save timeout, so its late manifest never describes
  files a redo replaced (Orbax's merge writes other bytes each run);
* a fate record is carried out by its decider at once and by another party only once old enough; one that does not
  read whole (forged, damaged) decides nothing."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ckptd.catalog._retention import RetentionPolicy, collect, decide
from ckptd.multihost import _part_commit
from ckptd.multihost._abandoned_parts import clean_abandoned_parts
from ckptd.multihost._part_commit import PartSaves
from ckptd.persist._worker_client import InProcessWorker
from tests.server.multihost.test_fencing import _interpose, _meta
from tests.server.multihost.test_forged_parts import Recorder
from tests.support.fenced_saves import (
    JOB,
    STEP,
    committed_whole,
    data_file,
    finalizing_worker,
    land_part,
    lay_save,
    part_record,
)
from tests.support.gcs_emulator import GcsEmulator
from trainer_client.core._errors import StorageError
from trainer_client.core._storage import Storage, join_path
from trainer_client.core.format import _fates
from trainer_client.core.format._fates import decide_fate, fate_path, read_fate, read_fate_record
from trainer_client.core.format._files import COMMIT_MARKER
from trainer_client.core.format._manifest import crc32c_of, file_entry, read_manifest
from trainer_client.core.format._parts import (
    Claim,
    claim_path,
    make_claim,
    read_claim,
    read_part,
    record_path,
    take_over_claim,
)
from trainer_client.core.format._step_files import list_files
from trainer_client.core.format._steps import inspect_step
from trainer_client.core.protocol import CheckpointInfo, StepState

DEAD, LIVE = f"aa-{STEP}", f"bb-{STEP}"


@pytest.fixture
def storage(gcs_emulator: GcsEmulator) -> Storage:
    return Storage(gcs_emulator.gs(f"gaps-{uuid.uuid4().hex[:8]}"))


def _step_info(storage: Storage, step: int) -> CheckpointInfo:
    """What a leader's catalog says of ``<job>/<step>``, its save timeout passed (the step is uncommitted)."""
    storage.invalidate()
    [entry] = [e for e in storage.list_dir(storage.join(JOB)) if e.name == str(step)]
    found = inspect_step(storage, entry, save_timeout_s=0.0, now=time.time() + 1.0)
    assert found is not None
    return found.to_info(storage)


def _late_part_committed(storage: Storage) -> bool:
    """The newer leader's work: host 1's part of DEAD lands late and the save is committed."""
    land_part(storage, DEAD, 1)
    return PartSaves(storage, finalizing_worker(), sidecar="new-leader").commit_ready(JOB) == [STEP]


def _restarted_save_committed(storage: Storage) -> bool:
    """A restarted incarnation's save LIVE of the same step takes DEAD's claim over, its parts land, it commits."""
    claim = read_claim(storage, JOB, STEP)
    assert claim is not None and take_over_claim(storage, JOB, STEP, claim, LIVE, 2)
    for k in (0, 1):
        land_part(storage, LIVE, k)
    return PartSaves(storage, finalizing_worker(), sidecar="new-leader").commit_ready(JOB) == [STEP]


@pytest.mark.parametrize("meanwhile", [_late_part_committed, _restarted_save_committed])
def test_retention_never_deletes_a_save_in_place_that_a_newer_leader_committed(
        storage: Storage, monkeypatch: pytest.MonkeyPatch, meanwhile: Callable[[Storage], bool]) -> None:
    """The old leader's catalog lists ``<job>/7`` (save DEAD, host 1's part missing, written in place) as an
    abandoned save and retention decides to delete it; it pauses at its deletion, past its lease check. Meanwhile
    the newer leader commits step 7. The committed step stays whole."""
    lay_save(storage, DEAD, (0,))
    [decision] = decide([_step_info(storage, STEP)], RetentionPolicy())
    assert decision.action == "delete" and decision.state is StepState.ABANDONED
    old = Storage(storage.url)
    done = _interpose(monkeypatch, PartSaves(old, Recorder()), "remove", lambda: meanwhile(Storage(storage.url)))
    collect(old, [decision], job=JOB, writes=lambda _job: True)
    if not done:  # the old leader's retention left the save alone: the newer leader commits it all the same
        done.append(meanwhile(Storage(storage.url)))
    assert done == [True]
    assert committed_whole(storage, LIVE if meanwhile is _restarted_save_committed else DEAD)


def _good_step(storage: Storage, step: int) -> CheckpointInfo:
    assert storage.create_new(join_path(storage.join(JOB, str(step)), COMMIT_MARKER), b"committed")
    return CheckpointInfo(step=step, state=StepState.VERIFIED, path=storage.url_of(storage.join(JOB, str(step))),
                          committed_at=time.time())


def test_a_verified_step_a_stale_retention_deletes_is_one_the_newer_leader_deletes_too(
        storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention's rules only let go of more steps as steps are added and time passes: the old leader decided to
    delete step 3 (keep the last 1 of 3 and 5), paused, and the newer leader committed step 7 meanwhile. Its late
    deletion takes step 3 only, which the newer leader's policy deletes too; step 5 and the committed 7 stay."""
    policy = RetentionPolicy(keep_last=1)
    infos = [_good_step(storage, 3), _good_step(storage, 5)]
    stale = [d for d in decide(infos, policy) if d.action == "delete"]
    assert [d.step for d in stale] == [3]
    lay_save(storage, DEAD, (0,))
    old = Storage(storage.url)
    # paused right before its first deletion (every deletion checks its path first: ``Storage.writable``)
    done = _interpose(monkeypatch, PartSaves(old, Recorder()), "writable", lambda: _late_part_committed(storage))
    assert [d.step for d in collect(old, stale, job=JOB, writes=lambda _job: True)] == [3]
    assert done == [True] and committed_whole(storage, DEAD)
    newer = [*infos, CheckpointInfo(step=STEP, state=StepState.VERIFIED, path=storage.url_of(storage.join(JOB, "7")),
                                    committed_at=time.time())]
    assert {d.step for d in decide(newer, policy) if d.action == "delete"} >= {3}
    assert storage.exists(storage.join(JOB, "5", COMMIT_MARKER))


def test_a_cleanup_another_leader_retired_is_not_redone_before_the_save_timeout(
        storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old leader retired the abandoned save DEAD and paused before its deletion. The newer leader leaves the
    save and its claim alone until the fate record is older than the save timeout, so no new save of step 7 is
    written where the old leader's late deletion would land; that deletion then takes DEAD's files only, and the
    restarted save claims step 7 afterwards and is committed whole."""
    lay_save(storage, DEAD, (0,))
    old = PartSaves(Storage(storage.url), Recorder(), sidecar="old-leader")
    [found] = old.abandoned(JOB, older_than_s=30.0)
    new_leader = Storage(storage.url)

    def newer_leader_cleans_and_a_new_save_claims() -> bool:
        assert read_fate(storage, JOB, STEP, DEAD) == "retire"
        cleaned = clean_abandoned_parts(new_leader, JOB, older_than_s=30.0)
        claim = make_claim(new_leader, JOB, STEP, LIVE, 2)
        assert claim is not None
        return not cleaned and claim.save_id == DEAD  # the step is still DEAD's: LIVE waits

    done = _interpose(monkeypatch, old, "remove", newer_leader_cleans_and_a_new_save_claims)
    assert old.clean(found)
    assert done == [True]
    claim = make_claim(new_leader, JOB, STEP, LIVE, 2)
    assert claim is not None and claim.save_id == LIVE
    for k in (0, 1):
        land_part(new_leader, LIVE, k)
    assert PartSaves(new_leader, finalizing_worker()).commit_ready(JOB) == [STEP]
    assert committed_whole(storage, LIVE)


def test_a_cleanup_another_leader_retired_is_redone_after_the_save_timeout(
        storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    """A leader that retired a save and died half-way: the next one finishes the cleanup once the save timeout
    passed since that decision (and its own decisions at once)."""
    now = [time.time()]  # the fates' clock, moved by the test: a slow first cleanup cannot pass the 30 s itself
    monkeypatch.setattr(_fates, "time", SimpleNamespace(time=lambda: now[0]))
    lay_save(storage, DEAD, (0,))
    decided = {"fate": "retire", "by": "old-leader", "at": now[0] - 29.0}
    assert storage.create_new(fate_path(storage, JOB, STEP, DEAD), json.dumps(decided).encode())
    record = read_fate_record(storage, JOB, STEP, DEAD)
    assert not isinstance(record, str) and record is not None and record.by == "old-leader"
    assert clean_abandoned_parts(Storage(storage.url), JOB, older_than_s=30.0) == []
    now[0] += 1.1  # 30.1 s since the decision
    assert [d.step for d in clean_abandoned_parts(Storage(storage.url), JOB, older_than_s=30.0)] == [STEP]
    assert read_claim(storage, JOB, STEP) is None and not storage.exists(storage.join(JOB, str(STEP)))


def _merging_worker() -> InProcessWorker:
    """The persist worker's finalize as it behaves: each run writes a new merged root (``default/manifest.ocdbt``
    and a new ``default/d/`` file) and ``_CHECKPOINT_METADATA`` with its own commit time, so two runs over one
    save differ in those files (measured with Orbax's merge, docs/multihost.md, "Fenced writers")."""
    def answer(request: dict[str, Any]) -> dict[str, Any]:
        if "commit" not in request:
            return {"ok": False}
        step, run = Storage(request["commit"]), uuid.uuid4().hex
        step.fs.makedirs(step.join("default", "d"), exist_ok=True)
        step.fs.pipe_file(step.join("default", "d", run), run.encode())
        step.fs.pipe_file(step.join("default", "manifest.ocdbt"), f"root {run}".encode())
        step.fs.pipe_file(step.join("_CHECKPOINT_METADATA"), json.dumps({"commit": time.time_ns()}).encode())
        return {"ok": True}
    return InProcessWorker(answer)


def _manifest_holds(storage: Storage, step: str) -> bool:
    """Quick validation's check: every file the step's manifest lists is on storage with its size and CRC32C."""
    manifest, listed = read_manifest(storage, step), list_files(storage, step)
    assert manifest is not None
    return all(p in listed and file_entry(storage, join_path(step, p)) == e for p, e in manifest.files.items())


def test_a_commit_another_leader_decided_is_not_redone_before_the_save_timeout(
        storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old leader decided to commit save DEAD, finalized it and paused with its manifest in hand. A newer leader
    redoing the commit meanwhile would merge again (other bytes) and commit; the old leader's manifest, landing
    then, would describe files no longer there: the step quarantined at its next check. The newer leader leaves a
    commit another decided to it until the save timeout passed; the step is committed once, its manifest true."""
    lay_save(storage, DEAD, (0, 1))
    old = PartSaves(Storage(storage.url), _merging_worker(), sidecar="old-leader")
    new = PartSaves(Storage(storage.url), _merging_worker(), sidecar="new-leader")
    real = _part_commit.write_manifest
    paused: list[Any] = []

    def pausing(*args: Any, **kwargs: Any) -> None:
        if not paused:
            paused.append(True)
            paused.append(new.commit_ready(JOB))  # meanwhile, the newer leader's pass
        real(*args, **kwargs)

    monkeypatch.setattr(_part_commit, "write_manifest", pausing)
    old.commit_ready(JOB)
    assert committed_whole(storage, DEAD) and _manifest_holds(storage, storage.join(JOB, str(STEP)))
    assert paused == [True, []]  # the newer leader stood down; the old one committed


def _writing(record: dict[str, Any], also: Callable[[], None] = lambda: None) -> InProcessWorker:
    """A persist worker whose part write succeeds (``also`` runs meanwhile) and answers ``record``."""
    def answer(request: dict[str, Any]) -> dict[str, Any]:
        also()
        return {"ok": True, "record": record} if "part" in request else {"ok": False}
    return InProcessWorker(answer)


def test_a_dead_incarnations_late_part_leaves_no_record_beside_the_new_save(storage: Storage) -> None:
    """Host 1's sidecar of the dead incarnation is still writing its part of DEAD when the restarted incarnation
    takes the claim over (on another host). Its part lands late: no part record of DEAD is made in ``<job>/7``,
    so host 1's record of the new save is, and that save is committed."""
    lay_save(storage, DEAD, (0,), age_s=20.0)
    late = PartSaves(Storage(storage.url), Recorder(), sidecar="host1")

    def taken_over_meanwhile() -> None:
        claim = read_claim(storage, JOB, STEP)
        assert claim is not None and take_over_claim(storage, JOB, STEP, claim, LIVE, 2)

    late.worker = _writing(json.loads(part_record(DEAD, 1)), taken_over_meanwhile)
    assert late.persist_part(JOB, "/shm/job/7", _meta(DEAD, time.time() - 30.0)) != "written"
    assert read_part(storage, storage.join(JOB, str(STEP)), 1) is None
    for k in (0, 1):
        land_part(storage, LIVE, k)
    assert PartSaves(storage, finalizing_worker()).commit_ready(JOB) == [STEP]
    assert committed_whole(storage, LIVE)


def test_a_part_file_overwritten_after_its_record_is_never_committed(storage: Storage) -> None:
    """The new save's host 1 recorded ``ocdbt.process_1/manifest.ocdbt`` with its checksum; the dead incarnation's
    late write of the same name lands after it (same size, other bytes). The step is not committed from a file
    that is not the one its part recorded: never a step that mixes two saves."""
    lay_save(storage, LIVE, (0,))
    step = storage.join(JOB, str(STEP))
    name = "default/ocdbt.process_1/manifest.ocdbt"
    ours = b"manifest of LIVE"
    assert storage.create_new(join_path(step, name), ours)
    record = json.loads(part_record(LIVE, 1))
    record["files"] = [{"path": name, "size": len(ours), "crc32c": _crc(ours)}]
    storage.fs.pipe_file(join_path(step, name), b"manifest of DEAD")  # the dead save's late write, same size
    assert storage.create_new(record_path(step, 1), json.dumps(record).encode())
    with pytest.raises(StorageError, match=r"missing or changed: default/ocdbt\.process_1/manifest\.ocdbt"):
        PartSaves(Storage(storage.url), finalizing_worker()).commit_ready(JOB)
    storage.invalidate()
    assert not storage.exists(join_path(step, COMMIT_MARKER))


def _crc(data: bytes) -> str:
    chunks = iter([data, b""])
    return crc32c_of(lambda: next(chunks))[1]


@pytest.mark.parametrize(("record", "read"), [
    ({"fate": "retire", "by": "old-leader", "at": 100.0}, ("retire", "old-leader", 100.0)),
    ({"save_id": LIVE, "process_count": 2, "created_at": 50.0}, ("retire", LIVE, 50.0)),  # previous release's taker
    ({"save_id": DEAD, "process_count": 2, "created_at": 50.0}, "unreadable"),  # a claim naming the save itself
    ({"fate": "commit", "by": "x"}, "unreadable"),
    ({"fate": "commit", "by": "x", "at": "NaN"}, "unreadable"),
    ({"fate": "commit", "by": "x", "at": 10**400}, "unreadable"),  # too large for a float: not an OverflowError
    ({"save_id": LIVE, "process_count": 2, "created_at": -(10**400)}, "unreadable"),
    ({"fate": "commit", "by": 3, "at": 1.0}, "unreadable"),
    ({"fate": "keep", "by": "x", "at": 1.0}, "unreadable"),
    ([1, 2], "unreadable"),
])
def test_a_fate_record_is_read_whole_or_not_at_all(tmp_path: Path, record: Any, read: Any) -> None:
    storage = Storage(str(tmp_path))
    assert storage.create_new(fate_path(storage, JOB, STEP, DEAD), json.dumps(record).encode())
    found = read_fate_record(storage, JOB, STEP, DEAD)
    assert (found if isinstance(found, str) else (found.fate, found.by, found.at) if found else None) == read
    assert not decide_fate(storage, JOB, STEP, DEAD, "commit", "new-leader", redo_after_s=0.0)


def test_a_fate_is_carried_out_by_its_decider_and_by_another_only_once_old_enough(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    assert read_fate_record(storage, JOB, STEP, DEAD) is None
    assert decide_fate(storage, JOB, STEP, DEAD, "commit", "old-leader", redo_after_s=60.0)
    assert decide_fate(storage, JOB, STEP, DEAD, "commit", "old-leader", redo_after_s=60.0)  # its own: a redo
    assert not decide_fate(storage, JOB, STEP, DEAD, "commit", "new-leader", redo_after_s=60.0)  # it may be paused
    assert decide_fate(storage, JOB, STEP, DEAD, "commit", "new-leader", redo_after_s=0.0)  # old enough
    assert not decide_fate(storage, JOB, STEP, DEAD, "retire", "old-leader", redo_after_s=0.0)  # decided otherwise


def test_retention_asks_storage_not_a_listing_it_cached_whether_a_save_now_writes_in_place(
        storage: Storage, gcs_emulator: GcsEmulator) -> None:
    """The old leader decided to delete ``<job>/7`` (abandoned: a stray file, no claim) and its file system
    listed the step and the claims before a restarted incarnation claimed step 7 and landed a part in place
    (another client). Its retention must see the claim and the part: gcsfs would answer ``exists`` from the
    listings it kept."""
    assert storage.create_new(storage.join(JOB, str(STEP), "stray"), b"left by a dead save")
    [decision] = decide([_step_info(storage, STEP)], RetentionPolicy())
    assert decision.action == "delete"
    old = Storage(storage.url)
    old.list_dir(old.join(JOB, str(STEP)))
    old.list_dir(old.join(JOB))
    other = gcs_emulator.other_writer()  # the restarted incarnation's sidecar: another process
    claim = Claim(save_id=LIVE, process_count=2, created_at=time.time())
    other.pipe(claim_path(storage, JOB, STEP), claim.model_dump_json().encode())
    other.pipe(data_file(storage, LIVE, 0), b"part 0 of the restarted save")
    other.pipe(record_path(storage.join(JOB, str(STEP)), 0), part_record(LIVE, 0))
    collect(old, [decision], job=JOB, writes=lambda _job: True)
    storage.invalidate()
    assert read_claim(storage, JOB, STEP) is not None
    assert storage.exists(record_path(storage.join(JOB, str(STEP)), 0)), "the new save's part was deleted"


def test_a_sidecar_started_again_under_the_same_host_name_and_pid_is_another_party(storage: Storage) -> None:
    """A recreated pod keeps its host name and its entrypoint's pid (1): its sidecar must not count as the decider
    of a fate its predecessor recorded, or it would redo a commit or cleanup at once beside a paused one."""
    first, again = (PartSaves(storage, Recorder()) for _ in range(2))
    assert first.sidecar != again.sidecar
    assert first.sidecar.split("/")[:2] == again.sidecar.split("/")[:2]  # the same host and pid
    assert decide_fate(storage, JOB, STEP, DEAD, "retire", first.sidecar, redo_after_s=3600.0)
    assert decide_fate(storage, JOB, STEP, DEAD, "retire", first.sidecar, redo_after_s=3600.0)  # its decider
    assert not decide_fate(storage, JOB, STEP, DEAD, "retire", again.sidecar, redo_after_s=3600.0)  # waits
