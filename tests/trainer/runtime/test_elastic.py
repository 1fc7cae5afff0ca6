"""The elastic runner on fake slices, against a real ckptd server and real Orbax checkpoints.

(a) ``pause``: a run that loses a slice ends bitwise equal to a run without failures;
(b) ``resize``: training continues on the smaller mesh from exactly the restored values, and grows back
    without losing a step when the slice returns; plus retries, error propagation and the fallback.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from examples.elastic_mlp import TrainLog, init_state, make_train_fn, partition_specs, train_step
from tests.support.elastic_runs import BATCH, JOB, elastic_runner, leaves, run_to_end
from tests.support.helpers import wait_until
from tests.support.server import start_server
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.errors import ElasticRetriesExhausted
from trainer_client.runtime.elastic._elastic import ElasticContext, ElasticRunner
from trainer_client.runtime.memory._memory_tier import MemoryTier, MemoryTierFull
from trainer_client.runtime.slices._slices import SimulatedSlices, SliceFault


def _runner(root: Path, url: str, policy: str, faults: list[SliceFault], **config: Any) -> ElasticRunner:
    return elastic_runner(root, url, policy, faults, **config)


_run = run_to_end
_leaves = leaves


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[np.ndarray]]:
    """A pause run of 40 steps without failures, against a ckptd of its own: its process and final state (on the
    host), which every pause run below that loses a slice must end on (read only)."""
    root = tmp_path_factory.mktemp("clean")
    server = start_server(root, tmp_path_factory.mktemp("clean-state"))
    try:
        result = _run(_runner(root, server.url, "pause", []), make_train_fn(40, TrainLog()))
    finally:
        server.stop()
    return result.pid, _leaves(result.value)


@pytest.mark.parametrize("replicas", [True, False], ids=["replicas", "no-replicas"])
@pytest.mark.needs_devices(8)
def test_pause_policy_is_bitwise_equal_to_a_run_without_failures(tmp_path: Path, ckptd_server: Any,
                                                                 clean: tuple[int, list[np.ndarray]],
                                                                 replicas: bool) -> None:
    clean_pid, clean_state = clean
    failing_root = tmp_path / "failing"
    failing_server = ckptd_server(failing_root.mkdir() or failing_root)
    log = TrainLog()
    failed = _run(
        _runner(failing_root, failing_server.url, "pause", [SliceFault(1, at_step=25, down_for_s=0.5)],
                replicas=replicas),
        make_train_fn(40, log),
    )

    assert failed.pid == clean_pid == os.getpid()
    assert len(failed.recoveries) == 1
    rec = failed.recoveries[0]
    assert (rec.kind, rec.failed_at_step) == ("slice_down", 25)
    if replicas:  # step 25's copy was done when the slice went (25), or met the loss and was dropped whole (24)
        assert rec.restored_step in (24, 25) and rec.restored_from == "replicas"
    else:
        assert rec.restored_step == 20 and rec.restored_from == f"storage: {failing_root / JOB / '20'}"
    assert rec.lost_steps == 25 - rec.restored_step
    assert rec.mesh_before == rec.mesh_after == [4, 2]
    kinds = [e.kind for e in failed.events]
    assert kinds.index("failure_detected") < kinds.index("plan_received") < kinds.index("restored")
    # pause planned only once every slice was back (whether it had to wait depends on the machine's speed)
    after = next(e for e in failed.events[kinds.index("failure_detected"):] if e.kind == "slices_ready")
    assert after.detail == "slices [0, 1, 2, 3]"
    for a, b in zip(clean_state, _leaves(failed.value), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b), "pause run diverged from the failure-free run"
    assert log.losses[39] < log.losses[0]


@pytest.mark.needs_devices(8)
def test_resize_continues_from_the_restored_values_then_grows_back(tmp_path: Path, ckptd_server: Any) -> None:
    server = ckptd_server(tmp_path)
    log = TrainLog()
    seen: dict[int, list[np.ndarray]] = {}  # the first attempt's state at each step boundary
    attempts: list[dict[str, Any]] = []
    inner = make_train_fn(60, log)

    def train(ctx: ElasticContext) -> Any:
        original = ctx.restore_or_init

        def capture(init_fn: Callable[[], Any], specs_fn: Callable[[Any], Any]) -> tuple[Any, int, int]:
            state, step, position = original(init_fn, specs_fn)
            attempts.append({"mesh": list(ctx.mesh.devices.shape), "step": step, "position": position,
                             "values": _leaves(state)})
            return state, step, position

        ctx.restore_or_init = capture  # type: ignore[method-assign]
        original_boundary = ctx.step_boundary

        def boundary(step: int, state: Any, position: int) -> None:
            if len(attempts) == 1:
                seen[step] = _leaves(state)
            original_boundary(step, state, position)

        ctx.step_boundary = boundary  # type: ignore[method-assign]
        return inner(ctx)

    # Slice 3 dies at step 25 and stays down for a while; training goes on on 3 slices meanwhile.
    result = _run(_runner(tmp_path, server.url, "resize", [SliceFault(3, at_step=25, down_for_s=4.0)]), train)

    assert result.pid == os.getpid()
    assert [a["mesh"] for a in attempts[:2]] == [[4, 2], [3, 2]]
    resized = attempts[1]
    # from the replicas on the slices left: step 25 (its copy was done) or 24 (the copy met the loss)
    step = resized["step"]
    assert step in (24, 25) and resized["position"] == step * BATCH
    for saved, restored in zip(seen[step], resized["values"], strict=True):
        assert np.array_equal(saved, restored), f"resize did not restore the exact values of step {step}"

    down, *rest = result.recoveries
    assert (down.kind, down.restored_step, down.lost_steps, down.mesh_after) == ("slice_down", step, 25 - step,
                                                                                 [3, 2])
    assert down.restored_from == "replicas"
    if rest:  # the slice came back before step 60: grown back from a fresh checkpoint, nothing lost
        up = rest[0]
        assert up.kind == "scale_up" and up.mesh_after == [4, 2]
        assert up.lost_steps == 0 and up.restored_step == up.failed_at_step
    # the surviving trajectory read every sample once, in order
    for step in range(60):
        assert log.samples[step] == (step * BATCH, (step + 1) * BATCH)
    assert log.losses[59] < log.losses[0]


@pytest.mark.needs_devices(8)
def test_scale_up_restores_the_state_it_saved(tmp_path: Path, ckptd_server: Any) -> None:
    server = ckptd_server(tmp_path)
    runner = _runner(tmp_path, server.url, "resize", [SliceFault(0, at_step=12, down_for_s=None)])
    slices = runner.slices
    assert isinstance(slices, SimulatedSlices)

    def hook(step: int) -> None:
        if step == 17:  # the replacement slice is healthy from now on; pathwaysutils' monitor notices it
            slices.bring_back(0)
            wait_until(lambda: 0 in runner.manager.available_inactive_slices, what="the monitor to see slice 0")

    log = TrainLog()
    result = _run(runner, make_train_fn(30, log, step_hook=hook))
    down, up = result.recoveries
    assert (down.kind, down.mesh_after, down.restored_from) == ("slice_down", [3, 2], "replicas")
    assert down.restored_step in (11, 12)  # the replicas of step 12, or of 11 when 12's copy met the loss
    assert (up.kind, up.mesh_before, up.mesh_after) == ("scale_up", [3, 2], [4, 2])
    assert up.failed_at_step == 18 and up.restored_step == 18 and up.lost_steps == 0
    assert up.restored_from == "replicas"  # grown onto 4 slices from the 3 replicas held in host memory
    assert result.final_step == 29
    assert [log.samples[s] for s in range(30)] == [(s * BATCH, (s + 1) * BATCH) for s in range(30)]


@pytest.mark.needs_devices(8)
def test_scale_up_with_a_full_memory_tier_saves_its_step_to_storage(
    tmp_path: Path, ckptd_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step a regrow starts from must exist somewhere: when the memory tier has no room for the scale-up's
    memory snapshot, it is saved to storage instead (else the next attempt restored an older step)."""
    shm = tmp_path / "shm"
    server = ckptd_server(tmp_path, shm_dir=str(shm))
    original = MemoryTier.save

    def full_for_memory_only(self: MemoryTier, step: int, state: Any, meta: Any, *, persist: bool,
                             **kwargs: Any) -> Any:
        if not persist:
            raise MemoryTierFull("no room (test)")
        return original(self, step, state, meta, persist=persist, **kwargs)

    monkeypatch.setattr(MemoryTier, "save", full_for_memory_only)
    runner = _runner(tmp_path, server.url, "resize", [SliceFault(0, at_step=12, down_for_s=None)], shm_dir=str(shm))
    slices = runner.slices
    assert isinstance(slices, SimulatedSlices)

    brought_back: list[int] = []

    def hook(step: int) -> None:
        if step == 17 and not brought_back:  # once: a regrow from an older step passes step 17 again
            brought_back.append(step)
            slices.bring_back(0)
            wait_until(lambda: 0 in runner.manager.available_inactive_slices, what="the monitor to see slice 0")

    log = TrainLog()
    result = _run(runner, make_train_fn(30, log, step_hook=hook))
    up = result.recoveries[-1]
    assert up.kind == "scale_up" and up.failed_at_step == 18
    assert up.restored_step == 18 and up.lost_steps == 0
    assert [log.samples[s] for s in range(30)] == [(s * BATCH, (s + 1) * BATCH) for s in range(30)]


