"""The elastic runner: survive slice failures inside the running process (same PID, no relaunch).

``ElasticRunner.run(train_fn)`` calls the user's training function with an ``ElasticContext``, through
pathwaysutils' ``Manager.elastic_retry`` (runtime/slices/_slice_manager.py), which waits for the slices the policy
needs (``pause``: all, ``resize``: at least ``min_slices``), retries an attempt after a slice loss or a
``ScaleUpSignalError``, and health-checks the slices not in use. When a slice dies the JAX operation that
touches it raises (``JaxRuntimeError``, ``DATA_LOSS``); only what pathwaysutils classifies as a slice loss *and*
a health check confirms reaches Manager (``fault_classification``; anything else is re-raised unchanged). The
failed attempt is then freed (``recovery``; compile-ahead's executable for the new mesh is kept); the next
asks ckptd for the resume plan (or scans storage), rebuilds the mesh and restores onto it
(``ctx.restore_or_init``). Under ``resize`` a slice back is noticed at a step boundary and the state saved
before growing. Hot spares (``spare_slices``) take a lost slice's place with the same mesh
(``SliceManager.take_slices``). In a multi-controller job (``jax.process_count() > 1``) each process runs one
attempt and all restore the step they agree on (``multihost.ResumeAgreement``, docs/multihost.md); a SIGTERM
makes them save that step and return (``ElasticResult.preempted``). Options mirror MaxText's elastic flags
(docs/maxtext.md).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar, cast

import jax
from jax.sharding import Mesh
from pathwaysutils.elastic.manager import ElasticRuntimeError, ScaleUpSignalError

from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.client._event_reporter import EventReporter
from trainer_client.core._batching import describe_batch
from trainer_client.core._planner import plan_mesh
from trainer_client.core.protocol import BatchPlan, MeshSpec, ResumePlan, ResumeRequest, SliceAlive, Tier
from trainer_client.errors import ElasticRetriesExhausted, ElasticTimeoutError, NoCheckpointError
from trainer_client.runtime.autopilot._autopilot_runner import RunnerAutopilot
from trainer_client.runtime.compilation._precompile import (
    Precompiler,
    build_mesh,
    enable_persistent_cache,
    ensure_compilation_cache,
)
from trainer_client.runtime.elastic._elastic_config import ElasticConfig
from trainer_client.runtime.elastic._elastic_context import (
    AttemptHooks,
    AttemptParts,
    ElasticContext,
    Preempted,
    RunnerSignal,
)
from trainer_client.runtime.elastic._fault_classification import classify_failure
from trainer_client.runtime.elastic._recovery import (
    ArraysBefore,
    collect_failed_attempt,
    hold_collection,
    release_failed_attempt,
)
from trainer_client.runtime.elastic._run_record import ElasticResult, Event, Recovery
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.multihost._multihost import ResumeAgreement
from trainer_client.runtime.replicas._replica_snapshots import RunnerReplicas
from trainer_client.runtime.saving._checkpointing import Checkpointer
from trainer_client.runtime.saving._saver import HealthWatch, Saver
from trainer_client.runtime.slices._jax_faults import InJaxFaults
from trainer_client.runtime.slices._slice_manager import SliceManager
from trainer_client.runtime.slices._slices import SimulatedSlices, SliceProvider, initialize_pathways

_log = logging.getLogger(__name__)

PyTree = Any
T = TypeVar("T")


class _Raise(RunnerSignal):
    """Carries an attempt's error that is not Manager's to retry through its loop, to be raised as it was
    (never leaves the runner)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


def _first_line(error: BaseException) -> str:
    return f"{(str(error).splitlines() or [''])[0][:300]}"


