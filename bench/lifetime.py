"""What a benchmark run leaves behind: nothing, however it ends.

A run (``python -m bench.run``) owns two directories, one on disk and one in shared memory, named
``ckptd-bench-<token>-work`` and ``ckptd-bench-<token>-shm`` (the token: the run's pid and a random part),
each holding an owner record (``.ckptd-bench-owner.json``: the run's pid, that process's start time and the
token). Every process the run starts, and every process those start, carries
``BENCH_RUN_TOKEN=<token>`` in its environment (set in ``os.environ`` before any family runs; the families hand
their children this environment, never a clean one, and ckptd hands it to its persist worker), so what the run
started can be found in ``/proc`` without knowing who started it or who its parent is now.

Three things remove them:

* each family, when it ends (success, failure or interrupt), in ``bench.run``: its processes still running are
  stopped (:func:`stop_marked`) and its directories removed;
* the reaper (``python -m bench.lifetime``, started by the run in a session of its own and without the token):
  it waits for the run's process to end, however it ends (``SIGKILL`` and the OOM killer included), then stops
  every process carrying the token and removes the run's directories;
* the next run's start-up sweep (:func:`sweep_stale`): a ``ckptd-bench-*`` directory whose owner record names
  a process that is gone (no such pid, or a pid reused by a process started at another time) is removed, and
  its processes stopped. A directory whose owner is alive is never touched, nor one without an owner record
  (an older run's format, or a run between creating its directory and writing the record): those are named
  on the console, not removed.

Stdlib only: the reaper must start in milliseconds, and ``bench.run`` sweeps before anything imports jax.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any

TOKEN_ENV = "BENCH_RUN_TOKEN"
PREFIX = "ckptd-bench-"
OWNER = ".ckptd-bench-owner.json"
GRACE_S = 10.0  # how long a leftover process has between SIGTERM and SIGKILL


def new_token() -> str:
    """A run's token: its pid and 8 random hex digits (the pid makes a directory's owner readable at a glance)."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22); None when there is
    no such process or it is a zombie (it holds nothing any more)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    rest = raw[raw.rfind(b")") + 2:].split()  # the command name may hold spaces and parentheses
    if not rest or rest[0] == b"Z":
        return None
    return int(rest[19])


def owner_alive(record: dict[str, Any]) -> bool:
    """Whether the process an owner record names still runs (the same pid started at the same time)."""
    pid, ticks = record.get("pid"), record.get("start_ticks")
    if not isinstance(pid, int):
        return False
    now = start_ticks(pid)
    return now is not None and (ticks is None or now == ticks)


def make_run_dir(parent: Path, token: str, kind: str) -> Path:
    """``parent/ckptd-bench-<token>-<kind>``, private to this user, with this process's owner record in it
    (``kind``: ``work`` or ``shm``, so that both may share a parent)."""
    parent.mkdir(parents=True, exist_ok=True)
    path = parent / f"{PREFIX}{token}-{kind}"
    path.mkdir(mode=0o700)
    record = {"pid": os.getpid(), "start_ticks": start_ticks(os.getpid()), "token": token}
    tmp = path / f"{OWNER}.tmp"
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path / OWNER)
    return path


def read_owner(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((path / OWNER).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def marked_processes(token: str) -> list[int]:
    """Every live process (this one aside) whose environment carries ``BENCH_RUN_TOKEN=<token>``."""
    needle = f"{TOKEN_ENV}={token}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop_marked(token: str, grace_s: float = GRACE_S) -> list[int]:
    """Stop every process carrying ``token``: SIGTERM, then SIGKILL whatever still runs after ``grace_s``
    seconds (a zombie counts as stopped: it holds nothing, and its parent collects it). Returns the pids found.
    A process that starts another while being stopped is found on the next pass (up to three)."""
    stopped: list[int] = []
    for _ in range(3):
        pids = [p for p in marked_processes(token) if p not in stopped]
        if not pids:
            break
        stopped += pids
        _signal_all(pids, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(start_ticks(p) is not None for p in pids):
            time.sleep(0.05)
        _signal_all([p for p in pids if start_ticks(p) is not None], signal.SIGKILL)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(start_ticks(p) is not None for p in pids):
            time.sleep(0.05)
    return stopped


def sweep_stale(parents: Iterable[Path], log: bool = True) -> list[Path]:
    """Remove the ``ckptd-bench-*`` directories under ``parents`` whose owner is gone, after stopping the
    processes that carry its token. Returns what was removed; a directory without an owner record, or whose
    owner still runs, is left (the former is named on the console)."""
    removed: list[Path] = []
    for parent in parents:
        try:
            entries = sorted(p for p in parent.iterdir() if p.name.startswith(PREFIX) and p.is_dir())
        except OSError:
            continue
        for path in entries:
            record = read_owner(path)
            if record is None:
                if log:
                    print(f"left alone: {path} (no owner record: an older run's, or one starting now)", flush=True)
                continue
            if owner_alive(record):
                continue
            token = record.get("token")
            if isinstance(token, str) and token:
                stop_marked(token)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            if log:
                print(f"removed {path}: left by run {token} (pid {record.get('pid')}, gone)", flush=True)
    return removed


def start_reaper(token: str, dirs: list[Path]) -> subprocess.Popen[bytes]:
    """Start the reaper of this run: it outlives this process by as long as it takes to stop what carries
    ``token`` and remove ``dirs``. Its command line names neither (they come on its standard input), and its
    environment lacks the token (it is not one of the run's processes)."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "bench.lifetime", str(os.getpid())], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, env=env, start_new_session=True,
                            cwd=Path(__file__).resolve().parent.parent)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps({"token": token, "dirs": [str(d) for d in dirs]}).encode() + b"\n")
    proc.stdin.close()
    return proc


def _wait_for_exit(pid: int) -> None:
    """Return once process ``pid`` (this one's parent when called) has ended."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None and os.getppid() == pid:  # the pidfd names the parent, not a later holder of its pid
        try:
            select.select([fd], [], [])
        finally:
            os.close(fd)
        return
    while os.getppid() == pid:  # an orphan is adopted by another process: that is the parent's end
        time.sleep(0.5)


def reap(parent: int, token: str, dirs: list[str]) -> None:
    """The reaper's work: once ``parent`` has ended, stop its run's processes and remove its directories."""
    _wait_for_exit(parent)
    stop_marked(token)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


class Interrupted(SystemExit):
    """SIGTERM or SIGHUP of the run: unwinds it like Ctrl-C does, so every family's ``finally`` runs."""


_interrupted: list[int] = []  # the exit status a signal asked for, once one came


def check_interrupted() -> None:
    """Raise the ``Interrupted`` a signal asked for, if one came: the handler's own raise can be swallowed when
    the signal lands inside a callback whose exceptions Python ignores (a garbage-collection callback of
    jax's did so), and the run must still end at its next check."""
    if _interrupted:
        raise Interrupted(_interrupted[0])


def raise_on_termination() -> None:
    """SIGTERM, SIGHUP and SIGINT end the run through its ``finally`` blocks (exit status 128 + the signal);
    while it cleans up, further ones are ignored (the reaper finishes what an impatient kill cuts short). The
    status is also kept for ``check_interrupted``."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        print(f"\n{signal.Signals(signum).name}: stopping the run's processes and removing its directories",
              flush=True)
        _interrupted.append(128 + signum)
        raise Interrupted(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, handler)


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGHUP):  # only the parent's end ends the reaper's wait
        signal.signal(sig, signal.SIG_IGN)
    config = json.loads(sys.stdin.readline())
    reap(int(argv[0]), config["token"], list(config["dirs"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
