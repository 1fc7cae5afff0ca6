"""Restoring a step onto the devices alive now, and the names of the Orbax writer a training script uses.

Restores go by the step directory a resume plan names, with target shardings on the new mesh
(``target_shardings``), so the state is laid out for the devices alive now: on a local disk the chunks are
read straight into the devices' buffers (``trainer_client.runtime.restore._direct_restore``), else Orbax restores them.
Saving is ``trainer_client.checkpoint_io._checkpointer``'s (the Checkpointer, shared with ckptd's persist
worker); its names are re-exported here, where training scripts have always imported them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer_client.checkpoint_io._checkpointer import (
    Checkpointer,
    array_specs,
    mesh_spec,
    spec_from_json,
    spec_to_json,
    training_metadata,
)
from trainer_client.checkpoint_io._handlers import standard_handler
from trainer_client.checkpoint_io._state_tree import is_value, leaf_name, orbax_restore
from trainer_client.core._storage import Storage, join_path
from trainer_client.core.format._steps import array_items
from trainer_client.core.protocol import ArraySpec
from trainer_client.errors import DirectRestoreUnsupported
from trainer_client.runtime.restore._direct_restore import restore_direct
from trainer_client.runtime.restore._restore_budget import host_budget, orbax_restore_batched

_log = logging.getLogger(__name__)

PyTree = Any


def target_shardings(
    abstract_state: PyTree, mesh: Mesh, specs: PyTree, plan_arrays: Mapping[str, ArraySpec] | None = None
) -> PyTree:
    """``ShapeDtypeStruct`` leaves with ``NamedSharding(mesh, spec)``; a plan's changed specs win."""
    flat_specs = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    leaves = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
    treedef = jax.tree_util.tree_structure(abstract_state)
    if len(flat_specs) != len(leaves):
        raise ValueError(f"{len(flat_specs)} partition specs for {len(leaves)} arrays")
    out = []
    for (path, leaf), spec in zip(leaves, flat_specs, strict=True):
        if is_value(leaf):  # a value target: restored as that type (state_tree.restored_leaf)
            out.append(leaf)
            continue
        planned = (plan_arrays or {}).get(leaf_name(path))
        if planned is not None and planned.changed:
            spec = spec_from_json(planned.partition_spec)
        out.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec)))
    return jax.tree_util.tree_unflatten(treedef, out)


def restore(step_path: str, target: PyTree, item: str | None = None, *, direct: bool = True,
            host_bytes: int | None = None) -> PyTree:
    """Restore the step directory ``step_path`` onto ``target``'s shapes, dtypes and shardings.

    ``item``: the Orbax item to restore; by default the step's item that holds arrays (``default`` for what
    trainer_client writes, ``items`` for MaxText's steps: a resume plan names it in ``items``). A step with
    several such items takes a ``target`` that is a dict of them by item name. On a local disk the chunks
    are read straight into the devices' buffers (``trainer_client.runtime.restore._direct_restore``); where that
    reader does not apply (``gs://``, compressed chunks, zarr3, a target Orbax casts, ...) or with
    ``direct=False``, Orbax's ``PyTreeCheckpointer`` restores it. A target leaf that is a value (a Python or
    numpy scalar, a string) gets the saved value as its type, as Orbax's restore gives it.

    ``host_bytes`` (default ``CKPTD_RESTORE_HOST_BYTES``; unset: no cap) caps the host memory the restore
    holds at once: a larger state is restored in batches of arrays
    (``trainer_client.runtime.restore._restore_budget``)."""
    budget = host_budget(host_bytes)
    if item is None:
        storage = Storage(step_path)
        items = array_items(storage, storage.root)
    else:
        items = [item]
    if len(items) > 1:
        if not isinstance(target, Mapping) or set(target) != set(items):
            raise ValueError(f"{step_path} holds the array items {items}: the target must be a dict of them")
        return {name: restore(step_path, target[name], name, direct=direct, host_bytes=budget) for name in items}
    item_path = join_path(step_path, items[0]) if items[0] else step_path  # '': the step is the item
    values = [is_value(leaf) for leaf in jax.tree_util.tree_leaves(target)]
    if direct and "://" not in step_path:
        try:
            arrays = restore_direct(item_path, jax.tree_util.tree_map(  # value leaves: None, no leaf
                lambda leaf: None if is_value(leaf) else leaf, target), leaf_name, host_batch_bytes=budget)
            return orbax_restore(item_path, target, arrays) if any(values) else arrays
        except DirectRestoreUnsupported as exc:
            _log.info("restoring %s through Orbax: %s", item_path, exc)
    if budget is not None:
        return orbax_restore_batched(item_path, target, budget)
    return orbax_restore(item_path, target)


__all__ = [
    "Checkpointer",
    "array_specs",
    "leaf_name",
    "mesh_spec",
    "restore",
    "spec_from_json",
    "spec_to_json",
    "standard_handler",
    "target_shardings",
    "training_metadata",
]
