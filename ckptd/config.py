"""ckptd's settings: the one place where the sidecar and the ``ckptd`` command read their environment (prefix
``CKPTD_``): ``Settings`` for ``ckptd serve``, ``CliSettings`` for the commands that read a root themselves.

``Settings`` is composed of one group per concern, each defined beside the part that uses it (``GROUPS``: where
``serve`` listens, ``auth``, ``storage``, ``retention``, the ``memory_tier``, ``peer`` copies, ``events``,
``limits``, ``advice``). Every variable keeps the name it had before the settings were grouped (``CKPTD_`` and the
field's name; ``JOB_COMPLETION_INDEX`` too). ``Settings()`` reads the environment once, in the composition root
(``ckptd serve``), which hands each part its group; ``Settings(field=value)`` takes any field by its own name, as
the flags and tests give them, and ``settings.field`` still reads one (deprecated: ``settings.group.field``).
Command-line flags override the environment.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from ckptd._settings_group import PLACEHOLDER_TOKEN_PREFIX, SettingsGroup
from ckptd.api._settings import AdviceSettings, AuthSettings, LimitSettings, token_problem
from ckptd.catalog._settings import RetentionSettings, StorageSettings
from ckptd.cli._serve_settings import UDS_MODES, ServeSettings
from ckptd.events._settings import EventSettings
from ckptd.memory_tier._settings import DEFAULT_PERSIST_NICE, MemoryTierSettings
from ckptd.peers._settings import MAX_HOSTS, PeerSettings

# group -> its settings, in the order `ckptd serve --help` and docs/operations.md ("Settings") list them
GROUPS: dict[str, type[SettingsGroup]] = {
    "serve": ServeSettings, "auth": AuthSettings, "storage": StorageSettings, "retention": RetentionSettings,
    "memory_tier": MemoryTierSettings, "peer": PeerSettings, "events": EventSettings, "limits": LimitSettings,
    "advice": AdviceSettings,
}
_GROUP_OF = {name: group for group, cls in GROUPS.items() for name in cls.model_fields}
# the methods Settings had before the settings were grouped, and the group that has each now
_MOVED = {"catalog_path": "storage", "read_only_job_names": "storage", "socket_mode": "serve", "this_host": "peer",
          "global_host_index": "peer"}


def env_names(name: str) -> tuple[str, ...]:
    """The variables that set the field ``name``, the first the one documented (``CKPTD_HOST_INDEX`` has Kubernetes'
    ``JOB_COMPLETION_INDEX`` after it)."""
    alias = GROUPS[_GROUP_OF[name]].model_fields[name].validation_alias
    choices = getattr(alias, "choices", None)
    return tuple(str(c) for c in choices) if choices else (f"CKPTD_{name.upper()}",)


class Settings:
    """Configuration of one ckptd process: one settings group per concern (``GROUPS``)."""

    serve: ServeSettings  # where ckptd serve listens, and its log (ckptd/cli/_serve_settings.py)
    auth: AuthSettings  # the bearer token (ckptd/api/_settings.py)
    storage: StorageSettings  # the root and its catalog (ckptd/catalog/_settings.py)
    retention: RetentionSettings  # what the server's retention keeps (ckptd/catalog/_settings.py)
    memory_tier: MemoryTierSettings  # the host-memory tier (ckptd/memory_tier/_settings.py)
    peer: PeerSettings  # peer copies among hosts (ckptd/peers/_settings.py)
    events: EventSettings  # the events kept (ckptd/events/_settings.py)
    limits: LimitSettings  # bounds on connections and requests (ckptd/api/_settings.py)
    advice: AdviceSettings  # bounds on advice computations (ckptd/api/_settings.py)

    def __init__(self, **values: Any) -> None:
        """Every group from the environment, with ``values`` over it: a field by its own name (``peer_port=0``),
        or a whole group by the group's (``peer=PeerSettings(...)``). A name of neither is ignored, as unknown
        variables are. One ``ValidationError`` lists what every group refused (each error at the field's name)."""
        given = {group: values.pop(group) for group in GROUPS if group in values}
        fields: dict[str, dict[str, Any]] = {group: {} for group in GROUPS}
        for name, value in values.items():
            if name in _GROUP_OF:
                fields[_GROUP_OF[name]][name] = value
        errors: list[Any] = []
        for group, cls in GROUPS.items():
            whole = given.get(group)
            if isinstance(whole, cls) and not fields[group]:
                setattr(self, group, whole)
                continue
            if whole is not None and not isinstance(whole, dict):
                raise TypeError(f"Settings({group}=...) takes a {cls.__name__} (and no field of it besides)")
            try:
                setattr(self, group, cls(**(whole or {}), **fields[group]))
            except ValidationError as exc:
                errors.extend(exc.errors())
        if errors:
            raise ValidationError.from_exception_data("Settings", errors, hide_input=True)

    if not TYPE_CHECKING:  # at run time only: type checkers hold code to the groups

        def __getattr__(self, name: str) -> Any:
            """``settings.port`` as before the settings were grouped, with a warning naming the group's spelling
            (``settings.serve.port``)."""
            group = _GROUP_OF.get(name) or _MOVED.get(name)
            if group is None or group not in self.__dict__:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            warnings.warn(f"Settings.{name} is deprecated: read Settings.{group}.{name} (its settings group)",
                          DeprecationWarning, stacklevel=2)
            return getattr(self.__dict__[group], name)

    def __repr__(self) -> str:
        return f"Settings({', '.join(f'{group}={getattr(self, group)!r}' for group in GROUPS)})"

    @classmethod
    def setting_fields(cls) -> dict[str, FieldInfo]:
        """Every setting by its field's name (``CKPTD_`` + its name in capitals), group after group."""
        return {name: info for group in GROUPS.values() for name, info in group.model_fields.items()}

    @staticmethod
    def group_of(name: str) -> str:
        """The group holding the setting ``name`` (``KeyError``: no such setting)."""
        return _GROUP_OF[name]

    def value(self, name: str) -> Any:
        """The setting ``name``'s value, wherever its group is."""
        return getattr(getattr(self, _GROUP_OF[name]), name)


class CliSettings(BaseSettings):
    """What the commands that read a root without a server (``ckptd ls``, ``show``, ``plan``, ...) take from the
    environment: ``CKPTD_ROOT`` stands for a root not given, and the first contact with storage is bounded."""

    model_config = SettingsConfigDict(env_prefix="CKPTD_", extra="ignore")

    root: str | None = Field(
        default=None, description="the root of `ckptd ls` when none is given, and of a bare JOB given to the others",
    )
    storage_timeout_s: float = Field(
        default=15.0, gt=0, le=3600,
        description="how long a command waits for storage's first answer (a root that does not answer: one line "
        "naming the cause, exit 1)",
    )


__all__ = ["DEFAULT_PERSIST_NICE", "GROUPS", "MAX_HOSTS", "PLACEHOLDER_TOKEN_PREFIX", "UDS_MODES", "CliSettings",
           "Settings", "env_names", "token_problem"]
