"""The persist worker's client: typed requests keep the JSON lines the worker reads, each failure is its own
exception (no string matching), and one start path starts the child on the first request and again after it
died or was killed for not answering; a closed client starts nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.persist._worker_client import (
    CommitParts,
    InProcessWorker,
    PersistSnapshot,
    PersistWorkerClient,
    SnapshotDamaged,
    WorkerAnswer,
    WorkerFailed,
    WorkerUnavailable,
    WritePart,
    parse_request,
)

FAKE = "tests.support.fake_persist_worker"
REPO = Path(__file__).resolve().parents[3]


def test_requests_are_told_apart_by_their_fields_and_keep_their_json_form() -> None:
    wire = [{"snapshot": "/shm/job/5", "job_url": "/root/job"}, {"part": "/shm/job/6", "step_url": "/root/job/6"},
            {"commit": "/root/job/6", "record": {"save_id": "s"}}]
    parsed = [parse_request(data) for data in wire]
    assert [type(r) for r in parsed] == [PersistSnapshot, WritePart, CommitParts]
    assert [r.wire() for r in parsed] == wire
    for junk in ({"snapshot": "/x"}, {"snapshot": "/x", "job_url": "/y", "part": "/z"}, [], "x"):
        with pytest.raises(ValueError):
            parse_request(junk)


def test_the_persist_worker_answers_what_is_no_request_as_failed() -> None:
    pytest.importorskip("jax")
    from ckptd.persist._persist_worker import handle

    answer = WorkerAnswer.model_validate(handle({"snapshot": "/x"}))
    assert not answer.ok and answer.failure == "failed" and "not a request" in (answer.error or "")
    missing = WorkerAnswer.model_validate(handle({"snapshot": "/nonexistent", "job_url": "/tmp/none"}))
    assert not missing.ok and missing.failure == "failed"


def test_each_failure_is_its_own_exception() -> None:
    answers = {"damaged": {"ok": False, "error": "StoredFormatError: x", "failure": "damaged"},
               "failed": {"ok": False, "error": "ValueError: y", "failure": "failed"},
               "old": {"ok": False, "error": "StoredFormatError: z"}}  # no kind: a failure, never taken as damage
    for kind, exc in (("damaged", SnapshotDamaged), ("failed", WorkerFailed), ("old", WorkerFailed)):
        worker = InProcessWorker(lambda _request, kind=kind: answers[kind])
        with pytest.raises(exc) as raised:
            worker.persist("/shm/job/5", "/root/job")
        assert str(raised.value) == answers[kind]["error"]
        assert kind == "damaged" or not isinstance(raised.value, SnapshotDamaged)
    with pytest.raises(WorkerUnavailable, match="bad answer"):
        InProcessWorker(lambda _request: {"ok": True}).write_part("/shm/job/5", "/root/job/5")
    with pytest.raises(WorkerUnavailable):
        InProcessWorker(lambda _request: {"no": "answer"}).persist("/shm/job/5", "/root/job")


def test_the_child_starts_on_demand_and_again_after_dying_or_hanging() -> None:
    client = PersistWorkerClient(module=FAKE, nice=0, timeout_s=5.0)
    assert not client.started
    try:
        first = client.persist("/shm/job/1", "/root/job")
        assert client.started and client.persist("/shm/job/2", "/root/job") == first  # the same child
        with pytest.raises(WorkerUnavailable, match="died or timed out"):
            client.persist("die", "/root/job")
        second = client.persist("/shm/job/3", "/root/job")
        assert second != first  # restarted
        with pytest.raises(WorkerUnavailable, match="persist worker said 'hello'"):
            client.persist("nonsense", "/root/job")
        with pytest.raises(SnapshotDamaged, match="bad bytes"):
            client.persist("damaged", "/root/job")
        with pytest.raises(WorkerFailed, match="disk full"):
            client.persist("fail", "/root/job")
        client.timeout_s = 0.5
        with pytest.raises(WorkerUnavailable, match="died or timed out"):
            client.persist("hang", "/root/job")  # killed: it may be stuck
        client.timeout_s = 5.0
        assert client.persist("/shm/job/4", "/root/job") not in (first, second)
    finally:
        client.close(5.0)
    with pytest.raises(WorkerUnavailable, match="shutting down"):
        client.persist("/shm/job/5", "/root/job")


def test_the_child_runs_jax_on_the_cpu_and_importing_the_worker_changes_no_platform(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The child never takes the host's accelerator (one program at a time can hold a TPU chip, and the trainer
    holds it), told so by its environment; a process that imports the worker module to persist in-process keeps
    its own platform (an import that set ``JAX_PLATFORMS`` moved a chip's test run onto the CPU)."""
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    client = PersistWorkerClient(module=FAKE, nice=0, timeout_s=5.0)
    try:
        assert client.persist("platform", "/root/job") == "cpu"
    finally:
        client.close(5.0)
    pytest.importorskip("jax")
    probe = ("import os; import ckptd.persist._persist_worker; import jax; "
             "print(os.environ.get('JAX_PLATFORMS'), jax.config.jax_platforms)")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "None"], out.stdout