@pytest.mark.needs_devices(8)
def test_too_many_failures_exhaust_the_retries(tmp_path: Path, ckptd_server: Any) -> None:
    server = ckptd_server(tmp_path)
    faults = [SliceFault(1, at_step=5, down_for_s=0.5), SliceFault(2, at_step=7, down_for_s=0.5)]
    runner = _runner(tmp_path, server.url, "pause", faults, elastic_max_retries=1)
    with pytest.raises(ElasticRetriesExhausted):
        _run(runner, make_train_fn(20, TrainLog()))


@pytest.mark.needs_devices(8)
def test_errors_that_are_not_slice_loss_propagate(tmp_path: Path, ckptd_server: Any) -> None:
    server = ckptd_server(tmp_path)

    def hook(step: int) -> None:
        if step == 3:
            raise jax.errors.JaxRuntimeError("UNAVAILABLE: not a slice failure")

    with pytest.raises(jax.errors.JaxRuntimeError, match="UNAVAILABLE"):
        _run(_runner(tmp_path, server.url, "resize", []), make_train_fn(10, TrainLog(), step_hook=hook))


@pytest.mark.needs_devices(8)
def test_recovery_falls_back_to_a_storage_scan_when_ckptd_is_down(tmp_path: Path, ckptd_server: Any) -> None:
    server = ckptd_server(tmp_path)
    _run(_runner(tmp_path, server.url, "resize", []), make_train_fn(20, TrainLog()))
    via_ckptd = CkptdClient(ClientSettings(url=server.url), root=str(tmp_path))
    from trainer_client.core.protocol import ResumeRequest

    request = ResumeRequest(policy="resize", alive_devices=6)
    plan = via_ckptd.resume(JOB, request)
    server.stop()
    dead = CkptdClient(ClientSettings(url=server.url, timeout_s=0.2, resume_deadline_s=0.5), root=str(tmp_path))
    fallback = dead.resume(JOB, request)
    assert plan.source == "ckptd" and fallback.source == "storage_scan"
    assert fallback.model_dump(exclude={"source"}) == plan.model_dump(exclude={"source"})
    assert (fallback.step, fallback.mesh.shape) == (20, [3, 2])

    # and a whole recovery runs on the fallback: a new run resumes from step 20 without ckptd
    log = TrainLog()
    runner = _runner(tmp_path, server.url, "resize", [])
    runner.client = dead
    result = _run(runner, make_train_fn(25, log))
    assert min(log.losses) == 20 and result.final_step == 24
    assert any(e.kind == "plan_received" and "storage_scan" in e.detail for e in result.events)


