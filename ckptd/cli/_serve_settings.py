"""``ckptd serve``'s own settings group (``ServeSettings``), beside the command that uses it: where the server
listens (an address and port, or a unix socket and its mode) and what it logs.

``ckptd/config.py`` composes it into ``Settings``; each field keeps the ``CKPTD_*`` variable it always had. It
imports nothing of the command, so the shared layer can compose it (docs/architecture.md, "Package map").
"""

from __future__ import annotations

import os

from pydantic import Field, model_validator

from ckptd._settings_group import SettingsGroup
from trainer_client.core import protocol as p
from trainer_client.core import socket_path_problem

UDS_MODES = ("0600", "0660")  # of ckptd's unix socket: the owner only, or the owner and the socket's group


class ServeSettings(SettingsGroup):
    """Where ``ckptd serve`` listens, and its log level."""

    host: str = Field(
        default="127.0.0.1",
        description="listen address; anything but loopback without a token is warned about at startup",
    )
    port: int = Field(default=p.DEFAULT_PORT, ge=0, le=65535, description="listen port (clear of libtpu's 8470-8479)")
    uds: str | None = Field(
        default=None,
        description="listen on this unix socket instead of host:port (trainers: CKPTD_URL=unix:///ABS/PATH); its "
        "mode (CKPTD_UDS_MODE) is the access rule, its directory may not be writable by others",
    )
    uds_mode: str = Field(
        default="0600", description="the unix socket's mode: 0600 (this user only) or 0660 (and the socket's group)",
    )
    log_level: str = Field(default="info", description="log level (uvicorn's: trace, debug, info, warning, error)")

    @model_validator(mode="after")
    def _check_uds(self) -> ServeSettings:
        """``uds`` made absolute and checked (it must fit in ``sun_path``; empty: unset), ``uds_mode`` one of the two
        modes."""
        if self.uds_mode.removeprefix("0o").rjust(4, "0") not in UDS_MODES:
            raise ValueError(f"CKPTD_UDS_MODE {self.uds_mode!r} must be 0600 (this user only) or 0660 (this user and "
                             "the socket's group): file permissions are who may reach ckptd over its socket")
        if not self.uds:  # an empty CKPTD_UDS: TCP, as when unset
            self.uds = None
            return self
        self.uds = os.path.abspath(self.uds)
        if (problem := socket_path_problem(self.uds)) is not None:
            raise ValueError(f"CKPTD_UDS (--uds): {problem}")
        return self

    def socket_mode(self) -> int:
        """``uds_mode`` as a number (0o600 or 0o660)."""
        return int(self.uds_mode.removeprefix("0o"), 8)


__all__ = ["UDS_MODES", "ServeSettings"]
