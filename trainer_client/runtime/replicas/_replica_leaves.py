"""One array of a replica snapshot: its copy in host memory, split into the replicas along the replica axis.

The replica tier (``trainer_client.runtime.replicas._replica_tier``) copies each array of the train state into
``pinned_host`` memory on the same sharding and splits the copy along the mesh axis the replicas lie on (the
data-parallel axis across slices) with pathwaysutils' ``split_by_mesh_axis``, as Orbax's Pathways
``Snapshotter`` does: each replica is then its own array on its own sub-mesh, so losing one slice loses only
the replicas on it. Typed PRNG keys are copied as their ``key_data`` and wrapped again on the way back.

``rebuild`` makes one array whole again from the replicas that survive: any one whole replica when the array
is replicated along the axis; every part when it is sharded along it (then losing any part leaves nothing
whole, and ``rebuild`` says so by returning ``None``).

The host memory a snapshot takes is counted here too (``required_bytes``: one copy of this host's share of
the state, two at the peak; ``check_budget``), and ``touch_copies`` makes throwaway copies of a state's
layout in pinned host memory before the first snapshot, so that the host's pages are faulted in (and the
runtime's pinned allocator holds them) ahead of it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding
from pathwaysutils.experimental.concatenate_by_mesh_axis import concatenate_by_mesh_axis
from pathwaysutils.experimental.split_by_mesh_axis import split_by_mesh_axis

from trainer_client.core.format._snapshot_shards import index_bounds
from trainer_client.errors import MemoryTierFull

PINNED = "pinned_host"
UNPINNED = "unpinned_host"
HOST_KINDS = (PINNED, UNPINNED)
ReplicaAxis = str | int
HBM_MARGIN = 0.05  # of a device's memory limit, kept free beside the step's peak when a staged copy is made


def is_key(x: Any) -> bool:
    """A typed PRNG key array (``jax.random.key``): copied as its ``key_data``."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def host_bytes(x: Any) -> int:
    """Bytes of this process's shards of ``x`` (a ``jax.Array`` or a ``ShapeDtypeStruct`` with a sharding),
    every replica counted: the host memory one copy of it on the same sharding takes."""
    sharding = getattr(x, "sharding", None)
    shape = tuple(x.shape)
    itemsize = x.dtype.itemsize  # a key's: its key_data's bytes per key
    if not isinstance(sharding, Sharding):
        return math.prod(shape) * itemsize
    return sum(math.prod(stop - start for start, stop in index_bounds(index, shape)) * itemsize
               for index in sharding.addressable_devices_indices_map(shape).values())


def axis_name(mesh: Mesh | AbstractMesh, axis: ReplicaAxis) -> str | None:
    """The replica axis's name on ``mesh``, or None when the mesh has no such axis."""
    if isinstance(axis, int):
        return str(mesh.axis_names[axis]) if -len(mesh.axis_names) <= axis < len(mesh.axis_names) else None
    return axis if axis in mesh.axis_names else None


def _spec_uses(spec: PartitionSpec, name: str) -> bool:
    return any(name in jax.tree_util.tree_leaves(dim) for dim in spec)


@dataclass
class HeldArray:
    """One array of a snapshot: its replicas in host memory (one per group along the replica axis)."""

    name: str
    replicas: list[jax.Array]
    device_ids: list[frozenset[int]]  # each replica's devices
    axis: str | None  # the replica axis's name (None: the array is held whole, on its own devices)
    split: bool  # sharded along the replica axis: each replica holds only a part
    spec: PartitionSpec | None  # its NamedSharding's spec, to lay it out on a new mesh
    key_dtype: Any | None  # a typed PRNG key's dtype (the replicas hold its key_data)
    nbytes: int


def _ids(sharding: Sharding) -> frozenset[int]:
    devices: set[Any] = sharding.device_set
    return frozenset(int(d.id) for d in devices)


def _copy_all(arrays: list[jax.Array]) -> list[jax.Array]:
    return [x.copy() for x in arrays]


