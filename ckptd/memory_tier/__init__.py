"""ckptd's side of the host-memory tier: the keeper (``_snapshots``: ``SnapshotKeeper``) that persists the
snapshots trainers leave in shared memory, through the persist worker, and keeps that memory bounded, with the
settings group that configures it (``_settings``: ``MemoryTierSettings``, ``CKPTD_SHM_DIR`` and the persist
worker's knobs; a settings group belongs to the shared layer, so ``ckptd/config.py`` composes it and the persist
worker's client reads its default niceness from it without importing the keeper).

A room of its own, at the top of the sidecar's parts: the keeper writes a single-host snapshot as a whole step
and a multi-host job's snapshot as this host's part of its step, so it stands above the multi-host commit
(``ckptd/multihost/``) and the persist worker (``ckptd/persist/``); the catalog learns of what it persisted
through the callback the composition root hands it (``on_persisted``). The trainer's side of the tier is
``trainer_client/runtime/memory/`` (docs/architecture.md, "Package map").
"""
