"""The one resume decision: which step, from which tier, laid out how — or why none.

A resume may restore a step from several tiers: the trainer's replica snapshots in the accelerator hosts'
memory, a whole snapshot in host memory, a committed step on storage (and, as they come, peer copies). The
server's ``POST /resume`` (``ckptd/api/_answers.py``) and the client's storage-scan fallback
(``trainer_client/client/_ckptd_client.py``) gather what each tier holds in their own way (the catalog and
its checks; a scan of storage; the request's replicas, ``with_replicas``) and hand it here as
``Candidate``s; ``decide`` applies the one rule (docs/protocol.md, "Resume": the newest good step,
and at equal steps the tier restored from fastest) and lays out the chosen step. What comes back is the
plan or a ``Refusal``: a wire-contract code, never an HTTP status nor an exception; the API turns it into
its error (``ckptd/api/_errors.py`` gives the status), the client into the exception a user gets for the
same answer from ckptd. A new tier is a new ``source`` in ``TIERS_FASTEST_FIRST`` and candidates of it.

The plan of one chosen step (``resume_plan``: mesh, batch, slices, identity notes) is assembled here too,
from the mesh planner (``trainer_client/core/_planner.py``). Pure; no jax here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Generic, TypeVar

from trainer_client.core._batching import initial_batch, plan_batch
from trainer_client.core._errors import PlanningError
from trainer_client.core._identity import identity_notes
from trainer_client.core._planner import plan_mesh
from trainer_client.core.format._snapshot import SnapshotMeta
from trainer_client.core.format._snapshot_dirs import newest_whole
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

    ``NO_GOOD_CHECKPOINT`` and ``STEP_NOT_FOUND`` come with an empty ``message``: each side says them in its
    own words (where it looked). Otherwise ``message`` is the tier's or the planner's."""

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


def decide(candidates: Iterable[Candidate[T]], request: ResumeRequest) -> T | Refusal:
    """The plan of the newest step a tier holds good (the step asked for, when ``request.step`` is set); of
    equal steps, the one of the fastest tier. With none: the refusal of the newest step held but refused,
    else ``NO_GOOD_CHECKPOINT`` (``STEP_NOT_FOUND`` for a step asked for). A ``PlanningError`` laying the
    step out (devices, memory, identity) is its refusal too: a slower tier's older step is never tried
    instead."""
    asked = [c for c in candidates if request.step is None or c.step == request.step]
    good = [c for c in asked if c.lay_out is not None]
    if good:
        chosen = max(good, key=_rank)
        assert chosen.lay_out is not None
        try:
            return chosen.lay_out()
        except PlanningError as exc:
            return Refusal(exc.code, exc.message, chosen.step)
    refused = [c for c in asked if c.refused is not None]
    if refused:
        why = max(refused, key=_rank).refused
        assert why is not None
        return why
    if request.step is None:
        return Refusal(ErrorCode.NO_GOOD_CHECKPOINT)
    return Refusal(ErrorCode.STEP_NOT_FOUND, step=request.step)


def memory_candidate(
    shm_dir: str | PathLike[str] | None, job: str, request: ResumeRequest, *, source: str = "ckptd"
) -> Candidate[ResumePlan] | None:
    """The memory tier's candidate: the newest whole snapshot of ``job`` (not past ``request.step``), unless
    the request leaves the memory tier out. ``source``: who plans (the plan's ``source`` field)."""
    held = newest_whole(shm_dir, job, at_most=request.step) if request.use_memory_tier else None
    if held is None:
        return None
    return Candidate(MEMORY, held[1].step,
                     lambda: memory_snapshot_plan(job=job, request=request, snapshot=held, source=source))


def whole_replica(request: ResumeRequest) -> list[int] | None:
    """The slices of a replica the request's alive slices hold whole, or None (docs/protocol.md, "Resume").

    What the core can check from the request alone: ``request.replicas`` names each replica's slices, and a
    replica is whole when every one of them is among the slices ``slices_alive`` names (listed with devices).
    Without a slice list it names (no ``slices``, or ones that do not hold ``alive_devices``), which slices
    survived is unknown and no replica is whole. Whether each device of a listed slice still holds its copy is
    the trainer's to check when it restores (a replica that does not read back: it asks again without
    ``replicas``)."""
    held = request.replicas
    slices = slices_alive(request)[0]
    if held is None or slices is None:
        return None
    alive = {s.index for s in slices if s.devices > 0}
    return next((sorted(set(replica)) for replica in held.slices if set(replica) <= alive), None)


def with_replicas(
    candidates: Iterable[Candidate[T]], request: ResumeRequest,
    *, load: Callable[[T], ResumePlan], dump: Callable[[ResumePlan], T], job: str, source: str = "ckptd",
) -> list[Candidate[T]]:
    """``candidates`` and the replica tier's, when the request says the trainer holds a step whose replica
    survives whole (``whole_replica``): what ckptd's ``POST /resume`` and the client's fallback both decide on.

    The replicas' plan (``tier: "replicas"``, no ``path``) is laid out from the held step's own training
    metadata when the request carries it (``ReplicasHeld.training``: its mesh, arrays, batch and data
    position), as a step on storage is from its own. A request without it (the replicas carry the state, not
    its layout) gets the plan of the newest step another tier holds good, laid out for the alive devices as
    that tier would, then named for the replicas' step (no ``data_position``: the tier keeps it with its
    arrays); with no other good step there is then no replica candidate. ``load``/``dump``: a candidate's
    plan to a ``ResumePlan`` and back (the server's candidates give bytes); ``job``, ``source``: the plan's."""
    held = list(candidates)
    replica = whole_replica(request)
    if replica is None or request.replicas is None:
        return held
    step = request.replicas.step
    note = f"restored from the replicas of step {step} in the hosts' memory (slices {replica} hold one whole)"
    training = request.replicas.training
    if training is not None:
        own = training

        def lay_out_own() -> T:
            plan = resume_plan(job=job, step=step, path="", request=request, training=own,
                               saved_layout=(own.mesh, dict(own.arrays)), source=source, tier=Tier.REPLICAS)
            return dump(plan.model_copy(update={"notes": [*plan.notes, note]}))

        return [*held, Candidate(REPLICAS, step, lay_out_own)]
    donors = [c for c in held if c.lay_out is not None]
    if not donors:
        return held
    donor = max(donors, key=_rank)
    assert donor.lay_out is not None
    lay_donor = donor.lay_out

    def lay_out() -> T:
        plan = load(lay_donor())
        laid = f"{note}; laid out as step {plan.step} on {donor.source}"
        return dump(plan.model_copy(update={
            "step": step, "path": "", "tier": REPLICAS, "data_position": None, "notes": [*plan.notes, laid]}))

    return [*held, Candidate(REPLICAS, step, lay_out)]


def as_is(plan: ResumePlan) -> ResumePlan:
    """``with_replicas``' ``load`` and ``dump`` where candidates give plans."""
    return plan


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
    "as_is",
    "assign_slices",
    "decide",
    "memory_candidate",
    "memory_snapshot_plan",
    "resume_plan",
    "slices_alive",
    "whole_replica",
    "with_replicas",
]
