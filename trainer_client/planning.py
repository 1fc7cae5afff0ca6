"""The resume planner: a pure function of (saved layout, devices alive, policy) -> mesh and array specs.

Pure so that every host's sidecar, and the client's own fallback when the sidecar cannot answer, give
the same answer for the same inputs. This first planner keeps every model-parallel axis and resizes one
data-parallel axis (``replica`` first, then ``data``/``dp``/``batch``) to use as many of the alive devices
as it can; an array dimension that no longer divides by its axis size stops being sharded on that axis
(the array is listed as changed, with the reason). No jax here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer_client.protocol import (
    ArraySpec,
    ErrorCode,
    MeshSpec,
    PartitionSpecJSON,
    ResumePlan,
    ResumeRequest,
    TrainingMetadata,
)

# Axes a plan may resize, in the order it prefers to resize them.
DATA_PARALLEL_AXES: tuple[str, ...] = ("replica", "data", "dp", "batch")


class PlanningError(ValueError):
    """No plan exists for these inputs; ``code`` says why in the wire contract's terms."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class MeshPlan:
    mesh: MeshSpec
    arrays: dict[str, ArraySpec]
    idle_devices: int
    notes: list[str] = field(default_factory=list)


def _prod(xs: list[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def choose_mesh(saved: MeshSpec, alive_devices: int, policy: str) -> tuple[MeshSpec, list[str]]:
    """Resize one data-parallel axis of ``saved`` to fit ``alive_devices``.

    ``pause`` never shrinks: it needs at least the saved mesh's device count.
    """
    notes: list[str] = []
    if alive_devices < 1:
        raise PlanningError(ErrorCode.NOT_ENOUGH_DEVICES, "no devices are alive")
    if policy == "pause" and alive_devices < saved.size:
        raise PlanningError(
            ErrorCode.NOT_ENOUGH_DEVICES,
            f"policy 'pause' needs the full mesh of {saved.size} devices "
            f"({_fmt(saved)}); only {alive_devices} are alive. Wait for the lost slices or use 'resize'.",
        )
    candidates = [i for name in DATA_PARALLEL_AXES for i, a in enumerate(saved.axis_names) if a == name]
    best: MeshSpec | None = None
    for i in candidates:
        others = _prod(saved.shape[:i] + saved.shape[i + 1 :])
        size = alive_devices // others
        if size < 1:
            continue
        shape = list(saved.shape)
        shape[i] = size
        mesh = MeshSpec(axis_names=list(saved.axis_names), shape=shape)
        if best is None or mesh.size > best.size:
            best = mesh
    if best is None and candidates and alive_devices >= _prod(
        [s for i, s in enumerate(saved.shape) if i not in candidates]
    ):
        # No single data-parallel axis fits: shrink them in order of preference, down to 1 if need be.
        shape = list(saved.shape)
        for i in candidates:
            shape[i] = 1
        for i in candidates:
            shape[i] = max(1, alive_devices // _prod(shape[:i] + shape[i + 1 :]))
        best = MeshSpec(axis_names=list(saved.axis_names), shape=shape)
    if best is None:
        if alive_devices >= saved.size:
            best = MeshSpec(axis_names=list(saved.axis_names), shape=list(saved.shape))
            notes.append("no data-parallel axis to resize; kept the saved mesh")
        else:
            model = [a for a in saved.axis_names if a not in DATA_PARALLEL_AXES]
            raise PlanningError(
                ErrorCode.NO_VALID_MESH,
                f"no mesh fits {alive_devices} devices: the saved mesh {_fmt(saved)} needs at least "
                f"{min((_prod(saved.shape) // saved.shape[i] for i in candidates), default=saved.size)} "
                f"devices for its model-parallel axes {model}. Wait for the lost slices to return.",
            )
    if best.shape != saved.shape:
        notes.append(f"mesh resized from {_fmt(saved)} to {_fmt(best)}")
    return best, notes


def _fmt(mesh: MeshSpec) -> str:
    return "(" + ", ".join(f"{a}={s}" for a, s in zip(mesh.axis_names, mesh.shape, strict=True)) + ")"


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
        axes = [a for a in _axes_of(entry) if a in sizes]
        extent = spec.shape[dim] if dim < len(spec.shape) else 1
        kept: list[str] = []
        for axis in axes:
            if extent % (_prod([sizes[a] for a in kept]) * sizes[axis]) == 0:
                kept.append(axis)
            else:
                reasons.append(f"dim {dim} ({extent}) does not divide by {axis}={sizes[axis]}")
        new_spec.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    if not reasons:
        return spec, None
    return spec.model_copy(update={"partition_spec": new_spec, "changed": True}), (
        f"{name}: " + "; ".join(reasons) + " -> replicated on that axis"
    )


def plan_mesh(
    saved_mesh: MeshSpec,
    saved_arrays: dict[str, ArraySpec],
    alive_devices: int,
    policy: str,
) -> MeshPlan:
    """The mesh for the devices alive and every array's spec on it."""
    mesh, notes = choose_mesh(saved_mesh, alive_devices, policy)
    arrays: dict[str, ArraySpec] = {}
    for name in sorted(saved_arrays):
        fitted, why = fit_array(name, saved_arrays[name], mesh)
        arrays[name] = fitted
        if why:
            notes.append(why)
    return MeshPlan(mesh=mesh, arrays=arrays, idle_devices=alive_devices - mesh.size, notes=notes)


def resume_plan(
    *,
    job: str,
    step: int,
    path: str,
    request: ResumeRequest,
    training: TrainingMetadata | None,
    saved_sharding: tuple[MeshSpec | None, dict[str, ArraySpec]],
    source: str = "ckptd",
) -> ResumePlan:
    """The whole answer to a resume request for one chosen step (pure).

    The saved layout comes from ckptd's training metadata when the step has it, else from Orbax's
    ``_sharding`` file (``saved_sharding``), so steps written by plain Orbax get plans too.
    """
    if training is not None:
        saved_mesh: MeshSpec | None = training.mesh
        saved_arrays = dict(training.arrays) or saved_sharding[1]
    else:
        saved_mesh, saved_arrays = saved_sharding
    alive = request.alive_devices
    if request.slices is not None and sum(s.devices for s in request.slices) != alive:
        raise PlanningError(
            ErrorCode.INVALID_REQUEST,
            f"alive_devices={alive} but the slices listed hold "
            f"{sum(s.devices for s in request.slices)} devices",
        )
    if saved_mesh is None:
        raise PlanningError(
            ErrorCode.NO_VALID_MESH,
            f"step {step} records no mesh (no ckptd metadata and no NamedSharding in _sharding); "
            "cannot lay it out on a new mesh",
        )
    planned = plan_mesh(saved_mesh, saved_arrays, alive, request.policy)
    return ResumePlan(
        job=job,
        step=step,
        path=path,
        policy=request.policy,
        mesh=planned.mesh,
        saved_mesh=saved_mesh,
        arrays=planned.arrays,
        data_position=training.data_position if training else None,
        global_batch=training.global_batch if training else None,
        idle_devices=planned.idle_devices,
        source="storage_scan" if source == "storage_scan" else "ckptd",
        notes=planned.notes,
    )


__all__ = [
    "DATA_PARALLEL_AXES",
    "MeshPlan",
    "PlanningError",
    "choose_mesh",
    "fit_array",
    "plan_mesh",
    "resume_plan",
]
