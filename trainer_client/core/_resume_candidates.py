"""What each tier holds for a resume, gathered in one place for the one decision.

ckptd's ``POST /resume`` (``ckptd/api/_answers.py``) and the client's storage fallback
(``trainer_client/client/_ckptd_client.py``) see different things — ckptd its catalog rows, confirmed on storage;
the client a scan of storage — but the same tiers: the storage tier's step (``SeenStep``: a catalog row, or
``StoredStep`` for the step the scan found good), the whole host-memory snapshot this host's shared memory holds,
and the replica snapshots the request says the trainer holds. ``resume_candidates`` turns what a caller sees into
the ``Candidate``s of ``trainer_client.core._resume_decision.decide``, the same way for both: a catalog row still
being verified is refused ``NOT_READY``, one that is not good ``STEP_NOT_GOOD``, a good one is laid out by the
caller's planner (``plan_for_step``, the one planner of a step on storage: the server's call keeps its plans);
the memory tier's newest whole snapshot (``memory_candidate``) and the replicas (``with_replicas``) are added
here. Only how each side sees the storage tier, and how it lays a step out, is its own. No jax here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from os import PathLike
from typing import Protocol, TypeVar

from trainer_client.core._resume_decision import (
    MEMORY,
    REPLICAS,
    STORAGE,
    Candidate,
    Refusal,
    best,
    memory_snapshot_plan,
    resume_plan,
    slices_alive,
)
from trainer_client.core.format._snapshot_dirs import newest_whole
from trainer_client.core.protocol import ErrorCode, ResumePlan, ResumeRequest, StepState, Tier

T = TypeVar("T")
S = TypeVar("S", bound="SeenStep")


class SeenStep(Protocol):
    """The storage tier's step as a caller sees it (``CheckpointInfo``, a catalog row, is one)."""

    @property
    def step(self) -> int: ...

    @property
    def state(self) -> StepState: ...

    @property
    def reason(self) -> str | None: ...


@dataclass(frozen=True)
class StoredStep:
    """A step the fallback's scan of storage found good (``latest_good_on_storage``: committed, not quarantined,
    its files matching its manifest): good by the rule ckptd verifies by, so ``verified`` here."""

    step: int
    path: str
    state: StepState = StepState.VERIFIED
    reason: str | None = None


def stored_candidate(seen: S | None, job: str, request: ResumeRequest,
                     lay_out: Callable[[S], T]) -> Candidate[T] | None:
    """The storage tier's candidate: ``seen`` laid out by ``lay_out`` when it is good (``verified``); refused
    ``NOT_READY`` while it is committed and still being verified, ``STEP_NOT_GOOD`` (with its state and reason)
    when it is anything else."""
    if seen is None:
        return None
    if seen.state is StepState.COMMITTED:
        return Candidate(STORAGE, seen.step, refused=Refusal(ErrorCode.NOT_READY, step=seen.step))
    if seen.state is not StepState.VERIFIED:
        return Candidate(STORAGE, seen.step, refused=Refusal(
            ErrorCode.STEP_NOT_GOOD, f"step {request.step} of job {job!r} is {seen.state.value}: {seen.reason}",
            seen.step))
    good = seen
    return Candidate(STORAGE, seen.step, lambda: lay_out(good))


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


def resume_candidates(
    job: str, request: ResumeRequest, *, stored: Callable[[], S | None], lay_out_stored: Callable[[S], T],
    shm_dir: str | PathLike[str] | None, load: Callable[[T], ResumePlan], dump: Callable[[ResumePlan], T],
    source: str = "ckptd",
) -> list[Candidate[T]]:
    """Every candidate a caller can see, for ``decide``: the memory tier's newest whole snapshot in ``shm_dir``,
    the storage tier's step ``stored()`` (laid out by ``lay_out_stored``), and the replicas the request names.
    ``load``/``dump``: a plan of type ``T`` to a ``ResumePlan`` and back (the server's plans are bytes);
    ``source``: the plans' ``source`` (``ckptd`` or ``storage_scan``).

    Memory is looked at first, then storage: a snapshot leaves shared memory only once it is persisted, so a
    step that leaves memory meanwhile is on storage by the time storage is looked at, never missed by both."""
    held: list[Candidate[T]] = []
    memory = memory_candidate(shm_dir, job, request, source=source)
    if memory is not None:
        held.append(memory.then(dump))
    on_storage = stored_candidate(stored(), job, request, lay_out_stored)
    if on_storage is not None:
        held.append(on_storage)
    return with_replicas(held, request, load=load, dump=dump, job=job, source=source)


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
    survives whole (``whole_replica``).

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
    donor = best(donors)
    assert donor.lay_out is not None
    lay_donor = donor.lay_out

    def lay_out() -> T:
        plan = load(lay_donor())
        laid = f"{note}; laid out as step {plan.step} on {donor.source}"
        return dump(plan.model_copy(update={
            "step": step, "path": "", "tier": REPLICAS, "data_position": None, "notes": [*plan.notes, laid]}))

    return [*held, Candidate(REPLICAS, step, lay_out)]


def as_is(plan: ResumePlan) -> ResumePlan:
    """``load`` and ``dump`` where candidates give plans."""
    return plan


__all__ = [
    "SeenStep",
    "StoredStep",
    "as_is",
    "memory_candidate",
    "resume_candidates",
    "stored_candidate",
    "whole_replica",
    "with_replicas",
]
