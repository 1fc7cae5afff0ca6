"""Claims and part records of multi-host saves are read from storage, so they are hostile input
(docs/multihost.md, section 5): every field is bounded and every name patterned, a forged record is reported
and skipped (never acted on, never deleted), every path ckptd writes passes one check (``Storage.writable``:
plain names, inside the root once links are resolved, not under a read-only job), and one job's costly claims
hold up neither the other jobs' commits nor a stop. Real files and directories throughout; the persist worker
(jax, Orbax) is replaced by a recorder of what would have been asked of it: what is tested is what ckptd
decides before it asks."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ckptd.catalog._catalog import Catalog
from ckptd.memory_tier._snapshots import SnapshotKeeper
from ckptd.multihost._abandoned_parts import clean_abandoned_parts
from ckptd.multihost._commit_pass import CommitPass
from ckptd.multihost._part_commit import PartSaves
from ckptd.persist._worker_client import InProcessWorker
from tests.support.forged_records import forge_claim, forge_part, tree_state, write_snapshot
from tests.support.helpers import SteppingClock, wait_until
from trainer_client.core._errors import StorageError, UnsafePathError
from trainer_client.core._storage import Storage, join_path
from trainer_client.core._whole_files import write_json_file
from trainer_client.core.format._parts import Claim, PartInfo, part_problems, read_claim, save_parts


class Recorder(InProcessWorker):
    """Stands in for the persist worker: records each request, answers that nothing was done."""

    def __init__(self) -> None:
        super().__init__(self._record)
        self.asked: list[dict[str, Any]] = []

    def _record(self, request: dict[str, Any]) -> dict[str, Any]:
        self.asked.append(request)
        return {"ok": False, "error": "not done here"}


@pytest.mark.parametrize("name", ["..", "a/../b", ".", "a/./b", "", "a//b", "/etc", "//x", "a\0b", "../../tmp/x"])
def test_a_join_refuses_names_that_could_leave_the_path(name: str) -> None:
    with pytest.raises(UnsafePathError, match="no relative path of plain names"):
        join_path("/root/job", name)
    with pytest.raises(UnsafePathError):
        Storage("/root").join("job", name)


def test_a_join_keeps_plain_names() -> None:
    assert join_path("/root/", "job", "default/_METADATA", "d/") == "/root/job/default/_METADATA/d"
    assert join_path("gs://b/p", ".ckptd", "x.json") == "gs://b/p/.ckptd/x.json"
    assert join_path("/", "job") == "/job" and Storage("/r").join() == "/r"


def test_every_write_passes_one_check(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "job").mkdir(parents=True)
    outside.mkdir()
    os.symlink(outside, root / "job" / "out")
    (tmp_path / "root2").mkdir()
    storage = Storage(str(root))
    for path in (f"{root}/job/../../outside/x", f"{root}2/x", f"{root}/job//x", f"{root}/job/./x", str(root),
                 f"{root}/job/out/x", "/etc/x"):
        assert storage.write_refusal(path) is not None, path
        with pytest.raises(UnsafePathError):
            storage.create_new(path, b"x")
        with pytest.raises(UnsafePathError):
            write_json_file(storage, path, "{}")
        with pytest.raises(UnsafePathError):
            storage.remove(path)
        with pytest.raises(UnsafePathError):
            storage.rename(f"{root}/job", path)
    assert list(outside.iterdir()) == [] and (root / "job").is_dir()
    assert storage.create_new(f"{root}/job/.ckptd/claims/1.json", b"{}")  # what is inside: written
    storage.remove(f"{root}/job/.ckptd/claims/1.json")


def test_a_read_only_job_refuses_every_write_but_its_records_on_the_side(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for job in ("ro", "rw"):
        (root / job / "1").mkdir(parents=True)
    storage = Storage(str(root))
    Catalog(storage, ":memory:", read_only_jobs=frozenset({"ro"}))  # the catalog guards its storage's writes
    before = tree_state(root / "ro")
    for path in (f"{root}/ro/1/ckptd_manifest.json", f"{root}/ro/.ckptd/claims/9.json", f"{root}/ro/new"):
        assert "watched read-only" in (storage.write_refusal(path) or ""), path
        with pytest.raises(UnsafePathError, match="read-only"):
            write_json_file(storage, path, "{}")
    with pytest.raises(UnsafePathError, match="read-only"):
        storage.remove(f"{root}/ro/1", recursive=True)
    write_json_file(storage, f"{root}/.ckptd/ro/1/ckptd_manifest.json", "{}")  # the side prefix: ckptd's own
    write_json_file(storage, f"{root}/rw/1/ckptd_manifest.json", "{}")
    assert tree_state(root / "ro") == before


TWO_DAYS_AHEAD = "two days ahead"


@pytest.mark.parametrize(("field", "value"), [
    ("process_count", 20_000_000), ("process_count", 65537), ("process_count", 1), ("created_at", 1e300),
    ("created_at", float("inf")), ("created_at", float("nan")), ("created_at", -1.0),
    ("created_at", TWO_DAYS_AHEAD), ("save_id", "../x"),
])
def test_a_claim_out_of_bounds_is_refused_reported_and_kept(tmp_path: Path, field: str, value: Any,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    if value is TWO_DAYS_AHEAD:  # computed when the test runs: ids must be the same on every xdist worker
        value = time.time() + 2 * 86400
    path = forge_claim(tmp_path, "job", 7, **{field: value})
    raw = path.read_bytes()
    with pytest.raises(ValueError):
        Claim.model_validate_json(raw)
    assert read_claim(Storage(str(tmp_path)), "job", 7) is None
    assert f"ignoring {path}, forged or damaged" in caplog.text and field in caplog.text
    assert PartSaves(Storage(str(tmp_path)), Recorder()).abandoned("job", older_than_s=0.0) == []
    assert path.read_bytes() == raw


def test_a_claim_within_bounds_is_read() -> None:
    claim = Claim.model_validate_json(json.dumps({"save_id": "ab-7", "process_count": 65536,
                                                  "created_at": time.time() + 3600}))
    assert claim.process_count == 65536


@pytest.mark.parametrize("update", [
    {"item": "../../../tmp/x"}, {"item": ".."}, {"item": "a/b"}, {"item": ""},
    {"files": [{"path": "../x", "size": 1, "crc32c": "AAAAAA=="}]},
    {"files": [{"path": "/etc/passwd", "size": 1, "crc32c": "AAAAAA=="}]},
    {"files": [{"path": "default//d", "size": 1, "crc32c": "AAAAAA=="}]},
    {"files": [{"path": "default/d", "size": 1 << 60, "crc32c": "AAAAAA=="}]},
    {"files": [{"path": "default/d", "size": 1, "crc32c": "not a crc"}]},
    {"process_index": 2}, {"process_count": 20_000_000}, {"written_at": 1e300}, {"sidecar": "x" * 300},
    {"write_shapes": {"w": [-1]}},
])
def test_a_part_record_out_of_bounds_is_refused(tmp_path: Path, update: dict[str, Any]) -> None:
    path = forge_part(tmp_path, "job", 7, 0, **update)
    with pytest.raises(ValueError):
        PartInfo.model_validate_json(path.read_bytes())
    held = save_parts(Storage(str(tmp_path)), str(path.parents[1]), "ab-7", 2)
    assert held.bad == [0] and held.absent == [1] and not held.found


def test_a_commits_reads_of_the_records_go_at_once_with_the_same_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Six processes' records: 4 absent, 2 of another process count, 5 claiming another index; the rest good. Read
    16 at a time (a commit pass, the commit's re-read under the job's lock) the answer is the one-by-one answer, in
    process order, and the reads overlap (each waits until another is in flight, or 10 s); a pass's first gap and
    its spent time budget stop the reading where they stopped it one by one."""
    import trainer_client.core.format._parts as parts

    for k, fields in ((0, {}), (1, {}), (2, {"process_count": 5}), (3, {}), (5, {"process_index": 2})):
        forge_part(tmp_path, "job", 7, k, **{"process_count": 6, **fields})
    where = str(tmp_path / "job" / ".ckptd" / "staging" / "7.ab-7")
    storage = Storage(str(tmp_path))
    one_by_one = save_parts(storage, where, "ab-7", 6)
    assert ([p.process_index for p in one_by_one.found], one_by_one.absent, one_by_one.bad) == ([0, 1, 3], [4], [2, 5])

    real_read, in_flight, overlapped = parts.read_part, [0], threading.Event()
    lock = threading.Lock()

    def read_beside_another(storage: Storage, step_path: str, k: int) -> Any:
        with lock:
            in_flight[0] += 1
            if in_flight[0] > 1:
                overlapped.set()
        overlapped.wait(timeout=10)
        try:
            return real_read(storage, step_path, k)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(parts, "read_part", read_beside_another)
    at_once = save_parts(storage, where, "ab-7", 6, readers=16)
    assert overlapped.is_set()
    assert ([p.process_index for p in at_once.found], at_once.absent, at_once.bad) == ([0, 1, 3], [4], [2, 5])
    assert at_once.whole is False and at_once.stopped is None
    gap = save_parts(storage, where, "ab-7", 6, first_gap=True, readers=16)
    assert ([p.process_index for p in gap.found], gap.absent, gap.bad, gap.stopped) == ([0, 1], [], [2], None)
    later = save_parts(storage, where, "ab-7", 6, first_gap=True, start=3, readers=16)
    assert ([p.process_index for p in later.found], later.absent, later.bad) == ([3], [4], [])
    asked: list[bool] = []
    budget = save_parts(storage, where, "ab-7", 6, readers=1, spent=lambda: asked.append(True) or True)
    assert ([p.process_index for p in budget.found], budget.stopped, len(asked)) == ([0], 1, 1)


