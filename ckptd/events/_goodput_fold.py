"""Goodput over a job's whole history when its oldest events are rotated away: fold, then add up.

``ckptd.advisor._goodput.compute_goodput`` needs a job's events in one list. ckptd keeps a bounded window of
them (``ckptd.events._events``); the older ones are folded into the job's summary
(``ckptd.events._event_summary``), which keeps the goodput of the folded stretch as a ``FoldedGoodput``.
Goodput over the whole history is that stretch, the gap after it and the window's goodput, added up
(``combine``). The sum equals one computation over every event when the fold was cut at a moment where
no interval of badput crosses the cut:

* the cut is at or before every event still kept (and before the save stall of each kept save);
* no run is in the middle of an outage or a startup at the cut (``choose_cut`` moves the cut back to the
  moment such a run left productive training, and the events from there on stay in the window), except
  a run gone quiet (no event for ``stale_s``), which is folded as it stands, as the whole computation
  would close it at its last event;
* a run alive on both sides of the cut makes the time between its last folded event and its first
  kept one productive where either part alone saw no run alive (``down``).

What is not exact: each part measures its own step time (the same when steps take the same time), a
recovery reported by two hosts on both sides of a cut counts twice, and a cut forced by the carry bound
(``fold``'s ``carry_cap``) may split an outage; the summary's notes say when that happened.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from ckptd.advisor._goodput import CAUSES
from trainer_client.core.protocol import Goodput, GoodputCauses, GoodputSegment, StoredEvent

MAX_SEGMENTS = 2000  # the answer's (ckptd/advisor/_goodput.py)
_KEPT_SEGMENTS = 500  # kept in a summary: enough to correct the stretch before a cut
_KEPT_RUNS = 256
_KEPT_NOTES = 10
# What leaves productive training, what returns to it, what ends a run (ckptd/advisor/_goodput.py's walker).
_OPENS = frozenset({"start", "failure_detected", "scale_up_detected", "waiting_for_slices", "slices_ready",
                    "restored", "initialized"})
_RETURNS = frozenset({"first_step_done"})
_ENDS = frozenset({"finished", "aborted"})

Segment = tuple[float, float, str]


def run_key(e: StoredEvent) -> str:
    """The run an event belongs to, as ``compute_goodput`` groups them."""
    return e.run or f"{e.host or '?'}:{e.pid if e.pid is not None else '?'}"


class FoldedGoodput(BaseModel):
    """The goodput of a stretch of a job's history, in a form that adds up with the next stretch's."""

    model_config = ConfigDict(extra="ignore")

    wall_seconds: float = 0.0
    productive_seconds: float = 0.0
    badput_seconds: dict[str, float] = Field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    window_start: float | None = None
    window_end: float | None = None
    runs: int = 0
    recoveries: int = 0
    lost_steps: int = 0
    events: int = 0
    step_time_s: float | None = None
    segments: list[Segment] = Field(default_factory=list, description="non-productive stretches, newest kept")
    open_runs: dict[str, float] = Field(default_factory=dict, description="runs not ended: their last event time")
    notes: list[str] = Field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.window_start is None or self.window_end is None


def _ends(events: Iterable[StoredEvent]) -> tuple[dict[str, float], dict[str, float], set[str]]:
    """Per run: its first and last event times, and the runs whose last phase event ended them."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    ended: set[str] = set()
    for e in events:
        key = run_key(e)
        first.setdefault(key, e.time)
        last[key] = e.time
        if e.kind in _ENDS:
            ended.add(key)
        elif e.kind in _OPENS or e.kind in _RETURNS:
            ended.discard(key)
    return first, last, ended


def first_times(events: Iterable[StoredEvent]) -> dict[str, float]:
    """The first event time of each run among ``events`` (time-sorted)."""
    return _ends(events)[0]