_on_device_copy = jax.jit(_copy_all)


def stage(arrays: Sequence[jax.Array]) -> tuple[list[jax.Array], list[Sharding]]:
    """A copy of each array in device memory on its own sharding, dispatched as one jitted program (the caller
    is blocked only for the dispatch; a typed key's ``key_data`` is copied). A later step that donates the
    arrays leaves the copies alone, so a slow copy to the host can read them while the loop trains on. On a
    TPU v5e chip 5.22 GB took 17 ms this way; ``jax.device_put`` onto the same device took 2.4 s (it goes
    through the host): docs/benchmarks.md, "Device profile"."""
    if not arrays:
        return [], []
    data = [jax.random.key_data(x) if is_key(x) else x for x in arrays]
    copies = _on_device_copy(list(data))
    # the copy keeps each array's layout; where the compiler chose another, put it back (a no-op when equal).
    # The sources' own shardings are returned with them: the host copy goes on those (a NamedSharding stays one,
    # which the split into replicas needs)
    shardings = [d.sharding for d in data]
    return [c if c.sharding.is_equivalent_to(s, c.ndim) else jax.device_put(c, s)
            for c, s in zip(copies, shardings, strict=True)], shardings


def device_bytes(arrays: Sequence[Any]) -> dict[int, int]:
    """Bytes each addressable device holds of ``arrays`` (the memory a staged copy takes there)."""
    per: dict[int, int] = {}
    for x in arrays:
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, Sharding):
            continue
        itemsize = x.dtype.itemsize
        for device, index in sharding.addressable_devices_indices_map(tuple(x.shape)).items():
            size = math.prod(stop - start for start, stop in index_bounds(index, tuple(x.shape))) * itemsize
            per[int(device.id)] = per.get(int(device.id), 0) + size  # type: ignore[attr-defined]
    return per


def staging_room(arrays: Sequence[Any], staged_before: dict[int, int] | None = None,
                 stats_of: Callable[[int], dict[str, Any] | None] | None = None) -> tuple[bool, str]:
    """Whether every device has room for a staged copy of ``arrays`` beside the step's peak: its memory limit
    less its peak use so far (what the step and restores needed) less ``HBM_MARGIN`` of the limit, from the
    device's own statistics. ``staged_before``: the bytes per device of the staged copies this tier made
    already, which lived beside the steps and so are in that peak (not counted twice). Devices without
    statistics (CPU) have room: their memory is the host's, which the tier's budget counts. ``stats_of``: a
    device id's statistics (default: the device's own ``memory_stats``). Returns the answer and why."""
    need = device_bytes(arrays)
    before = staged_before or {}
    by_id = {d.id: d for d in jax.local_devices()}
    tightest: tuple[float, str] | None = None
    for device_id, size in need.items():
        stats = stats_of(device_id) if stats_of is not None else \
            by_id[device_id].memory_stats() if device_id in by_id else None
        if not stats or "bytes_limit" not in stats:
            continue
        limit = int(stats["bytes_limit"])
        peak = int(stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0)))
        peak = max(0, peak - before.get(device_id, 0))
        free = limit * (1 - HBM_MARGIN) - peak
        line = (f"device {device_id}: staging {size / 2**30:.2f} GiB beside a peak of {peak / 2**30:.2f} GiB "
                f"of {limit / 2**30:.2f} GiB")
        if size > free:
            return False, line + " does not fit"
        if tightest is None or free - size < tightest[0]:
            tightest = (free - size, line)
    return True, (tightest[1] + " fits") if tightest else "no device memory statistics: host memory"


