"""trainer_client's settings: the one place where the library reads its environment (prefix ``CKPTD_``).

``CKPTD_URL`` (where the sidecar listens), ``CKPTD_TOKEN`` (bearer token), ``CKPTD_TIMEOUT_S`` (per
request) and ``CKPTD_RESUME_DEADLINE_S`` (how long a resume may wait for the sidecar before the client
scans storage itself).
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ClientSettings(BaseSettings):
    """How the trainer reaches its sidecar."""

    model_config = SettingsConfigDict(env_prefix="CKPTD_", extra="ignore")

    url: str = Field(default="http://127.0.0.1:8471", description="base URL of the ckptd sidecar")
    token: str | None = Field(default=None, description="bearer token sent on /v1 routes")
    timeout_s: float = Field(default=2.0, gt=0, description="timeout of one HTTP request")
    resume_deadline_s: float = Field(
        default=5.0, gt=0, description="after this long without an answer a resume scans storage itself"
    )


__all__ = ["ClientSettings"]
