"""What the elastic runner needs to know about a job: ``ElasticConfig``, composed of small option groups.

The job and its mesh (``job``, ``mesh_axes``, ``mesh_shape``, ``global_batch``) and the save period are
``ElasticConfig``'s own fields; everything else comes in one frozen group per concern, each with defaults, the
way Orbax's ``CheckpointManagerOptions`` composes ``AsyncOptions``, ``MultiprocessingOptions`` and
``FileOptions``: ``ElasticOptions`` (the policy after a slice loss, retries, hot spares),
``BatchScalingOptions`` (the batch on a resized mesh), ``MemoryFitOptions`` (the device memory a plan must
fit), ``HealthOptions`` (the waits and health checks), ``MemoryTierOptions`` (the host-memory tiers: ckptd's
shared-memory snapshots, and ``ReplicaOptions`` for the replica snapshots in the accelerator hosts' memory),
``CompilationOptions``, ``SaveOptions`` and ``AutopilotOptions`` (the periods the user leaves unset, chosen during
the run). docs/maxtext.md maps MaxText's flags onto them. A keyword that
names a group's field on ``ElasticConfig`` itself (``ElasticConfig(shm_dir=...)``) is refused with its
spelling in the group, never ignored.

jax-free: the runner (``trainer_client.runtime.elastic._elastic``) and the attempt's context
(``trainer_client.runtime.elastic._elastic_context``) both read it.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from trainer_client.core.protocol import BatchOptions, MeshSpec


@dataclass(frozen=True)
class ElasticOptions:
    """What happens after a slice loss (MaxText's elastic flags)."""

    policy: Literal["pause", "resize"] = "resize"  # with spare_slices: what happens when no spare is healthy
    elastic_timeout_s: float = 300.0
    elastic_max_retries: int = 10
    min_slices: int = 1
    # hot spares: slices of the allocation the mesh leaves idle; a healthy one takes a lost slice's place
    # (the mesh keeps its shape). The mesh (mesh_shape) uses the other slices.
    spare_slices: int = 0


@dataclass(frozen=True)
class BatchScalingOptions:
    """The global batch and the learning rate on a resized mesh (docs/concepts.md)."""

    batch_mode: Literal["keep_global_batch", "scale_batch"] = "keep_global_batch"
    lr_scaling: Literal["none", "linear", "sqrt"] = "linear"

    def wire(self) -> BatchOptions:
        """As a resume request and the planner take them."""
        return BatchOptions(mode=self.batch_mode, lr_scaling=self.lr_scaling)


@dataclass(frozen=True)
class MemoryFitOptions:
    """The device memory a planned mesh must fit the state into (unset: not checked)."""

    device_memory_bytes: int | None = None
    memory_headroom_bytes: int = 0


@dataclass(frozen=True)
class HealthOptions:
    """How often slices are waited for and health-checked."""

    poll_interval_s: float = 0.25  # the wait for slices after an event (pathwaysutils' health check)
    # how often a step boundary looks for slices back (no health check)
    scale_up_check_interval_s: float = 1.0
    # background health checks of the slices not in use (pathwaysutils' monitor)
    monitor_interval_s: float = 1.0


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


@dataclass(frozen=True)
class MemoryTierOptions:
    """The host-memory tiers: ckptd's shared-memory snapshots (off unless a directory is set) and the replica
    snapshots in the accelerator hosts' pinned memory (``replicas``; on by default).

    The shared-memory directory is one setting, ``CKPTD_SHM_DIR`` (``ClientSettings.shm_dir``, read once per
    process), which ckptd is given too: ``shm_dir`` defaults to the runner's client's. Given here it overrides
    it (``""``: the tier off whatever the client's says); naming another directory than the client's is
    deprecated (``ElasticConfig.with_shm_dir`` warns)."""

    shm_dir: str | None = None  # host-memory tier: a shared-memory directory ckptd also sees (None: the client's)
    # memory-only snapshots every N steps (between persistent saves); None: chosen by the autopilot (none without it)
    memory_period: int | None = None
    max_snapshots: int = 2
    preallocate_snapshots: bool = True  # allocate the next snapshot's shm file in the background after a save
    replicas: ReplicaOptions = field(default_factory=ReplicaOptions)


@dataclass(frozen=True)
class CompilationOptions:
    """Compiled steps kept across an elastic event, and compiled ahead for the next meshes."""

    # JAX's persistent compilation cache (shared with relaunches); unset: a private one under the temp dir,
    # unless one is configured already (it carries compiled steps across the cache clear after an event)
    compilation_cache_dir: str | None = None
    precompile: bool = True  # compile the likely next meshes in the background (needs ctx.set_precompile)


@dataclass(frozen=True)
class SaveOptions:
    """How each save to storage is written."""

    # a periodic save while the previous save to storage is still being written: waits for it (Orbax's way),
    # or is skipped so the loop never waits (fewer checkpoints when saves take longer than checkpoint_period)
    when_save_busy: Literal["wait", "skip"] = "wait"
    checkpoint_item: str = "default"  # the Orbax item of the state in each step (MaxText's steps: "items")
    async_save: bool = True  # Orbax writes in the background (MaxText's async_checkpointing); False: blocking


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


@dataclass(frozen=True)
class ElasticConfig:
    """What the runner needs to know about the job (MaxText-style elastic options, grouped by concern)."""

    job: str
    mesh_axes: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    global_batch: int
    # a persistent save every N steps (0: none); None: chosen by the autopilot (every 10 steps until it chooses,
    # and without it)
    checkpoint_period: int | None = None
    elastic: ElasticOptions = field(default_factory=ElasticOptions)
    batch: BatchScalingOptions = field(default_factory=BatchScalingOptions)
    memory_fit: MemoryFitOptions = field(default_factory=MemoryFitOptions)
    health: HealthOptions = field(default_factory=HealthOptions)
    memory_tier: MemoryTierOptions = field(default_factory=MemoryTierOptions)
    compilation: CompilationOptions = field(default_factory=CompilationOptions)
    saving: SaveOptions = field(default_factory=SaveOptions)
    autopilot: AutopilotOptions = field(default_factory=AutopilotOptions)

    def __new__(cls, *args: Any, **kwargs: Any) -> ElasticConfig:
        moved = sorted(set(kwargs) & set(_MOVED))
        if moved:
            raise TypeError("; ".join(_new_spelling(name) for name in moved))
        return super().__new__(cls)

    def with_shm_dir(self, client_dir: str | None) -> ElasticConfig:
        """This config with its host-memory tier's one directory: ``memory_tier.shm_dir`` when given, else
        ``client_dir`` (the runner's client's ``ClientSettings.shm_dir``: ``CKPTD_SHM_DIR``). A directory given
        here apart from the client's is deprecated: the client's own plan from storage, when ckptd is down,
        looks in the client's, so a snapshot in the tier's would be missed."""
        given = self.memory_tier.shm_dir
        if given is None:
            return self if client_dir is None else replace(self, memory_tier=replace(self.memory_tier,
                                                                                     shm_dir=client_dir))
        if given and (client_dir is None or os.path.normpath(given) != os.path.normpath(client_dir)):
            warnings.warn(f"MemoryTierOptions(shm_dir={given!r}) apart from the client's shared-memory directory "
                          f"({client_dir!r}: CKPTD_SHM_DIR, ClientSettings.shm_dir) is deprecated: set "
                          "CKPTD_SHM_DIR (or ClientSettings(shm_dir=...)), the one directory the runner snapshots "
                          "into and the client's plan from storage reads; MemoryTierOptions.shm_dir defaults to it",
                          DeprecationWarning, stacklevel=3)
        return self

    @property
    def full_mesh(self) -> MeshSpec:
        return MeshSpec(axis_names=list(self.mesh_axes), shape=list(self.mesh_shape))


_GROUPS: dict[str, type] = {f.name: f.default_factory for f in fields(ElasticConfig)  # type: ignore[misc]
                            if isinstance(f.default_factory, type)}
# each field of a group: (ElasticConfig's field that holds the group, the group's class)
_MOVED: dict[str, tuple[str, type]] = {
    f.name: (group, cls) for group, cls in _GROUPS.items() for f in fields(cls)}


def _new_spelling(name: str) -> str:
    group, cls = _MOVED[name]
    return (f"{name} is now {cls.__name__}.{name}: "
            f"ElasticConfig({group}={cls.__name__}({name}=...))")


__all__ = [
    "AutopilotOptions",
    "BatchScalingOptions",
    "CompilationOptions",
    "ElasticConfig",
    "ElasticOptions",
    "HealthOptions",
    "MemoryFitOptions",
    "MemoryTierOptions",
    "ReplicaOptions",
    "SaveOptions",
]
