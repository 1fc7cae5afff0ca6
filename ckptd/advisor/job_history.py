"""What a job's own checkpoints say about its costs: the advisor's inputs measured, not assumed.

Every step that trainer_client saves records ckptd training metadata (``TrainingMetadata``): the wall
time at which the save began, the step, the slices that saved it; Orbax records when the step was
committed. From those alone this module derives the step time (time between saves / steps between
them), the persist time (save start to commit), the slice count and the job's current save period.
Failures, restore and recompile times are not recorded yet, so they must be given.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from trainer_client.core.protocol import CheckpointInfo


@dataclass(frozen=True)
class Measured:
    """One value measured from the history, with how it was measured."""

    value: float
    note: str


@dataclass(frozen=True)
class JobHistory:
    """The advisor inputs a job's history gives (absent when the history cannot tell)."""

    step_time_s: Measured | None = None
    persist_time_s: Measured | None = None
    slices: Measured | None = None
    checkpoint_period_steps: Measured | None = None
    steps_seen: int = 0

    def values(self) -> dict[str, Measured]:
        """The measured inputs by advisor field name."""
        found = {
            "step_time_s": self.step_time_s,
            "persist_time_s": self.persist_time_s,
            "slices": self.slices,
            "checkpoint_period_steps": self.checkpoint_period_steps,
        }
        return {k: v for k, v in found.items() if v is not None}


def job_history(checkpoints: Sequence[CheckpointInfo]) -> JobHistory:
    """Derive costs from the steps that carry ckptd training metadata (any finalized state).

    Step time: the median over consecutive saves of (wall time difference) / (step difference); it
    includes the save stalls, as the job ran. A save that went backwards in steps (a restore came
    between) or in time is skipped. Persist time: the median of commit time - save start.
    """
    saved = sorted(
        ((c.step, c.training.wall_time, c.committed_at) for c in checkpoints if c.training is not None),
        key=lambda x: x[1],
    )
    if not saved:
        return JobHistory()
    rates: list[float] = []
    gaps: list[int] = []
    for (s0, t0, _), (s1, t1, _) in itertools.pairwise(saved):
        if s1 > s0 and t1 > t0:
            rates.append((t1 - t0) / (s1 - s0))
            gaps.append(s1 - s0)
    persists = [c - t for _, t, c in saved if c is not None and c >= t]
    newest = max((c for c in checkpoints if c.training is not None), key=lambda c: c.step)
    slices = len(newest.training.slices) if newest.training and newest.training.slices else 0
    n = len(saved)
    return JobHistory(
        step_time_s=Measured(statistics.median(rates), f"median over {len(rates)} intervals between saves "
                             "(includes the save stalls)") if rates else None,
        persist_time_s=Measured(statistics.median(persists), f"median of commit time - save start over "
                                f"{len(persists)} steps") if persists else None,
        slices=Measured(float(slices), f"slices that saved step {newest.step}") if slices else None,
        checkpoint_period_steps=Measured(float(statistics.median(gaps)), f"median step gap over {len(gaps)} saves")
        if gaps else None,
        steps_seen=n,
    )


__all__ = ["JobHistory", "Measured", "job_history"]
