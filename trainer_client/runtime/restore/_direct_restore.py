"""Restoring an Orbax checkpoint on a local disk by reading its chunks straight into the devices' buffers.

A ckptd checkpoint is plain Orbax: zarr v2 arrays (uncompressed chunks, since ckptd saves with compression
off) in one OCDBT database per item. Orbax restores it through tensorstore, which takes ~2.4 s for a
2 GiB step whether the files are in the page cache or not — slower than the disk itself, and far slower
than memory when the step was just written (the usual case of an in-process recovery). This module reads
the index itself (``trainer_client.core.format._ocdbt_index``), works out which bytes of which chunks every shard this
process's devices need, reads them with parallel ``preadv`` calls straight into 64-byte-aligned buffers
(a shard that is a byte range of one chunk — every shard when the mesh is the one saved, and every row
block on a smaller data axis — is one read with no copy after it), and hands the buffers to jax, whose
CPU client takes them without copying again.

Anything it does not handle — ``gs://``, compressed chunks (``Checkpointer(compression=True)``), zarr v3,
a dtype other than the target's, a damaged or unknown index — raises ``DirectRestoreUnsupported`` before
any array is built, and ``trainer_client.runtime.saving._checkpointing.restore`` restores through Orbax as before. It
reads
nothing but the item directory and never writes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import mmap
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

from trainer_client.core._dtypes import np_dtype
from trainer_client.core._storage import Storage
from trainer_client.core.format._ocdbt_index import OcdbtIndex, ValueRef
from trainer_client.core.format._snapshot_shards import aligned_empty, index_bounds
from trainer_client.errors import DirectRestoreUnsupported, OcdbtFormatError
from trainer_client.runtime.restore._host_pipeline import ACCELERATOR_HOST_BYTES, stream_to_devices
from trainer_client.runtime.restore._restore_budget import batches

PyTree = Any
Bounds = tuple[tuple[int, int], ...]
# Outstanding reads: a cold virtual disk serves a deep queue faster (2 GiB here: 8 threads 2.3 s, 16 1.6 s).
READ_THREADS = 16
READ_PIECE_BYTES = 64 << 20  # a larger chunk is read as several pieces at once
HOST_BATCH_BYTES = ACCELERATOR_HOST_BYTES  # on accelerators: host buffers held at once before they are on the devices


@dataclasses.dataclass(frozen=True)
class _ZarrArray:
    """One saved array: its zarr v2 metadata and where its chunks are."""

    name: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype[Any]
    separator: str
    fill: Any
    index: OcdbtIndex

    @classmethod
    def open(cls, index: OcdbtIndex, name: str) -> _ZarrArray:
        try:
            meta = json.loads(index.read(f"{name}/.zarray"))
        except KeyError:
            raise DirectRestoreUnsupported(f"{name}: no zarr v2 array of that name in the checkpoint") from None
        except (ValueError, OcdbtFormatError) as exc:
            raise DirectRestoreUnsupported(f"{name}/.zarray: {exc}") from exc
        for key, want in (("zarr_format", 2), ("compressor", None), ("filters", None), ("order", "C")):
            if meta.get(key) != want:
                raise DirectRestoreUnsupported(f"{name}: {key} is {meta.get(key)!r}, this reader needs {want!r}")
        try:
            dtype = np_dtype(meta["dtype"])
        except (TypeError, KeyError) as exc:
            raise DirectRestoreUnsupported(f"{name}: dtype {meta.get('dtype')!r}: {exc}") from exc
        if dtype.byteorder == ">" or dtype.hasobject:
            raise DirectRestoreUnsupported(f"{name}: dtype {meta['dtype']!r} is not read directly")
        if any(not isinstance(c, int) or c < 1 for c in meta.get("chunks", [None])) and meta.get("shape"):
            raise DirectRestoreUnsupported(f"{name}: chunk shape {meta.get('chunks')!r} is not read directly")
        fill = meta.get("fill_value")
        if not (fill is None or (isinstance(fill, int | float) and not isinstance(fill, bool))):
            raise DirectRestoreUnsupported(f"{name}: fill value {fill!r} is not read directly")
        if fill is not None:
            try:  # as a missing chunk's elements are set: a value the dtype cannot hold (an integer of 400 digits,
                np.empty((), dtype)[...] = fill  # infinity in an integer array) is refused here, not mid-restore
            except (OverflowError, ValueError, TypeError):
                raise DirectRestoreUnsupported(f"{name}: fill value {fill!r:.40} is not a {dtype}") from None
        return cls(name, tuple(meta["shape"]), tuple(meta["chunks"]), dtype, meta.get("dimension_separator", "."),
                   fill, index)

    def chunk_ref(self, cell: tuple[int, ...]) -> ValueRef | None:
        key = f"{self.name}/" + (self.separator.join(map(str, cell)) if cell else "0")
        ref = self.index.values.get(key)
        want = math.prod(self.chunks) * self.dtype.itemsize
        if ref is not None and ref.length != want:
            raise DirectRestoreUnsupported(f"{key}: {ref.length} bytes stored, an uncompressed chunk has {want}")
        return ref

    def cells(self, bounds: Bounds) -> Iterator[tuple[int, ...]]:
        """The chunk grid cells the region ``bounds`` overlaps (none for an empty region)."""
        if any(hi <= lo for lo, hi in bounds):
            return iter(())
        ranges = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(bounds, self.chunks, strict=True)]
        return itertools.product(*ranges)


_Planned = tuple[Any, "_ZarrArray", list[Bounds]]  # a target leaf, its saved array, the regions it needs


def _contiguous(region: Bounds, shape: tuple[int, ...]) -> bool:
    """Whether ``region`` of a C-ordered array of ``shape`` is one run of bytes."""
    extents = [hi - lo for lo, hi in region]
    for d in range(len(shape)):
        if all(extents[k] == shape[k] for k in range(d + 1, len(shape))):
            return all(extents[k] == 1 for k in range(d))
    return True


def _flat_start(region: Bounds, shape: tuple[int, ...]) -> int:
    start = 0
    for (lo, _), dim in zip(region, shape, strict=True):
        start = start * dim + lo
    return start


@dataclasses.dataclass
class _Reads:
    """The reads and copies one restore needs, run by a pool of threads."""

    direct: list[tuple[ValueRef, int, memoryview]] = dataclasses.field(default_factory=list)
    whole: dict[tuple[str, tuple[int, ...]], tuple[_ZarrArray, ValueRef, list[tuple[Bounds, np.ndarray, Bounds]]]] = (
        dataclasses.field(default_factory=dict))

    def add(self, array: _ZarrArray, bounds: Bounds, buffer: np.ndarray) -> None:
        """Fill ``buffer`` (the region ``bounds`` of ``array``) from the chunks it overlaps."""
        for cell in array.cells(bounds):
            origin = [i * c for i, c in zip(cell, array.chunks, strict=True)]
            overlap = tuple((max(lo, o), min(hi, o + c)) for (lo, hi), o, c in zip(bounds, origin, array.chunks,
                                                                                 strict=True))
            in_chunk = tuple((lo - o, hi - o) for (lo, hi), o in zip(overlap, origin, strict=True))
            in_dest = tuple((lo - b, hi - b) for (lo, hi), (b, _) in zip(overlap, bounds, strict=True))
            ref = array.chunk_ref(cell)
            dest = buffer[tuple(slice(lo, hi) for lo, hi in in_dest)]
            if ref is None:  # never written: zarr's fill value (Orbax stores chunks equal to it too)
                dest[...] = array.fill if array.fill is not None else 0
            elif ref.inline is None and _contiguous(in_chunk, array.chunks) and _contiguous(in_dest, buffer.shape):
                offset = ref.offset + _flat_start(in_chunk, array.chunks) * array.dtype.itemsize
                flat = buffer.reshape(-1).view(np.uint8)
                start = _flat_start(in_dest, buffer.shape) * array.dtype.itemsize
                view = flat.data[start : start + dest.nbytes]
                for piece in range(0, len(view), READ_PIECE_BYTES):
                    self.direct.append((ref, offset + piece, view[piece : piece + READ_PIECE_BYTES]))
            else:
                key = (array.name, cell)
                self.whole.setdefault(key, (array, ref, []))[2].append((in_chunk, buffer, in_dest))

    def run(self, threads: int) -> None:
        fds: dict[Path, int] = {}
        try:
            refs = [ref for ref, _, _ in self.direct] + [ref for _, ref, _ in self.whole.values()]
            for path in {ref.path for ref in refs if ref.path is not None}:
                fds[path] = os.open(path, os.O_RDONLY)
            sized: list[tuple[int, Callable[[], None]]] = [
                (len(view), functools.partial(_pread, fds, ref, offset, view)) for ref, offset, view in self.direct
            ]
            sized += [(work[1].length, functools.partial(_read_whole, fds, *work)) for work in self.whole.values()]
            sized.sort(key=lambda job: -job[0])  # the largest first, so that no big read starts last
            jobs = [job for _, job in sized]
            if threads <= 1 or len(jobs) <= 1:
                for job in jobs:
                    job()
            else:
                with ThreadPoolExecutor(min(threads, len(jobs)), thread_name_prefix="ckptd-restore") as pool:
                    for _ in pool.map(lambda job: job(), jobs):
                        pass
        except OSError as exc:
            raise DirectRestoreUnsupported(f"reading the checkpoint's data files: {exc}") from exc
        finally:
            for fd in fds.values():
                os.close(fd)


def _pread(fds: dict[Path, int], ref: ValueRef, offset: int, view: memoryview) -> None:
    if ref.inline is not None:
        view[:] = ref.inline[offset - ref.offset : offset - ref.offset + len(view)]
        return
    assert ref.path is not None
    done = 0
    while done < len(view):
        n = os.preadv(fds[ref.path], [view[done:]], offset + done)
        if n <= 0:
            raise DirectRestoreUnsupported(f"{ref.path}: ends before byte {offset + done + 1}")
        done += n


def _read_whole(fds: dict[Path, int], array: _ZarrArray, ref: ValueRef,
                uses: list[tuple[Bounds, np.ndarray, Bounds]]) -> None:
    chunk = aligned_empty(list(array.chunks), array.dtype)
    _pread(fds, ref, ref.offset, chunk.reshape(-1).view(np.uint8).data)
    for in_chunk, buffer, in_dest in uses:
        buffer[tuple(slice(lo, hi) for lo, hi in in_dest)] = chunk[tuple(slice(lo, hi) for lo, hi in in_chunk)]


def _region(regions: dict[Bounds, np.ndarray], shape: tuple[int, ...], index: tuple[slice, ...] | None) -> np.ndarray:
    return regions[index_bounds(index, shape)]


def _on_cpu(sharding: jax.sharding.Sharding) -> bool:
    """Whether every device of ``sharding`` here is a CPU device (whose arrays take host buffers as they are)."""
    devices: set[jax.Device] = sharding.addressable_devices
    return all(d.platform == "cpu" for d in devices)


def _map_files(planned: list[_Planned]) -> dict[Path, np.ndarray]:
    """Each data file the planned regions read, mapped read-only at once (``MAP_POPULATE``: in the gVisor sandbox
    of the lent TPU machine a map touched page by page, or fresh buffers read into, ran at ~1.2-1.4 GB/s on 13
    threads; a populated map was there at once). ``DirectRestoreUnsupported`` when a chunk lies past a file's end."""
    ends: dict[Path, int] = {}
    for _, array, needed in planned:
        for bounds in needed:
            for cell in array.cells(bounds):
                ref = array.chunk_ref(cell)
                if ref is not None and ref.inline is None and ref.path is not None:
                    ends[ref.path] = max(ends.get(ref.path, 0), ref.offset + ref.length)
    maps: dict[Path, np.ndarray] = {}
    for path, end in ends.items():
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                if os.fstat(fd).st_size < end:
                    raise DirectRestoreUnsupported(f"{path}: ends before byte {end}")
                mapped = mmap.mmap(fd, end, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                   prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        except OSError as exc:
            raise DirectRestoreUnsupported(f"mapping the checkpoint's data file {path}: {exc}") from exc
        maps[path] = np.frombuffer(mapped, dtype=np.uint8)
    return maps


def _chunk(array: _ZarrArray, ref: ValueRef, maps: dict[Path, np.ndarray]) -> np.ndarray:
    """A stored chunk as a read-only view of its bytes (in a mapped file, or inline in the index)."""
    if ref.inline is not None:
        raw = np.frombuffer(ref.inline, dtype=np.uint8)
    else:
        assert ref.path is not None
        raw = maps[ref.path][ref.offset : ref.offset + ref.length]
    return raw.view(array.dtype).reshape(array.chunks)


def _mapped_region(array: _ZarrArray, bounds: Bounds, maps: dict[Path, np.ndarray]) -> np.ndarray:
    """The region ``bounds`` of ``array``: a view of the mapped file where it is one run of bytes of one stored
    chunk (no copy: the transfer reads the file's pages), else assembled from the chunks it overlaps."""
    cells = list(array.cells(bounds))
    pieces = []
    for cell in cells:
        origin = [i * c for i, c in zip(cell, array.chunks, strict=True)]
        overlap = tuple((max(lo, o), min(hi, o + c)) for (lo, hi), o, c in zip(bounds, origin, array.chunks,
                                                                             strict=True))
        in_chunk = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(overlap, origin, strict=True))
        in_dest = tuple(slice(lo - b, hi - b) for (lo, hi), (b, _) in zip(overlap, bounds, strict=True))
        pieces.append((array.chunk_ref(cell), in_chunk, in_dest))
    first = pieces[0][0] if len(pieces) == 1 else None
    if first is not None:
        view = _chunk(array, first, maps)[pieces[0][1]]
        if view.flags.c_contiguous:
            return view
    region = aligned_empty([hi - lo for lo, hi in bounds], array.dtype)
    for ref, in_chunk, in_dest in pieces:
        if ref is None:  # never written: zarr's fill value
            region[in_dest] = array.fill if array.fill is not None else 0
        else:
            region[in_dest] = _chunk(array, ref, maps)[in_chunk]
    return region


