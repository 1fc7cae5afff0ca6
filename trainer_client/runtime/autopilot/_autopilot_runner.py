"""The runner's autopilot: the periods of the replica snapshots, the shared-memory snapshots and the persistent
saves re-chosen at step boundaries from what the run measures and the failures it sees (docs/planning.md,
"Autopilot in a run").

Why it exists: the best periods depend on each tier's costs and on the failure rate, and both are known only
once the run measures them and keep moving (a slower storage, a bad rack). The choice is the period model's
(``trainer_client.core.planning``: the same one ``ckptd advise`` answers from), made by its ``Autopilot`` with
hysteresis from the costs ``CostMeter`` keeps (``trainer_client.runtime.autopilot._autopilot_costs``), the replica
pacer's
measurements, and the estimate ``FailureHistory`` makes of the failure rate from a prior and each recovery (with
the tier it restored from). What the model is given of the run's constraints: a period the user set is fixed (both
bounds at it: the model chooses the others around it and the runner leaves it alone); ``AutopilotOptions``'
bounds and bound on steps lost; and the replica tier's overhead budget, whose smallest period (the pacer's 2%
rule, its period in force) is the replica tier's floor: the autopilot may snapshot less often than the pacer
would, never more. The host's memory and the storage's bandwidth and request rate are constraints too: what the
host-memory tiers may hold together (``AutopilotOptions.host_memory_budget_bytes``, else the host's limit:
``_host_memory``) against each tier's bytes (a tier that does not fit beside the others is turned off: the replica
tier for the rest of the run, the shared-memory tier while it does not fit, its saves going to Orbax meanwhile),
and the storage limits of the options against what a save writes (its bytes, and its requests: ``Footprint``).

In a multi-controller job process 0 chooses and every process applies its choice at the same step
(``_autopilot_agreement``: agreement points through the job's key-value store), from the slowest process's costs:
the others report theirs at each point.

Cheap on the hot path: ``at_boundary`` times the step and compares a count of measurements with the one the last
choice was made at; the model runs at most once per new measurement (a closed replica cycle, a save timed, a
recovery) and at most every ``MIN_INTERVAL_S`` but right after a recovery. Each change of the periods is an
``autopilot_decided`` event with the decision's inputs and the expected goodput before and after
(``Decision.fields``), which ckptd exports as gauges.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from trainer_client.config import ClientSettings
from trainer_client.core.format._snapshot_dirs import persisted_time
from trainer_client.core.planning import (
    Autopilot,
    Constraints,
    Decision,
    EarlierRuns,
    FailureHistory,
    FailurePrior,
    TierCosts,
)
from trainer_client.core.protocol import Tier
from trainer_client.runtime.autopilot._autopilot_agreement import AgreedPeriods, PeriodsAgreement, interval_steps
from trainer_client.runtime.autopilot._autopilot_costs import CostMeter, Footprint, MeasuredCosts, estimated_requests
from trainer_client.runtime.autopilot._host_memory import HostMemory, host_memory_budget
from trainer_client.runtime.autopilot._options import AutopilotOptions
from trainer_client.runtime.elastic._elastic_config import ElasticConfig
from trainer_client.runtime.replicas._options import ReplicaOptions
from trainer_client.runtime.replicas._replica_pacing import KindCosts
from trainer_client.runtime.saving._saver import Saver

_log = logging.getLogger(__name__)
DEFAULT_CHECKPOINT_PERIOD = 10  # a persistent save every this many steps until the autopilot chooses (or without it)
MIN_INTERVAL_S = 10.0  # seconds of the run between two choices, but right after a recovery
BOUNDS = {Tier.REPLICAS: "replica_bounds", Tier.MEMORY: "memory_bounds", Tier.STORAGE: "persist_bounds"}  # options
TIERS = tuple(Tier)  # the resume plan's tiers, fastest first (their values are the event's field names)


class PacedReplicas(Protocol):
    """What the autopilot uses of the replica tier (``RunnerReplicas``)."""

    options: ReplicaOptions
    off_reason: str | None
    autopilot_period: int | None

    @property
    def cycles_closed(self) -> int: ...

    @property
    def host_bytes(self) -> int: ...

    def turn_off(self, reason: str) -> None: ...

    @property
    def paced_period(self) -> int | None: ...

    def measured(self) -> tuple[float, KindCosts] | None: ...


class _Writer(Protocol):
    def is_saving(self) -> bool: ...


class EarlierRunsAsked:
    """The job's earlier runs as ckptd's history counts them (``GET /v1/jobs/{job}/goodput``: running time and
    failures recovered in a run's process), asked once, in the background: a ckptd that is down or slow costs the
    run nothing, and the autopilot goes without (``value`` stays None)."""

    def __init__(self, client: _History, job: str) -> None:
        self.value: EarlierRuns | None = None
        self._done = threading.Event()
        threading.Thread(target=self._ask, args=(client, job), name="ckptd-autopilot-history", daemon=True).start()

    def _ask(self, client: _History, job: str) -> None:
        try:
            g = client.goodput(job)
            self.value = EarlierRuns.from_goodput(g.wall_seconds, g.badput_seconds.down, g.recoveries)
        except Exception as exc:  # any failure to learn the history leaves the autopilot without it
            _log.info("autopilot: the job's earlier runs not learned from ckptd: %s", exc)
        finally:
            self._done.set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)


class _History(Protocol):
    def goodput(self, job: str) -> Any: ...  # CkptdClient's: p.Goodput


class _Processes(Protocol):
    """A multi-controller job's processes (the runner's ``ResumeAgreement``): this one's index, and how many."""

    index: int
    count: int


