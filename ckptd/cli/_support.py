"""What every ``ckptd`` subcommand that works on storage needs: ``ROOT/JOB`` parsing and a one-shot catalog.

Kept apart from ``ckptd.cli._main`` so the subcommand modules (``maintenance``, ``advise``, ``observe``)
import it without importing the CLI that imports them. A root, a job and a step are all directories, and
were easy to mix up (``ckptd ls ROOT/JOB`` listed step directories as jobs, ``ckptd show ROOT`` printed an
empty table): ``misplaced`` tells them apart from what they hold, and the commands say which command fits,
exit 2 (a usage error, like argparse's).
"""

from __future__ import annotations

import logging
import posixpath
import sys
import time
from typing import Any, NoReturn

from pydantic import ValidationError
from tqdm import tqdm

from ckptd.catalog._catalog import Catalog
from ckptd.cli._reach import reach
from ckptd.config import CliSettings
from trainer_client.core import Storage
from trainer_client.core.format import CHECKPOINT_METADATA, COMMIT_MARKER, SIDE_DIR, parse_step_name, step_entries
from trainer_client.core.protocol import is_valid_job_name

EXIT_OK = 0
EXIT_BAD = 1
EXIT_USAGE = 2


def settings() -> CliSettings:
    """``CKPTD_ROOT`` and ``CKPTD_STORAGE_TIMEOUT_S`` as the environment has them now; a bad value is a usage
    error."""
    try:
        return CliSettings()
    except ValidationError as exc:
        err = exc.errors()[0]
        usage_error(f"CKPTD_{str(err['loc'][0]).upper()}: {err['msg']}")


def root_or_default(root: str | None) -> str:
    """``root``, else ``CKPTD_ROOT``; a usage error when neither is there."""
    chosen = root or settings().root
    if not chosen:
        usage_error("no ROOT given and CKPTD_ROOT is not set")
    return chosen


def split_job(target: str) -> tuple[str, str]:
    """``ROOT/JOB`` -> (root, job); a bare ``JOB`` is a job of ``CKPTD_ROOT``."""
    target = target.rstrip("/")
    if "/" not in target:
        if settings().root:
            return settings().root or "", target
        usage_error(f"expected ROOT/JOB (or JOB with CKPTD_ROOT set), got {target!r}")
    root, job = target.rsplit("/", 1)
    return root or "/", job


def job_target(target: str) -> str:
    """``target`` as ``ROOT/JOB``, the way messages show it."""
    root, job = split_job(target)
    return f"{root.rstrip('/')}/{job}"


def open_storage(root: str) -> Storage:
    """The storage of ``root`` once it has answered, within ``CKPTD_STORAGE_TIMEOUT_S`` (``ckptd.cli._reach``)."""
    return reach(root, root, settings().storage_timeout_s)


def usage_error(message: str) -> NoReturn:
    """Say what is wrong on stderr and exit 2, as argparse does for a malformed command line."""
    print(f"ckptd: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def _is_step_dir(storage: Storage, path: str) -> bool:
    """``path`` holds what an Orbax step directory holds (its metadata or its commit marker)."""
    return bool({e.name for e in storage.list_dir(path)} & {CHECKPOINT_METADATA, COMMIT_MARKER})


def steps_in(storage: Storage, path: str, *, probe: int = 3) -> list[int]:
    """The steps ``path`` holds when it is a job directory (its newest step-named children, up to ``probe`` of
    them, are Orbax step directories), else []. A root whose jobs have numeric names holds none."""
    entries = step_entries(storage, path)
    if not any(name.is_tmp or _is_step_dir(storage, entry.path) for name, entry in entries[:probe]):
        return []
    return sorted(name.step for name, _ in entries)


def _some(names: list[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names)} in all)" if len(names) > shown else "")


def misplaced(storage: Storage, path: str, shown_as: str, expected: str) -> str | None:
    """Why ``path`` (given as ``shown_as``) is not the ``expected`` kind ("root" or "job"), with the command
    that fits; None when nothing says it is something else."""
    if expected == "root":
        steps = steps_in(storage, path)
        if steps:
            return (f"{shown_as} is a job, not a checkpoint root (it holds steps {_some([str(s) for s in steps])}): "
                    f"`ckptd show {shown_as}` lists its steps, `ckptd ls {posixpath.dirname(shown_as) or '/'}` "
                    "the jobs beside it")
        return None
    if parse_step_name(posixpath.basename(path.rstrip("/"))) is not None and _is_step_dir(storage, path):
        job = posixpath.dirname(shown_as.rstrip("/"))
        return f"{shown_as} is a step directory, not a job: `ckptd show {job}` lists the steps of its job"
    if steps_in(storage, path):
        return None
    jobs = sorted(e.name for e in storage.list_dir(path)
                  if e.is_dir and is_valid_job_name(e.name) and steps_in(storage, e.path))
    if jobs:
        return (f"{shown_as} is a checkpoint root, not a job (its jobs: {_some(jobs)}): `ckptd ls {shown_as}` "
                f"lists them, `ckptd show {shown_as}/{jobs[0]}` the steps of one")
    return None


