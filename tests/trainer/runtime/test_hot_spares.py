"""Hot spares: the allocation holds more slices than the mesh uses; a healthy idle slice takes a lost one's place.

Fake slices (4 of 2 CPU devices, ``SimulatedSlices``) with the loss raised from inside JAX (``InJaxFaults``),
a real ckptd. The mesh is (3, 2) on three slices, one slice is a spare (``ElasticOptions(spare_slices=1)``):

- a slice lost mid-step and never back: the spare takes its place at once (same mesh, no resize, no wait —
  pause without a spare would time out), and the run ends bitwise equal to a run without failures;
- the lost slice returns as a spare (no scale-up under ``resize``: the mesh is whole) and takes the next
  loss's place;
- with no healthy spare the policy decides: ``resize`` shrinks to two slices and grows back to three, never
  to the four slices of the allocation.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.advisor._job_history import job_history
from ckptd.events._events import EventStore
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
from tests.support.helpers import wait_until
from trainer_client.core._storage import Storage
from trainer_client.core.protocol import MeshSpec
from trainer_client.runtime.compilation._precompile import likely_next
from trainer_client.runtime.elastic._elastic import ElasticRunner
from trainer_client.runtime.slices._jax_faults import InJaxFaults
from trainer_client.runtime.slices._slice_manager import SliceManager

STEPS = 40
SPARE = {"mesh_shape": (3, 2), "spare_slices": 1}


@pytest.fixture
def faults() -> Iterator[InJaxFaults]:
    yield from in_jax_faults()


@pytest.fixture(scope="module")
def clean_state(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The final state of a run without failures on the (3, 2) mesh (slices 0-2)."""
    return failure_free_state(tmp_path_factory.mktemp("clean"), tmp_path_factory.mktemp("state"), "pause", STEPS,
                              **SPARE)


@pytest.mark.needs_devices(8)
def test_a_spare_takes_the_place_of_a_slice_lost_for_good(tmp_path: Path, ckptd_server: Any, faults: InJaxFaults,
                                                        clean_state: Any) -> None:
    server = ckptd_server(tmp_path)

    def hook(step: int) -> None:
        if step == 25 and not faults.fired:
            faults.fail_during("to_host", 1, down_for_s=None)  # never back: pause alone would time out

    log = TrainLog()
    runner = elastic_runner(tmp_path, server.url, "pause", slices=faults.slices, elastic_timeout_s=20, **SPARE)
    result = run_to_end(runner, make_train_fn(STEPS, log, step_hook=hook))
    assert result.pid == os.getpid()
    (rec,) = result.recoveries
    assert (rec.kind, rec.failed_at_step, rec.restored_from) == ("slice_down", 25, "replicas")
    # the replicas on slices 0 and 2, laid out again with the spare: step 25, or 24 when 25's copy met the loss
    assert rec.restored_step in (24, 25) and rec.lost_steps == 25 - rec.restored_step
    assert rec.mesh_before == rec.mesh_after == [3, 2], "a spare keeps the mesh: no resize"
    assert (rec.slices_before, rec.slices_after, rec.spares_used) == ([0, 1, 2], [0, 2, 3], [3])
    ready = [e.detail for e in result.events if e.kind == "slices_ready"]
    assert ready == ["slices [0, 1, 2], spare(s) [3]", "slices [0, 2, 3], spare(s) []"]
    plans = [e.detail for e in result.events if e.kind == "plan_received"]
    assert "on slices [0, 2, 3]" in plans[-1]
    recovered = next(e for e in result.events if e.kind == "recovered")
    assert recovered.fields["spares_used"] == [3]
    # ckptd stored the events: the advisor's spare policy gets the switch measured, not assumed
    switch = job_history([], EventStore(Storage(str(tmp_path))).load(JOB)).spare_switch_time_s
    assert switch is not None and 0 < switch.value < rec.seconds  # type: ignore[operator]
    assert_bitwise_equal(clean_state, result.value)
    assert every_sample_once(log, STEPS)


