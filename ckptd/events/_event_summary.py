"""What a job's events add up to, kept after the events themselves are rotated away.

ckptd keeps a bounded window of each job's events (``ckptd.events._events``: at most
``events_max_per_job`` events and ``events_max_bytes_per_job`` bytes). Older batches are *folded* into
one small object per job, ``<root>/<job>/.ckptd/events/summary.json`` (an ``EventSummary``), then deleted.
The summary holds:

* ``stats``: counts by kind and running totals of what the events measure — recovery seconds, lost
  steps, save stalls (count, sum, min, max and the most recent values) — over every folded event;
* ``goodput``: the goodput of the folded stretch of time (``ckptd.events._goodput_fold``), so that goodput
  over the job's whole history survives rotation;
* ``carry``: folded events that could not be folded yet (a run in the middle of an outage at the cut);
  they stay part of the window;
* ``through``: the newest event file folded (file names sort by the time ckptd received them): files at
  or before it are in the summary and may be deleted by any sidecar.

Whole-history figures are the summary plus the window: ``EventStats.merged`` (``ckptd/_event_stats.py``) and
``goodput_fold.combine``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from ckptd._event_stats import EventStats
from ckptd.advisor._goodput import compute_goodput
from ckptd.events._goodput_fold import (
    FoldedGoodput,
    as_goodput,
    choose_cut,
    combine,
    first_times,
    folded,
    kept_for_summary,
    lead_stalls,
)
from trainer_client.core.format import EVENTS_SUMMARY_FILE as SUMMARY_FILE
from trainer_client.core.protocol import CheckpointInfo, Goodput, StoredEvent

SUMMARY_FORMAT = "ckptd-events-summary/1"


class EventSummary(BaseModel):
    """``<job>/.ckptd/events/summary.json``: the job's folded events (see the module docstring)."""

    model_config = ConfigDict(extra="ignore")

    format: str = SUMMARY_FORMAT
    job: str
    through: str = Field(default="", description="newest event file folded (files sort by receive time)")
    cut: float | None = Field(default=None, description="trainer events before this time are folded")
    files: int = Field(default=0, description="event files folded and deleted")
    bytes: int = Field(default=0, description="bytes of those files")
    late: int = Field(default=0, description="events that arrived after their time was folded: counted, not timed")
    stats: EventStats = Field(default_factory=EventStats)
    goodput: FoldedGoodput | None = None
    carry: list[StoredEvent] = Field(default_factory=list, description="folded files' events still in the window")
    updated_at: float = 0.0


def unique_events(events: Iterable[StoredEvent]) -> list[StoredEvent]:
    """``events`` without repeated ids (the first kept), sorted as goodput reads them."""
    seen: set[str] = set()
    out = []
    for e in events:
        if e.id is not None:
            if e.id in seen:
                continue
            seen.add(e.id)
        out.append(e)
    return sorted(out, key=lambda e: (e.time, e.received_at))


def fold(
    summary: EventSummary,
    files: Sequence[tuple[str, int, Sequence[StoredEvent]]],
    kept: Sequence[StoredEvent],
    *,
    carry_cap: int,
    stale_s: float,
    now: float,
) -> EventSummary:
    """``summary`` with ``files`` (name, size, events; oldest first) folded in; ``kept``: the events of the
    files that stay. Events that cannot be folded yet (``goodput_fold.choose_cut``) become the carry."""
    floor = summary.cut
    candidates = unique_events([*summary.carry, *(e for _, _, evs in files for e in evs)])
    trainer = [e for e in candidates if e.source == "trainer"]
    late = [e for e in trainer if floor is not None and e.time < floor]
    trainer = [e for e in trainer if floor is None or e.time >= floor]
    kept_trainer = [e for e in kept if e.source == "trainer" and (floor is None or e.time >= floor)]
    cut = choose_cut(trainer, kept_trainer, stale_s=stale_s)
    folding = [e for e in trainer if e.time < cut]
    carry = [e for e in trainer if e.time >= cut]
    notes: list[str] = []
    if len(carry) > carry_cap:  # a run stuck in an outage for a flood of events: fold it as it stands
        split = len(carry) - carry_cap
        folding, carry = folding + carry[:split], carry[split:]
        cut = carry[0].time if carry else cut
        notes.append("a rotation of the events was cut during an outage: goodput around it is approximate")
    if cut == float("inf"):
        cut = max((e.time for e in folding), default=floor if floor is not None else 0.0)
    goodput = summary.goodput or FoldedGoodput()
    if folding:
        part = folded(compute_goodput(summary.job, folding), folding)
        part.notes += notes
        lead = lead_stalls(folding, part.window_start or 0.0)
        goodput = kept_for_summary(combine(goodput, part, first_times(folding), lead))
    stats = EventStats().add([*folding, *late, *(e for e in candidates if e.source != "trainer")])
    return summary.model_copy(update={
        "through": files[-1][0] if files else summary.through, "cut": cut, "files": summary.files + len(files),
        "bytes": summary.bytes + sum(size for _, size, _ in files), "late": summary.late + len(late),
        "stats": summary.stats.merged(stats), "goodput": goodput if not goodput.empty else None,
        "carry": carry, "updated_at": now,
    })


def history_goodput(
    job: str,
    summary: EventSummary | None,
    window: Sequence[StoredEvent],
    checkpoints: Sequence[CheckpointInfo] = (),
    *,
    step_time_s: float | None = None,
    since: float | None = None,
) -> Goodput:
    """Goodput over the job's whole history: its summary's folded goodput, then the ``window`` of events
    kept (or, with ``since`` after the folded stretch began, over the kept events from ``since`` on)."""
    history = summary.goodput if summary is not None else None
    if summary is None or history is None or history.empty:
        chosen = window if since is None else [e for e in window if e.time >= since]
        return compute_goodput(job, chosen, checkpoints, step_time_s=step_time_s)
    assert history.window_start is not None
    cut = summary.cut if summary.cut is not None else history.window_end or 0.0
    if since is not None and since > history.window_start:
        result = compute_goodput(job, [e for e in window if e.time >= since], checkpoints, step_time_s=step_time_s)
        if since < cut:
            result.notes.append(f"the events before {cut:.3f} are folded into the job's event summary (rotation): "
                                "this window starts at the first event kept")
        return result
    later = [e for e in window if not (e.source == "trainer" and e.time < cut)]
    recent = compute_goodput(job, later, checkpoints, step_time_s=step_time_s)
    trainer = sorted((e for e in later if e.source == "trainer"), key=lambda e: (e.time, e.received_at))
    part = folded(recent, trainer)
    if part.empty:
        recent = recent.model_copy(update={"notes": []})
    lead = lead_stalls(trainer, part.window_start or 0.0)
    answer = as_goodput(job, combine(history, part, first_times(trainer), lead), recent)
    answer.notes.append(f"{summary.stats.events} older event(s) of {summary.files} rotated file(s) are counted from "
                        "the job's event summary")
    late = len(window) - len(later) + summary.late
    if late:
        answer.notes.append(f"{late} event(s) reported after their time was folded are counted but not timed")
    if step_time_s is not None and history.step_time_s != step_time_s:
        answer.notes.append("the folded history keeps the step time measured when it was folded")
    return answer


__all__ = ["SUMMARY_FILE", "SUMMARY_FORMAT", "EventSummary", "fold", "history_goodput", "unique_events"]
