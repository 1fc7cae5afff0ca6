"""One resume step for every process of a multi-controller job (docs/multihost.md, "One resume step").

In a multi-process JAX job each host's shared memory holds only that host's part of a memory snapshot, and
each host may ask its own sidecar (or scan storage) for the resume step: left alone, hosts could restore
different steps. ``ResumeAgreement`` makes them agree through JAX's coordination service key-value store
(``jax._src.distributed.global_state.client``: no device work, explicit timeouts, usable before any mesh
exists; the store lives in process 0 and starts empty with every incarnation of the job):

1. every process offers the steps whose part it holds intact in its own shared memory, and the copies of other
   hosts' parts its sidecar keeps there (``offer/<k>``; docs/multihost.md, "Peer copies");
2. process 0 asks for the storage answer (its sidecar's resume plan with the memory tier off, or the
   client's storage scan when the sidecar cannot answer) on a thread of its own as soon as it enters the
   round, so that call overlaps the listing of its own parts and the wait for the others' offers; it waits
   for all offers and for that answer and hands them to the one resume decision as candidates
   (``candidates``: the newest step every host can get from its own memory or from a peer's copy, the same
   save in every part; the storage step), which ckptd and the client's fallback make too
   (``trainer_client/core/_resume_decision.py``: the newest, memory at a tie); a host whose part is nowhere
   (its memory and its peers' wiped) leaves storage the only candidate. It publishes the decision with the
   storage plan and, per host that must fetch its part, the host holding the copy (``decision``);
3. every process plans from the decision (a memory plan of its own part, brought back first by its sidecar
   from the peer the decision names when its memory lacks it: asked over ckptd's API through the process's
   ``CkptdClient``, ``POST /v1/jobs/{job}/peer-fetch``; or the one storage plan) and restores; then
   all exchange how it went (``restored/<k>``): if any memory restore failed (a checksum found wrong, a part
   that could not be brought back), every process restores the storage step instead, so the job never runs
   on mixed steps.

A single-process job never gets here (``ElasticRunner`` asks ckptd as it always did).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.core._errors import UnsafePathError
from trainer_client.core._refusals import refusal_kind, refusal_message, refusal_status
from trainer_client.core._resume_decision import Candidate, Refusal, memory_snapshot_plan
from trainer_client.core._resume_decision import decide as decide_resume
from trainer_client.core.format._peer_copies import brought_from, held_copies
from trainer_client.core.format._snapshot import SnapshotMeta, problems, read_meta
from trainer_client.core.format._snapshot_dirs import complete_snapshots
from trainer_client.core.protocol import PeerFetchRequest, ResumePlan, ResumeRequest, Tier
from trainer_client.errors import CkptdError, CkptdRequestError, NoCheckpointError
from trainer_client.runtime.multihost._job_store import JobProcess, KeyValueStore
from trainer_client.runtime.restore._restore_loop import restore_by_plan, restore_from_plan

_log = logging.getLogger(__name__)
PyTree = Any

OFFER_TIMEOUT_MS = 120_000  # the slowest process's start (imports, jax.distributed) plus its shm scan
RESTORE_TIMEOUT_MS = 600_000  # the slowest process's restore (storage: every process reads its shards)


@dataclass(frozen=True)
class Part:
    """A step this process holds intact in its own shared memory, and what must match across the hosts."""

    step: int
    path: Path
    meta: SnapshotMeta

    @property
    def save(self) -> str:
        """What every host's part of one save has alike (its save id: ``<job incarnation>-<step>``, the data
        position, the mesh, the arrays' global shapes and dtypes): parts of the same step from different saves
        (a step run again after a restart) never make a whole."""
        t = self.meta.training
        arrays = sorted((name, a.shape, a.dtype) for name, a in self.meta.arrays.items())
        return json.dumps([self.meta.save_id, self.step, t.data_position, t.mesh.model_dump(mode="json"), arrays])


def own_parts(shm_dir: str | None, job: str, process_index: int, process_count: int,
              at_most: int | None = None) -> list[Part]:
    """This process's intact parts of ``job`` (``problems() == []``, written by this process index of a job of
    this many processes), newest first. Shard checksums are checked by the restore itself."""
    if shm_dir is None:
        return []
    try:
        held = complete_snapshots(shm_dir, job)
    except UnsafePathError as exc:  # never resume from what someone else could have written
        _log.warning("not offering the memory tier of %s: %s", job, exc)
        return []
    out = []
    for path in reversed(held):
        if (at_most is not None and int(path.name) > at_most) or problems(path):
            continue
        try:
            meta = read_meta(path)
        except (OSError, ValueError, ValidationError):  # dropped by ckptd meanwhile
            continue
        if (meta.process_index, meta.process_count) == (process_index, process_count):
            out.append(Part(meta.step, path, meta))
    return out


def copy_parts(shm_dir: str | None, job: str, process_count: int, at_most: int | None = None) -> list[Part]:
    """The intact copies of other hosts' parts of ``job`` this host's sidecar keeps (of a job of this many
    processes), newest first."""
    return [Part(meta.step, path, meta) for _, path, meta in held_copies(shm_dir, job)
            if meta.process_count == process_count and (at_most is None or meta.step <= at_most)]


def _reachable(offers: list[list[list[Any]]], copies: list[list[list[Any]]] | None) -> list[set[tuple[int, str]]]:
    """Per host: the ``(step, save)`` of its part it can get, from its own memory or a peer's copy."""
    out = [{(int(s), str(k)) for s, k in offer} for offer in offers]
    for holder, held in enumerate(copies or []):
        for origin, s, k in held:
            if 0 <= int(origin) < len(out) and int(origin) != holder:
                out[int(origin)].add((int(s), str(k)))
    return out


