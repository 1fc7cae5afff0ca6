"""Storage that cannot answer is one line, fast: ``ckptd ls gs://bucket/x`` without credentials or network once sat
silent for ~50 s and printed 54 lines of gcsfs and aiohttp tracebacks ending in "is not a directory".

Against the GCS emulator (``tests/support/gcs_emulator.py``): a missing bucket is one line naming it; an endpoint that
refuses every connection (a closed port on 127.0.0.1, which gcsfs retries six times over ~30 s) is one line within
``CKPTD_STORAGE_TIMEOUT_S``, naming the network; on a terminal the wait shows while it lasts. Each is the installed
command in a subprocess.
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios
import time

import pytest

from tests.support.gcs_emulator import GcsEmulator, emulator_env
from tests.support.helpers import clean_env, free_port

pytestmark = pytest.mark.integration

BOUND_S = 3.0  # CKPTD_STORAGE_TIMEOUT_S of these runs
START_S = 20.0  # what starting the interpreter and importing the command may take on a loaded machine


def _ckptd(env: dict[str, str], *argv: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ckptd", *argv], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    return done, time.monotonic() - started


def test_a_missing_bucket_is_one_line_naming_it(gcs_emulator: GcsEmulator) -> None:
    env = clean_env(**gcs_emulator.env)
    for command in (["ls", "gs://no-such-bucket/x"], ["show", "gs://no-such-bucket/x/job"]):
        done, _ = _ckptd(env, *command)
        assert done.returncode == 1, done.stderr
        assert done.stderr.splitlines() == [
            f"ckptd: {command[1].removesuffix('/job')}: no bucket 'no-such-bucket' (or these credentials may not "
            "see it)"], done.stderr
    done, _ = _ckptd(env, "ls", gcs_emulator.gs("nothing-here"))  # the bucket is there, the prefix is not
    assert (done.returncode, done.stderr) == (1, f"ckptd: {gcs_emulator.gs('nothing-here')} does not exist\n")


def _closed_endpoint_env() -> dict[str, str]:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there: every connection is refused
    return clean_env(**emulator_env(closed), CKPTD_STORAGE_TIMEOUT_S=str(BOUND_S))


def test_an_unreachable_endpoint_is_one_line_within_the_bound() -> None:
    done, took = _ckptd(_closed_endpoint_env(), "ls", "gs://bucket/x")
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"ckptd: gs://bucket/x: storage did not answer within {BOUND_S:g} s; last error: "
                               "network: Cannot connect to host 127.0.0.1:"), lines
    assert lines[0].endswith("(CKPTD_STORAGE_TIMEOUT_S sets the wait)")
    assert BOUND_S <= took < BOUND_S + START_S, took  # gcsfs alone retries for ~30 s


def test_the_wait_shows_on_a_terminal() -> None:
    """stderr a terminal (a pty): the seconds waited and the error being retried show while it waits; then the one
    line."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a terminal's size: tqdm fits it
    try:
        proc = subprocess.Popen([sys.executable, "-m", "ckptd", "ls", "gs://bucket/x"], env=_closed_endpoint_env(),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave)
        os.close(slave)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the child closed its end: all read
                break
            if not chunk:
                break
            seen += chunk
        assert proc.wait(timeout=60) == 1
    finally:
        os.close(master)
    text = seen.decode(errors="replace")
    assert re.search(r"\rwaiting for gs://bucket/x: \d/3 s, retrying: Cannot connect to host", text), text
    last = text.rstrip().rsplit("\r", 1)[-1]  # the wait, cleared (tqdm's escape sequence), then the one line
    assert last.lstrip("\x1b[A\n").startswith("ckptd: gs://bucket/x: storage did not answer"), text
    assert last.endswith("(CKPTD_STORAGE_TIMEOUT_S sets the wait)"), text
