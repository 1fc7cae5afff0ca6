"""Where a save goes: a host-memory snapshot that ckptd persists, or Orbax straight to storage.

With the memory tier on, a persistent save is a snapshot in shared memory marked ``persist``: the loop is
blocked only for the device-to-host copy and ckptd writes it to storage in the background (even if this
process dies right after). Snapshots between persistent saves (``memory_period``) stay in memory only and
bound the work a failure can lose. If ckptd is not answering its health check, or memory is full, a
persistent save goes through Orbax directly instead — training never waits on the sidecar, and never
stops saving because of it.

``restore_from_plan`` reads a plan's step from whichever tier the plan names.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from trainer_client.client.ckptd_client import CkptdClient
from trainer_client.core.protocol import ResumePlan, TrainingMetadata
from trainer_client.errors import MemoryTierFull
from trainer_client.runtime.checkpointing import Checkpointer, restore
from trainer_client.runtime.memory_tier import MemoryTier, restore_snapshot

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


class Saver:
    """Routes saves to the memory tier or to Orbax, and remembers which steps were saved how."""

    def __init__(self, checkpointer: Checkpointer, memory: MemoryTier | None, health: HealthWatch | None) -> None:
        self.checkpointer = checkpointer
        self.memory = memory
        self.health = health
        self.saved_steps: set[int] = set()
        self.last_tier: str | None = None
        self.last_blocked_s: float | None = None

    def save(self, step: int, state: PyTree, meta: TrainingMetadata, *, persist: bool) -> str:
        """Save ``step``; returns the tier used (``memory``, ``memory+persist`` or ``storage``)."""
        tier = "storage"
        if self.memory is not None and (not persist or (self.health is not None and self.health.ok)):
            try:
                self.memory.save(step, state, meta, persist=persist)
                tier = "memory+persist" if persist else "memory"
                self.last_blocked_s = self.memory.last_blocked_s
            except MemoryTierFull as exc:
                if not persist:
                    _log.info("memory snapshot of step %s skipped: %s", step, exc)
                    return "skipped"
                _log.warning("memory tier full, saving step %s through Orbax: %s", step, exc)
        if tier == "storage":
            self.checkpointer.save_with_metadata(step, state, meta)
            self.last_blocked_s = self.checkpointer.last_save_blocked_s
        self.saved_steps.add(step)
        self.last_tier = tier
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


def restore_from_plan(plan: ResumePlan, target: PyTree) -> PyTree:
    """The plan's step onto ``target``'s shardings, from host memory or from storage."""
    if plan.tier == "memory":
        return restore_snapshot(plan.path, target)
    return restore(plan.path, target)


__all__ = ["HealthWatch", "Saver", "restore_from_plan"]
