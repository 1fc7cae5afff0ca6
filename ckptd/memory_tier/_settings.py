"""The host-memory tier's settings group (``MemoryTierSettings``), beside the keeper that uses it
(``_snapshots.py``): the shared-memory directory trainers snapshot into, how many snapshots are kept, and how the
persist worker writes them to storage (``ckptd/persist/``; the peer channel runs at the same priority).

``DEFAULT_PERSIST_NICE`` is its ``persist_nice`` default, here with the group it belongs to: the persist worker's
client takes it as its own default from here (a settings group is in the shared layer, so ``ckptd/persist/``, at
the bottom, may import it without importing the memory tier). ``ckptd/config.py`` composes the group into
``Settings``; it keeps the ``CKPTD_*`` variable names it always had. This module imports nothing of the keeper
(docs/architecture.md, "Package map").
"""

from __future__ import annotations

from pydantic import Field

from ckptd._settings_group import SettingsGroup

DEFAULT_PERSIST_NICE = 10  # how far below ckptd the persist worker runs, unless CKPTD_PERSIST_NICE says otherwise


class MemoryTierSettings(SettingsGroup):
    """The host-memory tier: the shared-memory directory trainers snapshot into, and how its snapshots are written
    to storage (the persist worker)."""

    shm_dir: str | None = Field(
        default=None, description="host-memory tier: the shared-memory directory trainers snapshot into (off: None)"
    )
    max_snapshots: int = Field(default=2, ge=1, description="host-memory tier: snapshots kept per job")
    drain_timeout_s: float = Field(
        default=20.0, ge=0, le=3600,
        description="on SIGTERM, how long to keep persisting the memory snapshots trainers asked for (keep it "
                    "below Kubernetes' terminationGracePeriodSeconds; what is left stays in shared memory)",
    )
    persist_compression: bool = Field(default=False, description="zstd when persisting snapshots to storage")
    persist_devices: int = Field(
        default=16, ge=1, le=1024,
        description="fake CPU devices the persist worker writes a snapshot's shards from, in parallel",
    )
    persist_nice: int = Field(
        default=DEFAULT_PERSIST_NICE, ge=0, le=19,
        description="the persist worker runs this many nice steps below ckptd: the trainer wins the host's cores",
    )


__all__ = ["DEFAULT_PERSIST_NICE", "MemoryTierSettings"]
