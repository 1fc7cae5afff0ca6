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
from trainer_client.core._gcs_pacing import BACKOFF, PACED, Backoff, pace
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
