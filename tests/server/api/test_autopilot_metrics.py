"""The trainer's autopilot as ckptd exports it: each ``autopilot_decided`` event sets the gauges of the chosen
periods (one series per tier; a tier that is off has none), the estimated MTBF and the expected goodput; other
events leave them as they are."""

from __future__ import annotations

from typing import Any

from ckptd._metrics import Metrics
from trainer_client.core import protocol as p


def _report(metrics: Metrics, i: int, kind: str = "autopilot_decided", **fields: Any) -> None:
    event = p.StoredEvent(kind=kind, time=1000.0 + i, run="r", id=f"r-{i}", received_at=1.0, **fields)
    metrics.observe_events("job", [event])


def _periods(metrics: Metrics) -> dict[str, float | None]:
    get = metrics.registry.get_sample_value
    return {tier: get("ckptd_autopilot_period_steps", {"ckpt_job": "job", "tier": tier})
            for tier in ("replicas", "memory", "storage")}


def test_each_decision_sets_the_periods_the_mtbf_and_the_expected_goodput() -> None:
    metrics = Metrics()
    get = metrics.registry.get_sample_value
    _report(metrics, 0, autopilot_replicas_period=26, autopilot_memory_period=300, autopilot_storage_period=900,
            autopilot_mtbf_s=14_400.0, autopilot_goodput_after=0.97)
    assert _periods(metrics) == {"replicas": 26.0, "memory": 300.0, "storage": 900.0}
    assert get("ckptd_autopilot_mtbf_seconds", {"ckpt_job": "job"}) == 14_400.0
    assert get("ckptd_autopilot_expected_goodput_ratio", {"ckpt_job": "job"}) == 0.97
    _report(metrics, 1, kind="checkpoint_started", autopilot_memory_period=5)  # not a decision: ignored
    # the memory tier off (the host memory budget): its series goes; the others follow the new decision
    _report(metrics, 2, autopilot_replicas_period=10, autopilot_storage_period=450, autopilot_mtbf_s=3600.0,
            autopilot_goodput_after=0.95)
    assert _periods(metrics) == {"replicas": 10.0, "memory": None, "storage": 450.0}
    assert get("ckptd_autopilot_mtbf_seconds", {"ckpt_job": "job"}) == 3600.0