def copy_to_host(named: Sequence[tuple[str, jax.Array]], axis: ReplicaAxis, kind: str = PINNED) -> list[HeldArray]:
    """Dispatch the copy of each array into host memory of ``kind`` on its sharding, split into replicas
    (asynchronous: the copies complete in the background; ``jax.block_until_ready`` on the replicas waits for
    them). One ``jax.device_put`` for all of them: dispatched leaf by leaf, 13 arrays on 8 CPU devices took
    3.3 ms of the training thread, together 1.7 ms. Each copy is a new buffer: a later step that donates an
    array does not touch it (but waits for the copy to have read it: ``stage`` first avoids that)."""
    if not named:
        return []
    key_dtypes = [x.dtype if is_key(x) else None for _, x in named]
    return [hold_pinned(name, copy, axis, key)
            for (name, _), copy, key in zip(named, dispatch_to_host([x for _, x in named], kind), key_dtypes,
                                            strict=True)]


def dispatch_to_host(arrays: Sequence[jax.Array], kind: str,
                     shardings: Sequence[Sharding] | None = None) -> list[jax.Array]:
    """One ``jax.device_put`` of ``arrays`` (typed keys as their ``key_data``) into host memory of ``kind``, on
    ``shardings`` (default: their own) in that memory."""
    data = [jax.random.key_data(x) if is_key(x) else x for x in arrays]
    on = shardings if shardings is not None else [d.sharding for d in data]
    return list(jax.device_put(data, [s.with_memory_kind(kind) for s in on], may_alias=False))


def hold_pinned(name: str, pinned: jax.Array, axis: ReplicaAxis, key_dtype: Any | None = None) -> HeldArray:
    """``pinned`` (in host memory, pinned or not; a typed key's ``key_data`` with ``key_dtype``) held as it is, split
    into replicas along ``axis``: no copy (the caller gives a buffer nothing else writes)."""
    sharding = pinned.sharding
    nbytes = host_bytes(pinned)
    name_on_mesh = axis_name(sharding.mesh, axis) if isinstance(sharding, NamedSharding) else None
    if name_on_mesh is None or not isinstance(sharding, NamedSharding):
        spec = sharding.spec if isinstance(sharding, NamedSharding) else None
        return HeldArray(name, [pinned], [_ids(sharding)], None, False, spec,
                         key_dtype, nbytes)
    replicas = list(split_by_mesh_axis(pinned, name_on_mesh))
    return HeldArray(name, replicas, [_ids(r.sharding) for r in replicas],
                     name_on_mesh, _spec_uses(sharding.spec, name_on_mesh), sharding.spec, key_dtype, nbytes)


def readable(x: jax.Array) -> bool:
    """Whether a held replica can still be read: on Pathways (and under ``InJaxFaults``) a lost slice's
    arrays raise ``DATA_LOSS`` when waited on."""
    try:
        jax.block_until_ready(x)
    except (jax.errors.JaxRuntimeError, RuntimeError):
        return False
    return True


def rebuild(held: HeldArray, target: Sharding, usable: Callable[[frozenset[int]], bool]) -> jax.Array | None:
    """``held`` whole again in pinned host memory on ``target``'s layout, from its replicas on devices that
    ``usable`` accepts and that read back; None when no whole copy survives. The held replicas stay as they
    are (a sharded array's parts are copied first: pathwaysutils' concatenation donates its inputs)."""
    alive = [r for r, ids in zip(held.replicas, held.device_ids, strict=True) if usable(ids) and readable(r)]
    if not held.split:
        if not alive:
            return None
        source = alive[0]
    else:
        if len(alive) != len(held.replicas) or held.axis is None:
            return None
        parts = [jax.device_put(r, r.sharding, may_alias=False) for r in alive]
        source = concatenate_by_mesh_axis(parts, held.axis)
    # host to host (the kind it is held in) first, then to the devices, as Orbax's Snapshotter restores on Pathways
    return jax.device_put(source, target.with_memory_kind(source.sharding.memory_kind or PINNED))


def to_device(host: jax.Array, held: HeldArray, target: Sharding) -> Any:
    """The rebuilt array on ``target`` in device memory, a typed key again where it was one."""
    out = jax.device_put(host, target, may_alias=False)
    return jax.random.wrap_key_data(out, dtype=held.key_dtype) if held.key_dtype is not None else out