class RunParts(Protocol):
    """What the autopilot is made from of its runner (``ElasticRunner``)."""

    @property
    def config(self) -> ElasticConfig: ...

    @property
    def settings(self) -> ClientSettings: ...

    @property
    def replicas(self) -> PacedReplicas | None: ...

    @property
    def saver(self) -> Saver: ...

    @property
    def checkpointer(self) -> _Writer: ...

    @property
    def agreement(self) -> _Processes | None: ...

    @property
    def client(self) -> _History: ...

    def emit(self, kind: str, step: int | None = None, detail: str = "", **fields: Any) -> None: ...


@dataclass
class LivePeriods:
    """The periods in force of the saves the step boundary makes: a persistent save every ``persist`` steps (0:
    none), a memory-only snapshot every ``memory`` (None: none), through the memory tier or not (``memory_tier``:
    off, every save goes to Orbax; the ``Saver`` is told). The replica tier's is its own
    (``RunnerReplicas.autopilot_period``)."""

    persist: int
    memory: int | None
    memory_tier: bool = True


class RunnerAutopilot:
    """One run's autopilot: ``at_boundary(step)`` at every step boundary (the periods in force), ``observe`` for
    every event the runner emits. ``owned``: the tiers whose period it chooses (those the user left unset).

    ``agreement``: a multi-controller job's agreement points (None: a single controller). ``footprint``: what the
    tiers hold and write; ``host_memory``: the host-memory tiers' budget (None: none known); ``use_memory_tier``:
    told when the shared-memory tier turns off or on (``Saver.use_memory_tier``)."""

    def __init__(self, options: AutopilotOptions, *, checkpoint_period: int | None, memory_period: int | None,
                 memory_tier: bool, replicas: PacedReplicas | None, meter: CostMeter,
                 emit: Callable[..., None], agreement: PeriodsAgreement | None = None,
                 history: _History | None = None, job: str = "", footprint: Footprint | None = None,
                 host_memory: HostMemory | None = None,
                 use_memory_tier: Callable[[bool], None] | None = None) -> None:
        self.options = options
        self.meter = meter
        self.replicas = replicas
        self.agreement = agreement
        self.footprint = footprint or Footprint()
        self.host_memory = host_memory
        self._use_memory_tier = use_memory_tier
        self._emit = emit
        self._memory_tier = memory_tier
        self._fixed: dict[str, int | None] = {Tier.REPLICAS: replicas.options.period if replicas else None,
                                              Tier.MEMORY: memory_period, Tier.STORAGE: checkpoint_period}
        self.periods = LivePeriods(DEFAULT_CHECKPOINT_PERIOD if checkpoint_period is None else checkpoint_period,
                                   memory_period)
        owned = {Tier.REPLICAS: replicas is not None and replicas.options.period is None,
                 Tier.MEMORY: memory_tier and memory_period is None, Tier.STORAGE: checkpoint_period is None}
        self.owned = frozenset(name for name, mine in owned.items() if mine)
        self.off_reason: str | None = None
        if not options.enabled:
            self.off_reason = "off (AutopilotOptions.enabled=False)"
        elif checkpoint_period == 0:
            self.off_reason = "off: no periodic persistent save (checkpoint_period=0) to plan around"
        elif not self.owned:
            self.off_reason = "off: every period is set"
        if self.off_reason is not None and options.enabled and self.owned:
            _log.info("autopilot %s; the periods stay as configured", self.off_reason)
        # the job's earlier runs, asked of ckptd where no MTBF is configured: part of the prior (``_history``); in
        # a multi-controller job by the process that chooses only
        chooses = agreement is None or agreement.leader
        self.earlier = (EarlierRunsAsked(history, job) if history is not None and self.off_reason is None
                        and options.mtbf_hours is None and chooses else None)
        self.pilot: Autopilot | None = None
        self.decisions: list[Decision] = []  # the changes this process chose
        self.agreed: list[AgreedPeriods] = []  # a multi-controller job's: the choices in force, point by point
        self._tiers: tuple[str, ...] = ()  # the tiers the failure history counts shares of
        self._fed_at = meter.clock()  # running time fed to the failure estimate up to here
        self._exposure = 0.0  # before a prior: running time and failures seen, for the run's own prior
        self._failures = 0
        self._pending: int = 0  # failures detected whose recovery has not ended yet
        self._seen = 0  # measurements when the last choice was made
        self._last_choice: float | None = None
        self._urgent = False

    @classmethod
    def for_run(cls, runner: RunParts) -> RunnerAutopilot:
        """The autopilot of an ``ElasticRunner``: its config, its replica tier, the directory its shared-memory
        snapshots go to (where ckptd marks them persisted), its Orbax writer (whether a save is being written)."""
        config, saver = runner.config, runner.saver
        memory = saver.memory
        memory_dir = memory.dir if memory is not None else None
        meter = CostMeter(
            persisted_at=(lambda step: persisted_time(Path(memory_dir, str(step)))) if memory_dir else None,
            storage_busy=runner.checkpointer.is_saving)
        processes = runner.agreement
        agreement = (PeriodsAgreement(processes.index, processes.count, settings=runner.settings)
                     if processes is not None else None)
        footprint = Footprint(step_size=lambda: saver.last_size)
        if memory is not None:
            footprint = replace(footprint, memory_bytes=lambda: memory.held_bytes)
        return cls(config.autopilot, checkpoint_period=config.checkpoint_period,
                   memory_period=config.memory_tier.memory_period, memory_tier=memory_dir is not None,
                   replicas=runner.replicas, meter=meter, emit=runner.emit, agreement=agreement,
                   history=runner.client, job=config.job, footprint=footprint,
                   host_memory=host_memory_budget(config.autopilot.host_memory_budget_bytes),
                   use_memory_tier=saver.use_memory_tier)

    # ---- the hot path ------------------------------------------------------------------------------

    def at_boundary(self, step: int) -> LivePeriods:
        """A step boundary: timed; the periods chosen again when something new was measured (see the module)."""
        self.meter.boundary()
        if self.off_reason is not None:
            return self.periods
        if self.agreement is not None:
            if self.agreement.due(step):
                self._agree(step, self.agreement)
            return self.periods
        seen = self._measured()
        if seen == self._seen:
            return self.periods
        now = self.meter.clock()
        if not self._urgent and self._last_choice is not None and now - self._last_choice < MIN_INTERVAL_S:
            return self.periods
        self._seen = seen
        self._choose(step, now)
        return self.periods

    def _measured(self) -> int:
        """A count of what was measured so far: a choice needs making again only when it moved."""
        return self.meter.version + self._failures + (self.replicas.cycles_closed if self.replicas else 0)

    def observe(self, kind: str, step: int | None, fields: Mapping[str, Any]) -> None:
        """An event of the runner: costs for the meter; failures for the estimate (counted when their recovery
        ends, with the tier it restored from)."""
        if kind == "autopilot_decided":
            return
        self.meter.observe(kind, step, fields)
        if kind == "failure_detected":
            self._pending += 1
        elif kind == "recovered" and self._pending:
            restored = str(fields.get("restored_from") or "").split(":", 1)[0].strip()
            for k in range(self._pending):
                self._failed(restored if k == self._pending - 1 else None)
            self._pending = 0
            self._urgent = True  # the next boundary chooses again, whatever the interval

    # ---- the failure estimate ---------------------------------------------------------------------

    def _ran(self) -> None:
        now = self.meter.clock()
        ran, self._fed_at = max(0.0, now - self._fed_at), now
        if self.pilot is not None:
            self.pilot.history.ran(ran)
        else:
            self._exposure += ran

    def _failed(self, tier: str | None) -> None:
        self._ran()
        self._failures += 1
        if self.pilot is not None:
            self.pilot.history.failed(self._tiers.index(tier) if tier in self._tiers else None)

    def _history(self, tiers: tuple[str, ...]) -> Autopilot | None:
        """The autopilot over ``tiers``: made from the prior once there is one (the config's MTBF, or the mean
        interval of ``min_failures`` failures: the job's earlier runs' as ckptd counts them and this run's own,
        their running times added); made again, from the estimate so far, when the tiers change (the replica tier
        turned itself off)."""
        if self.pilot is not None and tiers == self._tiers:
            return self.pilot
        flat = tuple(1.0 / len(tiers) for _ in tiers)
        if self.pilot is not None:
            estimate = self.pilot.history.estimate()
            prior = FailurePrior(mtbf_s=estimate.mtbf_s, weight=max(estimate.weight, 0.5), shares=flat)
        elif self.options.mtbf_hours is not None:
            prior = FailurePrior(mtbf_s=self.options.mtbf_hours * 3600.0, shares=flat)
        else:
            earlier = (self.earlier.value if self.earlier else None) or EarlierRuns(running_s=0.0, failures=0)
            failures, exposure = self._failures + earlier.failures, self._exposure + earlier.running_s
            if failures < self.options.min_failures or exposure <= 0:
                return None
            prior = FailurePrior(mtbf_s=exposure / failures, shares=flat)
            if earlier.failures:
                _log.info("autopilot: prior MTBF %.3g h from %s and %d of this run's", prior.mtbf_s / 3600,
                          earlier.describe(), self._failures)
        self.pilot = Autopilot(FailureHistory(prior), min_gain=self.options.min_gain)
        self._tiers = tiers
        return self.pilot

    # ---- the choice ------------------------------------------------------------------------------

    def _costs(self, step_s: float, costs: MeasuredCosts) -> list[TierCosts] | None:
        """Each tier the run has, as measured (``costs``); None while a tier's save has not been timed yet. Where the
        host-memory tiers do not fit the budget together, those whose period the autopilot owns are optional: the
        model leaves off what does not fit (only then: a tier the model left off for a moment's goodput would be gone
        for good)."""
        out: list[TierCosts] = []
        size = self.footprint.step_size()
        write_bytes = float(size[0]) if size is not None else 0.0
        requests = self.options.storage_requests_per_save
        if requests is None:
            requests = estimated_requests(size[1], self.agreement.count if self.agreement else 1) if size else 0.0
        replicas = self.replicas
        if replicas is not None and replicas.off_reason is None:
            measured = replicas.measured()
            if (measured is None or replicas.paced_period is None) and Tier.REPLICAS in self.owned:
                return None
            cost_s = copy_s = 0.0  # a fixed period's costs may never be measured (no step without a copy in flight)
            if measured is not None:
                cost_s, copy_s = measured[1].cost_s, measured[1].copy_s
            # the floor is the pacer's period in force (it moves only with the pacer's own hysteresis), not one
            # recomputed from each new measurement: a floor that jitters would break the periods in force by turns
            paced = replicas.paced_period
            out.append(self._tier(Tier.REPLICAS, step_s, costs, cost_s, copy_s, (paced, "overhead budget") if paced
                                  else (1, "bound"), host_bytes=replicas.host_bytes))
        memory = costs.get("block/memory")
        if self._memory_tier:
            if memory is None:
                return None
            out.append(self._tier(Tier.MEMORY, step_s, costs, memory, memory,
                                  host_bytes=costs.get("memory_bytes") or 0.0))
            persist = costs.get("copy/persist") or 0.0  # the persist is ckptd's: it costs the loop nothing
            out.append(self._tier(Tier.STORAGE, step_s, costs, 0.0, persist, nested=True, write_bytes=write_bytes,
                                  requests=requests))
        else:
            storage = costs.get("block/storage")
            if storage is None:
                return None
            out.append(self._tier(Tier.STORAGE, step_s, costs, storage, costs.get("copy/storage") or 0.0,
                                  write_bytes=write_bytes, requests=requests))
        budget = self.host_memory.budget_bytes if self.host_memory is not None else None
        if budget is not None and sum(t.host_bytes for t in out) > budget:
            out = [replace(t, optional=True) if t.host_bytes and t.name in self.owned else t for t in out]
        return out

    def _tier(self, name: str, step_s: float, costs: MeasuredCosts, block_s: float, copy_s: float,
              floor: tuple[int, str] = (1, "bound"), nested: bool = False, host_bytes: float = 0.0,
              write_bytes: float = 0.0, requests: float = 0.0) -> TierCosts:
        """A tier's costs with the bounds on its period: fixed where the user set it (a copy longer than that
        period is waited for or skipped: its cost is in the block measured), else the options' bounds and the
        tier's own floor; with its recovery's (``costs``: 0 while not measured), what it holds of the host's memory
        and what a save writes to storage."""
        restore_s, first_s = costs.get(f"restore/{name}") or 0.0, costs.get(f"first_step/{name}") or 0.0
        fixed = self._fixed[name] if name not in self.owned else None
        if fixed:
            low, high, why, copy_s = fixed, fixed, "fixed", min(copy_s, fixed * step_s)
        else:
            low, high = getattr(self.options, BOUNDS[Tier(name)])
            low, why = max((low, "bound"), floor)
        return TierCosts(name, block_s=block_s, copy_s=copy_s, restore_s=restore_s, first_step_s=first_s,
                         nested=nested, min_period_s=low * step_s, min_reason=why,
                         max_period_s=None if high is None else high * step_s, host_bytes=host_bytes,
                         write_bytes=write_bytes, requests=requests)

    def _constraints(self) -> Constraints:
        options = self.options
        return Constraints(host_memory_bytes=self.host_memory.budget_bytes if self.host_memory is not None else None,
                           storage_Bps=options.storage_bytes_per_s,
                           storage_requests_per_s=options.storage_requests_per_s,
                           max_lost_steps=options.max_lost_steps)

    def _choose(self, step: int, now: float) -> None:
        """A single controller's choice at ``step``: made, applied, and each change reported."""
        decision = self._decide(step, now)
        if decision is not None:
            self._report(step, decision, self._fields(decision))

    def _own_costs(self) -> MeasuredCosts:
        """What this process measured so far (the persists waited for looked at first)."""
        self.meter.poll_persists()
        return self.meter.measured(self.footprint.memory_bytes())

    def _decide(self, step: int, now: float, costs: MeasuredCosts | None = None) -> Decision | None:
        """Choose again from ``costs`` (this process's measured now unless given); the decision when it changed the
        periods (applied), else None (nothing to choose from yet, or the periods in force kept)."""
        costs = costs if costs is not None else self._own_costs()
        replicas = self.replicas
        paced = replicas.measured() if replicas is not None and replicas.off_reason is None else None
        step_s = costs.get("step") or (paced[0] if paced else None)
        tiers = self._costs(step_s, costs) if step_s else None
        self._ran()
        pilot = self._history(tuple(t.name for t in tiers)) if tiers else None
        if step_s is None or tiers is None or pilot is None:
            return None
        self._last_choice, self._urgent = now, False
        decision = pilot.decide(step_s, tiers, detect_s=costs.get("detect") or 0.0,
                                constraints=self._constraints())
        if not decision.changed:
            _log.debug("autopilot at step %d: %s", step, decision.describe())
            return None
        self.decisions.append(decision)
        periods = dict(zip(self._tiers, decision.plan.periods, strict=True))
        if replicas is not None and Tier.REPLICAS in self.owned and Tier.REPLICAS in periods:
            period = periods[Tier.REPLICAS]
            if period is None:  # left off: it does not fit the host's memory beside the others
                replicas.turn_off(f"the autopilot left it off: {'; '.join(decision.plan.notes) or decision.reason}")
            else:
                replicas.autopilot_period = period
        if Tier.MEMORY in self.owned and Tier.MEMORY in periods:
            self._set_memory(periods[Tier.MEMORY])
        if Tier.STORAGE in self.owned and periods.get(Tier.STORAGE) is not None:
            persist = periods[Tier.STORAGE]
            assert persist is not None
            self.periods.persist = persist
        _log.info("autopilot at step %d: %s", step, decision.describe())
        return decision

    def _set_memory(self, period: int | None, memory_tier: bool | None = None) -> None:
        """The shared-memory tier's period (None: off, its saves to Orbax meanwhile), the ``Saver`` told of a turn."""
        on = period is not None if memory_tier is None else memory_tier
        self.periods.memory = period
        if on != self.periods.memory_tier:
            self.periods.memory_tier = on
            _log.warning("autopilot: the shared-memory tier %s", "on again" if on else
                         "off: it does not fit the host's memory beside the other tiers; saves go to Orbax")
            if self._use_memory_tier is not None:
                self._use_memory_tier(on)

    def _fields(self, decision: Decision) -> dict[str, Any]:
        """The ``autopilot_decided`` event's fields: the decision's, where the host-memory budget comes from, and
        in a multi-controller job the processes that apply it and the one that chose."""
        fields = decision.fields()
        fields["autopilot_reason"] = str(fields["autopilot_reason"])[:2000]
        fields["autopilot_host_memory_source"] = self.host_memory.source if self.host_memory is not None else None
        if self.agreement is not None:
            fields["autopilot_processes"] = self.agreement.count
            fields["autopilot_decided_by"] = self.agreement.index
        return fields

    def _report(self, step: int, decision: Decision, fields: dict[str, Any]) -> None:
        self._emit("autopilot_decided", step, decision.describe()[:1900], **fields)

    # ---- a multi-controller job ------------------------------------------------------------------

    def _agree(self, step: int, agreement: PeriodsAgreement) -> None:
        """An agreement point: the others report their costs; the leader chooses (when something new was measured,
        by it or another process) from the slowest process's costs and publishes the periods in force from here;
        the others wait for them and apply them. Each change is reported by every process."""
        first = agreement.points == 0
        if not agreement.leader:
            agreement.report(self._own_costs(), self.host_memory.budget_bytes if self.host_memory is not None else None)
            agreed = agreement.receive(step)
            self.agreed.append(agreed)
            if Tier.STORAGE in self.owned:
                self.periods.persist = agreed.persist
            if Tier.MEMORY in self.owned:
                self._set_memory(agreed.memory, agreed.memory_tier)
            if agreed.decision is not None:
                _log.info("autopilot at step %d, as process 0 chose: %s", step, agreed.detail)
                self._emit("autopilot_decided", step, agreed.detail[:1900], **agreed.decision)
            return
        reports = agreement.reports()
        if first:
            self._smallest_budget([r.budget if r is not None else None for r in reports])
        others = [r.costs for r in reports if r is not None]
        costs = self._own_costs().slowest(others)
        decision: Decision | None = None
        seen = self._measured() + sum(c.version for c in others)
        if seen != self._seen:
            self._seen = seen
            decision = self._decide(step, self.meter.clock(), costs)
        fields = self._fields(decision) if decision is not None else None
        agreed = AgreedPeriods(step, step + interval_steps(costs.get("step")), self.periods.persist,
                               self.periods.memory, self.periods.memory_tier, fields,
                               decision.describe()[:1900] if decision is not None else "")
        agreement.publish(agreed)
        self.agreed.append(agreed)
        if decision is not None and fields is not None:
            self._report(step, decision, fields)

    def _smallest_budget(self, others: list[float | None]) -> None:
        """The leader's budget: the smallest host's, so that its choice fits every host."""
        known = [(b, f"process {k + 1}'s") for k, b in enumerate(others) if b is not None]
        if self.host_memory is not None:
            known.append((self.host_memory.budget_bytes, "this process's"))
        if not known:
            return
        budget, whose = min(known, key=lambda k: k[0])
        if self.host_memory is None or budget < self.host_memory.budget_bytes:
            source = f"{whose} host, the smallest of {len(others) + 1}"
            self.host_memory = HostMemory(budget, source)


__all__ = ["DEFAULT_CHECKPOINT_PERIOD", "LivePeriods", "PacedReplicas", "RunParts", "RunnerAutopilot"]