def test_a_part_record_within_bounds_is_read(tmp_path: Path) -> None:
    files = [{"path": "default/ocdbt.process_0/d/0a1b", "size": 10, "crc32c": "AAAAAA=="},
             {"path": "iter/process_0-of-2.json", "size": 3, "crc32c": "+/+/+A=="}]
    path = forge_part(tmp_path, "job", 7, 0, item="items", files=files)
    assert PartInfo.model_validate_json(path.read_bytes()).item == "items"


def test_forged_parts_are_never_committed_and_nothing_is_written_outside(tmp_path: Path) -> None:
    """The records that once made the commit write ``_METADATA`` and ``commit_success.txt`` beside the root."""
    root, sentinel = tmp_path / "root", tmp_path / "sentinel"
    sentinel.mkdir()
    where = root / "job" / ".ckptd" / "staging" / "9.ab-9"
    forge_claim(root, "job", 9)
    for k in (0, 1):
        forge_part(root, "job", 9, k, item=os.path.relpath(sentinel, where))
    planted = tree_state(root / "job")
    worker = Recorder()
    commits = CommitPass(Storage(str(root)), jobs=lambda: ["job"], writes=lambda _job: True, interval_s=3600,
                         worker=worker)
    assert commits.run_once() == [] and worker.asked == []  # refused before the worker is ever asked
    assert clean_abandoned_parts(Storage(str(root)), "job", older_than_s=0.0) == []  # kept for inspection
    assert part_problems(Storage(str(root)), str(where)) == [
        "ckptd_parts/process_0.json is missing or unreadable"]
    assert list(sentinel.iterdir()) == [] and tree_state(root / "job") == planted


