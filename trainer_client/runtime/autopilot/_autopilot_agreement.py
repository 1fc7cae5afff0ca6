"""One choice of checkpoint periods for every process of a multi-controller job (docs/planning.md, "Autopilot in a
run": "In a multi-controller job").

Why it exists: each process of a multi-controller job saves its own part of every step, so every process must
snapshot and save at the same steps, or a step's parts will not all exist (and a persistent save's route, agreed
per save, would wait for a process that never comes). Each process's autopilot measures its own costs; left
alone, they would choose apart. So process 0 (the leader) chooses for all and the others apply its choice at the
same step, through the channel the job already agrees on its resume step and its saves' routes with: JAX's
coordination-service key-value store (``trainer_client.runtime.multihost._job_store``; it starts empty with every
incarnation of the job, so its keys never go stale).

The protocol, at *agreement points*: the first step boundary of the run, then each step the previous point named.
At a point, every other process reports to the leader (``process/<k>``, overwritten each time: ``ProcessReport``)
what it measured, how many points it has read, and, for the first point, its host-memory budget; the leader
chooses (when something new was measured) from the slowest process's costs (``MeasuredCosts.slowest``: the job
waits for its slowest host) and, once, the smallest budget (its choice must fit every host), publishes the periods
in force from that step and the step of the next point (create-only, ``<n>``), and goes on without waiting. At
the first point it waits for every report (at most ``CKPTD_ROUTE_TIMEOUT_S``); later it reads those there are and
goes on. Every other process waits for point ``n`` (at most ``CKPTD_ROUTE_TIMEOUT_S``: only a dead leader is waited
for, and a dead process ends the job), checks that it was made at the step it is at, and applies it. Between points
nothing is exchanged and the periods do not change, so every process saves at the same steps. The points are about
``AGREE_INTERVAL_S`` of steps apart (of the slowest process's step time): a key of a few hundred bytes each.

What the store holds stays bounded: a process that has read point ``k`` has read every point before it (it waits
for them in order) and never reads them again, so the leader deletes each point every report says was read, when
it next reads the reports. The store holds the points some process has not read yet (in a job that steps together,
one or two), one report per other process, no more over any number of points. Keys are
``ckptd/autopilot/<incarnation>/<run>/``: ``run`` counts this process's agreements in this incarnation of the job
(every process makes the same runners in the same order); the leader deletes the previous run's keys once every
process has reported in this one (none of them reads the previous run's again). A new incarnation has a new store.

What is read from the store is checked (``AgreedPeriods.decode``, ``ProcessReport.decode``): a choice that is not
what a leader writes is an error, never a guess; a report that is not what a process writes is ignored (logged):
its costs are not pooled, its budget is not known, and no point is deleted on its word.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from trainer_client.config import ClientSettings
from trainer_client.runtime.autopilot._autopilot_costs import MAX_BYTES, MeasuredCosts
from trainer_client.runtime.multihost._job_store import JobProcess, KeyValueStore, job_incarnation

AGREE_INTERVAL_S = 30.0  # seconds of the leader's steps between two agreement points
FIRST_INTERVAL_STEPS = 10  # steps to the next point while the step time is not known
MAX_INTERVAL_STEPS = 10_000
_MAX_FIELDS = 200  # fields of a decision carried to the other processes (its event's: ~60)
_MAX_TEXT = 2000
_MAX_REPORT = 16 << 10  # characters of a process's report (~1 KB)
_log = logging.getLogger(__name__)
_runs: dict[tuple[str, int], int] = {}  # (incarnation, process index) -> this process's agreements in it so far


def interval_steps(step_s: float | None) -> int:
    """Steps from one agreement point to the next: ``AGREE_INTERVAL_S`` of steps of ``step_s``."""
    if step_s is None or not math.isfinite(step_s) or step_s <= 0:
        return FIRST_INTERVAL_STEPS
    return max(1, min(MAX_INTERVAL_STEPS, math.ceil(AGREE_INTERVAL_S / step_s)))


def _period(value: Any, name: str, *, none: bool) -> int | None:
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a step count, got {value!r}")
    return value


def _json(text: str, limit: int, what: str) -> Any:
    """``text`` parsed, at most ``limit`` characters; ``ValueError`` for anything else (nesting too deep too)."""
    if len(text) > limit:
        raise ValueError(f"{what} of {len(text)} characters")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} nested too deep") from None


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value))


@dataclass(frozen=True)
class AgreedPeriods:
    """The periods every process uses from ``step`` until the point at ``next_step``: a persistent save every
    ``persist`` steps, a memory-only snapshot every ``memory`` (None: none), saves through the memory tier or not
    (``memory_tier``); ``decision``: the leader's ``autopilot_decided`` fields when it changed the periods here (the
    others report the same event), with its one-line ``detail``."""

    step: int
    next_step: int
    persist: int
    memory: int | None
    memory_tier: bool
    decision: dict[str, Any] | None = None
    detail: str = ""

    def encode(self) -> str:
        return json.dumps({"step": self.step, "next": self.next_step, "persist": self.persist,
                           "memory": self.memory, "memory_tier": self.memory_tier, "decision": self.decision,
                           "detail": self.detail[:_MAX_TEXT]})

    @classmethod
    def decode(cls, text: str) -> AgreedPeriods:
        """The periods a leader published; ``ValueError`` for anything a leader does not write."""
        value = _json(text, 64 << 10, "an agreed choice")
        if not isinstance(value, dict):
            raise ValueError("an agreed choice is a JSON object")
        step = _period(value.get("step"), "step", none=False)
        after = _period(value.get("next"), "next", none=False)
        persist = _period(value.get("persist"), "persist", none=False)
        memory = _period(value.get("memory"), "memory", none=True)
        assert step is not None and after is not None and persist is not None
        if after <= step or memory == 0:
            raise ValueError(f"an agreed choice at step {step} names the next at {after} and memory every {memory}")
        memory_tier, decision, detail = value.get("memory_tier"), value.get("decision"), value.get("detail", "")
        if not isinstance(memory_tier, bool) or not isinstance(detail, str) or len(detail) > _MAX_TEXT:
            raise ValueError("an agreed choice's memory_tier is a bool and its detail a short string")
        if decision is not None and not (
                isinstance(decision, dict) and len(decision) <= _MAX_FIELDS
                and all(isinstance(k, str) and k.startswith("autopilot_") and _scalar(v) and
                        (not isinstance(v, str) or len(v) <= _MAX_TEXT) for k, v in decision.items())):
            raise ValueError("an agreed choice's decision is a flat object of autopilot_ fields")
        return cls(step, after, persist, memory, memory_tier, decision, detail)


@dataclass(frozen=True)
class ProcessReport:
    """What another process tells the leader at an agreement point: ``read``, the points it has read (every one
    before that index: it reads none of them again); ``budget``, its host-memory budget (None: not known); ``costs``,
    what it measured."""

    read: int
    budget: float | None
    costs: MeasuredCosts

    def encode(self) -> str:
        return json.dumps({"read": self.read, "budget": self.budget, "costs": self.costs.wire()})

    @classmethod
    def decode(cls, text: str, published: int) -> ProcessReport:
        """A report read from the store, ``published`` points published so far; ``ValueError`` for anything a
        process does not write (a budget that is not a positive number of bytes up to ``MAX_BYTES`` among them)."""
        value = _json(text, _MAX_REPORT, "a report")
        if not isinstance(value, dict) or set(value) != {"read", "budget", "costs"}:
            raise ValueError("a report is an object of read, budget and costs")
        read, budget = value["read"], value["budget"]
        if isinstance(read, bool) or not isinstance(read, int) or not 0 <= read <= published:
            raise ValueError(f"a report of {read!r} points read, of {published} published")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or not 0 < budget <= MAX_BYTES or not math.isfinite(budget)):
            raise ValueError(f"a host-memory budget of {budget!r} bytes")
        return cls(read, None if budget is None else float(budget), MeasuredCosts.checked(value["costs"]))


class PeriodsAgreement(JobProcess):
    """The agreement points of one process of a job of ``process_count`` (process 0 leads). ``incarnation``: the
    job's incarnation (``job_incarnation()`` when not given: the same in every process); ``timeout_ms``: the wait
    for the leader's choice at a point, and for the others' first reports, unless given the ``route_timeout_s`` of
    ``settings`` (or the process's)."""

    def __init__(self, process_index: int, process_count: int, *, incarnation: str | None = None,
                 store: KeyValueStore | None = None, timeout_ms: int | None = None,
                 settings: ClientSettings | None = None) -> None:
        super().__init__(process_index, process_count, store=store, timeout_ms=timeout_ms, settings=settings)
        self._incarnation = incarnation
        self._run: tuple[str, int] | None = None  # the incarnation, and this run's number in it
        self.points = 0  # agreement points passed
        self.next_step = 0  # the first boundary is the first point
        self.kept = 0  # the leader: the first point whose key is not deleted yet

    @property
    def leader(self) -> bool:
        return self.index == 0

    def _key(self, name: str, run: int = 0) -> str:
        """The key of ``name`` in this run (``run``: in the one that many before): ``ckptd/autopilot/<incarnation>/
        <run>/<name>``."""
        if self._run is None:
            incarnation = self._incarnation if self._incarnation is not None else job_incarnation(self.store)
            self._run = incarnation, _runs.get((incarnation, self.index), -1) + 1
            _runs[incarnation, self.index] = self._run[1]
        return f"ckptd/autopilot/{self._run[0]}/{self._run[1] - run}/{name}".rstrip("/")

    def due(self, step: int) -> bool:
        """Whether the boundary of ``step`` is an agreement point (the hot path: one comparison)."""
        return step >= self.next_step

    def publish(self, agreed: AgreedPeriods) -> None:
        """The leader: ``agreed`` is the choice of this point (its step is the boundary's)."""
        if not self.leader:
            raise RuntimeError("only process 0 publishes the agreed periods")
        self.store.key_value_set(self._key(str(self.points)), agreed.encode())
        self._passed(agreed)

    def receive(self, step: int) -> AgreedPeriods:
        """Another process: the leader's choice for this point, waited for; it must be made at ``step``."""
        text = self.store.blocking_key_value_get(self._key(str(self.points)), self.timeout_ms)
        agreed = AgreedPeriods.decode(text)
        if agreed.step != step:
            raise RuntimeError(f"process {self.index} is at step {step} at agreement point {self.points}, which "
                               f"process 0 passed at step {agreed.step}: the processes do not step alike")
        self._passed(agreed)
        return agreed

    def _passed(self, agreed: AgreedPeriods) -> None:
        self.points += 1
        self.next_step = agreed.next_step

    def report(self, costs: MeasuredCosts, budget_bytes: float | None) -> None:
        """Another process, at each point before it waits for the choice: its costs, its host-memory budget (None:
        not known) and the points it has read, for the leader."""
        if self.leader:
            raise RuntimeError("process 0 reports to no one")
        report = ProcessReport(self.points, budget_bytes, costs)
        self.store.key_value_set(self._key(f"process/{self.index}"), report.encode(), allow_overwrite=True)

    def reports(self) -> list[ProcessReport | None]:
        """The leader, before it publishes a point: every other process's latest report (None: none, or one
        refused, logged), waited for at the first point; then each point every report says was read is deleted,
        and at the first point the previous run's keys."""
        first, keys = self.points == 0, {self._key(f"process/{k}"): k for k in range(1, self.count)}
        if first:
            texts = {k: self.store.blocking_key_value_get(key, self.timeout_ms) for key, k in keys.items()}
        else:
            texts = {keys[key]: text for key, text in self.store.key_value_dir_get(self._key("process")) if key in keys}
        out: list[ProcessReport | None] = []
        for k in range(1, self.count):
            report = None
            if k in texts:
                try:
                    report = ProcessReport.decode(texts[k], self.points)
                except ValueError as exc:
                    _log.warning("autopilot: process %d's report refused (its costs, budget and progress are not "
                                 "counted): %s", k, exc)
            out.append(report)
        read = min((r.read if r is not None else self.kept for r in out), default=self.points)
        for point in range(self.kept, read):
            self.store.key_value_delete(self._key(str(point)))
        self.kept = max(self.kept, read)
        assert self._run is not None
        if first and self._run[1] > 0:  # every process is in this run: none reads the previous one's keys again
            self.store.key_value_delete(self._key("", run=1))
        return out


__all__ = ["AGREE_INTERVAL_S", "FIRST_INTERVAL_STEPS", "MAX_INTERVAL_STEPS", "AgreedPeriods", "PeriodsAgreement",
           "ProcessReport", "interval_steps"]