def peer_sources(offers: list[list[list[Any]]], copies: list[list[list[Any]]], step: int, save: str) -> dict[int, int]:
    """``{host: holder}``: for each host whose own memory lacks ``(step, save)``, the lowest host holding a
    copy of its part."""
    out = {}
    for k, offer in enumerate(offers):
        if (step, save) not in {(int(s), str(x)) for s, x in offer}:
            out[k] = min(j for j, held in enumerate(copies) if j != k and [k, step, save] in
                         [[int(o), int(s), str(x)] for o, s, x in held])
    return out


def candidates(offers: list[list[list[Any]]], storage_step: int | None,
               copies: list[list[list[Any]]] | None = None) -> list[Candidate[tuple[Tier, int, str | None]]]:
    """What the hosts' offers and the storage answer hold, as the core decision's candidates, each laid out as
    ``(tier, step, save)``: every ``[step, save]`` every process offered, or can get from a peer's copy
    (``copies[j]``: the ``[origin, step, save]`` host j holds) (``memory``; of two saves of one step, the
    greater first: the one the decision takes), and the storage step (``storage``)."""
    common = set.intersection(*_reachable(offers, copies)) if offers else set()

    def memory(step: int, save: str) -> Candidate[tuple[Tier, int, str | None]]:
        return Candidate(Tier.MEMORY, step, lambda: (Tier.MEMORY, step, save))

    held = [memory(step, save) for step, save in sorted(common, reverse=True)]
    if storage_step is not None:
        stored = storage_step
        held.append(Candidate(Tier.STORAGE, stored, lambda: (Tier.STORAGE, stored, None)))
    return held


def decide(offers: list[list[list[Any]]], storage_step: int | None, copies: list[list[list[Any]]] | None = None,
           request: ResumeRequest | None = None) -> tuple[str, int | None, str | None] | Refusal:
    """``(tier, step, save)`` by the one resume decision (``trainer_client/core/_resume_decision.py``) over the
    ``candidates`` of the offers and the storage step: the newest, memory at a tie (the faster restore), the step
    ``request`` asks for when it asks for one; ``("none", None, None)`` when no tier holds a step, the refusal
    when the decision refuses otherwise (a step asked for that no tier holds)."""
    decided = decide_resume(candidates(offers, storage_step, copies), request)
    if not isinstance(decided, Refusal):
        return decided
    if refusal_kind(decided.code).nothing_to_resume:
        return "none", None, None
    return decided


