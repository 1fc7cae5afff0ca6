"""Slice failures raised from inside JAX operations, where a lost Pathways slice shows up, at each phase.

``InJaxFaults`` (trainer_client/runtime/slices/_jax_faults.py) takes a fake slice down *inside* a JAX call — reading
a step's result, a shard's copy into the memory tier, a restore's transfer to the devices, a background
compile — and that call raises ``DATA_LOSS``, as on Pathways. Each run recovers in this process, restores
the right step, and (``pause``) ends bitwise equal to a run without failures.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from examples.elastic_mlp import TrainLog, make_train_fn
from tests.support.elastic_runs import (
    JOB,
    assert_bitwise_equal,
    elastic_runner,
    every_sample_once,
    failure_free_state,
    in_jax_faults,
    run_to_end,
)
from trainer_client.core.protocol import BatchPlan
from trainer_client.runtime.elastic._elastic import Event
from trainer_client.runtime.slices._jax_faults import Fired, InJaxFaults

pytestmark = pytest.mark.needs_devices(8)

STEPS = 40


@pytest.fixture
def faults() -> Iterator[InJaxFaults]:
    yield from in_jax_faults()


@pytest.fixture(scope="module")
def clean_state(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The final state of a run without failures (pause keeps the mesh: every failing run must end on it),
    on the host: arrays alive when a slice is lost are lost with it."""
    return failure_free_state(tmp_path_factory.mktemp("clean"), tmp_path_factory.mktemp("clean-state"), "pause", STEPS)


def _assert_every_sample_once(log: TrainLog) -> None:
    assert every_sample_once(log, STEPS)


@pytest.mark.parametrize("replicas", [True, False], ids=["replicas", "no-replicas"])
def test_a_slice_lost_mid_step(tmp_path: Path, ckptd_server: Any, faults: InJaxFaults, clean_state: Any,
                               replicas: bool) -> None:
    server = ckptd_server(tmp_path)

    def hook(step: int) -> None:
        if step == 25 and not faults.fired:  # the step is dispatched; reading its loss meets the dead slice
            faults.fail_during("to_host", 1, down_for_s=0.5)

    log = TrainLog()
    result = run_to_end(elastic_runner(tmp_path, server.url, "pause", slices=faults.slices, replicas=replicas),
                        make_train_fn(STEPS, log, step_hook=hook))
    assert faults.fired == [Fired("to_host", 1, "MainThread", None)]
    assert result.pid == os.getpid()
    (rec,) = result.recoveries
    # the replicas hold step 25 (its copy was done when the loss was met) or 24 (the copy met it: dropped whole)
    assert (rec.kind, rec.failed_at_step) == ("slice_down", 25)
    if replicas:
        assert rec.restored_step in (24, 25) and rec.restored_from == "replicas"
    else:
        assert rec.restored_step == 20 and rec.restored_from == f"storage: {tmp_path / JOB / '20'}"
    assert rec.lost_steps == 25 - rec.restored_step
    assert_bitwise_equal(clean_state, result.value)
    _assert_every_sample_once(log)


def test_a_slice_lost_mid_snapshot_copy(tmp_path: Path, ckptd_server: Any, faults: InJaxFaults,
                                        clean_state: Any) -> None:
    shm, root = tmp_path / "shm", tmp_path / "root"
    server = ckptd_server(root.mkdir() or root, shm_dir=str(shm), refresh_interval_s=0.2)

    def hook(step: int) -> None:
        if step == 15 and not faults.armed and not faults.fired:  # the save of step 20 copies slice 0's shards
            faults.fail_during("to_host", 0, nth=2, down_for_s=0.5, inside="MemoryTier._write")

    left: list[list[str]] = []

    def on_event(event: Event) -> None:
        if event.kind == "failure_detected":
            left.append([p.name for p in (shm / JOB).iterdir() if ".tmp-" in p.name])

    log = TrainLog()
    runner = elastic_runner(root, server.url, "pause", slices=faults.slices, shm_dir=str(shm), on_event=on_event,
                            replicas=False)  # the shared-memory tier's path
    result = run_to_end(runner, make_train_fn(STEPS, log, step_hook=hook))
    assert faults.fired == [Fired("to_host", 0, "MainThread", "MemoryTier._write")]
    (rec,) = result.recoveries
    assert (rec.failed_at_step, rec.restored_step, rec.lost_steps) == (20, 10, 10)  # step 20 was never saved
    assert left == [[]], "the half-copied snapshot holds shared memory"
    assert_bitwise_equal(clean_state, result.value)
    _assert_every_sample_once(log)


@pytest.mark.parametrize("tier", ["storage", "memory", "replicas"])
def test_a_slice_lost_mid_restore(tmp_path: Path, ckptd_server: Any, faults: InJaxFaults, clean_state: Any,
                                  tier: str) -> None:
    shm, root = tmp_path / "shm", tmp_path / "root"
    shm_dir = str(shm) if tier == "memory" else None
    server = ckptd_server(root.mkdir() or root, shm_dir=shm_dir, refresh_interval_s=0.2)

    def hook(step: int) -> None:
        if step == 25 and not faults.fired:
            faults.fail_during("to_host", 1, down_for_s=0.5)

    def on_event(event: Event) -> None:
        if event.kind == "plan_received" and len(faults.fired) == 1:  # the restore's second array meets it
            faults.fail_during("to_device", 3, nth=2, down_for_s=0.5)

    log = TrainLog()
    runner = elastic_runner(root, server.url, "pause", slices=faults.slices, on_event=on_event, shm_dir=shm_dir,
                            replicas=tier == "replicas")
    result = run_to_end(runner, make_train_fn(STEPS, log, step_hook=hook))
    assert [(f.op, f.slice_index) for f in faults.fired] == [("to_host", 1), ("to_device", 3)]
    first, second = result.recoveries
    step = first.restored_step  # the replicas hold step 24 or 25 (see test_a_slice_lost_mid_step)
    assert first.failed_at_step == 25 and step in ((24, 25) if tier == "replicas" else (20,))
    # the restore met a lost slice: a second event, the same step restored again (from the other replicas)
    assert (second.failed_at_step, second.restored_step, second.lost_steps) == (step, step, 0)
    assert str(second.restored_from).startswith(tier)
    restored = [e for e in result.events if e.kind == "restored"]
    assert len(restored) == 1 and restored[0].fields["tier"] == tier
    assert_bitwise_equal(clean_state, result.value)
    _assert_every_sample_once(log)


