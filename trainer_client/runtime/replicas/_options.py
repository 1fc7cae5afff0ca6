"""The replica tier's options: ``ReplicaOptions``, the group ``MemoryTierOptions.replicas`` of ``ElasticConfig``
(trainer_client/runtime/elastic/_elastic_config.py), with their validation.

jax-free: the config reads it, and the tier's snapshots (``_replica_snapshots``) and the autopilot read the
options it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ReplicaOptions:
    """The replica snapshot tier: the train state copied into the accelerator hosts' pinned memory every
    ``period`` steps and restored from the replicas that survive a slice loss (docs/concepts.md, "Three
    tiers"). A single-controller run only (Pathways, one process): in a multi-controller job a lost process
    ends every process, and the shared-memory tier is the fast path there."""

    enabled: bool = True
    # a snapshot every N steps; None: paced from what the run measures (docs/concepts.md, "Pacing the replica
    # tier"): the smallest period that keeps the loop's overhead within ``overhead_budget`` and lets each copy
    # finish before the next is due, or the autopilot's longer one (``AutopilotOptions``)
    period: int | None = None
    # a snapshot due while the previous copy is still in flight: skipped and counted (the loop never waits),
    # or the loop waits for that copy (every due step is held: with ``period=1`` a loss costs at most one step,
    # and each step costs the copy's time where the copy is slower than the step, as on accelerators)
    when_busy: Literal["skip", "wait"] = "skip"
    # the mesh axis the replicas lie along (name, or index in the mesh's axes): the data-parallel axis across
    # slices. An array sharded along it has no whole replica once one of its slices is lost.
    replica_axis: str | int = 0
    # host memory the tier may take on this host (two copies of its share of the state at the peak); unset:
    # the host's free memory when the first snapshot is taken
    host_budget_bytes: int | None = None
    # the host memory the copies go to: "auto" measures pinned and unpinned host memory (a snapshot each) and
    # keeps the one a failure costs least with; or one of them
    memory_kind: Literal["auto", "pinned_host", "unpinned_host"] = "auto"
    # copy through an on-device copy of the state, which the step does not donate (None: when the devices'
    # memory statistics show room for it beside the step's peak); without it the step waits for each copy
    staging: bool | None = None
    # the loop's overhead a paced tier may cost (0.02: steps 2% slower on average)
    overhead_budget: float = 0.02

    def __post_init__(self) -> None:
        if self.period is not None and self.period < 1:
            raise ValueError(f"ReplicaOptions.period={self.period}: a snapshot every N >= 1 steps, or None (paced)")
        if not 0 < self.overhead_budget < 1:
            raise ValueError(f"ReplicaOptions.overhead_budget={self.overhead_budget}: a fraction in (0, 1)")


__all__ = ["ReplicaOptions"]
