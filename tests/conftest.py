"""Fixtures shared by every test: a real ckptd server in a thread, and a free TCP port; the markers that skip a test
this run cannot hold (``needs_devices(n)``, ``needs_tcp``).

The environment lines come first, before anything can import jax: every test process (and every
subprocess started from it) sees 8 fake CPU devices, unless the environment already says otherwise
(``make test-device`` leaves the platform to jax: one real chip). Plain helpers live in ``tests/support/``.
"""

from __future__ import annotations

import os

if os.environ.get("CKPTD_TEST_DEVICE") != "1":  # make test-device: the platform is jax's own choice (one real chip)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.gcs_emulator import gcs_emulator
from tests.support.helpers import REPO, free_port
from tests.support.long_runs import LONG_RUNS
from tests.support.server import ServerHandle, StartServer, start_server
from tests.support.sockets import device_mode, no_tcp_reason
from trainer_client.config import reset_client_settings


def pytest_report_header(config: pytest.Config) -> str | None:
    """``make test-device``: jax's devices, made now, before any test module is imported, so that nothing a module
    does on import can move the run off the chip (one did: the whole run went to the CPU), and the log says which
    platform it tested."""
    if not device_mode():
        return None
    import jax

    return f"jax: {jax.default_backend()}, {jax.device_count()} device(s): {jax.devices()[0].device_kind}"


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``long`` every test ``LONG_RUNS`` names (tests/support/long_runs.py); a collected file that lacks a
    function the table names fails the run, naming it."""
    seen: dict[str, set[str]] = {}
    for item in items:
        try:
            where = item.path.relative_to(REPO).as_posix()
        except ValueError:
            continue
        name = getattr(item, "originalname", None) or item.name
        seen.setdefault(where, set()).add(name)
        if name in LONG_RUNS.get(where, ()):
            item.add_marker(pytest.mark.long)
    stale = [f"{where}::{name}" for where, names in seen.items() for name in LONG_RUNS.get(where, frozenset()) - names]
    if stale and not config.getoption("keyword") and not any("::" in arg for arg in config.args):
        raise pytest.UsageError(f"tests/support/long_runs.py names tests that do not exist: {sorted(stale)}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip, before its fixtures run, a test marked ``needs_devices(n)`` where jax has fewer than ``n`` devices, and
    one marked ``needs_tcp`` where the tests run on unix sockets only."""
    wanted = [int(mark.args[0]) for mark in item.iter_markers("needs_devices")]
    if wanted:
        import jax  # only for marked tests: the others may never import it

        have = jax.device_count()
        if have < max(wanted):
            pytest.skip(f"needs {max(wanted)} devices, this run has {have}")
    if item.get_closest_marker("needs_tcp") is not None and (reason := no_tcp_reason()) is not None:
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def _client_settings_per_test() -> Iterator[None]:
    """The trainer's settings are read once per process (``trainer_client.config.client_settings``); each test reads
    them from its own environment (``monkeypatch.setenv`` before the first read), not from an earlier test's."""
    reset_client_settings()
    yield
    reset_client_settings()


@pytest.fixture
def ckptd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartServer]:
    """Factory: ``start(root, **settings_overrides) -> ServerHandle``; every server stops at teardown."""
    handles: list[ServerHandle] = []

    def start(root: str | Path, **settings_overrides: Any) -> ServerHandle:
        handle = start_server(root, tmp_path_factory.mktemp("ckptd-state"), **settings_overrides)
        handles.append(handle)
        return handle

    yield start
    for handle in reversed(handles):
        handle.stop()


@pytest.fixture
def tcp_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now; the test is skipped, with the reason, where the
    run has no TCP (a test needing TCP need not be marked to be skipped cleanly there)."""
    if (reason := no_tcp_reason()) is not None:
        pytest.skip(reason)
    return free_port()


__all__ = ["ckptd_server", "gcs_emulator", "tcp_port"]  # gcs_emulator: a fake GCS on 127.0.0.1, once a session
