"""Three real ``ckptd serve`` processes on one root with ``CKPTD_LEASE_TTL_S``, on a local
root and on the GCS emulator: exactly one leads; steps written by plain Orbax get their manifests from the
leader only (with the leader stopped, the followers leave a new step unadopted until one of them holds the
lease); the leader SIGKILLed, a follower leads within the lease time and goes on adopting; every sidecar
answers latest-good and resume alike. The measured takeover is printed (``[lease] takeover ...``)."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptd.catalog._integrity import FOLLOWER_REASON
from ckptd.lease._lease import released_name
from tests.support.chaos_support import CkptdProcess
from tests.support.gcs_emulator import GcsEmulator  # the gcs_emulator fixture: tests/conftest.py, one per session
from tests.support.helpers import wait_until
from tests.support.lease_views import lease_view
from tests.support.orbax_steps import write_orbax_steps
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import CKPTD_MANIFEST

TTL_S = 2.0
JOB = "job"
TAKEOVER_LIMIT_S = TTL_S + TTL_S / 4 + 3.0  # TTL, one tick, and a margin for this loaded 2-core machine


def _lease(proc: CkptdProcess) -> dict[str, Any] | None:
    return lease_view(proc, JOB)


def _leaders(procs: list[CkptdProcess]) -> list[CkptdProcess]:
    return [p for p in procs if (lease := _lease(p)) is not None and lease["role"] == "leader"]


def _get(proc: CkptdProcess, route: str) -> Any:
    return httpx.get(f"{proc.url}/v1/jobs/{JOB}/{route}", timeout=10).json()


def _answers(proc: CkptdProcess) -> tuple[Any, Any]:
    """What a trainer asks: the newest good step and a resume plan on 8 devices."""
    latest = _get(proc, "checkpoints/latest-good")
    plan = httpx.post(f"{proc.url}/v1/jobs/{JOB}/resume", json={"alive_devices": 8}, timeout=10).json()
    return latest, plan


def _all_serve(procs: list[CkptdProcess], step: int) -> bool:
    for p in procs:
        latest = _get(p, "checkpoints/latest-good")
        if latest.get("step") != step:
            return False
    return True


def _sidecars(root: str, tmp_path: Path) -> list[CkptdProcess]:
    return [CkptdProcess(root, tmp_path / f"state{i}", log_path=tmp_path / f"ckptd{i}.log",
                         # rescans 8x a TTL: a follower lists a new step well within the lease time, even when
                         # a loaded machine delays it (at the default 2 s, one missed rescan was the whole TTL)
                         env={"CKPTD_LEASE_TTL_S": str(TTL_S), "CKPTD_ADOPT_AFTER_S": "0",
                              "CKPTD_REFRESH_INTERVAL_S": str(TTL_S / 8)})
            for i in range(3)]


def _start(procs: list[CkptdProcess]) -> None:
    """Start the sidecars; wait until each serves step 1 (adopted by whichever leads)."""
    for p in procs:
        p.start()
    for p in procs:
        p.wait_ready()
    wait_until(lambda: _all_serve(procs, 1), timeout=30, what="step 1 adopted and served by all")


def _stable_leader(procs: list[CkptdProcess]) -> CkptdProcess:
    """The one leader, once every sidecar names the same epoch and holder twice, a lease tick apart."""
    def agreed() -> tuple[object, ...] | None:
        views = [_lease(p) for p in procs]
        leaders = [p for p, v in zip(procs, views, strict=True) if v and v["role"] == "leader"]
        terms = {(v["epoch"], v["holder"]) for v in views if v}
        return (leaders[0], *terms) if len(leaders) == 1 and len(terms) == 1 and all(views) else None

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        first = agreed()
        time.sleep(TTL_S / 4)
        if first is not None and agreed() == first:
            return first[0]  # type: ignore[return-value]
    pytest.fail("no stable single leader among the sidecars: " + repr([_lease(p) for p in procs]))


@pytest.fixture(params=["local", "gcs"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "root")
    else:
        emulator: GcsEmulator = request.getfixturevalue("gcs_emulator")
        yield emulator.gs(f"lease-{uuid.uuid4().hex[:8]}")


def test_one_leader_writes_and_a_follower_takes_over(root: str, tmp_path: Path) -> None:
    storage = Storage(root)
    write_orbax_steps(storage.url_of(storage.join(JOB)), [1])  # plain Orbax: no manifest
    staged = tmp_path / "staged"  # step 2, written by plain Orbax beside the root, moved in later at once
    write_orbax_steps(staged / JOB, [2])
    procs = _sidecars(root, tmp_path)
    try:
        _start(procs)
        assert len({repr(_answers(p)) for p in procs}) == 1, [_answers(p) for p in procs]
        leader = _stable_leader(procs)  # after the warm-up: a start's first imports can stall a process past 2 s
        followers = [p for p in procs if p is not leader]
        old_epoch = _lease(leader)["epoch"]  # type: ignore[index]

        # The leader stops (it cannot beat any more); step 2 appears. Until a follower holds a newer epoch
        # nobody may write its manifest, and the followers must not serve it.
        os.kill(leader.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        stopped_at = time.monotonic()
        step2 = storage.join(JOB, "2")
        if storage.is_remote:
            storage.fs.put(str(staged / JOB / "2"), step2, recursive=True)
        else:
            os.rename(staged / JOB / "2", step2)
        declined = 0  # polls where a follower listed step 2 as left to the leader, with no manifest written
        while True:  # what storage and the followers show first, then their epochs: still the old one for
            storage.invalidate(step2)  # both afterwards means nobody held a newer lease when it was seen
            manifest = storage.exists(f"{step2}/{CKPTD_MANIFEST}")
            listed = {c["step"]: c for c in _get(followers[0], "checkpoints")["checkpoints"]}
            latest = [_get(f, "checkpoints/latest-good")["step"] for f in followers]
            epochs = [(_lease(f) or {}).get("epoch") for f in followers]
            if all(e == old_epoch for e in epochs):
                assert not manifest, "a manifest was written while no follower held the lease"
                assert latest == [1, 1], latest
                declined += listed.get(2, {}).get("reason") == FOLLOWER_REASON
            if any(e is not None and e > old_epoch for e in epochs):
                break
            assert time.monotonic() - stopped_at < TAKEOVER_LIMIT_S + 5, "no follower took over"
            time.sleep(0.05)
        leader.kill()  # SIGKILL (a stopped process dies as well)
        wait_until(lambda: len(_leaders(followers)) == 1, timeout=TAKEOVER_LIMIT_S, what="a new leader")
        takeover_s = time.monotonic() - stopped_at
        print(f"[lease] takeover {takeover_s:.2f}s after the leader stopped (ttl {TTL_S}s, {storage.url})")
        assert declined > 0, "the followers never saw step 2 while the leader was stopped"
        assert takeover_s < TAKEOVER_LIMIT_S
        new_leader = _leaders(followers)[0]
        new_view = _lease(new_leader)
        assert new_view is not None and new_view["epoch"] > old_epoch and new_view["holder"] == new_view["me"]
        for p in followers:  # the role as a metric too
            metrics = httpx.get(f"{p.url}/metrics", timeout=10).text
            assert f'ckptd_lease_leader{{ckpt_job="{JOB}"}} {1.0 if p is new_leader else 0.0}' in metrics
            if p is new_leader:
                assert f'ckptd_lease_epoch{{ckpt_job="{JOB}"}} {float(new_view["epoch"])}' in metrics

        wait_until(lambda: _all_serve(followers, 2), timeout=20, what="step 2 adopted by the new leader")
        write_orbax_steps(storage.url_of(storage.join(JOB)), [3])
        wait_until(lambda: _all_serve(followers, 3), timeout=30, what="step 3 adopted after the takeover")
        answers = [_answers(p) for p in followers]
        assert answers[0] == answers[1] and answers[0][1]["step"] == 3, answers
        assert len(_leaders(followers)) == 1
    finally:
        for p in procs:
            if p.proc is not None and p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)
            p.stop()


def test_a_leader_stopped_cleanly_hands_the_lease_over_at_once(tmp_path: Path) -> None:
    """Two sidecars, a long lease (8 s); the leader SIGTERMed: after its drain it stops leading, then releases
    its term (``released-<n>``), and the follower leads at its next tick. Without the release the follower
    would wait for the beat to stay unchanged for the whole ttl: at least 3/4 of it after the SIGTERM (the
    leader beats until its shutdown ends). Polled all along: never two leaders."""
    ttl_s = 8.0
    root = tmp_path / "root"
    write_orbax_steps(str(root / JOB), [1])
    procs = [CkptdProcess(str(root), tmp_path / f"state{i}", log_path=tmp_path / f"ckptd{i}.log",
                          env={"CKPTD_LEASE_TTL_S": str(ttl_s), "CKPTD_ADOPT_AFTER_S": "0"}) for i in range(2)]
    try:
        _start(procs)
        leader = _stable_leader(procs)
        follower = next(p for p in procs if p is not leader)
        old_epoch = _lease(leader)["epoch"]  # type: ignore[index]
        assert leader.proc is not None
        leader.proc.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        while True:
            leaders = _leaders(procs)
            assert len(leaders) <= 1, "two leaders at once"
            if leaders == [follower]:
                break
            assert time.monotonic() - stopped_at < ttl_s + 5, "no follower took over"
            time.sleep(0.05)
        takeover_s = time.monotonic() - stopped_at
        assert leader.proc.wait(timeout=20) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once done
        print(f"[lease] takeover {takeover_s:.2f}s after the leader's SIGTERM (ttl {ttl_s}s, released)")
        assert takeover_s < ttl_s * 3 / 4, takeover_s  # an expiry cannot be this quick: the release was used
        view = _lease(follower)
        assert view is not None and view["epoch"] == old_epoch + 1 and view["holder"] == view["me"]
        lease_dir = root / JOB / ".ckptd" / "leader"
        assert (lease_dir / released_name(old_epoch)).is_file()
        write_orbax_steps(str(root / JOB), [2])
        wait_until(lambda: _all_serve([follower], 2), timeout=20, what="step 2 adopted by the new leader")
    finally:
        for p in procs:
            p.stop()


@pytest.mark.chaos
@pytest.mark.slow
def test_repeated_leader_kills_with_restarts(root: str, tmp_path: Path) -> None:
    """Long form (``make chaos``): four rounds of "a plain-Orbax step lands, the leader is SIGKILLed at once,
    restarted as a follower". Every round: a new leader within the lease time, a newer epoch than before, the
    step served by all three, nothing quarantined."""
    storage = Storage(root)
    write_orbax_steps(storage.url_of(storage.join(JOB)), [1])
    procs = _sidecars(root, tmp_path)
    takeovers: list[float] = []
    try:
        _start(procs)
        epoch = -1
        for step in range(2, 6):
            leader = _stable_leader(procs)
            view = _lease(leader)
            assert view is not None and view["epoch"] > epoch
            epoch = view["epoch"]
            write_orbax_steps(storage.url_of(storage.join(JOB)), [step])
            leader.kill()
            killed_at = time.monotonic()
            others = [p for p in procs if p is not leader]
            wait_until(lambda others=others: len(_leaders(others)) == 1, timeout=TAKEOVER_LIMIT_S,
                       what="a new leader")
            takeovers.append(time.monotonic() - killed_at)
            leader.start()  # back as a follower
            leader.wait_ready()
            wait_until(lambda step=step: _all_serve(procs, step), timeout=30,
                       what=f"step {step} served by all")
            for p in procs:
                states = {c["state"] for c in _get(p, "checkpoints")["checkpoints"]}
                assert states == {"verified"}, (p.url, states)
        print(f"[lease] takeovers after SIGKILL: {[round(t, 2) for t in takeovers]} s (ttl {TTL_S}s, {storage.url})")
    finally:
        for p in procs:
            p.stop()
