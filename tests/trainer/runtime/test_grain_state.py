"""A Grain iterator's state is saved with every step as the Orbax item ``iter`` in Grain's own format and
given back on resume, so the next batch is exactly the one an uninterrupted iterator gives: through a direct
save, a memory snapshot and its persist by ckptd's worker, a step MaxText wrote (Grain's handler, another
process), and an elastic run that loses a slice and grows back (keep_global_batch), from storage and from
memory. A step ckptd wrote is restored by Grain's own handler too. Bad iterator state is refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from etils import epath
from grain.python import PyGrainCheckpointHandler
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from examples.elastic_mlp import batch_layout, init_state, jitted_step, partition_specs
from tests.support import grain_data
from tests.support.elastic_runs import BATCH, JOB, elastic_runner, run_to_end
from tests.support.helpers import wait_until
from tests.support.orbax_steps import write_maxtext_jobs
from trainer_client.checkpoint_io._iterator_state import ITER_ITEM, MAX_STATE_BYTES
from trainer_client.core import protocol as p
from trainer_client.core._step_plan import plan_for_step
from trainer_client.core._storage import Storage
from trainer_client.core.format._snapshot import SNAPSHOT_META_FILE, problems
from trainer_client.runtime.elastic._elastic import ElasticContext
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.restore import _restore_loop
from trainer_client.runtime.saving._checkpointing import Checkpointer, training_metadata
from trainer_client.runtime.saving._data_iterator import planned_state, restore_iterator, state_record
from trainer_client.runtime.slices._slices import SimulatedSlices, SliceFault

PIPELINES: dict[str, Callable[..., Any]] = {"data_loader": grain_data.data_loader, "dataset": grain_data.dataset}


def _batches(make: Callable[[], Any], start: int, count: int) -> list[np.ndarray]:
    """Batches ``start .. start+count-1`` of an uninterrupted iterator of ``make()``."""
    it = iter(make())
    for _ in range(start):
        next(it)
    return [np.asarray(next(it)) for _ in range(count)]


def _state(mesh: jax.sharding.Mesh) -> Any:
    return {"w": jax.device_put(np.arange(32, dtype=np.float32).reshape(4, 8), NamedSharding(mesh, P(None, "data")))}


def _plan(root: Path, step: int) -> p.ResumePlan:
    return plan_for_step(Storage(str(root)), str(root / "job" / str(step)), p.ResumeRequest(alive_devices=4),
                         job="job", step=step)


@pytest.mark.parametrize("kind", sorted(PIPELINES))
@pytest.mark.needs_devices(8)
def test_the_state_goes_with_a_direct_save_a_snapshot_and_its_persist(tmp_path: Path, kind: str) -> None:
    from ckptd.persist._persist_worker import persist

    make = PIPELINES[kind]
    mesh = jax.make_mesh((4, 2), ("replica", "data"))
    it = iter(make())
    for _ in range(7):
        next(it)
    expected = _batches(make, 7, 3)
    state = _state(mesh)
    meta = training_metadata(7, state, data_position=7 * 16, global_batch=16, mesh=mesh, slices=[0])
    checkpointer = Checkpointer(str(tmp_path / "root" / "job"))
    try:
        checkpointer.save_with_metadata(7, state, meta, data_iterator=state_record(it))
    finally:
        checkpointer.close()
    snapshot = MemoryTier(str(tmp_path / "shm"), "job").save(9, state, meta.model_copy(update={"step": 9}),
                                                              persist=True, data_iterator=state_record(it))
    assert problems(snapshot) == []
    persist(snapshot, str(tmp_path / "root" / "job"))
    # what Grain's own handler writes for this iterator, byte for byte, is what both saves wrote
    grain_dir = tmp_path / "grain"
    grain_dir.mkdir()
    PyGrainCheckpointHandler().save(epath.Path(grain_dir), item=it)
    for step in (7, 9):
        written = (tmp_path / "root" / "job" / str(step) / ITER_ITEM / "process_0-of-1.json").read_text()
        assert written == (grain_dir / "process_0-of-1.json").read_text()
    # each tier gives the next batch back: from storage, from memory, from the persisted step
    for step, plan in ((7, _plan(tmp_path / "root", 7)),
                       (9, _plan(tmp_path / "root", 7).model_copy(update={"tier": "memory", "path": str(snapshot),
                                                                          "step": 9})),
                       (9, _plan(tmp_path / "root", 9))):
        fresh = iter(make())
        assert restore_iterator(plan, fresh) and step == plan.step
        assert all(np.array_equal(next(fresh), batch) for batch in expected)
    # Grain's own handler restores the step ckptd's worker persisted
    fresh = iter(make())
    PyGrainCheckpointHandler().restore(epath.Path(tmp_path / "root" / "job" / "9" / ITER_ITEM), item=fresh)
    assert np.array_equal(next(fresh), expected[0])


def test_a_maxtext_step_resumes_its_grain_iterator_exactly(tmp_path: Path) -> None:
    """MaxText's iterator state, written by Grain's handler in another process after 20 batches of 16."""
    job = tmp_path / "run" / "checkpoints"
    write_maxtext_jobs({job: [20]}, batch=16, period=20)
    plan = plan_for_step(Storage(str(tmp_path / "run")), str(job / "20"), p.ResumeRequest(alive_devices=6),
                         job="checkpoints", step=20)
    fresh = iter(grain_data.data_loader(16))
    assert restore_iterator(plan, fresh)
    expected = _batches(lambda: grain_data.data_loader(16), 20, 2)
    assert all(np.array_equal(next(fresh), batch) for batch in expected)


@pytest.mark.needs_devices(8)
def test_a_step_without_iterator_state_leaves_the_iterator_and_bad_state_is_refused(tmp_path: Path) -> None:
    mesh = jax.make_mesh((4, 2), ("replica", "data"))
    state = _state(mesh)
    checkpointer = Checkpointer(str(tmp_path / "root" / "job"))
    try:
        checkpointer.save(3, state, data_position=0, global_batch=16, mesh=mesh, slices=[0])
        it = iter(grain_data.dataset())
        next(it)
        checkpointer.save(4, state, data_position=16, global_batch=16, mesh=mesh, slices=[0],
                          data_iterator=state_record(it))
    finally:
        checkpointer.close()
    untouched = iter(grain_data.dataset())
    assert not restore_iterator(_plan(tmp_path / "root", 3), untouched)
    assert np.array_equal(next(untouched), _batches(grain_data.dataset, 0, 1)[0])
    iter_dir = tmp_path / "root" / "job" / "4" / ITER_ITEM
    state_file = iter_dir / "process_0-of-1.json"
    plan = _plan(tmp_path / "root", 4)
    state_file.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        planned_state(plan)
    state_file.write_bytes(b" " * (MAX_STATE_BYTES + 1))
    with pytest.raises(ValueError, match="bytes of iterator state"):
        planned_state(plan)
    state_file.rename(iter_dir / "process_0-of-2.json")  # saved by two processes: none for this one
    with pytest.raises(ValueError, match="no iterator state for process 0 of 1"):
        planned_state(plan)
    # a snapshot recording another process's state (or nonsense) is not whole
    snapshot = MemoryTier(str(tmp_path / "shm"), "job").save(
        5, state, training_metadata(5, state, data_position=0, global_batch=16, mesh=mesh, slices=[0]),
        persist=False, data_iterator=state_record(it))
    meta = json.loads((snapshot / SNAPSHOT_META_FILE).read_text())
    meta["data_iterator"]["process_index"] = 3
    (snapshot / SNAPSHOT_META_FILE).write_text(json.dumps(meta))
    assert any(SNAPSHOT_META_FILE in problem for problem in problems(snapshot))


def _grain_train_fn(total: int, make: Callable[[], Any], seen: dict[int, np.ndarray],
                    step_hook: Callable[[int], None]) -> Callable[[ElasticContext], Any]:
    """The demo MLP trained on the sample indices a Grain pipeline gives (its batch is the global batch): a
    fresh iterator each attempt, restored to the step's state by ``restore_or_init``."""

    def train(ctx: ElasticContext) -> Any:
        it = iter(make())
        state, step, position = ctx.restore_or_init(init_state, partition_specs, data_iterator=it)
        plan = ctx.batch
        shape, sharding = batch_layout(ctx.mesh, plan)
        step_fn = jitted_step(plan.accumulation_steps, plan.lr_scale)
        while step < total:
            ctx.step_boundary(step, state, position)
            step_hook(step)
            ids = np.asarray(next(it), dtype=np.int32)
            seen[step] = ids
            state, _ = step_fn(state, jax.device_put(ids.reshape(shape), sharding))
            position += ids.size
            step += 1
        ctx.save(step, state, position)
        return state

    return train


