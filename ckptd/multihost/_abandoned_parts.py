"""Retention's part for multi-host saves: the saves of a job claimed long ago and never committed (a host's part
never came), and the staged saves whose claim a restarted incarnation took over, deleted (docs/multihost.md,
section 5).

Beside the multi-host commit, not in the catalog's retention: it acts through ``PartSaves`` (the claims, the fate
records, the job's lock), which stands above the catalog. The composition root hands it to the catalog's
retention (``prune``'s ``clean_parts``, ``ckptd/catalog/_retention.py``), which runs it for each job this sidecar
leads after the job's steps' deletions; its answers are retention's ``Decision`` records, so they are recorded as
the job's events with the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ckptd.catalog._retention import Decision
from ckptd.multihost._part_commit import JOB_BUDGET_S, PartSaves
from ckptd.persist._worker_client import InProcessWorker
from trainer_client.core import Storage, storage_errors
from trainer_client.core.format import spans, step_path_for
from trainer_client.core.protocol import StepState


def clean_abandoned_parts(storage: Storage, job: str, older_than_s: float, *, budget_s: float = JOB_BUDGET_S,
                          writes: Callable[[str], bool] = lambda _job: True) -> list[Decision]:
    """Delete the multi-host saves of ``job`` claimed longer than ``older_than_s`` ago and never committed
    (a host's part never came): their staged or in-place files, then the claim; and the staged saves whose
    claim a restarted incarnation took over (``PartSaves.superseded``). Looking for them stops after
    ``budget_s`` (the rest waits for the next run): a job's forged claims hold up no other job's retention.
    ``writes(job)``: whether this sidecar still leads, asked again under the job's lock before each deletion."""
    saves = PartSaves(storage, InProcessWorker(lambda _request: {"ok": False, "error": "retention writes no parts"}),
                      writes=writes, redo_after_s=older_than_s)
    out = []
    deadline = time.monotonic() + budget_s
    for found in saves.abandoned(job, older_than_s, spent=lambda: time.monotonic() > deadline):
        with storage_errors(f"cannot delete the abandoned save {found.save_id} of step {found.step}"):
            if not saves.clean(found):
                continue
        out.append(Decision(found.step, step_path_for(storage, job, found.step, found.save_id), StepState.ABANDONED,
                            "delete", [f"multi-host save {found.save_id} abandoned: parts {spans(found.missing)} "
                                       "missing after the save timeout"]))
    for step, save_id in saves.superseded(job, spent=lambda: time.monotonic() > deadline):
        with storage_errors(f"cannot delete the superseded save {save_id} of step {step}"):
            if saves.clean_superseded(job, step, save_id):
                out.append(Decision(step, step_path_for(storage, job, step, save_id), StepState.ABANDONED, "delete",
                                    [f"multi-host save {save_id} superseded: its step's claim is another save's"]))
    return out


__all__ = ["clean_abandoned_parts"]
