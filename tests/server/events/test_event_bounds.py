"""Events stay bounded: per job on storage and in memory, over all jobs in memory, across a
restart, and in /metrics; goodput over the whole history survives the rotation that bounds them
(ckptd.events._events, ckptd.events._event_summary, ckptd.events._goodput_fold).

The histories are synthetic but shaped like ElasticRunner's: runs of one or more hosts that start,
compile, save every 10 steps (each save stalls the loop), lose slices now and then (waiting, restore,
recompile, lost steps) and finish, with the job down between runs.
"""

from __future__ import annotations

import math
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ckptd.advisor._goodput import compute_goodput
from ckptd.api._app import create_app
from ckptd.catalog._catalog import Catalog
from ckptd.events._event_summary import SUMMARY_FILE
from ckptd.events._events import EventLimits, EventStore
from tests.support.helpers import make_settings
from trainer_client.core import protocol as p
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import EVENTS_DIR

_FIELDS = ("goodput", "wall_seconds", "productive_seconds", "runs", "recoveries", "lost_steps", "events",
           "window_start", "window_end")


def history(seed: int, runs: int = 5, steps: int = 600, hosts: int = 2) -> list[dict[str, Any]]:
    """A job's events in time order (a step takes 1 s; hosts report 10 ms apart)."""
    rnd = random.Random(seed)
    out: list[dict[str, Any]] = []
    t, step = 1_000_000.0, 0

    def each_host(kind: str, at: float, step: int | None = None, **fields: Any) -> None:
        for h in range(hosts):
            run = f"r{len(runs_seen)}-h{h}"
            out.append({"kind": kind, "time": at + 0.01 * h, "step": step, "id": f"{run}:{len(out)}", "run": run,
                        **fields})

    runs_seen: list[int] = []
    for r in range(runs):
        runs_seen.append(r)
        each_host("start", t)
        each_host("initialized", t + 20, step)
        each_host("first_step_done", t + 25, step)
        t += 25
        for _ in range(steps // 10):
            step, t = step + 10, t + 10.2
            each_host("checkpoint_started", t, step, blocked_seconds=0.2)
            if rnd.random() < 0.05:
                wait = rnd.uniform(5, 60)
                each_host("failure_detected", t + 3, step + 3, detail="DATA_LOSS")
                each_host("slices_ready", t + 3 + wait)
                each_host("restored", t + 7 + wait, step)
                t += 13 + wait
                each_host("first_step_done", t, step)
                each_host("recovered", t + 0.001, step, recovery_seconds=10 + wait, lost_steps=3, restored_step=step)
        each_host("finished", t, step)
        t += rnd.uniform(30, 300)
    return out


def post_all(store: EventStore, job: str, events: list[dict[str, Any]], batch: int) -> None:
    for i in range(0, len(events), batch):
        chunk = events[i:i + batch]
        store.append(job, [p.ElasticEvent(**e) for e in chunk], now=chunk[-1]["time"] + 0.5)


def unrotated(job: str, events: list[dict[str, Any]]) -> p.Goodput:
    return compute_goodput(job, [p.StoredEvent(**e, received_at=0.0) for e in events])


def assert_same_goodput(got: p.Goodput, want: p.Goodput) -> None:
    for name in _FIELDS:
        assert math.isclose(getattr(got, name), getattr(want, name), rel_tol=1e-9, abs_tol=1e-6), name
    for cause, seconds in want.badput_seconds.model_dump().items():
        assert math.isclose(getattr(got.badput_seconds, cause), seconds, rel_tol=1e-9, abs_tol=1e-6), cause
    assert [(s.start, s.end, s.cause) for s in got.segments] == [(s.start, s.end, s.cause) for s in want.segments]


def event_files(root: Path, job: str) -> list[Path]:
    return [f for f in (root / job / EVENTS_DIR).iterdir() if f.name != SUMMARY_FILE]


@pytest.mark.parametrize(("seed", "hosts", "batch", "cap"), [(0, 1, 7, 150), (1, 2, 50, 300), (2, 3, 120, 500)])
def test_goodput_over_the_whole_history_survives_rotation(
    tmp_path: Path, seed: int, hosts: int, batch: int, cap: int
) -> None:
    events = history(seed, hosts=hosts)
    store = EventStore(Storage(str(tmp_path)), EventLimits(max_events=cap, memory_bytes=8 << 20))
    post_all(store, "job", events, batch)
    summary = store.summary("job")
    assert summary is not None and summary.files > 5  # rotated, several times
    assert len(store.load("job")) <= cap + batch < len(events)
    want = unrotated("job", events)
    assert_same_goodput(store.goodput("job"), want)
    restarted = EventStore(Storage(str(tmp_path)), EventLimits(max_events=cap, memory_bytes=8 << 20))
    assert_same_goodput(restarted.goodput("job"), want)  # the summary is on storage, not in this process
    stats = restarted.stats("job")  # totals over every event, folded or kept
    assert stats.events == len(events)
    recovered = [e for e in events if e["kind"] == "recovered"]
    assert stats.kinds["recovered"] == stats.recovery_seconds.count == len(recovered)
    assert stats.recovery_seconds.total == pytest.approx(sum(e["recovery_seconds"] for e in recovered))
    assert stats.save_stall_seconds.count == sum(e["kind"] == "checkpoint_started" for e in events)
    assert stats.lost_steps.total == 3 * len(recovered)


def test_a_flood_of_events_stays_bounded_on_storage_and_in_memory(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "llm").mkdir(parents=True)
    catalog = Catalog(Storage(str(root)), tmp_path / "catalog.sqlite3")
    catalog.rebuild()
    settings = make_settings(root, tmp_path / "state", events_max_per_job=3000, events_max_bytes_per_job=1 << 20,
                             events_memory_bytes=8 << 20)
    t0 = time.time()
    with TestClient(create_app(settings, catalog, background=False)) as client:
        store: EventStore = client.app.state.events  # type: ignore[attr-defined]
        most = (0, 0)
        for k in range(12):  # 12,000 events with 300-character details: ~4 MB of event files unbounded, 4 caps
            batch = [{"kind": "checkpoint_started", "time": t0 + k * 1000 + i, "step": k * 1000 + i,
                      "id": f"flood:{k}:{i}", "blocked_seconds": 0.01, "detail": f"{k}:{i}:" + "x" * 300}
                     for i in range(1000)]
            assert client.post("/v1/jobs/llm/events", json={"events": batch}).status_code == 200
            most = max(most, store.memory())
            on_disk = sum(f.stat().st_size for f in event_files(root, "llm"))
            assert on_disk <= (1 << 20) + 450_000  # the cap, plus the batch that just passed it
        assert most[0] <= 3000 + 1000 and most[1] <= (1 << 20) + 450_000
        assert len(client.get("/v1/jobs/llm/events", params={"limit": 100_000}).json()["events"]) <= 3000
        goodput = p.Goodput.model_validate(client.get("/v1/jobs/llm/goodput").json())
        assert goodput.events == 12_000 and goodput.window_start == pytest.approx(t0)  # every event still counts
        summary = store.summary("llm")
        assert summary is not None and summary.stats.save_stall_seconds.count + len(store.load("llm")) == 12_000


def test_memory_over_all_jobs_is_bounded_and_a_job_pushed_out_is_read_again(tmp_path: Path) -> None:
    limits = EventLimits(max_events=2000, memory_bytes=3 << 20)
    store = EventStore(Storage(str(tmp_path)), limits)
    events = history(3, runs=2, steps=1000, hosts=2)
    for j in range(8):
        post_all(store, f"job{j}", events, 100)
        used, size = store.memory()
        assert size + used * 1536 <= (3 << 20) + 2000 * (1536 + 400)  # the budget, plus the job in use
    assert_same_goodput(store.goodput("job0"), unrotated("job0", events))  # pushed out, read again


def test_a_restart_over_a_long_history_reads_a_bounded_amount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = history(4, runs=6, steps=1500, hosts=2)
    limits = EventLimits(max_events=1000, max_bytes=256 << 10, memory_bytes=8 << 20)
    post_all(EventStore(Storage(str(tmp_path)), limits), "job", events, 40)
    kept = sum(f.stat().st_size for f in event_files(tmp_path, "job"))
    summary_size = (tmp_path / "job" / EVENTS_DIR / SUMMARY_FILE).stat().st_size
    assert kept <= 256 << 10 and summary_size < 200 << 10
    storage = Storage(str(tmp_path))
    read: list[int] = []
    original = storage.read_bytes
    monkeypatch.setattr(storage, "read_bytes", lambda path: read.append(len(data := original(path))) or data)
    restarted = EventStore(storage, limits)
    assert_same_goodput(restarted.goodput("job"), unrotated("job", events))
    assert sum(read) <= kept + summary_size  # what is kept, not the history (~1 MB of event files)


def test_an_unbounded_history_from_before_is_folded_in_bounded_memory(tmp_path: Path) -> None:
    events = history(5, runs=6, steps=1500, hosts=2)
    post_all(EventStore(Storage(str(tmp_path))), "job", events, 40)  # no limits: every file kept
    assert len(event_files(tmp_path, "job")) * 40 >= len(events) > 2000
    store = EventStore(Storage(str(tmp_path)), EventLimits(max_events=800, memory_bytes=8 << 20))
    peak = [0]
    store.load("job", progress=lambda _: peak.__setitem__(0, max(peak[0], store.memory()[0])))
    assert peak[0] <= 800 + 40 + 200  # the window, the file just read, the summary's carry
    assert len(event_files(tmp_path, "job")) * 40 <= 800  # folded down to the limit on storage too
    assert_same_goodput(store.goodput("job"), unrotated("job", events))


def test_metrics_stay_bounded_with_many_jobs(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for j in range(300):  # 300 job directories appear on storage (any writer of the bucket)
        (root / f"job{j:03d}").mkdir(parents=True)
    catalog = Catalog(Storage(str(root)), tmp_path / "catalog.sqlite3")
    settings = make_settings(root, tmp_path / "state", max_jobs=20)
    with TestClient(create_app(settings, catalog, background=False)) as client:
        catalog.rebuild()
        kept = sorted(j["name"] for j in client.get("/v1/jobs").json()["jobs"])  # which: test_job_admission.py
        assert len(kept) == 20
        assert len(catalog.refused) == 280
        for job in kept:
            ok = client.post(f"/v1/jobs/{job}/events", json={"events": [
                {"kind": "recovered", "time": 1.0, "recovery_seconds": 3.0, "lost_steps": 1}]})
            assert ok.status_code == 200
        left_out = sorted(catalog.refused)[-1]
        refused = client.post(f"/v1/jobs/{left_out}/events", json={"events": [{"kind": "start", "time": 1.0}]})
        assert p.ErrorBody.model_validate(refused.json()).code is p.ErrorCode.JOB_LIMIT
        size = len(client.get("/metrics").content)
        assert f'"{left_out}"' not in client.get("/metrics").text
        for job in kept[:10]:  # jobs leave storage: their series leave the metrics
            shutil.rmtree(root / job)
        catalog.refresh()
        after = client.get("/metrics").text
        assert f'"{kept[0]}"' not in after and f'"{kept[10]}"' in after
        assert len(after) < size
    assert size < 20 * 6000 + 20_000  # per job: a few dozen series
