"""The elastic runner with the replica snapshot tier, where it must not be used or must be used exactly.

- A slice lost while a snapshot's copy is dispatched: the copy is dropped whole, the step before is restored
  from the replicas, and its values are exactly that step's — never a mix of two steps.
- Two slices lost with two replicas (each replica on two slices, one slice of each lost): no whole replica
  survives, ckptd plans from storage, and the run goes on from there.
- The same loss under ``pause``: the slices come back, but the runner does not offer ckptd copies on slices
  that were lost (their host memory may be gone): storage, bitwise as a failure-free run.
- Copies that do not read back although ckptd planned from them: the runner finds no whole replica, says so
  (``replicas_unusable``), asks ckptd again without the tier and resumes from storage.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from examples.elastic_mlp import TrainLog, init_state, make_train_fn, partition_specs
from tests.support.elastic_runs import (
    BATCH,
    JOB,
    assert_bitwise_equal,
    elastic_runner,
    every_sample_once,
    failure_free_state,
    in_jax_faults,
    leaves,
    run_to_end,
)
from trainer_client.errors import MemoryTierFull
from trainer_client.runtime.elastic._elastic import ElasticContext, Event
from trainer_client.runtime.memory._memory_spare import snapshot_bytes
from trainer_client.runtime.replicas import _replica_leaves
from trainer_client.runtime.replicas._options import ReplicaOptions
from trainer_client.runtime.replicas._replica_tier import required_bytes
from trainer_client.runtime.slices._jax_faults import InJaxFaults
from trainer_client.runtime.slices._slices import SliceFault

pytestmark = pytest.mark.needs_devices(8)

STEPS = 40
TWO_REPLICAS = {"mesh_shape": (2, 4)}  # replica 0 on slices 0 and 1, replica 1 on slices 2 and 3


@pytest.fixture
def faults() -> Iterator[InJaxFaults]:
    yield from in_jax_faults()


def _capturing(inner: Callable[[ElasticContext], Any], seen: dict[int, list[np.ndarray]],
               restored: list[tuple[int, list[np.ndarray]]]) -> Callable[[ElasticContext], Any]:
    """``inner`` with the first attempt's state at every step boundary kept in ``seen``, and each later
    attempt's restored state in ``restored``."""
    attempts = [0]

    def train(ctx: ElasticContext) -> Any:
        attempts[0] += 1
        original_restore, original_boundary = ctx.restore_or_init, ctx.step_boundary

        def restore(init_fn: Callable[[], Any], specs_fn: Callable[[Any], Any], **kw: Any) -> tuple[Any, int, int]:
            state, step, position = original_restore(init_fn, specs_fn, **kw)
            if attempts[0] > 1:
                restored.append((step, leaves(state)))
            return state, step, position

        def boundary(step: int, state: Any, position: int) -> None:
            if attempts[0] == 1:
                seen[step] = leaves(state)
            original_boundary(step, state, position)

        ctx.restore_or_init = restore  # type: ignore[method-assign]
        ctx.step_boundary = boundary  # type: ignore[method-assign]
        return inner(ctx)

    return train


def test_a_slice_lost_during_the_copy_restores_the_step_before_exactly(
        tmp_path: Path, ckptd_server: Any, faults: InJaxFaults) -> None:
    server = ckptd_server(tmp_path)

    def hook(step: int) -> None:
        if step == 24 and not faults.armed and not faults.fired:  # step 25's snapshot copies onto slice 1
            # the copy to the host is the worker's, from the staged on-device copy: step 24's is let finish first
            assert runner.replicas is not None and runner.replicas.tier is not None and runner.replicas.tier.wait(30)
            faults.fail_during("to_device", 1, down_for_s=0.5, inside="ReplicaTier._complete")

    seen: dict[int, list[np.ndarray]] = {}
    restored: list[tuple[int, list[np.ndarray]]] = []
    log = TrainLog()
    runner = elastic_runner(tmp_path, server.url, "resize", slices=faults.slices)
    result = run_to_end(runner, _capturing(make_train_fn(STEPS, log, step_hook=hook), seen, restored))
    assert [(f.op, f.slice_index, f.inside) for f in faults.fired] == [("to_device", 1, "ReplicaTier._complete")]
    down = result.recoveries[0]
    # the copy fails beside the loop: the loss is seen by step 25's work or by the next boundary's
    assert down.failed_at_step in (25, 26)
    assert (down.restored_step, down.lost_steps, down.restored_from) == (24, down.failed_at_step - 24, "replicas")
    step, values = restored[0]
    assert step == 24
    for want, got in zip(seen[24], values, strict=True):
        assert np.array_equal(want, got), "the restored state is not step 24's"
    assert every_sample_once(log, STEPS) and result.pid == os.getpid()


