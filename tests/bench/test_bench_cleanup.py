"""A benchmark run leaves no process and no directory behind, however it ends (bench/lifetime.py, bench/run.py).

Each kill test starts ``python -m bench.run --profile toy --only peers`` (two ``ckptd serve`` sidecars with
their shared-memory directories, then the 2-process job) and kills it once a sidecar of that run is up and the
family's shared-memory directory is there: with SIGTERM (the run cleans up itself), with SIGKILL (its reaper
does), and with SIGKILL of the run and of its reaper (the next run's start-up sweep does). The run's processes
are found as the task asks for them: any process whose command line names the run's directories (their names
hold the run's token), and any whose environment carries the token. A normal run of two families leaves the
shared-memory parent as it found it; the sweep removes only what a dead run owned.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench import lifetime
from tests.support.helpers import REPO, clean_env

STARTED = re.compile(r"work (\S+); shm (\S+); reaper (\d+);")
WAIT_S = 180.0  # a bound on waits for events (a family starting, a process ending), never an ordering


@dataclass
class Run:
    proc: subprocess.Popen[str]
    log: Path
    work: Path
    shm: Path
    reaper: int

    @property
    def token(self) -> str:
        return self.shm.name.removeprefix(lifetime.PREFIX).removesuffix("-shm")

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _wait_for(condition: Callable[[], bool], what: str, run: Run | None = None) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if run is not None and run.proc.poll() is not None:
            pytest.fail(f"the run ended ({run.proc.returncode}) before {what}:\n{run.output()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {WAIT_S:.0f} s" + (f":\n{run.output()[-4000:]}" if run else ""))
        time.sleep(0.02)


def _bench(tmp_path: Path, only: str, name: str) -> tuple[subprocess.Popen[str], Path]:
    log = tmp_path / f"{name}.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.run", "--profile", "toy", "--only", only, "--workdir",
             str(tmp_path / "work"), "--shm", str(tmp_path / "shm"), "--out", str(tmp_path / f"{name}.json"),
             "--docs", "none"], cwd=REPO, env=clean_env(), stdout=sink, stderr=subprocess.STDOUT, text=True)
    return proc, log


def _start_peers(tmp_path: Path) -> Run:
    """The peers family of a toy run, caught while it holds a ckptd sidecar and its shared memory."""
    (tmp_path / "shm").mkdir()
    proc, log = _bench(tmp_path, "peers", "killed")
    found: list[re.Match[str]] = []

    def started() -> bool:
        found[:] = [m for m in [STARTED.search(log.read_text())] if m]
        return bool(found)

    probe = Run(proc, log, Path(), Path(), 0)
    _wait_for(started, "start-up line", probe)
    run = Run(proc, log, Path(found[0][1]), Path(found[0][2]), int(found[0][3]))
    _wait_for(lambda: any("serve" in c and str(run.shm) in c for c in _cmdlines(run.token).values())
              and (run.shm / "peers").is_dir(), "ckptd sidecar of the peers family", run)
    return run


def _cmdlines(token: str) -> dict[int, str]:
    """Live processes whose command line names the run's directories (their names hold its token)."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"{lifetime.PREFIX}{token}" in cmdline and lifetime.start_ticks(int(entry.name)) is not None:
            out[int(entry.name)] = cmdline
    return out


def _left_behind(run: Run) -> dict[str, object]:
    return {"by command line": _cmdlines(run.token), "by environment": lifetime.marked_processes(run.token),
            "directories": [str(d) for d in (run.work, run.shm) if d.exists()]}


NOTHING: dict[str, object] = {"by command line": {}, "by environment": [], "directories": []}


@pytest.fixture
def cleanup() -> Iterator[list[Run]]:
    runs: list[Run] = []
    yield runs
    for run in runs:  # whatever a failed test left: never past the test
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        lifetime.stop_marked(run.token, grace_s=2)


def test_sigterm_mid_family_stops_every_process_and_removes_the_directories(tmp_path: Path,
                                                                              cleanup: list[Run]) -> None:
    run = _start_peers(tmp_path)
    cleanup.append(run)
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=WAIT_S) == 128 + signal.SIGTERM, run.output()[-4000:]
    assert "SIGTERM: stopping the run's processes" in run.output()
    assert _left_behind(run) == NOTHING, run.output()[-4000:]  # the run itself, before its reaper acts
    assert not list((tmp_path / "shm").iterdir()) and not list((tmp_path / "work").iterdir())
    _wait_for(lambda: lifetime.start_ticks(run.reaper) is None, "end of the reaper")


