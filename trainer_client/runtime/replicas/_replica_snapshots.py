"""The elastic runner's use of the replica snapshot tier: when a snapshot is due (every ``period`` steps, or
paced from what the run measures), what a resume request tells ckptd of it, and the restore a ``replicas``
plan asks for (docs/concepts.md, "Three tiers" and "Pacing the replica tier").

The tier itself (``trainer_client.runtime.replicas._replica_tier``) knows nothing of runs: this module times the step
boundaries and the tier's copies (``PaceMeter``), chooses the period and the host memory kind from them
(``trainer_client.runtime.replicas._replica_pacing``: each change is reported through ``on_paced``), decides when to
snapshot (the first time with the state's footprint checked against the host budget, ``MemoryTierFull`` with
the sizes when it does not fit), turns what the tier holds into the request's ``ReplicasHeld`` (no HTTP per
step: ckptd learns of it only when the runner asks where to resume), and restores the held step onto an
attempt's mesh, leaving out the slices the last events took. A single-controller run only: in a
multi-controller job a lost process ends every process and takes its host memory's snapshot with it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax

from trainer_client.core.format._snapshot import DataIteratorRecord
from trainer_client.core.protocol import ReplicasHeld, TrainingMetadata
from trainer_client.errors import MemoryTierFull, NoWholeReplica
from trainer_client.runtime.replicas._options import ReplicaOptions
from trainer_client.runtime.replicas._replica_leaves import HOST_KINDS, PINNED, required_bytes
from trainer_client.runtime.replicas._replica_pacing import KindCosts, PaceChoice, PaceMeter, choose, worth_changing
from trainer_client.runtime.replicas._replica_tier import ReplicaStats, ReplicaTier, Restored

_log = logging.getLogger(__name__)
PyTree = Any


class RunnerReplicas:
    """One run's replica tier: made at the first snapshot (when the state's footprint is known)."""

    def __init__(self, options: ReplicaOptions, slice_to_devices: Mapping[int, Sequence[jax.Device]],
                 on_off: Callable[[str], None] | None = None,
                 on_paced: Callable[[int, PaceChoice, PaceChoice | None], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self._slice_to_devices = slice_to_devices
        self._on_off = on_off
        self._on_paced = on_paced
        self._clock = clock
        self.meter = PaceMeter()
        self.choice: PaceChoice | None = None  # the paced period and memory kind (None: not chosen yet)
        # the autopilot's period (runtime/autopilot/_autopilot_runner.py): a paced tier snapshots every
        # max(choice.period, autopilot_period) steps, so the pacer's overhead budget holds whatever it chose
        self.autopilot_period: int | None = None
        self._kinds = self._kinds_to_measure()
        self._last_snapshot: int | None = None  # the step of the last snapshot dispatched
        self._nbytes = 0  # this host's bytes of one snapshot
        self._paced_after = -1  # ``meter.cycles_closed`` when the choice was last revised
        self.tier: ReplicaTier | None = None
        self.off_reason: str | None = None  # the tier turned itself off: the host cannot hold it
        # each slice lost, with how many snapshots had been dispatched then: while the held snapshot is one of
        # those, its copies on that slice are neither offered to ckptd nor read on restore (on real hardware a
        # lost slice's host memory may be gone, or read back stale after the slice returns); a copy in flight
        # at the loss counts as taken before it
        self._lost_at: dict[int, int] = {}
        self._dispatched = 0
        self._number_of: dict[int, int] = {}  # a recent snapshot's step -> its dispatch number
        self._training_of: dict[int, TrainingMetadata] = {}  # a recent snapshot's step -> its training metadata

    def _kinds_to_measure(self) -> tuple[str, ...]:
        """The host memory kinds a paced tier chooses between: the configured one, or those the devices have."""
        if self.options.memory_kind != "auto":
            return (self.options.memory_kind,)
        devices = [d for ds in self._slice_to_devices.values() for d in ds] or jax.local_devices()
        try:
            present = {m.kind for m in devices[0].addressable_memories()}
        except Exception:  # a backend without memory spaces: pinned host memory, as before
            present = {PINNED}
        return tuple(k for k in HOST_KINDS if k in present) or (PINNED,)

    def boundary(self, step: int) -> None:
        """A step boundary (``step`` steps done): timed for the pacer. Called at every boundary, before ``due``."""
        self.meter.boundary(self._clock())

    def due(self, step: int) -> bool:
        """Whether a snapshot of ``step`` is due while the tier is on: every ``period`` steps when it is set;
        paced otherwise (after a few steps timed; while a memory kind is still unmeasured, as soon as no copy
        is in flight; then every ``choice.period`` steps). Asked before the caller gathers what goes with it."""
        if self.off_reason is not None:
            return False
        if self.options.period is not None:
            return step % self.options.period == 0
        if self.meter.step_s() is None:
            return False
        self._repace(step)
        if self._measuring() is not None:
            return self.tier is None or not self.tier.busy
        period = max(self.choice.period if self.choice is not None else 1, self.autopilot_period or 1)
        return self._last_snapshot is None or step - self._last_snapshot >= period

    def _measuring(self) -> str | None:
        """The next memory kind to measure (a paced tier measures each before it chooses), or None."""
        if self.choice is not None:
            return None
        measured = set(self.meter.kinds_measured())
        return next((k for k in self._kinds if k not in measured), None)

    def _repace(self, step: int) -> None:
        """Choose the period and kind again from the measurements (hysteresis: ``worth_changing``), once per
        snapshot whose cost became known: not at every step boundary (the loop's hot path)."""
        if self._measuring() is not None or not self._nbytes or self.meter.cycles_closed == self._paced_after:
            return
        costs = self.meter.costs(self._nbytes)
        if costs is None:
            return
        self._paced_after = self.meter.cycles_closed
        step_s, kinds = costs
        kinds = [k for k in kinds if k.kind in self._kinds]
        if not kinds:
            return
        new = choose(step_s, kinds, self._nbytes, self.options.overhead_budget)
        if not worth_changing(self.choice, new, self.options.overhead_budget):
            return
        old, self.choice = self.choice, new
        _log.info("replica snapshots paced at step %d: %s", step, new.reason)
        if self._on_paced is not None:
            self._on_paced(step, new, old)

    @property
    def paced_period(self) -> int | None:
        """The pacer's period in force (the smallest within the overhead budget); None before it chose."""
        return self.choice.period if self.choice is not None else None

    @property
    def cycles_closed(self) -> int:
        """Snapshots whose whole cost is measured: a choice made from the costs needs revising only after one."""
        return self.meter.cycles_closed

    @property
    def host_bytes(self) -> int:
        """Host memory the tier holds on this host at its peak: two copies of its share (the held one and the next,
        in flight); 0 before the first snapshot sized it."""
        return 2 * self._nbytes

    def turn_off(self, reason: str) -> None:
        """Turn the tier off for the rest of the run (the autopilot's choice: it does not fit the host's memory
        beside the other tiers): its held snapshot's memory goes back, ``on_off(reason)`` is told."""
        if self.off_reason is not None:
            return
        self.off_reason = f"replica snapshot tier off: {reason}"
        _log.warning("%s", self.off_reason)
        if self.tier is not None:
            self.tier.close()
            self.tier = None
        if self._on_off is not None:
            self._on_off(self.off_reason)

    def measured(self) -> tuple[float, KindCosts] | None:
        """The step time and the costs of the memory kind in use (the pacer's choice; with a fixed period, the
        first measured), as measured now (the pacer's window); None before a snapshot's whole cost is known."""
        costs = self.meter.costs(self._nbytes) if self._nbytes else None
        if costs is None:
            return None
        step_s, kinds = costs
        chosen = self.choice.kind if self.choice is not None else None
        return step_s, next((k for k in kinds if k.kind == chosen), kinds[0])

    def snapshot(self, step: int, state: PyTree, data_position: int,
                 iterator_state: DataIteratorRecord | None, training: TrainingMetadata | None = None) -> bool:
        """Dispatch a snapshot of ``step`` when it is due; False when not due, or skipped (one in flight).
        ``training``: the step's training metadata, which ckptd lays the replicas out from."""
        if not self.due(step):
            return False
        if self.tier is None and not self._make_tier(state):
            return False
        assert self.tier is not None
        if self.options.when_busy == "wait":
            self.tier.wait()
        kind = self._measuring() or (self.choice.kind if self.choice is not None else self._kinds[0])
        self.tier.memory_kind = kind
        if not self.tier.snapshot(step, state, data_position=data_position, iterator_state=iterator_state):
            return False
        self._last_snapshot = step
        self._dispatched += 1
        self._number_of[step] = self._dispatched
        if training is not None:
            self._training_of[step] = training
        for old in sorted(self._number_of)[:-4]:  # one held, one in flight, and a margin
            del self._number_of[old]
            self._training_of.pop(old, None)
        return True

    def prepare(self, state: PyTree) -> None:
        """Before an attempt's first step: the tier made for ``state`` (its footprint checked) and, while it
        holds nothing, the host's pinned pages for two copies of ``state`` touched (``ReplicaTier.prepare``), so
        that the first snapshot costs the loop what a later one does."""
        self.meter.reset_steps()  # a new attempt: its steps are timed afresh (the copies' costs are kept)
        self._last_snapshot = None
        if self.off_reason is not None or (self.tier is None and not self._make_tier(state)):
            return
        assert self.tier is not None
        self.tier.prepare(state)

    def _make_tier(self, state: PyTree) -> bool:
        """The tier for ``state``'s footprint. Over a budget the user set: ``MemoryTierFull`` (the run stops
        with the sizes). Over the default budget (the host's free memory): the tier turns itself off, once, with
        a warning and ``on_off(reason)`` (an event), and training goes on with the other tiers."""
        try:
            self.tier = ReplicaTier(replica_axis=self.options.replica_axis, slice_to_devices=self._slice_to_devices,
                                    state=state, budget_bytes=self.options.host_budget_bytes,
                                    memory_kind=self._kinds[0], staging=self.options.staging, meter=self.meter,
                                    clock=self._clock)
            self._nbytes = required_bytes(state, in_flight=False)
        except MemoryTierFull as exc:
            if self.options.host_budget_bytes is not None:
                raise
            self.off_reason = f"replica snapshot tier off: {exc}"
            _log.warning("%s", self.off_reason)
            if self._on_off is not None:
                self._on_off(self.off_reason)
            return False
        return True

    @property
    def lost(self) -> frozenset[int]:
        """The slices lost since the held snapshot was dispatched."""
        held = self.tier.held() if self.tier is not None else None
        number = self._number_of.get(held.step, 0) if held is not None else 0
        return frozenset(k for k, at in self._lost_at.items() if number <= at)

    def held_step(self) -> int | None:
        held = self.tier.held() if self.tier is not None else None
        return held.step if held is not None else None

    def wire(self) -> ReplicasHeld | None:
        """What a resume request says of the tier: the step held whole and each replica's slices; None when
        nothing is held (the request then leaves the tier out)."""
        held = self.tier.held() if self.tier is not None else None
        lost = self.lost
        groups = [sorted(group) for group in held.replicas if not group & lost] if held is not None else []
        if held is None or not groups:
            return None
        return ReplicasHeld(step=held.step, slices=groups, training=self._training_of.get(held.step))

    def note_lost(self, slices: Collection[int]) -> None:
        self._lost_at.update({k: self._dispatched for k in slices})

    def restore(self, target: PyTree, alive_devices: Collection[jax.Device]) -> Restored:
        """The held step onto ``target`` (a tree of ``ShapeDtypeStruct``s with shardings) from the replicas on
        ``alive_devices`` outside the lost slices; ``NoWholeReplica`` when none is whole."""
        if self.tier is None:
            raise NoWholeReplica("the replica snapshot tier has taken no snapshot in this run")
        restored = self.tier.restore(target, lost_slices=sorted(self.lost), alive_devices=alive_devices)
        self._lost_at.clear()  # the tier now holds the restored step on the new mesh's devices
        self.meter.reset_steps()  # another mesh: its steps are timed afresh (the copies' costs are kept)
        self._last_snapshot = None
        return restored

    def restored_as(self, step: int, training: TrainingMetadata) -> None:
        """The held step, restored onto a new mesh, has this layout now: what the next resume request says of it
        until a newer snapshot is held."""
        self._training_of[step] = training

    def held_arrays(self) -> list[jax.Array]:
        return self.tier.held_arrays() if self.tier is not None else []

    def stats(self) -> ReplicaStats | None:
        return self.tier.stats() if self.tier is not None else None

    def stats_fields(self) -> dict[str, Any]:
        """The tier's counters as event fields (docs/operations.md): age, skips, failures, bytes held."""
        stats = self.stats()
        if stats is None:
            return {}
        return {"replica_held_step": stats.held_step, "replica_age_seconds": stats.age_s,
                "replica_skips": stats.skips, "replica_failures": stats.failures,
                "replica_bytes_held": stats.bytes_held, **(self.choice.fields() if self.choice is not None else {})}

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()


__all__ = ["RunnerReplicas"]
