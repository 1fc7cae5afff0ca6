"""The replica tier's skips and failures are counters: a trainer reports its run's counts so far, and ckptd adds
what each report brings beyond the run's previous one (a report again, or an older one, adds nothing; a new run
counts from zero)."""

from __future__ import annotations

from typing import Any

from ckptd._metrics import Metrics
from trainer_client.core import protocol as p


def _report(metrics: Metrics, run: str, i: int, **counts: Any) -> None:
    event = p.StoredEvent(kind="checkpoint_started", time=1000.0 + i, run=run, id=f"{run}-{i}", received_at=1.0,
                          **counts)
    metrics.observe_events("job", [event])


def _values(metrics: Metrics) -> tuple[float | None, float | None]:
    get = metrics.registry.get_sample_value
    return (get("ckptd_replica_snapshot_skips_total", {"ckpt_job": "job"}),
            get("ckptd_replica_snapshot_failures_total", {"ckpt_job": "job"}))


def test_skips_and_failures_are_counters_of_what_each_run_reported_new() -> None:
    metrics = Metrics()
    types = {m.name: m.type for m in metrics.registry.collect()}
    assert types["ckptd_replica_snapshot_skips"] == types["ckptd_replica_snapshot_failures"] == "counter"
    _report(metrics, "a", 0, replica_skips=2, replica_failures=1)
    assert _values(metrics) == (2.0, 1.0)
    _report(metrics, "a", 1, replica_skips=2, replica_failures=1)  # the same counts again: nothing new
    _report(metrics, "a", 2, replica_skips=5)  # 3 more skips; no failures field: none added
    assert _values(metrics) == (5.0, 1.0)
    _report(metrics, "a", 3, replica_skips=4, replica_failures=0)  # an older report, arrived late
    assert _values(metrics) == (5.0, 1.0)
    _report(metrics, "b", 4, replica_skips=1, replica_failures=2)  # a new run: its counts are all new
    assert _values(metrics) == (6.0, 3.0)
