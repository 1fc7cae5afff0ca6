"""The set-up of the advisor's sweeps: the simulator's job model from the resolved inputs, the first-order periods
(Young/Daly per tier, from the period model the runner's autopilot uses: ``trainer_client.core.planning``) and the
failure process every simulated run of one answer shares (``Plan``).

Apart from ``ckptd.advisor._advisor`` (the sweeps and the answer) and ``ckptd.advisor._advice_text`` (the words):
both read a ``Plan``, and neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptd.advisor._budget import WorkBudget
from ckptd.advisor._failures import PoissonFailures
from ckptd.advisor._sim_model import DAY, JobModel, Policy, Schedule, SimResult
from ckptd.advisor._simulator import simulate
from trainer_client.core.planning import PlanInputs, TierCosts, choose
from trainer_client.core.protocol import AdviceInput, YoungDaly


def job_model(inputs: dict[str, AdviceInput]) -> JobModel:
    """The simulator's view of the resolved inputs."""
    v = {k: float(x.value) for k, x in inputs.items()}
    return JobModel(
        slices=int(v["slices"]), save_stall=v["save_stall_s"], persist_time=v["persist_time_s"],
        restore_time=v["restore_time_s"], recovery_time=v["recovery_time_s"], replace_time=v["replace_time_s"],
        detect_time=v["detect_time_s"], memory_restore_time=v["memory_restore_time_s"],
        resize_recovery_time=v["resize_recovery_time_s"], scale_up_time=v["scale_up_time_s"],
        spare_switch_time=v["spare_switch_time_s"], spares=int(v["spares"]), min_slices=int(v["min_slices"]),
        degraded_efficiency=v["degraded_efficiency"], host_loss_fraction=v["host_loss_fraction"],
        persist_overhead=v["persist_overhead_s"],
    )


@dataclass(frozen=True)
class Plan:
    """What the sweeps work with: the model, the failure process and the first-order periods."""

    model: JobModel
    step: float
    mtbf: float
    memory_tier: bool
    yd: YoungDaly
    horizon: float
    seed: int
    budget: WorkBudget

    @property
    def split_tiers(self) -> bool:
        """Memory snapshots between persistent saves (not every snapshot persisted)."""
        return self.memory_tier and (self.yd.persistent_period_s or 0.0) > 1.5 * self.yd.period_s

    @property
    def rollback_mtbf(self) -> float:
        """Mean time between the failures that roll back to the newest snapshot."""
        return self.mtbf / (1.0 - self.model.host_loss_fraction) if self.split_tiers else self.mtbf

    def steps(self, period: float) -> int:
        return max(1, round(period / self.step))

    def snap(self, period: float) -> float:
        """A period rounded to whole steps (saves happen at step boundaries)."""
        return self.steps(period) * self.step

    def schedule(self, period: float, multiple: int | None = None) -> Schedule:
        """Saves every ``period``; with a memory tier, persisted every ``multiple`` (default: first-order)."""
        if not self.memory_tier:
            return Schedule(period)
        if multiple is None:
            multiple = max(1, round((self.yd.persistent_period_s or period) / period))
        return Schedule(multiple * period, period)

    def run(self, policy: Policy, schedule: Schedule, horizon: float | None = None) -> SimResult:
        failures = PoissonFailures.from_mtbf(self.mtbf, self.model.slices, seed=self.seed)
        return simulate(self.model, policy, schedule, horizon=horizon or self.horizon, failures=failures,
                        seed=self.seed, budget=self.budget)


def first_order(model: JobModel, step: float, mtbf: float, memory_tier: bool) -> YoungDaly:
    """The first-order periods of the period model (``trainer_client.core.planning``, the one the runner's autopilot
    uses): with a memory tier, snapshots serve the failures that keep host memory and persistent saves (nested in
    them, costing only the persist's overhead, at least a persist time apart) serve the rest; without one, every
    save is persisted and costs its stall and the overhead."""
    tiers: tuple[TierCosts, ...]
    if memory_tier:
        tiers = (TierCosts("memory", block_s=model.save_stall, survives=1.0 - model.host_loss_fraction),
                 TierCosts("storage", block_s=model.persist_overhead, copy_s=model.persist_time, nested=True))
    else:
        tiers = (TierCosts("storage", block_s=model.save_stall + model.persist_overhead, copy_s=model.persist_time),)
    # the first-order periods are read in seconds: the sweeps put them in whole steps (``Plan.snap``)
    plan = choose(PlanInputs(step_s=step, tiers=tiers, mtbf_s=mtbf))
    fastest = plan.blocks[0]
    # Young/Daly as the formula gives it for the fastest tier; a persist time longer than that bounds the persistent
    # period, and so the one period of a job without a memory tier is reported unbounded (the reasoning says why a
    # persist slower than the period costs more)
    return YoungDaly(mtbf_s=mtbf, save_cost_s=fastest.save_cost_s, period_s=fastest.young_daly_s,
                     daly_period_s=fastest.daly_s,
                     persistent_period_s=plan.block("storage").period_s if memory_tier else None)


def make_plan(inputs: dict[str, AdviceInput], budget: WorkBudget | None = None) -> Plan:
    """First-order periods (Young/Daly) and the simulation set-up for the resolved inputs."""
    model = job_model(inputs)
    v = {k: float(x.value) for k, x in inputs.items()}
    mtbf = v["mtbf_hours"] * 3600.0
    tier = bool(inputs["memory_tier"].value) and model.host_loss_fraction < 1.0
    yd = first_order(model, v["step_time_s"], mtbf, tier)
    horizon = max(v["horizon_days"] * DAY, v["min_failures"] * mtbf)
    return Plan(model, v["step_time_s"], mtbf, tier, yd, horizon, int(v["seed"]), budget or WorkBudget())


__all__ = ["Plan", "first_order", "job_model", "make_plan"]
