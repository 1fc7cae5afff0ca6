"""A bucket that behaves like GCS under load, for the tests: an asyncio HTTP proxy on 127.0.0.1 in front of the
GCS emulator (``tests/support/gcs_emulator.py``) that enforces ``tests/support/gcs_shaping.py``'s rules: per
bucket a write rate and a read rate with GCS's ramp, one write a second per object name, ``429``/``503`` past
them, every request and every refusal counted.

``with GcsShaper(emulator.url, Limits()) as shaper:`` then point gcsfs and tensorstore at ``shaper.url``
(``shaped_env``: ``STORAGE_EMULATOR_HOST``, ``TENSORSTORE_GCS_HTTP_URL``). A shaper can listen on several
*doors* (``doors=("hosts", "leader")``: one port each, ``shaper.urls[door]``), all in front of the same
bucket and its limits, each counted apart (``door:<name>:requests``): the clients of one role go through
one door, so a test counts what each role asked without telling clients apart otherwise.

A resumable upload's URL, which the emulator builds on its own address, is pointed back at the door it came
through (as ``tests/support/fault_proxy.py`` does), so its later requests are shaped and counted too. Nothing
is refused after it was forwarded: a refusal is never ambiguous (the fault proxy injects those).

Run on its own (``python -m tests.support.gcs_shaper UPSTREAM [--doors hosts,leader] [--write-per-s N] ...``) it
prints one JSON line with the doors' URLs and serves until its stdin closes; ``GET /_shaper/stats`` on any door
answers the counts (``BucketRules.snapshot``), ``POST /_shaper/reset`` forgets them. The clock is injectable
(``clock=``), so the ramp can be tested without waiting 20 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from tests.support.gcs_shaping import BucketRules, Clock, Limits, classify, gcs_error

# Headers that belong to one hop, never forwarded as they are (aiohttp sets its own).
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
               "content-length", "expect", "host"}
_URL_HEADERS = {"location", "content-location", "x-goog-upload-url"}
_MAX_BODY = 1 << 31


def shaped_env(url: str) -> dict[str, str]:
    """The variables that send gcsfs and tensorstore (so Orbax) through the shaper at ``url``."""
    return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url}


class GcsShaper:
    """The proxy, on an event loop of its own in a thread (``start``/``stop``, or ``with``)."""

    def __init__(self, upstream: str, limits: Limits | None = None, *, doors: Sequence[str] = ("main",),
                 clock: Clock = time.monotonic, seed: int = 0, keep_log: bool = False) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or parts.port is None:
            raise ValueError(f"upstream must be http://host:port, not {upstream!r}")
        self.upstream = upstream.rstrip("/")
        self._upstream_netloc = parts.netloc.lower()
        self.rules = BucketRules(limits or Limits(), clock=clock, seed=seed, keep_log=keep_log)
        self.doors = tuple(doors)
        self.urls: dict[str, str] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gcs-shaper", daemon=True)
        self._runners: list[web.AppRunner] = []
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        """The first door's URL."""
        return self.urls[self.doors[0]]

    def stats(self) -> dict[str, int]:
        return dict(self.rules.snapshot()["stats"])

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> GcsShaper:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(timeout=30)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> GcsShaper:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    async def _open(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                              timeout=aiohttp.ClientTimeout(total=300))
        for door in self.doors:
            app = web.Application(client_max_size=_MAX_BODY)
            app.router.add_route("*", "/{tail:.*}", self._handler(door))
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
            await site.start()
            server = site._server
            assert isinstance(server, asyncio.base_events.Server)
            port = server.sockets[0].getsockname()[1]
            self.urls[door] = f"http://127.0.0.1:{port}"
            self._runners.append(runner)

    async def _close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ---- one request -----------------------------------------------------------------------------

    def _to_door(self, value: str, door: str) -> str:
        """``value`` with the upstream's ``http://host:port`` replaced by ``door``'s (any other URL as it is)."""
        parts = urlsplit(value)
        if parts.scheme != "http" or parts.netloc.lower() != self._upstream_netloc:
            return value
        return urlunsplit(parts._replace(netloc=urlsplit(self.urls[door]).netloc))

    def _handler(self, door: str) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            if request.path.startswith("/_shaper/"):
                return self._control(request)
            body = await request.read()
            target = request.raw_path
            op = classify(request.method, target, body, self.rules.uploads)
            refusal = self.rules.admit(op, door)
            if refusal is not None:
                self.rules.note(door, request.method, target, refusal.status)
                return web.Response(status=refusal.status, body=gcs_error(refusal),
                                    headers={"Content-Type": "application/json; charset=UTF-8"})
            headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP)
            assert self._session is not None
            try:
                async with self._session.request(
                        request.method, URL(self.upstream + target, encoded=True), headers=headers,
                        data=body if body or request.method in ("POST", "PUT", "PATCH") else None,
                        allow_redirects=False, skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept",
                                                                  "Content-Type")) as answer:
                    data = await answer.read()
                    status, answered = answer.status, answer.headers
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.rules.finished(op, 502)
                self.rules.count("upstream_error")
                return web.Response(status=502, text=str(exc))
            out = CIMultiDict((k, self._to_door(v, door) if k.lower() in _URL_HEADERS else v)
                              for k, v in answered.items() if k.lower() not in _HOP_BY_HOP)
            self.rules.finished(op, status, answered.get("Location"), request.method)
            self.rules.note(door, request.method, target, status)
            return web.Response(status=status, body=data if request.method != "HEAD" else None, headers=out)

        return handle

    def _control(self, request: web.Request) -> web.Response:
        if request.path == "/_shaper/stats" and request.method == "GET":
            return web.json_response(self.rules.snapshot())
        if request.path == "/_shaper/log" and request.method == "GET":
            return web.json_response(self.rules.log or [])
        if request.path == "/_shaper/reset" and request.method == "POST":
            self.rules.reset()
            return web.json_response({"ok": True})
        return web.Response(status=404, text="no such control")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("upstream", help="the emulator's URL, http://127.0.0.1:PORT")
    parser.add_argument("--doors", default="main", help="comma-separated door names (one port each)")
    defaults = Limits()
    parser.add_argument("--write-per-s", type=float, default=defaults.write_per_s)
    parser.add_argument("--read-per-s", type=float, default=defaults.read_per_s)
    parser.add_argument("--burst-s", type=float, default=defaults.burst_s)
    parser.add_argument("--share-503", type=float, default=defaults.share_503)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", action="store_true", help="keep every request's line (GET /_shaper/log)")
    args = parser.parse_args(argv)
    limits = Limits(write_per_s=args.write_per_s, read_per_s=args.read_per_s, burst_s=args.burst_s,
                    share_503=args.share_503)
    with GcsShaper(args.upstream, limits, doors=args.doors.split(","), seed=args.seed,
                   keep_log=args.log) as shaper:
        print(json.dumps({"urls": shaper.urls}), flush=True)
        for _ in sys.stdin:  # serves until the parent closes our stdin (or dies)
            pass
    return 0


__all__ = ["GcsShaper", "shaped_env"]

if __name__ == "__main__":
    raise SystemExit(main())
