"""The shared-memory tier's spare snapshot file: allocated before the save that will write into it, and for the
first saves also touched, so that no save waits for the kernel to find pages.

A save into a fresh file of shared memory makes the kernel allocate and zero every 4 KiB page while the
training loop waits; on a host that has just started, the first touch of its memory costs several times more
again (docs/benchmarks.md, "First snapshots"). ``MemoryTier`` (``trainer_client.runtime.memory._memory_tier``)
therefore keeps one spare file per trainer process, ``.spare-<pid>`` in the job's directory: ``make_spare``
allocates it (``posix_fallocate``) and, when asked, touches it — every page written once through a shared
mapping, which faults it in — so the save that renames it into its snapshot writes into memory that exists.
``snapshot_bytes`` sizes it from the state alone (arrays or ``ShapeDtypeStruct``s), before any save.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np

from trainer_client.checkpoint_io._state_tree import is_value
from trainer_client.core.format._private_files import open_private
from trainer_client.core.format._snapshot import SHARD_ALIGN
from trainer_client.core.format._snapshot_shards import index_bounds

_PAGE = mmap.PAGESIZE
_TOUCH_CHUNK = 256 << 20  # bytes mapped at a time while touching: the mapping never holds the whole file


def leaf_bytes(leaf: Any) -> int:
    """The bytes a snapshot gives one array (or ``ShapeDtypeStruct`` with a sharding): each region this
    process's devices hold, once, each at a ``SHARD_ALIGN`` boundary (the bound a save sizes its file by)."""
    shape = tuple(leaf.shape)
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:  # a ShapeDtypeStruct without one: the whole array, as one shard
        return math.prod(shape) * leaf.dtype.itemsize + SHARD_ALIGN
    regions = {index_bounds(index, shape) for index in sharding.addressable_devices_indices_map(shape).values()}
    return sum(math.prod(stop - start for start, stop in bounds) * leaf.dtype.itemsize + SHARD_ALIGN
               for bounds in regions)


def snapshot_bytes(state: Any) -> int:
    """The size of the file a snapshot of ``state`` writes at most (its leaves that are values take none)."""
    return sum(leaf_bytes(leaf) for leaf in jax.tree_util.tree_leaves(state) if not is_value(leaf))


def touch(fd: int, nbytes: int, gate: threading.Event | None = None) -> None:
    """Fault in every page of the first ``nbytes`` of the file ``fd``: one byte written per page through a
    shared mapping (the kernel zeroes the rest of the page), a chunk at a time; before each chunk, wait for
    ``gate`` (a restore running beside it has it closed)."""
    for start in range(0, nbytes, _TOUCH_CHUNK):
        if gate is not None:
            gate.wait()
        length = min(_TOUCH_CHUNK, nbytes - start)
        with mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                       offset=start) as view:
            pages = np.frombuffer(view, dtype=np.uint8)
            pages[::_PAGE] = 0
            del pages  # the mapping closes only once no view of it is left


def make_spare(spare: Path, nbytes: int, *, touched: bool, gate: threading.Event | None = None) -> None:
    """Allocate ``nbytes`` for the file ``spare`` (written as ``<spare>.part`` and renamed when ready, so a
    save never takes half of one) and, with ``touched``, fault its pages in (each chunk once ``gate`` is open).
    ``OSError`` (e.g. ENOSPC) leaves no file behind."""
    part = spare.with_name(spare.name + ".part")
    try:
        part.unlink(missing_ok=True)  # a leftover, or a link planted there: never written through
        fd = open_private(part, os.O_CREAT | os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            if touched:
                touch(fd, nbytes, gate)
        finally:
            os.close(fd)
        os.replace(part, spare)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


__all__ = ["leaf_bytes", "make_spare", "snapshot_bytes", "touch"]
