"""ckptd's settings: the one place where the sidecar reads its environment (prefix ``CKPTD_``).

Command-line flags override these; tests build ``Settings`` directly.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Configuration of one ckptd process."""

    model_config = SettingsConfigDict(env_prefix="CKPTD_", extra="ignore")

    root: str = Field(default="./checkpoints", description="checkpoint root: a directory or gs://bucket/prefix")
    host: str = "127.0.0.1"
    port: int = Field(default=8471, ge=0, le=65535)
    token: str | None = Field(default=None, description="bearer token required on /v1 routes when set")
    state_dir: str | None = Field(
        default=None, description="where the catalog cache lives (default: a per-root dir under ~/.cache)"
    )
    refresh_interval_s: float = Field(default=2.0, gt=0, description="how often storage is rescanned")
    save_timeout_s: float = Field(
        default=3600.0, gt=0, description="a tmp step older than this is reported abandoned"
    )
    log_level: str = "info"

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


__all__ = ["Settings"]
