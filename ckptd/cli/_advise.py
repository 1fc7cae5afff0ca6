"""``ckptd advise [[ROOT/]JOB]``: the goodput advisor on the command line.

Its options are built from ``trainer_client.core.protocol.AdviceQuery``, the same model as the query of
``GET /v1/jobs/{job}/advice``, so the command and the API take the same inputs under the same names
(``step_time_s`` is ``--step-time``, in seconds). Inputs not given come from the job's history when a job
is named: its steps (step time, persist time, slices, period) and its elastic events on storage (save stall,
restore and recompile times; ``ckptd.advisor._job_history``); a flag overrides what the history says. What a job's
history cannot tell (a run that never restored from storage or failed long enough to time a replacement; the failure
rate) is assumed, labelled so in the answer and listed on stderr (``ckptd.advisor._advisor.assumed_inputs``): the
demo's own job gets an answer. Exit 0 with an answer, 1 when an input is still missing or the job has none, 2 for
bad values.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pydantic import ValidationError

from ckptd.advisor._advice_text import render
from ckptd.advisor._advisor import ASSUMABLE, advise
from ckptd.advisor._job_history import JobHistory, job_history
from ckptd.cli._support import add_read_only, open_job
from ckptd.errors import MissingInputs
from ckptd.events._events import EventStore
from trainer_client.core.protocol import AdviceQuery

EXIT_OK, EXIT_BAD, EXIT_USAGE = 0, 1, 2
DESCRIPTION = (
    "Checkpoint periods and a recovery policy (pause, resize or a hot spare) from a goodput simulation. With a job, "
    "its steps and elastic events on storage give the measured inputs (step time, persist time, save stall, restore "
    "and recompile times); what they cannot tell (the failure rate, a replacement's wait, ...) is assumed and marked "
    "so in the answer. Every flag overrides what the history says. Exit 0 with an answer, 1 when an input is "
    "missing, 2 for a bad value."
)
_TYPES: dict[str, Any] = {"number": float, "integer": int}


def flag(name: str) -> str:
    """``step_time_s`` -> ``--step-time``; ``mtbf_hours`` -> ``--mtbf-hours``."""
    return "--" + name.removesuffix("_s").replace("_", "-")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``advise`` to the subcommands of ``ckptd``."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "advise", help="checkpoint periods and recovery policy from measured costs (a goodput simulation)",
        description=DESCRIPTION)
    parser.add_argument("target", metavar="[ROOT/]JOB", nargs="?",
                        help="the job whose history gives the inputs not set below (JOB alone: under CKPTD_ROOT)")
    schema = AdviceQuery.model_json_schema()["properties"]
    for name, prop in schema.items():
        kinds = [x.get("type") for x in prop.get("anyOf", [prop])]
        unit = " (seconds)" if name.endswith("_s") else ""
        help_text = f"{prop.get('description', name.replace('_', ' '))}{unit}"
        if "boolean" in kinds:
            parser.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:
            kind = next(_TYPES[k] for k in kinds if k in _TYPES)
            parser.add_argument(flag(name), dest=name, type=kind, default=None, metavar=kind.__name__.upper(),
                                help=help_text)
    parser.add_argument("--points", type=int, default=13, help="periods per sweep (default 13)")
    parser.add_argument("--json", action="store_true", help="print the Advice as JSON")
    add_read_only(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    given = {k: getattr(args, k) for k in AdviceQuery.model_fields if getattr(args, k, None) is not None}
    try:
        query = AdviceQuery(**given)
    except ValidationError as exc:
        for err in exc.errors():
            print(f"ckptd: {flag(str(err['loc'][0]))}: {err['msg']}", file=sys.stderr)
        return EXIT_USAGE
    history: JobHistory | None = None
    job = None
    if args.target:
        opened = open_job(args.target, read_only=args.read_only)
        if opened is None:
            return EXIT_BAD
        cat, job = opened
        history = job_history(cat.checkpoints(job), EventStore(cat.storage, read_only=cat.read_only_for).load(job))
    try:
        advice = advise(query, history, job=job, points=max(3, args.points), assume=job is not None)
    except MissingInputs as exc:
        wanted = ", ".join(" or ".join(flag(n) for n in name.split("|")) for name in exc.names)
        where = f"job {job!r} has no history of them" if job else "no ROOT/JOB given to read a history from"
        print(f"ckptd: cannot advise, missing: {wanted} ({where})", file=sys.stderr)
        return EXIT_BAD
    except ValueError as exc:
        print(f"ckptd: {exc}", file=sys.stderr)
        return EXIT_USAGE
    assumed = [f"{flag(n)} {float(advice.inputs[n].value):.3g}" for n in ASSUMABLE
               if advice.inputs[n].source in ("default", "derived")]
    if assumed:  # on stderr: --json stays one document (its inputs say the same, each with its source and why)
        print(f"ckptd: advise: assumed, not in the history of job {job}: {', '.join(assumed)} (the inputs say "
              "why; a flag sets any of them)", file=sys.stderr)
    print(advice.model_dump_json(indent=2) if args.json else render(advice))
    return EXIT_OK


__all__ = ["add_parser", "flag", "run"]
