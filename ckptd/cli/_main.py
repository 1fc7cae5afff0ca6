"""The ``ckptd`` command: ``serve`` runs the sidecar, the other subcommands read a checkpoint root themselves.

``ls``, ``show``, ``plan``, ``validate``, ``gc``, ``events``, ``goodput`` and ``advise`` apply the same commit rule
and planner as the server, straight on storage, in every install (``pip install ckptd``); ``serve`` needs the
server's libraries and says so without them (``trainer_client.core._extras``). Every command exits 0 only when its
answer is good; storage that cannot answer is one line (``ckptd.cli._reach``), and so is a reader that stops
reading (``ckptd plan ... | head``: no BrokenPipeError traceback). The text of ``--help`` is ``DESCRIPTION`` and the
subcommands' own, written for a user: no markup, no module paths (these docstrings are for the code's readers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from ckptd import __version__
from ckptd.cli import _advise as advise
from ckptd.cli import _maintenance as maintenance
from ckptd.cli import _observe as observe
from ckptd.cli import _plan as plan
from ckptd.cli import _serve as serve
from ckptd.cli._reach import Unreachable
from ckptd.cli._support import add_json, add_read_only, open_catalog, open_job, root_or_default
from trainer_client.core import MissingExtra, StorageError
from trainer_client.core.format import aside_state, aside_steps

EXIT_OK = 0
EXIT_BAD = 1
EXIT_USAGE = 2

DESCRIPTION = (
    "ckptd, the checkpoint sidecar for elastic JAX training. `ckptd serve` runs the sidecar (install ckptd[server]); "
    "the other commands read a checkpoint root (a directory or gs://bucket/prefix) directly, with no server. A job is "
    "given as ROOT/JOB, or as JOB alone with CKPTD_ROOT set. Each command exits 0 only when its answer is good."
)


def _cmd_ls(args: argparse.Namespace) -> int:
    # ROOT/JOB given by mistake: exit 2 with the command that fits
    cat = open_catalog(root_or_default(args.root), read_only=args.read_only)
    jobs = cat.jobs()
    aside = {j.name: len(aside_steps(cat.storage, cat.storage.join(j.name))) for j in jobs}
    if args.json:
        print(json.dumps([{**j.model_dump(mode="json"), "moved_aside": aside[j.name]} for j in jobs], indent=2))
    else:
        print(f"{'JOB':<32} {'STEPS':>6} {'LATEST':>8} {'LATEST-GOOD':>12}")
        for j in jobs:
            latest, good = (("-" if n is None else n) for n in (j.latest_step, j.latest_good_step))
            print(f"{j.name:<32} {j.steps:>6} {latest:>8} {good:>12}")
    for name, count in aside.items():  # beside the table: bad or unfinished steps a save kept when it took their number
        if count:
            print(f"{name}: {count} step(s) moved aside (ckptd show {name})", file=sys.stderr)
    return EXIT_OK


def _cmd_show(args: argparse.Namespace) -> int:
    opened = open_job(args.target, read_only=args.read_only)
    if opened is None:
        return EXIT_BAD
    cat, job = opened
    checkpoints = cat.checkpoints(job)
    if args.json:
        print(json.dumps([c.model_dump(mode="json") for c in checkpoints], indent=2))
    else:
        print(f"{'STEP':>10} {'STATE':<10} {'DATA-POS':>10} REASON")
        for c in checkpoints:
            pos = c.training.data_position if c.training else "-"
            print(f"{c.step:>10} {c.state.value:<10} {pos!s:>10} {c.reason or ''}")
    for aside in aside_steps(cat.storage, cat.storage.join(job)):  # kept when a save took their number
        print(f"moved aside: {aside.name} (step {aside.step}, {aside_state(cat.storage, aside.path)})",
              file=sys.stderr if args.json else sys.stdout)
    good = cat.latest_good(job)
    print(f"latest-good: {good.step if good else 'none'}", file=sys.stderr)
    return EXIT_OK if good is not None else EXIT_BAD


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptd", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"ckptd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve.add_parser(sub)  # ckptd serve: the HTTP API (ckptd/cli/_serve.py)

    ls = sub.add_parser("ls", help="list the jobs of a root", description="List the jobs of a checkpoint root, "
                        "their newest and newest good steps, and how many steps were moved aside (a bad or unfinished "
                        "step kept when a new save took its number). A directory that holds no job is refused.")
    ls.add_argument("root", nargs="?", metavar="ROOT", help="the root (default: CKPTD_ROOT)")
    add_json(ls)
    add_read_only(ls)
    ls.set_defaults(func=_cmd_ls)

    show = sub.add_parser("show", help="list a job's steps and their states",
                          description="List a job's steps, their states and data positions, then the steps moved "
                          "aside; exit 0 when it has a good step.")
    show.add_argument("target", metavar="[ROOT/]JOB", help="the job (JOB alone: under CKPTD_ROOT)")
    add_json(show)
    add_read_only(show)
    show.set_defaults(func=_cmd_show)

    plan.add_parser(sub)  # ckptd plan [ROOT/]JOB --devices N (ckptd/cli/_plan.py)

    maintenance.add_parsers(sub)  # ckptd validate / gc (ckptd/cli/_maintenance.py)
    advise.add_parser(sub)  # ckptd advise [ROOT/JOB]: periods and recovery policy (ckptd/cli/_advise.py)
    observe.add_parsers(sub)  # ckptd events / goodput ROOT/JOB, from storage (ckptd/cli/_observe.py)
    return parser


def _stdout_gone() -> int:
    """The reader of stdout went away (``| head``): Python's documented way out, without a second error at exit
    when the interpreter flushes stdout again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BAD


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a reader gone shows here, inside the try, not at exit
        return code
    except BrokenPipeError:
        return _stdout_gone()
    except Unreachable as exc:
        print(f"ckptd: {exc}", file=sys.stderr)
        return EXIT_BAD
    except StorageError as exc:
        print(f"ckptd: storage error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_BAD
    except MissingExtra as exc:
        print(f"ckptd: {exc}", file=sys.stderr)
        return EXIT_BAD


if __name__ == "__main__":
    sys.exit(main())
