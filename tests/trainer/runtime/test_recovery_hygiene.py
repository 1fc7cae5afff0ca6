"""After every elastic event the failed attempt is freed: JAX's caches cleared, its arrays deleted, the next
attempt's default device on a live slice, and on Pathways ``pathwaysutils.initialize()`` called.

A recovered process lives for the whole job: what each failed attempt leaves behind would add up.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.extend.backend
import jax.numpy as jnp
import pathwaysutils
import pytest

from examples.elastic_mlp import TrainLog, jitted_step, make_train_fn
from tests.support.elastic_runs import elastic_runner, in_jax_faults, run_to_end
from tests.support.helpers import wait_until
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.runtime.elastic._elastic import ElasticConfig, ElasticContext, ElasticRunner, Event
from trainer_client.runtime.replicas import _replica_leaves
from trainer_client.runtime.slices._jax_faults import InJaxFaults
from trainer_client.runtime.slices._slices import SimulatedSlices

STAGING_COPY = f"jit_{_replica_leaves._copy_all.__name__}"  # the replica tier's on-device copy, as XLA names it


@pytest.fixture
def faults() -> Iterator[InJaxFaults]:
    yield from in_jax_faults()


@pytest.mark.needs_devices(8)
def test_live_arrays_and_executables_do_not_grow_over_recoveries(
    tmp_path: Path, ckptd_server: Any, faults: InJaxFaults
) -> None:
    server = ckptd_server(tmp_path)
    slices = faults.slices
    losses = {12: 0, 26: 1, 40: 2}  # step -> slice lost inside the step; each comes back 4 steps later
    returns = {step + 4: k for step, k in losses.items()}
    kept: dict[int, Any] = {}  # the last state each attempt saw: a callback that keeps its arrays
    attempt = [0]
    measured: list[tuple[str, int, list[str]]] = []  # (recovery kind, live arrays, live executables' names)
    backend = jax.extend.backend.get_backend()

    def hook(step: int) -> None:
        if step in losses and not any(f.slice_index == losses[step] for f in faults.fired):
            faults.fail_during("to_host", losses[step], down_for_s=None)
        if step in returns:  # back, and seen by pathwaysutils' monitor: the next boundary grows back
            slices.bring_back(returns[step])
            wait_until(lambda: returns[step] in runner.manager.available_inactive_slices, what="the monitor")

    inner = make_train_fn(56, TrainLog(), step_hook=hook, use_precompile=False)

    def train(ctx: ElasticContext) -> Any:
        attempt[0] += 1
        boundary = ctx.step_boundary

        def keep(step: int, state: Any, position: int) -> None:
            kept[attempt[0]] = state
            boundary(step, state, position)

        ctx.step_boundary = keep  # type: ignore[method-assign]
        return inner(ctx)

    def on_event(event: Event) -> None:
        # The training's arrays and executables span the mesh; pathwaysutils' health checks (a pmap per slice,
        # between attempts and in its monitor) leave some of one slice behind for a while: not counted.
        # What only waits for Python's cycle collector (a traceback's frames holding the failed step's
        # executable) is collected first: when that collector last ran is timing, not a leak. Nor counted: the
        # replica tier's on-device staging copy, compiled at this attempt's first snapshot, which the pacer takes
        # before or after the first step as its timing falls (it is this attempt's, not a failed one's).
        if event.kind == "first_step_done" and runner.recoveries:
            gc.collect()
            arrays = [a for a in jax.live_arrays() if len(a.sharding.device_set) > 2]
            executables = sorted(name for e in backend.live_executables() if len(e.local_devices()) > 2
                                 if (name := e.hlo_modules()[0].name) != STAGING_COPY)
            measured.append((runner.recoveries[-1].kind, len(arrays), executables))

    jitted_step.cache_clear()
    runner = elastic_runner(tmp_path, server.url, "resize", slices=slices, on_event=on_event, precompile=False)
    result = run_to_end(runner, train)
    kinds = [r.kind for r in result.recoveries]
    assert kinds == ["slice_down", "scale_up"] * 3, kinds
    assert [r.mesh_after for r in result.recoveries] == [[3, 2], [4, 2]] * 3
    assert len(measured) == 6
    assert all(len(set(names)) == len(names) for _, _, names in measured), measured  # none twice: a failed one's
    for kind in ("slice_down", "scale_up"):
        arrays = [a for k, a, _ in measured if k == kind]
        executables = [len(e) for k, _, e in measured if k == kind]
        assert max(arrays) <= arrays[0], f"live arrays grew over {kind} recoveries: {measured}"
        assert max(executables) <= executables[0], f"executables grew over {kind} recoveries: {measured}"
    assert all(x.is_deleted() for k, state in kept.items() if k < attempt[0]
               for x in jax.tree_util.tree_leaves(state)), "a failed attempt's arrays are still alive"


@pytest.mark.needs_devices(8)
def test_the_next_attempt_computes_on_a_live_slice_when_slice_0_is_lost(
    tmp_path: Path, ckptd_server: Any, faults: InJaxFaults
) -> None:
    server = ckptd_server(tmp_path)
    placed: list[set[Any]] = []  # where unsharded work went, per attempt

    def hook(step: int) -> None:
        if step == 12 and not faults.fired:
            faults.fail_during("to_host", 0, down_for_s=None)

    inner = make_train_fn(20, TrainLog(), step_hook=hook)

    def train(ctx: ElasticContext) -> Any:
        placed.append(set(jnp.zeros(()).devices()))
        return inner(ctx)

    result = run_to_end(elastic_runner(tmp_path, server.url, "resize", slices=faults.slices), train)
    assert result.recoveries[0].mesh_after == [3, 2]
    slice_0 = set(faults.slices.slice_to_devices[0])
    assert placed[0] <= slice_0
    assert not placed[1] & slice_0, f"the next attempt's default device is on the lost slice 0: {placed[1]}"
    assert placed[1] <= {d for k in (1, 2, 3) for d in faults.slices.slice_to_devices[k]}


def _runner(tmp_path: Path) -> ElasticRunner:
    config = ElasticConfig(job="job", mesh_axes=("replica", "data"), mesh_shape=(4, 2), global_batch=48)
    client = CkptdClient(ClientSettings(url="http://127.0.0.1:9"), root=str(tmp_path))
    return ElasticRunner(config, slices=SimulatedSlices(num_slices=4), client=client,
                         checkpoint_dir=str(tmp_path / "job"))


@pytest.mark.needs_devices(8)
def test_pathwaysutils_is_initialised_on_pathways_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(pathwaysutils, "initialize", lambda: calls.append("initialize"))
    _runner(tmp_path).checkpointer.close()
    assert calls == [], "pathwaysutils.initialize() on CPU"  # jax_platforms is 'cpu': not Pathways

    platforms = jax.config.jax_platforms  # type: ignore[attr-defined]
    jax.config.update("jax_platforms", "proxy")  # what pathwaysutils looks at (the backends are up already)
    try:
        assert pathwaysutils.is_pathways_backend_used()
        _runner(tmp_path).checkpointer.close()
    finally:
        jax.config.update("jax_platforms", platforms)
    assert calls == ["initialize"]


def test_the_monitors_health_check_and_the_deletion_of_arrays_never_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleting arrays while the monitor's health check ran its pmap on arrays of its own crashed the process
    (SIGSEGV in make demo); both hold SliceManager.device_work."""
    import threading

    from pathwaysutils.elastic import elastic as pw_elastic

    from trainer_client.runtime.slices._slice_manager import SliceManager

    devices = jax.devices()
    manager = SliceManager({0: devices[:4], 1: devices[4:8]}, monitor_interval_s=0.05)
    manager.active_slice_indices = frozenset({0})  # slice 1 is inactive: the monitor checks it
    inside, release = threading.Event(), threading.Event()

    def slow_check(slice_to_devices: Any) -> frozenset[int]:
        inside.set()
        release.wait(5)
        return frozenset(slice_to_devices)

    monkeypatch.setattr(pw_elastic, "get_active_slice_indices", slow_check)
    checker = threading.Thread(target=manager._check_inactive_slices)
    checker.start()
    assert inside.wait(5)
    assert not manager.device_work.acquire(timeout=0.2)  # the runner's deletion would wait for the check
    release.set()
    checker.join(5)
    assert manager.device_work.acquire(timeout=1)
    manager.device_work.release()
