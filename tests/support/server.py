"""A real ckptd app served by uvicorn on 127.0.0.1 (a free port) in a background thread, or ``ckptd serve`` as a
child process (``serve_process``: for what needs a process of its own, a SIGTERM, a persist worker child)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from ckptd.api._app import create_app
from ckptd.api._connections import server_config
from ckptd.config import Settings
from tests.support.helpers import REPO, clean_env, free_port, make_settings, wait_until


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


def app_over(root: str | Path, state_dir: Path, **overrides: Any) -> FastAPI:
    """An app for FastAPI's TestClient over ``root``: its catalog built now, no background threads."""
    from ckptd.catalog._catalog import Catalog
    from trainer_client.core._storage import Storage

    catalog = Catalog(Storage(str(root)), state_dir / "catalog.sqlite3")
    catalog.rebuild()
    return create_app(make_settings(root, state_dir, **overrides), catalog, background=False)


def start_server(root: str | Path, state_dir: Path, **overrides: Any) -> ServerHandle:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # bound before uvicorn starts: no race for the port
    port = int(sock.getsockname()[1])
    settings = make_settings(root, state_dir, port=port, **overrides)
    app = create_app(settings)
    config = server_config(app, settings, log_level="warning", lifespan="on")  # what `ckptd serve` runs
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


def serve_process(root: str | Path, log: Path, *args: str, **env: str) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m ckptd serve --root ROOT`` on 127.0.0.1 (a free port) with ``args``, the ``CKPTD_*`` variables
    ``env`` (nothing else of the caller's) and its output in ``log``; returns once ``/readyz`` answers 200:
    the process and its URL (failing the test, with the log's end, when it exits first)."""
    port = free_port()
    with log.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", str(root), "--host", "127.0.0.1",
                                 "--port", str(port), *args], env=clean_env(**env), stdin=subprocess.DEVNULL,
                                stdout=sink, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, timeout=60, what="ckptd ready")
    return proc, url


__all__ = ["ServerHandle", "StartServer", "app_over", "serve_process", "start_server"]
