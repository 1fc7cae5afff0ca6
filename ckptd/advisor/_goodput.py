"""Goodput of a job from its reported events: productive training time over wall time, and where the rest
went, in the spirit of Google's ML goodput metrics (productive time / total time, badput by cause).

Every moment of the job's window (its first reported event to its last) gets one cause:

* ``waiting``: a failure (or a returning slice) detected, until enough slices are healthy;
* ``restore``: slices ready until the state is restored (resume plan + restore onto the new mesh);
* ``recompile``: the first step after a restore, minus one normal step (that step is productive);
* ``startup``: a run's start until its first step when it starts from scratch (initialization, first
  compile, minus one normal step);
* ``checkpoint``: the loop blocked by a save (``blocked_seconds`` of ``checkpoint_started``);
* ``down``: no run of the job alive (between one process's last event and the next one's start);
* otherwise productive. Overlaps (several hosts report the same failure) count once: a moment takes
  the cause of highest priority, in the order above.

Then ``lost``: steps computed after the checkpoint that a recovery restored were done again, so
``lost_steps x step time`` moves from productive to badput. The step time comes from the caller, else
from the events (time between saves of one attempt, minus the save stall), else from the checkpoints'
training metadata (``ckptd.advisor._job_history``). Pure functions; no storage, no jax.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence

from ckptd.advisor._job_history import job_history
from trainer_client.core.protocol import CheckpointInfo, Goodput, GoodputCauses, GoodputSegment, StoredEvent

CAUSES = ("checkpoint", "waiting", "restore", "recompile", "lost", "startup", "down")
# Higher wins where intervals overlap.
_PRIORITY = {"waiting": 5, "restore": 4, "recompile": 3, "startup": 2, "checkpoint": 1}
_MAX_SEGMENTS = 2000
_PHASE_CHANGES = frozenset({"start", "failure_detected", "scale_up_detected", "waiting_for_slices", "slices_ready",
                            "restored", "initialized", "finished", "aborted"})

Interval = tuple[float, float, str]


def _run_key(e: StoredEvent) -> str:
    return e.run or f"{e.host or '?'}:{e.pid if e.pid is not None else '?'}"


class _RunWalker:
    """Turns one run's events into badput intervals (the phase machine of the module docstring)."""

    def __init__(self, step_time: float | None) -> None:
        self.step_time = step_time
        self.intervals: list[Interval] = []
        self.phase: str | None = None  # None: productive; "startup", "waiting", "pending", "compile"; "ended"
        self.since = 0.0
        self.recovering = False
        self.compile_cause = "startup"

    def _close(self, t: float, pending_as: str | None = None) -> None:
        phase, start = self.phase, self.since
        if phase in ("startup", "waiting") and t > start:
            self.intervals.append((start, t, phase))
        elif phase == "pending" and t > start:
            self.intervals.append((start, t, pending_as or ("restore" if self.recovering else "startup")))
        elif phase == "compile" and t > start:
            end = t - self.step_time if self.step_time is not None else t
            if end > start:
                self.intervals.append((start, end, self.compile_cause))
        self.phase, self.since = None, t

    def _open(self, phase: str, t: float) -> None:
        self.phase, self.since = phase, t

    def walk(self, events: Sequence[StoredEvent]) -> None:
        for e in events:
            t, kind = e.time, e.kind
            if kind == "start":
                self._close(t)
                self._open("startup", t)
                self.recovering = False
            elif kind in ("failure_detected", "scale_up_detected"):
                self._close(t)
                self._open("waiting", t)
                self.recovering = True
            elif kind == "waiting_for_slices" and self.phase != "waiting":
                self._close(t)
                self._open("waiting", t)
            elif kind == "slices_ready":
                self._close(t)
                self._open("pending", t)
            elif kind in ("restored", "initialized"):
                cause = "restore" if kind == "restored" else "startup"
                self._close(t, pending_as=cause)
                self._open("compile", t)
                self.compile_cause = "recompile" if kind == "restored" else "startup"
            elif kind == "first_step_done":
                self._close(t)
                self.recovering = False
            elif kind == "checkpoint_started" and e.blocked_seconds:
                self.intervals.append((t - e.blocked_seconds, t, "checkpoint"))
            elif kind in ("finished", "aborted"):
                self._close(t)
                self.phase = "ended"
        if events and self.phase not in (None, "ended"):
            self._close(events[-1].time)


def step_time_from_events(runs: Iterable[Sequence[StoredEvent]]) -> float | None:
    """Median seconds per step between consecutive saves of one attempt (minus the later save's stall);
    the first step done after a restore counts as the start of an interval too."""
    rates: list[float] = []
    for events in runs:
        anchor: StoredEvent | None = None
        for e in events:
            if e.kind in ("checkpoint_started", "first_step_done") and e.step is not None:
                if anchor is not None and e.kind == "checkpoint_started" and anchor.step is not None:
                    steps = e.step - anchor.step
                    seconds = e.time - anchor.time - (e.blocked_seconds or 0.0)
                    if steps > 0 and seconds > 0:
                        rates.append(seconds / steps)
                anchor = e
            elif e.kind in _PHASE_CHANGES:  # the attempt's steady stretch ends
                anchor = None
    return statistics.median(rates) if rates else None


