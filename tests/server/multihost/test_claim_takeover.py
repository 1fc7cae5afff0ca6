"""A restarted job's save of a step takes over at once the claim of a dead incarnation's incomplete save of the
same step, instead of waiting for ``save_timeout_s`` (docs/multihost.md, section 5, "Claims of a dead
incarnation"): the claim is another incarnation's (its save id's prefix), made before the new part's snapshot,
the step is not committed and a part record of the old save is absent. A same-incarnation claim, a claim made
after the snapshot, a save whose every part is durable and a committed step are never taken over; among
racing takers exactly one replaces the claim; the dead save's staged files are then cleaned by retention.
Real files; the persist worker is replaced by a recorder (what is tested is what ckptd decides)."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from ckptd.multihost._abandoned_parts import clean_abandoned_parts
from ckptd.multihost._part_commit import PartSaves
from ckptd.persist._worker_client import PersistWorkerError
from tests.server.multihost.test_forged_parts import Recorder
from tests.support.claim_race import race
from tests.support.forged_records import forge_claim, forge_part
from tests.support.orbax_steps import training_metadata
from trainer_client.core._storage import Storage
from trainer_client.core.format._parts import Claim, read_claim, take_over_claim
from trainer_client.core.format._snapshot import SnapshotMeta
from trainer_client.core.protocol import TrainingMetadata

STEP = 7
DEAD, LIVE = f"aa-{STEP}", f"bb-{STEP}"


def part_meta(save_id: str, created_at: float, process_index: int = 1) -> SnapshotMeta:
    """This host's part of ``save_id`` (2 processes), its snapshot taken at ``created_at``."""
    training = TrainingMetadata.model_validate(training_metadata(STEP)["ckptd"])
    return SnapshotMeta(step=STEP, created_at=created_at, persist=True, nbytes=0, leaf_names=[], tree=[], arrays={},
                        training=training, process_index=process_index, process_count=2, save_id=save_id)


def dead_save(root: Path, *, age_s: float = 20.0, parts: tuple[int, ...] = (0,)) -> Claim:
    """The claim of a killed incarnation's save of STEP, ``age_s`` old, with the part records ``parts`` staged."""
    forge_claim(root, "job", STEP, save_id=DEAD, created_at=time.time() - age_s)
    for k in parts:
        forge_part(root, "job", STEP, k, save_id=DEAD)
    claim = read_claim(Storage(str(root)), "job", STEP)
    assert claim is not None
    return claim


def test_a_dead_incarnations_incomplete_claim_is_taken_over_at_once_and_its_staging_cleaned(tmp_path: Path) -> None:
    dead_save(tmp_path)
    storage, worker = Storage(str(tmp_path)), Recorder()
    saves = PartSaves(storage, worker)
    meta = part_meta(LIVE, time.time() - 1.0)
    assert saves.state("job", meta) == "todo"  # not "claimed by another save": no wait for save_timeout_s
    with pytest.raises(PersistWorkerError):  # the recorder writes nothing; the claim is taken before
        saves.persist_part("job", "/shm/job/7", meta)
    claim = read_claim(storage, "job", STEP)
    assert claim is not None and claim.save_id == LIVE and claim.process_count == 2
    assert len(worker.asked) == 1 and f".ckptd/staging/{STEP}.{LIVE}" in str(worker.asked[0])
    assert (tmp_path / "job" / ".ckptd" / "claims" / f"{STEP}.takeover-{DEAD}").is_file()

    decisions = clean_abandoned_parts(storage, "job", older_than_s=3600.0)
    assert [d.path for d in decisions] == [str(tmp_path / "job" / ".ckptd" / "staging" / f"{STEP}.{DEAD}")]
    assert "superseded" in decisions[0].reasons[0]
    assert not (tmp_path / "job" / ".ckptd" / "staging" / f"{STEP}.{DEAD}").exists()
    assert read_claim(storage, "job", STEP) == claim  # the live save's claim stays


@pytest.mark.parametrize("case", ["same incarnation", "claimed after the snapshot", "every part durable",
                                  "committed"])
def test_a_claim_that_may_be_alive_or_complete_is_not_taken_over(tmp_path: Path, case: str) -> None:
    storage = Storage(str(tmp_path))
    stale = dead_save(tmp_path, parts=(0, 1) if case == "every part durable" else (0,))
    snapshot_at = stale.created_at - 5.0 if case == "claimed after the snapshot" else time.time()
    save_id = f"aa-{STEP + 1}" if case == "same incarnation" else LIVE  # a claim of this incarnation's own
    if case == "committed":
        (tmp_path / "job" / str(STEP)).mkdir(parents=True)
        (tmp_path / "job" / str(STEP) / "commit_success.txt").write_text("committed")
    saves = PartSaves(storage, Recorder())
    meta = part_meta(save_id, snapshot_at)
    assert not saves.stale("job", stale, meta)
    assert saves.state("job", meta) == ("committed" if case == "committed" else "claimed by another save")
    assert saves.persist_part("job", "/shm/job/7", meta) in {"committed", "claimed by another save"}
    assert read_claim(storage, "job", STEP) == stale
    assert clean_abandoned_parts(storage, "job", older_than_s=3600.0) == []
    assert (tmp_path / "job" / ".ckptd" / "staging" / f"{STEP}.{DEAD}").is_dir()


def test_a_claim_changed_since_it_was_read_is_not_replaced(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    stale = dead_save(tmp_path)
    forge_claim(tmp_path, "job", STEP, save_id=f"cc-{STEP}", created_at=time.time())  # replaced meanwhile
    assert not take_over_claim(storage, "job", STEP, stale, LIVE, 2)
    claim = read_claim(storage, "job", STEP)
    assert claim is not None and claim.save_id == f"cc-{STEP}"


def test_of_racing_takers_in_separate_processes_exactly_one_replaces_the_claim(tmp_path: Path) -> None:
    stale = dead_save(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    start, won = ctx.Barrier(6), ctx.Queue()
    takers = [ctx.Process(target=race, args=(str(tmp_path), "job", STEP, stale.model_dump_json(), f"{n:02x}c-{STEP}",
                                             start, won)) for n in range(6)]
    for p in takers:
        p.start()
    results = dict(won.get(timeout=60) for _ in takers)
    for p in takers:
        p.join(timeout=30)
        assert p.exitcode == 0
    winners = [save_id for save_id, replaced in results.items() if replaced]
    assert len(winners) == 1
    claim = read_claim(Storage(str(tmp_path)), "job", STEP)
    assert claim is not None and claim.save_id == winners[0]
    assert sorted(p.name for p in (tmp_path / "job" / ".ckptd" / "claims").iterdir()) == [
        f"{STEP}.json", f"{STEP}.takeover-{DEAD}"]  # no temporary file left

