"""Forged files in a job's lease directory (ckptd/lease/_lease_records.py, docs/operations.md "Several sidecars
on one root"): names past the bound or outside the pattern are reported once and ignored, never deleted; no
takeover creates a name no listing finds; a follower never waits for good (an epoch at the bound, a directory
at the next epoch's name, an oversized or unreadable beat); ``ckptd gc`` on a forged lease record says so in
one line and goes on, within seconds. Time is a fake monotonic clock shared by the leases, as in test_lease.py."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.cli._maintenance import leader_refusal
from ckptd.lease._lease import MAX_EPOCH, Lease, beat_name, epoch_name, lease_directory, released_name
from tests.support.helpers import clean_env
from tests.support.peak_rss import peak_growth
from trainer_client.core._storage import Storage

TTL = 30.0
FORGED = "epoch-99999999999999999999.json"  # 20 digits: the pattern's, past the bound


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _dir(root: Path) -> Path:
    path = root / "job" / ".ckptd" / "leader"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _lease(root: Path, holder: str, clock: Clock) -> Lease:
    return Lease(Storage(str(root)), str(_dir(root)), holder, TTL, clock)


def _record(holder: str = "forger/1/x", **fields: object) -> str:
    return json.dumps({"holder": holder, "ttl_s": TTL, "created_at": time.time(), **fields})


def _tick_until_led(leases: list[Lease], clock: Clock, *, most_s: float) -> tuple[Lease, float]:
    """Tick every lease each quarter TTL until one leads; (the leader, the fake seconds it took)."""
    started = clock.now
    while clock.now - started <= most_s:
        for lease in leases:
            lease.tick()
        leaders = [lease for lease in leases if lease.leads()]
        if leaders:
            assert len(leaders) == 1
            return leaders[0], clock.now - started
        clock.now += TTL / 4
    pytest.fail(f"no leader within {most_s}s: {[lease.view() for lease in leases]}")


def test_a_forged_epoch_past_the_bound_is_ignored_and_takeovers_stay_listable(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = _dir(tmp_path)
    planted = {FORGED: _record(), "released-99999999999999999999.json": _record(), "epoch-7.json": _record(),
               "epoch-0000000000000000000x.json": _record(), "epoch-000000000000000000001.json": _record()}
    for name, body in planted.items():
        (directory / name).write_text(body)
    clock = Clock()
    a, b = _lease(tmp_path, "a", clock), _lease(tmp_path, "b", clock)
    with caplog.at_level(logging.WARNING, logger="ckptd.lease._lease"):
        leader, _ = _tick_until_led([a, b], clock, most_s=0)  # nothing that counts: epoch 0 at the first tick
        assert leader is a and a.view().epoch == 0 and b.view().as_dict()["holder"] == "a"
        for _ in range(8):
            clock.now += TTL / 4
            a.tick()
            b.tick()
        clock.now += TTL  # a dies: b takes the next epoch, one every listing finds
        new, _ = _tick_until_led([b], clock, most_s=TTL + TTL / 4)
    assert new is b and b.view().epoch == 1 and (directory / epoch_name(1)).is_file()
    for name in planted:  # reported once by each sidecar, never deleted
        assert sum(name in r.getMessage() for r in caplog.records) == 2, name
        assert (directory / name).read_text() == planted[name]


def test_an_epoch_at_the_bound_is_ignored_once_its_beat_stopped(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    a, b = _lease(tmp_path, "a", clock), _lease(tmp_path, "b", clock)
    _tick_until_led([a, b], clock, most_s=0)
    (_dir(tmp_path) / epoch_name(MAX_EPOCH)).write_text(_record())  # no epoch may follow it
    with caplog.at_level(logging.ERROR, logger="ckptd.lease._lease"):
        leader, waited = _tick_until_led([a, b], clock, most_s=3 * TTL)  # a steps down: a newer epoch exists
    print(f"[lease] an epoch at the bound: led again after {waited:.0f}s (ttl {TTL:g}s)")
    assert leader.view().epoch == 1 and waited <= 2 * TTL + TTL / 2
    assert any(epoch_name(MAX_EPOCH) in r.getMessage() and "forged" in r.getMessage() for r in caplog.records)
    assert (_dir(tmp_path) / epoch_name(MAX_EPOCH)).is_file()


def test_a_directory_at_the_next_epoch_name_is_stepped_over(tmp_path: Path) -> None:
    clock = Clock()
    a, b = _lease(tmp_path, "a", clock), _lease(tmp_path, "b", clock)
    _tick_until_led([a, b], clock, most_s=0)
    (_dir(tmp_path) / epoch_name(1)).mkdir()  # create-only cannot create it: once, nobody ever led again
    clock.now += TTL  # a dies
    leader, _ = _tick_until_led([b], clock, most_s=TTL + TTL / 4)
    assert leader is b and b.view().epoch == 2


@pytest.mark.parametrize("beat", ["sparse", "directory", "fifo"])
def test_an_unreadable_beat_is_reported_and_its_epoch_expires(tmp_path: Path, beat: str) -> None:
    directory = _dir(tmp_path)
    (directory / epoch_name(4)).write_text(_record(ttl_s="abc"))  # an invalid record: its holder is unknown
    path = directory / beat_name(4)
    if beat == "sparse":
        with path.open("wb") as f:
            f.truncate(768 << 20)
    elif beat == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    clock = Clock()
    b = _lease(tmp_path, "b", clock)
    b.tick()
    assert b.view().as_dict() == {"role": "follower", "epoch": 4, "holder": None, "ttl_s": TTL}
    leader, _ = _tick_until_led([b], clock, most_s=TTL + TTL / 4)
    assert leader.view().epoch == 5 and path.exists()


def test_an_oversized_beat_costs_no_memory(tmp_path: Path) -> None:
    """A 768 MiB beat once took each sidecar to 1.6 GiB: a lease's tick, measured in a fresh process."""
    directory = _dir(tmp_path)
    (directory / epoch_name(0)).write_text(_record())
    with (directory / beat_name(0)).open("wb") as f:
        f.truncate(768 << 20)
    result = peak_growth("from ckptd.lease._lease import Lease\nfrom trainer_client.core._storage import Storage",
                         "lease = Lease(Storage(args['root']), args['dir'], 'b', 30.0)\nlease.tick()\n"
                         "outcomes.append(lease.view().as_dict())",
                         {"root": str(tmp_path), "dir": str(directory)})
    assert result["outcomes"] == [{"role": "follower", "epoch": 0, "holder": "forger/1/x", "ttl_s": 30.0}]
    assert result["grew_mib"] < 24, result


