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
At a point, the leader chooses (when something new was measured), publishes the periods in force from that step
and the step of the next point (create-only, ``ckptd/autopilot/<incarnation>/<n>``), and goes on without waiting;
every other process waits for point ``n`` (at most ``CKPTD_ROUTE_TIMEOUT_S``: only a dead leader is waited for,
and a dead process ends the job), checks that it was made at the step it is at, and applies it. Between points
nothing is exchanged and the periods do not change, so every process saves at the same steps. The points are about
``AGREE_INTERVAL_S`` of the leader's steps apart: a key of a few hundred bytes each. Once, at the first point,
every other process tells its host-memory budget (``budget/<k>``) and the leader takes the smallest, so that its
choice fits every host. The encoding is checked on reading (``AgreedPeriods.decode``): a value that is not what a
leader writes is an error, never a guess.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from trainer_client.config import ClientSettings
from trainer_client.runtime.multihost._job_store import JobProcess, KeyValueStore, job_incarnation

AGREE_INTERVAL_S = 30.0  # seconds of the leader's steps between two agreement points
FIRST_INTERVAL_STEPS = 10  # steps to the next point while the step time is not known
MAX_INTERVAL_STEPS = 10_000
_MAX_FIELDS = 200  # fields of a decision carried to the other processes (its event's: ~60)
_MAX_TEXT = 2000


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
        if len(text) > 64 << 10:
            raise ValueError(f"an agreed choice of {len(text)} characters")
        value = json.loads(text)
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


class PeriodsAgreement(JobProcess):
    """The agreement points of one process of a job of ``process_count`` (process 0 leads). ``incarnation``: the
    job's incarnation (``job_incarnation()`` when not given: the same in every process); ``timeout_ms``: the wait
    for the leader's choice at a point, unless given the ``route_timeout_s`` of ``settings`` (or the process's)."""

    def __init__(self, process_index: int, process_count: int, *, incarnation: str | None = None,
                 store: KeyValueStore | None = None, timeout_ms: int | None = None,
                 settings: ClientSettings | None = None) -> None:
        super().__init__(process_index, process_count, store=store, timeout_ms=timeout_ms, settings=settings)
        self._incarnation = incarnation
        self.points = 0  # agreement points passed
        self.next_step = 0  # the first boundary is the first point

    @property
    def leader(self) -> bool:
        return self.index == 0

    def _key(self, name: str) -> str:
        if self._incarnation is None:
            self._incarnation = job_incarnation(self.store)
        return f"ckptd/autopilot/{self._incarnation}/{name}"

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
        agreed = AgreedPeriods.decode(self.store.blocking_key_value_get(self._key(str(self.points)), self.timeout_ms))
        if agreed.step != step:
            raise RuntimeError(f"process {self.index} is at step {step} at agreement point {self.points}, which "
                               f"process 0 passed at step {agreed.step}: the processes do not step alike")
        self._passed(agreed)
        return agreed

    def _passed(self, agreed: AgreedPeriods) -> None:
        self.points += 1
        self.next_step = agreed.next_step

    def tell_budget(self, budget_bytes: float | None) -> None:
        """Another process, at the first point: its host-memory budget for the leader (None: not known)."""
        self.store.key_value_set(self._key(f"budget/{self.index}"), json.dumps(budget_bytes))

    def budgets(self) -> list[float | None]:
        """The leader, at the first point: every other process's host-memory budget (waited for); a value that is
        not a positive finite number is not known (None)."""
        out: list[float | None] = []
        for k in range(1, self.count):
            try:
                value = json.loads(self.store.blocking_key_value_get(self._key(f"budget/{k}"), self.timeout_ms))
            except ValueError:
                value = None
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
            out.append(float(value) if ok else None)
        return out


__all__ = ["AGREE_INTERVAL_S", "FIRST_INTERVAL_STEPS", "MAX_INTERVAL_STEPS", "AgreedPeriods", "PeriodsAgreement",
           "interval_steps"]
