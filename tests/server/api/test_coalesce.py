"""Identical resume requests asked together share one answer worked out after they arrived (ckptd/api/_coalesce.py)."""

from __future__ import annotations

import asyncio
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptd.api._coalesce import Coalescer
from ckptd.api._plan_cache import PlanCache
from tests.support.golden import copy_root, golden_fixture
from tests.support.helpers import wait_until
from tests.support.orbax_steps import write_orbax_jobs
from trainer_client.core import protocol as p
from trainer_client.core.format._files import COMMIT_MARKER

# ---- the coalescer on its own --------------------------------------------------------------------


class Gate:
    """Work whose rounds block until released; counts the rounds and returns the round's number."""

    def __init__(self) -> None:
        self.started: list[threading.Event] = [threading.Event() for _ in range(8)]
        self.release: list[threading.Event] = [threading.Event() for _ in range(8)]
        self.rounds = 0
        self._lock = threading.Lock()

    def work(self) -> int:
        with self._lock:
            n = self.rounds
            self.rounds += 1
        self.started[n].set()
        assert self.release[n].wait(10)
        return n


async def _until(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, 10)


def test_callers_during_a_round_share_the_next_one() -> None:
    async def scenario() -> None:
        gate, coalescer = Gate(), Coalescer[int]()
        first = asyncio.ensure_future(coalescer.answer("k", gate.work))
        await _until(gate.started[0])
        # these arrive while round 0 runs: round 0 began before them, so none may be answered by it
        late = [asyncio.ensure_future(coalescer.answer("k", gate.work)) for _ in range(10)]
        await asyncio.sleep(0)
        gate.release[0].set()
        assert await first == 0
        await _until(gate.started[1])
        gate.release[1].set()
        assert await asyncio.gather(*late) == [1] * 10
        assert (gate.rounds, coalescer.rounds, coalescer.waited) == (2, 2, 10)
        # a caller after everything settled starts a round of its own
        gate.release[2].set()
        assert await coalescer.answer("k", gate.work) == 2

    asyncio.run(scenario())


def test_different_keys_do_not_wait_for_each_other() -> None:
    async def scenario() -> None:
        gate_a, gate_b, coalescer = Gate(), Gate(), Coalescer[int]()
        a = asyncio.ensure_future(coalescer.answer("a", gate_a.work))
        await _until(gate_a.started[0])
        gate_b.release[0].set()
        assert await coalescer.answer("b", gate_b.work) == 0  # while "a" is still running
        assert not a.done()
        gate_a.release[0].set()
        assert await a == 0
        assert coalescer.waited == 0

    asyncio.run(scenario())


def test_an_error_reaches_every_caller_of_its_round_and_is_not_kept() -> None:
    async def scenario() -> None:
        gate, coalescer = Gate(), Coalescer[int]()
        calls = 0

        def failing() -> int:
            nonlocal calls
            calls += 1
            gate.work()
            raise LookupError("no good step")

        first = asyncio.ensure_future(coalescer.answer("k", failing))
        await _until(gate.started[0])
        late = [asyncio.ensure_future(coalescer.answer("k", failing)) for _ in range(3)]
        await asyncio.sleep(0)
        gate.release[0].set()
        gate.release[1].set()
        with pytest.raises(LookupError):
            await first
        for fut in late:
            with pytest.raises(LookupError, match="no good step"):
                await fut
        assert calls == 2
        gate.release[2].set()
        assert await coalescer.answer("k", gate.work) == 2  # a later caller is answered afresh

    asyncio.run(scenario())


def test_a_caller_that_goes_away_does_not_cancel_the_round_for_the_others() -> None:
    async def scenario() -> None:
        gate, coalescer = Gate(), Coalescer[int]()
        first = asyncio.ensure_future(coalescer.answer("k", gate.work))
        await _until(gate.started[0])
        impatient = asyncio.ensure_future(coalescer.answer("k", gate.work))
        patient = asyncio.ensure_future(coalescer.answer("k", gate.work))
        await asyncio.sleep(0)
        impatient.cancel()
        gate.release[0].set()
        gate.release[1].set()
        assert await first == 0
        assert await patient == 1
        assert impatient.cancelled()

    asyncio.run(scenario())


# ---- in the server ----------------------------------------------------------------------------------


golden_root = golden_fixture(lambda root: write_orbax_jobs({root / "train": [10, 20]}), name="golden_root")


@pytest.fixture
def root(golden_root: Path, tmp_path: Path) -> Path:
    """This test's own copy of the module's root (job ``train``, steps 10 and 20): it may serve and damage it."""
    return copy_root(golden_root, tmp_path)


def _slow_first_plan(monkeypatch: pytest.MonkeyPatch, started: threading.Event, release: threading.Event) -> None:
    """The first resume of the process blocks in planning (its checks done) until released: its round stays
    open while the test sends more."""
    original = PlanCache.answer
    first = [True]

    def answer(self: PlanCache, *args: Any) -> bytes:
        if first[0]:
            first[0] = False
            started.set()
            assert release.wait(20)
        return original(self, *args)

    monkeypatch.setattr(PlanCache, "answer", answer)