FORGED_RECORDS = {
    "ttl_s a string": _record(ttl_s="abc"),
    "ttl_s past a float": '{"holder": "x", "ttl_s": 1e400, "created_at": 0}',
    "ttl_s of 10^300 s": _record(ttl_s=1e300),
    "ttl_s negative": _record(ttl_s=-5),
    "ttl_s a list": _record(ttl_s=[1]),
    "holder of 10,000 characters": _record(holder="h" * 10_000),
    "created_at NaN": '{"holder": "x", "ttl_s": 30, "created_at": NaN}',
    "not an object": "[1, 2]",
}


@pytest.mark.parametrize("record", FORGED_RECORDS.values(), ids=FORGED_RECORDS.keys())
def test_a_forged_lease_record_is_ignored_in_one_line_by_gc_and_validate(tmp_path: Path, record: str,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    (_dir(tmp_path) / epoch_name(0)).write_text(record)
    (_dir(tmp_path) / beat_name(0)).write_text("{}")  # beaten just now
    started = time.monotonic()
    assert leader_refusal(f"{tmp_path}/job", "gc") is None
    assert time.monotonic() - started < 5
    notices = capsys.readouterr().err.splitlines()
    assert len(notices) == 1 and notices[0].startswith("ckptd: ignoring the lease of job 'job': "), notices
    assert epoch_name(0) in notices[0] and len(notices[0]) < 400


def test_a_beat_dated_in_the_future_or_a_huge_record_is_ignored(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    directory = Path(lease_directory(Storage(str(tmp_path)), "job"))
    directory.mkdir(parents=True)
    (directory / epoch_name(0)).write_text(_record())
    (directory / beat_name(0)).write_text("{}")
    assert leader_refusal(f"{tmp_path}/job", "gc") is not None  # a valid lease, beaten now: held
    year_2100 = 4_102_444_800
    os.utime(directory / beat_name(0), (year_2100, year_2100))  # never older than ttl_s: held until then
    assert leader_refusal(f"{tmp_path}/job", "gc") is None
    assert "in the future" in capsys.readouterr().err
    (directory / released_name(0)).write_text("{}")
    with (directory / epoch_name(1)).open("wb") as f:
        f.truncate(1 << 30)
    assert leader_refusal(f"{tmp_path}/job", "validate") is None
    assert "more than the 4096" in capsys.readouterr().err


def test_the_gc_command_on_a_forged_lease_exits_within_seconds_without_a_traceback(tmp_path: Path) -> None:
    """The command as an operator runs it (before: a ``ValueError`` traceback; ``ttl_s: 1e400`` refused it for
    good). A job with no step yet: what is measured is the lease's check, not the adoption of steps."""
    (_dir(tmp_path) / epoch_name(0)).write_text(FORGED_RECORDS["ttl_s a string"])
    (_dir(tmp_path) / beat_name(0)).write_text("{}")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ckptd", "gc", f"{tmp_path}/job", "--keep-last", "1"],
                          env=clean_env(), capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    print(f"[gc] a forged lease record: exit {done.returncode} in {took:.1f}s; stderr: {done.stderr!r}")
    assert done.returncode == 0 and "Traceback" not in done.stderr and took < 30
    assert "ttl_s" in done.stderr and "ignoring the lease" in done.stderr and "0 step(s) deleted" in done.stderr
