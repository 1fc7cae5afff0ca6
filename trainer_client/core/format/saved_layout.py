"""How a step was laid out when saved: its mesh and, per array, shape, dtype and partition spec.

The planner needs this for every step it plans. Steps saved by trainer_client record it in ckptd's
training metadata. For steps written by plain Orbax it is assembled from Orbax's own files: the mesh and
partition specs from ``<item>/_sharding``, the global shapes and dtypes from each array's zarr metadata
(``trainer_client.core.format.array_index``). One function, used by the server, the CLI and the client's fallback,
so all three plan from the same view. No jax here.
"""

from __future__ import annotations

import logging

from trainer_client.core.errors import ArrayIndexError
from trainer_client.core.format.array_index import read_array_index
from trainer_client.core.format.steps import read_saved_sharding
from trainer_client.core.protocol import ArraySpec, MeshSpec, TrainingMetadata
from trainer_client.core.storage import Storage

_log = logging.getLogger(__name__)


def saved_layout(
    storage: Storage, step_path: str, training: TrainingMetadata | None
) -> tuple[MeshSpec | None, dict[str, ArraySpec]]:
    """(saved mesh, arrays) of a step; ``(None, {})`` parts when the step does not say."""
    if training is not None and training.arrays:
        return training.mesh, dict(training.arrays)
    mesh, arrays = read_saved_sharding(storage, step_path)
    try:
        index = read_array_index(storage.url_of(step_path))
    except ArrayIndexError as exc:
        _log.warning("no array shapes for %s: %s", storage.url_of(step_path), exc)
        index = {}
    for name, info in index.items():
        spec = arrays.get(name) or ArraySpec(partition_spec=[])
        arrays[name] = spec.model_copy(update={"shape": list(info.shape), "dtype": info.dtype})
    return (training.mesh if training is not None else mesh), arrays


__all__ = ["saved_layout"]
