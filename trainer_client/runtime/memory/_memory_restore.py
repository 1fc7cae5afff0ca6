"""The host-memory tier's restore path: a snapshot's state rebuilt onto the devices of a new mesh.

Its own module because restoring shares nothing with saving (``trainer_client/runtime/memory/_memory_tier.py``) but
the format: it reads a snapshot the trainer wrote earlier, possibly in another process, onto another mesh, and
trusts none of its bytes until checked. ``restore_snapshot`` maps ``data.bin`` (or, on CPU devices, reads each
shard into a buffer of this process's own), checks each shard's XXH3 as it is taken, and hands each array to the
devices while the next are checked (``_host_pipeline``); any damage raises ``StoredFormatError`` and no array
is returned. ``trainer_client.runtime.memory._memory_tier.restore_snapshot`` names the same function (the name the
protocol's ``tier: "memory"`` answer documents).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import xxhash

from trainer_client.checkpoint_io._state_tree import is_value, leaf_name, restored_leaf
from trainer_client.core._dtypes import np_dtype
from trainer_client.core._errors import StoredFormatError
from trainer_client.core.format._files import SNAPSHOT_DATA_FILE
from trainer_client.core.format._private_files import open_private
from trainer_client.core.format._snapshot import ArrayRecord, SnapshotMeta, map_data, read_meta
from trainer_client.core.format._snapshot_shards import ShardReader, aligned_empty, index_bounds
from trainer_client.core.format._tree_paths import decode_value
from trainer_client.runtime.restore._host_pipeline import ACCELERATOR_HOST_BYTES, stream_to_devices

PyTree = Any


def restore_snapshot(path: str | os.PathLike[str], target: PyTree, *, threads: int | None = None,
                     host_bytes: int | None = None) -> PyTree:
    """The snapshot's state laid out like ``target`` (``ShapeDtypeStruct`` leaves with shardings).

    ``data.bin`` is mapped read-only at once (``map_data(populate=True)``), and each saved shard's XXH3 is
    checked by ``threads`` threads (default: one per core); an array is handed to jax as soon as every shard
    it needs passed, while the others are still checked (``_host_pipeline``): the checks run beside the
    transfers, and nothing unchecked is transferred. On an accelerator a transfer reads the shards straight
    from the map (no copy on the host; regions of a mesh other than the saved one are assembled from the
    checked shards, at most ``host_bytes`` of them held at once, default ``ACCELERATOR_HOST_BYTES``), and the
    map is held until every transfer from it is complete. On CPU devices, whose arrays take host buffers as
    they are, each shard is copied into an aligned buffer of this process's own and checked there: no restored
    array shares memory with the snapshot, which ckptd evicts or replaces at its own time, and the bytes
    checked are the bytes restored.

    Any damage (a checksum that differs, a short file) raises ``StoredFormatError`` and returns no array: the
    arrays built already are deleted, nothing corrupt is resumed from, and the caller falls back to storage.
    The leaves saved as values come from the snapshot's record, as their target asks
    (``state_tree.restored_leaf``: what Orbax's restore gives)."""
    meta = read_meta(path)
    leaves = jax.tree_util.tree_leaves(target)
    saved = [entry for entry in meta.tree if entry.kind in ("array", "value")]
    if len(leaves) != len(saved):
        raise ValueError(f"snapshot of step {meta.step} has {len(saved)} leaves, the target {len(leaves)}")
    read = _Shards(path, meta, copy=_on_cpu(leaves))
    try:
        return _restore_arrays(path, meta, target, read, threads, host_bytes)
    finally:
        read.close()


def _restore_arrays(path: str | os.PathLike[str], meta: SnapshotMeta, target: PyTree, read: _Shards,
                    threads: int | None, host_bytes: int | None) -> PyTree:
    all_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    saved = [entry for entry in meta.tree if entry.kind in ("array", "value")]
    on_host = read.fd is not None
    values: dict[int, Any] = {}  # target leaf index -> the value restored there
    arrays: list[tuple[Any, str]] = []  # (target leaf, the snapshot's array) for the arrays restored
    names = iter(meta.leaf_names)
    for k, ((where, want), entry) in enumerate(zip(all_leaves, saved, strict=True)):
        if entry.value is not None:
            values[k] = restored_leaf(decode_value(entry.value), want, leaf_name(where))
            continue
        name = next(names, None)
        if name is None or name not in meta.arrays:
            raise StoredFormatError(f"snapshot {path}: its tree and its arrays differ")
        if is_value(want):  # a saved (0-d) array asked for as a value
            record = meta.arrays[name]
            reader = ShardReader(None, record, views=read.checked(name, record))
            values[k] = restored_leaf(reader(None), want, leaf_name(where))
        else:
            arrays.append((want, name))
    if meta.is_part:  # one host's part holds only the regions its devices had: the target must need no other
        _check_part_covers(path, meta, arrays)
    for want, name in arrays:
        record = meta.arrays[name]
        if tuple(want.shape) != tuple(record.shape):
            raise ValueError(f"snapshot array {name} of shape {record.shape} does not fit a target of "
                             f"{want.shape}")
    sizes = [_held_bytes(want, meta.arrays[name], views=not on_host) for want, name in arrays]

    def prepare(item: tuple[Any, str]) -> dict[Any, np.ndarray]:
        want, name = item
        record = meta.arrays[name]
        reader = ShardReader(None, record, views=read.checked(name, record))
        shape = tuple(want.shape)
        needed = {reader.bounds(i) for i in want.sharding.addressable_devices_indices_map(shape).values()}
        # the devices of a replicated axis share one region, as jax shares one buffer for replicas
        # (XLA's CPU client never writes a donated buffer it took from the host in place)
        return {bounds: reader.exact[bounds] if bounds in reader.exact else reader.assemble(bounds)
                for bounds in needed}

    def build(item: tuple[Any, str], regions: dict[Any, np.ndarray]) -> jax.Array:
        want, _ = item
        shape = tuple(want.shape)
        return jax.make_array_from_callback(
            shape, want.sharding, lambda index: regions[index_bounds(index, shape)], dtype=want.dtype)

    out = stream_to_devices(arrays, sizes, prepare, build, threads=threads or os.cpu_count() or 1,
                            budget=None if on_host else (host_bytes or ACCELERATOR_HOST_BYTES))
    built = iter(out)
    return jax.tree_util.tree_unflatten(treedef, [values[k] if k in values else next(built)
                                                  for k in range(len(all_leaves))])


class _Shards:
    """The saved shards of a snapshot, each checked against its XXH3 as it is taken (xxhash and ``preadv``
    release the GIL: several threads at once). ``copy=False`` (accelerators): views of a read-only map of
    ``data.bin`` made at once (``map_data(populate=True)``), which the transfers read with no copy on the host.
    ``copy=True`` (CPU devices, whose arrays take host buffers as they are): each shard read (``preadv``) into
    an aligned buffer of this process's own and checked there, so that no restored array shares memory with
    the snapshot and the bytes checked are the bytes restored."""

    def __init__(self, path: str | os.PathLike[str], meta: SnapshotMeta, *, copy: bool) -> None:
        self.path = str(path)
        self.fd: int | None = None
        self.data: np.ndarray | None = None
        if copy:
            self.fd = open_private(Path(path) / SNAPSHOT_DATA_FILE)
            size = os.fstat(self.fd).st_size
            if size != meta.nbytes:
                self.close()
                raise StoredFormatError(f"memory snapshot {path} is damaged: {SNAPSHOT_DATA_FILE} has {size} bytes, "
                                        f"its record says {meta.nbytes}")
            return
        try:
            self.data = map_data(path, meta, populate=True)
        except OSError as exc:
            raise StoredFormatError(f"memory snapshot {path} is damaged: {exc}") from exc

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.data = None  # the map goes once no array views it: after every transfer from it

    def checked(self, name: str, record: ArrayRecord) -> list[np.ndarray]:
        dtype = np_dtype(record.dtype)
        out = []
        for k, shard in enumerate(record.shards):
            extent = [stop - start for start, stop in shard.index]
            if math.prod(extent) * dtype.itemsize != shard.nbytes:
                raise StoredFormatError(f"memory snapshot {self.path} is damaged: {name} shard {k}'s extent does "
                                        "not match its bytes")
            raw = self._read(shard.offset, shard.nbytes, extent, dtype) if self.fd is not None else (
                self._view(shard.offset, shard.nbytes))
            if raw is None:
                raise StoredFormatError(f"memory snapshot {self.path} is damaged: {SNAPSHOT_DATA_FILE} ends within "
                                        f"{name} shard {k}")
            digest = xxhash.xxh3_64_intdigest(raw.data)
            if digest != shard.xxh3:
                raise StoredFormatError(f"memory snapshot {self.path} is damaged: {name} shard {k}: XXH3 "
                                        f"{digest:016x}, recorded {shard.xxh3:016x}")
            out.append(raw.view(dtype).reshape(extent))
        return out

    def _view(self, offset: int, nbytes: int) -> np.ndarray | None:
        assert self.data is not None
        return self.data[offset : offset + nbytes] if offset + nbytes <= len(self.data) else None

    def _read(self, offset: int, nbytes: int, extent: list[int], dtype: np.dtype[Any]) -> np.ndarray | None:
        assert self.fd is not None
        raw = aligned_empty(extent, dtype).reshape(-1).view(np.uint8)
        view = raw.data
        done = 0
        while done < nbytes:
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                return None
            done += n
        return raw


def _on_cpu(leaves: list[Any]) -> bool:
    """Whether every device the target leaves are laid out on is a CPU device (whose arrays take host
    buffers as they are)."""
    return all(d.platform == "cpu" for want in leaves
               for d in getattr(getattr(want, "sharding", None), "addressable_devices", ()))


def _held_bytes(want: Any, record: ArrayRecord, *, views: bool) -> int:
    """Host bytes one array's restore holds: the copies of its saved shards (none when they are ``views`` of
    the map), and the regions assembled from them."""
    shape = tuple(want.shape)
    exact = {tuple(tuple(b) for b in s.index) for s in record.shards}
    regions = {index_bounds(i, shape) for i in want.sharding.addressable_devices_indices_map(shape).values()}
    itemsize = np_dtype(record.dtype).itemsize
    return (0 if views else sum(s.nbytes for s in record.shards)) + sum(
        math.prod(hi - lo for lo, hi in r) * itemsize for r in regions if r not in exact)


def _check_part_covers(path: str | os.PathLike[str], meta: SnapshotMeta, arrays: list[tuple[Any, str]]) -> None:
    """``StoredFormatError`` unless every region this process's devices need of each array lies within the
    part's shards (a part's shards never overlap: one of each region its process held)."""
    for want, name in arrays:
        shards = [[tuple(b) for b in s.index] for s in meta.arrays[name].shards]
        for index in want.sharding.addressable_devices_indices_map(tuple(want.shape)).values():
            bounds = index_bounds(index, tuple(want.shape))
            held = sum(math.prod(max(0, min(b[1], s[1]) - max(b[0], s[0])) for b, s in zip(bounds, shard, strict=True))
                       for shard in shards)
            if held != math.prod(stop - start for start, stop in bounds):
                raise StoredFormatError(f"memory snapshot {path} (process {meta.process_index} of "
                                        f"{meta.process_count}'s part) does not hold {name}{list(bounds)}, which "
                                        "this process's devices need")


__all__ = ["restore_snapshot"]
