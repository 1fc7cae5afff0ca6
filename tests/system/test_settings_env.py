"""Grouping ckptd's settings renamed no variable: every ``CKPTD_*`` variable documented before the settings were
split into groups (docs/protocol.md's table then; docs/operations.md, "Settings", now) still sets the same value,
read from the environment or given by its field's name, and the flat reads of before still answer (with a
deprecation warning naming the group)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from ckptd.config import GROUPS, CliSettings, Settings, env_names
from trainer_client.config import ClientSettings

SECRET = "0123456789abcdef-peer"

# variable -> (a value other than the default, the field it sets, what the field holds then). "{file}" is a file
# holding "file-secret-0123456789" (the token and peer-secret files).
SERVER: dict[str, tuple[str, str, Any]] = {
    "CKPTD_ROOT": ("/data/ckpt", "root", "/data/ckpt"),
    "CKPTD_CREATE_ROOT": ("true", "create_root", True),
    "CKPTD_HOST": ("0.0.0.0", "host", "0.0.0.0"),
    "CKPTD_PORT": ("9123", "port", 9123),
    "CKPTD_UDS": ("/run/ckptd/ckptd.sock", "uds", "/run/ckptd/ckptd.sock"),
    "CKPTD_UDS_MODE": ("0660", "uds_mode", "0660"),
    "CKPTD_TOKEN": ("a-real-token-1", "token", "a-real-token-1"),
    "CKPTD_TOKEN_FILE": ("{file}", "token", "file-secret-0123456789"),
    "CKPTD_METRICS_REQUIRE_TOKEN": ("true", "metrics_require_token", True),
    "CKPTD_MAX_BODY_BYTES": ("1048576", "max_body_bytes", 1 << 20),
    "CKPTD_WORKER_THREADS": ("3", "worker_threads", 3),
    "CKPTD_REVALIDATE_AFTER_S": ("12.5", "revalidate_after_s", 12.5),
    "CKPTD_KEEP_ALIVE_S": ("30", "keep_alive_s", 30.0),
    "CKPTD_MAX_CONNECTIONS": ("64", "max_connections", 64),
    "CKPTD_MAX_HEADER_BYTES": ("8192", "max_header_bytes", 8192),
    "CKPTD_MAX_HEADERS": ("50", "max_headers", 50),
    "CKPTD_HEADER_TIMEOUT_S": ("5", "header_timeout_s", 5.0),
    "CKPTD_BODY_TIMEOUT_S": ("7", "body_timeout_s", 7.0),
    "CKPTD_MAX_BODY_BYTES_IN_FLIGHT": ("2097152", "max_body_bytes_in_flight", 2 << 20),
    "CKPTD_READ_ONLY": ("true", "read_only", True),
    "CKPTD_READ_ONLY_JOBS": ("llama,mlp", "read_only_jobs", "llama,mlp"),
    "CKPTD_STATE_DIR": ("/var/lib/ckptd", "state_dir", "/var/lib/ckptd"),
    "CKPTD_REFRESH_INTERVAL_S": ("0.5", "refresh_interval_s", 0.5),
    "CKPTD_SAVE_TIMEOUT_S": ("60", "save_timeout_s", 60.0),
    "CKPTD_LOG_LEVEL": ("debug", "log_level", "debug"),
    "CKPTD_ADOPT_AFTER_S": ("0", "adopt_after_s", 0.0),
    "CKPTD_KEEP_LAST": ("3", "keep_last", 3),
    "CKPTD_KEEP_EVERY": ("100", "keep_every", 100),
    "CKPTD_KEEP_NEWER_THAN_S": ("3600", "keep_newer_than_s", 3600.0),
    "CKPTD_CLEAN_ABANDONED": ("false", "clean_abandoned", False),
    "CKPTD_GC_INTERVAL_S": ("60", "gc_interval_s", 60.0),
    "CKPTD_DRAIN_TIMEOUT_S": ("5", "drain_timeout_s", 5.0),
    "CKPTD_LEASE_TTL_S": ("30", "lease_ttl_s", 30.0),
    "CKPTD_BUCKET_WRITES_PER_S": ("250", "bucket_writes_per_s", 250.0),
    "CKPTD_SHM_DIR": ("/dev/shm/ckptd", "shm_dir", "/dev/shm/ckptd"),
    "CKPTD_MAX_SNAPSHOTS": ("4", "max_snapshots", 4),
    "CKPTD_PEER_PORT": ("9472", "peer_port", 9472),
    "CKPTD_PEER_HOST": ("0.0.0.0", "peer_host", "0.0.0.0"),
    "CKPTD_PEER_ADVERTISE": ("host-1.svc:9472", "peer_advertise", "host-1.svc:9472"),
    "CKPTD_PEER_SECRET": (SECRET, "peer_secret", SECRET),
    "CKPTD_PEER_SECRET_FILE": ("{file}", "peer_secret", "file-secret-0123456789"),
    "CKPTD_PEERS": ("0=a:9472,1=b:9472", "peers", "0=a:9472,1=b:9472"),
    "CKPTD_PEER_COPIES": ("2", "peer_copies", 2),
    "CKPTD_PEER_STRIDE": ("4", "peer_stride", 4),
    "CKPTD_PEER_MAP": ("0:1+2", "peer_map", "0:1+2"),
    "CKPTD_PEER_BANDWIDTH_BYTES_S": ("1000000", "peer_bandwidth_bytes_s", 1e6),
    "CKPTD_PEER_REFILL": ("false", "peer_refill", False),
    "CKPTD_HOST_INDEX": ("3", "host_index", 3),
    "JOB_COMPLETION_INDEX": ("2", "host_index", 2),
    "CKPTD_SLICE_INDEX": ("1", "slice_index", 1),
    "CKPTD_HOSTS_PER_SLICE": ("4", "hosts_per_slice", 4),
    "CKPTD_HOST_COUNT": ("8", "host_count", 8),
    "CKPTD_PEER_CAPACITY_BYTES": ("1073741824", "peer_capacity_bytes", 1 << 30),
    "CKPTD_PERSIST_COMPRESSION": ("true", "persist_compression", True),
    "CKPTD_PERSIST_DEVICES": ("4", "persist_devices", 4),
    "CKPTD_PERSIST_NICE": ("0", "persist_nice", 0),
    "CKPTD_MAX_JOBS": ("10", "max_jobs", 10),
    "CKPTD_EVENTS_MAX_PER_JOB": ("500", "events_max_per_job", 500),
    "CKPTD_EVENTS_MAX_BYTES_PER_JOB": ("131072", "events_max_bytes_per_job", 128 << 10),
    "CKPTD_EVENTS_MEMORY_BYTES": ("2097152", "events_memory_bytes", 2 << 20),
    "CKPTD_ADVICE_WORKERS": ("2", "advice_workers", 2),
    "CKPTD_ADVICE_TIMEOUT_S": ("3", "advice_timeout_s", 3.0),
    "CKPTD_ADVICE_MAX_FAILURES": ("5000", "advice_max_failures", 5000),
    "CKPTD_WEDGED_AFTER_S": ("15", "wedged_after_s", 15.0),
}
# what a variable needs beside it to be a valid setting
NEEDS = {"CKPTD_PEER_PORT": {"CKPTD_PEER_SECRET": SECRET}}
# the other settings the table documented: the commands' (CliSettings) and the trainer's (ClientSettings)
OTHERS: dict[str, tuple[type[Any], str, str, Any]] = {
    "CKPTD_STORAGE_TIMEOUT_S": (CliSettings, "20", "storage_timeout_s", 20.0),
    "CKPTD_RESTORE_HOST_BYTES": (ClientSettings, "16777216", "restore_host_bytes", 16 << 20),
    "CKPTD_HEARTBEAT_TIMEOUT_S": (ClientSettings, "30", "heartbeat_timeout_s", 30),
    "CKPTD_ROUTE_TIMEOUT_S": (ClientSettings, "2.5", "route_timeout_s", 2.5),
}


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """An environment without any ckptd variable (and without Kubernetes' index); ``{file}``'s path."""
    for name in list(os.environ):
        if name.startswith("CKPTD_") or name == "JOB_COMPLETION_INDEX":
            monkeypatch.delenv(name)
    secret = tmp_path / "secret"
    secret.write_text("file-secret-0123456789\n")
    return {"{file}": str(secret)}


def test_the_table_names_every_setting_of_every_group() -> None:
    files = {"token_file", "peer_secret_file"}  # each read into the secret's field: the table checks that field
    assert {field for _, field, _ in SERVER.values()} == set(Settings.setting_fields()) - files
    assert {name for names in map(env_names, Settings.setting_fields()) for name in names} == set(SERVER)
    assert sum(len(cls.model_fields) for cls in GROUPS.values()) == len(Settings.setting_fields())


@pytest.mark.parametrize("variable", sorted(SERVER))
def test_every_variable_documented_before_the_groups_sets_the_same_value(
        variable: str, environ: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    raw, field, expected = SERVER[variable]
    for name, value in {**NEEDS.get(variable, {}), variable: environ.get(raw, raw)}.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.value(field) == expected
    assert getattr(getattr(settings, Settings.group_of(field)), field) == expected
    if variable in ("CKPTD_TOKEN_FILE", "CKPTD_PEER_SECRET_FILE", "JOB_COMPLETION_INDEX"):
        return  # a file's field holds its path (test_a_file_variable_and_its_field_by_name_agree); an alias
    monkeypatch.delenv(variable)
    assert Settings(**{field: raw}).value(field) == expected, "the field by its name, as the flags and tests give it"


@pytest.mark.parametrize("variable", sorted(OTHERS))
def test_the_commands_and_the_trainers_variables_set_the_same_value(
        variable: str, environ: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    cls, raw, field, expected = OTHERS[variable]
    monkeypatch.setenv(variable, raw)
    assert getattr(cls(), field) == expected


def test_a_file_variable_and_its_field_by_name_agree(environ: dict[str, str]) -> None:
    path = environ["{file}"]
    assert Settings(token_file=path).auth.token == "file-secret-0123456789"
    assert Settings(peer_secret_file=path).peer.peer_secret == "file-secret-0123456789"


def test_the_reads_of_before_the_groups_still_answer_with_a_warning(environ: dict[str, str]) -> None:
    settings = Settings(port=9123, host_index=1, host_count=2, uds_mode="0660")
    with pytest.warns(DeprecationWarning, match=r"Settings.port is deprecated: read Settings.serve.port"):
        assert settings.port == 9123  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert settings.this_host() == (1, 2)  # type: ignore[attr-defined]
        assert settings.socket_mode() == 0o660  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        _ = settings.no_such_setting  # type: ignore[attr-defined]


def test_one_error_lists_what_every_group_refused(environ: dict[str, str]) -> None:
    """Each error at the field's name, as ``ckptd serve`` prints them (``invalid settings: port: ...``)."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as refused:
        Settings(port=-1, peer_copies=99)
    assert [e["loc"] for e in refused.value.errors()] == [("port",), ("peer_copies",)]

