"""What one attempt of the user's training function gets from the elastic runner: ``ElasticContext``.

The mesh and resume plan of the attempt, compile-ahead's executable for exactly that mesh (``precompiled``),
``restore_or_init`` (the plan's step onto this mesh, and the
data iterator's state saved with it), ``save`` and the ``step_boundary`` hook (periodic saves, injected
faults, the start of compile-ahead, growing back under ``resize``). The loop around attempts
(``trainer_client.runtime.elastic._elastic``) imports this module, never the other way, and the context never
holds the runner: when an attempt starts, the runner hands it the parts of the run it uses (``AttemptParts``:
the config, the saver, the replica tier, the precompiler, the autopilot, ...) and its hooks as plain callables
(``AttemptHooks``: ``emit``, ``resume_plan``, ...).

``Preempted`` is control flow, not an error: like every ``RunnerSignal`` it derives from ``BaseException``
(as ``KeyboardInterrupt`` does), so a training function's ``except CkptdError`` or ``except Exception``
around its step never swallows it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from pathwaysutils.elastic.manager import ScaleUpSignalError

from trainer_client.config import ClientSettings
from trainer_client.core._batching import initial_batch
from trainer_client.core.format._snapshot import DataIteratorRecord
from trainer_client.core.protocol import BatchPlan, ResumePlan, Tier, TrainingMetadata
from trainer_client.errors import NoWholeReplica
from trainer_client.runtime.autopilot._autopilot_runner import RunnerAutopilot
from trainer_client.runtime.compilation._precompile import Precompiled, PrecompileHook, Precompiler
from trainer_client.runtime.elastic._elastic_config import ElasticConfig
from trainer_client.runtime.multihost._job_store import preemption_reached
from trainer_client.runtime.multihost._multihost import ResumeAgreement
from trainer_client.runtime.replicas._replica_held import Restored
from trainer_client.runtime.replicas._replica_snapshots import RunnerReplicas
from trainer_client.runtime.restore._restore_loop import restore_by_plan, restore_from_plan
from trainer_client.runtime.saving._checkpointing import mesh_spec, target_shardings, training_metadata
from trainer_client.runtime.saving._data_iterator import (
    DataIterator,
    planned_state,
    restore_iterator,
    set_iterator_state,
    state_record,
)
from trainer_client.runtime.saving._saver import Saver
from trainer_client.runtime.slices._slices import SliceProvider

PyTree = Any
_log = logging.getLogger(__name__)


class RunnerSignal(BaseException):
    """Control flow between an attempt and its runner, not an error: a ``BaseException`` outside the
    ``CkptdError`` tree, so ``except CkptdError`` and ``except Exception`` in a training function let it
    through to ``ElasticRunner``, which handles every one (none leaves ``run``)."""


class Preempted(RunnerSignal):
    """Raised by ``step_boundary`` at the step where every process of a multi-controller job agreed to stop
    after a preemption notice (SIGTERM), once that step is saved to storage; ``ElasticRunner`` ends the run
    cleanly (``ElasticResult.preempted``)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"preempted: step {step} saved to storage, stopping")
        self.step = step


class Emit(Protocol):
    """The runner's event hook: ``emit(kind, step, detail, **fields)`` records and reports an event."""

    def __call__(self, kind: str, step: int | None = None, detail: str = "", **fields: Any) -> None: ...


class AskResumePlan(Protocol):
    """The runner's question to ckptd (or storage, or the multi-controller agreement): where to resume on the
    slices ``active``, without the memory tier or the replicas when told so; None when no tier holds a step."""

    def __call__(self, active: frozenset[int], *, use_memory_tier: bool = True,
                 use_replicas: bool = True) -> ResumePlan | None: ...


@dataclass(frozen=True)
class AttemptParts:
    """The parts of the run an attempt uses, as the runner (``ElasticRunner``) built them: handed to the
    attempt's context when the attempt starts; the context never holds the runner itself."""

    config: ElasticConfig
    settings: ClientSettings
    slices: SliceProvider
    saver: Saver
    precompiler: Precompiler
    autopilot: RunnerAutopilot
    replicas: RunnerReplicas | None = None  # the replica snapshot tier, when the run has one
    agreement: ResumeAgreement | None = None  # a multi-controller job's resume agreement


