"""What the elastic runner needs to know about a job: ``ElasticConfig``, composed of small option groups.

The job and its mesh (``job``, ``mesh_axes``, ``mesh_shape``, ``global_batch``) and the save period are
``ElasticConfig``'s own fields; everything else comes in one frozen group per concern, each with defaults, the
way Orbax's ``CheckpointManagerOptions`` composes ``AsyncOptions``, ``MultiprocessingOptions`` and
``FileOptions``. The runner's own groups are here: ``ElasticOptions`` (the policy after a slice loss, retries, hot
spares), ``BatchScalingOptions`` (the batch on a resized mesh), ``MemoryFitOptions`` (the device memory a plan
must fit), ``HealthOptions`` (the waits and health checks). Each tier's or part's group lives beside the part that
reads it, in its room's ``_options`` module: ``MemoryTierOptions`` (the host-memory tiers: ckptd's shared-memory
snapshots, ``trainer_client.runtime.memory``) with ``ReplicaOptions`` (the replica snapshots in the accelerator
hosts' memory, ``trainer_client.runtime.replicas``), ``CompilationOptions`` (``trainer_client.runtime.compilation``),
``SaveOptions`` (``trainer_client.runtime.saving``) and ``AutopilotOptions`` (the periods the user leaves unset,
chosen during the run: ``trainer_client.runtime.autopilot``); this module composes them, and ``trainer_client``
exports them all. docs/maxtext.md maps MaxText's flags onto them. A keyword that names a group's field on
``ElasticConfig`` itself (``ElasticConfig(shm_dir=...)``) is refused with its spelling in the group, never
ignored.

jax-free, as the groups' modules are: the runner (``trainer_client.runtime.elastic._elastic``) and the attempt's
context (``trainer_client.runtime.elastic._elastic_context``) both read it.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from trainer_client.core.protocol import BatchOptions, MeshSpec
from trainer_client.runtime.autopilot._options import AutopilotOptions
from trainer_client.runtime.compilation._options import CompilationOptions
from trainer_client.runtime.memory._options import MemoryTierOptions
from trainer_client.runtime.saving._options import SaveOptions


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
    "BatchScalingOptions",
    "ElasticConfig",
    "ElasticOptions",
    "HealthOptions",
    "MemoryFitOptions",
]
