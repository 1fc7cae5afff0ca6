"""Reading a snapshot's shards: regions of its arrays cut from the memory map of ``data.bin``.

Shared by the trainer's restore from memory (``trainer_client/runtime/memory/_memory_restore.py``), ckptd's persist
worker (which hands the shards to Orbax) and the direct restore (``aligned_empty``, ``index_bounds``). The
format itself is ``_snapshot.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from trainer_client.core._dtypes import np_dtype
from trainer_client.core.format._snapshot import SHARD_ALIGN, ArrayRecord


class ShardReader:
    """Regions of one array of a snapshot, read from the memory map of its ``data.bin``.

    The shards are views of the memory map ``data`` of ``data.bin``, or with ``views`` the shards' bytes
    already read into arrays of their own, in ``record``'s order. Called with a tuple of slices (what
    ``jax.make_array_from_callback`` passes). A region that is exactly a
    saved shard is that shard: a copy of it, or with ``copy=False`` a read-only view of the map (no copy at
    all; the caller must not let it be written to, nor outlive the snapshot). Any other region is assembled
    from the shards that overlap it, into a new array.
    """

    def __init__(self, data: np.ndarray | None, record: ArrayRecord, *, copy: bool = True,
                 views: Sequence[np.ndarray] | None = None) -> None:
        self.shape = tuple(record.shape)
        self.dtype = np_dtype(record.dtype)
        self.copy = copy
        self.shards: list[tuple[tuple[tuple[int, int], ...], np.ndarray]] = []
        for k, shard in enumerate(record.shards):
            extent = [stop - start for start, stop in shard.index]
            if views is not None:  # the shards already read (and checked) into buffers of their own
                view = views[k]
            else:
                assert data is not None, "a ShardReader reads from a map of data.bin or from the shards' views"
                view = data[shard.offset : shard.offset + shard.nbytes].view(self.dtype).reshape(extent)
            self.shards.append((tuple((start, stop) for start, stop in shard.index), view))
        self.exact = dict(self.shards)

    def __call__(self, index: tuple[slice, ...] | None) -> np.ndarray:
        bounds = self.bounds(index)
        hit = self.exact.get(bounds)
        if hit is None:
            return self.assemble(bounds)
        return np.array(hit) if self.copy else hit

    def bounds(self, index: tuple[slice, ...] | None) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` per dimension of the region ``index`` names."""
        return index_bounds(index, self.shape)

    def assemble(self, bounds: tuple[tuple[int, int], ...]) -> np.ndarray:
        """A new array of the region ``bounds``, copied from the saved shards that overlap it. It starts at
        a multiple of ``SHARD_ALIGN`` bytes, so XLA's CPU client can take it as a buffer without copying it
        again. (numpy's copies release the GIL: regions can be assembled by several threads at once.)"""
        region = aligned_empty([stop - start for start, stop in bounds], self.dtype)
        for shard_bounds, view in self.shards:
            lo = [max(a[0], b[0]) for a, b in zip(bounds, shard_bounds, strict=True)]
            hi = [min(a[1], b[1]) for a, b in zip(bounds, shard_bounds, strict=True)]
            if any(low >= high for low, high in zip(lo, hi, strict=True)):
                continue
            dst = tuple(slice(low - b[0], high - b[0]) for low, high, b in zip(lo, hi, bounds, strict=True))
            src = tuple(slice(low - b[0], high - b[0]) for low, high, b in zip(lo, hi, shard_bounds, strict=True))
            region[dst] = view[src]
        return region


def index_bounds(index: tuple[slice, ...] | None, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` per dimension of the region of an array of ``shape`` that ``index`` (what
    ``jax.make_array_from_callback`` passes) names."""
    index = index or ()
    return tuple(
        (s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(index, shape, strict=False)
    ) + tuple((0, dim) for dim in shape[len(index) :])


def aligned_empty(shape: list[int], dtype: np.dtype[np.generic]) -> np.ndarray:
    """An uninitialised array whose data starts at a multiple of ``SHARD_ALIGN`` bytes."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + SHARD_ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % SHARD_ALIGN
    return raw[skip : skip + nbytes].view(dtype).reshape(shape)


def shard_grid(record: ArrayRecord) -> list[int] | None:
    """How many shards the saved shards cut each dimension into, when they tile the array as a grid (as a
    ``NamedSharding``'s shards do); None when they do not."""
    grid = []
    for dim, size in enumerate(record.shape):
        cuts = sorted({(shard.index[dim][0], shard.index[dim][1]) for shard in record.shards})
        edges = [start for start, _ in cuts] + [cuts[-1][1]] if cuts else []
        if not cuts or edges[0] != 0 or edges[-1] != size or any(
            stop != nxt for (_, stop), nxt in zip(cuts, edges[1:], strict=False)
        ):
            return None
        grid.append(len(cuts))
    cells = {tuple((start, stop) for start, stop in shard.index) for shard in record.shards}
    return grid if math.prod(grid) == len(record.shards) == len(cells) else None


__all__ = ["ShardReader", "aligned_empty", "index_bounds", "shard_grid"]