def _sweep(intervals: list[Interval], spans: list[tuple[float, float]], lo: float, hi: float) -> list[Interval]:
    """Elementary stretches of [lo, hi] with their cause (``productive`` when none, ``down`` off-run)."""
    points = {lo, hi}
    for a, b, _ in intervals:
        points.update((min(max(a, lo), hi), min(max(b, lo), hi)))
    for a, b in spans:
        points.update((min(max(a, lo), hi), min(max(b, lo), hi)))
    grid = sorted(points)
    index = {x: i for i, x in enumerate(grid)}
    n = len(grid)
    cover: dict[str, list[int]] = defaultdict(lambda: [0] * (n + 1))
    alive = [0] * (n + 1)
    for a, b, cause in intervals:
        i, j = index[min(max(a, lo), hi)], index[min(max(b, lo), hi)]
        if j > i:
            cover[cause][i] += 1
            cover[cause][j] -= 1
    for a, b in spans:
        i, j = index[min(max(a, lo), hi)], index[min(max(b, lo), hi)]
        if j > i:
            alive[i] += 1
            alive[j] -= 1
    running = {c: 0 for c in cover}
    live = 0
    out: list[Interval] = []
    for k in range(n - 1):
        for c in running:
            running[c] += cover[c][k]
        live += alive[k]
        active = [c for c, v in running.items() if v > 0]
        cause = max(active, key=_PRIORITY.__getitem__) if active else ("productive" if live > 0 else "down")
        if out and out[-1][2] == cause and out[-1][1] == grid[k]:
            out[-1] = (out[-1][0], grid[k + 1], cause)
        else:
            out.append((grid[k], grid[k + 1], cause))
    return out


def compute_goodput(
    job: str,
    events: Sequence[StoredEvent],
    checkpoints: Sequence[CheckpointInfo] = (),
    *,
    step_time_s: float | None = None,
) -> Goodput:
    """The job's goodput over the window of its trainer events (ckptd's own events do not count)."""
    trainer = sorted((e for e in events if e.source == "trainer"), key=lambda e: (e.time, e.received_at))
    notes: list[str] = []
    runs: dict[str, list[StoredEvent]] = defaultdict(list)
    for e in trainer:
        runs[_run_key(e)].append(e)
    step_time, source = step_time_s, "given" if step_time_s is not None else None
    if step_time is None:
        step_time = step_time_from_events(runs.values())
        source = "events" if step_time is not None else None
    if step_time is None:
        measured = job_history(checkpoints).step_time_s
        if measured is not None:
            step_time, source = measured.value, "checkpoints"
    zero = GoodputCauses(**dict.fromkeys(CAUSES, 0.0))
    if not trainer:
        return Goodput(job=job, goodput=None, wall_seconds=0.0, productive_seconds=0.0, badput_seconds=zero,
                       badput=zero, step_time_s=step_time, step_time_source=source,  # type: ignore[arg-type]
                       notes=["no events reported for this job yet: trainer_client reports them to ckptd"])
    intervals: list[Interval] = []
    spans: list[tuple[float, float]] = []
    recoveries: dict[tuple[object, ...], int] = {}
    for evs in runs.values():
        walker = _RunWalker(step_time)
        walker.walk(evs)
        intervals += walker.intervals
        spans.append((evs[0].time, evs[-1].time))
        for e in evs:
            if e.kind == "recovered":  # the same recovery reported by several hosts counts once
                key = (e.step, e.restored_step, e.lost_steps, tuple(e.mesh_after or ()))
                recoveries[key] = e.lost_steps or 0
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    stretches = _sweep(intervals, spans, lo, hi)
    seconds = dict.fromkeys(CAUSES, 0.0)
    productive = 0.0
    for a, b, cause in stretches:
        if cause == "productive":
            productive += b - a
        else:
            seconds[cause] += b - a
    lost_steps = sum(recoveries.values())
    if lost_steps and step_time is not None:
        seconds["lost"] = min(productive, lost_steps * step_time)
        productive -= seconds["lost"]
    elif lost_steps:
        notes.append(f"{lost_steps} lost steps not counted: no step time known (give step_time_s)")
    if step_time is None:
        notes.append("no step time known: recompile and startup include one normal step each")
    wall = hi - lo
    segments = [GoodputSegment(start=a, end=b, cause=c) for a, b, c in stretches  # type: ignore[arg-type]
                if c not in ("productive", "checkpoint")][-_MAX_SEGMENTS:]
    return Goodput(
        job=job,
        goodput=productive / wall if wall > 0 else None,
        wall_seconds=wall,
        productive_seconds=productive,
        badput_seconds=GoodputCauses(**seconds),
        badput=GoodputCauses(**{c: (v / wall if wall > 0 else 0.0) for c, v in seconds.items()}),
        window_start=lo,
        window_end=hi,
        step_time_s=step_time,
        step_time_source=source,  # type: ignore[arg-type]
        runs=len(runs),
        recoveries=len(recoveries),
        lost_steps=lost_steps,
        events=len(trainer),
        segments=segments,
        notes=notes,
    )


__all__ = ["CAUSES", "compute_goodput", "step_time_from_events"]
