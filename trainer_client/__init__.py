"""trainer_client: the library a JAX training script imports to survive slice failures in-process.

It saves through Orbax, asks the ckptd sidecar where to resume after a failure (or scans storage itself
when ckptd cannot answer), rebuilds the mesh from the plan and restores onto the devices still alive.

Packages (docs/architecture.md): ``trainer_client.core`` is the jax-free core the sidecar imports too
(wire contract, stored format, planner, validation, storage); ``trainer_client.client`` talks to ckptd
over HTTP (jax-free); ``trainer_client.runtime`` is the part that imports jax. Names that need jax are
loaded on first use, so ``from trainer_client import CkptdClient`` loads neither jax nor any server
framework. Every error derives from ``CkptdError``; the whole tree (``trainer_client.errors``) is exported here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real types for type checkers; at run time each name is imported on first use
    from trainer_client.client._ckptd_client import CkptdClient
    from trainer_client.config import ClientSettings
    from trainer_client.errors import (
        ArrayIndexError,
        CkptdError,
        CkptdRequestError,
        CkptdUnavailable,
        DirectRestoreUnsupported,
        ElasticRetriesExhausted,
        ElasticTimeoutError,
        MemoryTierFull,
        MissingExtra,
        NoCheckpointError,
        NoWholeReplica,
        OcdbtFormatError,
        OcdbtRefusedError,
        PlanningError,
        RecordTooLargeError,
        StorageError,
        StoredFormatError,
        UnsafePathError,
    )
    from trainer_client.runtime.autopilot._options import AutopilotOptions
    from trainer_client.runtime.compilation._options import CompilationOptions
    from trainer_client.runtime.elastic._elastic import (
        ElasticConfig,
        ElasticContext,
        ElasticResult,
        ElasticRunner,
        Event,
    )
    from trainer_client.runtime.elastic._elastic_config import (
        BatchScalingOptions,
        ElasticOptions,
        HealthOptions,
        MemoryFitOptions,
    )
    from trainer_client.runtime.memory._options import MemoryTierOptions
    from trainer_client.runtime.multihost._job_store import initialize_multihost
    from trainer_client.runtime.orbax_compat._checkpoint_manager import CheckpointManager
    from trainer_client.runtime.orbax_compat._maxtext import MaxTextHooks
    from trainer_client.runtime.replicas._options import ReplicaOptions
    from trainer_client.runtime.saving._checkpointing import Checkpointer, restore
    from trainer_client.runtime.saving._options import SaveOptions
    from trainer_client.runtime.slices._jax_faults import InJaxFaults
    from trainer_client.runtime.slices._slices import PathwaysSlices, SimulatedSlices, SliceFault

__version__ = "0.1.0"

_LAZY = {
    "restore": "trainer_client.runtime.saving._checkpointing",
    "Event": "trainer_client.runtime.elastic._elastic",
    "InJaxFaults": "trainer_client.runtime.slices._jax_faults",
    "initialize_multihost": "trainer_client.runtime.multihost._job_store",
    "CkptdClient": "trainer_client.client._ckptd_client",
    "ClientSettings": "trainer_client.config",
    "ElasticConfig": "trainer_client.runtime.elastic._elastic",
    "ElasticContext": "trainer_client.runtime.elastic._elastic",
    "ElasticRunner": "trainer_client.runtime.elastic._elastic",
    "ElasticResult": "trainer_client.runtime.elastic._elastic",
    "AutopilotOptions": "trainer_client.runtime.autopilot._options",
    "BatchScalingOptions": "trainer_client.runtime.elastic._elastic_config",
    "CompilationOptions": "trainer_client.runtime.compilation._options",
    "ElasticOptions": "trainer_client.runtime.elastic._elastic_config",
    "HealthOptions": "trainer_client.runtime.elastic._elastic_config",
    "MemoryFitOptions": "trainer_client.runtime.elastic._elastic_config",
    "MemoryTierOptions": "trainer_client.runtime.memory._options",
    "ReplicaOptions": "trainer_client.runtime.replicas._options",
    "SaveOptions": "trainer_client.runtime.saving._options",
    "Checkpointer": "trainer_client.runtime.saving._checkpointing",
    "CheckpointManager": "trainer_client.runtime.orbax_compat._checkpoint_manager",
    "MaxTextHooks": "trainer_client.runtime.orbax_compat._maxtext",
    "SimulatedSlices": "trainer_client.runtime.slices._slices",
    "PathwaysSlices": "trainer_client.runtime.slices._slices",
    "SliceFault": "trainer_client.runtime.slices._slices",
    "CkptdError": "trainer_client.errors",
    "CkptdUnavailable": "trainer_client.errors",
    "CkptdRequestError": "trainer_client.errors",
    "NoCheckpointError": "trainer_client.errors",
    "NoWholeReplica": "trainer_client.errors",
    "ElasticTimeoutError": "trainer_client.errors",
    "ElasticRetriesExhausted": "trainer_client.errors",
    "MemoryTierFull": "trainer_client.errors",
    "PlanningError": "trainer_client.errors",
    "StorageError": "trainer_client.errors",
    "StoredFormatError": "trainer_client.errors",
    "ArrayIndexError": "trainer_client.errors",
    "RecordTooLargeError": "trainer_client.errors",
    "OcdbtFormatError": "trainer_client.errors",
    "OcdbtRefusedError": "trainer_client.errors",
    "UnsafePathError": "trainer_client.errors",
    "MissingExtra": "trainer_client.errors",
    "DirectRestoreUnsupported": "trainer_client.errors",
}

__all__ = [
    "ArrayIndexError",
    "AutopilotOptions",
    "BatchScalingOptions",
    "CheckpointManager",
    "Checkpointer",
    "CkptdClient",
    "CkptdError",
    "CkptdRequestError",
    "CkptdUnavailable",
    "ClientSettings",
    "CompilationOptions",
    "DirectRestoreUnsupported",
    "ElasticConfig",
    "ElasticContext",
    "ElasticOptions",
    "ElasticResult",
    "ElasticRetriesExhausted",
    "ElasticRunner",
    "ElasticTimeoutError",
    "Event",
    "HealthOptions",
    "InJaxFaults",
    "MaxTextHooks",
    "MemoryFitOptions",
    "MemoryTierFull",
    "MemoryTierOptions",
    "MissingExtra",
    "NoCheckpointError",
    "NoWholeReplica",
    "OcdbtFormatError",
    "OcdbtRefusedError",
    "PathwaysSlices",
    "PlanningError",
    "RecordTooLargeError",
    "ReplicaOptions",
    "SaveOptions",
    "SimulatedSlices",
    "SliceFault",
    "StorageError",
    "StoredFormatError",
    "UnsafePathError",
    "__version__",
    "initialize_multihost",
    "restore",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer_client' has no attribute {name!r}")
    if not module.startswith("trainer_client.runtime."):
        return getattr(importlib.import_module(module), name)
    from trainer_client.core._extras import needs_extra

    with needs_extra("trainer", f"trainer_client.{name}"):  # the base install has no jax: say which extra has
        return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