def folded(result: Goodput, events: Sequence[StoredEvent]) -> FoldedGoodput:
    """``compute_goodput``'s answer over ``events`` (its trainer events, time-sorted), ready to add up."""
    if result.goodput is None and result.wall_seconds == 0.0 and result.window_start is None:
        return FoldedGoodput(step_time_s=result.step_time_s)
    _, last, ended = _ends(events)
    return FoldedGoodput(
        wall_seconds=result.wall_seconds, productive_seconds=result.productive_seconds,
        badput_seconds=result.badput_seconds.model_dump(), window_start=result.window_start,
        window_end=result.window_end, runs=result.runs, recoveries=result.recoveries, lost_steps=result.lost_steps,
        events=result.events, step_time_s=result.step_time_s,
        segments=[(s.start, s.end, s.cause) for s in result.segments],
        open_runs={k: t for k, t in last.items() if k not in ended}, notes=list(result.notes),
    )


def open_since(events: Iterable[StoredEvent]) -> float | None:
    """When the run (its events, time-sorted) last left productive training, if it has not returned."""
    since: float | None = None
    for e in events:
        if e.kind in _OPENS:
            since = e.time if since is None else since
        elif e.kind in _RETURNS or e.kind in _ENDS:
            since = None
    return since


def choose_cut(candidates: Sequence[StoredEvent], kept: Sequence[StoredEvent], *, stale_s: float) -> float:
    """The time before which ``candidates`` (trainer events of the files being folded, time-sorted) can be
    folded, given the trainer events ``kept`` in the window (see the module docstring); ``inf``: all."""
    cut = min((e.time - (e.blocked_seconds or 0.0) for e in kept), default=float("inf"))
    kept_runs = {run_key(e) for e in kept}
    newest = max((e.time for e in (*candidates, *kept)), default=0.0)
    by_run: dict[str, list[StoredEvent]] = defaultdict(list)
    for e in candidates:
        by_run[run_key(e)].append(e)
    moved = True
    while moved:
        moved = False
        for key, evs in by_run.items():
            before = [e for e in evs if e.time < cut]
            opened = open_since(before)
            if opened is None or opened >= cut:
                continue
            if key not in kept_runs and before[-1].time < newest - stale_s:
                continue  # gone quiet: the whole computation closes it at its last event too
            cut, moved = opened, True
    return cut