@dataclass(frozen=True)
class AttemptHooks:
    """What an attempt tells its runner or asks of it, as plain callables (as pathwaysutils' ``Manager`` takes
    its callbacks)."""

    emit: Emit
    resume_plan: AskResumePlan  # the next plan when the restore of one fails (without that tier)
    note_restored: Callable[[ResumePlan | None], None]  # the plan restored (None: a fresh start)
    first_step_done: Callable[[int], None]  # the attempt's first step is done: the recovery ends
    slices_to_grow: Callable[[frozenset[int]], frozenset[int]]  # slices back that a degraded mesh grows onto


class ElasticContext:
    """What one attempt of the training function gets: the mesh, the plan, and the step hooks."""

    def __init__(self, parts: AttemptParts, hooks: AttemptHooks, mesh: Mesh, plan: ResumePlan | None,
                 active: frozenset[int], precompiled: Precompiled | None = None):
        if precompiled is not None and not precompiled.fits(mesh):  # never run on other devices than its own
            devices = precompiled.key[2]
            raise ValueError(f"an executable precompiled for devices {devices} given to a different mesh")
        self._precompiled = precompiled
        self._parts = parts
        self._hooks = hooks
        self.mesh = mesh
        self.plan = plan
        self.active_slices = active
        cfg = parts.config
        self.batch: BatchPlan = plan.batch if plan is not None and plan.batch is not None else initial_batch(
            cfg.global_batch, mesh_spec(mesh), cfg.batch.batch_mode
        )
        self.start_step = plan.step if plan is not None else 0  # a failure before the restore: this step
        self.last_step: int | None = None
        self._first_step_done = False
        self._last_scale_check = time.monotonic()
        self._precompile: PrecompileHook | None = None
        self._precompiling = False
        self._data_iterator: DataIterator | None = None
        self._persisted: set[int] = set()  # steps this attempt saved to storage (or had ckptd persist)
        self._training: TrainingMetadata | None = None  # the attempt's layout, for the replica snapshots
        # a multi-controller job: SIGTERM is a preemption notice
        self._preemptible = parts.agreement is not None

    def set_precompile(self, hook: PrecompileHook) -> None:
        """Register ``hook(mesh, batch_plan)``: lower and compile the training step for ``mesh``. The runner
        calls it in the background for the meshes an elastic event would lead to next; what it returns (e.g.
        ``jit(step).lower(...).compile()``) is kept, and the attempt after an event onto exactly that mesh
        gets it as ``precompiled``."""
        self._precompile = hook

    @property
    def precompiled(self) -> Precompiled | None:
        """What the precompile hook returned for exactly this attempt's mesh (the same devices in the same
        order) before the elastic event that led here, or None (the first attempt, a hook that returns
        nothing, a mesh that was not compiled ahead). ``.executable`` is the hook's object, e.g. a
        ``jax.stages.Compiled``, to call instead of the jitted step: no trace, no compile. ``.batch`` is the
        batch plan it was compiled for; use it only when that matches ``batch`` (the step's shapes and lr
        scale), the jitted step otherwise."""
        return self._precompiled

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step on this mesh (``batch.accumulation_steps`` microbatches)."""
        return self.batch.global_batch

    # ---- state ----------------------------------------------------------------------------------

    def restore_or_init(
        self, init_fn: Callable[[], PyTree], specs_fn: Callable[[PyTree], PyTree], *,
        data_iterator: DataIterator | None = None,
    ) -> tuple[PyTree, int, int]:
        """``(state, step, data_position)``: restored from the plan's step onto this mesh, or freshly
        initialised (step 0, position 0) when the job has no committed checkpoint yet.

        ``specs_fn(abstract_state)`` gives a ``PartitionSpec`` per leaf in this mesh's axis names.
        ``data_iterator``: a Grain ``DataLoaderIterator``/``DatasetIterator`` (anything with ``get_state`` and
        ``set_state``), made fresh by this attempt. It is set to the state saved with the plan's step, so its
        next batch is the one that would have come next, and every save of this attempt saves its state (the
        step's item ``iter``, in Grain's format: ``trainer_client.runtime.saving._data_iterator``). Take the next
        batch from it only after ``step_boundary``: the state saved with a step is the iterator's there.
        """
        self._data_iterator = data_iterator
        abstract = jax.eval_shape(init_fn)
        specs = specs_fn(abstract)
        memory = self._parts.saver.memory
        if memory is not None and self.plan is not None:
            memory.hold_spare()  # a spare's page-touching waits: the restore and the first step come first
        restored = self._restore(abstract, specs) if self.plan is not None else None
        if isinstance(restored, Restored):  # the tier goes on from the state it restored
            return self._from_replicas(restored)
        if restored is None:
            shardings = jax.tree_util.tree_map(
                lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
            )
            state = jax.jit(init_fn, out_shardings=shardings)()
            self.start_step, position = 0, 0
            self._hooks.emit("initialized", 0, f"fresh state on mesh {list(self.mesh.devices.shape)}")
            self._hooks.note_restored(None)
        else:
            state, held = restored
            plan = self.plan
            assert plan is not None
            self.start_step = plan.step
            position = plan.data_position or 0
            detail = f"from {plan.tier}: {plan.path}"
            if data_iterator is not None:  # from the step actually restored (the plan may have fallen back)
                detail += ", data iterator restored" if restore_iterator(plan, data_iterator, held) else (
                    ", no data iterator state saved with the step: the iterator starts where it is")
            self._hooks.emit("restored", plan.step, detail, tier=Tier(plan.tier).value)
            self._hooks.note_restored(plan)
        # host pages touched before the first snapshot of each tier, so that it costs what a later one does
        if self._parts.replicas is not None:
            self._parts.replicas.prepare(state)
        if self._parts.saver.memory is not None:
            self._parts.saver.memory.prepare(state)  # in the background
        self.last_step = self.start_step
        return state, self.start_step, position

    def _restore(self, abstract: PyTree, specs: PyTree) -> Restored | tuple[PyTree, Any] | None:
        """The plan's step through the one restore loop (``trainer_client/runtime/restore/_restore_loop.py``; agreed by
        every process of a multi-controller job): the replicas' restore, or ``(state, the data iterator's state
        read with a memory snapshot)``; None when the replicas did not read back and no other tier holds a
        step (a fresh start). ``self.plan`` becomes the plan restored."""
        parts, active, plan = self._parts, self.active_slices, self.plan
        assert plan is not None
        target_for = lambda chosen: target_shardings(abstract, self.mesh, specs, chosen.arrays)  # noqa: E731
        held: list[tuple[ResumePlan, Any]] = []  # a memory snapshot's iterator state, read before its arrays

        def read_held(chosen: ResumePlan) -> None:  # ckptd may evict the snapshot once its arrays are mapped
            if self._data_iterator is not None and chosen.tier == Tier.MEMORY:
                with contextlib.suppress(OSError, ValueError):  # gone or unusable: the restore falls back
                    held.append((chosen, planned_state(chosen)))

        def restore_step(chosen: ResumePlan) -> Any:
            if chosen.tier == Tier.REPLICAS:
                return self._replicas_restore(chosen, target_for(chosen))
            read_held(chosen)
            return restore_from_plan(chosen, target_for(chosen), parts.settings.restore_host_bytes)

        def without(excluded: frozenset[Tier]) -> ResumePlan | None:  # the next plan: ckptd asked again
            return self._hooks.resume_plan(active, use_memory_tier=Tier.MEMORY not in excluded,
                                           use_replicas=Tier.REPLICAS not in excluded)

        done: tuple[Any, ResumePlan] | None
        if parts.agreement is not None:
            read_held(plan)
            done = parts.agreement.restore(plan, target_for)
        else:
            done = restore_by_plan(plan, restore_step, without)
        self.plan = None if done is None else done[1]
        if done is None or isinstance(done[0], Restored):
            return None if done is None else done[0]
        jax.block_until_ready(done[0])
        return done[0], next((state for read, state in held if read is done[1]), None)

    def _replicas_restore(self, plan: ResumePlan, target: PyTree) -> Restored:
        """The plan's step from the replicas on the slices left (``replica_snapshots``); ``NoWholeReplica`` when
        no whole replica survives (none reads back whole), told as the event ``replicas_unusable``."""
        replicas = self._parts.replicas
        try:
            if replicas is None:
                raise NoWholeReplica("this run has no replica snapshot tier")
            return replicas.restore(target, list(self.mesh.devices.flat))
        except NoWholeReplica as exc:  # a slice lost during the restore itself is a slice loss: raised on
            self._hooks.emit("replicas_unusable", plan.step,
                             f"{type(exc).__name__}: {exc}"[:500] + "; asking for another tier")
            raise

    def _from_replicas(self, restored: Restored) -> tuple[PyTree, int, int]:
        """The replicas' step restored, with the data position and iterator state held with it."""
        plan = self.plan
        replicas = self._parts.replicas
        assert plan is not None and replicas is not None
        self.start_step = restored.step
        position = restored.data_position
        detail = f"from replicas in host memory (step {restored.step})"
        if self._data_iterator is not None:
            record = restored.iterator_state
            if isinstance(record, DataIteratorRecord):
                set_iterator_state(self._data_iterator, record.state)
                detail += ", data iterator restored"
            else:
                detail += ", no data iterator state held with the step: the iterator starts where it is"
        self.plan = plan.model_copy(update={"data_position": position})
        replicas.restored_as(restored.step, self._training_at(restored.step, restored.state, position))
        self._hooks.emit("restored", restored.step, detail, tier=Tier.REPLICAS.value)
        self._hooks.note_restored(self.plan)
        self.last_step = self.start_step
        return restored.state, self.start_step, position

    def save(self, step: int, state: PyTree, data_position: int, *, persist: bool = True,
             if_busy: Literal["wait", "skip"] = "wait") -> str:
        """Save ``state`` as ``step`` (the loop is blocked only for the device-to-host copy): to storage
        (through ckptd's memory tier when it is on), or only to host memory when ``persist`` is False.
        ``if_busy="skip"`` (the periodic saves) skips a direct save that would wait for the previous one. The
        data iterator given to ``restore_or_init`` is saved with it, as it is now. Returns the tier used
        (``memory``, ``memory+persist``, ``storage``) or ``skipped``."""
        meta = training_metadata(step, state, data_position=data_position, global_batch=self.global_batch,
                                 mesh=self.mesh, slices=sorted(self.active_slices), batch=self.batch,
                                 run_id=self._parts.settings.run_id)
        saver = self._parts.saver
        with self._parts.precompiler.paused():  # a save's Python must not queue for the GIL behind tracing
            tier = saver.save(step, state, meta, persist=persist, if_busy=if_busy, data_iterator=(
                state_record(self._data_iterator) if self._data_iterator is not None else None))
        if persist and tier != "skipped":
            self._persisted.add(step)
        self._start_precompile()  # after the attempt's first save: its first-time costs are paid alone
        replicas = self._parts.replicas
        self._hooks.emit("checkpoint_started", step, f"{tier}, {saver.last_blocked_s or 0.0:.3f}s blocked",
                         blocked_seconds=saver.last_blocked_s, tier=tier,
                         **(replicas.stats_fields() if replicas is not None else {}))
        return tier

    def _start_precompile(self) -> None:
        cfg = self._parts.config
        if not self._first_step_done or self._precompile is None or self._precompiling:
            return
        if cfg.compilation.precompile:
            self._precompiling = True  # one pass per attempt
            devices = self._parts.slices.slice_to_devices
            self._parts.precompiler.start(self._precompile, mesh_spec(self.mesh), self.active_slices, devices,
                                          self.batch, cfg.batch.wire())

    # ---- the hook called at the top of every step -----------------------------------------------

    def step_boundary(self, step: int, state: PyTree, data_position: int) -> None:
        """Call before computing ``step`` (``state`` holds ``step`` completed steps).

        Reports the first step done after a recovery, fires injected faults (CPU simulation), saves at the
        periods in force (``runtime/autopilot/_autopilot_runner.py``), and under ``resize`` grows back when lost slices
        have returned. In a multi-controller job, once a preemption notice (SIGTERM to any process) reached the
        step every process agreed on (``multihost_utils.reached_preemption_sync_point``, asked at every step),
        saves ``step`` to storage, waits for it and raises ``Preempted``: the runner ends the run cleanly.
        """
        if self._preemptible and preemption_reached(step):
            self._stop_for_preemption(step, state, data_position)
        if not self._first_step_done and step > self.start_step:
            jax.block_until_ready(state)
            self._first_step_done = True
            if self._parts.saver.memory is not None:
                self._parts.saver.memory.release_spare()
            self._hooks.first_step_done(step)
        cfg = self._parts.config
        self.last_step = step
        later = step > self.start_step
        replicas = self._parts.replicas
        if replicas is not None:
            replicas.boundary(step)  # timed: the pacer's step time
        live = self._parts.autopilot.at_boundary(step)  # the periods in force: the config's, or chosen as it runs
        period = live.persist
        if replicas is not None and replicas.due(step) and (later or replicas.held_step() != step):
            # the iterator's state and the metadata gathered only for a snapshot that is due
            iterator = state_record(self._data_iterator) if self._data_iterator is not None else None
            # dispatched: the copy runs on
            replicas.snapshot(step, state, data_position, iterator, self._training_at(step, state, data_position))
        self._parts.slices.at_step_boundary(step, self.active_slices)
        if later and period > 0 and step % period == 0:
            self.save(step, state, data_position, if_busy=cfg.saving.when_save_busy)
        elif later and live.memory and step % live.memory == 0 and cfg.memory_tier.shm_dir:
            self.save(step, state, data_position, persist=False)
        if not self._precompiling and (period <= 0 or step >= self.start_step + period):
            self._start_precompile()  # no save came first (one in this boundary started it already)
        if cfg.elastic.policy == "resize":
            self._maybe_scale_up(step, state, data_position)

    def _training_at(self, step: int, state: PyTree, data_position: int) -> TrainingMetadata:
        """The training metadata of ``step``: the attempt's mesh and arrays (read from the state once per
        attempt) with this step's number, data position and time."""
        if self._training is None:
            self._training = training_metadata(
                step, state, data_position=data_position, global_batch=self.global_batch, mesh=self.mesh,
                slices=sorted(self.active_slices), batch=self.batch, run_id=self._parts.settings.run_id)
        return self._training.model_copy(update={"step": step, "data_position": data_position,
                                                 "wall_time": time.time()})

    def _stop_for_preemption(self, step: int, state: PyTree, data_position: int) -> None:
        plan = self.plan
        restored_from_storage = step == self.start_step and plan is not None and plan.tier != Tier.MEMORY
        if step not in self._persisted and not restored_from_storage:
            self.save(step, state, data_position, persist=True)
        self._parts.saver.wait()
        self._hooks.emit("preempted", step, f"preemption notice: step {step} saved to storage, stopping")
        raise Preempted(step)

    def _maybe_scale_up(self, step: int, state: PyTree, data_position: int) -> None:
        now = time.monotonic()
        if now - self._last_scale_check < self._parts.config.health.scale_up_check_interval_s:
            return
        self._last_scale_check = now
        # what pathwaysutils' monitor thread found healthy among the slices not in use (none while the mesh is
        # whole: those are hot spares): no check here
        back = self._hooks.slices_to_grow(self.active_slices)
        if not back:
            return
        if step not in self._parts.saver.saved_steps:
            tier = self.save(step, state, data_position, persist=self._parts.saver.memory is None)
            if tier == "skipped":  # the memory tier is full: the step we grow from goes to storage instead,
                # or the next attempt would lose the steps since
                self.save(step, state, data_position, persist=True)
        self._parts.saver.wait()  # the step we grow from must be whole (in memory) or committed
        raise ScaleUpSignalError(f"slice(s) {sorted(back)} healthy again at step {step}")


__all__ = ["AttemptHooks", "AttemptParts", "ElasticContext", "Preempted", "RunnerSignal"]