def test_train_step_is_deterministic_on_one_mesh() -> None:
    """The premise of test (a): the same inputs on the same mesh give the same bits."""
    state = init_state()
    ids = np.arange(BATCH, dtype=np.int32)
    a, _ = jax.jit(train_step)(state, ids)
    b, _ = jax.jit(train_step)(state, ids)
    assert all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b), strict=True))
    assert jax.tree_util.tree_structure(partition_specs(state)) is not None


@pytest.mark.parametrize("mode", ["keep_global_batch", "scale_batch"])
@pytest.mark.needs_devices(8)
def test_every_sample_is_consumed_exactly_once_across_a_shrink_and_a_regrow(
    tmp_path: Path, ckptd_server: Any, mode: str
) -> None:
    server = ckptd_server(tmp_path)
    runner = _runner(tmp_path, server.url, "resize", [SliceFault(1, at_step=13, down_for_s=None)], batch_mode=mode)
    slices = runner.slices
    assert isinstance(slices, SimulatedSlices)

    def hook(step: int) -> None:
        if step == 22:  # back, and seen by pathwaysutils' monitor before the next step however fast the steps are
            slices.bring_back(1)
            wait_until(lambda: 1 in runner.manager.available_inactive_slices, what="the monitor to see slice 1")

    log = TrainLog()
    result = _run(runner, make_train_fn(40, log, step_hook=hook))
    down, up = result.recoveries
    assert (down.mesh_after, up.mesh_after) == ([3, 2], [4, 2])
    assert down.restored_step in (12, 13)  # from the replicas (13's copy done, or met by the loss)
    counts = Counter(i for step in range(40) for i in range(*log.samples[step]))
    end = log.samples[39][1]
    assert sorted(counts) == list(range(end)), "a sample was skipped"
    assert set(counts.values()) == {1}, "a sample was read twice"
    shrunk = range(down.restored_step, up.restored_step)  # the steps that ran on 3 slices
    for step in range(40):
        size = log.samples[step][1] - log.samples[step][0]
        accumulation, lr_scale = log.batches[step]
        if step in shrunk and mode == "keep_global_batch":
            assert (size, accumulation, lr_scale) == (BATCH, 2, 1.0)  # 2 x 24 keeps the global batch
        elif step in shrunk:
            assert (size, accumulation, lr_scale) == (36, 1, 0.75)  # 6 per device on 6 devices, linear LR
        else:
            assert (size, accumulation, lr_scale) == (BATCH, 1, 1.0)
