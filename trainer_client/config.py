"""trainer_client's settings: the one place where the library reads its environment (prefix ``CKPTD_``).

``CKPTD_URL`` (where the sidecar listens: ``http://HOST:PORT``, or ``unix:///ABS/PATH`` for its unix socket, parsed
by ``trainer_client.core._ckptd_url``), ``CKPTD_TOKEN`` (bearer token), ``CKPTD_SHM_DIR`` (the
host-memory tier), ``CKPTD_TIMEOUT_S`` (per request), ``CKPTD_RESUME_DEADLINE_S`` (how long a resume may
wait for the sidecar before the client scans storage itself), ``CKPTD_REPORT_EVENTS`` and
``CKPTD_EVENTS_FLUSH_TIMEOUT_S`` (the background event reporter, ``trainer_client.client._event_reporter``),
``CKPTD_RUN_ID`` (the run's identity, recorded with every step and sent with every resume),
``CKPTD_HEARTBEAT_TIMEOUT_S`` (a multi-controller job's ``jax.distributed`` heartbeat timeout:
``trainer_client.runtime.multihost._job_store.initialize_multihost``), ``CKPTD_ROUTE_TIMEOUT_S`` (how long a process of
a multi-process job waits for another's answer on a persistent save's route:
``trainer_client.runtime.saving._save_route``),
``CKPTD_RESTORE_HOST_BYTES`` (the host memory a
restore may hold at once: ``trainer_client.runtime.restore._restore_budget``).

Read once per process: ``client_settings()`` reads the environment the first time it is asked and answers the
same ``ClientSettings`` after that, so every part of a run sees one reading even where the environment changes
later. ``ElasticRunner`` takes its client's settings (``CkptdClient.settings``: given in code, else
``client_settings()``) and passes them down to the checkpointer, the save route and the restore; a module that
is passed none takes ``client_settings()``, never a reading of its own. ``reset_client_settings()`` forgets the
reading, for tests that change the environment.
"""

from __future__ import annotations

import threading

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainer_client.core._ckptd_url import parse_ckptd_url
from trainer_client.core.protocol import DEFAULT_PORT


class ClientSettings(BaseSettings):
    """How the trainer reaches its sidecar."""

    model_config = SettingsConfigDict(env_prefix="CKPTD_", extra="ignore")

    url: str = Field(
        default=f"http://127.0.0.1:{DEFAULT_PORT}",
        description="where the ckptd sidecar answers: its base URL (http://HOST:PORT), or unix:///ABS/PATH/TO.sock for "
        "its unix socket (`ckptd serve --uds`)",
    )
    token: str | None = Field(default=None, repr=False, description="bearer token sent on /v1 routes")
    timeout_s: float = Field(default=2.0, gt=0, description="timeout of one HTTP request")
    shm_dir: str | None = Field(
        default=None, description="host-memory tier directory (the fallback scan looks there too)"
    )
    resume_deadline_s: float = Field(
        default=5.0, gt=0, description="after this long without an answer a resume scans storage itself"
    )
    run_id: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="this run's id, the same across its restarts (e.g. the JobSet's uid): recorded with every step, "
        "and a resume refuses a step another run saved (docs/protocol.md, Identity); unset: not checked",
    )
    report_events: bool = Field(default=True, description="report elastic events to ckptd (in the background)")
    events_flush_timeout_s: float = Field(
        default=5.0, ge=0, description="at the end of a run, how long to wait for unsent events to reach ckptd"
    )
    heartbeat_timeout_s: int = Field(
        default=10, ge=1, le=3600,
        description="multi-controller jobs: jax.distributed's heartbeat timeout, how long a dead process goes "
        "unnoticed before the others abort and the job restarts (jax's default, 100 s, docs/multihost.md section 2)",
    )
    route_timeout_s: float = Field(
        default=600.0, gt=0,
        description="multi-process jobs: how long a process waits for each other process's answer on a persistent "
        "save's route (memory or Orbax, trainer_client.runtime.saving._save_route) before it fails; a process whose "
        "snapshot fails still answers, so only a dead process is waited for (and a dead process ends the job)",
    )
    restore_host_bytes: int | None = Field(
        default=None, gt=0,
        description="host memory a restore may hold at once, in bytes: a larger state is restored in batches "
        "(trainer_client.runtime.restore._restore_budget); unset: no cap (on accelerators the direct reader "
        "still batches at 4 GiB)",
    )

    @field_validator("url")
    @classmethod
    def _known_form(cls, url: str) -> str:
        """A malformed URL (no scheme, a relative socket path, one too long for a socket) is refused here, in one
        line, not at the first request."""
        parse_ckptd_url(url)
        return url


_read: ClientSettings | None = None
_reading = threading.Lock()


def client_settings() -> ClientSettings:
    """This process's ``ClientSettings``: read from the environment the first time, the same object after that (a
    value the environment gets wrong raises here, each time, until it is right)."""
    global _read
    with _reading:
        if _read is None:
            _read = ClientSettings()
        return _read


def reset_client_settings() -> None:
    """Forget the reading: the next ``client_settings()`` reads the environment again (tests that change it)."""
    global _read
    with _reading:
        _read = None


__all__ = ["ClientSettings", "client_settings", "reset_client_settings"]
