"""A job's elastic events with several sidecars on one root (docs/multihost.md section 7): every
sidecar appends the batches it receives as files of its own and reads every sidecar's files, so listings,
counts and goodput agree. A fold used to take the oldest files of the folding sidecar's window without
reading the others' files first: their files older than its ``through`` passed for folded and were lost
(309 of 494 events left in this history, on both sidecars). Now a fold reads every file first, and only the
job's leader folds (``EventStore.writes``), so two sidecars crossing the limits at once never overwrite each
other's summary. Two stores on one root stand for two sidecars: host 0's trainer posts to the leader,
host 1's to a follower, interleaved."""

from __future__ import annotations

from pathlib import Path

from ckptd.events._event_summary import SUMMARY_FILE
from ckptd.events._events import EventLimits, EventStore
from tests.server.events.test_event_bounds import _FIELDS, history
from trainer_client.core import protocol as p
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import EVENTS_DIR


def _post(store: EventStore, events: list[dict[str, object]]) -> None:
    store.append("job", [p.ElasticEvent(**e) for e in events], now=float(events[-1]["time"]) + 0.5)  # type: ignore[arg-type]


def test_only_the_leader_folds_and_every_sidecar_answers_alike(tmp_path: Path) -> None:
    limits = EventLimits(max_events=60, memory_bytes=8 << 20)
    leader = EventStore(Storage(str(tmp_path)), limits, writes=lambda _job: True)
    follower = EventStore(Storage(str(tmp_path)), limits, writes=lambda _job: False)
    events = history(seed=3, runs=3, steps=600)  # in time order, both hosts' events
    summary = tmp_path / "job" / EVENTS_DIR / SUMMARY_FILE

    for i in range(0, 100, 5):  # at first every batch reaches the follower: past the limit, it folds nothing
        _post(follower, events[i:i + 5])
    assert not summary.exists() and follower.stats("job").events == 100
    for n, i in enumerate(range(100, len(events), 5)):  # then each host's trainer posts to its own sidecar
        batch = events[i:i + 5]
        for k, store in enumerate((leader, follower)):
            mine = [e for e in batch if str(e["run"]).endswith(f"-h{k}")]
            if mine:
                _post(store, mine)
        if n % 10 == 0:  # and each sidecar is asked now and then
            follower.load("job")
    assert summary.exists()  # the leader folded
    answers = [(s.stats("job"), s.goodput("job"), [e.id for e in s.load("job")]) for s in (leader, follower)]
    assert answers[0][0] == answers[1][0] and answers[0][0].events == len(events)
    assert [getattr(answers[0][1], f) for f in _FIELDS] == [getattr(answers[1][1], f) for f in _FIELDS]
    assert answers[0][2] == answers[1][2]
