"""A flood of idle connections against a real ``ckptd serve``: the probes and authenticated clients still get in.

Threads hold every connection ckptd allows plus the probes' reserve, sending nothing and reconnecting as soon
as the server closes them (what an attacker without the token can do). Before the connection table gave the
slots of idle connections away (ckptd/api/_connection_table.py), every slot stayed taken: ``/healthz`` answered
``503`` to 8 of 9 probes and ``latest-good`` likewise (256 connections, the default, and 264 sockets), and the
kubelet would have restarted the sidecar.

The flood reconnects at once, so the slots churn (thousands of connects a second here): a newcomer's slot is
given away only after every older idle one, so it is lost only if the whole table turns over before its
request head arrives (256 connects; a probe sends its head within a millisecond of the connect).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ckptd.api._connections import PROBE_CONNECTIONS
from tests.support.chaos_support import CkptdProcess, serving_empty_job
from tests.support.helpers import wait_until
from trainer_client.core import protocol as p

pytestmark = pytest.mark.integration

TOKEN = "idle-flood-token"
MAX_CONNECTIONS = 256  # the default
SOCKETS = MAX_CONNECTIONS + PROBE_CONNECTIONS  # every slot and the whole reserve, as 264 = 256 + 8 at the defaults
ROUNDS = 9


@pytest.fixture
def ckptd(tmp_path: Path) -> Iterator[CkptdProcess]:
    # a short head deadline: the old server closed and the flood reopened its sockets faster, as in the issue
    env = {"CKPTD_TOKEN": TOKEN, "CKPTD_MAX_CONNECTIONS": str(MAX_CONNECTIONS), "CKPTD_HEADER_TIMEOUT_S": "2"}
    with serving_empty_job(tmp_path, env) as proc:
        yield proc


class IdleFlood:
    """``SOCKETS`` threads, each holding one connection that sends nothing, reopened once the server closes it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.connects = 0
        self.held = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._hold, daemon=True) for _ in range(SOCKETS)]

    def _hold(self) -> None:
        while not self.stop.is_set():
            try:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=1)
            except OSError:
                time.sleep(0.01)
                continue
            with self._lock:
                self.connects += 1
                self.held += 1
            with sock:
                while not self.stop.is_set():
                    try:
                        if not sock.recv(4096):
                            break  # closed by the server: reconnect
                    except TimeoutError:
                        continue
                    except OSError:
                        break
            with self._lock:
                self.held -= 1

    def __enter__(self) -> IdleFlood:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=5)


def test_an_idle_flood_keeps_out_neither_the_probes_nor_authenticated_clients(ckptd: CkptdProcess) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    keep = httpx.Limits(keepalive_expiry=120)  # httpx's own default closes a connection idle for 5 s
    with httpx.Client(base_url=ckptd.url, headers=auth, timeout=3, limits=keep) as pooled:
        first = pooled.get("/v1/jobs")  # a client of ckptd, keeping its connection between requests
        assert first.status_code == 200
        pooled_port = first.extensions["network_stream"].get_extra_info("client_addr")[1]
        with IdleFlood(ckptd.port) as flood:
            wait_until(lambda: flood.connects > SOCKETS, timeout=15, what=f"{SOCKETS} idle connections made")
            answers: dict[str, list[int | str]] = {"healthz": [], "readyz": [], "jobs": [], "latest-good": []}
            took: list[float] = []
            for _ in range(ROUNDS):
                for name, path, headers in (("healthz", p.ROUTE_HEALTHZ, {}), ("readyz", p.ROUTE_READYZ, {}),
                                            ("jobs", "/v1/jobs", auth),
                                            ("latest-good", "/v1/jobs/job/latest-good", auth)):
                    started = time.monotonic()
                    try:  # a fresh connection each, as the kubelet's probes come; 3 s, the liveness probe's timeout
                        status: int | str = httpx.get(f"{ckptd.url}{path}", headers=headers, timeout=3).status_code
                    except httpx.HTTPError as exc:
                        status = type(exc).__name__
                    took.append(time.monotonic() - started)
                    answers[name].append(status)
                time.sleep(0.2)
            again = pooled.get("/v1/jobs")  # the authenticated keep-alive connection outlived the flood
            again_port = again.extensions["network_stream"].get_extra_info("client_addr")[1]
            connects = flood.connects
    print(f"{connects} flood connects; answers {answers}; slowest {max(took):.3f} s")
    assert answers["healthz"] == [200] * ROUNDS, answers
    assert answers["readyz"] == [200] * ROUNDS, answers
    assert answers["jobs"] == [200] * ROUNDS, answers
    # the job has no step yet: the app's own answer, not a refusal of the connection
    assert answers["latest-good"] == [404] * ROUNDS, answers
    assert again.status_code == 200
    assert again_port == pooled_port
    assert connects > SOCKETS  # the flood kept reopening what was given away