@pytest.mark.parametrize("tier", ["storage", "memory", "memory_evicted", "replicas"])
@pytest.mark.needs_devices(8)
def test_an_elastic_run_reads_every_batch_an_uninterrupted_iterator_gives(
    tmp_path: Path, ckptd_server: Any, tier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slice 1 is lost at step 13 (restored at step 10: storage, or 10 from memory) and comes back at step 22:
    the run shrinks to 3 slices keeping the global batch (2 microbatches of 24), grows back to 4 (when the
    monitor sees the slice in time), and the batches of the trajectory that survived are exactly those of an
    uninterrupted iterator. ``memory_evicted``: ckptd evicts the snapshot just after the restore mapped its
    arrays (its snapshot.json is gone): the iterator's state was read before, so the resume still holds.
    ``replicas``: the state and the iterator's come back from the replica snapshots in host memory (step 13, or
    12 when 13's copy met the loss); the other variants run without that tier."""
    if tier == "memory_evicted":
        tier = "memory"
        restore, evicted = _restore_loop.restore_snapshot, []

        def restore_then_evict(path: str, target: Any) -> Any:
            arrays = restore(path, target)
            if not evicted:  # the first resume's snapshot (the regrow's must still be persisted, below)
                evicted.append(path)
                (Path(path) / SNAPSHOT_META_FILE).unlink()
            return arrays

        monkeypatch.setattr(_restore_loop, "restore_snapshot", restore_then_evict)
    kind = "data_loader" if tier in ("storage", "replicas") else "dataset"

    def make() -> Any:
        return PIPELINES[kind](BATCH, tokens=False)

    shm = tmp_path / "shm"
    extra: dict[str, Any] = {"shm_dir": str(shm), "memory_period": 5, "max_snapshots": 4} if tier == "memory" else {}
    server = ckptd_server(tmp_path, refresh_interval_s=0.2, **({"shm_dir": str(shm)} if tier == "memory" else {}))
    runner = elastic_runner(tmp_path, server.url, "resize", [SliceFault(1, at_step=13, down_for_s=None)],
                            batch_mode="keep_global_batch", replicas=tier == "replicas", **extra)
    slices = runner.slices
    assert isinstance(slices, SimulatedSlices)

    def hook(step: int) -> None:
        if step == 22:
            slices.bring_back(1)

    seen: dict[int, np.ndarray] = {}
    result = run_to_end(runner, _grain_train_fn(40, make, seen, hook))
    down, *rest = result.recoveries
    assert down.restored_step in ((12, 13) if tier == "replicas" else (10,)) and down.mesh_after == [3, 2]
    if rest:  # grown back when pathwaysutils' monitor saw the slice before step 40 (steps take milliseconds)
        assert (rest[0].kind, rest[0].mesh_after) == ("scale_up", [4, 2])
    restored = [e.detail for e in result.events if e.kind == "restored"]
    assert len(restored) == 1 + len(rest) and all("data iterator restored" in d for d in restored), restored
    assert f"from {tier}" in restored[0], restored  # (the regrow's save may go to storage: a full memory tier)
    expected = _batches(make, 0, 40)
    for step in range(40):
        assert np.array_equal(seen[step], expected[step]), f"step {step} read another batch"
    ids = np.concatenate([seen[s] for s in range(40)])
    assert len(set(ids.tolist())) == ids.size == 40 * BATCH  # no sample twice
    # the saved steps hold Grain's file: written by the trainer, or from memory by ckptd's persist worker (the run's
    # last persistent save, 40: the ones before it may have been superseded while an earlier persist still ran,
    # docs/operations.md, "Persists that fall behind"; never the newest)
    step = 40
    state_file = tmp_path / JOB / str(step) / ITER_ITEM / "process_0-of-1.json"
    wait_until(state_file.exists, timeout=90, what=f"step {step} on storage")
    fresh = iter(make())
    for _ in range(step):
        next(fresh)
    want = fresh.get_state()
    assert json.loads(state_file.read_text()) == (json.loads(want) if isinstance(want, bytes) else want)


@pytest.mark.needs_devices(8)
def test_an_elastic_iterator_resumes_at_its_global_index_with_another_batch_or_shard_count(tmp_path: Path) -> None:
    """Grain's ElasticIterator (for a global batch that changes, or another process count): the state saved
    after 10 batches of 48 resumes at sample 480 with a global batch of 36, and on 2 shards, which read the
    next 48 samples between them."""
    mesh = jax.make_mesh((4, 2), ("replica", "data"))
    saved = iter(grain_data.elastic(48))
    for _ in range(10):
        next(saved)
    checkpointer = Checkpointer(str(tmp_path / "root" / "job"))
    try:
        checkpointer.save(10, _state(mesh), data_position=480, global_batch=48, mesh=mesh, slices=[0],
                          data_iterator=state_record(saved))
    finally:
        checkpointer.close()
    plan = _plan(tmp_path / "root", 10)
    samples = grain_data.samples()  # the shuffled samples the iterators slice
    smaller = iter(grain_data.elastic(36))
    assert restore_iterator(plan, smaller)
    assert np.array_equal(next(smaller), np.stack([samples[i] for i in range(480, 516)]))
    shards = [iter(grain_data.elastic(48, shard_index=k, shard_count=2)) for k in range(2)]
    assert all(restore_iterator(plan, shard) for shard in shards)
    both = np.concatenate([next(shard) for shard in shards])
    assert sorted(map(tuple, both.tolist())) == sorted(tuple(samples[i].tolist()) for i in range(480, 528))
