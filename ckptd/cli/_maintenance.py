"""``ckptd validate`` and ``ckptd gc``: checking and pruning a job's steps on storage, without a server.

``validate`` settles every step the way the server does (adopting, sealing, quarantining), then with
``--deep`` reads every byte back and decodes every array; bad steps (and structurally corrupt ones) are
quarantined on storage unless ``--no-quarantine``. It exits 0 only when every checked step is good.
``gc`` prints what retention would delete and why, and deletes it unless ``--dry-run``; it lists the steps a save
moved aside too, and deletes them only when told to (``ckptd/cli/_gc_aside.py``).

Both settle the job's steps first (adoption writes manifests and records) and then write or delete, so on a root
where sidecars hold the job's leadership lease (docs/multihost.md, section 7) they refuse, naming the holder,
rather than write beside the leader: exit 1, nothing written. ``--force`` overrides (the lease's holder may be
stopped for good and its lease not yet expired, or the clocks disagree by more than the lease time).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from tqdm import tqdm

from ckptd.catalog._integrity import quarantine, validate_and_quarantine
from ckptd.catalog._retention import Decision, RetentionPolicy, checked_decisions, collect
from ckptd.cli._gc_aside import OPTION, STATE, decide_aside, delete_aside
from ckptd.cli._support import (
    EXIT_BAD,
    EXIT_OK,
    TARGET_HELP,
    add_json,
    add_read_only,
    open_job,
    open_storage,
    split_job,
)
from ckptd.lease._lease import held_lease, lease_directory
from trainer_client.core import ArrayIndexError, StoredFormatError, validate_step
from trainer_client.core.format import decode_all_arrays, read_manifest
from trainer_client.core.protocol import StepState, is_valid_job_name

_FINALIZED = (StepState.VERIFIED, StepState.COMMITTED, StepState.QUARANTINED, StepState.CORRUPT)
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """``"7d"`` -> 604800.0; plain numbers are seconds."""
    m = _DURATION.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 45s, 30m, 12h, 7d)")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def _decode_problems(step_path: str) -> list[str]:
    try:
        return decode_all_arrays(step_path)
    except ArrayIndexError as exc:
        return [f"arrays: {exc}"]


def leader_refusal(target: str, command: str) -> str | None:
    """Why ``command`` must not write into ``ROOT/JOB`` now: a sidecar holds the job's lease (in the job, or on
    the side for a read-only job), found by one look at storage (``held_lease``); None when nobody does. A lease
    whose record is invalid (forged or damaged) holds nothing: said in one line on stderr, and ignored."""
    root, job = split_job(target)
    if not is_valid_job_name(job):
        return None
    storage = open_storage(root)
    for read_only in (False, True):
        try:
            held = held_lease(storage, lease_directory(storage, job, read_only=read_only))
        except StoredFormatError as exc:  # forged or damaged: it leads nobody (ckptd/lease/_lease_records.py)
            print(f"ckptd: ignoring the lease of job {job!r}: {exc}", file=sys.stderr)
            continue
        if held is not None:
            return (f"job {job!r} is led by the sidecar {held.holder} (lease epoch {held.epoch}, renewed "
                    f"{held.age_s:.1f}s ago, ttl {held.ttl_s:g}s): `ckptd {command}` writes records and deletes "
                    "steps as if alone; the leader does this work (docs/multihost.md, section 7). Stop the "
                    "sidecars, or pass --force to write beside them")
    return None


def _refused(args: argparse.Namespace, command: str) -> bool:
    why = None if args.force else leader_refusal(args.target, command)
    if why is not None:
        print(f"ckptd: {why}", file=sys.stderr)
    return why is not None


def _cmd_validate(args: argparse.Namespace) -> int:
    if _refused(args, "validate"):
        return EXIT_BAD
    # building the catalog settles every step: adopt, seal, quick-validate
    opened = open_job(args.target, read_only=args.read_only)
    if opened is None:
        return EXIT_BAD
    cat, job = opened
    steps = [c for c in cat.checkpoints(job) if c.state in _FINALIZED and (args.step is None or c.step == args.step)]
    if not steps:
        print(f"ckptd: job {job!r} has no finalized step{'' if args.step is None else f' {args.step}'}",
              file=sys.stderr)
        return EXIT_BAD
    rows: list[dict[str, Any]] = []
    total = 0
    if args.deep:
        for c in steps:
            manifest = read_manifest(cat.storage, c.path) if c.state is StepState.VERIFIED else None
            total += sum(f.size for f in manifest.files.values()) if manifest else 0
    with tqdm(total=total, unit="B", unit_scale=True, desc="deep validation", file=sys.stderr,
              disable=None if args.deep else True) as bar:
        for c in steps:
            row: dict[str, Any] = {"step": c.step, "path": c.path, "level": "deep" if args.deep else "quick"}
            if c.state is StepState.CORRUPT and not args.no_quarantine:
                quarantine(cat.storage, c.path, f"corrupt: {c.reason}", [c.reason or "corrupt"],
                           read_only=args.read_only)
                row.update(ok=False, state=StepState.QUARANTINED.value, problems=[c.reason or "corrupt"])
            elif c.state is not StepState.VERIFIED:
                row.update(ok=False, state=c.state.value, problems=[c.reason or c.state.value])
            elif args.deep:
                if args.no_quarantine:
                    result = validate_step(cat.storage, c.path, "deep", progress=bar.update,
                                           decode_arrays=_decode_problems)
                else:
                    result = validate_and_quarantine(cat.storage, c.path, "deep", read_only=args.read_only,
                                                     progress=bar.update, decode_arrays=_decode_problems)
                state = StepState.VERIFIED if result.ok else StepState.QUARANTINED
                if not result.ok:
                    cat.mark(job, c.step, state, "; ".join(result.problems[:5]))
                row.update(ok=result.ok, state=state.value, problems=result.problems,
                           bytes_read=result.bytes_read)
            else:
                row.update(ok=True, state=c.state.value, problems=[])
            rows.append(row)
    bad = [r for r in rows if not r["ok"]]
    if args.json:
        print(json.dumps({"job": job, "checked": len(rows), "bad": len(bad), "steps": rows}, indent=2))
    else:
        print(f"{'STEP':>10} {'LEVEL':<6} {'STATE':<12} PROBLEMS")
        for r in rows:
            print(f"{r['step']:>10} {r['level']:<6} {r['state']:<12} {'; '.join(r['problems'][:3])}")
        print(f"{len(rows)} checked, {len(bad)} bad", file=sys.stderr)
    return EXIT_OK if not bad else EXIT_BAD


def _cmd_gc(args: argparse.Namespace) -> int:
    if _refused(args, "gc"):
        return EXIT_BAD
    opened = open_job(args.target, read_only=args.read_only)
    if opened is None:
        return EXIT_BAD
    cat, job = opened
    policy = RetentionPolicy(keep_last=args.keep_last, keep_every=args.keep_every,
                             keep_newer_than_s=args.keep_newer_than, clean_abandoned=not args.keep_abandoned)
    decisions = checked_decisions(cat, job, policy)
    refused: list[Decision] = []  # gs://: steps changed since they were decided (docs/gcs.md, Fencing on gs://)
    deleted = collect(cat.storage, decisions, dry_run=args.dry_run, save_timeout_s=cat.save_timeout_s, refused=refused)
    refusals = {r.step: r.reasons[-1] for r in refused}
    asides = decide_aside(cat.storage, cat.storage.join(job), older_than_s=args.delete_aside_older_than,
                          read_only=cat.read_only_for(job))
    asides_deleted = delete_aside(cat.storage, asides, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    if args.json:
        print(json.dumps([{"step": d.step, "path": d.path, "state": d.state.value, "action": d.action,
                           "reasons": d.reasons} for d in decisions] + [a.as_json() for a in asides], indent=2))
    else:
        print(f"policy: {policy.describe()}")
        print(f"{'STEP':>10} {'STATE':<12} {'ACTION':<13} WHY")
        done = {id(d) for d in deleted}
        for d in decisions:
            # a delete collect left alone (gs://: a multi-host save written in place, its claim's cleanup decides)
            action = ("keep" if d.action != "delete" else verb if id(d) in done
                      else "refused" if d.step in refusals else "left")
            why = "; ".join(d.reasons) + {"left": "; a multi-host save's: its cleanup decides",
                                          "refused": f"; {refusals.get(d.step)}"}.get(action, "")
            print(f"{d.step:>10} {d.state.value:<12} {action:<13} {why}")
        for a in asides:  # kept unless told otherwise: the evidence of a bad step or a save cut short
            action = verb if a.action == "delete" else "keep"
            print(f"{a.aside.step:>10} {STATE:<12} {action:<13} {a.aside.name} ({a.was}): {a.reason}")
        print(f"{len(deleted)} step(s) {verb}", file=sys.stderr)
    if asides:
        print(f"{len(asides_deleted)} moved-aside step(s) {verb}, {len(asides) - len(asides_deleted)} kept",
              file=sys.stderr)
    return EXIT_OK


def add_force(parser: Any) -> None:
    parser.add_argument("--force", action="store_true",
                        help="write even while sidecars hold the job's leadership lease (by default: refuse)")


def add_parsers(sub: Any) -> None:
    validate = sub.add_parser(
        "validate", help="check a job's steps against their manifests (exit 0: all good)",
        description="Check a job's committed steps against their manifests (every file present, with its size; "
        "--deep: every checksum and array). A bad step is quarantined on storage, never deleted. Exit 0 when every "
        "step checked is good.")
    validate.add_argument("target", metavar="[ROOT/]JOB", help=TARGET_HELP)
    validate.add_argument("step", nargs="?", type=int, help="only this step")
    validate.add_argument("--deep", action="store_true", help="read every byte back and decode every array")
    validate.add_argument("--no-quarantine", action="store_true",
                          help="report bad steps without recording them as quarantined on storage")
    add_json(validate)
    add_read_only(validate)
    add_force(validate)
    validate.set_defaults(func=_cmd_validate)

    gc = sub.add_parser(
        "gc", help="delete steps that retention does not keep (never the newest good step)",
        description="Delete the good steps that no retention rule keeps, and abandoned saves. Never the newest good "
        "step, a step being written or a bad (quarantined) step. With no rule given every good step is kept. Steps a "
        "save moved aside (<step>.ckptd-aside-<UTC time>: a quarantined step or a save cut short, kept as evidence) "
        f"are listed and never deleted by a rule: only with {OPTION}, once moved longer ago than that, and never in "
        "a read-only job. Exit 0 when it ran.")
    gc.add_argument("target", metavar="[ROOT/]JOB", help=TARGET_HELP)
    gc.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    gc.add_argument("--keep-last", type=int, metavar="N", help="keep the newest N good steps")
    gc.add_argument("--keep-every", type=int, metavar="K", help="keep every step whose number is a multiple of K")
    gc.add_argument("--keep-newer-than", type=parse_duration, metavar="DURATION", help="e.g. 12h, 7d")
    gc.add_argument("--keep-abandoned", action="store_true", help="do not clean abandoned saves")
    gc.add_argument(OPTION, type=parse_duration, metavar="DURATION",
                    help="also delete the steps moved aside longer ago than this (the time in their name), e.g. 30d; "
                    "without it every moved-aside step is kept")
    add_json(gc)
    add_read_only(gc)
    add_force(gc)
    gc.set_defaults(func=_cmd_gc)


__all__ = ["add_parsers", "leader_refusal", "parse_duration"]
