"""What the checkpoint routes answer, worked out once for all who ask together: a job's list or a page of it,
its latest good step, a resume plan; each as the bytes sent and their ``ETag``.

Used by the routes (``ckptd/api/routes/_jobs.py``) and by the hot path below FastAPI's routing
(``ckptd/api/_hot_path.py``), so both answer alike. Identical requests asked together share one round of
checks begun after they arrived (``ckptd/api/_coalesce.py``); answers are serialised here, not by FastAPI
(its response_model would dump and validate a 1,000-array plan again on every answer). A job's list is
built once per catalog version and paged newest first (``ckptd/api/_listing.py``).
"""

from __future__ import annotations

import time

from ckptd.api._conditional import Tagged, tag
from ckptd.api._listing import Listing
from ckptd.api._services import Services
from ckptd.catalog._layouts import ANSWER_WAIT_S
from ckptd.errors import Refused, ServiceError
from trainer_client.core import PlanningError, Refusal, decide, plan_for_step, resume_candidates
from trainer_client.core import protocol as p

# Refusals that name no catalogued job: not counted per job (a label per unknown name would grow without bound).
_NOT_A_JOB = frozenset({p.ErrorCode.INVALID_JOB_NAME, p.ErrorCode.JOB_NOT_FOUND, p.ErrorCode.NOT_READY})


def _none_yet(svc: Services, job: str) -> Refused:
    """Why a job has no good step: none at all (404), or committed steps still being verified (503 with
    Retry-After: "no checkpoint" must mean none, never "not checked yet"); as the refusal table says them."""
    pending = svc.catalog.newest(job, p.StepState.COMMITTED)
    why = (Refusal(p.ErrorCode.NO_GOOD_CHECKPOINT) if pending is None
           else Refusal(p.ErrorCode.NOT_READY, step=pending.step))
    return Refused.of(why, job)


class JobAnswers:
    """The answers of one app's checkpoint routes (``Services``: its catalog, caches and metrics)."""

    def __init__(self, svc: Services) -> None:
        self.svc = svc
        self.cat = svc.catalog

    async def checkpoints(self, job: str, limit: int | None, cursor: str | None) -> Tagged:
        """The whole list (no ``limit`` nor ``cursor``) or a page of it."""
        return await self.svc.answers.answer(("list", job, limit, cursor),
                                             lambda: self._list_answer(job, limit, cursor))

    async def latest_good(self, job: str) -> Tagged:
        """Asked together, answered together: one round of checks on storage begun after the request arrived."""
        return await self.svc.answers.answer(("latest-good", job), lambda: self._latest_good(job))

    async def resume(self, job: str, request: p.ResumeRequest) -> Tagged:
        """The plan. The hosts of a job ask together and alike: requests that arrive while the same question is
        being answered share the next answer, worked out after they arrived. The request as asked (devices
        alive, allow flags, identity) keys the round and is part of the answer's tag."""
        started = time.perf_counter()
        asked = request.model_dump_json()
        try:
            answer = await self.svc.answers.answer(("resume", job, asked), lambda: self._answer(job, request, asked))
        except (ServiceError, PlanningError) as exc:
            if exc.code not in _NOT_A_JOB:  # no metric label for names that are not jobs
                self.svc.metrics.resume_requests.labels(job).inc()
            raise
        self.svc.metrics.resume_requests.labels(job).inc()
        self.svc.metrics.plan_seconds.observe(time.perf_counter() - started)
        return answer

    def _listing(self, job: str) -> Listing:
        """The job's steps serialised once per catalog version, however many clients list at once (a job of
        10,000 steps lists in megabytes and about a second of GIL)."""
        self.svc.check_job(job)
        version = self.cat.version  # read before the rows: a change after it gives a newer version, never a stale hit
        kept = self.svc.listings.get(job)
        if kept is not None and kept.version == version:
            return kept
        kept = self.svc.listings[job] = Listing.build(job, version, self.cat.checkpoints(job))
        return kept

    def _list_answer(self, job: str, limit: int | None, cursor: str | None) -> Tagged:
        listing = self._listing(job)
        if limit is None and cursor is None:
            return listing.whole()
        return tag(listing.page(limit or p.DEFAULT_PAGE_LIMIT, cursor), "list", job, str(limit), str(cursor))

    def _latest_good(self, job: str) -> Tagged:
        info = self.cat.confirmed_latest_good(self.svc.check_job(job))
        if info is None:
            raise _none_yet(self.svc, job)
        return tag(info.model_dump_json().encode(), "latest-good", job)

    def _answer(self, job: str, request: p.ResumeRequest, asked: str) -> Tagged:
        """The resume plan and its tag, from checks made now (run by a worker thread, once per round)."""
        return tag(self._plan(job, request), "resume", job, asked)

    def _plan(self, job: str, request: p.ResumeRequest) -> bytes:
        """The resume plan's bytes, from checks made now: what each tier holds, gathered as the client's storage
        fallback gathers it (trainer_client/core/_resume_candidates.py) and handed to the one decision."""
        self.svc.check_job(job)
        self.cat.refresh_job(job, quick=True)  # the newest committed step, even if the last periodic scan missed it
        held = resume_candidates(job, request, stored=lambda: self._stored(job, request),
                                 lay_out_stored=lambda good: self._lay_out(job, request, good),
                                 shm_dir=self.svc.settings.memory_tier.shm_dir, load=p.ResumePlan.model_validate_json,
                                 dump=_plan_bytes)
        decided = decide(held, request)
        if isinstance(decided, Refusal):
            raise Refused.of(decided, job)
        return decided

    def _stored(self, job: str, request: p.ResumeRequest) -> p.CheckpointInfo | None:
        """The storage tier's step as the catalog sees it: the newest verified step (or the step asked for, in
        whatever state the catalog holds it), confirmed on storage; or, with none verified, the newest one
        committed and still being verified."""
        cat = self.cat
        info = cat.confirmed_latest_good(job) if request.step is None else cat.confirmed_step(job, request.step)
        if info is None and request.step is None:
            info = cat.newest(job, p.StepState.COMMITTED)
        return info

    def _lay_out(self, job: str, request: p.ResumeRequest, good: p.CheckpointInfo) -> bytes:
        """The plan of a good step on storage, as bytes."""
        cat = self.cat
        # the step's read_step_layout, read once and kept; a read already running is waited for briefly, then
        # 503 BUSY (ckptd/catalog/_layouts.py)
        layout = cat.layout(good, wait_s=ANSWER_WAIT_S)
        return self.svc.plans.answer(  # planned once per (step, request): ckptd/api/_plan_cache.py
            good.path, request.model_dump_json(), layout,
            # the one planner `ckptd plan` and the client's fallback call too (trainer_client/core/_step_plan.py)
            lambda: plan_for_step(cat.storage, good.path, request, job=job, step=good.step,
                                  layout=layout).model_dump_json().encode(),
        )


def _plan_bytes(plan: p.ResumePlan) -> bytes:
    return plan.model_dump_json().encode()


__all__ = ["JobAnswers"]