def target_sharding(held: HeldArray, want: Any) -> Sharding:
    """The sharding a restore puts ``held`` on: ``want`` itself (a ``Sharding``), its ``.sharding`` (an array
    or ``ShapeDtypeStruct``), or — ``want`` a ``Mesh`` — the array's own spec on that mesh."""
    if isinstance(want, Mesh):
        if held.spec is None:
            raise ValueError(f"{held.name}: not laid out by a NamedSharding; give its target sharding")
        return NamedSharding(want, held.spec)
    sharding = want if isinstance(want, Sharding) else getattr(want, "sharding", None)
    if not isinstance(sharding, Sharding):
        raise ValueError(f"{held.name}: the target leaf ({type(want).__name__}) has no sharding")
    return sharding


def required_bytes(state: Any, *, in_flight: bool = True) -> int:
    """Host memory the tier needs for ``state`` (arrays or ``ShapeDtypeStruct``s with shardings): one copy of
    this host's share, every replica its devices hold; two copies with ``in_flight`` (the held one while the
    next is copied), the peak."""
    one = sum(host_bytes(leaf) for leaf in jax.tree_util.tree_leaves(state) if _is_array_like(leaf))
    return 2 * one if in_flight else one


def _is_array_like(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | jax.ShapeDtypeStruct)


def host_memory_free() -> int:
    """The host's free physical memory, the default budget."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_budget(state: Any, budget_bytes: int | None) -> int:
    """``required_bytes(state)``, or ``MemoryTierFull`` when ``budget_bytes`` (default: the host's free
    memory) cannot hold it."""
    need = required_bytes(state)
    budget = host_memory_free() if budget_bytes is None else budget_bytes
    if need > budget:
        raise MemoryTierFull(
            f"the replica snapshot tier needs {need / 2**20:.1f} MiB of host memory on this host (two copies of "
            f"its {need / 2 / 2**20:.1f} MiB share of the state: the held one and the next, in flight) and the "
            f"budget is {budget / 2**20:.1f} MiB. Give the host more memory, shard the state over more devices, "
            "or turn the tier off.")
    return need


def pinned_zeros(leaf: jax.ShapeDtypeStruct) -> jax.Array | None:
    """Zeros of ``leaf``'s shape in pinned host memory on its sharding, every byte written (a region's zeros
    are copied in from the host); None for a typed key (a few bytes) or a leaf without a sharding."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, Sharding) or is_key(leaf):
        return None
    shape, dtype = tuple(leaf.shape), leaf.dtype

    def region(index: tuple[slice, ...] | None) -> np.ndarray:  # written, not calloc's untouched pages
        return np.full(tuple(stop - start for start, stop in index_bounds(index, shape)), 0, dtype)

    return jax.make_array_from_callback(shape, sharding.with_memory_kind(PINNED), region)


def touch_copies(state: Any, axis: ReplicaAxis, copies: int, kind: str = PINNED) -> list[jax.Array]:
    """``copies`` throwaway copies of ``state``'s arrays in host memory of ``kind`` on their shardings, complete:
    each array copied as a snapshot copies it, each ``ShapeDtypeStruct`` as zeros (pinned memory)."""
    out: list[jax.Array] = []
    leaves = jax.tree_util.tree_leaves(state)
    for _ in range(copies):
        out.extend(r for held in copy_to_host([("", x) for x in leaves if isinstance(x, jax.Array)], axis, kind)
                   for r in held.replicas)
        out.extend(zeros for leaf in leaves
                   if isinstance(leaf, jax.ShapeDtypeStruct) and (zeros := pinned_zeros(leaf)) is not None)
    jax.block_until_ready(out)
    return out


__all__ = ["HOST_KINDS", "PINNED", "UNPINNED", "HeldArray", "ReplicaAxis", "axis_name", "check_budget", "copy_to_host",
           "device_bytes", "dispatch_to_host", "hold_pinned", "host_bytes", "host_memory_free", "is_key",
           "pinned_zeros", "readable", "rebuild", "required_bytes", "stage", "staging_room", "target_sharding",
           "to_device", "touch_copies"]