def test_two_slices_lost_with_two_replicas_resume_from_storage(tmp_path: Path, ckptd_server: Any) -> None:
    server = ckptd_server(tmp_path)
    seen: dict[int, list[np.ndarray]] = {}
    restored: list[tuple[int, list[np.ndarray]]] = []
    log = TrainLog()
    lost = [SliceFault(1, at_step=25, down_for_s=None), SliceFault(2, at_step=25, down_for_s=None)]
    runner = elastic_runner(tmp_path, server.url, "resize", lost, **TWO_REPLICAS)
    result = run_to_end(runner, _capturing(make_train_fn(STEPS, log), seen, restored))
    (down,) = result.recoveries
    assert (down.failed_at_step, down.restored_step, down.mesh_after) == (25, 20, [1, 4])
    assert down.restored_from == f"storage: {tmp_path / JOB / '20'}"
    assert all(e.fields.get("tier") != "replicas" for e in result.events if e.kind == "restored")
    for want, got in zip(seen[20], restored[0][1], strict=True):
        assert np.array_equal(want, got)
    assert every_sample_once(log, STEPS)


@pytest.fixture(scope="module")
def clean_two_replicas(tmp_path_factory: pytest.TempPathFactory) -> list[np.ndarray]:
    return failure_free_state(tmp_path_factory.mktemp("clean"), tmp_path_factory.mktemp("clean-state"), "pause",
                              STEPS, **TWO_REPLICAS)


def _lose_two_under_pause(root: Path, url: str) -> tuple[Any, TrainLog]:
    lost = [SliceFault(1, at_step=25, down_for_s=0.3), SliceFault(2, at_step=25, down_for_s=0.3)]
    log = TrainLog()
    return run_to_end(elastic_runner(root, url, "pause", lost, **TWO_REPLICAS), make_train_fn(STEPS, log)), log


def test_replicas_on_slices_that_were_lost_are_not_offered(tmp_path: Path, ckptd_server: Any,
                                                           clean_two_replicas: list[np.ndarray]) -> None:
    result, log = _lose_two_under_pause(tmp_path, ckptd_server(tmp_path).url)
    (down,) = result.recoveries
    plans = [e for e in result.events if e.kind == "plan_received"]
    assert "tier storage" in plans[0].detail  # every slice is back, yet no replica was offered whole
    assert (down.restored_step, down.restored_from) == (20, f"storage: {tmp_path / JOB / '20'}")
    assert not [e for e in result.events if e.kind == "replicas_unusable"]
    assert_bitwise_equal(clean_two_replicas, result.value)
    assert every_sample_once(log, STEPS)


def test_replicas_that_do_not_read_back_fall_back_and_say_so(
        tmp_path: Path, ckptd_server: Any, clean_two_replicas: list[np.ndarray],
        monkeypatch: pytest.MonkeyPatch) -> None:
    server = ckptd_server(tmp_path)
    runner = elastic_runner(tmp_path, server.url, "pause", [SliceFault(3, at_step=25, down_for_s=0.3)],
                            **TWO_REPLICAS)
    real = _replica_leaves.readable
    monkeypatch.setattr(_replica_leaves, "readable", lambda x: False)  # e.g. host memory gone under the tier
    try:
        log = TrainLog()
        result = run_to_end(runner, make_train_fn(STEPS, log))
    finally:
        monkeypatch.setattr(_replica_leaves, "readable", real)
    (down,) = result.recoveries
    plans = [e for e in result.events if e.kind == "plan_received"]
    # ckptd planned from replica 0 (slices 0 and 1: not lost), which did not read back; then storage
    assert "tier replicas" in plans[0].detail and "tier storage" in plans[1].detail
    (unusable,) = [e for e in result.events if e.kind == "replicas_unusable"]
    # the step held then (a snapshot is skipped while the previous copy is still in flight)
    assert "NoWholeReplica" in unusable.detail and unusable.step is not None and 20 < unusable.step <= 25
    assert (down.restored_step, down.restored_from) == (20, f"storage: {tmp_path / JOB / '20'}")
    assert_bitwise_equal(clean_two_replicas, result.value)
    assert every_sample_once(log, STEPS)


