"""The one boundary between ckptd and its persist worker child: typed requests and answers, typed errors,
one client that starts the child and restarts it after a crash.

The child (``python -m ckptd.persist._persist_worker --serve``) imports jax and Orbax, which ckptd's own process
never does; it reads one request a line on its stdin and writes one answer a line on its stdout, both JSON
(never pickle). A request is one of ``PersistSnapshot`` (a whole memory snapshot to a committed step),
``WritePart`` (one host's part of a multi-process step) and ``CommitParts`` (the leader's commit of a step from
its parts: docs/multihost.md, section 5); each is told from the others by its fields alone, so the JSON form
is just the fields. An answer is a ``WorkerAnswer``: ``ok``, what was made (a step's URL, a part's record),
or the worker's error and what kind of failure it was (``damaged``: the snapshot's bytes do not match their
checksums, so retrying cannot help; ``failed``: anything else).

``PersistWorker`` is the seam (after torchft's ``CheckpointTransport``): one abstract exchange, and the typed
calls built on it that turn a failed answer into an exception of the ``PersistWorkerError`` tree. Two
transports implement it: ``PersistWorkerClient``, the child process (started on the first request, restarted
when it died, one request at a time), which the snapshot keeper and the commit pass each own; and
``InProcessWorker``, a function from the request's JSON form to the answer's (tests and benchmarks hand it the
worker's own ``handle``).
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from ckptd.memory_tier._settings import DEFAULT_PERSIST_NICE
from trainer_client.core import CkptdError

WORKER_MODULE = "ckptd.persist._persist_worker"


class PersistWorkerError(CkptdError, RuntimeError):
    """A request to the persist worker did not get done; the message says why (it is what ckptd logs)."""


class WorkerUnavailable(PersistWorkerError):
    """No answer: the worker could not be started, died, did not answer in time or said something that is not
    an answer, or ckptd is shutting down."""


class WorkerFailed(PersistWorkerError):
    """The worker answered that the request failed (the message is its error: the exception's type and text)."""


class SnapshotDamaged(WorkerFailed):
    """The snapshot's bytes do not match their checksums (damaged in memory): retrying cannot help."""


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def wire(self) -> dict[str, Any]:
        """The JSON form sent on the pipe."""
        return self.model_dump(mode="json", exclude_none=True)


class PersistSnapshot(_Wire):
    """Write the whole snapshot directory ``snapshot`` as a committed step under ``job_url``."""

    snapshot: str
    job_url: str


class WritePart(_Wire):
    """Write this host's part of the snapshot ``part`` into the step directory ``step_url``."""

    part: str
    step_url: str


class CommitParts(_Wire):
    """Orbax's finalize of the step ``commit`` from its durable parts (``record``: process 0's part record)."""

    commit: str
    record: dict[str, Any]


WorkerRequest = PersistSnapshot | WritePart | CommitParts
_REQUEST: TypeAdapter[WorkerRequest] = TypeAdapter(WorkerRequest)


def parse_request(data: object) -> WorkerRequest:
    """The request whose JSON form ``data`` is (``pydantic.ValidationError`` when it is none of them)."""
    return _REQUEST.validate_python(data)


class WorkerAnswer(_Wire):
    """One answer: ``ok`` with ``path`` (a persisted step's URL) or ``record`` (a written part's record), or not
    ok with the worker's ``error`` and its ``failure`` kind. A worker may add fields of its own (the benchmarks'
    ``bench.persist_phases`` adds its timings): kept in ``model_extra``."""

    model_config = ConfigDict(extra="allow", frozen=True)

    ok: bool
    path: str | None = None
    record: dict[str, Any] | None = None
    error: str | None = None
    failure: Literal["damaged", "failed"] | None = None

    @classmethod
    def failed(cls, exc: BaseException, *, damaged: bool = False) -> WorkerAnswer:
        return cls(ok=False, error=f"{type(exc).__name__}: {exc}", failure="damaged" if damaged else "failed")


class PersistWorker(ABC):
    """What ckptd asks of a persist worker, whatever carries the request."""

    @abstractmethod
    def exchange(self, request: WorkerRequest) -> WorkerAnswer:
        """One request and its answer; ``WorkerUnavailable`` when none comes."""

    def close(self, timeout_s: float = 10.0) -> None:  # noqa: B027 (a transport without a process has nothing)
        """Stop the worker (it finishes the request in hand for up to ``timeout_s``); later requests get
        ``WorkerUnavailable``."""

    def persist(self, snapshot: str, job_url: str) -> str:
        """Persist a whole snapshot as a committed step; the step's URL."""
        answer = self._done(PersistSnapshot(snapshot=snapshot, job_url=job_url))
        if answer.path is None:
            raise WorkerUnavailable("bad answer")
        return answer.path

    def write_part(self, part: str, step_url: str) -> dict[str, Any]:
        """Write one host's part; the fields of its part record (``trainer_client.core.format._parts.PartInfo``)."""
        answer = self._done(WritePart(part=part, step_url=step_url))
        if answer.record is None:
            raise WorkerUnavailable("bad answer")
        return answer.record

    def commit_parts(self, step_url: str, record: dict[str, Any]) -> None:
        """Finalize the step at ``step_url`` from its parts (``record``: process 0's part record)."""
        self._done(CommitParts(commit=step_url, record=record))

    def _done(self, request: WorkerRequest) -> WorkerAnswer:
        answer = self.exchange(request)
        if answer.ok:
            return answer
        why = answer.error or "no answer"
        raise SnapshotDamaged(why) if answer.failure == "damaged" else WorkerFailed(why)


class InProcessWorker(PersistWorker):
    """A worker that is a function from a request's JSON form to the answer's (``persist_worker.handle`` run in a
    process that has jax already, or a stand-in)."""

    def __init__(self, answer: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.answer = answer

    def exchange(self, request: WorkerRequest) -> WorkerAnswer:
        try:
            return WorkerAnswer.model_validate(self.answer(request.wire()))
        except ValidationError as exc:
            raise WorkerUnavailable(f"bad answer: {exc}") from exc


class PersistWorkerClient(PersistWorker):
    """The persist worker child: started on the first request (restarted when it died), ``nice`` steps below
    ckptd's CPU priority (a persist competes with the trainer for the host's cores; the trainer should win),
    one request at a time, each answered within ``timeout_s`` or the child is killed (it may be stuck)."""

    def __init__(self, *, compression: bool = False, nice: int = DEFAULT_PERSIST_NICE, devices: int | None = None,
                 timeout_s: float = 3600.0, module: str = WORKER_MODULE) -> None:
        """``module``: what ``python -m`` runs (the worker; the benchmarks run it with timers around it)."""
        self.module = module
        self.compression = compression
        self.nice = nice
        self.devices = devices
        self.timeout_s = timeout_s
        self._process: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def started(self) -> bool:
        return self._process is not None

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module, "--serve", f"--nice={self.nice}",
                *([f"--devices={self.devices}"] if self.devices else []),
                *(["--compression"] if self.compression else [])]

    def exchange(self, request: WorkerRequest) -> WorkerAnswer:
        with self._lock:
            if self._closed:
                raise WorkerUnavailable("ckptd is shutting down")
            return self._ask(self._running(), request)

    def _running(self) -> subprocess.Popen[str]:
        """The child, started now when there is none or it has exited."""
        if self._process is None or self._process.poll() is not None:
            try:
                self._process = subprocess.Popen(self.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                 text=True, bufsize=1, env={**os.environ, "JAX_PLATFORMS": "cpu"})
            except OSError as exc:
                raise WorkerUnavailable(f"cannot start the persist worker: {exc}") from exc
        return self._process

    def _ask(self, process: subprocess.Popen[str], request: WorkerRequest) -> WorkerAnswer:
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(request.model_dump_json(exclude_none=True) + "\n")
            process.stdin.flush()
        except OSError as exc:
            _kill(process)
            raise WorkerUnavailable(f"persist worker gone: {exc}") from exc
        ready, _, _ = select.select([process.stdout], [], [], self.timeout_s)
        line = process.stdout.readline() if ready else ""
        if not line:
            _kill(process)
            raise WorkerUnavailable("persist worker died or timed out")
        try:
            return WorkerAnswer.model_validate_json(line)
        except ValidationError:
            raise WorkerUnavailable(f"persist worker said {line.strip()[:200]!r}") from None

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the child's input (it finishes the request in hand and exits); kill it after ``timeout_s``. Not
        under the lock, which a request in progress holds (its answer comes, or the child is gone, on return)."""
        self._closed = True
        process = self._process
        if process is None or process.poll() is not None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(process)


def _kill(process: subprocess.Popen[str]) -> None:
    """Kill the child and reap it, so the next request sees it gone and starts another."""
    process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10.0)


__all__ = [
    "CommitParts",
    "InProcessWorker",
    "PersistSnapshot",
    "PersistWorker",
    "PersistWorkerClient",
    "PersistWorkerError",
    "SnapshotDamaged",
    "WorkerAnswer",
    "WorkerFailed",
    "WorkerRequest",
    "WorkerUnavailable",
    "WritePart",
    "parse_request",
]
