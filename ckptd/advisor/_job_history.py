"""What a job's own checkpoints and events say about its costs: the advisor's inputs measured, not assumed.

Every step that trainer_client saves records ckptd training metadata (``TrainingMetadata``): the wall
time at which the save began, the step, the slices that saved it; Orbax records when the step was
committed. From those this module derives the step time (time between saves / steps between them), the
persist time (save start to commit), the slice count and the job's current save period.

The elastic events trainer_client reports (``ckptd.events._events``) give the rest of a recovery, run by
run: the save stall (``checkpoint_started.blocked_seconds``), the restore (``slices_ready`` until
``restored``, the resume plan included; from host memory or from storage, as ``restored`` says) and the
recompile (``restored`` until ``first_step_done``, less one normal step; on the same mesh or a new one, as
the ``recovered`` event after it says), and the hot-spare switch (``failure_detected`` until ``slices_ready`` in
the recoveries whose ``recovered`` event names the spares that took over: what the ``spare`` policy waits
instead of a replacement; its restore and recompile are the ones above). Each is the median of what was seen.
The failure rate is not measured (a job's history is too short to tell it), so it must be given.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from trainer_client.core.protocol import CheckpointInfo, StoredEvent


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
    save_stall_s: Measured | None = None
    restore_time_s: Measured | None = None
    memory_restore_time_s: Measured | None = None
    recovery_time_s: Measured | None = None
    resize_recovery_time_s: Measured | None = None
    spare_switch_time_s: Measured | None = None
    steps_seen: int = 0

    def values(self) -> dict[str, Measured]:
        """The measured inputs by advisor field name."""
        found = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in found.items() if isinstance(v, Measured)}


def _median(values: list[float], what: str) -> Measured | None:
    return Measured(statistics.median(values), f"median of {what} over {len(values)}") if values else None


def _restored_from_memory(e: StoredEvent) -> bool:
    tier = getattr(e, "tier", None)  # newer trainers say it in a field, all of them in the detail
    return str(tier).startswith("memory") if tier else e.detail.startswith("from memory")


def event_measures(events: Sequence[StoredEvent], step_time: float | None = None) -> dict[str, Measured]:
    """Save stall, restore and recompile times from a job's events (see the module docstring). ``step_time``:
    a normal step, taken off the first step after a restore (else that step stays in the figure)."""
    stalls = [e.blocked_seconds for e in events if e.kind == "checkpoint_started" and e.blocked_seconds is not None
              and getattr(e, "tier", None) != "skipped"]
    runs: dict[str, list[StoredEvent]] = defaultdict(list)
    for e in sorted((e for e in events if e.source == "trainer"), key=lambda e: (e.time, e.received_at)):
        runs[e.run or f"{e.host}:{e.pid}"].append(e)
    restores: dict[bool, list[float]] = {True: [], False: []}  # from memory?
    recompiles: dict[bool, list[float]] = {True: [], False: []}  # same mesh?
    switches: list[float] = []  # failure detected -> slices ready, where a hot spare took over
    for run in runs.values():
        ready: float | None = None
        restored: float | None = None
        first: float | None = None
        failed: float | None = None
        switch: float | None = None
        for e in run:
            if e.kind == "slices_ready":
                ready = e.time
                if failed is not None and switch is None:
                    switch = e.time - failed
            elif e.kind == "restored":
                if ready is not None:
                    restores[_restored_from_memory(e)].append(e.time - ready)
                ready, restored = None, e.time
            elif e.kind == "first_step_done":
                first = None if restored is None else max(0.0, e.time - restored - (step_time or 0.0))
                restored = None
            elif e.kind == "recovered":
                if first is not None and e.mesh_before and e.mesh_after:
                    recompiles[e.mesh_before == e.mesh_after].append(first)
                if switch is not None and e.spares_used:
                    switches.append(switch)
                first = failed = switch = None
            elif e.kind in ("start", "failure_detected", "scale_up_detected", "finished", "aborted"):
                ready = restored = first = None
                failed = e.time if e.kind == "failure_detected" else None
                switch = None
    step = "less one step" if step_time else "one step included"
    found = {
        "save_stall_s": _median(stalls, "the loop's blocked time per save (checkpoint_started events)"),
        "restore_time_s": _median(restores[False], "slices ready -> restored from storage (plan included)"),
        "memory_restore_time_s": _median(restores[True], "slices ready -> restored from host memory"),
        "recovery_time_s": _median(recompiles[True], f"restored -> first step on the same mesh ({step})"),
        "resize_recovery_time_s": _median(recompiles[False], f"restored -> first step on a new mesh ({step})"),
        "spare_switch_time_s": _median(switches, "failure detected -> slices ready where a hot spare took over"),
    }
    return {k: v for k, v in found.items() if v is not None}


def job_history(checkpoints: Sequence[CheckpointInfo], events: Sequence[StoredEvent] = ()) -> JobHistory:
    """Derive costs from the steps that carry ckptd training metadata (any finalized state).

    Step time: the median over consecutive saves of (wall time difference) / (step difference); it
    includes the save stalls, as the job ran. A save that went backwards in steps (a restore came
    between) or in time is skipped. Persist time: the median of commit time - save start. ``events``: the
    job's elastic events, for the save stall, restore and recompile times (``event_measures``).
    """
    saved = sorted(
        ((c.step, c.training.wall_time, c.committed_at) for c in checkpoints if c.training is not None),
        key=lambda x: x[1],
    )
    history, step_time = (_steps_history(checkpoints, saved) if saved else (JobHistory(), None))
    measures: dict[str, Any] = event_measures(events, step_time)  # by field name (Any: mypy sees steps_seen)
    return replace(history, **measures)


def _steps_history(checkpoints: Sequence[CheckpointInfo],
                   saved: list[tuple[int, float, float | None]]) -> tuple[JobHistory, float | None]:
    rates: list[float] = []
    gaps: list[int] = []
    for (s0, t0, _), (s1, t1, _) in itertools.pairwise(saved):
        if s1 > s0 and t1 > t0:
            rates.append((t1 - t0) / (s1 - s0))
            gaps.append(s1 - s0)
    persists = [c - t for _, t, c in saved if c is not None and c >= t]
    newest = max((c for c in checkpoints if c.training is not None), key=lambda c: c.step)
    slices = len(newest.training.slices) if newest.training and newest.training.slices else 0
    step_time = statistics.median(rates) if rates else None
    return JobHistory(
        step_time_s=Measured(step_time, f"median over {len(rates)} intervals between saves "
                             "(includes the save stalls)") if step_time is not None else None,
        persist_time_s=Measured(statistics.median(persists), f"median of commit time - save start over "
                                f"{len(persists)} steps") if persists else None,
        slices=Measured(float(slices), f"slices that saved step {newest.step}") if slices else None,
        checkpoint_period_steps=Measured(float(statistics.median(gaps)), f"median step gap over {len(gaps)} saves")
        if gaps else None,
        steps_seen=len(saved),
    ), step_time

__all__ = ["JobHistory", "Measured", "event_measures", "job_history"]
