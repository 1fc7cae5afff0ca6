"""The trainer runtime: the only part of ckptd that imports jax (and Orbax, pathwaysutils).

One room per concept (docs/architecture.md, the package map): the elastic runner (``elastic``), slice health and
simulated faults (``slices``), a multi-controller job's agreement (``multihost``), the tiers (``replicas``,
``memory``), saving (``saving``) and restoring (``restore``), Orbax-compatible faces (``orbax_compat``), the
periods chosen as the run goes (``autopilot``) and compile-ahead of the next meshes (``compilation``)."""

from trainer_client.core._extras import needs_extra

with needs_extra("trainer", "trainer_client.runtime"):  # without jax: which install brings it, not a bare error
    import jax  # noqa: F401
