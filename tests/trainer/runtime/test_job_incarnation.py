"""A job's incarnation (``trainer_client.runtime.multihost._job_store.job_incarnation``): process 0 draws it once
per jax.distributed start and every caller of that start gets the same one; a restart's new store gets a new one,
also when Python gives the new store the id of a freed one (the cache keyed by ``id()`` handed the old one back)."""

from __future__ import annotations

import gc

from tests.support.kv_store import InProcessKeyValueStore
from trainer_client.runtime.multihost._job_store import INCARNATION_KEY, job_incarnation


def test_one_incarnation_per_store_and_a_new_one_after_a_restart() -> None:
    first = InProcessKeyValueStore()
    drawn = job_incarnation(first)
    assert len(drawn) == 16 and int(drawn, 16) >= 0
    assert job_incarnation(first) == drawn and first.values[INCARNATION_KEY] == drawn  # drawn once, published
    seen = {drawn}
    for _ in range(50):  # restarts: each store freed before the next is made, so ids come back
        del first
        gc.collect()
        first = InProcessKeyValueStore()
        now = job_incarnation(first)
        assert first.values[INCARNATION_KEY] == now, "a restart's store was handed an old incarnation"
        assert now not in seen
        seen.add(now)
