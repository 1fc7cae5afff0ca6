"""What the chaos, load and fault tests share: sizes, seeds, a ckptd process to kill, a deterministic state.

Sizes: every chaos/load test runs in a short form in CI (``make test``) and in a long form under the
``chaos`` marker (``make chaos``); ``sized(short, long)`` parametrizes a test with both, the long one
marked ``chaos`` and ``slow`` so ``-m "not slow"`` leaves it out.

Seeds: ``chaos_rng(name)`` is a ``random.Random`` seeded from ``CHAOS_SEED`` (default: a fixed seed per
test, so CI is reproducible; ``CHAOS_SEED=random`` draws one) and prints the seed, so a failing run can
be replayed exactly.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support.helpers import REPO, clean_env, free_port, stop_process

LONG_FORM = (pytest.mark.chaos, pytest.mark.slow)  # the marks of a long form


def sized(short: Any, long: Any, *, name: str = "size") -> pytest.MarkDecorator:
    """Parametrize ``name`` with a short form (CI) and a long form (``make chaos``)."""
    return pytest.mark.parametrize(
        name, [pytest.param(short, id="short"), pytest.param(long, id="long", marks=LONG_FORM)]
    )


def chaos_rng(name: str) -> random.Random:
    """A seeded RNG for one test: ``CHAOS_SEED`` (an integer or ``random``), else a fixed seed per name."""
    env = os.environ.get("CHAOS_SEED", "")
    if env == "random":
        seed = random.SystemRandom().randrange(2**32)
    elif env:
        seed = int(env)
    else:
        seed = zlib.crc32(name.encode())
    print(f"[chaos] {name}: seed {seed} (replay with CHAOS_SEED={seed})")
    return random.Random(seed)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` (nearest rank); NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


# ---- the deterministic training state of the kill tests -------------------------------------------

BATCH = 8


def state_for_step(step: int) -> dict[str, np.ndarray]:
    """The state a trainer holds after ``step`` steps: a pure function of the step, ~3 MiB, incompressible
    (so a save takes long enough for a kill to land anywhere in it)."""
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((512, 1024), dtype=np.float32),
        "v": rng.standard_normal((256, 512), dtype=np.float32) + np.float32(step),
        "n": np.arange(64, dtype=np.int32) * 7 + np.int32(step),
    }


# ---- a ckptd server process that can be SIGKILLed and restarted on the same port --------------------


class CkptdProcess:
    """``python -m ckptd serve`` as a child process on a fixed port: start, ``kill -9``, start again."""

    def __init__(
        self,
        root: str | Path,
        state_dir: Path,
        *,
        port: int | None = None,
        log_path: Path,
        env: dict[str, str] | None = None,
        refresh_interval_s: float = 0.2,
    ) -> None:
        self.root = str(root)
        self.state_dir = state_dir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.env = clean_env(
            **{"CKPTD_REFRESH_INTERVAL_S": str(refresh_interval_s), "CKPTD_LOG_LEVEL": "warning", **(env or {})}
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.kills = 0

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ckptd",
                    "serve",
                    "--root",
                    self.root,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--state-dir",
                    str(self.state_dir),
                ],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        self.starts += 1

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, the catalog is left as it was."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.kills += 1

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 30.0) -> float:
        """Seconds until ``/readyz`` answers 200; fails the test after ``timeout``."""
        started = time.monotonic()
        while not self.ready():
            if self.proc is not None and self.proc.poll() is not None:
                pytest.fail(f"ckptd exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() - started > timeout:
                pytest.fail(f"ckptd not ready after {timeout}s:\n{self.log()}")
            time.sleep(0.05)
        return time.monotonic() - started

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


@contextmanager
def serving_empty_job(tmp_path: Path, env: dict[str, str]) -> Iterator[CkptdProcess]:
    """``ckptd serve`` with ``env`` over a root in ``tmp_path`` holding one job without steps (``job``), ready;
    stopped after."""
    (tmp_path / "root" / "job").mkdir(parents=True)
    proc = CkptdProcess(tmp_path / "root", tmp_path / "state", log_path=tmp_path / "ckptd.log", env=env)
    proc.start()
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


__all__ = [
    "BATCH",
    "LONG_FORM",
    "CkptdProcess",
    "chaos_rng",
    "percentile",
    "serving_empty_job",
    "sized",
    "state_for_step",
]
