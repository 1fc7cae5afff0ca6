"""The mesh planner: a pure function of (saved layout, devices alive, policy, memory) -> mesh and specs.

Pure so that every host's sidecar, and the client's own fallback when the sidecar cannot answer, give
the same answer for the same inputs. The whole plan of a step (this mesh, the batch, the slices, the
identity notes) is assembled by ``trainer_client/core/_resume_decision.py``, which also picks the step. The
planner

* keeps every model-parallel axis (any axis not named in ``DATA_PARALLEL_AXES``) at its saved size and
  resizes the data-parallel axes, ``replica`` first, then ``data``, ``dp``, ``batch`` and ``fsdp`` last
  (fsdp shards parameters: shrinking it costs memory per device);
* resizes the most preferred data-parallel axis alone when it can (so the other axes keep their saved
  sizes and the devices of a slice stay together), using as many alive devices as that layout allows;
  when the count does not factor (7 of 8 on ``(replica=4, data=2)``) it takes the largest usable subset
  and names the devices (per slice) left idle; other data-parallel axes shrink only when that layout
  does not exist or the state does not fit on it;
* keeps each array's partition spec where every sharded dimension still divides, and otherwise stops
  sharding that dimension on the offending axis — every such array is marked ``changed``, with the reason;
* computes the state's bytes per device on the new mesh and, given the device memory, only returns a mesh
  the state fits on (``DOES_NOT_FIT`` otherwise); ``NO_VALID_MESH`` when the model-parallel axes alone
  need more devices than are alive.

The search is exhaustive over data-parallel sizes while that is under ``_EXHAUSTIVE_LIMIT`` meshes;
beyond it the less-preferred data-parallel axes take divisors and multiples of their saved sizes.
No jax here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from trainer_client.core._dtypes import dtype_bytes
from trainer_client.core._errors import PlanningError
from trainer_client.core.protocol import ArraySpec, ErrorCode, MeshSpec, PartitionSpecJSON

# Axes a plan may resize, in the order it prefers to resize them.
DATA_PARALLEL_AXES: tuple[str, ...] = ("replica", "data", "dp", "batch", "fsdp")
_EXHAUSTIVE_LIMIT = 20_000
_NEAR_MULTIPLES = 64  # non-exhaustive search: multiples of an axis's saved size tried near it ...
_TOP_MULTIPLES = 256  # ... and at the top (most devices used)


@dataclass
class MeshPlan:
    mesh: MeshSpec
    arrays: dict[str, ArraySpec]
    idle_devices: int
    bytes_per_device: int | None = None
    fits_memory: bool | None = None
    notes: list[str] = field(default_factory=list)


def _prod(xs: list[int]) -> int:
    return math.prod(xs)


def _fmt(mesh: MeshSpec) -> str:
    return "(" + ", ".join(f"{a}={s}" for a, s in zip(mesh.axis_names, mesh.shape, strict=True)) + ")"


def format_bytes(n: int | float | None) -> str:
    """``1536`` -> ``"1.50 KiB"``; None -> ``"unknown"``."""
    if n is None:
        return "unknown"
    try:
        value = float(n)
    except OverflowError:  # an integer no float holds: a size from a shape of 400 digits (or of 40 huge ones)
        return f"~10^{len(str(abs(int(n)))) - 1} B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def _axes_of(entry: str | list[str] | None) -> list[str]:
    if entry is None:
        return []
    return [entry] if isinstance(entry, str) else list(entry)


def fit_array(name: str, spec: ArraySpec, mesh: MeshSpec) -> tuple[ArraySpec, str | None]:
    """Keep ``spec`` on ``mesh`` where every sharded dimension divides; drop axes where it does not."""
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    if spec.shape is None:
        return spec, None
    new_spec: PartitionSpecJSON = []
    reasons = []
    for dim, entry in enumerate(spec.partition_spec):
        extent = spec.shape[dim] if dim < len(spec.shape) else 1
        kept: list[str] = []
        for axis in _axes_of(entry):
            if axis not in sizes:
                reasons.append(f"dim {dim}: axis {axis!r} is not in the mesh")
            elif extent % (_prod([sizes[a] for a in kept]) * sizes[axis]) == 0:
                kept.append(axis)
            else:
                reasons.append(f"dim {dim} ({extent}) does not divide by {axis}={sizes[axis]}")
        new_spec.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    if not reasons:
        return spec, None
    return spec.model_copy(update={"partition_spec": new_spec, "changed": True}), (
        f"{name}: " + "; ".join(reasons) + " -> not sharded on that axis"
    )


def array_bytes_per_device(spec: ArraySpec, mesh: MeshSpec) -> int:
    """Bytes of one device's shard of an array (its largest shard)."""
    if spec.shape is None:
        return 0
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    elements = 1
    for dim, extent in enumerate(spec.shape):
        entry = spec.partition_spec[dim] if dim < len(spec.partition_spec) else None
        ways = _prod([sizes.get(a, 1) for a in _axes_of(entry)])
        elements *= -(-extent // ways)
    return elements * dtype_bytes(spec.dtype)


def _candidate_sizes(axis_saved: int, cap: int, exhaustive: bool) -> list[int]:
    if exhaustive:
        return list(range(cap, 0, -1))
    sizes = {d for d in range(1, axis_saved + 1) if axis_saved % d == 0}
    most = cap // max(axis_saved, 1)
    # multiples of the saved size: those near it, the largest ones (the meshes that use the most devices)
    # and the 5-smooth ones between (array dimensions are powers of two times small factors, so these are
    # the sizes that divide them); not every one (300,000 devices once meant 150,000 meshes to try, 33 s)
    sizes |= {axis_saved * k for k in (*range(2, min(most, _NEAR_MULTIPLES) + 1),
                                       *range(max(2, most - _TOP_MULTIPLES + 1), most + 1), *_smooth(most))}
    return sorted((s for s in sizes if s <= cap), reverse=True)


def _smooth(limit: int) -> list[int]:
    """Every 2^a * 3^b * 5^c from 2 up to ``limit`` (a few hundred below a million)."""
    out = []
    two = 1
    while two <= limit:
        three = two
        while three <= limit:
            five = three
            while five <= limit:
                out.append(five)
                five *= 5
            three *= 3
        two *= 2
    return [n for n in out if n >= 2]


def candidate_meshes(saved: MeshSpec, alive: int) -> Iterator[MeshSpec]:
    """Meshes with the saved model-parallel axes and resized data-parallel axes, best first.

    First the mesh that resizes only the most preferred data-parallel axis (e.g. ``replica=3`` for 6 or
    7 of 8 devices on ``(replica=4, data=2)``: 7 does not factor, one device stays idle). Then, for when
    that one does not exist or the state does not fit on it, every other resize: most devices used
    first, then the less preferred axes (``fsdp`` first) kept closest to their saved sizes.
    """
    dp_idx = [i for name in DATA_PARALLEL_AXES for i, a in enumerate(saved.axis_names) if a == name]
    model = _prod([s for i, s in enumerate(saved.shape) if i not in dp_idx])
    if not dp_idx:
        if alive >= saved.size:
            yield MeshSpec(axis_names=list(saved.axis_names), shape=list(saved.shape))
        return
    if alive < model:
        return
    first, rest = dp_idx[0], dp_idx[1:]
    seen: set[tuple[int, ...]] = set()
    primary = list(saved.shape)
    primary[first] = alive // (saved.size // saved.shape[first])
    if primary[first] >= 1:  # only the most preferred axis resized: the layout users expect
        seen.add(tuple(primary))
        yield MeshSpec(axis_names=list(saved.axis_names), shape=primary)
    cap = alive // model
    exhaustive = cap ** (len(rest) + 1) <= _EXHAUSTIVE_LIMIT
    options = [_candidate_sizes(saved.shape[i], cap, exhaustive) for i in rest]
    found: list[tuple[tuple[int, ...], MeshSpec]] = []
    for combo in itertools.product(*options):
        others = model * _prod(list(combo))
        if others > alive:
            continue
        # the largest size of the first axis, and (for memory or divisibility) every smaller one
        firsts = range(alive // others, 0, -1) if exhaustive else [alive // others]
        for first_size in firsts:
            shape = list(saved.shape)
            for i, size in zip(rest, combo, strict=True):
                shape[i] = size
            shape[first] = first_size
            mesh = MeshSpec(axis_names=list(saved.axis_names), shape=shape)
            # prefer: more devices; then later (less preferred) axes closer to their saved size
            closeness = tuple(-abs(shape[i] - saved.shape[i]) for i in reversed(rest))
            found.append(((mesh.size, *closeness), mesh))
    found.sort(key=lambda item: item[0], reverse=True)
    for _, mesh in found:
        if tuple(mesh.shape) not in seen:
            seen.add(tuple(mesh.shape))
            yield mesh


def plan_mesh(
    saved_mesh: MeshSpec,
    saved_arrays: Mapping[str, ArraySpec],
    alive_devices: int,
    policy: str,
    *,
    device_memory_bytes: int | None = None,
    headroom_bytes: int = 0,
) -> MeshPlan:
    """The best mesh for the devices alive on which the state fits, and every array's spec on it."""
    if alive_devices < 1:
        raise PlanningError(ErrorCode.NOT_ENOUGH_DEVICES, "no devices are alive")
    if policy == "pause" and alive_devices < saved_mesh.size:
        raise PlanningError(
            ErrorCode.NOT_ENOUGH_DEVICES,
            f"policy 'pause' needs the full mesh of {saved_mesh.size} devices {_fmt(saved_mesh)}; only "
            f"{alive_devices} are alive. Wait for the lost slices or use 'resize'.",
        )
    best_miss: tuple[int, MeshSpec] | None = None
    tried = 0
    for mesh in candidate_meshes(saved_mesh, alive_devices):
        tried += 1
        arrays: dict[str, ArraySpec] = {}
        notes: list[str] = []
        for name in sorted(saved_arrays):
            fitted, why = fit_array(name, saved_arrays[name], mesh)
            arrays[name] = fitted
            if why:
                notes.append(why)
        known = any(a.shape is not None for a in arrays.values())
        per_device = sum(array_bytes_per_device(a, mesh) for a in arrays.values()) if known else None
        fits = None
        if device_memory_bytes is not None and per_device is not None:
            fits = per_device + headroom_bytes <= device_memory_bytes
            if not fits:
                if best_miss is None or per_device < best_miss[0]:
                    best_miss = (per_device, mesh)
                continue
        if mesh.shape != saved_mesh.shape:
            notes.insert(0, f"mesh resized from {_fmt(saved_mesh)} to {_fmt(mesh)}")
        if per_device is None and saved_arrays:
            notes.append("array shapes unknown: memory per device not computed")
        return MeshPlan(mesh, arrays, alive_devices - mesh.size, per_device, fits, notes)
    if best_miss is not None:
        need, mesh = best_miss
        raise PlanningError(
            ErrorCode.DOES_NOT_FIT,
            f"the state needs {format_bytes(need)} per device at best (mesh {_fmt(mesh)}) plus "
            f"{format_bytes(headroom_bytes)} headroom, but a device has {format_bytes(device_memory_bytes)} "
            f"({tried} meshes tried). Wait for the lost slices, or lower the headroom.",
        )
    model = [f"{a}={s}" for a, s in zip(saved_mesh.axis_names, saved_mesh.shape, strict=True)
             if a not in DATA_PARALLEL_AXES]
    need = _prod([s for a, s in zip(saved_mesh.axis_names, saved_mesh.shape, strict=True)
                  if a not in DATA_PARALLEL_AXES])
    raise PlanningError(
        ErrorCode.NO_VALID_MESH,
        f"no mesh fits {alive_devices} alive devices: the model-parallel axes {model or 'of the saved mesh'} "
        f"of {_fmt(saved_mesh)} need at least {need if model else saved_mesh.size} devices. "
        "Wait for the lost slices to return.",
    )


__all__ = [
    "DATA_PARALLEL_AXES",
    "MeshPlan",
    "PlanningError",
    "array_bytes_per_device",
    "candidate_meshes",
    "fit_array",
    "format_bytes",
    "plan_mesh",
]
