"""``python -m ckptd.persist._persist_worker [--serve | SNAPSHOT_DIR JOB_URL]``: write host-memory snapshots to storage.

Runs as a child process of ckptd, because writing Orbax's layout takes Orbax, and Orbax takes jax —
which ckptd's own process never imports. It answers the typed requests of ``ckptd.persist._worker_client``
(JSON lines). The child uses jax on the CPU only (it must never claim the host's accelerators) and saves
the state through the Orbax writer the trainer uses (``trainer_client.checkpoint_io``: the Checkpointer,
and the part writer of a multi-process step): Orbax's layout, the manifest written before the commit marker,
fsynced. Plain Orbax can restore the result. It prints the
committed step's URL; a non-zero exit means the step was not committed.

Each array is handed to Orbax sharded as the trainer saved it: on the trainer's own mesh (its axis names
and shape, over as many fake CPU devices: ``--devices`` of them, ckptd's ``CKPTD_PERSIST_DEVICES``, 16 by
default) with the trainer's partition spec, so Orbax's ``_sharding`` records the trainer's mesh and
shardings and plain Orbax restoring without a target sees them. Each device's buffer is a read-only view
of the snapshot's memory map (the trainer puts every shard at a 64-byte boundary, so XLA takes the view as
it is; the replicas of a shard share that view): no byte is copied before Orbax writes it, Orbax writes the
shards in parallel, and the chunks on storage are the trainer's own. The leaves that are not arrays come
from the snapshot's record as values (Orbax saves them as it would the trainer's: numbers as 0-d arrays,
strings in ``_strings.json``), and a data iterator's state recorded with the snapshot becomes the step's
item ``iter`` in Grain's format (``trainer_client.checkpoint_io._iterator_state``). Where the trainer's mesh has more
devices than the worker (or an array's shards are not its recorded spec on that mesh), that array goes
through a grid of one device per saved shard (coarser beyond ``--devices``) instead: the same bytes and
chunks, but its ``_sharding`` then names that grid (``shard0``, ...); ckptd's own plans read the trainer's
mesh from its training metadata either way (docs/architecture.md, "One planner").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from pydantic import ValidationError

from ckptd.persist._worker_client import CommitParts, WorkerAnswer, WorkerRequest, WritePart, parse_request
from trainer_client.checkpoint_io import Checkpointer, commit_parts, spec_from_json, write_part
from trainer_client.core import StoredFormatError, join_path
from trainer_client.core.format import (
    ArrayRecord,
    ShardReader,
    SnapshotMeta,
    damaged_shards,
    index_bounds,
    map_data,
    problems,
    read_meta,
    rebuild,
    shard_grid,
)
from trainer_client.core.protocol import ArraySpec, TrainingMetadata

_log = logging.getLogger(__name__)

DEFAULT_DEVICES = 16  # fake CPU devices the worker asks jax for (ckptd passes CKPTD_PERSIST_DEVICES as --devices)


def _coarsen(grid: list[int], devices: int) -> list[int]:
    """Blocks per dimension: the saved grid, or where it has more cells than ``devices``, a coarser grid
    whose blocks are whole runs of saved shards (a divisor per dimension, leading dimensions first)."""
    out = []
    for count in grid:
        out.append(max(c for c in range(1, count + 1) if count % c == 0 and c <= devices))
        devices //= out[-1]
    return out


def _sharding(record: ArrayRecord, devices: Sequence[jax.Device]) -> jax.sharding.Sharding:
    """One device per saved shard (so each device's shard is one view of the map, and Orbax writes the
    trainer's chunks), over as many of ``devices`` as that takes; one device when the shards are no grid."""
    grid = shard_grid(record) if math.prod(record.shape) else None
    blocks = _coarsen(grid, len(devices)) if grid else []
    if math.prod(blocks) <= 1:
        return SingleDeviceSharding(devices[0])
    names = tuple(f"shard{d}" for d in range(len(blocks)))
    mesh = Mesh(np.array(devices[: math.prod(blocks)]).reshape(blocks), names)
    return NamedSharding(mesh, PartitionSpec(*[name if n > 1 else None for name, n in zip(names, blocks, strict=True)]))


def _trainer_mesh(training: TrainingMetadata, devices: Sequence[jax.Device]) -> Mesh | None:
    """The trainer's mesh (axis names and shape) over the first of ``devices``; None when too few."""
    shape = training.mesh.shape
    if training.mesh.size > len(devices):
        return None
    return Mesh(np.array(devices[: training.mesh.size]).reshape(shape), tuple(training.mesh.axis_names))


def _as_trained(record: ArrayRecord, spec: ArraySpec | None, mesh: Mesh | None) -> NamedSharding | None:
    """The trainer's sharding of one array on ``mesh``, when its shards are exactly the ones the snapshot
    holds (one replica each); None otherwise (no spec recorded, not a NamedSharding the trainer had)."""
    if mesh is None or spec is None:
        return None
    shape = tuple(record.shape)
    try:
        sharding = NamedSharding(mesh, spec_from_json(spec.partition_spec))
        wanted = {index_bounds(index, shape) for index in sharding.devices_indices_map(shape).values()}
    except (ValueError, TypeError, KeyError):
        return None
    saved = {tuple((start, stop) for start, stop in shard.index) for shard in record.shards}
    return sharding if wanted == saved else None


def _damage_error(snapshot: Path, damaged: list[str]) -> StoredFormatError:
    return StoredFormatError(f"snapshot {snapshot} is damaged: {'; '.join(damaged[:4])}"
                             + (f" (and {len(damaged) - 4} more shards)" if len(damaged) > 4 else ""))


def snapshot_arrays(snapshot: Path, devices: Sequence[jax.Device] | None = None,
                    meta: SnapshotMeta | None = None, *, data: np.ndarray | None = None,
                    check: bool = True) -> list[jax.Array]:
    """Every array of the snapshot as a jax array on ``devices`` (default: this process's CPU devices), in
    leaf order, sharded as saved: on the trainer's mesh with its partition spec where ``devices`` are
    enough, else one device per saved shard; a device's buffer is the shard's read-only view of the
    memory map (``data``: ``map_data``'s, made here when not given) where jax takes it as is (on the CPU it
    does: no copy). With ``check``, first ``StoredFormatError`` when a shard's bytes do not match their
    checksum; without it the caller checks them (``persist`` does, beside the write, before the commit)."""
    meta = meta or read_meta(snapshot)
    data = map_data(snapshot, meta) if data is None else data
    if check and (damaged := damaged_shards(data, meta)):
        raise _damage_error(snapshot, damaged)
    devices = list(devices or jax.devices("cpu"))
    mesh = _trainer_mesh(meta.training, devices)
    out: list[jax.Array] = []
    for name in meta.leaf_names:
        record = meta.arrays[name]
        # Views, not copies: only Orbax reads these arrays, and a snapshot waiting to be persisted is never
        # evicted (a trainer re-saving the step replaces the file; the old pages stay mapped).
        reader = ShardReader(data, record, copy=False)
        sharding = _as_trained(record, meta.training.arrays.get(name), mesh)
        if sharding is None:
            _log.info("%s of step %s: not on the trainer's mesh %s (%d devices here): saved on its shard grid",
                      name, meta.step, meta.training.mesh.shape, len(devices))
        out.append(jax.make_array_from_callback(tuple(record.shape), sharding or _sharding(record, devices), reader,
                                                dtype=reader.dtype))
    return out


# The arrays of a persist whose answer is not out yet (``handle``): releasing them unmaps the snapshot, page
# tables and all — ~0.1 s a GiB once Orbax has read every page — so ``serve`` does it after answering. Left
# to jax, the views are freed lazily and the unmap lands inside the next persist's start (measured in the
# long-lived worker: 0.28-0.50 s of a 2 GiB persist; docs/benchmarks.md, "What holds the persist gap").
_unreleased: list[jax.Array] = []


def release_arrays(arrays: list[jax.Array] | None = None) -> None:
    """Free ``arrays`` (default: those ``handle`` left for after its answer) and the snapshot maps they view."""
    batch = _unreleased if arrays is None else arrays
    if not batch:  # nothing held: no collection on a request's path (``handle`` calls this first)
        return
    for arr in batch:
        with contextlib.suppress(Exception):  # deleted already
            arr.delete()
    batch.clear()
    gc.collect()  # the map's last references may sit in reference cycles (Orbax's, jax's)


def persist(snapshot: Path, job_url: str, *, compression: bool = False, defer_release: bool = False) -> str:
    """Save the snapshot as a committed Orbax step under ``job_url``; the step's URL.

    Every shard's checksum is checked in a thread beside Orbax's write (the check reads the same memory
    map the write does: its cost hides behind the disk's) and the save's commit waits for it: a damaged
    snapshot raises ``StoredFormatError`` and is never committed (what was written of it stays in the
    step's uncommitted temporary directory, as any failed save's does, which no plan names). The arrays made
    from the snapshot's map are freed before returning, or with ``defer_release`` by ``release_arrays()``."""
    bad = problems(snapshot)
    if bad:
        raise ValueError(f"snapshot {snapshot} is not whole: {'; '.join(bad)}")
    meta = read_meta(snapshot)
    if meta.is_part:  # the other hosts' shards are not here: a part is written as one (``write_part``)
        raise ValueError(f"snapshot {snapshot} is process {meta.process_index} of {meta.process_count}'s part only: "
                         "it is persisted as a part, never as a whole step (docs/multihost.md)")
    data = map_data(snapshot, meta)
    arrays: list[jax.Array] = []
    try:
        return _persist_arrays(snapshot, job_url, meta, data, arrays, compression)
    finally:
        if defer_release:
            _unreleased.extend(arrays)
        else:
            release_arrays(arrays)


def _persist_arrays(snapshot: Path, job_url: str, meta: SnapshotMeta, data: np.ndarray, arrays: list[jax.Array],
                    compression: bool) -> str:
    """``persist``'s save: ``arrays`` gets the jax arrays made from ``data`` (the snapshot's map)."""
    with ThreadPoolExecutor(1, thread_name_prefix="snapshot-check") as pool:
        check = pool.submit(damaged_shards, data, meta)

        def verify() -> None:
            if damaged := check.result():
                raise _damage_error(snapshot, damaged)

        try:
            # The trainer's tree as data (never unpickled): dicts and lists with the same key paths, which
            # is all Orbax records of a tree. jax arrays, not numpy: Orbax writes jax arrays through its
            # parallel array path, numpy leaves ~7x slower.
            arrays.extend(snapshot_arrays(snapshot, meta=meta, data=data, check=False))
            state = rebuild(meta.tree, arrays)
            checkpointer = Checkpointer(job_url, compression=compression, item=meta.item)
            try:
                checkpointer.save_with_metadata(meta.step, state, meta.training, data_iterator=meta.data_iterator,
                                                verify=verify)
                checkpointer.wait()
            finally:
                checkpointer.close()
        except Exception:
            verify()  # a damaged snapshot is the reason, whatever Orbax made of it
            raise
        verify()  # also when the step was on storage already (nothing saved, nothing committed)
    return join_path(job_url, str(meta.step))


def answer(request: WorkerRequest, compression: bool = False) -> WorkerAnswer:
    """One request (``ckptd.persist._worker_client``): persist a whole snapshot (answer: the step's URL), write a
    multi-process job's part (answer: the part record's fields, ``trainer_client.checkpoint_io._part_writer``) or
    commit a step from its parts; a failure is answered with its error, ``damaged`` when the snapshot's bytes
    are (``StoredFormatError``: retrying cannot help)."""
    release_arrays()  # a caller that did not (``serve`` does, after each answer): at most one persist's held
    try:
        if isinstance(request, WritePart):
            return WorkerAnswer(ok=True, record=write_part(Path(request.part), request.step_url,
                                                           compression=compression))
        if isinstance(request, CommitParts):
            commit_parts(request.commit, request.record)
            return WorkerAnswer(ok=True)
        return WorkerAnswer(ok=True, path=persist(Path(request.snapshot), request.job_url, compression=compression,
                                                  defer_release=True))
    except StoredFormatError as exc:
        return WorkerAnswer.failed(exc, damaged=True)
    except Exception as exc:  # reported to the parent, which logs it and retries later
        return WorkerAnswer.failed(exc)


def handle(request: object, compression: bool = False) -> dict[str, Any]:
    """``answer`` for a request's JSON form, the answer's JSON form; what is no request is answered failed."""
    try:
        parsed = parse_request(request)
    except ValidationError as exc:
        return WorkerAnswer.failed(ValueError(f"not a request: {exc.error_count()} error(s)")).wire()
    return answer(parsed, compression).wire()


def serve(compression: bool) -> int:
    """Answer one request line at a time (``handle``), one JSON line each — so jax and Orbax are imported
    once, not once per snapshot."""
    jax.devices()  # make the CPU client now, while the worker waits for its first request
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except ValueError as exc:
            print(json.dumps(WorkerAnswer.failed(ValueError(f"not JSON: {exc}")).wire()), flush=True)
            continue
        print(json.dumps(handle(request, compression)), flush=True)
        release_arrays()  # after the answer: the unmap is not on any request's path
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("snapshot", nargs="?")
    parser.add_argument("job_url", nargs="?")
    parser.add_argument("--compression", action="store_true")
    parser.add_argument("--serve", action="store_true", help="persist the snapshots named on stdin, one per line")
    parser.add_argument("--nice", type=int, default=0, help="lower this process's CPU priority by N first")
    parser.add_argument("--devices", type=int, default=DEFAULT_DEVICES,
                        help="fake CPU devices to write shards from in parallel (at least 1)")
    args = parser.parse_args(argv)
    if args.nice > 0:  # a persist competes with the trainer for the host's cores: the trainer should win
        os.nice(args.nice)
    # Before jax makes its clients: the CPU only, never the host's accelerators (the parent's environment says so
    # too), and one device per saved shard. Set here, not on import: a process that imports this module to persist
    # in-process (tests, benchmarks) keeps its own platform, and ``persist`` asks for the CPU's devices by name.
    # (Called in a process already using jax, neither can change: that process's devices will do.)
    jax.config.update("jax_platforms", "cpu")
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", max(1, args.devices))
    if args.serve:
        return serve(args.compression)
    if not args.snapshot or not args.job_url:
        parser.error("SNAPSHOT and JOB_URL are required without --serve")
    try:
        print(persist(Path(args.snapshot), args.job_url, compression=args.compression), flush=True)
    except Exception as exc:  # reported to the parent through stderr and the exit code
        print(f"persist failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
