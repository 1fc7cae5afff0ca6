"""The trainer runtime: the only part of ckptd that imports jax (and Orbax, pathwaysutils).

Elastic same-PID recovery (``elastic``), slice health (``slices``), saving and restoring through Orbax
(``checkpointing``, ``direct_restore``), the host-memory tier (``memory_tier``), the save router
(``saver``) and compile-ahead of the next meshes (``precompile``)."""

from trainer_client.core._extras import needs_extra

with needs_extra("trainer", "trainer_client.runtime"):  # without jax: which install brings it, not a bare error
    import jax  # noqa: F401
