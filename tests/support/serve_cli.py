"""``ckptd serve`` as a user starts it: a subprocess, its log in a file, used once it answers, stopped at the end."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.support.helpers import stop_process, wait_until


@contextmanager
def served(args: list[str], port: int, env: dict[str, str], log: Path, *, route: str = "/healthz",
           timeout: float = 60) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m ckptd serve ARGS --port PORT`` with ``env``, its output in ``log``, once ``route`` answers 200
    (the test fails, showing the log, if it exits first); SIGTERM (then SIGKILL) at the end."""
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", *args, "--port", str(port)], env=env,
                                stdout=sink, stderr=subprocess.STDOUT)
    try:
        def ready() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{port}{route}", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=timeout, what=f"ckptd serve to answer {route}")
        yield proc
    finally:
        assert stop_process(proc, 15)


__all__ = ["served"]
