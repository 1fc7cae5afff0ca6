"""Shared fixtures: a real ckptd server in a thread, checkpoints written by plain Orbax, polling.

The environment lines come first, before anything can import jax: every test process (and every
subprocess started from it) sees 8 fake CPU devices.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx
import pytest
import uvicorn

from ckptd.api.app import create_app
from ckptd.config import Settings

T = TypeVar("T")

# ---- helpers (plain functions) -------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    probe: Callable[[], T | None], *, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"
) -> T:
    """Call ``probe`` until it returns something truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:.1f}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without any CKPTD_* variable, plus ``extra``; 8 fake CPU devices."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


def make_settings(root: str | Path, state_dir: str | Path, **overrides: Any) -> Settings:
    """Settings with every field pinned, so no CKPTD_* variable of the caller's shell leaks in."""
    values: dict[str, Any] = {
        "root": str(root),
        "host": "127.0.0.1",
        "port": 0,
        "token": None,
        "token_file": None,
        "state_dir": str(state_dir),
        "refresh_interval_s": 0.2,
        "save_timeout_s": 3600.0,
        "log_level": "warning",
        "keep_last": None,
        "keep_every": None,
        "keep_newer_than_s": None,
        "clean_abandoned": True,
        "gc_interval_s": 300.0,
        "adopt_after_s": 0.0,  # tests write plain-Orbax steps and look at once
        "metrics_require_token": False,
        "max_body_bytes": 8 << 20,
        "worker_threads": 8,
    }
    values.update(overrides)
    return Settings(**values)


# The writer runs in its own interpreter: plain Orbax, nothing from ckptd or trainer_client.
_ORBAX_WRITER = r"""
import json, sys
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

spec = json.loads(sys.argv[1])
assert jax.device_count() == 8, jax.device_count()
mesh = jax.make_mesh((4, 2), ("replica", "data"))
for job_dir, steps in spec["jobs"].items():
    mgr = ocp.CheckpointManager(job_dir, options=ocp.CheckpointManagerOptions(max_to_keep=None))
    for step in steps:
        w = jnp.arange(32, dtype=jnp.float32).reshape(4, 8) + step
        state = {"params": {"w": jax.device_put(w, NamedSharding(mesh, P(None, "data")))},
                 "step": jnp.int32(step)}
        custom = spec["custom_metadata"].get(str(step))
        mgr.save(step, args=ocp.args.StandardSave(state), custom_metadata=custom)
    mgr.wait_until_finished()
    mgr.close()
"""


