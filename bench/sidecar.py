"""A ``ckptd serve`` for the benchmark families that need a real sidecar: on TCP, or on a unix socket.

Why it exists: the recovery families (bench/recovery.py on CPU devices, bench/device_profile.py on whatever
device jax has) each run one sidecar for their children to ask; the device profile must run where no TCP socket
can be made at all (the lent chip's sandbox), so the same start-up takes a unix socket too. No jax here: the
parent of those families never loads it (on a chip, a process that does holds the device).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.common import stop_process
from trainer_client.client._http import ckptd_http
from trainer_client.config import ClientSettings
from trainer_client.core._ckptd_url import unix_url


def start_ckptd(root: Path, state: Path, shm: Path, env: dict[str, str], log: Path, *,
                uds: Path | None = None, timeout_s: float = 60.0) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m ckptd serve`` over ``root`` (its own state in ``state``, the memory tier in ``shm``) on a free
    port of 127.0.0.1, or with ``uds`` on that unix socket (a machine with no TCP at all: the lent chip's), in the
    environment ``env``, its output in ``log``. Returns once ``/readyz`` answers 200: the process and the URL its
    clients take (``http://127.0.0.1:PORT`` or ``unix:///PATH``)."""
    if uds is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        listen, url = ["--host", "127.0.0.1", "--port", str(port)], f"http://127.0.0.1:{port}"
    else:
        listen, url = ["--uds", str(uds)], unix_url(str(uds))
    with log.open("ab") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", str(root), *listen, "--state-dir",
                                 str(state), "--shm-dir", str(shm)], env=env, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    with ckptd_http(ClientSettings(url=url, token=None, timeout_s=1.0)) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"ckptd exited ({proc.returncode}): {log.read_text(errors='replace')[-2000:]}")
            try:
                if http.get("/readyz").status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    stop_process(proc, 5)
    raise RuntimeError(f"ckptd did not become ready in {timeout_s:.0f} s: {log.read_text(errors='replace')[-2000:]}")


__all__ = ["start_ckptd"]
