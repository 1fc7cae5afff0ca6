"""The elastic runner: survive slice failures inside the running process (same PID, no relaunch).

``ElasticRunner.run(train_fn)`` calls the user's training function with an ``ElasticContext``. When a
slice dies the JAX operation that touches it raises (``JaxRuntimeError`` with ``DATA_LOSS``); the runner
retries only what pathwaysutils classifies as a slice loss *and* a health check confirms
(``fault_classification``; anything else is re-raised at once). It frees the failed attempt (JAX's caches
cleared, its arrays deleted: ``recovery``), waits for slices as the policy says (``pause``: all of them,
``resize``: what is alive), asks ckptd for the resume plan (or scans storage when ckptd cannot answer),
rebuilds the mesh from the plan and calls the training function again, with the default device on a live
slice; it restores onto the new mesh through ``ctx.restore_or_init``. Under ``resize`` a returning slice
is noticed at a step boundary: the current state is saved first, so growing back loses no steps. On
Pathways the runner calls ``pathwaysutils.initialize()``.

Options mirror MaxText's elastic flags: ``checkpoint_period``, ``elastic_timeout_s``,
``elastic_max_retries``, and the policy.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import jax
from jax.sharding import Mesh
from pathwaysutils.elastic.manager import ScaleUpSignalError

from trainer_client.client.ckptd_client import CkptdClient
from trainer_client.client.event_reporter import EventReporter
from trainer_client.core.planner import plan_mesh
from trainer_client.core.protocol import BatchOptions, MeshSpec, ResumePlan, ResumeRequest, SliceAlive
from trainer_client.errors import ElasticRetriesExhausted, ElasticTimeoutError, NoCheckpointError
from trainer_client.runtime._saver import HealthWatch, Saver
from trainer_client.runtime.checkpointing import Checkpointer
from trainer_client.runtime.elastic_context import ElasticContext
from trainer_client.runtime.fault_classification import classify_failure
from trainer_client.runtime.memory_tier import MemoryTier
from trainer_client.runtime.precompile import (
    Precompiler,
    build_mesh,
    enable_persistent_cache,
    ensure_compilation_cache,
)
from trainer_client.runtime.recovery import ArraysBefore, live_default_device, release_failed_attempt
from trainer_client.runtime.slices import SliceProvider, initialize_pathways

_log = logging.getLogger(__name__)

PyTree = Any
T = TypeVar("T")


@dataclass(frozen=True)
class ElasticConfig:
    """What the runner needs to know about the job (MaxText-style elastic options)."""

    job: str
    mesh_axes: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    global_batch: int
    checkpoint_period: int = 10
    elastic_timeout_s: float = 300.0
    elastic_max_retries: int = 10
    policy: Literal["pause", "resize"] = "resize"
    batch_mode: Literal["keep_global_batch", "scale_batch"] = "keep_global_batch"
    lr_scaling: Literal["none", "linear", "sqrt"] = "linear"
    device_memory_bytes: int | None = None
    memory_headroom_bytes: int = 0
    poll_interval_s: float = 0.25
    scale_up_check_interval_s: float = 1.0
    min_slices: int = 1
    shm_dir: str | None = None  # host-memory tier: a shared-memory directory ckptd also sees
    memory_period: int | None = None  # memory-only snapshots every N steps (between persistent saves)
    max_snapshots: int = 2
    preallocate_snapshots: bool = True  # allocate the next snapshot's shm file in the background after a save
    # JAX's persistent compilation cache (shared with relaunches); unset: a private one under the temp dir, unless
    # one is configured already (it carries compiled steps across the cache clear after an event)
    compilation_cache_dir: str | None = None
    precompile: bool = True  # compile the likely next meshes in the background (needs ctx.set_precompile)
    # a periodic save while the previous save to storage is still being written: waits for it (Orbax's way), or
    # is skipped so the loop never waits (fewer checkpoints when saves take longer than checkpoint_period)
    when_save_busy: Literal["wait", "skip"] = "wait"

    @property
    def full_mesh(self) -> MeshSpec:
        return MeshSpec(axis_names=list(self.mesh_axes), shape=list(self.mesh_shape))


@dataclass(frozen=True)
class Event:
    kind: str
    step: int | None
    t: float  # seconds since the run started
    detail: str = ""
    wall_time: float = 0.0  # time.time() when emitted
    fields: dict[str, Any] = field(default_factory=dict)  # structured extras (protocol.ElasticEvent fields)


@dataclass
class Recovery:
    """One elastic event, from detection to the first completed step on the new mesh."""

    kind: Literal["slice_down", "scale_up"]
    failed_at_step: int
    detected_t: float
    restored_step: int | None = None
    lost_steps: int | None = None
    mesh_before: list[int] = field(default_factory=list)
    mesh_after: list[int] = field(default_factory=list)
    seconds: float | None = None


@dataclass
class ElasticResult(Generic[T]):
    value: T
    pid: int
    events: list[Event]
    recoveries: list[Recovery]
    final_step: int | None


class ElasticRunner:
    """Runs a training function through slice failures, in this process."""

    def __init__(
        self,
        config: ElasticConfig,
        *,
        slices: SliceProvider,
        client: CkptdClient,
        checkpoint_dir: str,
        on_event: Callable[[Event], None] | None = None,
        reporter: EventReporter | None = None,
    ) -> None:
        self.config = config
        self.slices = slices
        self.client = client
        # Events go to ckptd in the background (trainer_client/client/event_reporter.py); training never waits.
        self.reporter = reporter if reporter is not None else (
            EventReporter(client.settings, config.job) if client.settings.report_events else None)
        initialize_pathways()  # on Pathways only (pathwaysutils' proxy backend); PathwaysSlices did it first
        if config.compilation_cache_dir:
            enable_persistent_cache(config.compilation_cache_dir)
        else:  # compiled executables must outlive the cache clear after an event (compile-ahead's above all)
            ensure_compilation_cache()
        self.precompiler = Precompiler()
        self.checkpointer = Checkpointer(checkpoint_dir)
        memory = (MemoryTier(config.shm_dir, config.job, max_snapshots=config.max_snapshots,
                             preallocate=config.preallocate_snapshots) if config.shm_dir else None)
        self.saver = Saver(self.checkpointer, memory, HealthWatch(client) if memory is not None else None)
        self.on_event = on_event
        self.events: list[Event] = []
        self.recoveries: list[Recovery] = []
        self._t0 = time.monotonic()

    def emit(self, kind: str, step: int | None = None, detail: str = "", **fields: Any) -> None:
        event = Event(kind, step, time.monotonic() - self._t0, detail, time.time(), fields)
        self.events.append(event)
        _log.info("elastic event %s step=%s %s", kind, step, detail)
        if self.reporter is not None:
            self.reporter.report(kind, time=event.wall_time, step=step, t=event.t, detail=detail, **fields)
        if self.on_event is not None:
            self.on_event(event)

    def _first_step_done(self, step: int) -> None:
        self.emit("first_step_done", step)
        if self.recoveries and self.recoveries[-1].seconds is None:
            rec = self.recoveries[-1]
            rec.seconds = self.events[-1].t - rec.detected_t
            self.emit("recovered", step, f"{rec.kind} at step {rec.failed_at_step}: {rec.seconds:.2f}s to the "
                      f"first step, {rec.lost_steps} step(s) lost", recovery_seconds=rec.seconds,
                      lost_steps=rec.lost_steps, restored_step=rec.restored_step, mesh_before=rec.mesh_before,
                      mesh_after=rec.mesh_after)

    # ---- the loop around the user's function ---------------------------------------------------

    def run(self, train_fn: Callable[[ElasticContext], T]) -> ElasticResult[T]:
        """Run ``train_fn`` through slice failures; the events reach ckptd before this returns (or the
        reporter gives up after ``events_flush_timeout_s``, at once when ckptd does not answer)."""
        try:
            return self._run(train_fn)
        except BaseException as exc:
            self.emit("aborted", None, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}")
            raise
        finally:
            # No background compile may outlive the run: XLA aborts the process if the interpreter exits
            # while one is in flight.
            self.precompiler.stop(wait=True)
            self.saver.close()
            if self.reporter is not None:
                self.reporter.close(self.client.settings.events_flush_timeout_s)

    def _run(self, train_fn: Callable[[ElasticContext], T]) -> ElasticResult[T]:
        self._t0 = time.monotonic()
        self.emit("start", None, f"pid {os.getpid()}, policy {self.config.policy}")
        callers_arrays = ArraysBefore()  # kept across events; whatever an attempt creates is not
        active = self._wait_for_slices(self.config.policy)
        failures = 0
        while True:
            plan = self._plan(active)
            order = plan.slices_used if plan and plan.slices_used else sorted(active)
            mesh = self._build_mesh(plan.mesh if plan else self._fresh_mesh(active), order)
            if self.recoveries and not self.recoveries[-1].mesh_after:
                rec = self.recoveries[-1]
                rec.mesh_after = [int(s) for s in mesh.devices.shape]
                rec.restored_step = plan.step if plan else 0
                rec.lost_steps = rec.failed_at_step - rec.restored_step
            ctx = ElasticContext(self, mesh, plan, active)
            try:
                # as Manager.elastic_retry: nothing without an explicit sharding lands on a dead slice
                with jax.default_device(live_default_device(self.slices.slice_to_devices, order)):
                    value = train_fn(ctx)
                self.checkpointer.wait()
                self.emit("finished", ctx.last_step)
                return ElasticResult(value, os.getpid(), list(self.events), list(self.recoveries), ctx.last_step)
            except ScaleUpSignalError as exc:
                self._record("scale_up", ctx, str(exc))
            except Exception as exc:
                # a slice loss only when pathwaysutils says so and the health check confirms it; anything
                # else (an XLA compiler bug, an out-of-memory, a corrupt read) leaves unchanged, at once
                loss = classify_failure(exc, self.slices, ctx.active_slices)
                if loss is None:
                    raise
                failures += 1
                self._record("slice_down", ctx, f"slice(s) {sorted(loss.lost)} down: "
                             f"{(str(exc).splitlines() or [''])[0][:300]}")
                if failures > self.config.elastic_max_retries:
                    raise ElasticRetriesExhausted(
                        f"{failures} slice failures exceed elastic_max_retries="
                        f"{self.config.elastic_max_retries}"
                    ) from exc
            self.precompiler.stop()
            # Out of the except block: the traceback and the frames holding the old arrays are gone.
            del ctx
            self.checkpointer.reset()  # a save in flight has its host copy: the device arrays may go
            release_failed_attempt(callers_arrays)
            self.precompiler.forget()
            active = self._wait_for_slices(self.config.policy)

    def _record(self, kind: Literal["slice_down", "scale_up"], ctx: ElasticContext, detail: str) -> None:
        step = ctx.last_step if ctx.last_step is not None else ctx.start_step
        self.emit("failure_detected" if kind == "slice_down" else "scale_up_detected", step, detail)
        self.recoveries.append(
            Recovery(kind, step, self.events[-1].t, mesh_before=[int(s) for s in ctx.mesh.devices.shape])
        )

    def _wait_for_slices(self, policy: str) -> frozenset[int]:
        """Healthy slices once the policy is satisfied: all of them (pause) or at least ``min_slices``."""
        everything = frozenset(self.slices.slice_to_devices)
        needed = len(everything) if policy == "pause" else self.config.min_slices
        deadline = time.monotonic() + self.config.elastic_timeout_s
        healthy = self.slices.healthy_slices()
        if len(healthy) < needed:
            self.emit("waiting_for_slices", None, f"{len(healthy)}/{len(everything)} healthy, need {needed}")
        while len(healthy) < needed:
            if time.monotonic() >= deadline:
                raise ElasticTimeoutError(
                    f"only {len(healthy)} of {len(everything)} slices healthy after "
                    f"{self.config.elastic_timeout_s}s; policy {policy!r} needs {needed}"
                )
            time.sleep(self.config.poll_interval_s)
            healthy = self.slices.healthy_slices()
        self.emit("slices_ready", None, f"slices {sorted(healthy)}")
        return healthy

    def _plan(self, active: frozenset[int], *, use_memory_tier: bool = True) -> ResumePlan | None:
        slices = [SliceAlive(index=k, devices=len(self.slices.slice_to_devices[k])) for k in sorted(active)]
        cfg = self.config
        request = ResumeRequest(
            policy=cfg.policy, alive_devices=sum(s.devices for s in slices), slices=slices,
            device_memory_bytes=cfg.device_memory_bytes, memory_headroom_bytes=cfg.memory_headroom_bytes,
            batch=BatchOptions(mode=cfg.batch_mode, lr_scaling=cfg.lr_scaling), use_memory_tier=use_memory_tier,
        )
        try:
            plan = self.client.resume(self.config.job, request)
        except NoCheckpointError:
            return None
        batch = plan.batch
        self.emit("plan_received", plan.step,
                  f"mesh {plan.mesh.shape} from {plan.source}, data position {plan.data_position}"
                  + (f", batch {batch.global_batch} = {batch.accumulation_steps} x {batch.micro_batch}"
                     if batch else ""))
        return plan

    def _fresh_mesh(self, active: frozenset[int]) -> MeshSpec:
        alive = sum(len(self.slices.slice_to_devices[k]) for k in active)
        return plan_mesh(self.config.full_mesh, {}, alive, "resize").mesh

    def _build_mesh(self, spec: MeshSpec, slice_order: list[int]) -> Mesh:
        """Devices of the planned slices, slice by slice, reshaped to the planned mesh."""
        return build_mesh(spec, slice_order, self.slices.slice_to_devices)


__all__ = ["ElasticConfig", "ElasticContext", "ElasticResult", "ElasticRunner", "Event", "Recovery"]
