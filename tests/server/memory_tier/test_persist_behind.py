"""Persists that fall behind the trainer's snapshots (storage slower than the saves: a slow storage day, GCS
backing off): one persist runs, the newest snapshot waits behind it, an older waiting one is superseded (reported,
not persisted, left to the tier's eviction rules), the persist running is never cancelled, and each of these is the
job's event, a counter and a rate-limited warning (docs/operations.md, "Persists that fall behind").

The persist worker is a stand-in that holds the first persist until the test lets it go (the keeper's thread, its
queue and its scans are the real ones); snapshots are written without jax."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from ckptd._sidecar import build_sidecar
from ckptd.catalog._catalog import Catalog
from ckptd.memory_tier._snapshots import SnapshotKeeper
from ckptd.persist._worker_client import InProcessWorker
from tests.support.helpers import make_settings, wait_until
from tests.support.orbax_steps import training_metadata
from trainer_client.core import Storage
from trainer_client.core.format._files import (
    SNAPSHOT_DATA_FILE,
    SNAPSHOT_META_FILE,
    SNAPSHOT_PERSISTED_FILE,
    SNAPSHOT_SUPERSEDED_FILE,
)
from trainer_client.core.format._private_files import ensure_private_dir, make_private_dir, open_private, write_private
from trainer_client.core.format._snapshot import ArrayRecord, ShardRecord, SnapshotMeta
from trainer_client.core.format._snapshot_dirs import evict_oldest
from trainer_client.core.format._tree_paths import TreeEntry
from trainer_client.core.protocol import ElasticEvent, TrainingMetadata

JOB = "job"


def snapshot(shm: Path, step: int, *, persist: bool = True, cols: int = 256) -> Path:
    """A whole single-process snapshot of one f32[4, cols] array (``<shm>/<job>/<step>/``)."""
    ensure_private_dir(shm)
    ensure_private_dir(shm / JOB)
    raw = np.full((4, cols), step, np.float32).tobytes()
    shard = ShardRecord(index=[[0, 4], [0, cols]], offset=0, nbytes=len(raw), xxh3=xxhash.xxh3_64_intdigest(raw),
                        replica_id=0)
    meta = SnapshotMeta(step=step, created_at=1.0, persist=persist, nbytes=len(raw), leaf_names=["w"],
                        tree=[TreeEntry(path=[("dict", "w")])],
                        arrays={"w": ArrayRecord(shape=[4, cols], dtype="float32", shards=[shard])},
                        training=TrainingMetadata.model_validate(training_metadata(step)["ckptd"]))
    tmp = make_private_dir(shm / JOB / f"{step}.tmp-{os.getpid()}")
    with os.fdopen(open_private(tmp / SNAPSHOT_DATA_FILE, os.O_WRONLY | os.O_CREAT), "wb") as f:
        f.write(raw)
    write_private(tmp / SNAPSHOT_META_FILE, meta.model_dump_json().encode())
    os.rename(tmp, shm / JOB / str(step))
    return shm / JOB / str(step)


class SlowWorker:
    """A persist worker whose first persist runs until ``release`` is set (storage that is slow today)."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.running = threading.Event()
        self.release = threading.Event()

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        step = int(Path(request["snapshot"]).name)
        self.asked.append(step)
        if len(self.asked) == 1:
            self.running.set()
            assert self.release.wait(30), "the test never let the slow persist finish"
        return {"ok": True, "path": f"{request['job_url']}/{step}"}


def mark_three(keeper: SnapshotKeeper, worker: SlowWorker, shm: Path) -> None:
    """Steps 10, 20 and 30 marked persist in quick succession, each found by a scan; 10's persist is still
    running when 20 and 30 come."""
    snapshot(shm, 10)
    keeper.scan()
    assert worker.running.wait(10)
    for step in (20, 30):
        snapshot(shm, step)
        keeper.scan()


def held(shm: Path) -> list[int]:
    return sorted(int(p.name) for p in (shm / JOB).iterdir() if p.name.isdigit())


@pytest.fixture
def slow(tmp_path: Path) -> Iterator[tuple[SnapshotKeeper, SlowWorker, list[tuple[str, ElasticEvent]]]]:
    (tmp_path / "root" / JOB).mkdir(parents=True)
    reported: list[tuple[str, ElasticEvent]] = []
    keeper = SnapshotKeeper(Storage(str(tmp_path / "root")), str(tmp_path / "shm"), max_snapshots=3,
                            on_report=lambda job, event: reported.append((job, event)))
    worker = SlowWorker()
    keeper.worker = InProcessWorker(worker.answer)
    keeper.start()
    yield keeper, worker, reported
    worker.release.set()
    keeper.stop(5.0)