class ElasticRunner:
    """Runs a training function through slice failures, in this process.

    The environment is read once: ``client.settings`` (``client_settings()`` unless the client was given some) is
    what every part of the run uses (the run id of each step, the save route's timeout, the restore's host-memory
    cap, the memory tier's directory unless ``MemoryTierOptions.shm_dir`` names one)."""

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
        self.config = config = config.with_shm_dir(client.settings.shm_dir)  # one directory: CKPTD_SHM_DIR's
        self.slices = slices
        self.client = client
        self.settings = settings = client.settings
        # Events go to ckptd in the background (client/_event_reporter.py); training never waits.
        if reporter is None and settings.report_events:
            reporter = EventReporter(settings, config.job)
        self.reporter = reporter
        initialize_pathways()  # on Pathways only (pathwaysutils' proxy backend); PathwaysSlices did it first
        if config.compilation.compilation_cache_dir:
            enable_persistent_cache(config.compilation.compilation_cache_dir)
        else:  # compiled executables must outlive the cache clear after an event (compile-ahead's above all)
            ensure_compilation_cache()
        total = len(slices.slice_to_devices)
        spares = config.elastic.spare_slices
        if not 0 <= spares < total:
            raise ValueError(f"spare_slices={spares}: the allocation has {total} slices")
        self.manager = SliceManager(slices.slice_to_devices, config.health.monitor_interval_s,
                                    mesh_slices=total - spares)
        self.precompiler = Precompiler(mesh_slices=total - spares)
        saving, tier = config.saving, config.memory_tier
        self.checkpointer = Checkpointer(checkpoint_dir, async_save=saving.async_save,
                                         item=saving.checkpoint_item, run_id=settings.run_id)
        memory = None
        if tier.shm_dir:
            memory = MemoryTier(tier.shm_dir, config.job, max_snapshots=tier.max_snapshots,
                                preallocate=tier.preallocate_snapshots)
        health = HealthWatch(client) if memory is not None else None
        self.saver = Saver(self.checkpointer, memory, health, settings=settings)
        # a multi-controller job's processes restore one step, agreed through JAX's coordination service
        self.agreement: ResumeAgreement | None = None
        if (count := jax.process_count()) > 1:
            self.agreement = ResumeAgreement(config.job, tier.shm_dir, client,
                                             process_index=jax.process_index(), process_count=count)
        # the replica snapshot tier: a single-controller run's (a lost process of a multi-controller job takes
        # its host memory with it)
        self.replicas: RunnerReplicas | None = None
        if tier.replicas.enabled and self.agreement is None:
            self.replicas = RunnerReplicas(tier.replicas, slices.slice_to_devices,
                                           on_off=lambda why: self.emit("replicas_off", None, why[:1900]),
                                           on_paced=lambda step, new, old: self.emit(
                                               "replica_paced", step, new.describe(old)[:1900], **new.fields()))
        self.autopilot = RunnerAutopilot.for_run(self)  # the periods the config leaves unset, chosen as it runs
        self.on_event = on_event
        self.events: list[Event] = []
        self.recoveries: list[Recovery] = []
        self._lost: frozenset[int] = frozenset()  # the slices the last event took
        self._batch: BatchPlan | None = None  # the current attempt's batch plan
        # a failed attempt's Python objects wait for the garbage collector until the next first step (``_held``:
        # the objects alive at the event are frozen meanwhile: runtime/elastic/_recovery.py)
        self._collect_pending = False
        self._held = False
        self._t0 = time.monotonic()

    def emit(self, kind: str, step: int | None = None, detail: str = "", **fields: Any) -> None:
        event = Event(kind, step, time.monotonic() - self._t0, detail, time.time(), fields)
        self.events.append(event)
        self.autopilot.observe(kind, step, fields)  # costs and failures: what the periods are chosen from
        _log.info("elastic event %s step=%s %s", kind, step, detail)
        if self.reporter is not None:
            self.reporter.report(kind, time=event.wall_time, step=step, t=event.t, detail=detail, **fields)
        if self.on_event is not None:
            self.on_event(event)

    def first_step_done(self, step: int) -> None:
        """The attempt's first step is done (``ElasticContext.step_boundary``): ends the open recovery, then
        collects what the failed attempts before it left (``_recovery.collect_failed_attempt``)."""
        self.emit("first_step_done", step)
        try:
            self._end_recovery(step)
        finally:
            self._collect_failed()

    def _collect_failed(self) -> None:
        if self._collect_pending:
            held, self._collect_pending, self._held = self._held, False, False
            collect_failed_attempt(held)

    def _end_recovery(self, step: int) -> None:
        if not self.recoveries or self.recoveries[-1].seconds is not None:
            return
        rec = self.recoveries[-1]
        rec.seconds = self.events[-1].t - rec.detected_t
        detail = rec.summary() + (f"; {describe_batch(self._batch)}" if self._batch is not None else "")
        self.emit("recovered", step, detail, recovery_seconds=rec.seconds, lost_steps=rec.lost_steps,
                  restored_step=rec.restored_step, mesh_before=rec.mesh_before, mesh_after=rec.mesh_after,
                  spares_used=rec.spares_used or None, restored_from=rec.restored_from or "none",
                  **(self.replicas.stats_fields() if self.replicas is not None else {}))

    def note_restored(self, plan: ResumePlan | None) -> None:
        """The attempt restored ``plan`` (after any fallback; None: it started afresh, no tier held a step): the
        open recovery's step, tier and path."""
        if self.recoveries and self.recoveries[-1].seconds is None:
            self.recoveries[-1].restored(plan.step if plan else None, plan.tier if plan else None,
                                        plan.path if plan else "")

    # ---- the loop around the user's function ---------------------------------------------------

    def run(self, train_fn: Callable[[ElasticContext], T]) -> ElasticResult[T]:
        """Run ``train_fn`` through slice failures; the events reach ckptd before this returns (or the
        reporter gives up after ``events_flush_timeout_s``, at once when ckptd does not answer)."""
        try:
            with self._slices_in_jax():
                return self._run(train_fn)
        except BaseException as exc:
            self.emit("aborted", None, f"{type(exc).__name__}: {_first_line(exc)}")
            raise
        finally:
            # No background compile may outlive the run (XLA aborts the process when the interpreter exits
            # in one)
            self.precompiler.stop(wait=True)
            self.precompiler.release()
            self._collect_failed()  # a run that ended before the first step after its last event
            self.saver.close()
            if self.replicas is not None:
                self.replicas.close()
            if self.reporter is not None:
                self.reporter.close(self.settings.events_flush_timeout_s)

    def _run(self, train_fn: Callable[[ElasticContext], T]) -> ElasticResult[T]:
        """The attempts, through pathwaysutils' ``Manager.elastic_retry`` (runtime/slices/_slice_manager.py): it waits
        for the slices, runs ``_attempt`` under ``jax.default_device`` on one of them, retries it after a
        slice loss or a scale-up signal and stops its monitor at the end; ckptd's part is in the callbacks."""
        self._t0 = time.monotonic()
        options = self.config.elastic
        self.emit("start", None, f"pid {os.getpid()}, policy {options.policy}")
        callers_arrays = ArraysBefore()  # kept across events; whatever an attempt creates is not
        total = len(self.slices.slice_to_devices)
        needed = self.manager.mesh_slices
        if options.policy == "resize":
            needed = min(options.min_slices, needed)
        failures = 0
        if self.agreement is not None:
            # multi-controller: a lost process ends every process and the job restarts them
            # (docs/multihost.md, sections 2 and 6): no same-PID retries
            return self._only_attempt(train_fn)

        def retry(attempt: int, error: Exception) -> bool:
            nonlocal failures
            if isinstance(error, ScaleUpSignalError):
                return True
            failures += 1
            return failures <= options.elastic_max_retries

        def after_event() -> None:  # before the wait for slices; the failed attempt's frames still exist
            self.precompiler.stop()
            self.precompiler.forget(self._lost)  # executables on lost slices go with the clear below
            self.checkpointer.reset()  # a save in flight has its host copy: the device arrays may go
            held = self.replicas.held_arrays() if self.replicas is not None else []  # the snapshot survives
            with self.manager.device_work:  # not while the monitor's health check runs on arrays of its own
                release_failed_attempt(callers_arrays, also_keep=held)
            del held
            # the exception holds the failed attempt's frames until the retry: collected after the next first step
            self._collect_pending = True
            self._held = hold_collection(self._held)
            self.emit("waiting_for_slices", None, f"policy {options.policy} needs {needed} of {total} slices")

        def ready() -> None:  # after Manager's wait, before the attempt: which healthy slices the mesh uses
            used, spares = self.manager.take_slices()
            spare = f", spare(s) {sorted(spares)}" if options.spare_slices else ""
            self.emit("slices_ready", None, f"slices {sorted(used)}{spare}")

        attempts = self.manager.elastic_retry(
            minimum_slice_count=needed, poll_interval=self.config.health.poll_interval_s,
            timeout=options.elastic_timeout_s, pre_callback=ready, on_elastic_event_callback=after_event,
            retry_policy=retry,
        )(lambda: self._attempt(train_fn))
        try:
            return attempts()
        except _Raise as passed:
            error = passed.error
        except ElasticRuntimeError as exc:  # the retry policy said no
            limit = f"elastic_max_retries={options.elastic_max_retries}"
            raise ElasticRetriesExhausted(f"{failures} slice failures exceed {limit}") from exc.__cause__
        except TimeoutError as exc:  # Manager's wait (the attempt's own errors come as _Raise)
            raise ElasticTimeoutError(f"{exc} (policy {options.policy!r} needs {needed} of {total}; "
                                      f"elastic_timeout_s={options.elastic_timeout_s})") from exc
        raise error  # outside the except block: unchanged, with its own traceback and context

    def _only_attempt(self, train_fn: Callable[[ElasticContext], T]) -> ElasticResult[T]:
        """The one attempt of a process of a multi-controller job, on every slice, without pathwaysutils'
        Manager: its slice health check is a pmap over one slice's devices, which fails when a slice spans
        processes, and there is nothing to retry in this PID after a loss."""
        self.manager.active_slice_indices = self.manager.all_slice_indices
        self.manager.take_slices()
        try:
            return self._attempt(train_fn)
        except _Raise as passed:
            error = passed.error
        raise error

    def _attempt(self, train_fn: Callable[[ElasticContext], T]) -> ElasticResult[T]:
        """One attempt on the slices Manager found. Only a confirmed slice loss (fault_classification.py)
        and a scale-up signal reach Manager, which retries them; anything else passes through it as
        ``_Raise`` and leaves ``run`` unchanged, at once."""
        active = frozenset(self.manager.active_slice_indices)  # the slices in use (SliceManager.take_slices)
        ctx: ElasticContext | None = None
        try:
            plan = self.resume_plan(active)
            order = plan.slices_used if plan and plan.slices_used else sorted(active)
            mesh = self._build_mesh(plan.mesh if plan else self._fresh_mesh(active), order)
            self._note_new_mesh(mesh, plan, active)
            # compile-ahead's executable for exactly this mesh, if any (every other one is dropped)
            ctx = ElasticContext(self._attempt_parts(), self._attempt_hooks(), mesh, plan, active,
                                 precompiled=self.precompiler.claim(mesh))
            self._batch = ctx.batch  # what the step must process on this mesh: the recovery's summary says it
            try:
                value = train_fn(ctx)
            except Preempted as stop:
                self.checkpointer.wait()
                return ElasticResult(cast(T, None), os.getpid(), list(self.events), list(self.recoveries),
                                     stop.step, preempted=True)
            self.checkpointer.wait()
        except ScaleUpSignalError as exc:
            if ctx is not None:
                self._record("scale_up", ctx, str(exc))
            raise
        except jax.errors.JaxRuntimeError as exc:
            loss = classify_failure(exc, self.slices, active) if ctx is not None else None
            if ctx is None or loss is None:
                raise _Raise(exc) from None
            down = f"slice(s) {sorted(loss.lost)} down: {_first_line(exc)}"
            self._record("slice_down", ctx, down, loss.lost)
            raise
        except Exception as exc:
            raise _Raise(exc) from None
        self.emit("finished", ctx.last_step)
        return ElasticResult(value, os.getpid(), list(self.events), list(self.recoveries), ctx.last_step)

    def _attempt_parts(self) -> AttemptParts:
        """The parts of the run an attempt uses, as they are when it starts."""
        return AttemptParts(config=self.config, settings=self.settings, slices=self.slices, saver=self.saver,
                            precompiler=self.precompiler, autopilot=self.autopilot, replicas=self.replicas,
                            agreement=self.agreement)

    def _attempt_hooks(self) -> AttemptHooks:
        """What an attempt tells the runner or asks of it, as plain callables."""
        return AttemptHooks(emit=self.emit, resume_plan=self.resume_plan, note_restored=self.note_restored,
                            first_step_done=self.first_step_done, slices_to_grow=self.slices_to_grow)

    def _note_new_mesh(self, mesh: Mesh, plan: ResumePlan | None, active: frozenset[int]) -> None:
        """The open recovery's side after the event: the mesh, the slices, the spares used, the steps lost."""
        if not self.recoveries or self.recoveries[-1].mesh_after:
            return
        rec = self.recoveries[-1]
        rec.on_mesh([int(s) for s in mesh.devices.shape], sorted(active), bool(self.config.elastic.spare_slices))
        rec.restored(plan.step if plan else 0)

    def _record(self, kind: Literal["slice_down", "scale_up"], ctx: ElasticContext, detail: str,
                lost: frozenset[int] = frozenset()) -> None:
        self._lost = lost  # the event's compile-ahead executables on these slices are dropped (after_event)
        if self.replicas is not None:
            self.replicas.note_lost(lost)
        step = ctx.last_step if ctx.last_step is not None else ctx.start_step
        self.emit("failure_detected" if kind == "slice_down" else "scale_up_detected", step, detail)
        self.recoveries.append(Recovery(kind, step, self.events[-1].t,
                                        mesh_before=[int(s) for s in ctx.mesh.devices.shape],
                                        slices_before=sorted(ctx.active_slices)))

    def slices_to_grow(self, active: frozenset[int]) -> frozenset[int]:
        """Slices back that a degraded mesh grows onto at a step boundary (``resize``; none when the mesh is
        whole: slices back are spares then)."""
        return self.manager.slices_to_grow(active)

    def _slices_in_jax(self) -> contextlib.AbstractContextManager[object]:
        """Simulated slices' losses made visible to JAX for the run (``InJaxFaults``): Manager's health
        checks are pathwaysutils' pmaps, which must see a fake slice down as they see a real one."""
        if isinstance(self.slices, SimulatedSlices) and not self.slices.visible_in_jax:
            return InJaxFaults(self.slices)
        return contextlib.nullcontext()

    def resume_plan(self, active: frozenset[int], *, use_memory_tier: bool = True,
                    use_replicas: bool = True) -> ResumePlan | None:
        """Where to resume on the slices ``active`` (ckptd's answer, or the client's storage scan; agreed by
        every process of a multi-controller job); None when the job has no checkpoint yet. The request tells
        what the replica tier holds unless ``use_replicas`` is False (its restore failed)."""
        slices = [SliceAlive(index=k, devices=len(self.slices.slice_to_devices[k])) for k in sorted(active)]
        cfg = self.config
        request = ResumeRequest(
            policy=cfg.elastic.policy, alive_devices=sum(s.devices for s in slices), slices=slices,
            device_memory_bytes=cfg.memory_fit.device_memory_bytes,
            memory_headroom_bytes=cfg.memory_fit.memory_headroom_bytes,
            batch=cfg.batch.wire(), use_memory_tier=use_memory_tier,
            # who asks (docs/protocol.md, Identity); the client adds the run id of its settings
            process_count=jax.process_count(),
            replicas=self.replicas.wire() if self.replicas is not None and use_replicas else None,
        )
        try:
            plan = (self.agreement.plan(request) if self.agreement is not None
                    else self.client.resume(cfg.job, request))
        except NoCheckpointError:
            return None
        if plan is None:
            return None
        batch = plan.batch
        position = ("held with the replicas" if plan.tier == Tier.REPLICAS and plan.data_position is None
                    else plan.data_position)
        detail = (f"mesh {plan.mesh.shape} on slices {plan.slices_used} from {plan.source}, tier {plan.tier}, "
                  f"data position {position}")
        if batch:
            detail += f", batch {batch.global_batch} = {batch.accumulation_steps} x {batch.micro_batch}"
        self.emit("plan_received", plan.step, detail)
        return plan

    def _fresh_mesh(self, active: frozenset[int]) -> MeshSpec:
        alive = sum(len(self.slices.slice_to_devices[k]) for k in active)
        return plan_mesh(self.config.full_mesh, {}, alive, "resize").mesh

    def _build_mesh(self, spec: MeshSpec, slice_order: list[int]) -> Mesh:
        """Devices of the planned slices, slice by slice, reshaped to the planned mesh."""
        return build_mesh(spec, slice_order, self.slices.slice_to_devices)


__all__ = ["ElasticConfig", "ElasticContext", "ElasticResult", "ElasticRunner", "Event", "Preempted", "Recovery"]
