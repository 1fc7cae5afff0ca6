"""The leadership lease's edge cases (ckptd/lease/_lease.py): expiry, self-fencing, the takeover race, and
the create-only write it stands on, locally and on the GCS emulator. Time is a fake monotonic clock shared by
the sidecars of a test, so expiry is exact and nothing sleeps."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from ckptd.catalog._catalog import Catalog
from ckptd.catalog._integrity import FOLLOWER_REASON
from ckptd.lease._lease import FENCE, Lease, LeaseBoard, beat_name, epoch_name, released_name
from tests.support.gcs_emulator import GcsEmulator  # the gcs_emulator fixture: tests/conftest.py, one per session
from tests.support.orbax_steps import write_orbax_steps
from trainer_client.core._errors import StorageError
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import CKPTD_MANIFEST, VERIFIED_FILE
from trainer_client.core.protocol import StepState

TTL = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lease(root: Path, holder: str, clock: Clock) -> Lease:
    return Lease(Storage(str(root)), str(root / "job" / ".ckptd" / "leader"), holder, TTL, clock)


def test_first_tick_takes_epoch_zero_and_others_follow(tmp_path: Path) -> None:
    clock = Clock()
    a, b = _lease(tmp_path, "a", clock), _lease(tmp_path, "b", clock)
    a.tick()
    b.tick()
    assert a.leads() and not b.leads()
    assert a.view().as_dict() == {"role": "leader", "epoch": 0, "holder": "a", "ttl_s": TTL}
    assert b.view().as_dict() == {"role": "follower", "epoch": 0, "holder": "a", "ttl_s": TTL}
    record = json.loads((tmp_path / "job/.ckptd/leader" / epoch_name(0)).read_text())
    assert record["holder"] == "a" and record["ttl_s"] == TTL
    assert json.loads((tmp_path / "job/.ckptd/leader" / beat_name(0)).read_text())["holder"] == "a"


def test_a_renewing_leader_keeps_the_lease_and_a_silent_one_loses_it(tmp_path: Path) -> None:
    clock = Clock()
    a, b = _lease(tmp_path, "a", clock), _lease(tmp_path, "b", clock)
    a.tick()
    b.tick()
    for _ in range(8):  # far past one TTL in all, but the beat changes every quarter of it
        clock.now += TTL / 4
        a.tick()
        b.tick()
        assert a.leads() and not b.leads()
    clock.now += TTL * FENCE  # a stops beating (dies): it no longer leads, by its own clock alone
    assert not a.leads()
    b.tick()  # b saw the beat change last a quarter TTL ago: not yet
    assert not b.leads()
    clock.now += TTL * (1 - FENCE) + TTL / 4
    b.tick()
    assert b.leads() and b.view().epoch == 1
    a.tick()  # a comes back: a newer epoch exists, it follows
    assert not a.leads() and a.view().as_dict() == {"role": "follower", "epoch": 1, "holder": "b", "ttl_s": TTL}


def test_a_released_lease_is_taken_at_the_next_tick_and_its_holder_no_longer_leads(tmp_path: Path) -> None:
    clock = Clock()
    a, b = _lease(tmp_path, "a", clock), _lease(tmp_path, "b", clock)
    a.tick()
    b.tick()
    clock.now += TTL / 4
    b.tick()  # the beat unchanged for a quarter TTL: b waits, as before
    assert a.leads() and not b.leads()
    assert a.release() and not a.leads()  # stops leading first, then says so
    record = json.loads((tmp_path / "job/.ckptd/leader" / released_name(0)).read_text())
    assert record["holder"] == "a"
    assert not a.release()  # nothing held any more
    b.tick()  # no clock advance: the release is its expiry
    assert b.leads() and b.view().as_dict() == {"role": "leader", "epoch": 1, "holder": "b", "ttl_s": TTL}
    for _ in range(3):  # the old release does not move the lease again
        clock.now += TTL / 4
        b.tick()
        assert b.leads() and b.view().epoch == 1


def test_a_board_stopped_cleanly_releases_what_it_leads(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    (tmp_path / "job").mkdir()
    board = LeaseBoard(storage, TTL, jobs=lambda: ["job"], holder="a")
    board.tick()
    assert board.leads("job")
    board.stop()
    assert not board.leads("job") and (tmp_path / "job/.ckptd/leader" / released_name(0)).is_file()


def test_followers_racing_for_the_next_epoch_one_wins(tmp_path: Path) -> None:
    clock = Clock()
    leader = _lease(tmp_path, "leader", clock)
    leader.tick()
    followers = [_lease(tmp_path, f"f{i}", clock) for i in range(4)]
    for f in followers:
        f.tick()
    clock.now += TTL + 1  # the leader died: every follower's wait is over at once
    barrier = threading.Barrier(len(followers))

    def race(f: Lease) -> None:
        barrier.wait()
        f.tick()

    threads = [threading.Thread(target=race, args=(f,)) for f in followers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [f for f in followers if f.leads()]
    assert len(winners) == 1 and winners[0].view().epoch == 1
    for f in followers:
        f.tick()
        assert f.view().holder == winners[0].holder


def test_a_leader_that_cannot_renew_fences_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    a = _lease(tmp_path, "a", clock)
    a.tick()
    assert a.leads()

    def broken(*_args: object, **_kwargs: object) -> None:
        raise StorageError("storage unavailable")

    monkeypatch.setattr("ckptd.lease._lease.write_json_file", broken)
    clock.now += TTL * FENCE / 2
    a.tick()  # the renewal fails: the lease still runs on the last one
    assert a.leads()
    clock.now += TTL * FENCE / 2
    assert not a.leads()  # past the fence without a renewal: no more writes
    monkeypatch.undo()
    a.tick()  # storage is back, but the fence passed: it steps down rather than renew late
    assert not a.leads()


def test_create_new_is_create_only_locally_under_contention(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    path = str(tmp_path / "x" / "epoch.json")
    results: list[bool] = []
    barrier = threading.Barrier(16)

    def create(i: int) -> None:
        barrier.wait()
        results.append(storage.create_new(path, f"{i}".encode()))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 15 + [True]


def test_create_new_on_gcs_sends_the_precondition(gcs_emulator: GcsEmulator) -> None:
    storage = Storage(gcs_emulator.gs("lease-unit"))
    path = storage.join("job", "epoch.json")
    assert storage.create_new(path, b"first")
    assert not storage.create_new(path, b"second")
    assert storage.read_bytes(path) == b"first"


def test_a_follower_catalog_writes_nothing_and_serves_what_the_leader_wrote(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_orbax_steps(root / "job", [1, 2])  # plain Orbax: no manifests, to be adopted

    def catalog(holder: str) -> Catalog:
        cat = Catalog(Storage(str(root)), tmp_path / f"{holder}.sqlite3")
        cat.lease = LeaseBoard(cat.storage, TTL, jobs=lambda: ["job"], holder=holder)
        cat.lease.tick()
        return cat

    leader, follower = catalog("a"), catalog("b")  # a ticked first: it holds epoch 0
    assert leader.writes("job") and not follower.writes("job")
    follower.rebuild()
    assert [(c.step, c.state, c.reason) for c in follower.checkpoints("job")] == [
        (1, StepState.COMMITTED, FOLLOWER_REASON), (2, StepState.COMMITTED, FOLLOWER_REASON)]
    assert not list(root.glob(f"job/*/{CKPTD_MANIFEST}")), "a follower wrote a manifest"
    assert follower.confirmed_latest_good("job") is None
    leader.rebuild()
    assert {c.state for c in leader.checkpoints("job")} == {StepState.VERIFIED}
    assert len(list(root.glob(f"job/*/{VERIFIED_FILE}"))) == 2
    follower.refresh()
    good = follower.confirmed_latest_good("job")
    assert good is not None and good.step == 2 and good.state is StepState.VERIFIED
