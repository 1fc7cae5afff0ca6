"""How ckptd sets up Orbax's handlers for a save: zstd on or off, string leaves, the jax.Array handler's
replica-parallel threshold, and the OCDBT data file size of a local save.

Used by ``trainer_client.checkpoint_io._checkpointer`` (the Checkpointer) and the part writer; every setting is
Orbax's own option or field, reached where 0.12.8 has no public switch for it, and the layout written stays
Orbax's: plain Orbax restores it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any
DATA_FILES = 64  # OCDBT data files per local save (about): enough for tensorstore to write in parallel
MIN_DATA_FILE_BYTES = 1 << 20


def standard_handler(compression: bool) -> ocp.StandardCheckpointHandler:
    """Orbax's StandardCheckpointHandler with zstd on or off (0.12.8 has no public switch for it on the
    standard handler; the PyTree handler inside it has one). The layout stays Orbax's own: plain
    Orbax restores it either way (the zarr metadata says which compressor was used).

    It also takes string leaves: the standard handler refuses them only in its own check of the tree, while
    the PyTree handler inside it saves them (``_strings.json``, as for any PyTree checkpoint) and every
    Orbax restore of the item reads them back; the step still names the standard handler, so plain
    ``StandardRestore`` restores it."""
    handler = ocp.StandardCheckpointHandler()
    supported = getattr(handler, "_supported_types", None)
    if isinstance(supported, tuple) and str not in supported:
        handler._supported_types = (*supported, str)
    outer = getattr(handler, "_impl", None)
    impl = getattr(outer, "_handler_impl", None)
    for pytree_handler in (outer, impl):  # both hold the registry of type handlers they save with
        if pytree_handler is not None and hasattr(pytree_handler, "_type_handler_registry"):
            pytree_handler._type_handler_registry = _registry()
    if impl is None or not hasattr(impl, "_use_compression"):
        if not compression:
            raise RuntimeError("this orbax-checkpoint version offers no way to turn compression off")
        return handler
    impl._use_compression = compression
    return handler


# Orbax splits a replicated array's write among its replicas ("replica-parallel"), slicing each shard with
# a jax op compiled per shape *while the training loop is blocked*: the first save on every new mesh (each
# elastic event) compiled one slice per replicated array (96 compiles, 3.3 s for the demo MLP; 7-15 s on a
# loaded host). Only arrays whose per-replica slice is at least this big are split now: the few large
# ones, where spreading the write pays for one compile.
REPLICA_PARALLEL_MIN_BYTES = 64 << 20


def _registry() -> Any:
    """Orbax's default type handlers, with a ``jax.Array`` handler that splits only large replicated arrays."""
    from orbax.checkpoint._src.metadata import array_metadata_store
    from orbax.checkpoint._src.serialization import type_handler_registry, type_handlers

    arrays = type_handlers.ArrayHandler(array_metadata_store=array_metadata_store.Store(),
                                        min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES)
    defaults = type_handler_registry._DEFAULT_TYPE_HANDLERS
    return type_handler_registry.create_type_handler_registry(
        *[(kind, handler) for kind, handler in defaults if kind is not jax.Array], (jax.Array, arrays))


def data_file_bytes(state: PyTree) -> int:
    """The OCDBT data file size for saving ``state`` on a local disk: about 1/``DATA_FILES`` of its bytes,
    at least its largest shard (Orbax splits a chunk bigger than a data file) and ``MIN_DATA_FILE_BYTES``."""
    total = largest = 0
    for leaf in jax.tree_util.tree_leaves(state):
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            continue
        itemsize = np.dtype(dtype).itemsize
        sharding = getattr(leaf, "sharding", None)
        shard = sharding.shard_shape(tuple(shape)) if sharding is not None else tuple(shape)
        total += math.prod(shape) * itemsize
        largest = max(largest, math.prod(shard) * itemsize)
    return max(largest, -(-total // DATA_FILES), MIN_DATA_FILE_BYTES)


def route_data_file_size(handler: ocp.StandardCheckpointHandler, size: Callable[[], int | None]) -> bool:
    """Make ``handler``'s saves ask for OCDBT data files of ``size()`` bytes (None: Orbax's default).

    ``StandardSave`` has no field for it; the PyTree handler inside the standard handler takes it in its
    own save args, so its ``async_save`` is wrapped to fill it in. False (and nothing changed) when this
    orbax-checkpoint version is not built that way: saves then keep Orbax's default data files.
    """
    impl = getattr(handler, "_impl", None)
    save = getattr(impl, "async_save", None)
    if save is None or "ocdbt_target_data_file_size" not in {
        f.name for f in dataclasses.fields(ocp.args.PyTreeSave)
    }:
        return False

    async def async_save(directory: Any, *rest: Any, args: Any = None, **kwargs: Any) -> Any:
        wanted = size()
        if wanted is not None and isinstance(args, ocp.args.PyTreeSave) and args.ocdbt_target_data_file_size is None:
            args = dataclasses.replace(args, ocdbt_target_data_file_size=wanted)
        return await save(directory, *rest, args=args, **kwargs)

    impl.async_save = async_save  # type: ignore[union-attr]
    return True


__all__ = ["DATA_FILES", "MIN_DATA_FILE_BYTES", "REPLICA_PARALLEL_MIN_BYTES", "data_file_bytes",
           "route_data_file_size", "standard_handler"]
