"""Compile-ahead's executable for exactly the mesh a recovery lands on survives the elastic event and runs the
first step on it: nothing is traced again. Every other executable is released at the event, and one built for
other devices (another slice, or the same devices in another order) is never handed over."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import jax
import pytest
from jax.sharding import Mesh

import examples.elastic_mlp as mlp
from tests.support.elastic_runs import elastic_runner, run_to_end
from trainer_client.core._batching import initial_batch
from trainer_client.core.protocol import BatchOptions, BatchPlan, MeshSpec
from trainer_client.runtime.compilation._precompile import Precompiled, Precompiler, build_mesh, mesh_key
from trainer_client.runtime.elastic._elastic import ElasticContext, Event
from trainer_client.runtime.slices._slices import SliceFault

FULL = MeshSpec(axis_names=["replica", "data"], shape=[4, 2])
SMALL = MeshSpec(axis_names=["replica", "data"], shape=[3, 2])


def _slices() -> dict[int, list[jax.Device]]:
    return {k: jax.devices()[2 * k : 2 * k + 2] for k in range(4)}


class _Executable:
    """Stands in for a ``jax.stages.Compiled`` (weakly referenceable, so a test can see it freed)."""

    def __init__(self, slices: tuple[int, ...]) -> None:
        self.slices = slices


def _compiled_ahead() -> tuple[Precompiler, dict[tuple[int, ...], weakref.ref[_Executable]]]:
    """A Precompiler that ran one pass on the full mesh: one executable per mesh with one slice fewer."""
    made: dict[tuple[int, ...], weakref.ref[_Executable]] = {}
    slices = _slices()

    def hook(mesh: Mesh, batch: BatchPlan) -> _Executable:
        used = tuple(sorted({k for k, devices in slices.items() for d in mesh.devices.flat if d in devices}))
        executable = _Executable(used)
        made[used] = weakref.ref(executable)
        return executable

    precompiler = Precompiler()
    batch = initial_batch(48, FULL, "keep_global_batch")
    precompiler.start(hook, FULL, frozenset(range(4)), slices, batch, BatchOptions(mode="keep_global_batch"))
    precompiler.wait(60)
    return precompiler, made


@pytest.mark.needs_devices(8)
def test_the_event_keeps_only_the_new_meshs_executable() -> None:
    precompiler, made = _compiled_ahead()
    assert sorted(made) == [(0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3)]
    assert {p.slices for p in precompiler.kept()} == {frozenset(s) for s in made}

    precompiler.forget(frozenset({2}))  # slice 2 lost: what uses it goes before the cache clear
    gc.collect()
    assert {p.slices for p in precompiler.kept()} == {frozenset({0, 1, 3})}
    assert [s for s, ref in made.items() if ref() is not None] == [(0, 1, 3)]

    mesh = build_mesh(SMALL, [0, 1, 3], _slices())
    handed = precompiler.claim(mesh)
    assert handed is not None and handed.fits(mesh) and handed.key == mesh_key(mesh)
    assert cast(_Executable, handed.executable).slices == (0, 1, 3)
    assert handed.batch.global_batch == 48
    assert precompiler.kept() == [] and precompiler.claim(mesh) is None  # handed over once


@pytest.mark.needs_devices(8)
def test_a_mesh_on_other_devices_gets_nothing_and_frees_the_rest() -> None:
    precompiler, made = _compiled_ahead()
    precompiler.forget()  # a scale-up: no slice lost, every executable waits for the new mesh
    same_devices_other_order = build_mesh(SMALL, [3, 1, 0], _slices())
    assert precompiler.claim(same_devices_other_order) is None
    gc.collect()
    assert precompiler.kept() == [] and all(ref() is None for ref in made.values())

    precompiler, made = _compiled_ahead()
    assert precompiler.claim(build_mesh(FULL, [0, 1, 2, 3], _slices())) is None  # the full mesh: not compiled
    assert precompiler.kept() == []


@pytest.mark.needs_devices(8)
def test_a_context_never_takes_an_executable_built_for_other_devices() -> None:
    slices = _slices()
    built_for = build_mesh(SMALL, [0, 1, 3], slices)
    batch = initial_batch(48, SMALL, "keep_global_batch")
    pre = Precompiled(object(), mesh_key(built_for), frozenset({0, 1, 3}), batch)
    other = build_mesh(SMALL, [0, 1, 2], slices)
    assert not pre.fits(other) and not pre.fits(build_mesh(SMALL, [1, 0, 3], slices))
    with pytest.raises(ValueError, match="different mesh"):
        ElasticContext(cast(Any, None), cast(Any, None), other, None, frozenset({0, 1, 2}), precompiled=pre)


def test_a_compile_that_ends_after_the_event_is_not_kept() -> None:
    entered, finish = threading.Event(), threading.Event()

    def slow(mesh: Mesh, batch: BatchPlan) -> object:
        entered.set()
        finish.wait(10)
        return object()

    precompiler = Precompiler()
    precompiler.start(slow, FULL, frozenset(range(4)), _slices(), initial_batch(48, FULL, "keep_global_batch"),
                      BatchOptions(mode="keep_global_batch"))
    assert entered.wait(10)
    precompiler.stop()  # the elastic event
    finish.set()
    precompiler.wait(10)
    assert precompiler.kept() == []


# ---- the runner and the demo model ---------------------------------------------------------------------


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The thread of every trace of the demo's step, whichever its batch plan (every step form calls ``loss_fn``;
    a Python side effect runs only while tracing)."""
    seen: list[str] = []
    loss = mlp.loss_fn

    def counted(params: Any, ids: jax.Array) -> jax.Array:
        seen.append(threading.current_thread().name)
        return loss(params, ids)

    monkeypatch.setattr(mlp, "loss_fn", counted)
    mlp.jitted_step.cache_clear()
    jax.clear_caches()
    yield seen
    mlp.jitted_step.cache_clear()