def _costly_job(root: Path, job: str, claims: int) -> None:
    """``claims`` claims whose two part records are there and of another save: each read, none committed."""
    first = forge_part(root, job, 0, 0, save_id="ff-0")
    for step in range(claims):
        forge_claim(root, job, step)
        for k in (0, 1):
            record = root / job / ".ckptd" / "staging" / f"{step}.ab-{step}" / "ckptd_parts" / f"process_{k}.json"
            record.parent.mkdir(parents=True, exist_ok=True)
            os.link(first, record)


def _ready(root: Path, job: str, step: int) -> None:
    forge_claim(root, job, step)
    for k in (0, 1):
        forge_part(root, job, step, k)


def test_one_jobs_costly_claims_hold_up_no_other_job_and_are_all_visited(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ckptd.multihost._part_commit")
    root = tmp_path / "root"
    _costly_job(root, "aaa", 400)  # each claim's records read, none committed
    _ready(root, "aaa", 99_999)  # after every costly claim: reached in later passes, never starved
    _ready(root, "zzz", 5)
    worker = Recorder()
    # A job's budget is spent after ~20 looks at the clock, however fast the machine reads the claims (on the
    # real clock a fast machine read all 400 within the 0.02 s and the pass never ran out of time).
    clock = SteppingClock(0.001)
    commits = CommitPass(Storage(str(root)), jobs=lambda: ["aaa", "zzz"], writes=lambda _job: True, interval_s=3600,
                         worker=worker, job_budget_s=0.02, clock=clock)
    commits.run_once()
    asked = [request["commit"].rsplit("/", 1)[-1] for request in worker.asked]
    assert asked == ["5.ab-5"], asked  # zzz's ready step was reached in the first pass
    stopped_at = [int(r.getMessage().rsplit("at step ", 1)[1].split(";")[0]) for r in caplog.records
                  if "committing the host parts of aaa: out of time for this pass at step" in r.getMessage()]
    assert len(stopped_at) == 1 and 0 < stopped_at[0] < 100, stopped_at  # aaa's share ended early in its claims
    for _ in range(402):  # each pass visits at least one claim: 401 of them are all visited within as many passes
        if "99999.ab-99999" in [request["commit"].rsplit("/", 1)[-1] for request in worker.asked]:
            break
        commits.run_once()
    else:
        pytest.fail("aaa's ready step was never reached: its costly claims starve it")


def test_a_stop_ends_a_pass_at_its_next_record(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _costly_job(root, "aaa", 2000)
    # Every record read looks at the clock; once stopped, the pass in progress looks no more and the last pass
    # gets stop_wait_s of this clock (~25 looks): counted, not timed, so the machine's speed does not matter.
    clock = SteppingClock(0.01)
    commits = CommitPass(Storage(str(root)), jobs=lambda: ["aaa"], writes=lambda _job: True, interval_s=0.01,
                         worker=Recorder(), job_budget_s=600, stop_wait_s=0.5, clock=clock)
    commits.start()
    wait_until(lambda: clock.reads > 20, timeout=30, what="a pass over aaa's claims to be under way")
    before = clock.reads
    stopper = threading.Thread(target=commits.stop)
    stopper.start()
    stopper.join(timeout=30)
    assert not stopper.is_alive(), "stop hung"
    wait_until(lambda: not commits._thread.is_alive(), timeout=30, what="the commit pass thread to end")
    looks = clock.reads - before
    assert looks < 200, f"{looks} looks at the clock after the stop: a pass over 2000 claims went on"


def test_a_read_only_job_is_neither_persisted_nor_committed_nor_cleaned(tmp_path: Path) -> None:
    root, shm = tmp_path / "root", tmp_path / "shm"
    _ready(root, "job", 9)  # whole: a leader would commit it in normal mode
    forge_claim(root, "job", 10)  # abandoned: retention would delete it in normal mode
    snapshot = write_snapshot(shm, "job", 1000)
    storage = Storage(str(root))
    Catalog(storage, ":memory:", read_only=True)
    before = tree_state(root / "job")
    worker = Recorder()
    assert CommitPass(storage, jobs=lambda: ["job"], writes=lambda _job: True, interval_s=3600,
                      worker=worker).run_once() == []
    keeper = SnapshotKeeper(storage, str(shm))
    keeper.parts.worker = worker
    keeper.scan()
    assert keeper._queue.empty() and "watched read-only" in keeper.stats.held[str(snapshot)]
    assert keeper.persist("job", snapshot) is None and "read-only" in (keeper.stats.last_error or "")
    with pytest.raises(StorageError, match="cannot delete the abandoned save"):  # refused by the one check
        clean_abandoned_parts(storage, "job", older_than_s=0.0)
    assert worker.asked == [] and tree_state(root / "job") == before
    assert snapshot.is_dir() and not (snapshot / "persisted.json").exists()
