"""Headless Chromium for the dashboard test (tests/server/api/test_dashboard.py): what a browser really shows.

Two ways in. ``run_chromium`` is the plain command line (``--dump-dom``, ``--screenshot``). ``Browser`` speaks
the DevTools protocol over ``--remote-debugging-pipe`` (NUL-separated JSON on file descriptors 3 and 4, so
no websocket library is needed): it sets the viewport (800 px wide, say), waits for the page to settle,
evaluates JavaScript that measures the laid-out page (rectangles, computed colours, scroll width) and
saves screenshots. Debian's ``chromium`` is used; ``.ci/run`` installs it and sets ``REQUIRE_CHROMIUM``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars")

_ON_FDS_3_AND_4 = ("import os, sys; os.dup2(int(sys.argv[1]), 3, inheritable=True); "
                   "os.dup2(int(sys.argv[2]), 4, inheritable=True); os.execv(sys.argv[3], sys.argv[3:])")


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("REQUIRE_CHROMIUM") or os.environ.get("CI"):
            pytest.fail("chromium is not installed; .ci/run installs it (apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium); CI installs it")
    return found


def run_chromium(url: str, profile: Path, *extra: str) -> str:
    """One page load on the command line (``--dump-dom``: its DOM after the scripts ran, on stdout)."""
    cmd = [chromium(), *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=6000", *extra, url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


class Browser:
    """A headless Chromium driven over the DevTools pipe; one page (tab) at a time."""

    def __init__(self, profile: Path, *, timeout: float = 30.0) -> None:
        self.timeout = timeout
        profile.mkdir(parents=True, exist_ok=True)
        self.log = profile / "chromium.log"  # stderr to a file: a pipe nobody reads could fill and stall it
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # Chromium reads commands on fd 3 and writes answers on fd 4: a small exec wrapper puts the pipes there.
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _ON_FDS_3_AND_4, str(to_browser_r), str(from_browser_w), chromium(), *FLAGS,
                 "--remote-debugging-pipe", f"--user-data-dir={profile}", "about:blank"],
                pass_fds=(to_browser_r, from_browser_w), stdout=subprocess.DEVNULL, stderr=log)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.session: str | None = None

    # ---- the protocol ------------------------------------------------------------------------------

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError("no answer from chromium")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium exited: {self.log.read_text(errors='replace')[-2000:]}")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message

    def send(self, method: str, params: dict[str, Any] | None = None, *, browser: bool = False) -> dict[str, Any]:
        """A command to the page (or to the browser itself); its result, events in between are dropped."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if not browser and self.session is not None:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            answer = self._read_message(deadline)
            if answer.get("id") == self._next_id:
                assert "error" not in answer, (method, answer["error"])
                result: dict[str, Any] = answer.get("result", {})
                return result

    # ---- pages ---------------------------------------------------------------------------------------

    def open(self, url: str, *, width: int, height: int) -> None:
        """A new tab ``width`` x ``height`` CSS pixels wide that loads ``url``."""
        target = self.send("Target.createTarget", {"url": "about:blank"}, browser=True)["targetId"]
        attached = self.send("Target.attachToTarget", {"targetId": target, "flatten": True}, browser=True)
        self.session = attached["sessionId"]
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        self.send("Page.enable")
        self.send("Page.navigate", {"url": url})

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        answer = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        assert "exceptionDetails" not in answer, answer["exceptionDetails"]
        return answer["result"].get("value")

    def wait_for(self, expression: str, *, timeout: float = 20.0) -> Any:
        """Poll ``expression`` until it is truthy (the page's data arrived and was drawn); while the page
        is still loading, an expression that throws counts as not yet."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(f"(() => {{ try {{ return ({expression}); }} catch (e) {{ return null; }} }})()")
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {expression!r}: {value!r}")
            time.sleep(0.1)

    def screenshot(self, path: Path, *, full_page: bool = True) -> Path:
        """The page as a PNG (the whole page, not only the viewport, unless ``full_page`` is False)."""
        answer = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": full_page})
        path.write_bytes(base64.b64decode(answer["data"]))
        return path

    def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError, TimeoutError):  # it may exit before it answers
            self.send("Browser.close", browser=True)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for fd in (self._to_browser, self._from_browser):
            os.close(fd)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


__all__ = ["FLAGS", "Browser", "chromium", "run_chromium"]