READ_ONLY_HELP = ("write nothing into step directories: ckptd's records go to ROOT/.ckptd/JOB/STEP/, nothing is "
                  "deleted (what CKPTD_READ_ONLY does for the server)")


TARGET_HELP = "the job: ROOT/JOB, or JOB alone under CKPTD_ROOT"


def add_json(parser: Any) -> None:
    """``--json``: every command's machine-readable form of its answer."""
    parser.add_argument("--json", action="store_true", help="print the answer as JSON instead of a table")


def add_read_only(parser: Any) -> None:
    """``--read-only``: the option of every command that settles steps (docs/protocol.md, "Read-only adoption")."""
    parser.add_argument("--read-only", action="store_true", help=READ_ONLY_HELP)


def holds_jobs(storage: Storage, jobs: list[str]) -> bool:
    """Whether the root, with these job-named directories, looks like a checkpoint root: it has none yet, or ckptd's
    own directory, or one of them holds steps or ckptd's records (events)."""
    if not jobs or storage.is_dir(storage.join(SIDE_DIR)):
        return True
    # These directories may be anything (``ls /etc``): the links out of them that listing them warns about are no
    # news while asking whether they are jobs.
    links = logging.getLogger(Storage.__module__)
    level = links.level
    links.setLevel(logging.ERROR)
    try:
        return any(steps_in(storage, storage.join(job)) or storage.is_dir(storage.join(job, SIDE_DIR))
                   for job in jobs)
    finally:
        links.setLevel(level)


def open_catalog(root: str, *, read_only: bool = False) -> Catalog:
    """A catalog of ``root`` built now, in memory, settling every step the way the server does. A directory that
    holds directories but no job (``/etc``) is refused (exit 1), as ``show`` refuses a directory that is no job."""
    storage = open_storage(root)
    wrong = misplaced(storage, storage.root, root, "root")
    if wrong is not None:
        usage_error(wrong)
    jobs = [e.name for e in storage.list_dir(storage.root) if e.is_dir and is_valid_job_name(e.name)]
    if not holds_jobs(storage, jobs):
        print(f"ckptd: {root} is not a checkpoint root: none of its {len(jobs)} directories holds checkpoint steps "
              f"({_some(jobs)}); a root holds JOB/STEP directories", file=sys.stderr)
        raise SystemExit(EXIT_BAD)
    cat = Catalog(storage, ":memory:", read_only=read_only)  # one-shot: nothing to keep, no file left behind
    # What cat.rebuild() does, job by job, with a progress bar on a terminal (settling steps can take long).
    for name in tqdm(jobs, desc="scanning jobs", unit="job", file=sys.stderr, disable=None, leave=False):
        cat.refresh_job(name)
    cat.last_refresh = time.time()
    cat.ready.set()
    return cat


def open_job(target: str, *, read_only: bool = False) -> tuple[Catalog, str] | None:
    """A catalog of ``ROOT/JOB`` (that job alone, settled now) and the job's name; None (having said why on
    stderr) when there is no such job; exit 2 when ``ROOT/JOB`` names a root or a step instead."""
    root, job = split_job(target)
    storage = open_storage(root)
    cat = Catalog(storage, ":memory:", read_only=read_only)  # one-shot: nothing to keep, no file left behind
    if is_valid_job_name(job):
        cat.refresh_job(job)
    cat.last_refresh = time.time()
    cat.ready.set()
    if not cat.has_job(job):
        why = cat.refused.get(job)
        print(f"ckptd: no job {job!r} under {root}" + (f": {why}" if why else ""), file=sys.stderr)
        return None
    wrong = misplaced(storage, storage.join(job), job_target(target), "job")  # its jobs' names may look like steps
    if wrong is not None:
        usage_error(wrong)
    return cat, job


__all__ = ["EXIT_BAD", "EXIT_OK", "EXIT_USAGE", "READ_ONLY_HELP", "add_read_only", "holds_jobs", "job_target",
           "misplaced", "open_catalog", "open_job", "open_storage", "root_or_default", "settings", "split_job",
           "steps_in", "usage_error"]
