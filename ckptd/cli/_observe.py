"""``ckptd events`` and ``ckptd goodput``: a job's elastic events and goodput, straight from storage.

No server needed: the events are on storage next to the checkpoints (``<root>/<job>/.ckptd/events/``,
``ckptd.events._events``), and goodput is computed from them as ``GET /v1/jobs/{job}/goodput`` does
(``ckptd.advisor._goodput``). ``--json`` prints exactly what the HTTP routes answer. Exit 0 only when there is an
answer: the job has events (``events``) or a goodput could be computed (``goodput``). The ``events`` table
leaves out the kinds that come every few steps (``NOISY_KINDS``: a save's ``checkpoint_started``) unless
``--all`` or ``--kind`` asks for them, and says how many it left out; ``--json`` prints every event.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from datetime import datetime
from typing import Any

from tqdm import tqdm

from ckptd.advisor._goodput import CAUSES
from ckptd.catalog._catalog import Catalog
from ckptd.cli._support import (
    EXIT_BAD,
    EXIT_OK,
    TARGET_HELP,
    add_json,
    add_read_only,
    job_target,
    misplaced,
    open_storage,
    split_job,
    usage_error,
)
from ckptd.events._events import EventStore
from trainer_client.core import Storage
from trainer_client.core.protocol import EventList, Goodput, StoredEvent, is_valid_job_name

NOISY_KINDS = frozenset({"checkpoint_started"})  # one per save: hidden from the table unless asked for
_CAUSE_TEXT = {"checkpoint": "checkpoint stalls", "waiting": "waiting for slices", "restore": "restore",
               "recompile": "recompile", "lost": "lost steps", "startup": "startup", "down": "job down"}


def _open(target: str) -> tuple[Storage, str] | None:
    root, job = split_job(target)
    storage = open_storage(root)
    if not is_valid_job_name(job) or not storage.is_dir(storage.join(job)):
        print(f"ckptd: no job {job!r} under {root}", file=sys.stderr)
        return None
    wrong = misplaced(storage, storage.join(job), job_target(target), "job")
    if wrong is not None:
        usage_error(wrong)
    return storage, job


def _load(store: EventStore, job: str, since: float | None) -> list[StoredEvent]:
    names = store.file_names(job)
    with tqdm(total=len(names), unit="file", desc="reading events", file=sys.stderr, disable=None,
              leave=False) as bar:
        return store.load(job, since=since, progress=bar.update)


def _when(t: float) -> str:
    """An event's time as local date and time; as the number it is past the dates the platform has (a time
    of 1e300 or an infinite one, from anyone who can post events or write the root)."""
    try:
        return datetime.fromtimestamp(t).isoformat(sep=" ", timespec="milliseconds")
    except (OverflowError, ValueError, OSError):
        return f"{t:.6g}"


def render_events(events: list[StoredEvent]) -> str:
    lines = [f"{'TIME':<23} {'KIND':<18} {'STEP':>8} {'RECOVERY':>9} {'LOST':>5} {'MESH':<14} DETAIL"]
    for e in events:
        mesh = (f"{'x'.join(map(str, e.mesh_before or []))}->{'x'.join(map(str, e.mesh_after or []))}"
                if e.mesh_before or e.mesh_after else "")
        recovery = f"{e.recovery_seconds:.2f}s" if e.recovery_seconds is not None else ""
        lines.append(f"{_when(e.time):<23} {e.kind:<18} {'' if e.step is None else e.step:>8} {recovery:>9} "
                     f"{'' if e.lost_steps is None else e.lost_steps:>5} {mesh:<14} {e.detail}")
    return "\n".join(lines)


def render_goodput(g: Goodput) -> str:
    if g.goodput is None:
        return f"job {g.job}: no goodput" + "".join(f"\nnote: {n}" for n in g.notes)
    step = (f"step time {g.step_time_s:.4g} s from {g.step_time_source}" if g.step_time_s is not None
            else "step time unknown")
    lines = [
        f"job {g.job}: goodput {100 * g.goodput:.1f}% over {g.wall_seconds:.1f} s "
        f"({g.runs} run(s), {g.recoveries} recover{'y' if g.recoveries == 1 else 'ies'}, {g.lost_steps} lost "
        f"step(s); {step})",
        f"{'':<20} {'SECONDS':>10} {'SHARE':>7}",
        f"{'productive':<20} {g.productive_seconds:>10.2f} {100 * g.goodput:>6.1f}%",
    ]
    seconds, shares = g.badput_seconds.model_dump(), g.badput.model_dump()
    for cause in CAUSES:
        lines.append(f"{_CAUSE_TEXT[cause]:<20} {seconds[cause]:>10.2f} {100 * shares[cause]:>6.1f}%")
    lines.extend(f"note: {n}" for n in g.notes)
    return "\n".join(lines)


def _cmd_events(args: argparse.Namespace) -> int:
    opened = _open(args.target)
    if opened is None:
        return EXIT_BAD
    storage, job = opened
    events = _load(EventStore(storage, read_only=lambda _: args.read_only), job, args.since)
    if args.kind:
        events = [e for e in events if e.kind in set(args.kind)]
    if args.json:
        print(EventList(job=job, events=events[-args.limit:] if args.limit else events).model_dump_json(indent=2))
        return EXIT_OK if events else EXIT_BAD
    shown = events if args.kind or args.all else [e for e in events if e.kind not in NOISY_KINDS]
    shown = shown[-args.limit:] if args.limit else shown
    print(render_events(shown))
    hidden = Counter(e.kind for e in events if e.kind in NOISY_KINDS and not (args.kind or args.all))
    left_out = "".join(f"; {n} {kind} hidden" for kind, n in sorted(hidden.items()))
    print(f"{len(shown)} event(s){left_out}{' (--all shows them)' if hidden else ''}", file=sys.stderr)
    return EXIT_OK if events else EXIT_BAD


def _cmd_goodput(args: argparse.Namespace) -> int:
    opened = _open(args.target)
    if opened is None:
        return EXIT_BAD
    storage, job = opened
    store = EventStore(storage, read_only=lambda _: args.read_only)
    _load(store, job, args.since)  # reads the event files (a progress bar when there are many)
    # this job only: the step time falls back to its checkpoints
    catalog = Catalog(storage, ":memory:", read_only=args.read_only)
    catalog.refresh_job(job)
    # the job's whole history: its event summary (rotated events) and the events kept
    result = store.goodput(job, catalog.checkpoints(job), step_time_s=args.step_time, since=args.since)
    if store.unreadable:
        result.notes.append(f"{len(store.unreadable)} unreadable event file(s) skipped")
    print(result.model_dump_json(indent=2) if args.json else render_goodput(result))
    return EXIT_OK if result.goodput is not None else EXIT_BAD


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def add_parsers(sub: Any) -> None:
    events = sub.add_parser(
        "events", help="a job's elastic events, read from storage (exit 0: it has some)",
        description="Print a job's elastic events (failures, waits, restores, recoveries, saves) as the trainer "
        "reported them to ckptd, read from storage. Exit 0 when the job has some.")
    events.add_argument("target", metavar="[ROOT/]JOB", help=TARGET_HELP)
    events.add_argument("--since", type=float, metavar="UNIX_TIME", help="only events at or after this time")
    events.add_argument("--kind", action="append", help="only events of this kind (repeatable)")
    events.add_argument("--limit", type=int, default=0, help="only the newest N")
    events.add_argument("--all", action="store_true",
                        help=f"also the kinds the table leaves out by default ({', '.join(sorted(NOISY_KINDS))})")
    add_json(events)
    add_read_only(events)
    events.set_defaults(func=_cmd_events)

    goodput = sub.add_parser(
        "goodput", help="a job's goodput and badput by cause, from its events on storage",
        description="Print the share of a job's time spent on steps that count, and where the rest went (saves, "
        "waits for slices, restores, recompiles, lost steps), from its events on storage. Exit 0 when it has events.")
    goodput.add_argument("target", metavar="[ROOT/]JOB", help=TARGET_HELP)
    goodput.add_argument("--step-time", type=_positive, metavar="SECONDS",
                         help="a normal step's time (default: measured from the events, else the checkpoints)")
    goodput.add_argument("--since", type=float, metavar="UNIX_TIME", help="only the window from this time on")
    add_json(goodput)
    add_read_only(goodput)
    goodput.set_defaults(func=_cmd_goodput)


__all__ = ["NOISY_KINDS", "add_parsers", "render_events", "render_goodput"]
