"""After a restart the recovery metrics are rebuilt from the events on storage, as goodput is:
a restarted ckptd does not show empty recovery histograms beside a goodput read from storage, and counts
nothing twice."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ckptd.events._event_summary import SUMMARY_FILE
from ckptd.events._events import EventStore
from tests.support.server import app_over
from trainer_client.core import protocol as p
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import EVENTS_DIR

T0 = 1_700_000_000.0


def _recovered(i: int, seconds: float, lost: int) -> p.ElasticEvent:
    return p.ElasticEvent(kind="recovered", time=T0 + 100 * i, run="r", id=f"rec-{i}", recovery_seconds=seconds,
                          lost_steps=lost)


def _stall(i: int, seconds: float) -> p.ElasticEvent:
    return p.ElasticEvent(kind="checkpoint_started", time=T0 + 100 * i + 50, run="r", id=f"save-{i}", step=i,
                          blocked_seconds=seconds)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Job ``llm`` with events a previous ckptd stored: 3 recoveries (2, 4 and 30 s; 5 lost steps each) and 2
    saves; no step yet."""
    root = tmp_path / "root"
    root.mkdir()
    EventStore(Storage(str(root))).append("llm", [
        p.ElasticEvent(kind="start", time=T0, run="r", id="start"),
        _recovered(1, 2.0, 5), _recovered(2, 4.0, 5), _recovered(3, 30.0, 5), _stall(1, 0.5), _stall(2, 1.5)])
    return root


@pytest.fixture
def restarted(root: Path, tmp_path: Path) -> Iterator[TestClient]:
    """A freshly started ckptd over that root (its catalog built, its tracker not run yet)."""
    with TestClient(app_over(root, tmp_path)) as client:
        yield client


def _samples(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({"ckpt_job": "llm", **labels}.items()))), 0.0)


def test_a_restarted_ckptd_rebuilds_its_recovery_metrics_from_storage(restarted: TestClient) -> None:
    tracker = restarted.app.state.tracker  # type: ignore[attr-defined]
    # one more recovery arrives before the tracker's first pass: counted once, not again from storage
    resp = restarted.post("/v1/jobs/llm/events", json={"events": [_recovered(4, 8.0, 1).model_dump(
        exclude_none=True)]})
    assert resp.status_code == 200, resp.text
    tracker.poll(goodput=True)
    m = _samples(restarted)
    assert _value(m, "ckptd_recovery_seconds_count") == 4
    assert _value(m, "ckptd_recovery_seconds_sum") == pytest.approx(2 + 4 + 30 + 8)
    assert _value(m, "ckptd_recovery_seconds_bucket", le="5.0") == 2  # 2 s and 4 s
    assert _value(m, "ckptd_recovery_seconds_bucket", le="10.0") == 3
    assert _value(m, "ckptd_lost_steps_total") == 16
    assert _value(m, "ckptd_elastic_events_total", kind="recovered") == 4
    assert _value(m, "ckptd_elastic_events_total", kind="start") == 1
    assert _value(m, "ckptd_save_stall_seconds_count") == 2
    assert _value(m, "ckptd_save_stall_seconds_sum") == pytest.approx(2.0)
    assert _value(m, "ckptd_goodput_ratio") == pytest.approx(restarted.get("/v1/jobs/llm/goodput").json()["goodput"])
    # later passes and later events: each counted once
    tracker.poll(goodput=True)
    restarted.post("/v1/jobs/llm/events", json={"events": [_recovered(5, 1.0, 2).model_dump(exclude_none=True)]})
    tracker.poll(goodput=True)
    m = _samples(restarted)
    assert _value(m, "ckptd_recovery_seconds_count") == 5
    assert _value(m, "ckptd_lost_steps_total") == 18


def _with_summary(root: Path, stats: dict[str, object]) -> None:
    """A summary on storage as anyone who can write the root may write it (nothing folded: ``through`` empty)."""
    (root / "llm" / EVENTS_DIR / SUMMARY_FILE).write_text(json.dumps(
        {"format": "ckptd-events-summary/1", "job": "llm", "stats": stats}))


@pytest.mark.parametrize("stats", [
    {"recovery_seconds": {"count": 10**400, "total": 1.0}},  # an integer no float holds
    {"kinds": {"recovered": 10**400}},
    {"recovered_from": {"memory": 10**400}},
    {"save_stall_seconds": {"count": p.MAX_COUNT + 1}},
    {"kinds": {"recovered": -1}},
])
def test_a_summary_whose_counts_no_float_holds_is_unreadable_not_a_failed_scrape(
        root: Path, tmp_path: Path, stats: dict[str, object]) -> None:
    _with_summary(root, stats)
    with TestClient(app_over(root, tmp_path)) as client:
        client.app.state.tracker.poll(goodput=True)  # type: ignore[attr-defined]
        resp = client.get("/metrics")
        assert resp.status_code == 200, resp.text
        m = _samples(client)
    assert _value(m, "ckptd_recovery_seconds_count") == 3  # the events stored; the summary is skipped
    assert _value(m, "ckptd_elastic_events_total", kind="recovered") == 3


def test_a_long_history_in_the_summary_is_counted_at_once(root: Path, tmp_path: Path) -> None:
    n = 10**12  # a count within the bound, replayed at its mean: one step, not 10**12 observations
    _with_summary(root, {"recovery_seconds": {"count": n, "total": 3.0 * n}})
    with TestClient(app_over(root, tmp_path)) as client:
        client.app.state.tracker.poll(goodput=True)  # type: ignore[attr-defined]
        m = _samples(client)
    assert _value(m, "ckptd_recovery_seconds_count") == n + 3
    assert _value(m, "ckptd_recovery_seconds_sum") == pytest.approx(3.0 * n + 36)
    assert _value(m, "ckptd_recovery_seconds_bucket", le="5.0") == n + 2  # 3 s each, and 2 s and 4 s