def write_orbax_jobs(
    jobs: Mapping[str | Path, Sequence[int]],
    *,
    custom_metadata: Mapping[int, Mapping[str, Any]] | None = None,
    timeout: float = 120.0,
) -> None:
    """Save steps with plain ``orbax.checkpoint.CheckpointManager`` in a separate process.

    ``jobs`` maps a job directory to the steps to save there (all in one interpreter, so the ~2 s of
    importing jax is paid once). The state is ``{"params": {"w": f32[4, 8]}, "step": i32}`` with ``w``
    sharded ``P(None, "data")`` on the mesh ``("replica", "data") = (4, 2)``; ``custom_metadata[step]``
    becomes that step's Orbax custom metadata.
    """
    spec = {
        "jobs": {str(k): [int(s) for s in v] for k, v in jobs.items()},
        "custom_metadata": {str(k): dict(v) for k, v in (custom_metadata or {}).items()},
    }
    proc = subprocess.run(
        [sys.executable, "-c", _ORBAX_WRITER, json.dumps(spec)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"orbax writer failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")


def write_orbax_steps(
    job_dir: str | Path,
    steps: Sequence[int],
    *,
    custom_metadata: Mapping[int, Mapping[str, Any]] | None = None,
) -> None:
    """``write_orbax_jobs`` for one job directory."""
    write_orbax_jobs({job_dir: steps}, custom_metadata=custom_metadata)


def training_metadata(
    step: int,
    *,
    global_batch: int = 64,
    mesh: tuple[Sequence[str], Sequence[int]] = (("replica", "data"), (4, 2)),
    arrays: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """What trainer_client records under Orbax custom metadata key ``ckptd`` (protocol.TrainingMetadata).

    By default the mesh is ``(replica=4, data=2)`` with ``params.w`` sharded ``P(None, "data")`` and
    ``opt.mu`` sharded ``P("replica", "data")``, both f32[4, 8].
    """
    if arrays is None:
        arrays = {
            "params.w": {"shape": [4, 8], "dtype": "float32", "partition_spec": [None, "data"]},
            "opt.mu": {"shape": [4, 8], "dtype": "float32", "partition_spec": ["replica", "data"]},
        }
    return {
        "ckptd": {
            "step": step,
            "data_position": step * global_batch,
            "global_batch": global_batch,
            "mesh": {"axis_names": list(mesh[0]), "shape": list(mesh[1])},
            "slices": [0, 1, 2, 3],
            "wall_time": 1_700_000_000.0 + step,
            "arrays": {k: dict(v) for k, v in arrays.items()},
        }
    }


# A saved layout with a model-parallel axis: (data=2, model=4); it cannot run on fewer than 4 devices.
MODEL_PARALLEL_MESH: tuple[tuple[str, ...], tuple[int, ...]] = (("data", "model"), (2, 4))
MODEL_PARALLEL_ARRAYS: dict[str, dict[str, Any]] = {
    "params.w": {"shape": [8, 16], "dtype": "float32", "partition_spec": ["data", "model"]},
}


# ---- the server in a thread ----------------------------------------------------------------------


@dataclass
class ServerHandle:
    """A ckptd app served by a real uvicorn.Server on 127.0.0.1 in a background thread."""

    url: str
    settings: Settings
    server: uvicorn.Server
    thread: threading.Thread
    _stopped: bool = field(default=False, repr=False)

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10.0, **kwargs)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.server.should_exit = True
        self.thread.join(timeout=15)
        assert not self.thread.is_alive(), "uvicorn server thread did not stop"


class StartServer(Protocol):
    def __call__(self, root: str | Path, **settings_overrides: Any) -> ServerHandle: ...


def _start_server(root: str | Path, state_dir: Path, **overrides: Any) -> ServerHandle:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # bound before uvicorn starts: no race for the port
    port = int(sock.getsockname()[1])
    settings = make_settings(root, state_dir, port=port, **overrides)
    app = create_app(settings)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="ckptd-test-server",
                              daemon=True)
    thread.start()
    handle = ServerHandle(f"http://127.0.0.1:{port}", settings, server, thread)
    try:
        wait_until(lambda: server.started or not thread.is_alive(), timeout=15, what="uvicorn to start")
        if not server.started:
            sock.close()
            pytest.fail("uvicorn server thread exited before it started")

        def ready() -> bool:
            try:
                return httpx.get(f"{handle.url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=15, what="GET /readyz -> 200")
    except BaseException:
        handle.stop()
        raise
    return handle


@pytest.fixture
def ckptd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartServer]:
    """Factory: ``start(root, **settings_overrides) -> ServerHandle``; every server stops at teardown."""
    handles: list[ServerHandle] = []

    def start(root: str | Path, **settings_overrides: Any) -> ServerHandle:
        handle = _start_server(root, tmp_path_factory.mktemp("ckptd-state"), **settings_overrides)
        handles.append(handle)
        return handle

    yield start
    for handle in reversed(handles):
        handle.stop()


# ---- the helpers as fixtures (usable from module- and session-scoped fixtures) -------------------


@pytest.fixture(scope="session")
def orbax_writer() -> Callable[..., None]:
    """``write_orbax_steps(job_dir, steps, *, custom_metadata=None)``."""
    return write_orbax_steps


@pytest.fixture(scope="session")
def orbax_jobs_writer() -> Callable[..., None]:
    """``write_orbax_jobs({job_dir: steps, ...}, *, custom_metadata=None)``."""
    return write_orbax_jobs


@pytest.fixture(scope="session")
def poll() -> Callable[..., Any]:
    """``wait_until(probe, timeout=..., what=...)``: poll with a deadline, never a bare sleep."""
    return wait_until


@pytest.fixture(scope="session")
def settings_factory() -> Callable[..., Settings]:
    """``make_settings(root, state_dir, **overrides)``: Settings with every field pinned."""
    return make_settings


@pytest.fixture(scope="session")
def training_metadata_factory() -> Callable[..., dict[str, Any]]:
    """``training_metadata(step)``: Orbax custom metadata as trainer_client records it."""
    return training_metadata


@pytest.fixture(scope="session")
def model_parallel_metadata() -> Callable[[int], dict[str, Any]]:
    """``training_metadata(step)`` for a job saved on ``(data=2, model=4)``."""
    return lambda step: training_metadata(step, mesh=MODEL_PARALLEL_MESH, arrays=MODEL_PARALLEL_ARRAYS)


@pytest.fixture(scope="session")
def subprocess_env() -> Callable[..., dict[str, str]]:
    """``clean_env(**extra)``: os.environ without CKPTD_*, plus ``extra``."""
    return clean_env


@pytest.fixture
def tcp_port() -> int:
    return free_port()