def test_a_slice_lost_under_a_background_compile(tmp_path: Path, ckptd_server: Any, faults: InJaxFaults,
                                                 clean_state: Any) -> None:
    server = ckptd_server(tmp_path)
    faults.fail_during("compile", 2, down_for_s=2.0)  # the first compile-ahead of a mesh with slice 2
    log = TrainLog()
    runner = elastic_runner(tmp_path, server.url, "pause", slices=faults.slices)
    result = run_to_end(runner, make_train_fn(STEPS, log))
    assert faults.fired == [Fired("compile", 2, "ckptd-precompile", None)]
    assert ("compile", "ckptd-precompile") in faults.raised
    assert runner.precompiler.failed, "the compile that met the dead slice is recorded, not raised"
    # the training loop met the dead slice on its own (its next transfer, read or step boundary)
    detected = [e.detail for e in result.events if e.kind == "failure_detected"]
    assert len(detected) == 1 and detected[0].startswith("slice(s) [2] down: DATA_LOSS")
    (rec,) = result.recoveries
    assert rec.kind == "slice_down" and rec.restored_step == 10 and result.pid == os.getpid()
    compiled_after = [e for e in result.events if e.kind == "first_step_done"]
    assert len(compiled_after) == 2
    assert_bitwise_equal(clean_state, result.value)
    _assert_every_sample_once(log)


def test_a_compile_that_never_returns_neither_blocks_the_next_attempt_nor_the_end(
    tmp_path: Path, ckptd_server: Any, faults: InJaxFaults
) -> None:
    from examples.elastic_mlp import precompile as compile_step

    server = ckptd_server(tmp_path)
    release = threading.Event()
    timer = threading.Timer(60, release.set)  # the previous code waited for it forever: fail, do not hang
    timer.daemon = True
    timer.start()
    started: list[int] = []  # the attempt of every compile started
    attempt = [0]

    def precompile(mesh: Any, batch: BatchPlan) -> None:
        started.append(attempt[0])
        if attempt[0] == 1:
            release.wait()  # a compile stuck on a dead slice
            return
        compile_step(mesh, batch)

    def hook(step: int) -> None:
        if step == 25 and not faults.fired:
            faults.fail_during("to_host", 1, down_for_s=0.3)
        if attempt[0] == 2 and step == 35:
            runner.precompiler.wait(timeout=120)  # independent of how busy the machine is

    inner = make_train_fn(STEPS, TrainLog(), step_hook=hook, use_precompile=False)

    def train(ctx: Any) -> Any:
        attempt[0] += 1
        ctx.set_precompile(precompile)
        return inner(ctx)

    runner = elastic_runner(tmp_path, server.url, "pause", slices=faults.slices)
    runner.precompiler.join_timeout_s = 1.0
    try:
        result = run_to_end(runner, train)
        stuck = not release.is_set()
    finally:
        release.set()
        timer.cancel()
    assert result.final_step == STEPS - 1 and len(result.recoveries) == 1
    assert stuck, "the run waited for the stuck compile"
    assert started.count(1) == 1, "the first attempt's pass is stuck in its first compile"
    assert started.count(2) >= 4 and len(runner.precompiler.compiled) >= 4, "the second attempt's pass did not run"


def test_pathwaysutils_default_health_check_sees_the_injected_losses(faults: InJaxFaults) -> None:
    """pathwaysutils' own check (a pmap per slice, then block_until_ready) meets the same dead slices."""
    from pathwaysutils.elastic import elastic

    slices = faults.slices
    assert elastic.get_active_slice_indices(slices.slice_to_devices) == {0, 1, 2, 3}
    slices.take_down(1, None)
    assert elastic.get_active_slice_indices(slices.slice_to_devices) == {0, 2, 3}
    slices.bring_back(1)
    assert elastic.get_active_slice_indices(slices.slice_to_devices) == {0, 1, 2, 3}


def test_arrays_of_a_lost_slice_stay_lost_and_new_ones_work(faults: InJaxFaults) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("replica", "data"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("replica"))
    before = jax.device_put(np.arange(8.0), sharding)
    faults.slices.take_down(3, 0.0)  # down, and back at once
    with pytest.raises(jax.errors.JaxRuntimeError, match="DATA_LOSS"):
        np.asarray(before)  # its shard on slice 3 is gone for good
    after = jax.device_put(np.arange(8.0), sharding)
    assert np.asarray(after).tolist() == list(np.arange(8.0))
    faults.slices.take_down(3, None)
    with pytest.raises(jax.errors.JaxRuntimeError, match="DATA_LOSS"):
        jax.device_put(np.arange(8.0), sharding)  # a transfer to a dead slice
    with pytest.raises(jax.errors.JaxRuntimeError, match="DATA_LOSS"):
        jax.block_until_ready(after)
