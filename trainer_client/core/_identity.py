"""Run and topology identity: who saved a step, and whether the run asking to resume may take it.

Every step trainer_client saves records the run that saved it (``run_id``: the trainer's ``CKPTD_RUN_ID``,
stable across the run's restarts) and its JAX process count, beside the mesh, in ckptd's training metadata;
every manifest records them with the job (``StepIdentity``). A resume request may say who asks (``run_id``,
``process_count``). The rule (docs/protocol.md, "Identity"):

* another run — both ids known and different — is refused (``FOREIGN_CHECKPOINT``) unless the request sets
  ``allow_foreign_run``: a job directory reused by a new experiment, or two runs writing one directory,
  must not silently resume each other's weights;
* another topology — both process counts known and different — is refused unless ``allow_foreign_topology``:
  state kept per process (a data iterator's ``process_<i>-of-<n>`` files, per-host RNG) has no owner on
  another count;
* the mesh is not identity: a different mesh is what an elastic resume is for (the planner keeps the axis
  names and the model-parallel sizes, and notes the resize);
* what is not recorded is not checked: a step written by plain Orbax (no ckptd metadata) stays resumable,
  with a note saying nothing was checked; so does a request that names no run.

A refusal allowed by the request is kept in the plan's notes. One function, ``identity_notes``, called by
the one plan assembly (``resume_decision.resume_plan``), so the server, ``ckptd plan`` and the client's fallback agree.
No jax here.
"""

from __future__ import annotations

import posixpath

from trainer_client.core._errors import PlanningError
from trainer_client.core._storage import Storage
from trainer_client.core.format._steps import array_items, read_saved_sharding
from trainer_client.core.protocol import ErrorCode, ResumeRequest, StepIdentity, TrainingMetadata


def identity_notes(step: int, training: TrainingMetadata | None, request: ResumeRequest) -> list[str]:
    """The plan's notes about the step's identity against the request's; raises ``PlanningError``
    (``FOREIGN_CHECKPOINT``) for another run or process count the request does not allow."""
    if training is None:
        return [f"step {step} records no run identity (no ckptd metadata: plain Orbax?): its run and process "
                "count are not checked"]
    notes: list[str] = []
    refused: list[tuple[str, str]] = []  # (why, the request's field that allows it)
    if request.run_id is not None:
        if training.run_id is None:
            notes.append(f"step {step} records no run id: not checked against run {request.run_id!r}")
        elif training.run_id != request.run_id:
            text = f"step {step} was saved by run {training.run_id!r}, not by run {request.run_id!r}"
            if request.allow_foreign_run:
                notes.append(text + " (allow_foreign_run)")
            else:
                refused.append((text, "allow_foreign_run"))
    if request.process_count is not None and training.process_count is not None and (
        training.process_count != request.process_count
    ):
        text = (f"step {step} was saved by {training.process_count} process(es), this run has "
                f"{request.process_count}: state kept per process has no owner on another count")
        if request.allow_foreign_topology:
            notes.append(text + " (allow_foreign_topology)")
        else:
            refused.append((text, "allow_foreign_topology"))
    if refused:
        raise PlanningError(
            ErrorCode.FOREIGN_CHECKPOINT,
            "; ".join(why for why, _ in refused)
            + f". Set {' and '.join(flag for _, flag in refused)} in the request to resume from it anyway",
        )
    return notes


def step_identity(storage: Storage, step_path: str, training: TrainingMetadata | None) -> StepIdentity:
    """What a manifest records of the step at ``<job>/<step directory>``: its job (the directory it is in),
    and the run, process count and mesh from ckptd's training metadata; for a step without it (plain
    Orbax), the mesh its arrays' ``_sharding`` records, if any."""
    job = posixpath.basename(posixpath.dirname(step_path.rstrip("/"))) or None
    if training is not None:
        return StepIdentity(job=job, run_id=training.run_id, process_count=training.process_count,
                            mesh=training.mesh)
    mesh = None
    for item in array_items(storage, step_path):
        mesh = read_saved_sharding(storage, step_path, item)[0]
        if mesh is not None:
            break
    return StepIdentity(job=job, mesh=mesh)


__all__ = ["identity_notes", "step_identity"]
