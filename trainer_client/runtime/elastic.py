"""The elastic runner: survive slice failures inside the running process (same PID, no relaunch).

``ElasticRunner.run(train_fn)`` calls the user's training function with an ``ElasticContext``. When a
slice dies the JAX runtime raises (``JaxRuntimeError`` with ``DATA_LOSS``; classified by pathwaysutils);
the runner catches it, lets every reference to the old arrays go, waits for slices as the policy says
(``pause``: all of them, ``resize``: what is alive), asks ckptd for the resume plan (or scans storage
when ckptd cannot answer), rebuilds the mesh from the plan and calls the training function again, which
restores onto the new mesh through ``ctx.restore_or_init``. Under ``resize`` a returning slice is noticed
at a step boundary: the current state is saved first, so growing back loses no steps.

Options mirror MaxText's elastic flags: ``checkpoint_period``, ``elastic_timeout_s``,
``elastic_max_retries``, and the policy.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from pathwaysutils.elastic.manager import ScaleUpSignalError

from trainer_client.client.ckptd_client import CkptdClient
from trainer_client.client.event_reporter import EventReporter
from trainer_client.core.batching import initial_batch
from trainer_client.core.planner import plan_mesh
from trainer_client.core.protocol import BatchOptions, BatchPlan, MeshSpec, ResumePlan, ResumeRequest, SliceAlive
from trainer_client.errors import ElasticRetriesExhausted, ElasticTimeoutError, NoCheckpointError
from trainer_client.runtime._saver import HealthWatch, Saver, restore_plan
from trainer_client.runtime.checkpointing import Checkpointer, mesh_spec, target_shardings, training_metadata
from trainer_client.runtime.memory_tier import MemoryTier
from trainer_client.runtime.precompile import PrecompileHook, Precompiler, build_mesh, enable_persistent_cache
from trainer_client.runtime.slices import SliceProvider, is_slice_down_error

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
    compilation_cache_dir: str | None = None  # JAX's persistent compilation cache (shared with relaunches)
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


class ElasticContext:
    """What one attempt of the training function gets: the mesh, the plan, and the step hooks."""

    def __init__(self, runner: ElasticRunner, mesh: Mesh, plan: ResumePlan | None, active: frozenset[int]):
        self.runner = runner
        self.mesh = mesh
        self.plan = plan
        self.active_slices = active
        cfg = runner.config
        self.batch: BatchPlan = plan.batch if plan is not None and plan.batch is not None else initial_batch(
            cfg.global_batch, mesh_spec(mesh), cfg.batch_mode
        )
        self.start_step = 0
        self.last_step: int | None = None
        self._first_step_done = False
        self._last_scale_check = time.monotonic()
        self._precompile: PrecompileHook | None = None
        self._precompiling = False

    def set_precompile(self, hook: PrecompileHook) -> None:
        """Register ``hook(mesh, batch_plan)``: lower and compile the training step for ``mesh``. The runner
        calls it in the background for the meshes an elastic event would lead to next."""
        self._precompile = hook

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step on this mesh (``batch.accumulation_steps`` microbatches)."""
        return self.batch.global_batch

    # ---- state ----------------------------------------------------------------------------------

    def restore_or_init(
        self, init_fn: Callable[[], PyTree], specs_fn: Callable[[PyTree], PyTree]
    ) -> tuple[PyTree, int, int]:
        """``(state, step, data_position)``: restored from the plan's step onto this mesh, or freshly
        initialised (step 0, position 0) when the job has no committed checkpoint yet.

        ``specs_fn(abstract_state)`` gives a ``PartitionSpec`` per leaf in this mesh's axis names.
        """
        abstract = jax.eval_shape(init_fn)
        specs = specs_fn(abstract)
        if self.plan is None:
            shardings = jax.tree_util.tree_map(
                lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
            )
            state = jax.jit(init_fn, out_shardings=shardings)()
            self.start_step, position = 0, 0
            self.runner.emit("initialized", 0, f"fresh state on mesh {list(self.mesh.devices.shape)}")
        else:
            state, self.plan = restore_plan(
                self.plan, lambda plan: target_shardings(abstract, self.mesh, specs, plan.arrays),
                lambda: self.runner._plan(self.active_slices, use_memory_tier=False))
            jax.block_until_ready(state)
            self.start_step = self.plan.step
            position = self.plan.data_position or 0
            plan = self.plan
            self.runner.emit("restored", plan.step, f"from {plan.tier}: {plan.path}", tier=plan.tier)
        self.last_step = self.start_step
        return state, self.start_step, position

    def save(self, step: int, state: PyTree, data_position: int, *, persist: bool = True,
             if_busy: Literal["wait", "skip"] = "wait") -> None:
        """Save ``state`` as ``step`` (the loop is blocked only for the device-to-host copy): to storage
        (through ckptd's memory tier when it is on), or only to host memory when ``persist`` is False.
        ``if_busy="skip"`` (the periodic saves) skips a direct save that would wait for the previous one."""
        meta = training_metadata(step, state, data_position=data_position, global_batch=self.global_batch,
                                 mesh=self.mesh, slices=sorted(self.active_slices), batch=self.batch)
        saver = self.runner.saver
        with self.runner.precompiler.paused():  # a save's Python must not queue for the GIL behind tracing
            tier = saver.save(step, state, meta, persist=persist, if_busy=if_busy)
        self._start_precompile()  # after the attempt's first save: its first-time costs are paid alone
        self.runner.emit("checkpoint_started", step, f"{tier}, {saver.last_blocked_s or 0.0:.3f}s blocked",
                         blocked_seconds=saver.last_blocked_s, tier=tier)

    def _start_precompile(self) -> None:
        cfg = self.runner.config
        if self._first_step_done and self._precompile is not None and cfg.precompile and not self._precompiling:
            self._precompiling = True  # one pass per attempt
            self.runner.precompiler.start(
                self._precompile, mesh_spec(self.mesh), self.active_slices, self.runner.slices.slice_to_devices,
                self.batch, BatchOptions(mode=cfg.batch_mode, lr_scaling=cfg.lr_scaling))

    # ---- the hook called at the top of every step -----------------------------------------------

    def step_boundary(self, step: int, state: PyTree, data_position: int) -> None:
        """Call before computing ``step`` (``state`` holds ``step`` completed steps).

        Reports the first step done after a recovery, fires injected faults (CPU simulation), saves every
        ``checkpoint_period`` steps, and under ``resize`` grows back when lost slices have returned.
        """
        if not self._first_step_done and step > self.start_step:
            jax.block_until_ready(state)
            self._first_step_done = True
            self.runner._first_step_done(step)
        cfg = self.runner.config
        if not self._precompiling and (cfg.checkpoint_period <= 0 or step >= self.start_step + cfg.checkpoint_period):
            self._start_precompile()  # no save came first
        self.last_step = step
        self.runner.slices.at_step_boundary(step, self.active_slices)
        if step > self.start_step and cfg.checkpoint_period > 0 and step % cfg.checkpoint_period == 0:
            self.save(step, state, data_position, if_busy=cfg.when_save_busy)
        elif step > self.start_step and cfg.memory_period and step % cfg.memory_period == 0 and cfg.shm_dir:
            self.save(step, state, data_position, persist=False)
        if self.runner.config.policy == "resize":
            self._maybe_scale_up(step, state, data_position)

    def _maybe_scale_up(self, step: int, state: PyTree, data_position: int) -> None:
        now = time.monotonic()
        if now - self._last_scale_check < self.runner.config.scale_up_check_interval_s:
            return
        self._last_scale_check = now
        if set(self.runner.slices.slice_to_devices) == set(self.active_slices):
            return
        back = self.runner.slices.healthy_slices() - self.active_slices
        if not back:
            return
        if step not in self.runner.saver.saved_steps:
            self.save(step, state, data_position, persist=self.runner.saver.memory is None)
        self.runner.saver.wait()  # the step we grow from must be whole (in memory) or committed
        raise ScaleUpSignalError(f"slice(s) {sorted(back)} healthy again at step {step}")


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
        if config.compilation_cache_dir:
            enable_persistent_cache(config.compilation_cache_dir)
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
                value = train_fn(ctx)
                self.checkpointer.wait()
                self.emit("finished", ctx.last_step)
                return ElasticResult(value, os.getpid(), list(self.events), list(self.recoveries), ctx.last_step)
            except ScaleUpSignalError as exc:
                self._record("scale_up", ctx, str(exc))
            except Exception as exc:
                if not is_slice_down_error(exc):
                    raise
                failures += 1
                self._record("slice_down", ctx, str(exc).splitlines()[0][:300])
                if failures > self.config.elastic_max_retries:
                    raise ElasticRetriesExhausted(
                        f"{failures} slice failures exceed elastic_max_retries="
                        f"{self.config.elastic_max_retries}"
                    ) from exc
            self.precompiler.stop()
            # Out of the except block: the traceback and the frames holding the old arrays are gone.
            del ctx
            gc.collect()
            self.checkpointer.reset()
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