def _overlap(segments: Iterable[Segment], spans: Sequence[tuple[float, float]]) -> float:
    """Seconds of the ``down`` segments inside the union of ``spans``."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        elif b > a:
            merged.append((a, b))
    total = 0.0
    for a, b, cause in segments:
        if cause == "down":
            total += sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged)
    return total


def _relabel(segments: Iterable[Segment], spans: Sequence[tuple[float, float]]) -> list[Segment]:
    """``segments`` with their ``down`` parts inside ``spans`` removed (those runs were alive: productive)."""
    out: list[Segment] = []
    for a, b, cause in segments:
        out += [(lo, hi, cause) for lo, hi in (_pieces(a, b, spans) if cause == "down" else [(a, b)])]
    return out


def lead_stalls(events: Iterable[StoredEvent], start: float) -> list[tuple[float, float]]:
    """The save stalls of ``events`` that began before ``start`` (their part before it): a computation over
    ``events`` alone, whose window begins at its first event, leaves them out."""
    return [(e.time - e.blocked_seconds, min(e.time, start)) for e in events
            if e.blocked_seconds and e.time - e.blocked_seconds < start]


def _pieces(lo: float, hi: float, cuts: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """[lo, hi] without ``cuts``."""
    pieces = [(lo, hi)]
    for x, y in cuts:
        pieces = [p for a, b in pieces for p in ((a, min(b, x)), (max(a, y), b)) if p[1] > p[0]]
    return pieces


def combine(a: FoldedGoodput, b: FoldedGoodput, b_first: dict[str, float],
            lead: Sequence[tuple[float, float]] = ()) -> FoldedGoodput:
    """Stretch ``a`` followed by stretch ``b`` (``b_first``: the first event time of each run in ``b``;
    ``lead``: ``b``'s save stalls that began before its window, from ``lead_stalls``)."""
    if a.empty:
        return b
    if b.empty:
        return a
    assert a.window_start is not None and a.window_end is not None
    assert b.window_start is not None and b.window_end is not None
    continuing = {k: t for k, t in a.open_runs.items() if k in b_first}
    gap_end = max(a.window_end, b.window_start)
    stalls = [(max(x, a.window_end), min(y, gap_end)) for x, y in lead if min(y, gap_end) > max(x, a.window_end)]
    idle = _pieces(a.window_end, gap_end, stalls)
    stalled = (gap_end - a.window_end) - sum(y - x for x, y in idle)
    gap: list[Segment] = [(x, y, "down") for x, y in idle]
    spans = [(t, b_first[k]) for k, t in continuing.items()]
    segments = [*a.segments, *sorted([*gap, *((x, y, "checkpoint") for x, y in _pieces(a.window_end, gap_end, idle))]),
                *b.segments]
    revived = _overlap(segments, spans)
    seconds = {c: a.badput_seconds.get(c, 0.0) + b.badput_seconds.get(c, 0.0) for c in CAUSES}
    seconds["down"] += sum(y - x for x, y in idle) - revived
    seconds["checkpoint"] += stalled
    open_runs = {k: t for k, t in a.open_runs.items() if k not in b_first}
    open_runs.update(b.open_runs)
    newest_runs = sorted(open_runs.items(), key=lambda kv: kv[1])[-_KEPT_RUNS:]
    merged: list[Segment] = []
    for s in _relabel(segments, spans):
        if merged and merged[-1][2] == s[2] and merged[-1][1] == s[0]:
            merged[-1] = (merged[-1][0], s[1], s[2])
        else:
            merged.append(s)
    return FoldedGoodput(
        wall_seconds=b.window_end - a.window_start,
        productive_seconds=a.productive_seconds + b.productive_seconds + revived,
        badput_seconds=seconds, window_start=a.window_start, window_end=b.window_end,
        runs=a.runs + b.runs - len(continuing), recoveries=a.recoveries + b.recoveries,
        lost_steps=a.lost_steps + b.lost_steps, events=a.events + b.events,
        step_time_s=b.step_time_s if b.step_time_s is not None else a.step_time_s,
        segments=merged[-MAX_SEGMENTS:], open_runs=dict(newest_runs),
        notes=list(dict.fromkeys([*a.notes, *b.notes]))[-_KEPT_NOTES:],
    )


def kept_for_summary(g: FoldedGoodput) -> FoldedGoodput:
    """``g`` trimmed to what a summary keeps (the newest segments and notes)."""
    return g.model_copy(update={"segments": g.segments[-_KEPT_SEGMENTS:], "notes": g.notes[-_KEPT_NOTES:]})


def as_goodput(job: str, g: FoldedGoodput, window: Goodput) -> Goodput:
    """The answer for ``g`` (the whole history), taking the step time and its source from ``window``."""
    wall = g.wall_seconds
    seconds = {c: g.badput_seconds.get(c, 0.0) for c in CAUSES}
    return Goodput(
        job=job, goodput=g.productive_seconds / wall if wall > 0 else None, wall_seconds=wall,
        productive_seconds=g.productive_seconds, badput_seconds=GoodputCauses(**seconds),
        badput=GoodputCauses(**{c: (v / wall if wall > 0 else 0.0) for c, v in seconds.items()}),
        window_start=g.window_start, window_end=g.window_end,
        step_time_s=window.step_time_s if window.step_time_s is not None else g.step_time_s,
        step_time_source=window.step_time_source if window.step_time_s is not None else
        ("events" if g.step_time_s is not None else None),
        runs=g.runs, recoveries=g.recoveries, lost_steps=g.lost_steps, events=g.events,
        segments=[GoodputSegment(start=a, end=b, cause=c)  # type: ignore[arg-type]
                  for a, b, c in g.segments if c not in ("productive", "checkpoint")][-MAX_SEGMENTS:],
        notes=list(dict.fromkeys([*window.notes, *g.notes])),
    )


__all__ = ["MAX_SEGMENTS", "FoldedGoodput", "as_goodput", "choose_cut", "combine", "first_times", "folded",
           "kept_for_summary", "lead_stalls", "open_since", "run_key"]
