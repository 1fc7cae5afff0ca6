"""The one resume decision: which step, from which tier, laid out how — or why none.

A resume may restore a step from several tiers: the trainer's replica snapshots in the accelerator hosts'
memory, a whole snapshot in host memory, a committed step on storage (and, as they come, peer copies). What
each tier holds is gathered in one place (``trainer_client/core/_resume_candidates.py``), which the server's
``POST /resume`` (``ckptd/api/_answers.py``) and the client's storage-scan fallback
(``trainer_client/client/_ckptd_client.py``) both call, each with what it sees; a multi-controller job's
agreement (``trainer_client/runtime/multihost/_multihost.py``) hands its hosts' offers here too. ``decide`` applies the
one rule (docs/protocol.md, "Resume": the newest good step, and at equal steps the tier restored from fastest)
and lays out the chosen step. What comes back is the plan or a ``Refusal``: a wire-contract code, never an HTTP
status nor an exception; the one refusal table (``trainer_client/core/_refusals.py``) says what each side
makes of it: the API its error and status, the client the exception a user gets for the same answer from
ckptd. A new tier is a new ``source`` in ``TIERS_FASTEST_FIRST`` and candidates of it.

The plan of one chosen step (``resume_plan``: mesh, batch, slices, identity notes) is assembled here too,
from the mesh planner (``trainer_client/core/_planner.py``). Pure; no jax here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from trainer_client.core._batching import initial_batch, plan_batch
from trainer_client.core._errors import PlanningError
from trainer_client.core._identity import identity_notes
from trainer_client.core._planner import plan_mesh
from trainer_client.core.format._snapshot import SnapshotMeta
from trainer_client.core.protocol import (
    ArraySpec,
    BatchOptions,
    BatchPlan,
    ErrorCode,
    MeshSpec,
    ResumePlan,
    ResumeRequest,
    SliceAlive,
    Tier,
    TrainingMetadata,
)

REPLICAS, MEMORY, STORAGE = Tier.REPLICAS, Tier.MEMORY, Tier.STORAGE
# At equal steps the first of these wins: the tier a step is restored from fastest (``Tier``'s own order).
TIERS_FASTEST_FIRST: tuple[Tier, ...] = tuple(Tier)

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class Refusal:
    """Why there is no plan, in the wire contract's terms (``code``; its HTTP status is the API's business).

    ``NO_GOOD_CHECKPOINT``, ``STEP_NOT_FOUND`` and ``NOT_READY`` come with an empty ``message``: the refusal
    table words them (``trainer_client/core/_refusals.py``: where each side looked). Otherwise ``message`` is
    the tier's or the planner's."""

    code: ErrorCode
    message: str = ""
    step: int | None = None


@dataclass(frozen=True)
class Candidate(Generic[T]):
    """A step one tier holds: ``lay_out`` makes its plan (called only for the step chosen), or ``refused``
    says why the tier holds it but will not serve it (committed and still being verified, or not good)."""

    source: Tier
    step: int
    lay_out: Callable[[], T] | None = None
    refused: Refusal | None = None

    def __post_init__(self) -> None:
        if self.source not in TIERS_FASTEST_FIRST:
            raise ValueError(f"unknown tier {self.source!r}: add it to TIERS_FASTEST_FIRST")
        if (self.lay_out is None) == (self.refused is None):
            raise ValueError("a candidate is either laid out or refused")

    def then(self, finish: Callable[[T], U]) -> Candidate[U]:
        """The same candidate, its plan passed through ``finish`` (the server sends a plan's bytes)."""
        lay_out = self.lay_out
        return Candidate(self.source, self.step, refused=self.refused,
                         lay_out=None if lay_out is None else lambda: finish(lay_out()))


def _rank(candidate: Candidate[T]) -> tuple[int, int]:
    return candidate.step, -TIERS_FASTEST_FIRST.index(candidate.source)


def best(candidates: Iterable[Candidate[T]]) -> Candidate[T]:
    """The newest of ``candidates`` (not empty); of equal steps, the one of the fastest tier."""
    return max(candidates, key=_rank)


def decide(candidates: Iterable[Candidate[T]], request: ResumeRequest | None = None) -> T | Refusal:
    """The plan of the newest step a tier holds good (the step asked for, when ``request.step`` is set; None:
    no step asked for); of equal steps, the one of the fastest tier. With none: the refusal of the newest step
    held but refused, else ``NO_GOOD_CHECKPOINT`` (``STEP_NOT_FOUND`` for a step asked for). A ``PlanningError``
    laying the step out (devices, memory, identity) is its refusal too: a slower tier's older step is never
    tried instead."""
    wanted = None if request is None else request.step
    asked = [c for c in candidates if wanted is None or c.step == wanted]
    good = [c for c in asked if c.lay_out is not None]
    if good:
        chosen = best(good)
        assert chosen.lay_out is not None
        try:
            return chosen.lay_out()
        except PlanningError as exc:
            return Refusal(exc.code, exc.message, chosen.step)
    refused = [c for c in asked if c.refused is not None]
    if refused:
        why = best(refused).refused
        assert why is not None
        return why
    if wanted is None:
        return Refusal(ErrorCode.NO_GOOD_CHECKPOINT)
    return Refusal(ErrorCode.STEP_NOT_FOUND, step=wanted)


def slices_alive(request: ResumeRequest) -> tuple[list[SliceAlive] | None, list[str]]:
    """The slices a request lists, each once, and what the plan notes about them (docs/protocol.md, "Resume").

    Entries of one index add up (a slice's devices may be listed in parts, one entry per host). The plan is
    always for ``alive_devices``; slices that hold another number of devices cannot say where those are, so
    none is named (``slices_used`` and ``idle_slices`` empty) and a note says why. A schema cannot state
    either rule, and a request it calls valid is answered, not refused."""
    if request.slices is None:
        return None, []
    devices: dict[int, int] = {}
    for entry in request.slices:
        devices[entry.index] = devices.get(entry.index, 0) + entry.devices
    notes = []
    if len(devices) < len(request.slices):
        notes.append("a slice is listed more than once: its entries were added up")
    held = sum(devices.values())
    if held != request.alive_devices:
        notes.append(f"alive_devices={request.alive_devices} but the slices listed hold {held} devices: planned for "
                     "alive_devices, naming no slice")
        return None, notes
    return [SliceAlive(index=i, devices=n) for i, n in sorted(devices.items())], notes


def assign_slices(slices: list[SliceAlive] | None, used: int) -> tuple[list[int], list[SliceAlive]]:
    """Which slices' devices form a mesh of ``used`` devices (whole slices first), and what stays idle."""
    if not slices:
        return [], []
    order = sorted(slices, key=lambda s: (-s.devices, s.index))
    chosen: list[int] = []
    idle: list[SliceAlive] = []
    left = used
    for s in order:
        take = min(s.devices, left)
        if take > 0:
            chosen.append(s.index)
        if s.devices - take > 0:
            idle.append(SliceAlive(index=s.index, devices=s.devices - take))
        left -= take
    return sorted(chosen), sorted(idle, key=lambda s: s.index)


def resume_plan(
    *,
    job: str,
    step: int,
    path: str,
    request: ResumeRequest,
    training: TrainingMetadata | None,
    saved_layout: tuple[MeshSpec | None, dict[str, ArraySpec]],
    source: str = "ckptd",
    tier: Tier = Tier.STORAGE,
    items: Mapping[str, list[str]] | None = None,
) -> ResumePlan:
    """The whole answer to a resume request for one chosen step (pure).

    ``saved_layout`` is the step's (mesh, arrays) as ``trainer_client.core.format._saved_layout`` reads it from
    storage; where it is empty, ckptd's training metadata fills in. ``items``: the step's array items and
    their arrays, for a step whose arrays are not (all) in Orbax's ``default`` item.
    """
    saved_mesh = saved_layout[0] or (training.mesh if training is not None else None)
    saved_arrays = saved_layout[1] or (dict(training.arrays) if training is not None else {})
    alive = request.alive_devices
    slices, slice_notes = slices_alive(request)
    if saved_mesh is None:
        raise PlanningError(
            ErrorCode.NO_VALID_MESH,
            f"step {step} records no mesh (no ckptd metadata and no NamedSharding in _sharding); "
            "cannot lay it out on a new mesh",
        )
    identity = identity_notes(step, training, request)  # another run or process count: refused unless allowed
    planned = plan_mesh(
        saved_mesh, saved_arrays, alive, request.policy,
        device_memory_bytes=request.device_memory_bytes, headroom_bytes=request.memory_headroom_bytes,
    )
    batch = _batch_for(training, saved_mesh, planned.mesh, request.batch)
    notes = [*identity, *slice_notes, *planned.notes]
    if batch is not None and batch.note:
        notes.append(batch.note)
    slices_used, idle_slices = assign_slices(slices, planned.mesh.size)
    return ResumePlan(
        job=job,
        step=step,
        path=path,
        policy=request.policy,
        mesh=planned.mesh,
        saved_mesh=saved_mesh,
        arrays=planned.arrays,
        items={item: list(names) for item, names in items.items()} if items is not None else None,
        data_position=training.data_position if training else None,
        global_batch=batch.global_batch if batch else None,
        batch=batch,
        idle_devices=planned.idle_devices,
        slices_used=slices_used,
        idle_slices=idle_slices,
        bytes_per_device=planned.bytes_per_device,
        fits_memory=planned.fits_memory,
        source="storage_scan" if source == "storage_scan" else "ckptd",
        tier=tier,
        notes=notes,
    )


def _batch_for(
    training: TrainingMetadata | None, saved_mesh: MeshSpec, mesh: MeshSpec, options: BatchOptions
) -> BatchPlan | None:
    if training is None:
        return None
    saved = training.batch
    if saved is None:
        try:
            saved = initial_batch(training.global_batch, saved_mesh)
        except ValueError:
            return None
    return plan_batch(saved, mesh, options)


def memory_snapshot_plan(
    *, job: str, request: ResumeRequest, snapshot: tuple[Path, SnapshotMeta], source: str = "ckptd"
) -> ResumePlan:
    """A plan that restores from a whole host-memory snapshot (``tier: "memory"``)."""
    path, meta = snapshot
    return resume_plan(
        job=job, step=meta.step, path=str(path), request=request, training=meta.training,
        saved_layout=(meta.training.mesh, dict(meta.training.arrays)), source=source, tier=Tier.MEMORY,
    )


__all__ = [
    "MEMORY",
    "REPLICAS",
    "STORAGE",
    "TIERS_FASTEST_FIRST",
    "Candidate",
    "Refusal",
    "assign_slices",
    "best",
    "decide",
    "memory_snapshot_plan",
    "resume_plan",
    "slices_alive",
]
