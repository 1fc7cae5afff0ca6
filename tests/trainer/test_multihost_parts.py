"""One host's part of a multi-process job's memory snapshot: two real JAX processes (jax.distributed on
127.0.0.1, 4 CPU devices each, one global mesh of 8) each snapshot their own shards through the real
``MemoryTier``. The part records its process, is never taken for a whole snapshot, and ckptd's keeper keeps
it — neither persisted alone (a step missing the other host's shards) nor deleted as broken (a persistent
save lost) — and reports it once; the trainer's ``Saver`` sends a persistent save of such a job to storage
directly, in every process (docs/multihost.md)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from ckptd.catalog.persist_worker import persist
from ckptd.catalog.snapshots import SnapshotKeeper
from tests.support.jax_job import PREAMBLE, run_job
from trainer_client.core.format.snapshot import newest_whole, problems, read_meta
from trainer_client.core.storage import Storage

_HOST = PREAMBLE + """
from trainer_client.runtime._saver import Saver
from trainer_client.runtime.checkpointing import Checkpointer, training_metadata
from trainer_client.runtime.memory_tier import MemoryTier
state = {
    "w": jax.make_array_from_callback((16, 4), NamedSharding(mesh, P("data")),
                                      lambda i: np.arange(64, dtype=np.float32).reshape(16, 4)[i]),
    "b": jax.make_array_from_callback((4,), NamedSharding(mesh, P()), lambda i: np.ones(4, np.float32)[i]),
}
meta = training_metadata(5, state, data_position=40, global_batch=8, mesh=mesh, slices=[0])
tier = MemoryTier(shm, "job", preallocate=False)
path = tier.save(5, state, meta, persist=True)
saver = Saver(Checkpointer(root + "/job"), tier, None)
went = saver.save(6, state, training_metadata(6, state, data_position=48, global_batch=8, mesh=mesh, slices=[0]),
                  persist=True)
saver.wait()
print(went, path, flush=True)
jax.distributed.shutdown()
"""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], list[Path]]:
    """A 2-process job: step 5 snapshotted (marked persist) by both processes, each into its own host's
    shared memory; step 6 saved through the trainer's ``Saver`` with the memory tier on. The storage root,
    the tier each process's save of step 6 took, and the two parts of step 5."""
    base = tmp_path_factory.mktemp("hosts")
    root = base / "root"
    tiers, parts = [], []
    for line in run_job(_HOST, base):
        went, path = line.split()[-2:]
        tiers.append(went)
        parts.append(Path(path))
    return root, tiers, parts


@pytest.fixture(scope="module")
def parts(hosts: tuple[Path, list[str], list[Path]]) -> list[Path]:
    return hosts[2]


def test_a_persistent_save_of_a_multi_process_job_goes_to_storage(hosts: tuple[Path, list[str], list[Path]]) -> None:
    root, tiers, parts = hosts
    assert tiers == ["storage", "storage"]  # every process alike: one multi-process Orbax save
    assert (root / "job" / "6" / "commit_success.txt").is_file()
    assert sorted(p.name for p in (root / "job" / "6" / "default").glob("ocdbt.process_*")) == [
        "ocdbt.process_0", "ocdbt.process_1"]
    assert all(not (part.parent / "6").exists() for part in parts)  # not left in memory as a part


def test_each_host_snapshots_its_own_part_and_records_which(parts: list[Path]) -> None:
    metas = [read_meta(path) for path in parts]
    assert [(m.process_index, m.process_count, m.is_part) for m in metas] == [(0, 2, True), (1, 2, True)]
    w = [{tuple(map(tuple, s.index)) for s in m.arrays["w"].shards} for m in metas]
    assert not w[0] & w[1]  # the hosts hold different rows of the sharded array ...
    covered = [sum(math.prod(b - a for a, b in index) for index in part) for part in w]
    assert covered == [32, 32]  # ... each half of its 64 elements
    # a replicated array: one copy in each part, so that each process restores from its own part alone
    assert [len(m.arrays["b"].shards) for m in metas] == [1, 1]
    for path in parts:
        assert problems(path) == []  # intact as a part ...
        assert newest_whole(path.parent.parent, "job") is None  # ... and never a whole snapshot on its own
    recorded = json.loads((parts[1] / "snapshot.json").read_text())
    assert (recorded["process_index"], recorded["process_count"]) == (1, 2)
    single = json.loads(metas[0].model_copy(update={"process_index": 0, "process_count": 1}).model_dump_json())
    assert "process_index" not in single and "process_count" not in single  # what older readers parse


def test_the_keeper_keeps_and_reports_a_part_without_persisting_it(
        parts: list[Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    part = parts[0]
    root = tmp_path / "root"
    keeper = SnapshotKeeper(Storage(str(root)), str(part.parent.parent), max_snapshots=1)
    keeper.start()
    with caplog.at_level(logging.WARNING, logger="ckptd.catalog.snapshots"):
        keeper.scan()
        keeper.scan()
    left = keeper.stop(drain_timeout_s=30)
    assert part.is_dir() and problems(part) == []  # kept: a persistent save is not lost
    assert left == [] and keeper.stats.persisted == 0 and keeper.stats.failed == 0 and keeper.stats.broken == 0
    assert not (root / "job" / "5").exists()  # no step committed from one host's shards
    assert "process 0 of 2" in keeper.stats.parts[str(part)]
    warned = [r for r in caplog.records if "not persisting snapshot" in r.getMessage() and str(part) in r.getMessage()]
    assert len(warned) == 1  # once per snapshot, not once per scan


def test_the_persist_worker_refuses_a_part(parts: list[Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="process 1 of 2's part only"):
        persist(parts[1], str(tmp_path / "root" / "job"))
    assert not (tmp_path / "root" / "job" / "5").exists()
