"""ckptd's back-off on GCS (``trainer_client/core/_gcs_pacing.py``): the n-th retry waits a uniform draw from a window
that doubles up to its cap, retries stop at a deadline, only what gcsfs deems retriable is retried, and many writers
refused at once all land through the shaped bucket (``tests/support/gcs_shaper.py``) where gcsfs's own schedule
gives some up."""

from __future__ import annotations

import heapq
import random
import threading
import uuid
from collections.abc import Callable

import pytest

from tests.support.gcs_emulator import GcsEmulator
from tests.support.gcs_shaper import GcsShaper
from tests.support.gcs_shaping import Limits, ManualClock, RampingRate, TokenBucket
from trainer_client.core._errors import StorageError
from trainer_client.core._gcs_pacing import BACKOFF, PACED, Backoff, WriteShare, pace
from trainer_client.core._storage import Storage


def _client(url: str) -> object:
    import gcsfs  # once the emulator's settings are in place (tests/support/gcs_emulator.py)

    return gcsfs.GCSFileSystem(endpoint_url=url, token="anon", skip_instance_cache=True)


def test_the_windows_double_up_to_the_cap_and_each_wait_is_drawn_from_its_whole_window() -> None:
    backoff = Backoff(base_s=1.0, cap_s=8.0, deadline_s=30.0)
    assert [backoff.window(n) for n in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert backoff.window(10_000) == 8.0
    rng = random.Random(7)
    draws = [backoff.delay(4, rng.uniform) for _ in range(2000)]
    assert 0.0 <= min(draws) < 0.5 and 7.5 < max(draws) < 8.0  # full jitter: the whole window, not its end
    assert BACKOFF.deadline_s <= 30.0  # a storage that stays down is reported as soon as gcsfs's retries would


def test_only_gcsfs_file_systems_are_paced_and_only_once(gcs_emulator: GcsEmulator, tmp_path: object) -> None:
    local = Storage(str(tmp_path))
    assert not pace(local.fs) and getattr(local.fs, PACED, None) is None
    fs = _client(gcs_emulator.url)
    first = Backoff(base_s=0.5)
    assert pace(fs, first) and pace(fs, Backoff(base_s=9.0))
    assert getattr(fs, PACED) is first
    Storage(gcs_emulator.gs("paced"), fs=fs)  # a Storage paces its file system: already done, unchanged
    assert getattr(fs, PACED) is first
    assert getattr(Storage(gcs_emulator.gs("paced")).fs, PACED) is BACKOFF


def test_a_refused_write_is_retried_within_its_windows_until_the_deadline(gcs_emulator: GcsEmulator) -> None:
    clock = ManualClock()  # the shaper's time and the back-off's: it moves only when the back-off sleeps
    limits = Limits(write_per_s=0.002, read_per_s=100.0, burst_s=1000.0)  # two writes, then none for 500 s
    with GcsShaper(gcs_emulator.url, limits, clock=clock) as shaper:
        fs = _client(shaper.url)
        backoff = Backoff(base_s=1.0, cap_s=8.0, deadline_s=30.0)
        assert pace(fs, backoff, clock=clock, sleep=clock.sleep)
        storage = Storage(gcs_emulator.gs(f"pacing-{uuid.uuid4().hex[:6]}"), fs=fs)
        assert storage.create_new(storage.join("first.json"), b"{}")
        assert not storage.create_new(storage.join("first.json"), b"{}")  # 412: not retried, no wait
        assert clock.waits == []
        with pytest.raises(StorageError, match="over its current capacity"):
            storage.create_new(storage.join("second.json"), b"{}")
        stats = shaper.stats()
    assert all(0.0 <= wait < backoff.window(n) for n, wait in enumerate(clock.waits))
    assert sum(clock.waits[:-1]) < backoff.deadline_s <= sum(clock.waits)  # retried until the deadline, then no more
    assert stats["refused:write_rate"] == len(clock.waits) + 1  # every try of the second write was refused


def test_writers_refused_at_once_all_land(gcs_emulator: GcsEmulator) -> None:
    """40 writers at once against a bucket taking 20 writes/s (1 s of burst): about 1 s of the bucket's rate. Each
    write lands (times scaled down 20x: base 0.05 s, the deadline 1.5 s), none is given up."""
    with GcsShaper(gcs_emulator.url, Limits(write_per_s=20.0, read_per_s=100.0)) as shaper:
        fs = _client(shaper.url)
        assert pace(fs, Backoff(base_s=0.05, cap_s=0.8, deadline_s=1.5))
        storage = Storage(gcs_emulator.gs(f"pacing-{uuid.uuid4().hex[:6]}"), fs=fs)
        failed: list[BaseException] = []

        def write(i: int) -> None:
            try:
                assert storage.create_new(storage.join(f"w{i}.json"), b"{}")
            except BaseException as exc:  # counted below
                failed.append(exc)

        writers = [threading.Thread(target=write, args=(i,)) for i in range(40)]
        for thread in writers:
            thread.start()
        for thread in writers:
            thread.join()
        stats = shaper.stats()
    assert failed == []
    assert stats["admitted_writes"] == 40 and stats["refused"] > 0  # refused, absorbed


Schedule = Callable[[int, float, random.Random], float | None]  # (retry, now, rng) -> the wait, or None: give up


def _gcsfs_schedule(retry: int, now: float, rng: random.Random) -> float | None:
    """gcsfs 2026.x's ``retry_request``: six tries, the n-th retry after ``2^(n-1)`` s plus up to 1 s."""
    return None if retry + 1 >= 6 else min(rng.random() + 2**retry, 32)


def _paced_schedule(retry: int, now: float, rng: random.Random) -> float | None:
    return None if now >= BACKOFF.deadline_s else BACKOFF.delay(retry, rng.uniform)


def _writers_at_once(writers: int, rate: float, schedule: Schedule, seed: int) -> tuple[int, int, float]:
    """``writers`` writes at t=0 against one of the shaper's token buckets (``rate``/s, 1 s of burst), each retried
    on ``schedule``: how many landed, how many were given up, when the last landed (a virtual clock)."""
    rng = random.Random(seed)
    bucket = TokenBucket(RampingRate(rate), burst_s=1.0)
    pending = [(0.0, i, 0) for i in range(writers)]
    landed = gave_up = 0
    last = 0.0
    while pending:
        now, i, retry = heapq.heappop(pending)
        if bucket.take(now):
            landed, last = landed + 1, now
            continue
        wait = schedule(retry, now, rng)
        if wait is None:
            gave_up += 1
        else:
            heapq.heappush(pending, (now + wait, i, retry + 1))
    return landed, gave_up, last


@pytest.mark.parametrize(("writers", "rate"), [(200, 10.0), (2000, 100.0)])
def test_full_jitter_lands_every_write_that_gcsfs_schedule_gives_up(writers: int, rate: float) -> None:
    """About 20 s of the bucket's rate asked at once (through the real shaper, 200 writers at 10/s: gcsfs gave up 57,
    this back-off none, the last landing after 22.6 s)."""
    for seed in (1, 2, 3):
        landed, gave_up, _ = _writers_at_once(writers, rate, _gcsfs_schedule, seed)
        assert gave_up > writers // 5 and landed + gave_up == writers
        landed, gave_up, last = _writers_at_once(writers, rate, _paced_schedule, seed)
        assert (landed, gave_up) == (writers, 0) and last < 1.6 * writers / rate


def test_a_share_paces_its_writer_at_the_budget_over_the_writers_each_op_within_its_window() -> None:
    clock = ManualClock()
    share = WriteShare(100.0, clock=clock, sleep=lambda s: setattr(clock, "now", clock.now + s),
                       draw=lambda lo, hi: lo + 0.5 * (hi - lo))
    share.spread(10)  # 10 writers of 100 writes/s: one write each 0.1 s
    assert share.interval_s == pytest.approx(0.1)
    assert share.take() == pytest.approx(0.05)  # the middle of [0, 0.1)
    assert share.take(3) == pytest.approx(0.05 + 0.15)  # three together: the middle of [0.1, 0.4)
    assert share.take() == pytest.approx(0.15 + 0.05)  # the middle of [0.4, 0.5)
    assert clock.now == pytest.approx(0.45) and share.take(3) == pytest.approx(0.05 + 0.15)  # [0.5, 0.8)
    clock.now += 0.2  # held up to the middle of its next window [0.8, 0.9): it goes at once; the next keeps its place
    assert share.take() == 0.0 and share.take() == pytest.approx(0.1)  # the middle of [0.9, 1.0)
    share.spread(10)  # the next burst: its windows from now, whatever the last one left
    assert share.take() == pytest.approx(0.05)
    share.spread(10, index=7)  # the 8th of 10 writers: in the 8th tenth of each window, [0.07, 0.08) of [0, 0.1)
    assert share.take() == pytest.approx(0.075) and share.take(3) == pytest.approx(0.1 - 0.075 + 0.3 * 0.75)
    assert share.waited_s == pytest.approx(0.05 + 0.2 + 0.2 + 0.2 + 0.1 + 0.05 + 0.075 + 0.25)


@pytest.mark.parametrize(("writers", "budget"), [(1, 100.0), (0, 100.0), (64, 0.0)])
def test_a_writer_alone_or_without_a_budget_is_not_slowed(writers: int, budget: float) -> None:
    share = WriteShare(budget, sleep=lambda _s: pytest.fail("slowed"))
    share.spread(writers)
    assert [share.take(3) for _ in range(100)] == [0.0] * 100 and share.waited_s == 0.0


PART_OPS = (1, 3, 1)  # a host's part: the claim; the OCDBT data file, its manifest and the array metadatas; the record


def _hosts_save(hosts: int, rate: float, *, paced: bool, seed: int, latency_s: float = 0.02,
                stratified: bool = True) -> tuple[int, float]:
    """``hosts`` hosts each writing their part (``PART_OPS``, an op's writes together, ``latency_s`` between ops)
    at t=0 against one of the shaper's token buckets (``rate``/s, 1 s of burst), every refused write retried on
    ckptd's back-off; ``paced``: each host takes its ``WriteShare`` of ``rate`` for its part's writes before its
    first op (``stratified``: it knows its index among the hosts). The refusals, and when the last write landed (a
    virtual clock)."""
    rng = random.Random(seed)
    bucket = TokenBucket(RampingRate(rate), burst_s=1.0)
    now = [0.0]
    shares = [WriteShare(rate if paced else 0.0, clock=lambda: now[0], sleep=lambda _s: None, draw=rng.uniform)
              for _ in range(hosts)]
    events: list[tuple[float, int, int, int]] = []  # (when, host, op, retry)
    left = [0] * hosts  # the writes of the host's op not landed yet

    def start(k: int, op: int, at: float) -> None:
        now[0] = at
        wait = shares[k].take(sum(PART_OPS)) if op == 0 else 0.0  # the part's window, then its ops one after another
        left[k] = PART_OPS[op]
        for _ in range(PART_OPS[op]):
            heapq.heappush(events, (at + wait, k, op, 0))

    for k in range(hosts):
        shares[k].spread(hosts, k if stratified else None)
        start(k, 0, 0.0)
    refusals, last = 0, 0.0
    while events:
        at, k, op, retry = heapq.heappop(events)
        if not bucket.take(at):
            refusals += 1
            heapq.heappush(events, (at + BACKOFF.delay(retry, rng.uniform), k, op, retry + 1))
            continue
        last = max(last, at)
        left[k] -= 1
        if left[k] == 0 and op + 1 < len(PART_OPS):
            start(k, op + 1, at + latency_s)
    return refusals, last


@pytest.mark.parametrize(("hosts", "rate"), [(256, 50.0), (1024, 1000.0)])
def test_hosts_sharing_the_budget_are_not_refused_and_finish_within_the_rate_bound(hosts: int, rate: float) -> None:
    """A step's parts of N hosts at once: on back-off alone the bucket refuses a multiple of N; each host paced at
    its share of the bucket's rate (each op at a random point of its window), about none, and the last write lands
    within 1.2x of what the rate allows (5 writes a host)."""
    bound = sum(PART_OPS) * hosts / rate
    for seed in (1, 2, 3):
        unpaced, _ = _hosts_save(hosts, rate, paced=False, seed=seed)
        assert unpaced > 5 * hosts  # 256 hosts at 50/s: about 3,000; 1,024 at 1,000/s: about 6,400
        refusals, last = _hosts_save(hosts, rate, paced=True, seed=seed)
        assert refusals * 20 <= unpaced and last <= 1.2 * bound, (refusals, unpaced, last, bound)  # 0 to 75
