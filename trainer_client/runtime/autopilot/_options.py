"""The autopilot's options: ``AutopilotOptions``, the group ``autopilot`` of ``ElasticConfig``
(trainer_client/runtime/elastic/_elastic_config.py), with their validation; the runner's autopilot
(``_autopilot_runner``) reads them.

jax-free: the config reads it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AutopilotOptions:
    """The autopilot: the periods of the replica snapshots, the shared-memory snapshots and the persistent saves
    re-chosen during the run from their measured costs and the failures seen (docs/planning.md, "Autopilot in a
    run"). It chooses only the periods left unset (``ReplicaOptions.period``, ``MemoryTierOptions.memory_period``,
    ``ElasticConfig.checkpoint_period``); one that is set stays as it is and the others are chosen around it. In a
    multi-controller job process 0 chooses and every process applies its choice at the same step (the options must
    be the same in every process)."""

    enabled: bool = True
    # the job's mean time between failures expected before the run has seen any (the prior, worth one failure);
    # None: no guess: the periods stay as configured until ``min_failures`` failures are known (the job's earlier
    # runs' as ckptd counts them, and this run's), whose mean interval is then the prior
    mtbf_hours: float | None = None
    min_failures: int = 3
    # the most steps a failure may lose on average (every period shortened alike to keep it; None: no bound)
    max_lost_steps: float | None = None
    # a new choice replaces the periods in force only when it is expected to gain more goodput than this
    # (0.001: 0.1 point), or when they break a constraint
    min_gain: float = 0.001
    # (at least, at most) steps between saves of each tier (None: no upper bound); a bound the replica tier's
    # overhead budget or a copy's time exceeds gives way to them
    replica_bounds: tuple[int, int | None] = (1, None)
    memory_bounds: tuple[int, int | None] = (1, None)
    persist_bounds: tuple[int, int | None] = (1, None)
    # what the host-memory tiers (replica snapshots, shared-memory snapshots and the spare file kept for the next
    # one) may hold together on each host; a tier that does not fit beside the others is turned off. None: the
    # host's memory limit (its cgroup's, else the machine's) less a quarter
    host_memory_budget_bytes: int | None = None
    # the storage the job's saves may use on average, every host together (None: no limit): a save's bytes over
    # the bandwidth, and its requests over the request rate, are the shortest period of the tiers that write
    storage_bytes_per_s: float | None = None
    storage_requests_per_s: float | None = None
    # requests one persistent save makes, every host together; None: estimated from the save's arrays and the
    # processes (trainer_client/runtime/autopilot/_autopilot_costs.py, ``estimated_requests``)
    storage_requests_per_save: float | None = None

    def __post_init__(self) -> None:
        for name in ("host_memory_budget_bytes", "storage_bytes_per_s", "storage_requests_per_s",
                     "storage_requests_per_save"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"AutopilotOptions.{name}={value}: > 0 and finite, or None")
        if self.mtbf_hours is not None and not 0 < self.mtbf_hours < float("inf"):
            raise ValueError(f"AutopilotOptions.mtbf_hours={self.mtbf_hours}: hours > 0, or None (learned)")
        if self.min_failures < 1 or not 0 <= self.min_gain < 1:
            raise ValueError("AutopilotOptions: min_failures >= 1 and min_gain in [0, 1)")
        if self.max_lost_steps is not None and not self.max_lost_steps > 0:
            raise ValueError(f"AutopilotOptions.max_lost_steps={self.max_lost_steps}: > 0, or None")
        for name in ("replica_bounds", "memory_bounds", "persist_bounds"):
            low, high = getattr(self, name)
            if low < 1 or (high is not None and high < low):
                raise ValueError(f"AutopilotOptions.{name}={(low, high)}: 1 <= at least <= at most")


__all__ = ["AutopilotOptions"]
