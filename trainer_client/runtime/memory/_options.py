"""The host-memory tiers' options: ``MemoryTierOptions``, the group ``memory_tier`` of ``ElasticConfig``
(trainer_client/runtime/elastic/_elastic_config.py): the shared-memory tier's own settings, and the replica
tier's group (``ReplicaOptions``, beside its tier in ``trainer_client.runtime.replicas``).

jax-free: the config reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer_client.runtime.replicas._options import ReplicaOptions


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


__all__ = ["MemoryTierOptions"]
