"""The one planner of a step on storage: what ``ckptd plan``, the server's ``POST /resume`` and the client's
storage fallback all call, so that they give the same plan, byte for byte, for the same step and devices.

Once they each assembled the planner's inputs themselves, and differed: the CLI took the catalog's summary
of ckptd's training metadata (which has no arrays) and fell back to Orbax's ``_sharding``, so a step whose
``_sharding`` records another mesh than the trainer's (ckptd's persist worker used to write one) was
planned replicated by the CLI and sharded by the server. Now each hands the step to ``plan_for_step``,
which reads it with the one reader (``read_step_layout``) unless given that reader's result (the server
keeps the layouts of the steps it planned recently). Only ``source`` differs: where the plan was made.
No jax here.
"""

from __future__ import annotations

from typing import Literal

from trainer_client.core._resume_decision import resume_plan
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import DEFAULT_ITEM
from trainer_client.core.format._saved_layout import StepLayout, read_step_layout
from trainer_client.core.protocol import ResumePlan, ResumeRequest


def plan_for_step(
    storage: Storage,
    step_path: str,
    request: ResumeRequest,
    *,
    job: str,
    step: int,
    source: Literal["ckptd", "storage_scan"] = "ckptd",
    layout: StepLayout | None = None,
) -> ResumePlan:
    """The resume plan of the committed step at ``step_path`` (a path or URL of ``storage``) for
    ``request``. ``layout``: ``read_step_layout(storage, step_path)`` as read before, if kept.
    Raises ``PlanningError`` when the step cannot be laid out on the devices asked for."""
    if layout is None:
        layout = read_step_layout(storage, step_path)
    items = None if set(layout.items) <= {DEFAULT_ITEM} else layout.items  # absent for what older ckptd planned
    return resume_plan(
        job=job, step=step, path=storage.url_of(step_path), request=request, training=layout.training,
        saved_layout=(layout.mesh, layout.arrays), source=source, items=items,
    )


__all__ = ["StepLayout", "plan_for_step", "read_step_layout"]