def test_a_host_that_cannot_hold_the_tier_trains_on_without_it(tmp_path: Path, ckptd_server: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    server = ckptd_server(tmp_path)
    monkeypatch.setattr(_replica_leaves, "host_memory_free", lambda: 1024)  # the default budget: too small
    runner = elastic_runner(tmp_path, server.url, "resize", [SliceFault(1, at_step=15, down_for_s=None)])
    result = run_to_end(runner, make_train_fn(20, TrainLog()))
    (off,) = [e for e in result.events if e.kind == "replicas_off"]
    assert "MiB of host memory" in off.detail and "budget is 0.0 MiB" in off.detail
    assert result.final_step == 19 and result.recoveries[0].restored_from == f"storage: {tmp_path / JOB / '10'}"


def test_a_budget_set_too_small_stops_the_run_with_the_sizes(tmp_path: Path, ckptd_server: Any) -> None:
    server = ckptd_server(tmp_path)
    runner = elastic_runner(tmp_path, server.url, "resize", replicas=ReplicaOptions(host_budget_bytes=1024))
    with pytest.raises(MemoryTierFull, match=r"the replica snapshot tier needs .* MiB of host memory"):
        run_to_end(runner, make_train_fn(5, TrainLog()))


@pytest.mark.parametrize("staging", [False, True])
def test_the_host_pages_are_touched_before_the_first_snapshot(tmp_path: Path, ckptd_server: Any,
                                                              staging: bool) -> None:
    """Both host-memory tiers, before an attempt's first step: the replica tier's pinned pages for two copies
    when its copies read the state directly (the step waits for them: their first-time costs would be the
    loop's), none when they read an on-device copy (they run beside the loop); and the shared-memory tier's
    first save's file (allocated and touched, in the background)."""
    shm = tmp_path / "shm"
    server = ckptd_server(tmp_path, shm_dir=str(shm))
    runner = elastic_runner(tmp_path, server.url, "resize", shm_dir=str(shm), memory_period=5,
                            replicas=ReplicaOptions(period=1, when_busy="wait", staging=staging))
    reserved: list[tuple[int, int]] = []

    def train(ctx: ElasticContext) -> Any:
        state, step, position = ctx.restore_or_init(init_state, partition_specs)
        replicas, memory = runner.replicas, runner.saver.memory
        assert replicas is not None and replicas.tier is not None and memory is not None
        reserved.append((replicas.tier.reserved_bytes, required_bytes(state)))
        memory.wait_spare()
        spare = shm / JOB / f".spare-{os.getpid()}"
        reserved.append((spare.stat().st_size, snapshot_bytes(state)))
        ctx.step_boundary(step, state, position)  # the first snapshot takes the pinned pages over
        reserved.append((replicas.tier.reserved_bytes, 0))
        return state

    run_to_end(runner, train)
    (touched, need), (spare_size, snapshot_size), (after, _) = reserved
    assert need > 0 and touched == (0 if staging else need) and after == 0
    assert spare_size >= snapshot_size > 0


def test_a_loss_before_the_first_checkpoint_resumes_from_the_replicas(tmp_path: Path, ckptd_server: Any) -> None:
    """Nothing on storage or in shared memory yet: the replicas' own training metadata lays them out (before,
    the run started again from step 0)."""
    server = ckptd_server(tmp_path)
    log = TrainLog()
    told: list[Any] = []

    def on_event(event: Event) -> None:  # right after the restore: what a next resume request would say
        if event.kind == "restored" and runner.replicas is not None:
            told.append(runner.replicas.wire())

    runner = elastic_runner(tmp_path, server.url, "resize", [SliceFault(2, at_step=6, down_for_s=None)],
                            on_event=on_event)
    result = run_to_end(runner, make_train_fn(15, log))
    (down,) = result.recoveries
    assert (down.failed_at_step, down.restored_from, down.mesh_after) == (6, "replicas", [3, 2])
    assert down.restored_step in (5, 6) and down.lost_steps == 6 - down.restored_step
    plans = [e for e in result.events if e.kind == "plan_received"]
    assert plans and "tier replicas" in plans[0].detail and f"data position {down.restored_step * BATCH}" in \
        plans[0].detail
    (held,) = told  # the restored step, with the layout it has now
    assert held.step == down.restored_step and held.training is not None
    assert held.training.mesh.shape == [3, 2] and held.slices == [[0], [1], [3]]
    assert every_sample_once(log, 15)


def test_replicas_that_do_not_read_back_with_nothing_saved_start_afresh(
        tmp_path: Path, ckptd_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    server = ckptd_server(tmp_path)
    runner = elastic_runner(tmp_path, server.url, "resize", [SliceFault(2, at_step=6, down_for_s=None)])
    monkeypatch.setattr(_replica_leaves, "readable", lambda x: False)
    log = TrainLog()
    result = run_to_end(runner, make_train_fn(12, log))
    kinds = [e.kind for e in result.events]
    assert kinds.count("initialized") == 2 and "replicas_unusable" in kinds  # nothing else held a step
    (down,) = result.recoveries
    assert (down.restored_step, down.restored_from, result.final_step) == (0, None, 11)
    assert every_sample_once(log, 12)