def test_a_burst_of_identical_resumes_costs_two_rounds(ckptd_server: Any, root: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    started, release = threading.Event(), threading.Event()
    _slow_first_plan(monkeypatch, started, release)
    server = ckptd_server(root)
    answers: Coalescer[bytes] = server.server.config.app.state.resume_answers
    body = {"policy": "resize", "alive_devices": 6}
    with ThreadPoolExecutor(32) as pool, httpx.Client(base_url=server.url, timeout=30) as first_client:
        first = pool.submit(first_client.post, "/v1/jobs/train/resume", json=body)
        assert started.wait(20)
        clients = [httpx.Client(base_url=server.url, timeout=30) for _ in range(31)]
        try:
            burst = [pool.submit(c.post, "/v1/jobs/train/resume", json=body) for c in clients]
            # every one of them has arrived and is waiting for the next round
            deadline = 200
            while answers.waited < 31 and deadline:
                threading.Event().wait(0.05)
                deadline -= 1
            release.set()
            replies = [f.result(timeout=30) for f in [first, *burst]]
        finally:
            for c in clients:
                c.close()
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    assert len({r.content for r in replies}) == 1
    assert p.ResumePlan.model_validate_json(replies[0].content).step == 20
    assert (answers.rounds, answers.waited) == (2, 31)


def test_requests_that_arrive_after_a_step_is_lost_are_not_answered_with_it(
        ckptd_server: Any, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started, release = threading.Event(), threading.Event()
    _slow_first_plan(monkeypatch, started, release)
    server = ckptd_server(root)
    answers: Coalescer[bytes] = server.server.config.app.state.resume_answers
    body = {"policy": "resize", "alive_devices": 6}
    with ThreadPoolExecutor(4) as pool, httpx.Client(base_url=server.url, timeout=30) as a, \
            httpx.Client(base_url=server.url, timeout=30) as b:
        first = pool.submit(a.post, "/v1/jobs/train/resume", json=body)
        assert started.wait(20)  # step 20 has been checked and is being planned
        (root / "train" / "20" / COMMIT_MARKER).unlink(missing_ok=True)  # then it loses its commit
        shutil.rmtree(root / "train" / "20")
        later = pool.submit(b.post, "/v1/jobs/train/resume", json=body)
        deadline = 200
        while answers.waited < 1 and deadline:
            threading.Event().wait(0.05)
            deadline -= 1
        release.set()
        assert p.ResumePlan.model_validate_json(later.result(timeout=30).content).step == 10
        assert first.result(timeout=30).status_code == 200  # it asked before the step went away


def test_lists_are_built_once_per_catalog_change_and_never_stale(ckptd_server: Any, root: Path) -> None:
    server = ckptd_server(root)
    app = server.server.config.app
    catalog = app.state.catalog

    def states(c: httpx.Client) -> dict[int, str]:
        body = p.CheckpointList.model_validate_json(c.get("/v1/jobs/train/checkpoints").content)
        return {info.step: info.state.value for info in body.checkpoints}

    def settled() -> bool:  # the first passes settle (adopt) the plain-Orbax steps: wait for both, then quiet
        version = catalog.version
        adopted = all(getattr(catalog.step("train", s), "state", None) is p.StepState.VERIFIED for s in (10, 20))
        seen = {catalog.last_refresh}

        def three_passes() -> bool:  # counted, however long a loaded machine takes (not 0.6 s slept)
            seen.add(catalog.last_refresh)
            return len(seen) > 3

        wait_until(three_passes, timeout=30, interval=0.01, what="three more refresh passes")
        return adopted and bool(catalog.version == version)

    wait_until(settled, timeout=20, what="the catalog to stop changing")
    built = []
    original = catalog.checkpoints

    def checkpoints(job: str) -> Any:
        built.append(job)
        return original(job)

    catalog.checkpoints = checkpoints
    with server.client() as c:
        assert states(c) == {10: "verified", 20: "verified"}
        first = c.get("/v1/jobs/train/checkpoints").content
        assert c.get("/v1/jobs/train/checkpoints").content == first
        assert built == ["train"]  # one catalog read for three lists: nothing changed in between
        rounds = app.state.resume_answers.rounds
        catalog.mark("train", 20, p.StepState.QUARANTINED, "found bad by a test")  # a change: a new version
        assert states(c) == {10: "verified", 20: "quarantined"}
        assert c.get("/v1/jobs/train/checkpoints").content != first
        assert app.state.resume_answers.rounds > rounds
        # a new step on storage is listed as soon as a refresh catalogues it
        shutil.copytree(root / "train" / "10", root / "train" / "30")
        catalog.refresh_job("train")
        assert 30 in states(c)