def test_three_snapshots_marked_in_quick_succession_persist_the_first_and_the_newest(
    tmp_path: Path, slow: tuple[SnapshotKeeper, SlowWorker, list[tuple[str, ElasticEvent]]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    keeper, worker, reported = slow
    shm = tmp_path / "shm"
    caplog.set_level(logging.WARNING, logger="ckptd.memory_tier._snapshots")
    first = snapshot(shm, 10)
    keeper.scan()
    assert worker.running.wait(10)  # step 10 is being persisted, slowly
    second = snapshot(shm, 20)
    keeper.scan()  # due while 10 still runs: behind, and it waits
    third = snapshot(shm, 30)
    keeper.scan()  # 20 is superseded by 30 (not persisted); 30 waits
    keeper.scan()  # a scan again changes nothing
    assert (second / SNAPSHOT_SUPERSEDED_FILE).is_file() and not (third / SNAPSHOT_SUPERSEDED_FILE).exists()
    assert not (first / SNAPSHOT_PERSISTED_FILE).exists()  # never cancelled: still running
    worker.release.set()
    wait_until(lambda: (third / SNAPSHOT_PERSISTED_FILE).is_file(), timeout=10, what="step 30 persisted")
    assert worker.asked == [10, 30]
    assert (first / SNAPSHOT_PERSISTED_FILE).is_file() and not (second / SNAPSHOT_PERSISTED_FILE).exists()
    assert held(shm) == [10, 20, 30]  # superseding deleted nothing
    assert keeper.stats.persisted == 2 and keeper.stats.failed == 0
    assert (keeper.stats.behind, keeper.stats.overtaken) == (2, 1)

    assert [(job, e.kind, e.step) for job, e in reported] == [
        (JOB, "persist_behind", 20), (JOB, "persist_overtaken", 20), (JOB, "persist_behind", 30)]
    nbytes = 4 * 256 * 4
    for _job, e in reported:  # what was still persisting, for how long, how big
        assert e.persisting_step == 10 and e.persist_bytes == nbytes
        assert e.persist_running_seconds is not None and e.persist_running_seconds >= 0
    assert reported[1][1].superseded_by == 30 and "not persisted" in reported[1][1].detail
    assert len({e.id for _job, e in reported}) == 3
    warnings = [r for r in caplog.records if "falling behind" in r.getMessage()]
    assert len(warnings) == 1, "the warning is rate-limited: one for the burst, not one per snapshot"
    assert "step 10 has been persisting" in warnings[0].getMessage()

    keeper.scan()  # nothing more to persist: 20 is never taken up again
    assert worker.asked == [10, 30]


def test_a_superseded_snapshot_goes_only_by_the_tiers_eviction_rules(
    tmp_path: Path, slow: tuple[SnapshotKeeper, SlowWorker, list[tuple[str, ElasticEvent]]],
) -> None:
    """Superseded, a snapshot is kept as a memory-only one is: beyond the limit, oldest first, never the newest —
    so neither at once nor forever (unsuperseded, a snapshot marked persist and never persisted could never go, and
    the trainer's tier would stay full)."""
    keeper, worker, _reported = slow
    shm = tmp_path / "shm"
    mark_three(keeper, worker, shm)
    snapshot(shm, 40, persist=False)  # a memory-only save: four held, three kept
    keeper.scan()  # 10 runs (not evictable), 20 is superseded: the oldest that may go
    assert held(shm) == [10, 30, 40]
    worker.release.set()
    wait_until(lambda: (shm / JOB / "30" / SNAPSHOT_PERSISTED_FILE).is_file(), timeout=10, what="step 30 persisted")
    # the trainer's side applies the same rules: with 10 and 30 persisted, everything but the newest may go
    left = [shm / JOB / str(s) for s in held(shm)]
    evict_oldest(left, 1, never=left[-1])
    assert held(shm) == [40]


def test_a_persist_running_when_the_next_is_due_is_reported_and_not_piled_up_across_many(
    tmp_path: Path, slow: tuple[SnapshotKeeper, SlowWorker, list[tuple[str, ElasticEvent]]],
) -> None:
    """However many snapshots are marked while one persist runs, at most one waits: the newest."""
    keeper, worker, reported = slow
    shm = tmp_path / "shm"
    keeper.max_snapshots = 100
    snapshot(shm, 1)
    keeper.scan()
    assert worker.running.wait(10)
    for step in range(2, 12):
        snapshot(shm, step)
        keeper.scan()
    superseded = [s for s in held(shm) if (shm / JOB / str(s) / SNAPSHOT_SUPERSEDED_FILE).is_file()]
    assert superseded == list(range(2, 11))
    worker.release.set()
    wait_until(lambda: (shm / JOB / "11" / SNAPSHOT_PERSISTED_FILE).is_file(), timeout=10, what="step 11 persisted")
    assert worker.asked == [1, 11]
    kinds = [e.kind for _job, e in reported]
    assert kinds.count("persist_behind") == 10 and kinds.count("persist_overtaken") == 9


def test_the_sidecar_stores_the_reports_as_the_jobs_events_and_counts_them(tmp_path: Path) -> None:
    root, shm = tmp_path / "root", tmp_path / "shm"
    (root / JOB).mkdir(parents=True)
    settings = make_settings(root, tmp_path / "state", shm_dir=str(shm), max_snapshots=3)
    catalog = Catalog(Storage(str(root)), ":memory:")
    try:
        sidecar = build_sidecar(settings, catalog)
        keeper = sidecar.keeper
        assert keeper is not None
        worker = SlowWorker()
        keeper.worker = InProcessWorker(worker.answer)
        keeper.start()
        try:
            mark_three(keeper, worker, shm)
        finally:
            worker.release.set()
            keeper.stop(5.0)
        stored = [(e.kind, e.step, e.source) for e in sidecar.events.load(JOB)]
        assert stored == [("persist_behind", 20, "ckptd"), ("persist_overtaken", 20, "ckptd"),
                          ("persist_behind", 30, "ckptd")]
        overtaken = next(e for e in sidecar.events.load(JOB) if e.kind == "persist_overtaken")
        assert overtaken.persisting_step == 10 and overtaken.superseded_by == 30 and overtaken.persist_bytes
        get = sidecar.metrics.registry.get_sample_value
        assert get("ckptd_persist_behind_total", {"ckpt_job": JOB}) == 2.0
        assert get("ckptd_persist_overtaken_total", {"ckpt_job": JOB}) == 1.0
        assert get("ckptd_elastic_events_total", {"ckpt_job": JOB, "kind": "persist_overtaken"}) == 1.0
    finally:
        catalog.close()


class DamagedAt(SlowWorker):
    """A slow first persist, then the snapshot of ``damaged`` answered as damaged in memory (its checksums fail)."""

    def __init__(self, damaged: int) -> None:
        super().__init__()
        self.damaged = damaged

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        if int(Path(request["snapshot"]).name) == self.damaged:
            self.asked.append(self.damaged)
            return {"ok": False, "error": "StoredFormatError: shard 0 of w: checksum mismatch", "failure": "damaged"}
        return super().answer(request)


def test_a_superseded_snapshot_is_persisted_after_all_when_the_one_that_took_its_place_is_damaged(
        tmp_path: Path) -> None:
    """20 waits behind 10's persist and 30 supersedes it; 30 is then found damaged and dropped: 20, the newest good
    snapshot, is persisted in its place (not left superseded for ever while storage keeps only 10)."""
    (tmp_path / "root" / JOB).mkdir(parents=True)
    shm = tmp_path / "shm"
    keeper = SnapshotKeeper(Storage(str(tmp_path / "root")), str(shm), max_snapshots=3)
    worker = DamagedAt(30)
    keeper.worker = InProcessWorker(worker.answer)
    keeper.start()
    try:
        mark_three(keeper, worker, shm)
        assert (shm / JOB / "20" / SNAPSHOT_SUPERSEDED_FILE).is_file()
        worker.release.set()
        wait_until(lambda: worker.asked == [10, 30] and not (shm / JOB / "30").exists(), timeout=10,
                   what="step 30 found damaged and dropped")
        assert not (shm / JOB / "20" / SNAPSHOT_SUPERSEDED_FILE).exists()
        keeper.scan()
        wait_until(lambda: (shm / JOB / "20" / SNAPSHOT_PERSISTED_FILE).is_file(), timeout=10,
                   what="step 20 persisted after all")
        assert worker.asked == [10, 30, 20] and keeper.stats.broken == 1
        keeper.scan()  # once
        assert worker.asked == [10, 30, 20]
    finally:
        worker.release.set()
        keeper.stop(5.0)
