"""trainer_client: the library a JAX training script imports to survive slice failures in-process.

It saves through Orbax, asks the ckptd sidecar where to resume after a failure (or scans storage itself
when ckptd cannot answer), rebuilds the mesh from the plan and restores onto the devices still alive.

Names that need jax are loaded on first use, so ``trainer_client.core.protocol`` and the other jax-free
modules stay cheap to import (the sidecar imports them).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "CkptdClient": "trainer_client.client.ckptd_client",
    "ClientSettings": "trainer_client.config",
    "ElasticConfig": "trainer_client.runtime.elastic",
    "ElasticContext": "trainer_client.runtime.elastic",
    "ElasticRunner": "trainer_client.runtime.elastic",
    "ElasticResult": "trainer_client.runtime.elastic",
    "Checkpointer": "trainer_client.runtime.checkpointing",
    "SimulatedSlices": "trainer_client.runtime.slices",
    "PathwaysSlices": "trainer_client.runtime.slices",
    "SliceFault": "trainer_client.runtime.slices",
    "CkptdError": "trainer_client.errors",
    "CkptdUnavailable": "trainer_client.errors",
    "CkptdRequestError": "trainer_client.errors",
    "NoCheckpointError": "trainer_client.errors",
    "ElasticTimeoutError": "trainer_client.errors",
    "ElasticRetriesExhausted": "trainer_client.errors",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer_client' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
