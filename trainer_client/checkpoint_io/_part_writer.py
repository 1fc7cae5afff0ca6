"""Writing one host's part of a multi-process step, and committing the step from its parts: Orbax's writes,
done in ckptd's persist worker child (``ckptd.persist._persist_worker``), never in ckptd's own process, which
decides what to write and when (``ckptd.multihost._part_commit``).

A part is exactly what process k of a plain multi-process Orbax save writes into the item (docs/multihost.md,
section 5): its shards in ``<item>/ocdbt.process_<k>/`` through Orbax's own ``tensorstore_utils.ArrayWriteSpec``
(``process_id=k``; each shard at its global index, the shard's shape as the write shape, one atomic
transaction), its ``array_metadatas/process_<k>``, and in process 0's part what Orbax's primary host writes
besides: every array's zarr metadata, the value leaves (Python and numpy scalars, as 0-d arrays),
``_strings.json`` (empty nodes — ``None``, ``{}``, ``[]``, ``()``, optax's ``EmptyState`` — are only in
``_METADATA``, as Orbax records them). A region is written by the part
whose devices hold it with jax ``replica_id`` 0 (recorded per shard in the snapshot), as Orbax decides: no
region twice, so the merge of the parts is the merge of a plain save. The iterator item's
``iter/process_<k>-of-<n>.json`` goes beside it.

The commit (the leader's, once every part is durable) is Orbax's finalize: ``merge_ocdbt_per_process_files``,
``_METADATA`` (Orbax's ``InternalTreeMetadata``), ``_sharding`` (Orbax's ``sharding_metadata`` of the trainer's
mesh and partition specs, on this worker's devices, as a single-process persist records them),
``<item>/commit_success.txt`` and ``_CHECKPOINT_METADATA``. Every write is a rewrite of the same bytes, so a
commit redone after a crash gives the same step.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from jax.sharding import Mesh, NamedSharding
from orbax.checkpoint._src.metadata import array_metadata_store, empty_values
from orbax.checkpoint._src.metadata import sharding as sharding_metadata
from orbax.checkpoint._src.metadata import tree as tree_metadata
from orbax.checkpoint._src.metadata.pytree_metadata_options import PyTreeMetadataOptions
from orbax.checkpoint._src.metadata.value_metadata_entry import ValueMetadataEntry
from orbax.checkpoint._src.serialization import ocdbt_utils, type_handlers
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from trainer_client.checkpoint_io._checkpointer import spec_from_json
from trainer_client.checkpoint_io._handlers import DATA_FILES, MIN_DATA_FILE_BYTES
from trainer_client.checkpoint_io._iterator_state import ITER_ITEM, IteratorStateHandler, process_file, state_text
from trainer_client.core._dtypes import np_dtype
from trainer_client.core._durability import sync_paths, sync_tree
from trainer_client.core._errors import StoredFormatError
from trainer_client.core._storage import Storage, join_path, storage_errors
from trainer_client.core.format._files import CHECKPOINT_METADATA, COMMIT_MARKER, ITEM_METADATA
from trainer_client.core.format._files import STRINGS_FILE as _STRINGS
from trainer_client.core.format._part_files import part_files
from trainer_client.core.format._parts import PartInfo
from trainer_client.core.format._snapshot import SnapshotMeta, damaged_shards, map_data, problems, read_meta
from trainer_client.core.format._snapshot_shards import ShardReader
from trainer_client.core.format._steps import CUSTOM_METADATA_KEY
from trainer_client.core.format._tree_paths import TreeEntry, decode_value
from trainer_client.core.protocol import TrainingMetadata

_EMPTY_TYPES = {"none": empty_values.RESTORE_TYPE_NONE, "empty_dict": empty_values.RESTORE_TYPE_DICT,
                "empty_list": empty_values.RESTORE_TYPE_LIST, "empty_tuple": empty_values.RESTORE_TYPE_TUPLE}


def _context() -> ts.Context:
    return ts_utils.get_ts_context(use_ocdbt=True)


def _part_meta(snapshot: Path) -> SnapshotMeta:
    bad = problems(snapshot)
    if bad:
        raise ValueError(f"snapshot {snapshot} is not intact: {'; '.join(bad)}")
    meta = read_meta(snapshot)
    if not meta.is_part or meta.save_id is None:
        raise ValueError(f"snapshot {snapshot} is not one host's part of a multi-process save")
    for name, record in meta.arrays.items():
        if any(shard.replica_id is None for shard in record.shards):
            raise ValueError(f"snapshot {snapshot}: {name}'s shards carry no replica id (written by an older "
                             "trainer_client): which part writes a replicated region cannot be decided")
    return meta


def _value_leaves(tree: list[TreeEntry]) -> list[tuple[str, Any]]:
    """The leaves saved as values, by Orbax's parameter name: Python numbers and strings (Orbax's
    ``ScalarHandler``, ``StringHandler``) and numpy scalars (its ``NumpyHandler``: a 0-d array of their
    dtype). Arrays and the empty nodes (``None``, ``{}``, ``[]``, ``()``: only in ``_METADATA``) are not."""
    return [(".".join(key for _, key in entry.path), decode_value(entry.value))
            for entry in tree if entry.kind == "value" and entry.value is not None]


def _value_type(entry: TreeEntry) -> ValueMetadataEntry:
    """A leaf's ``_METADATA`` value entry that is not an array, as Orbax's standard save records it: an
    empty node by its type (``skip_deserialize``: nothing written; an empty namedtuple is ``None`` already),
    a numpy scalar as ``np.ndarray``, a Python number as ``scalar``, a string as ``string``."""
    if entry.kind in _EMPTY_TYPES:
        return ValueMetadataEntry(value_type=_EMPTY_TYPES[entry.kind], skip_deserialize=True)
    if entry.value is None:
        raise StoredFormatError(f"leaf {'.'.join(k for _, k in entry.path)!r} ({entry.kind}) holds no value")
    if entry.value.dtype is not None:
        return ValueMetadataEntry(value_type=type_handlers.NumpyHandler().typestr())
    if entry.value.type == "str":
        return ValueMetadataEntry(value_type=type_handlers.StringHandler().typestr())
    return ValueMetadataEntry(value_type=type_handlers.ScalarHandler().typestr())


def _data_file_bytes(meta: SnapshotMeta) -> int:
    """The OCDBT data file size a trainer's save of this state asks for on a local disk (``orbax_handlers``:
    about 1/``DATA_FILES`` of the whole state, at least its largest shard), so the part's files are written
    and synced in parallel as a single-process save's are."""
    total = largest = 0
    for record in meta.arrays.values():
        itemsize = np_dtype(record.dtype).itemsize
        total += math.prod(record.shape) * itemsize
        largest = max([largest, *(shard.nbytes for shard in record.shards)])
    return max(largest, -(-total // DATA_FILES), MIN_DATA_FILE_BYTES)


async def _write_part_async(snapshot: Path, meta: SnapshotMeta, item_dir: str, compression: bool,
                            file_bytes: int | None) -> None:
    data = map_data(snapshot, meta)
    damaged = damaged_shards(data, meta)
    if damaged:
        raise StoredFormatError(f"snapshot {snapshot} is damaged: {'; '.join(damaged[:4])}")
    k, primary = meta.process_index, meta.process_index == 0
    context = _context()
    txn = ts.Transaction(atomic=True)
    metadatas = []
    writes = []
    for name in meta.leaf_names:
        record = meta.arrays[name]
        if not record.shards:
            raise ValueError(f"{name}: this part holds no region of it")
        write_shape = tuple(stop - start for start, stop in record.shards[0].index)
        spec = ts_utils.ArrayWriteSpec(item_dir, name, global_shape=tuple(record.shape), write_shape=write_shape,
                                       dtype=np_dtype(record.dtype), use_compression=compression, use_ocdbt=True,
                                       process_id=k, ocdbt_target_data_file_size=file_bytes)
        metadatas.append(spec.metadata)
        if primary:  # the zarr metadata: Orbax's primary host creates it
            await ts.open(ts.Spec(spec.json), create=True, open=True, context=context, transaction=txn)
        store = await ts.open(ts.Spec(spec.json), open=True, assume_metadata=True, context=context, transaction=txn)
        reader = ShardReader(data, record, copy=False)
        for shard in record.shards:
            if shard.replica_id != 0 or not math.prod(record.shape):
                continue  # another process's devices hold replica 0 of this region: it writes it
            index = tuple(slice(start, stop) for start, stop in shard.index)
            # the snapshot's memory stays mapped and unchanged until the write is done: no copy into the cache
            writes.append(store[index].write(np.asarray(reader(index)), can_reference_source_data_indefinitely=True))
    if primary:
        for name, value in _value_leaves(meta.tree):
            if isinstance(value, str):
                continue
            arr = np.asarray(value)
            spec = ts_utils.ArrayWriteSpec(item_dir, name, global_shape=(), write_shape=(), dtype=arr.dtype,
                                           use_compression=compression, use_ocdbt=True, process_id=k)
            store = await ts.open(ts.Spec(spec.json), create=True, open=True, context=context, transaction=txn)
            writes.append(store.write(arr))
    for write in writes:
        await write
    await txn.commit_async()
    store_path = array_metadata_store.PathResolver().get_write_file_path(epath.Path(item_dir), k)
    _write_text(store_path, array_metadata_store.Serializer().serialize(metadatas))  # whole: a redo rewrites it
    strings = _strings(meta)
    if primary and strings:
        _write_text(epath.Path(item_dir) / _STRINGS, json.dumps(strings))


def _strings(meta: SnapshotMeta) -> dict[str, str]:
    """The string leaves (``_strings.json``, process 0's part writes them)."""
    return {name: value for name, value in _value_leaves(meta.tree) if isinstance(value, str)}


def _write_text(path: epath.Path, text: str) -> None:
    """A small file written whole: on an object store one simple upload (a file written through epath, so gcsfs,
    is a resumable upload: two requests, docs/gcs.md "Many hosts on one bucket"), locally through epath as Orbax
    writes it (its directory made first)."""
    storage = Storage(str(path))
    if storage.is_remote:
        with storage_errors(f"cannot write {path}"):
            storage.fs.pipe_file(storage.root, text.encode())
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_part(snapshot: Path, step_url: str, *, compression: bool = False) -> dict[str, Any]:
    """Write the part of the snapshot (process k's) into the step directory ``step_url`` (staging or in
    place); the part record's fields: every file this part wrote, with size and CRC32C, and its regions."""
    meta = _part_meta(snapshot)
    item_dir = join_path(step_url, meta.item)
    epath.Path(item_dir).mkdir(parents=True, exist_ok=True)
    remote = Storage(step_url).is_remote
    asyncio.run(_write_part_async(snapshot, meta, item_dir, compression, None if remote else _data_file_bytes(meta)))
    if meta.data_iterator is not None:
        record = meta.data_iterator
        _write_text(epath.Path(join_path(step_url, ITER_ITEM)) / process_file(record.process_index,
                                                                              record.process_count),
                    state_text(record.state))
    storage = Storage(step_url)
    files = part_files(storage, storage.join(), meta.item, meta.process_index, meta.process_count,
                       wrote_iter=meta.data_iterator is not None, wrote_strings=bool(_strings(meta)))
    if not remote:  # this part's files and the directories naming them (not the other parts')
        own = {join_path(step_url, f.path) for f in files}
        sync_paths(*sorted(own), *sorted({os.path.dirname(path) for path in own}, key=len, reverse=True),
                   item_dir, step_url)
    info = PartInfo(save_id=meta.save_id or "", process_index=meta.process_index, process_count=meta.process_count,
                    item=meta.item, has_iter=meta.data_iterator is not None, training=meta.training,
                    tree=list(meta.tree), files=files,
                    arrays={name: [shard.index for shard in record.shards if shard.replica_id == 0]
                            for name, record in meta.arrays.items()},
                    write_shapes={name: [stop - start for start, stop in record.shards[0].index]
                                  for name, record in meta.arrays.items()},
                    written_at=time.time())
    return info.model_dump(mode="json")


def _sharding_json(training: TrainingMetadata, arrays: set[str]) -> dict[str, str]:
    """Each array's ``_sharding`` entry: the trainer's mesh (shape, axis names) over this worker's first
    devices, with the array's partition spec; none when the worker has too few devices."""
    devices = jax.devices("cpu")
    if training.mesh.size > len(devices):
        return {}
    mesh = Mesh(np.array(devices[: training.mesh.size]).reshape(training.mesh.shape), tuple(training.mesh.axis_names))
    out = {}
    for name, spec in training.arrays.items():
        if name not in arrays:  # a scalar leaf: Orbax records no sharding for it
            continue
        value = sharding_metadata.from_jax_sharding(NamedSharding(mesh, spec_from_json(spec.partition_spec)))
        if value is not None:
            out[name] = value.to_serialized_string()
    return out


def _tree_metadata(info: PartInfo) -> dict[str, Any]:
    """The item's ``_METADATA``, built with Orbax's own classes as its standard save does."""
    entries = []
    for entry in info.tree:
        keypath = tuple(jax.tree_util.DictKey(key) if kind == "dict" else jax.tree_util.SequenceKey(int(key))
                        for kind, key in entry.path)
        name = ".".join(key for _, key in entry.path)
        if entry.kind == "array":
            value = ValueMetadataEntry(value_type="jax.Array", write_shape=tuple(info.write_shapes[name]))
        else:
            value = _value_type(entry)
        entries.append(tree_metadata.InternalTreeMetadataEntry(
            keypath=str(tuple(str(key) for _, key in entry.path)),
            key_metadata=tree_metadata.KeyMetadataEntry.build(keypath), value_metadata=value))
    return tree_metadata.InternalTreeMetadata(tree_metadata_entries=entries, use_ocdbt=True, use_zarr3=False,
                                              custom_metadata=None, store_array_data_equal_to_fill_value=True,
                                              pytree_metadata_options=PyTreeMetadataOptions()).to_json()


async def _write_sharding(item_dir: str, training: TrainingMetadata, arrays: set[str]) -> None:
    context = ts_utils.get_ts_context(use_ocdbt=False)
    txn = ts.Transaction()
    for name, serialized in _sharding_json(training, arrays).items():
        store = await ts.open(ts_utils.get_sharding_tensorstore_spec(item_dir, name), open=True, context=context)
        await store.with_transaction(txn).write(serialized)
    await txn.commit_async()


def commit_parts(step_url: str, record: dict[str, Any]) -> None:
    """Orbax's finalize of a step whose parts are all durable (``record``: process 0's part record): merge
    the per-process OCDBT stores, write ``_METADATA``, ``_sharding``, the item's commit marker and
    ``_CHECKPOINT_METADATA``. Not the step's own marker: the caller creates it (create-only) after the
    manifest."""
    info = PartInfo.model_validate(record)
    item_dir = join_path(step_url, info.item)
    asyncio.run(ocdbt_utils.merge_ocdbt_per_process_files(epath.Path(item_dir), _context(), use_zarr3=False,
                                                          enable_validation=True))
    asyncio.run(_write_sharding(item_dir, info.training, set(info.write_shapes)))
    _write_text(epath.Path(item_dir) / ITEM_METADATA, json.dumps(_tree_metadata(info)))
    _write_text(epath.Path(item_dir) / COMMIT_MARKER, f"Checkpoint commit was successful to {item_dir}")
    now = time.time_ns()
    standard = ocp.StandardCheckpointHandler.typestr()  # the type strings a plain save records
    handlers = {info.item: standard, **({ITER_ITEM: IteratorStateHandler.typestr()} if info.has_iter else {})}
    _write_text(epath.Path(step_url) / CHECKPOINT_METADATA, json.dumps({
        "item_handlers": handlers, "metrics": {}, "performance_metrics": {},
        "init_timestamp_nsecs": int(info.written_at * 1e9), "commit_timestamp_nsecs": now,
        "custom_metadata": {CUSTOM_METADATA_KEY: info.training.model_dump(mode="json")}}))
    if not Storage(step_url).is_remote:
        sync_tree(step_url)


__all__ = ["commit_parts", "write_part"]
