"""The catalog's settings groups, beside the code that uses them: the storage root and how it is scanned
(``StorageSettings``: ``Catalog``, ``Refresher``, ``LeaseBoard``) and retention (``RetentionSettings``:
``_retention.py``). The other rooms have theirs beside them: the events kept (``ckptd/events/_settings.py``) and
the host-memory tier (``ckptd/memory_tier/_settings.py``).

``ckptd/config.py`` composes them into ``Settings``; each keeps the ``CKPTD_*`` variable names it always had. This
module imports nothing of the catalog, so the shared layer can compose it (docs/architecture.md, "Package map").
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from pydantic import Field, model_validator

from ckptd._settings_group import SettingsGroup
from trainer_client.core import BUCKET_WRITES_PER_S
from trainer_client.core import protocol as p


class StorageSettings(SettingsGroup):
    """The checkpoint root, the catalog's cache of it, how often it is scanned and what ckptd may write there."""

    root: str = Field(default="./checkpoints", description="checkpoint root: a directory or gs://bucket/prefix")
    create_root: bool = Field(
        default=False, description="create a local root that does not exist (without it `serve` refuses to start)"
    )
    state_dir: str | None = Field(
        default=None, description="where the catalog cache lives (default: a per-root dir under ~/.cache)"
    )
    read_only: bool = Field(
        default=False,
        description="write nothing into any step directory of the root: manifests, verified and quarantine records "
        "go to <root>/.ckptd/<job>/<step>/, retention deletes nothing",
    )
    read_only_jobs: str = Field(
        default="", description="the same for these jobs only: job names separated by commas (e.g. `llama,maxtext`)",
    )
    refresh_interval_s: float = Field(default=2.0, gt=0, description="how often storage is rescanned")
    save_timeout_s: float = Field(
        default=3600.0, gt=0, description="a tmp step older than this is reported abandoned"
    )
    adopt_after_s: float = Field(
        default=2.0, ge=0, description="adopt a step without a manifest once its files are unchanged this long"
    )
    revalidate_after_s: float = Field(
        default=30.0, gt=0,
        description="a good step is quick-validated again in full before it is named once its last check is this "
        "old (the size of each of its files is checked on every answer)",
    )
    max_jobs: int = Field(
        default=256, ge=1, le=100_000,
        description="jobs catalogued at most: scans ignore jobs past it (with a warning) and events may not create "
        "one (409 JOB_LIMIT); directories holding steps are kept before empty ones, then the most recently "
        "changed",
    )
    lease_ttl_s: float | None = Field(
        default=None, gt=0, le=86400,
        description="several sidecars on one root (a multi-host job): only the holder of a job's lease on storage "
        "writes its records and runs its retention, the others serve what it wrote; a follower takes over when the "
        "leader's heartbeat stopped this long (off: None, every sidecar writes; docs/multihost.md)",
    )

    bucket_writes_per_s: float = Field(
        default=BUCKET_WRITES_PER_S, ge=0, le=1e7,
        description="gs://: the object writes a second the bucket takes (GCS: about 1,000 to start), shared by the "
        "hosts of a multi-host job: each host paces its part's writes at this over the host count (CKPTD_HOST_COUNT, "
        "else the job's process count), spread with jitter; 0: not paced (429/503 are backed off from either way)",
    )

    @model_validator(mode="after")
    def _valid_job_names(self) -> StorageSettings:
        bad = sorted(name for name in self.read_only_job_names() if not p.is_valid_job_name(name))
        if bad:
            raise ValueError(f"CKPTD_READ_ONLY_JOBS names invalid job names: {bad}")
        return self

    def read_only_job_names(self) -> frozenset[str]:
        """``read_only_jobs`` as a set of names."""
        return frozenset(name.strip() for name in self.read_only_jobs.split(",") if name.strip())

    def catalog_path(self) -> Path:
        """The SQLite file of the catalog cache for this root."""
        if self.state_dir:
            base = Path(self.state_dir)
        else:
            cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
            digest = hashlib.sha256(self.root.encode()).hexdigest()[:16]
            base = cache / "ckptd" / digest
        base.mkdir(parents=True, exist_ok=True)
        return base / "catalog.sqlite3"


class RetentionSettings(SettingsGroup):
    """Which good steps the server's retention keeps, and how often it runs (``ckptd gc`` takes the same rules)."""

    keep_last: int | None = Field(default=None, ge=1, description="retention: keep the newest N good steps")
    keep_every: int | None = Field(default=None, ge=1, description="retention: keep steps that are multiples of K")
    keep_newer_than_s: float | None = Field(
        default=None, gt=0, description="retention: keep steps committed less than this many seconds ago"
    )
    clean_abandoned: bool = Field(default=True, description="delete saves abandoned for longer than save_timeout_s")
    gc_interval_s: float = Field(default=300.0, gt=0, description="how often retention runs in the server")


__all__ = ["RetentionSettings", "StorageSettings"]