class ResumeAgreement(JobProcess):
    """The resume step of one JAX job, agreed by all its processes (one instance per process)."""

    def __init__(self, job: str, shm_dir: str | None, client: CkptdClient, *, process_index: int,
                 process_count: int, store: KeyValueStore | None = None) -> None:
        super().__init__(process_index, process_count, store=store)
        self.job = job
        self.shm_dir = shm_dir
        self.client = client
        self._round = 0  # every process agrees as often as the others, in the same order: the same keys
        self.decision: dict[str, Any] | None = None
        self.storage_plan: ResumePlan | None = None
        self.timings: dict[str, float] = {}  # seconds per phase of the last round (the bench reports them)
        self._planned: ResumePlan | None = None  # process 0's memory plan of the decided step, made once
        self.peer_source: int | None = None  # the host whose copy of this host's part was restored (last round)
        self._fetch_error: Exception | None = None  # why this host's part could not be brought back from a peer

    def _key(self, name: str) -> str:
        return f"ckptd/resume/{self.job}/{self._round}/{name}"

    def plan(self, request: ResumeRequest) -> ResumePlan | None:
        """The plan of the step every process restores (this process's part of it, or the storage step), or
        None when the job has no step anywhere. ``CkptdRequestError`` in every process when ckptd refused."""
        self._round += 1
        self.timings = {}
        self._planned = None
        self.peer_source, self._fetch_error = None, None
        start = time.perf_counter()
        storage = self._ask_storage(request) if self.index == 0 else None  # overlaps the listing and the waits
        parts = own_parts(self.shm_dir, self.job, self.index, self.count, request.step) \
            if request.use_memory_tier else []
        copies = copy_parts(self.shm_dir, self.job, self.count, request.step) if request.use_memory_tier else []
        self.timings["list_parts_s"] = time.perf_counter() - start
        self.store.key_value_set(self._key(f"offer/{self.index}"), json.dumps({
            "parts": [[p.step, p.save] for p in parts],
            "copies": [[p.meta.process_index, p.step, p.save] for p in copies]}))
        if storage is not None:
            self._decide(request, parts, copies, storage)
        waited = time.perf_counter()
        decision = json.loads(self.store.blocking_key_value_get(self._key("decision"), OFFER_TIMEOUT_MS))
        self.timings["decision_wait_s"] = time.perf_counter() - waited
        self.decision = decision
        if decision.get("refused"):
            raise CkptdRequestError(*decision["refused"])
        self.storage_plan = (ResumePlan.model_validate(decision[Tier.STORAGE])
                             if decision.get(Tier.STORAGE) is not None else None)
        self.timings["agreement_s"] = time.perf_counter() - start
        if decision["tier"] == Tier.MEMORY:
            source = decision.get("sources", {}).get(str(self.index))
            if source is not None:  # this host's memory lacks its part: its sidecar brings it back from a peer
                parts = self._fetch(decision["step"], decision["save"], int(source), request)
                if self._fetch_error is not None:
                    return self.storage_plan
            part = next((p for p in parts if p.step == decision["step"] and p.save == decision["save"]), None)
            if part is None:  # cannot be: this process offered it
                raise RuntimeError(f"the agreed memory step {decision['step']} is not in this host's memory")
            if source is None and (earlier := brought_from(part.path)) is not None:
                source = self.peer_source = earlier  # brought back by the sidecar before this process asked
            plan = self._planned or memory_snapshot_plan(job=self.job, request=request,
                                                         snapshot=(part.path, part.meta))
            return plan.model_copy(update={"source": "memory_agreement", "notes": [
                *plan.notes, f"agreed by {self.count} processes: each restores its own part of step {part.step} "
                "from memory" + (f" (this host's brought back from host {source}'s copy)" if source is not None
                                 else "")]})
        return self.storage_plan

    def _fetch(self, step: int, save: str, source: int, request: ResumeRequest) -> list[Part]:
        """Ask this host's sidecar, through the client (``POST /v1/jobs/{job}/peer-fetch``), for its part of
        ``step`` from host ``source``'s copy; this host's parts after it (``_fetch_error`` set when it could not be
        brought back: the sidecar's answer says why, or it refused, its peer channel off, or did not answer; the
        restore then fails over to storage in every process)."""
        fetched = time.perf_counter()
        error: str | None = "no shared-memory directory"
        if self.shm_dir is not None:
            try:
                asked = PeerFetchRequest(step=step, source=source, origin=self.index, count=self.count,
                                         save_id=json.loads(save)[0])
                answer = self.client.peer_fetch(self.job, asked)
                error = None if answer.ok else answer.error or "failed"
            except (CkptdError, ValidationError) as exc:  # refused (its channel off), no answer, or not askable
                error = str(exc)
        self.timings["peer_fetch_s"] = time.perf_counter() - fetched
        parts = own_parts(self.shm_dir, self.job, self.index, self.count, request.step)
        if error is None and not any((p.step, p.save) == (step, save) for p in parts):
            error = "the part brought back is not the agreed save"
        if error is not None:
            _log.error("this host's part of step %s could not be brought back from host %d: %s", step, source, error)
            self._fetch_error = RuntimeError(f"part of step {step} from host {source}: {error}")
            if self.storage_plan is None:  # nothing to fall back to: every process must hear it now
                self.store.key_value_set(self._key(f"restored/{self.index}"), f"failed: {self._fetch_error}")
                raise self._fetch_error
        else:
            self.peer_source = source
            _log.info("this host's part of step %s brought back from host %d in %.2f s", step, source,
                      self.timings["peer_fetch_s"])
        return parts

    def _ask_storage(self, request: ResumeRequest) -> Future[ResumePlan | None]:
        """Process 0's storage answer, asked on a thread now and awaited by ``_decide``."""
        def ask() -> ResumePlan | None:
            asked = time.perf_counter()
            try:
                return self.client.resume(self.job, request.model_copy(update={"use_memory_tier": False}))
            except NoCheckpointError:
                return None
            finally:
                self.timings["storage_answer_s"] = time.perf_counter() - asked
        pool = ThreadPoolExecutor(1, thread_name_prefix="ckptd-storage-answer")
        try:
            return pool.submit(ask)
        finally:
            pool.shutdown(wait=False)  # the call runs on; the thread ends with it

    def _decide(self, request: ResumeRequest, parts: list[Part], copies: list[Part],
                asked: Future[ResumePlan | None]) -> None:
        """Process 0: the storage answer asked before, every offer, the decision (published, read back like
        the others)."""
        storage: ResumePlan | None = None
        refused: list[Any] | None = None
        waited = time.perf_counter()
        try:  # first: an error getting it reaches every process at once, not after the offers
            storage = asked.result()
        except CkptdRequestError as exc:
            refused = [exc.status, exc.code, exc.message]
        except Exception as exc:  # every process must hear of it, or they wait out the timeout
            self.store.key_value_set(self._key("decision"), json.dumps(
                {"tier": "none", "refused": [503, "UNAVAILABLE", f"no storage answer: {exc}"]}))
            raise
        finally:
            self.timings["storage_wait_s"] = time.perf_counter() - waited
        offered = [json.loads(self.store.blocking_key_value_get(self._key(f"offer/{k}"), OFFER_TIMEOUT_MS))
                   for k in range(self.count)]
        offers, held = [o["parts"] for o in offered], [o.get("copies", []) for o in offered]
        self.timings["offers_wait_s"] = time.perf_counter() - waited - self.timings["storage_wait_s"]
        storage_step = storage.step if storage is not None else None

        def settled(decided: tuple[str, int | None, str | None] | Refusal) -> tuple[str, int | None, str | None]:
            nonlocal refused  # a refusal of the decision's own reaches every process as ckptd's would
            if not isinstance(decided, Refusal):
                return decided
            if refused is None:
                refused = [refusal_status(decided.code), decided.code.value,
                           refusal_message(self.job, decided, where="every host's memory and storage")]
            return "none", None, None

        tier, step, save = settled(decide(offers, storage_step, held, request))
        sources = peer_sources(offers, held, step, save) if tier == Tier.MEMORY and step is not None and save else {}
        # restored onto the same global mesh only: each process holds just its own regions (any part of the step
        # here tells its mesh; with none here, a host that fetched its part finds a mismatch at its restore)
        mine = next((p for p in [*parts, *copies] if (p.step, p.save) == (step, save)), None)
        if tier == Tier.MEMORY and mine is not None:
            planned = memory_snapshot_plan(job=self.job, request=request, snapshot=(mine.path, mine.meta))
            if planned.mesh.shape != mine.meta.training.mesh.shape:
                _log.warning("step %s is in every host's memory, but the devices alive ask for mesh %s, not the "
                             "saved %s: restoring from storage", step, planned.mesh.shape,
                             mine.meta.training.mesh.shape)
                tier, step, save = settled(decide([], storage_step, request=request))  # the decision without memory
                sources = {}
            elif mine in parts:
                self._planned = planned
        _log.info("resume agreed by %d processes: %s step %s (offers: %s; peer copies: %s; from peers: %s; "
                  "storage: %s)", self.count, tier, step, [[s for s, _ in offer] for offer in offers],
                  [[(o, s) for o, s, _ in h] for h in held], sources, storage_step)
        self.store.key_value_set(self._key("decision"), json.dumps({
            "tier": tier, "step": step, "save": save, "refused": refused,
            "sources": {str(k): j for k, j in sources.items()},
            Tier.STORAGE: storage.model_dump(mode="json") if storage is not None else None}))

    def restore(self, plan: ResumePlan, target_for: Callable[[ResumePlan], PyTree]) -> tuple[PyTree, ResumePlan]:
        """``(state, plan restored)``: the agreed plan's step onto ``target_for(plan)`` in every process, or
        the storage step in every process when any process's memory restore failed (the one restore loop,
        ``trainer_client/runtime/restore/_restore_loop.py``, with a memory failure agreed across the processes)."""
        budget = self.client.settings.restore_host_bytes
        agreed_memory = self._fetch_error is not None or plan.tier == Tier.MEMORY

        def restore_step(chosen: ResumePlan) -> PyTree:
            if chosen is plan:  # the agreed step: every process tells the others how it went
                return self._restore_agreed(plan, target_for, budget)
            return restore_from_plan(chosen, target_for(chosen), budget)  # storage, after memory failed somewhere

        def failed_tier(chosen: ResumePlan, error: Exception) -> Tier | None:
            return Tier.MEMORY if chosen is plan and agreed_memory else None  # any failure, in any process

        def storage(excluded: frozenset[Tier]) -> ResumePlan | None:
            self.peer_source = None
            return self.storage_plan

        done = restore_by_plan(plan, restore_step, storage, failed_tier=failed_tier)
        assert done is not None  # a memory failure with no storage plan stands (FAILOVER)
        return done

    def _restore_agreed(self, plan: ResumePlan, target_for: Callable[[ResumePlan], PyTree],
                        host_bytes: int | None) -> PyTree:
        """This process's restore of the agreed plan, then every process's outcome (``restored/<k>``): the state,
        or the error (this process's own, else one naming the processes that failed)."""
        state: PyTree = None
        error: Exception | None = None
        try:
            if self._fetch_error is not None:  # this host's part is nowhere here: the job takes storage
                raise self._fetch_error
            state = restore_from_plan(plan, target_for(plan), host_bytes)
        except Exception as exc:  # told to the others first: they must not wait for this process in vain
            error = exc
        self.store.key_value_set(self._key(f"restored/{self.index}"),
                                 "ok" if error is None else f"failed: {type(error).__name__}: {error}"[:2000])
        outcomes = [self.store.blocking_key_value_get(self._key(f"restored/{k}"), RESTORE_TIMEOUT_MS)
                    for k in range(self.count)]
        failed = [f"process {k}: {o}" for k, o in enumerate(outcomes) if o != "ok"]
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"restore of step {plan.step} from {plan.tier} failed in {'; '.join(failed)}")
        return state


__all__ = ["Part", "ResumeAgreement", "candidates", "copy_parts", "decide", "own_parts", "peer_sources"]
