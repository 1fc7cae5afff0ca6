"""Where a save goes: a host-memory snapshot that ckptd persists, or Orbax straight to storage.

With the memory tier on, a persistent save is a snapshot in shared memory marked ``persist``: the loop is
blocked only for the device-to-host copy and ckptd writes it to storage in the background (even if this
process dies right after). Snapshots between persistent saves (``memory_period``) stay in memory only and
bound the work a failure can lose. The loop pays the device-to-host copy whether or not ckptd answers
(snapshots marked ``persist`` wait in shared memory for it); when memory is full a persistent save goes
through Orbax directly instead (``SaveOptions.when_save_busy="skip"``: one that would wait for an
earlier direct save still being written is skipped) — training never waits on the sidecar, and never
stops saving because of it. In a multi-process job that route is agreed (``save_route.SaveRoute``): if any
host's tier is full, every process saves through Orbax (a multi-process Orbax save is collective).

Restores are the one restore loop's (``trainer_client/runtime/restore/_restore_loop.py``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Literal, NamedTuple, Protocol

import jax

from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core._errors import CkptdError
from trainer_client.core.format._snapshot import DataIteratorRecord
from trainer_client.core.protocol import MEMORY_AND_PERSIST, Tier, TrainingMetadata
from trainer_client.errors import MemoryTierFull
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.multihost._job_store import job_incarnation
from trainer_client.runtime.saving._save_route import BUSY, FULL, SaveRoute

_log = logging.getLogger(__name__)
PyTree = Any


class HealthWatch:
    """Polls ckptd's ``/healthz`` in a daemon thread, so a save never waits on it."""

    def __init__(self, client: CkptdClient, interval_s: float = 2.0) -> None:
        self.client = client
        self.interval_s = interval_s
        self.ok = client.healthy()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptd-health", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.ok = self.client.healthy()

    def stop(self) -> None:
        self._stop.set()


class StorageWriter(Protocol):
    """What a save route needs of the writer to storage: the elastic runner's ``Checkpointer``, or the
    ``CheckpointManager``'s Orbax manager (``trainer_client.runtime.orbax_compat._manager_saves.OrbaxWriter``)."""

    item: str
    last_save_blocked_s: float | None

    def is_saving(self) -> bool: ...

    def save_with_metadata(self, step: int, state: PyTree, meta: TrainingMetadata, *,
                           data_iterator: DataIteratorRecord | None = None) -> None: ...

    def wait(self) -> None: ...

    def reset(self) -> None: ...


class StepSize(NamedTuple):
    """What one save of the state writes to storage, every host together: ``nbytes`` (each array's global bytes,
    every region once, as Orbax stores it uncompressed) and ``arrays`` (the leaves stored as arrays)."""

    nbytes: int
    arrays: int


def step_size(state: PyTree) -> StepSize:
    """The ``StepSize`` of ``state`` (a leaf's ``nbytes``: a ``jax.Array``'s is its global size)."""
    nbytes = arrays = 0
    for leaf in jax.tree_util.tree_leaves(state):
        size = getattr(leaf, "nbytes", None)
        if isinstance(size, int) and size >= 0 and hasattr(leaf, "shape"):
            nbytes += size
            arrays += 1
    return StepSize(nbytes, arrays)


