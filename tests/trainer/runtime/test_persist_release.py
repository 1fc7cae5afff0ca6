"""The persist worker frees what a persist made from the snapshot's map — the jax arrays that view it, and so
the map itself — when the persist is done: before ``persist`` returns, or, for a request ``handle`` answers
(the ``--serve`` worker), right after the answer (``release_arrays``), never inside the next persist. Left to
jax, those views were freed lazily and the unmap of the previous snapshot landed in the next persist's start
(docs/benchmarks.md, "What holds the persist gap")."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptd.persist._persist_worker as worker
from trainer_client.core.format._files import SNAPSHOT_DATA_FILE
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.saving._checkpointing import training_metadata


def _snapshot(tmp_path: Path, step: int) -> Path:
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    sharding = NamedSharding(mesh, P("data", None))
    state = {"w": jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step, sharding),
             "b": jax.device_put(np.ones((8, 4), np.float32) * step, sharding)}
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700, exist_ok=True)
    meta = training_metadata(step, state, data_position=step * 8, global_batch=8, mesh=mesh, slices=[0])
    return Path(MemoryTier(str(shm), "job", max_snapshots=4, preallocate=False).save(step, state, meta, persist=True))


def _mapped(snapshot: Path) -> bool:
    """Whether this process maps the snapshot's data file."""
    data = str((snapshot / SNAPSHOT_DATA_FILE).resolve())
    return any(line.endswith(data) or line.endswith(data + " (deleted)")
               for line in Path("/proc/self/maps").read_text().splitlines())


def test_persist_frees_the_snapshots_map_before_it_returns(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path, 5)
    url = worker.persist(snapshot, str(tmp_path / "root" / "job"))
    assert url.endswith("/5") and (tmp_path / "root" / "job" / "5").is_dir()
    assert not worker._unreleased
    assert not _mapped(snapshot)


def test_a_served_request_leaves_its_arrays_for_after_the_answer_and_no_longer(tmp_path: Path) -> None:
    first, second = _snapshot(tmp_path, 5), _snapshot(tmp_path, 10)
    answer = worker.handle({"snapshot": str(first), "job_url": str(tmp_path / "root" / "job")})
    assert answer["ok"], answer
    held = list(worker._unreleased)
    assert held and not any(arr.is_deleted() for arr in held)  # the answer did not wait for the unmap
    assert _mapped(first)

    worker.release_arrays()  # what serve does once the answer is written
    assert not worker._unreleased and all(arr.is_deleted() for arr in held)
    assert not _mapped(first)

    # a caller that never releases holds one persist's arrays at most: the next request frees them first
    assert worker.handle({"snapshot": str(second), "job_url": str(tmp_path / "root" / "job")})["ok"]
    held = list(worker._unreleased)
    assert worker.handle({"snapshot": str(first), "job_url": str(tmp_path / "root" / "other")})["ok"]
    assert all(arr.is_deleted() for arr in held) and not _mapped(second)
    worker.release_arrays()
    assert not _mapped(first)