@pytest.mark.needs_devices(8)
def test_the_lost_slice_returns_as_a_spare_and_takes_the_next_loss(
    tmp_path: Path, ckptd_server: Any, faults: InJaxFaults, clean_state: Any
) -> None:
    server = ckptd_server(tmp_path)
    runner: ElasticRunner

    def hook(step: int) -> None:
        if step == 12 and not faults.fired:
            faults.fail_during("to_host", 1, down_for_s=None)
        if step == 20 and len(faults.fired) == 1:  # slice 1 is repaired; the monitor sees it idle and healthy
            faults.slices.bring_back(1)
            wait_until(lambda: 1 in runner.manager.available_inactive_slices, what="the monitor to see slice 1")
        if step == 27 and len(faults.fired) == 1:
            faults.fail_during("to_host", 0, down_for_s=None)

    log = TrainLog()
    # resize as the fallback: a slice back while the mesh is whole must not make it grow past three slices
    runner = elastic_runner(tmp_path, server.url, "resize", slices=faults.slices, **SPARE)
    result = run_to_end(runner, make_train_fn(STEPS, log, step_hook=hook))
    first, second = result.recoveries
    assert (first.kind, first.slices_after, first.spares_used) == ("slice_down", [0, 2, 3], [3])
    assert (second.kind, second.slices_before, second.slices_after, second.spares_used) == (
        "slice_down", [0, 2, 3], [1, 2, 3], [1])
    assert all(r.mesh_after == [3, 2] for r in result.recoveries)
    assert not any(e.kind == "scale_up_detected" for e in result.events)
    assert_bitwise_equal(clean_state, result.value)
    assert every_sample_once(log, STEPS)


@pytest.mark.needs_devices(8)
def test_with_no_healthy_spare_resize_shrinks_then_grows_back_to_the_mesh(
    tmp_path: Path, ckptd_server: Any, faults: InJaxFaults
) -> None:
    server = ckptd_server(tmp_path)
    slices = faults.slices
    slices.take_down(3, None)  # the spare is down from the start
    runner: ElasticRunner

    def hook(step: int) -> None:
        if step == 12 and not faults.fired:
            faults.fail_during("to_host", 1, down_for_s=None)
        if step == 22 and 1 not in slices.healthy_now():
            slices.bring_back(1)
            wait_until(lambda: 1 in runner.manager.available_inactive_slices, what="the monitor to see slice 1")

    log = TrainLog()
    runner = elastic_runner(tmp_path, server.url, "resize", slices=slices, **SPARE)
    result = run_to_end(runner, make_train_fn(STEPS, log, step_hook=hook))
    down, up = result.recoveries
    assert (down.kind, down.mesh_after, down.slices_after, down.spares_used) == ("slice_down", [2, 2], [0, 2], [])
    assert (up.kind, up.mesh_after, up.slices_after, up.lost_steps) == ("scale_up", [3, 2], [0, 1, 2], 0)
    assert every_sample_once(log, STEPS)


def test_take_slices_keeps_the_slices_in_use_and_fills_from_the_spares() -> None:
    import jax

    slices = {k: jax.devices()[2 * k: 2 * k + 2] for k in range(4)}
    manager = SliceManager(slices, 1.0, mesh_slices=3)
    manager.active_slice_indices = frozenset(range(4))  # what Manager's wait finds healthy
    assert manager.take_slices() == ({0, 1, 2}, {3})
    assert manager.active_slice_indices == {0, 1, 2} and manager.available_inactive_slices == {3}
    assert manager.slices_to_grow(frozenset({0, 1, 2})) == set()  # a whole mesh: slice 3 is a spare
    manager.active_slice_indices = frozenset({0, 2, 3})  # slice 1 lost
    assert manager.take_slices() == ({0, 2, 3}, set())
    manager.active_slice_indices = frozenset({0, 1, 2, 3})  # slice 1 back: it is the spare now
    assert manager.take_slices() == ({0, 2, 3}, {1})
    manager.active_slice_indices = frozenset({1, 2})  # two lost, nothing to spare: a degraded mesh
    assert manager.take_slices() == ({1, 2}, set())
    manager.available_inactive_slices = frozenset({0, 3})
    assert manager.slices_to_grow(frozenset({1, 2})) == {0, 3}


@pytest.mark.needs_devices(8)
def test_compile_ahead_covers_a_spare_in_place_of_each_slice() -> None:
    import jax

    slices = {k: jax.devices()[2 * k: 2 * k + 2] for k in range(4)}
    mesh = MeshSpec(axis_names=["replica", "data"], shape=[3, 2])
    targets = [(spec.shape, used) for spec, used in likely_next(mesh, frozenset({0, 1, 2}), slices, 3)]
    assert targets[:3] == [([3, 2], [1, 2, 3]), ([3, 2], [0, 2, 3]), ([3, 2], [0, 1, 3])]
    assert [used for _, used in targets[3:]] == [[1, 2], [0, 2], [0, 1]]  # then one slice fewer (no spare left)