class Saver:
    """Routes saves to the memory tier or to Orbax, and remembers which steps were saved how. ``memory_on``: whether
    saves use the memory tier now (the autopilot turns it off where it does not fit the host's memory:
    ``use_memory_tier``); off, every save goes to Orbax as without one."""

    def __init__(self, checkpointer: StorageWriter, memory: MemoryTier | None, health: HealthWatch | None,
                 route: SaveRoute | None = None, *, settings: ClientSettings | None = None) -> None:
        self.checkpointer = checkpointer
        self.memory = memory
        self.health = health
        if route is None and memory is not None and memory.process_count > 1 and memory.incarnation is not None:
            route = SaveRoute(memory.incarnation, memory.process_index, memory.process_count, settings=settings)
        elif route is None and memory is None and jax.process_count() > 1:  # the skip is agreed all the same
            route = SaveRoute(job_incarnation(), jax.process_index(), jax.process_count(), settings=settings)
        self.route = route  # a multi-process job's agreement on each persistent save's route
        self.saved_steps: set[int] = set()
        self.last_tier: str | None = None
        self.last_blocked_s: float | None = None
        self.last_size: StepSize | None = None  # what the last save wrote (or will have ckptd write)
        self.memory_on = True
        self._said_away = False  # warned that ckptd is away, since it last answered

    def use_memory_tier(self, on: bool) -> None:
        """Saves through the memory tier (``on``) or straight to Orbax. Turned off, its spare file's memory goes back
        now (the snapshots held stay ckptd's, until persisted and evicted). In a multi-process job every process
        must turn it at the same step (the autopilot's agreed choice): a save's route is agreed as it is."""
        if on == self.memory_on:
            return
        self.memory_on = on
        if not on and self.memory is not None:
            self.memory.close()

    def save(self, step: int, state: PyTree, meta: TrainingMetadata, *, persist: bool,
             if_busy: Literal["wait", "skip"] = "wait", data_iterator: DataIteratorRecord | None = None) -> str:
        """Save ``step`` (and ``data_iterator``, the data iterator's state at it); returns the tier used
        (``memory``, ``memory+persist`` or ``storage``), or ``skipped``.

        With the memory tier the loop pays only the device-to-host copy, whether or not ckptd answers: a
        snapshot marked ``persist`` waits in shared memory until ckptd (or the one Kubernetes restarts)
        writes it. Only when the tier is full does a persistent save go to Orbax directly; and while an
        earlier direct save is still being written, ``if_busy="skip"`` skips this one rather than block the
        loop until that save is done (Orbax waits for it), with a warning. An ``OSError`` of the snapshot
        (shared memory out of space, an I/O error) counts as a full tier; ckptd's refusal of an unsafe
        directory (``UnsafePathError``) does not. In a multi-process job any other
        failure of the snapshot still answers the route (``full``) before it propagates, so the other
        processes go on to Orbax instead of waiting out the route's timeout for an answer that never comes.
        """
        tier: str = Tier.STORAGE
        # In a multi-process job each host's ckptd persists its own part and the leader commits the step once
        # every part is durable (docs/multihost.md, section 5). A full tier sends a persistent save to Orbax
        # directly: every process must then take that path alike (one multi-process Orbax save), so the
        # processes agree on it (``self.route``): one host's full tier sends every process's save to Orbax.
        full: MemoryTierFull | None = None
        busy: bool | None = None  # whether some process's previous direct save is still being written
        if self.memory is not None and self.memory_on:
            try:
                self.memory.save(step, state, meta, persist=persist, data_iterator=data_iterator,
                                 item=self.checkpointer.item)
                tier = MEMORY_AND_PERSIST if persist else Tier.MEMORY
                self.last_blocked_s = self.memory.last_blocked_s
                away = persist and self.health is not None and not self.health.ok
                if away and not self._said_away:  # once per outage, not once per save
                    _log.warning("ckptd is not answering: step %s waits in shared memory until it is back, and so "
                                 "do the next saves (until the memory tier is full; then they go to storage "
                                 "directly)", step)
                self._said_away = away or (self._said_away and not persist)
            except Exception as exc:
                # shared memory out of space or failing (ENOSPC, EIO): as full. Not a refusal of ckptd's own
                # (UnsafePathError, a PermissionError: a directory others may write), which stands.
                shm_failed = isinstance(exc, OSError) and not isinstance(exc, CkptdError)
                if not isinstance(exc, MemoryTierFull) and not shm_failed:
                    if persist and self.route is not None:  # the others wait for this process's answer
                        self.route.tell(step, FULL + BUSY if self.checkpointer.is_saving() else FULL)
                    raise
                if not persist:
                    _log.info("memory snapshot of step %s skipped: %s", step, exc)
                    return "skipped"
                full = exc if isinstance(exc, MemoryTierFull) else MemoryTierFull(
                    f"the snapshot of step {step} failed: {exc!r}")
            if persist and self.route is not None:
                in_memory, busy = self.route.agree(step, full is None, self.checkpointer.is_saving())
                if not in_memory:
                    tier = Tier.STORAGE  # another host's tier (or this one's) is full: every process saves to storage
            if full is not None:
                _log.warning("memory tier full, saving step %s through Orbax: %s", step, full)
        if tier == Tier.STORAGE:
            if busy is None:  # no memory tier: every save goes to storage; a multi-process job agrees on the skip
                busy = (self.route.agree(step, False, self.checkpointer.is_saving())[1] if self.route is not None
                        else self.checkpointer.is_saving())
            if if_busy == "skip" and busy:
                _log.warning("save of step %s skipped: the previous save to storage is still being written, and "
                             "waiting for it would stall training (the next periodic save tries again)", step)
                self.last_blocked_s = 0.0
                return "skipped"
            self.checkpointer.save_with_metadata(step, state, meta, data_iterator=data_iterator)
            self.last_blocked_s = self.checkpointer.last_save_blocked_s
        self.saved_steps.add(step)
        self.last_tier = tier
        self.last_size = step_size(state)
        return tier

    def wait(self) -> None:
        self.checkpointer.wait()

    def reset(self) -> None:
        self.checkpointer.reset()

    def close(self) -> None:
        if self.health is not None:
            self.health.stop()
        if self.memory is not None:
            self.memory.close()


__all__ = ["HealthWatch", "Saver", "StepSize", "StorageWriter", "step_size"]
