"""The stored schema: what trainer_client records with every step (Orbax's custom metadata, key ``ckptd``)
and what the catalog says about a step. The same models travel on the wire inside answers."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from trainer_client.core.protocol._base import MAX_EXACT_INT, _Model


class StepState(StrEnum):
    """Lifecycle states of a step directory (docs/architecture.md, States of a step)."""

    WRITING = "writing"  # a tmp directory younger than the save timeout
    ABANDONED = "abandoned"  # a tmp directory older than the save timeout: a crashed save
    COMMITTED = "committed"  # finalized by Orbax and structurally sound, not verified yet
    VERIFIED = "verified"  # committed and its content matches its manifest: a good step
    QUARANTINED = "quarantined"  # found bad; recorded on storage, files kept, never served
    CORRUPT = "corrupt"  # finalized, but its Orbax metadata is missing or unreadable


class MeshSpec(_Model):
    """A named device mesh: ``axis_names[i]`` has ``shape[i]`` devices."""

    axis_names: list[str]
    shape: list[Annotated[int, Field(ge=1)]]

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


PartitionSpecJSON = list[str | list[str] | None]


class ArraySpec(_Model):
    """One array of the saved state, as a resume plan lays it out."""

    shape: list[int] | None = None
    dtype: str | None = None
    partition_spec: PartitionSpecJSON
    changed: bool = False


# A batch size or a count of devices or microbatches: a resize plans from the saved ones in floats (the
# learning-rate scale, the steps of accumulation).
_Size = Annotated[int, Field(ge=1, le=MAX_EXACT_INT)]


class BatchPlan(_Model):
    """How the batch is processed on a mesh: what a resume plan says and every step records.

    ``global_batch`` samples make one optimizer step, processed as ``accumulation_steps`` microbatches of
    ``micro_batch`` samples (``per_device_batch`` per data-parallel device). ``base_global_batch`` is the
    job's own global batch and ``max_per_device_batch`` the per-device batch it ran with on its first mesh;
    both carry over from plan to plan so shrinking and growing never drift.
    """

    # finite only, as in TrainingMetadata, which holds one
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    mode: Literal["keep_global_batch", "scale_batch"]
    base_global_batch: _Size
    global_batch: _Size
    accumulation_steps: _Size
    micro_batch: _Size
    per_device_batch: _Size
    max_per_device_batch: _Size
    data_parallel_size: _Size
    lr_scale: float = 1.0
    exact: bool = True
    note: str = ""


class TrainingMetadata(_Model):
    """What trainer_client records with every step (in Orbax's custom metadata, key ``ckptd``)."""

    # Its numbers are finite: anyone who can write the root can write a step's metadata, and an infinite time
    # (``1e400`` in JSON) would be kept by the catalog as JSON ``null``, which no longer parses: every listing of
    # the job would fail. Such metadata is unreadable instead (the step is corrupt).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    step: int
    data_position: int = Field(description="global sample index the next step reads from")
    global_batch: int
    mesh: MeshSpec
    slices: list[int] = Field(default_factory=list, description="indices of the slices that saved it")
    wall_time: float
    arrays: dict[str, ArraySpec] = Field(default_factory=dict)
    batch: BatchPlan | None = Field(default=None, description="the batch plan in effect when saved")
    # The run's identity (docs/protocol.md, "Identity"); absent from what older trainers wrote, and left out
    # when unset so the bytes (and checksums) of what they wrote stay the same.
    run_id: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="the run that saved the step (the trainer's CKPTD_RUN_ID); stable across the run's restarts",
    )
    process_count: Annotated[int, Field(ge=1)] | None = Field(
        default=None, exclude_if=lambda v: v is None, description="JAX processes that saved the step"
    )


class StepIdentity(_Model):
    """Who saved a step and on what topology: what a manifest records (docs/protocol.md, "Identity"). Parts
    the step does not record are null (a step written by plain Orbax records its job and mesh at most)."""

    job: str | None = None
    run_id: str | None = None
    process_count: int | None = None
    mesh: MeshSpec | None = None


class CheckpointInfo(_Model):
    step: int
    state: StepState
    path: str
    reason: str | None = Field(default=None, description="why a step is not committed")
    committed_at: float | None = None
    training: TrainingMetadata | None = None


__all__ = [
    "ArraySpec",
    "BatchPlan",
    "CheckpointInfo",
    "MeshSpec",
    "PartitionSpecJSON",
    "StepIdentity",
    "StepState",
    "TrainingMetadata",
]
