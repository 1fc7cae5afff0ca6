"""How much host memory a restore may hold at once, and a restore through Orbax that keeps to it.

A large resume can run the host out of memory (a known failure elsewhere: a resume OOM-killed the host)
when the restore reads the whole state into host buffers before handing any of it to the devices.
``checkpointing.restore`` takes ``host_bytes`` (default: ``CKPTD_RESTORE_HOST_BYTES``, unset = no cap):
the arrays are restored in batches of at most that many bytes of this process's shards, each batch handed
to the devices before the next is read (an array larger than the cap is one batch of its own).

- The direct reader (``trainer_client.runtime.restore._direct_restore``) reads a batch into host buffers, builds its
  arrays and waits for them before the next batch (on accelerators it does so with a default of 4 GiB).
- Through Orbax (``gs://``, compressed chunks, ...) each batch is one ``PyTreeCheckpointer`` restore in
  which every other leaf is Orbax's ``PLACEHOLDER`` (not read): tensorstore's buffers for a batch are
  freed before the next batch is read. Value leaves (numbers, strings) are read once at the end.

On CPU devices the restored arrays are host memory themselves; the cap bounds what the restore holds
besides them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp

from trainer_client.checkpoint_io._state_tree import is_value, orbax_restore
from trainer_client.config import client_settings
from trainer_client.core.format._snapshot_shards import index_bounds

PyTree = Any
T = TypeVar("T")


def host_budget(host_bytes: int | None) -> int | None:
    """``host_bytes`` if given, else ``CKPTD_RESTORE_HOST_BYTES`` (None: no cap)."""
    if host_bytes is not None:
        if host_bytes < 1:
            raise ValueError(f"host_bytes must be positive, not {host_bytes}")
        return host_bytes
    return client_settings().restore_host_bytes


def local_bytes(leaf: Any) -> int:
    """Bytes of ``leaf``'s distinct shards on this process's devices (replicas share one host buffer)."""
    shape = tuple(leaf.shape)
    regions = {index_bounds(i, shape) for i in leaf.sharding.addressable_devices_indices_map(shape).values()}
    return sum(math.prod(hi - lo for lo, hi in r) for r in regions) * np.dtype(leaf.dtype).itemsize


def batches(entries: Sequence[T], sizes: Sequence[int], budget: int | None) -> Iterator[list[T]]:
    """``entries`` in order, in runs of at most ``budget`` bytes (an entry larger than it alone; None: one run)."""
    batch: list[T] = []
    size = 0
    for entry, nbytes in zip(entries, sizes, strict=True):
        if batch and budget is not None and size + nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += nbytes
    if batch:
        yield batch


def orbax_restore_batched(item_path: str, target: PyTree, budget: int) -> PyTree:
    """``orbax_restore(item_path, target)`` with at most about ``budget`` bytes of arrays read per Orbax call."""
    leaves, treedef = jax.tree_util.tree_flatten(target)
    arrays = [i for i, leaf in enumerate(leaves) if not is_value(leaf)]
    restored: dict[int, Any] = {}
    for batch in batches(arrays, [local_bytes(leaves[i]) for i in arrays], budget):
        wanted = set(batch)
        args = [ocp.ArrayRestoreArgs(restore_type=jax.Array, sharding=leaf.sharding, global_shape=tuple(leaf.shape),
                                     dtype=leaf.dtype) if i in wanted else ocp.PLACEHOLDER
                for i, leaf in enumerate(leaves)]
        items = [leaf if i in wanted else ocp.PLACEHOLDER for i, leaf in enumerate(leaves)]
        checkpointer = ocp.PyTreeCheckpointer()
        try:
            out = checkpointer.restore(item_path, args=ocp.args.PyTreeRestore(
                item=jax.tree_util.tree_unflatten(treedef, items),
                restore_args=jax.tree_util.tree_unflatten(treedef, args)))
        finally:
            checkpointer.close()
        got = jax.tree_util.tree_leaves(out, is_leaf=lambda x: x is ocp.PLACEHOLDER)
        for i in batch:
            restored[i] = got[i]
        jax.block_until_ready([restored[i] for i in batch])
        del out, got
    in_order = [restored[i] for i in arrays]
    if len(arrays) < len(leaves):  # the values, with the arrays already read
        return orbax_restore(item_path, target, in_order)
    return jax.tree_util.tree_unflatten(treedef, in_order)


__all__ = ["batches", "host_budget", "local_bytes", "orbax_restore_batched"]
