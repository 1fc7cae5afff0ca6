"""A real ckptd app served by uvicorn on 127.0.0.1 (a free port) in a background thread, or ``ckptd serve`` as a
child process (``serve_process``: for what needs a process of its own, a SIGTERM, a persist worker child).

Either may listen on a unix socket instead (``start_server(..., uds=PATH)``, ``serve_process(..., uds=PATH)``; its
URL is then ``unix:///PATH``), in a directory of ``socket_dir()``: short, so the path fits a socket's, and private.
Where the tests run on unix sockets only (``tests.support.sockets``: device mode, or a machine without TCP) both
listen on a unix socket in a new private directory of their own unless told otherwise.
"""

from __future__ import annotations

import atexit
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from ckptd.api._app import create_app
from ckptd.api._connections import server_config
from ckptd.cli._unix_listener import bind_unix
from ckptd.config import Settings
from tests.support.helpers import REPO, clean_env, free_port, make_settings, wait_until
from tests.support.sockets import unix_sockets_only
from trainer_client.core._ckptd_url import parse_ckptd_url, unix_url


@dataclass
class ServerHandle:
    """A ckptd app served by a real uvicorn.Server on 127.0.0.1 (or a unix socket) in a background thread."""

    url: str
    settings: Settings
    server: uvicorn.Server
    thread: threading.Thread
    socket_dir: Path | None = None  # made for this server (unix sockets only): removed when it stops
    _stopped: bool = field(default=False, repr=False)

    def client(self, **kwargs: Any) -> httpx.Client:
        return http_client(self.url, **kwargs)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.server.should_exit = True
        self.thread.join(timeout=15)
        assert not self.thread.is_alive(), "uvicorn server thread did not stop"
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


class StartServer(Protocol):
    def __call__(self, root: str | Path, **settings_overrides: Any) -> ServerHandle: ...


def app_over(root: str | Path, state_dir: Path, **overrides: Any) -> FastAPI:
    """An app for FastAPI's TestClient over ``root``: its catalog built now, no background threads."""
    from ckptd.catalog._catalog import Catalog
    from trainer_client.core._storage import Storage

    catalog = Catalog(Storage(str(root)), state_dir / "catalog.sqlite3")
    catalog.rebuild()
    return create_app(make_settings(root, state_dir, **overrides), catalog, background=False)


def http_client(url: str, **kwargs: Any) -> httpx.Client:
    """An ``httpx.Client`` of the ckptd at ``url``: ``http://HOST:PORT`` or ``unix:///PATH`` (its socket)."""
    address = parse_ckptd_url(url)
    if address.uds is not None:
        kwargs.setdefault("transport", httpx.HTTPTransport(uds=address.uds))
    return httpx.Client(base_url=address.base_url, **{"timeout": 10.0, **kwargs})


def answers_ready(url: str) -> bool:
    """Whether ``GET /readyz`` of the ckptd at ``url`` answers 200 now."""
    try:
        with http_client(url, timeout=2) as http:
            return http.get("/readyz").status_code == 200
    except httpx.HTTPError:
        return False


def new_socket_dir() -> Path:
    """A new private (0700) directory for a unix socket, with a path short enough for one (pytest's ``tmp_path``
    may not be); the caller removes it."""
    return Path(tempfile.mkdtemp(prefix="ckptd-", dir="/tmp" if Path("/tmp").is_dir() else None))


@contextmanager
def socket_dir() -> Iterator[Path]:
    """``new_socket_dir()``, removed at the end."""
    path = new_socket_dir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def unreachable_url() -> str:
    """The URL of a ckptd that is not there (nothing listens): a free TCP port on 127.0.0.1, or, where the tests
    run on unix sockets only, a socket path that does not exist."""
    if unix_sockets_only():
        return unix_url(str(Path(tempfile.gettempdir()) / f"ckptd-absent-{uuid.uuid4().hex[:16]}.sock"))
    return f"http://127.0.0.1:{free_port()}"


def start_server(root: str | Path, state_dir: Path, **overrides: Any) -> ServerHandle:
    """The app over ``root`` served in a thread, once ``/readyz`` answers 200: on 127.0.0.1 (a free port), or on
    the unix socket ``uds=PATH`` (bound as ``ckptd serve --uds`` binds it) — one in a new directory of its own
    where the tests run on unix sockets only."""
    own_dir = None
    if not overrides.get("uds") and unix_sockets_only():
        own_dir = new_socket_dir()
        overrides["uds"] = str(own_dir / "ckptd.sock")
    if overrides.get("uds"):
        settings = make_settings(root, state_dir, **overrides)
        assert settings.serve.uds is not None
        sock = bind_unix(settings.serve.uds, settings.serve.socket_mode())
        url = unix_url(settings.serve.uds)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))  # bound before uvicorn starts: no race for the port
        port = int(sock.getsockname()[1])
        settings = make_settings(root, state_dir, port=port, **overrides)
        url = f"http://127.0.0.1:{port}"
    app = create_app(settings)
    config = server_config(app, settings, log_level="warning", lifespan="on")  # what `ckptd serve` runs
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="ckptd-test-server",
                              daemon=True)
    thread.start()
    handle = ServerHandle(url, settings, server, thread, socket_dir=own_dir)
    try:
        wait_until(lambda: server.started or not thread.is_alive(), timeout=15, what="uvicorn to start")
        if not server.started:
            sock.close()
            pytest.fail("uvicorn server thread exited before it started")

        wait_until(lambda: answers_ready(handle.url), timeout=15, what="GET /readyz -> 200")
    except BaseException:
        handle.stop()
        raise
    return handle


def serve_process(root: str | Path, log: Path, *args: str, uds: Path | None = None,
                  **env: str) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m ckptd serve --root ROOT`` on 127.0.0.1 (a free port), or on the unix socket ``uds`` (where the
    tests run on unix sockets only: one in a new directory, removed when this process exits), with ``args``, the
    ``CKPTD_*`` variables ``env`` (nothing else of the caller's) and its output in ``log``; returns once
    ``/readyz`` answers 200: the process and its URL (failing the test, with the log's end, when it exits
    first)."""
    if uds is None and unix_sockets_only():
        own_dir = new_socket_dir()
        atexit.register(shutil.rmtree, own_dir, ignore_errors=True)
        uds = own_dir / "ckptd.sock"
    if uds is None:
        port = free_port()
        listen, url = ["--host", "127.0.0.1", "--port", str(port)], f"http://127.0.0.1:{port}"
    else:
        listen, url = ["--uds", str(uds)], unix_url(uds)
    with log.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", str(root), *listen, *args],
                                env=clean_env(**env), stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                cwd=REPO)

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        return answers_ready(url)

    wait_until(ready, timeout=60, what="ckptd ready")
    return proc, url


__all__ = ["ServerHandle", "StartServer", "answers_ready", "app_over", "http_client", "new_socket_dir", "serve_process",
           "socket_dir", "start_server", "unreachable_url"]