@pytest.mark.parametrize("recovery_mesh_compiled", [True, False])
@pytest.mark.needs_devices(8)
def test_the_first_step_after_a_recovery_runs_the_precompiled_executable(
    tmp_path: Path, ckptd_server: Any, traces: list[str], recovery_mesh_compiled: bool
) -> None:
    """Slice 1 is lost at step 15; the recovery lands on (3, 2) over slices 0, 2, 3. Compile-ahead compiles that
    mesh (or not) and the one over slices 1, 2, 3 (which must be released at the event)."""
    server = ckptd_server(tmp_path)
    slices = _slices()
    target = mesh_key(build_mesh(SMALL, [0, 2, 3], slices))
    other = mesh_key(build_mesh(SMALL, [1, 2, 3], slices))
    compiled: dict[Any, weakref.ref[Any]] = {}

    def hook(mesh: Mesh, batch: BatchPlan) -> jax.stages.Compiled | None:
        if mesh_key(mesh) not in ((target, other) if recovery_mesh_compiled else (other,)):
            return None
        executable = mlp.precompile(mesh, batch)
        compiled[mesh_key(mesh)] = weakref.ref(executable)
        return executable

    handed: list[Precompiled | None] = []
    marks: dict[str, int] = {}
    alive_at_first_step: list[bool] = []

    def on_event(event: Event) -> None:
        if runner.recoveries and event.kind in ("restored", "first_step_done") and event.kind not in marks:
            marks[event.kind] = sum(name != "ckptd-precompile" for name in traces)
            if event.kind == "first_step_done":
                gc.collect()
                alive_at_first_step.append(compiled[other]() is not None)

    runner = elastic_runner(tmp_path, server.url, "resize", [SliceFault(1, 15, None)], on_event=on_event,
                            scale_up_check_interval_s=3600)
    inner = mlp.make_train_fn(20, mlp.TrainLog(), step_hook=lambda step: (
        runner.precompiler.wait(120) if step == 14 else None), use_precompile=False)

    def train(ctx: ElasticContext) -> Any:
        handed.append(ctx.precompiled)
        ctx.set_precompile(hook)
        return inner(ctx)

    result = run_to_end(runner, train)
    assert result.recoveries[0].mesh_after == [3, 2] and result.recoveries[0].slices_after == [0, 2, 3]
    assert handed[0] is None  # the first attempt: nothing compiled yet
    assert alive_at_first_step == [False], "the executable for another mesh outlived the event"
    traced_in_recovery = marks["first_step_done"] - marks["restored"]
    if recovery_mesh_compiled:
        pre = handed[1]
        assert pre is not None and pre.key == target
        assert pre.executable is compiled[target]()
        assert traced_in_recovery == 0, "the first step after the recovery traced the step again"
    else:
        assert handed[1] is None
        assert traced_in_recovery == 1  # the jitted step, traced for the new mesh