def test_sigkill_of_the_run_its_reaper_stops_every_process_and_removes_the_directories(
        tmp_path: Path, cleanup: list[Run]) -> None:
    run = _start_peers(tmp_path)
    cleanup.append(run)
    run.proc.kill()
    run.proc.wait()
    _wait_for(lambda: lifetime.start_ticks(run.reaper) is None, "end of the reaper")
    assert _left_behind(run) == NOTHING, run.output()[-4000:]
    assert not list((tmp_path / "shm").iterdir())


def test_sigkill_of_the_run_and_its_reaper_the_next_run_sweeps_what_it_left(tmp_path: Path,
                                                                            cleanup: list[Run]) -> None:
    run = _start_peers(tmp_path)
    cleanup.append(run)
    os.kill(run.reaper, signal.SIGKILL)
    run.proc.kill()
    run.proc.wait()
    _wait_for(lambda: lifetime.start_ticks(run.reaper) is None, "end of the reaper")
    left = _left_behind(run)
    assert left["by environment"] and left["directories"] == [str(run.work), str(run.shm)]  # a real leftover
    nxt, log = _bench(tmp_path, "", "next")  # no family: the start-up sweep and an empty run
    assert nxt.wait(timeout=WAIT_S) == 0, log.read_text()[-4000:]
    assert f"removed {run.shm}: left by run {run.token}" in log.read_text()
    assert _left_behind(run) == NOTHING, log.read_text()[-4000:]
    assert not list((tmp_path / "shm").iterdir())


def test_a_normal_run_of_two_families_leaves_the_shm_parent_as_it_found_it(tmp_path: Path,
                                                                           cleanup: list[Run]) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "someone-else").mkdir()  # not the run's: left alone
    proc, log = _bench(tmp_path, "interference,replicas", "normal")
    assert proc.wait(timeout=WAIT_S) == 0, log.read_text()[-4000:]
    found = STARTED.search(log.read_text())
    assert found is not None
    run = Run(proc, log, Path(found[1]), Path(found[2]), int(found[3]))
    cleanup.append(run)
    assert json.loads((tmp_path / "normal.json").read_text())["errors"] == {}
    assert run.shm.parent == shm and sorted(p.name for p in shm.iterdir()) == ["someone-else"]
    assert _left_behind(run) == NOTHING


def _owned(parent: Path, name: str, record: dict[str, object] | None) -> Path:
    path = parent / f"{lifetime.PREFIX}{name}"
    path.mkdir(parents=True)
    (path / "data").write_bytes(b"x" * 1024)
    if record is not None:
        (path / lifetime.OWNER).write_text(json.dumps(record))
    return path


def test_the_sweep_removes_only_what_a_dead_run_owned_and_stops_its_processes(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names no live process now (or a later one, started at another time)
    me = os.getpid()
    dead = _owned(tmp_path, "dead", {"pid": gone.pid, "start_ticks": 1, "token": "dead-run"})
    reused = _owned(tmp_path, "reused", {"pid": me, "start_ticks": -1, "token": "reused-run"})
    alive = _owned(tmp_path, "alive", {"pid": me, "start_ticks": lifetime.start_ticks(me), "token": "live-run"})
    unowned = _owned(tmp_path, "unowned", None)
    other = tmp_path / "not-a-bench-dir"
    other.mkdir()
    left_running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                    env={**os.environ, lifetime.TOKEN_ENV: "dead-run"})
    live_child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                  env={**os.environ, lifetime.TOKEN_ENV: "live-run"})
    try:
        _wait_for(lambda: left_running.pid in lifetime.marked_processes("dead-run")
                  and live_child.pid in lifetime.marked_processes("live-run"), "marked processes")
        removed = lifetime.sweep_stale([tmp_path], log=False)
        assert sorted(removed) == sorted([dead, reused])
        assert left_running.wait(timeout=WAIT_S) == -signal.SIGTERM  # the dead run's process, stopped
        assert alive.is_dir() and unowned.is_dir() and other.is_dir()
        assert live_child.poll() is None  # a live run's process is never touched
    finally:
        for proc in (left_running, live_child):
            proc.kill()
            proc.wait()
