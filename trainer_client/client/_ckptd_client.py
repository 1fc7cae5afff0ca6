"""The trainer's HTTP client of ckptd, with timeouts, retries and a storage fallback for resumes.

Training never waits on the sidecar (docs/architecture.md, invariant 5): saves go through Orbax and never call ckptd.
Only a resume needs an answer; when ckptd cannot give one before ``resume_deadline_s`` the client scans
storage itself with the same commit rule and the same decision (``trainer_client.core.format._steps`` and
``trainer_client.core._resume_decision``), so the plan is the one ckptd would have given. A refusal from ckptd
(its error body, e.g. ``NOT_ENOUGH_DEVICES``) is an answer, not an outage: it is raised, never bypassed.

A multi-host job's trainer whose host memory was wiped asks the same client for its part back from a peer's copy
(``peer_fetch``): one typed request that waits for the fetch itself (its own timeout, not the resume's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from trainer_client.client._http import ckptd_http
from trainer_client.client._retry import RetryPolicy, retry
from trainer_client.config import ClientSettings, client_settings
from trainer_client.core import protocol as p
from trainer_client.core._refusals import refusal_kind, refusal_message, refusal_status
from trainer_client.core._resume_candidates import StoredStep, as_is, resume_candidates
from trainer_client.core._resume_decision import Refusal, decide
from trainer_client.core._step_plan import plan_for_step
from trainer_client.core._storage import Storage
from trainer_client.core._validation import latest_good_on_storage
from trainer_client.errors import CkptdError, CkptdRequestError, CkptdUnavailable, NoCheckpointError, StorageError

_log = logging.getLogger(__name__)

# Answers that mean "ckptd cannot answer right now", worth a retry and then the fallback.
_UNAVAILABLE_STATUSES = {502, 503, 504}
# How long a peer fetch may take before the trainer gives up on its sidecar (the fetch has a deadline of its own,
# shorter for any part a peer can send faster than storage: this wait is for a sidecar that never answers).
PEER_FETCH_TIMEOUT_S = 300.0

_M = TypeVar("_M", bound=BaseModel)


class CkptdClient:
    """Talks to one ckptd; knows the checkpoint root so it can answer resumes without it."""

    def __init__(
        self,
        settings: ClientSettings | None = None,
        *,
        root: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.settings = settings or client_settings()
        self.root = root
        self._http = ckptd_http(self.settings, transport=transport)  # TCP, or a unix socket (unix:///PATH)
        self._tagged: dict[str, tuple[str, BaseModel]] = {}  # url -> (ETag, the answer it tags): If-None-Match
        self._policy = RetryPolicy(
            max_attempts=4, initial_backoff_s=0.1, max_backoff_s=1.0, deadline_s=self.settings.resume_deadline_s
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CkptdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- raw calls ------------------------------------------------------------------------------

    def _request(self, method: str, url: str, answer: type[_M], json: Any = None,
                 params: dict[str, Any] | None = None, *, conditional: bool = False,
                 timeout: httpx.Timeout | None = None) -> _M:
        """``answer`` parsed from ckptd's reply (straight from the bytes: a plan of 1,000 arrays is ~100 KB).
        ``conditional``: send the ``ETag`` of the last answer to this URL; a ``304`` gives that answer again
        (a copy), unparsed (docs/protocol.md, "Conditional requests"). ``timeout``: this request's, not the
        client's (``CKPTD_TIMEOUT_S``)."""

        @retry(self._policy, retry_on=(CkptdUnavailable,))
        def once() -> _M:
            kept = self._tagged.get(url) if conditional and params is None else None
            headers = {"If-None-Match": kept[0]} if kept is not None else None
            try:
                response = self._http.request(method, url, json=json, params=params, headers=headers,
                                              timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT)
            except httpx.HTTPError as exc:
                raise CkptdUnavailable(f"ckptd at {self.settings.url} did not answer: {exc}") from exc
            if response.status_code == 304 and kept is not None and isinstance(kept[1], answer):
                return kept[1].model_copy(deep=True)
            if response.status_code in _UNAVAILABLE_STATUSES:
                raise CkptdUnavailable(f"ckptd answered {response.status_code}: {response.text[:200]}")
            if response.status_code >= 400:
                try:
                    body = p.ErrorBody.model_validate_json(response.content)
                    raise CkptdRequestError(response.status_code, body.code.value, body.message)
                except ValidationError:
                    raise CkptdRequestError(
                        response.status_code, "UNKNOWN", response.text[:200]
                    ) from None
            try:
                parsed = answer.model_validate_json(response.content)
            except ValidationError as exc:  # not ckptd's answer (a proxy's page?): as if it had not answered
                raise CkptdUnavailable(
                    f"ckptd at {self.settings.url} answered {response.status_code} with no {answer.__name__}: "
                    f"{response.text[:200]!r}"
                ) from exc
            etag = response.headers.get("etag")
            if conditional and params is None and etag:
                self._tagged[url] = (etag, parsed.model_copy(deep=True))
            return parsed

        return once()

    def healthy(self) -> bool:
        try:
            return bool(self._http.get(p.ROUTE_HEALTHZ).status_code == 200)
        except httpx.HTTPError:
            return False

    def jobs(self) -> p.JobList:
        return self._request("GET", p.ROUTE_JOBS, p.JobList)

    def checkpoints(self, job: str, *, limit: int | None = None, cursor: str | None = None) -> p.CheckpointList:
        """Every step of ``job``, oldest first; with ``limit`` (or ``cursor``) one page, newest first, whose
        ``next`` asks for the following one (docs/protocol.md, "Pagination")."""
        params = {k: v for k, v in (("limit", limit), ("cursor", cursor)) if v is not None}
        return self._request("GET", p.ROUTE_CHECKPOINTS.format(job=job), p.CheckpointList, params=params or None)

    def goodput(self, job: str) -> p.Goodput:
        """The job's goodput over its whole history (its events, rotated ones included): wall time, time with no
        run alive, the recoveries; what the autopilot's prior learns from the job's earlier runs."""
        return self._request("GET", p.ROUTE_GOODPUT.format(job=job), p.Goodput)

    def iter_checkpoints(self, job: str, *, page_size: int = p.DEFAULT_PAGE_LIMIT) -> Iterator[p.CheckpointInfo]:
        """Every step of ``job``, newest first, a page at a time (each step once, even while steps arrive)."""
        cursor: str | None = None
        while True:
            page = self.checkpoints(job, limit=page_size, cursor=cursor)
            yield from page.checkpoints
            if page.next is None:
                return
            cursor = page.next

    def latest_good(self, job: str) -> p.CheckpointInfo | None:
        """The newest good step, or None; asked with the last answer's ``ETag`` (a poller's unchanged answer
        comes back as ``304``: no body, no parse)."""
        try:
            return self._request("GET", p.ROUTE_LATEST_GOOD.format(job=job), p.CheckpointInfo, conditional=True)
        except CkptdRequestError as exc:
            if refusal_kind(exc.code).nothing_to_resume:  # the refusal table (trainer_client/core/_refusals.py)
                return None
            raise

    def peer_fetch(self, job: str, request: p.PeerFetchRequest, *,
                   timeout_s: float = PEER_FETCH_TIMEOUT_S) -> p.PeerFetchAnswer:
        """Ask this host's ckptd to bring this host's part of ``request.step`` back from host ``request.source``'s
        copy (docs/multihost.md, "Peer copies"); its answer once the part is back (``ok``) or the fetch failed
        (``error``). ``CkptdRequestError`` when ckptd refuses the request (``PEER_CHANNEL_OFF``: its peer channel is
        off), ``CkptdUnavailable`` when it does not answer within ``timeout_s``: either way the part is not back."""
        return self._request("POST", p.ROUTE_PEER_FETCH.format(job=job), p.PeerFetchAnswer,
                             json=request.model_dump(mode="json"),
                             timeout=httpx.Timeout(timeout_s, connect=self.settings.timeout_s))

    # ---- the one call that matters after a failure ------------------------------------------------

    def resume(self, job: str, request: p.ResumeRequest) -> p.ResumePlan:
        """The resume plan from ckptd, or from a storage scan when ckptd cannot answer in time.

        Raises ``NoCheckpointError`` when there is no committed step, ``CkptdRequestError`` when ckptd
        refuses (e.g. not enough devices for the policy, or ``FOREIGN_CHECKPOINT``: the step is another run's).
        The request names this run (``CKPTD_RUN_ID``) unless it names one itself.
        """
        started = time.monotonic()
        if request.run_id is None and self.settings.run_id is not None:  # who asks (docs/protocol.md, Identity)
            request = request.model_copy(update={"run_id": self.settings.run_id})
        try:
            return self._request("POST", p.ROUTE_RESUME.format(job=job), p.ResumePlan,
                                 json=request.model_dump(mode="json"))
        except CkptdRequestError as exc:
            if not refusal_kind(exc.code).nothing_to_resume:
                raise
            # Before a job starts over, make sure storage agrees: ckptd may have no good step because it
            # cannot verify them (read-only or full storage), while committed steps are there.
            if self.root is not None:
                try:
                    plan = self.resume_from_storage(job, request)
                except (NoCheckpointError, CkptdUnavailable):
                    plan = None
                except CkptdRequestError as scanned:  # the step asked for is not on storage either
                    if scanned.code != p.ErrorCode.STEP_NOT_FOUND.value:
                        raise
                    plan = None
                if plan is not None:
                    _log.warning("ckptd has no good step of %r but storage has step %s: resuming from it (%s)",
                                 job, plan.step, exc.message)
                    return plan
            raise refusal_error(exc.code, exc.status, f"job {job!r}: {exc.message}") from exc
        except CkptdUnavailable as exc:
            if self.root is None:
                raise
            _log.warning(
                "ckptd unavailable after %.2fs (%s); scanning storage for the resume plan",
                time.monotonic() - started, exc,
            )
            return self.resume_from_storage(job, request)

    def resume_from_storage(self, job: str, request: p.ResumeRequest) -> p.ResumePlan:
        """The same plan ckptd would give, computed here (the fallback): what storage, this host's memory
        tier and the request's replicas hold, gathered as ckptd gathers them
        (trainer_client/core/_resume_candidates.py) and handed to the one decision ckptd makes too. A refusal
        raises what ckptd's answer with that code raises (``refusal_error``)."""
        if self.root is None:
            raise CkptdUnavailable("no storage root configured for the fallback scan")
        storage = Storage(self.root)
        job_path = storage.join(job)

        def scanned() -> StoredStep | None:
            found = latest_good_on_storage(storage, job_path, at_most=request.step)
            return None if found is None else StoredStep(found.step, found.path)

        def lay_out(good: StoredStep) -> p.ResumePlan:  # the one planner of a step on storage
            return plan_for_step(storage, good.path, request, job=job, step=good.step, source="storage_scan")

        try:
            held = resume_candidates(job, request, stored=scanned, lay_out_stored=lay_out,
                                     shm_dir=self.settings.shm_dir, load=as_is, dump=as_is, source="storage_scan")
        except StorageError as exc:
            raise CkptdUnavailable(f"neither ckptd nor storage answered: {exc}") from exc
        decided = decide(held, request)
        if not isinstance(decided, Refusal):
            return decided
        raise refusal_error(decided.code.value, refusal_status(decided.code),
                            refusal_message(job, decided, where=storage.url_of(job_path)))


def refusal_error(code: str, status: int, message: str) -> CkptdError:
    """What ``resume`` raises for a refusal with ``code``, whether ckptd answered it or the fallback found it
    (the refusal table, trainer_client/core/_refusals.py): ``NoCheckpointError`` when there is no step to
    resume from, otherwise ``CkptdRequestError``."""
    if refusal_kind(code).nothing_to_resume:
        return NoCheckpointError(message)
    return CkptdRequestError(status, code, message)


__all__ = ["CkptdClient", "refusal_error"]