def _restore_mapped(planned: list[_Planned], threads: int, budget: int) -> list[jax.Array]:
    """The planned arrays from populated maps of the data files, each handed to jax as soon as its regions are
    ready while the next are assembled (``_host_pipeline``); the maps are held until every transfer is done,
    at most ``budget`` bytes of assembled regions at once."""
    maps = _map_files(planned)
    sizes = [sum(math.prod(hi - lo for lo, hi in bounds) for bounds in needed) * array.dtype.itemsize
             for _, array, needed in planned]  # an upper bound: views of the maps hold no host memory

    def prepare(item: _Planned) -> dict[Bounds, np.ndarray]:
        _, array, needed = item
        return {bounds: _mapped_region(array, bounds, maps) for bounds in needed}

    def build(item: _Planned, mine: dict[Bounds, np.ndarray]) -> jax.Array:
        want = item[0]
        return jax.make_array_from_callback(tuple(want.shape), want.sharding,
                                            functools.partial(_region, mine, tuple(want.shape)), dtype=want.dtype)

    return stream_to_devices(planned, sizes, prepare, build, threads=min(threads, os.cpu_count() or 1),
                             budget=budget)


def restore_direct(item_dir: str | os.PathLike[str], target: PyTree, names: Callable[[tuple[Any, ...]], str],
                   *, threads: int = READ_THREADS, host_batch_bytes: int | None = None) -> PyTree:
    """``target``'s arrays (``ShapeDtypeStruct`` or ``jax.Array`` leaves with shardings) read from the Orbax
    item directory ``item_dir``; ``names`` maps a leaf's tree path to the name Orbax saved it under.

    Every array is checked against the checkpoint before anything is read. On CPU devices jax keeps the
    buffers read (no copy), in batches of at most ``host_batch_bytes`` when given. On accelerators the data
    files are mapped at once and each array's transfer reads the mapped pages (a region that is one run of a
    stored chunk: every shard of the mesh saved) or a region assembled from them, each array handed to jax
    as soon as its regions are ready while the next are assembled; at most ``host_batch_bytes`` (default
    ``HOST_BATCH_BYTES``) of assembled regions are held at once, and the maps until every transfer is done."""
    item = Path(item_dir)
    try:
        meta = json.loads(Storage(str(item)).read_bytes(str(item / "_METADATA")))  # size-checked first
    except (OSError, ValueError) as exc:
        raise DirectRestoreUnsupported(f"{item}/_METADATA: {exc}") from exc
    if not meta.get("use_ocdbt") or meta.get("use_zarr3"):
        raise DirectRestoreUnsupported("not an OCDBT checkpoint of zarr v2 arrays")
    try:
        index = OcdbtIndex(item)
    except OcdbtFormatError as exc:
        raise DirectRestoreUnsupported(str(exc)) from exc
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    planned: list[_Planned] = []
    on_host = True
    for path, want in leaves:
        sharding = getattr(want, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding) or not hasattr(want, "shape"):
            raise DirectRestoreUnsupported(f"{names(path)}: the target leaf {type(want).__name__} has no sharding")
        array = _ZarrArray.open(index, names(path))
        shape = tuple(want.shape)
        if array.shape != shape or array.dtype != np.dtype(want.dtype):
            raise DirectRestoreUnsupported(
                f"{array.name}: saved {array.dtype}{list(array.shape)}, the target is {want.dtype}{list(shape)}")
        # replicas share one buffer, as jax shares one for them
        needed = sorted({index_bounds(i, shape) for i in sharding.addressable_devices_indices_map(shape).values()})
        for bounds in needed:
            for cell in array.cells(bounds):
                array.chunk_ref(cell)  # refuses a chunk that is not stored uncompressed
        planned.append((want, array, needed))
        on_host = on_host and _on_cpu(sharding)
    if not on_host:  # accelerators: transfers read the files' pages, arrays as they are ready
        out = _restore_mapped(planned, threads, host_batch_bytes or ACCELERATOR_HOST_BYTES)
        return jax.tree_util.tree_unflatten(treedef, out)
    out = []
    sizes = [sum(math.prod(hi - lo for lo, hi in bounds) for bounds in needed) * array.dtype.itemsize
             for _, array, needed in planned]
    for batch in batches(planned, sizes, host_batch_bytes):
        reads = _Reads()
        regions: list[dict[Bounds, np.ndarray]] = []
        for _, array, needed in batch:
            mine = {bounds: aligned_empty([hi - lo for lo, hi in bounds], array.dtype) for bounds in needed}
            for bounds, buffer in mine.items():
                reads.add(array, bounds, buffer)
            regions.append(mine)
        reads.run(threads)
        built = [jax.make_array_from_callback(tuple(want.shape), want.sharding,
                                              functools.partial(_region, mine, tuple(want.shape)), dtype=want.dtype)
                 for (want, _, _), mine in zip(batch, regions, strict=True)]
        if host_batch_bytes is not None:
            jax.block_until_ready(built)  # the copies are on the devices: this batch's host buffers can go
        out.extend(built)
    return jax.tree_util.tree_unflatten(treedef, out)


__all__ = ["HOST_BATCH_BYTES", "READ_THREADS", "DirectRestoreUnsupported", "restore_direct"]
