"""What every ``ckptd`` subcommand that works on storage needs: ``ROOT/JOB`` parsing and a one-shot catalog.

Kept apart from ``ckptd.cli.main`` so the subcommand modules (``maintenance``, ``advise``, ``observe``)
import it without importing the CLI that imports them.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from ckptd.catalog.catalog import Catalog
from trainer_client.core.protocol import is_valid_job_name
from trainer_client.core.storage import Storage

EXIT_OK = 0
EXIT_BAD = 1
EXIT_USAGE = 2


def split_job(target: str) -> tuple[str, str]:
    """``ROOT/JOB`` -> (root, job)."""
    target = target.rstrip("/")
    if "/" not in target:
        raise SystemExit(f"ckptd: expected ROOT/JOB, got {target!r}")
    root, job = target.rsplit("/", 1)
    return root or "/", job


def open_catalog(root: str) -> Catalog:
    """A catalog of ``root`` built now, in memory, settling every step the way the server does."""
    storage = Storage(root)
    if not storage.is_dir(storage.root):
        raise SystemExit(f"ckptd: {root} is not a directory")
    cat = Catalog(storage, ":memory:")  # one-shot: nothing to keep, no file left behind
    # What cat.rebuild() does, job by job, with a progress bar on a terminal (settling steps can take long).
    jobs = [e.name for e in storage.list_dir(storage.root) if e.is_dir and is_valid_job_name(e.name)]
    for name in tqdm(jobs, desc="scanning jobs", unit="job", file=sys.stderr, disable=None, leave=False):
        cat.refresh_job(name)
    cat.last_refresh = time.time()
    cat.ready.set()
    return cat


def open_job(target: str) -> tuple[Catalog, str] | None:
    """The catalog and job name of ``ROOT/JOB``; None (having said why on stderr) when there is no such job."""
    root, job = split_job(target)
    cat = open_catalog(root)
    if not cat.has_job(job):
        print(f"ckptd: no job {job!r} under {root}", file=sys.stderr)
        return None
    return cat, job


__all__ = ["EXIT_BAD", "EXIT_OK", "EXIT_USAGE", "open_catalog", "open_job", "split_job"]
