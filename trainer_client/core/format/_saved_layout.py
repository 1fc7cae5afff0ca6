"""How a step was laid out when saved: its mesh, its array items and, per array, shape, dtype and partition
spec.

The planner needs this for every step it plans. Steps saved by trainer_client record it in ckptd's
training metadata. For steps written by plain Orbax it is assembled from Orbax's own files, item by item
(``trainer_client.core.format._steps.array_items``: ``default``, MaxText's ``items``, several at once): the
mesh and partition specs from ``<item>/_sharding``, the global shapes and dtypes from each array's zarr
metadata (``trainer_client.core.format._array_index``). One reader, ``read_step_layout``, whose result the
server, the CLI and the client's fallback all plan from (``trainer_client.core._step_plan``). No jax here.

Array names are Orbax's dotted leaf paths (``params.w``). A step with one array item names its arrays by
their paths in that item (what trainer_client's restore targets use); a step with several names each
``<item>.<path>``: the path of the leaf in the tree ``{item: that item's state}``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from trainer_client.core._errors import ArrayIndexError
from trainer_client.core._storage import Storage
from trainer_client.core.format._array_index import read_array_index
from trainer_client.core.format._steps import array_items, read_saved_sharding, read_training
from trainer_client.core.protocol import ArraySpec, MeshSpec, TrainingMetadata

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepLayout:
    """What a plan of one step is made from: ckptd's training metadata (arrays included; None for a step
    plain Orbax wrote), the saved mesh, every array's spec, and each array item's arrays (keys of
    ``arrays``)."""

    training: TrainingMetadata | None
    mesh: MeshSpec | None
    arrays: dict[str, ArraySpec]
    items: dict[str, list[str]] = field(default_factory=dict)


def read_step_layout(storage: Storage, step_path: str) -> StepLayout:
    """The saved layout of the committed step at ``step_path``, as every planner of it reads it.

    ckptd's training metadata wins where a step has it (the trainer's mesh and specs, as the trainer had
    them); otherwise each array item's ``_sharding`` and zarr metadata say. Parts the step does not record
    stay empty (``mesh`` None, ``arrays`` without shapes)."""
    training, item = read_training(storage, step_path)
    if training is not None and training.arrays:  # trainer_client's Checkpointer: one array item
        return StepLayout(training, training.mesh, dict(training.arrays), {item: sorted(training.arrays)})
    items = array_items(storage, step_path)
    mesh: MeshSpec | None = None
    arrays = {}
    by_item: dict[str, list[str]] = {}
    for item in items:
        item_mesh, specs = _item_layout(storage, step_path, item)
        mesh = mesh or item_mesh
        keys = {name: name if len(items) == 1 else f"{item}.{name}" for name in specs}
        arrays.update({keys[name]: spec for name, spec in specs.items()})
        by_item[item] = sorted(keys.values())
    return StepLayout(training, training.mesh if training is not None else mesh, arrays, by_item)


def _item_layout(storage: Storage, step_path: str, item: str) -> tuple[MeshSpec | None, dict[str, ArraySpec]]:
    """(mesh, arrays) of one item from Orbax's files: ``_sharding`` for specs, zarr metadata for shapes."""
    mesh, arrays = read_saved_sharding(storage, step_path, item)
    try:
        index = read_array_index(storage.url_of(step_path), item)
    except ArrayIndexError as exc:
        _log.warning("no array shapes for %s/%s: %s", storage.url_of(step_path), item, exc)
        index = {}
    for name, info in index.items():
        spec = arrays.get(name) or ArraySpec(partition_spec=[])
        arrays[name] = spec.model_copy(update={"shape": list(info.shape), "dtype": info.dtype})
    return mesh, arrays


__all__ = ["StepLayout", "read_step_layout"]
