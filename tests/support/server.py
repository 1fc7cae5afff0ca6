"""A real ckptd app served by uvicorn on 127.0.0.1 (a free port) in a background thread."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from ckptd.api.app import create_app
from ckptd.api.connections import server_config
from ckptd.config import Settings
from tests.support.helpers import make_settings, wait_until


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
    from ckptd.catalog.catalog import Catalog
    from trainer_client.core.storage import Storage

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


__all__ = ["ServerHandle", "StartServer", "app_over", "start_server"]
