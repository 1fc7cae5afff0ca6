"""The goodput simulator (ckptd.advisor._simulator) against closed forms, hand-computed timelines and its speed."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from ckptd.advisor._advisor import fit_optimum
from ckptd.advisor._failures import PoissonFailures, TraceFailures
from ckptd.advisor._sim_model import CAUSES, DAY, POLICIES, JobModel, Policy, Schedule, SimResult
from ckptd.advisor._simulator import simulate
from trainer_client.core.planning import daly, young_daly


def free_job(**overrides: float) -> JobModel:
    """A job whose saves and recoveries cost nothing: only the lost work is left."""
    values: dict[str, float] = dict(slices=8, save_stall=0.0, persist_time=0.0, restore_time=0.0, recovery_time=0.0,
                                    replace_time=0.0, detect_time=0.0, spare_switch_time=0.0, host_loss_fraction=1.0)
    values.update(overrides)
    return JobModel(**values)  # type: ignore[arg-type]


def poisson(job: JobModel, policy: Policy, schedule: Schedule, *, mtbf: float, failures: int,
            seed: int = 0) -> SimResult:
    return simulate(job, policy, schedule, horizon=failures * mtbf,
                    failures=PoissonFailures.from_mtbf(mtbf, job.slices, seed=seed), seed=seed)


def assert_adds_up(res: SimResult) -> None:
    """Goodput and the badput causes account for every second of the wall time."""
    assert set(res.badput) == set(CAUSES)
    assert all(v >= -1e-9 for v in res.badput.values()), res.badput
    assert res.useful + sum(res.badput.values()) == pytest.approx(res.wall, rel=1e-9)


# ---- closed forms over thousands of failures --------------------------------------------------------


def test_lost_work_per_failure_averages_half_the_period() -> None:
    period, mtbf = 1000.0, 50_000.0
    res = poisson(free_job(), "pause", Schedule(period), mtbf=mtbf, failures=20_000, seed=1)
    assert res.interruptions > 19_000
    lost = np.asarray(res.lost_work)
    # Exact for exponential gaps restarted at each failure: E[X mod T] = M - T / (exp(T/M) - 1).
    exact = mtbf - period / math.expm1(period / mtbf)
    stderr = lost.std() / math.sqrt(len(lost))
    assert abs(lost.mean() - exact) < 4 * stderr, (lost.mean(), exact, stderr)
    assert lost.mean() == pytest.approx(period / 2, rel=0.03)
    assert lost.min() >= 0 and lost.max() < period
    assert res.badput["lost"] == pytest.approx(lost.sum())
    assert_adds_up(res)


def test_persist_latency_loses_one_more_period_when_the_failure_comes_first() -> None:
    # A save is usable only persist_time after it began: E[lost] = E[X mod T] + T * P(X mod T < d, X >= T).
    period, persist, mtbf = 1000.0, 200.0, 100_000.0
    res = poisson(free_job(persist_time=persist), "pause", Schedule(period), mtbf=mtbf, failures=20_000, seed=2)
    q = math.exp(-period / mtbf)
    exact = mtbf - period / math.expm1(period / mtbf) + period * q * -math.expm1(-persist / mtbf) / (1 - q)
    lost = np.asarray(res.lost_work)
    assert abs(lost.mean() - exact) < 4 * lost.std() / math.sqrt(len(lost))
    assert lost.mean() == pytest.approx(period / 2 + persist, rel=0.03)


def test_memory_tier_loses_half_the_memory_period_unless_the_host_goes() -> None:
    memory, persistent, mtbf = 100.0, 1000.0, 20_000.0
    kept = poisson(free_job(host_loss_fraction=0.0), "pause", Schedule(persistent, memory), mtbf=mtbf,
                   failures=10_000, seed=3)
    gone = poisson(free_job(host_loss_fraction=1.0), "pause", Schedule(persistent, memory), mtbf=mtbf,
                   failures=10_000, seed=3)
    assert kept.lost_per_interruption == pytest.approx(memory / 2, rel=0.05)
    assert gone.lost_per_interruption == pytest.approx(persistent / 2, rel=0.05)
    assert kept.restores_from_memory == kept.failures and gone.restores_from_memory == 0


def test_simulated_optimum_is_young_daly_when_saves_are_cheap() -> None:
    save, mtbf = 30.0, 20 * 3600.0  # save cost / MTBF = 4e-4: the first-order regime
    job = free_job(slices=16, save_stall=save, restore_time=60.0, recovery_time=60.0, detect_time=60.0)
    first_order = young_daly(save, mtbf)
    periods = [first_order * 2 ** (k / 3) for k in range(-6, 7)]
    goodputs = [poisson(job, "pause", Schedule(t), mtbf=mtbf, failures=2000, seed=4).goodput for t in periods]
    assert fit_optimum(periods, goodputs) == pytest.approx(first_order, rel=0.10)
    # and the curve is what first order says: 1 - s/T - (T/2 + recovery) / M, within a point
    for t, g in zip(periods, goodputs, strict=True):
        assert g == pytest.approx(1 - save / t - (t / 2 + 180.0) / mtbf, abs=0.01)


def test_young_daly_overshoots_when_failures_are_frequent() -> None:
    save, mtbf = 600.0, 3600.0  # a save costs a sixth of the MTBF
    job = free_job(slices=16, save_stall=save, restore_time=60.0, recovery_time=60.0, detect_time=60.0)
    first_order = young_daly(save, mtbf)
    periods = [first_order * 2 ** (k / 3) for k in range(-6, 7)]
    goodputs = [poisson(job, "pause", Schedule(t), mtbf=mtbf, failures=2000, seed=5).goodput for t in periods]
    simulated = fit_optimum(periods, goodputs)
    assert simulated < 0.9 * first_order
    assert simulated == pytest.approx(daly(save, mtbf), rel=0.10)


# ---- hand-computed timelines (replayed failures) ----------------------------------------------------


def test_pause_timeline_by_hand() -> None:
    job = free_job(slices=4, save_stall=1.0, detect_time=5.0, replace_time=50.0, restore_time=10.0,
                   recovery_time=20.0)
    res = simulate(job, "pause", Schedule(100.0), horizon=1000.0, failures=TraceFailures([250.0]))
    # saves at work 100 (wall 100-101) and 200 (201-202); at 250 work is 248: 48 lost, back to 200.
    # detect 250-255, wait for the slice until 300, restore -310, recompile -330; then six more saves.
    assert res.lost_work == [pytest.approx(48.0)]
    assert res.badput == pytest.approx({"checkpoint": 8.0, "detection": 5.0, "waiting": 45.0, "restore": 10.0,
                                        "recompile": 20.0, "lost": 48.0, "degraded": 0.0, "scale_up": 0.0})
    assert res.useful == pytest.approx(864.0)
    assert res.wall == 1000.0
    assert_adds_up(res)


def test_resize_runs_degraded_then_regrows() -> None:
    job = free_job(slices=4, detect_time=5.0, restore_time=10.0, resize_recovery_time=20.0, scale_up_time=15.0,
                   replace_time=300.0)
    res = simulate(job, "resize", Schedule(100.0), horizon=1000.0, failures=TraceFailures([250.0]))
    # back to work 200; running again at 285 on 3 of 4 slices (rate 0.75) until the slice returns at 550,
    # regrow until 565, then full speed to 1000.
    assert res.badput == pytest.approx({"checkpoint": 0.0, "detection": 5.0, "waiting": 0.0, "restore": 10.0,
                                        "recompile": 20.0, "lost": 50.0, "degraded": 66.25, "scale_up": 15.0})
    assert res.useful == pytest.approx(200 + 0.75 * 265 + 435)
    assert_adds_up(res)


def test_hot_spare_switches_in_then_pauses_when_none_is_left() -> None:
    job = free_job(slices=4, detect_time=5.0, replace_time=1000.0, spare_switch_time=7.0, spares=1)
    spare = simulate(job, "spare", Schedule(100.0), horizon=3000.0, failures=TraceFailures([200.0, 400.0]))
    pause = simulate(job, "pause", Schedule(100.0), horizon=3000.0, failures=TraceFailures([200.0, 400.0]))
    # spare: the first failure waits 7 s; the second finds no spare and waits for the repair due at 1200.
    assert spare.badput["waiting"] == pytest.approx(7.0 + (1200.0 - 405.0))
    # pause: waits for the first slice (due at 1200); the second failure, at 400 during that wait, is detected
    # again (400-405) and the wait runs on until its slice is back at 1400.
    assert pause.badput["waiting"] == pytest.approx((400.0 - 205.0) + (1400.0 - 405.0))
    assert pause.badput["detection"] == pytest.approx(10.0)
    assert spare.goodput > pause.goodput
    assert_adds_up(spare)
    assert_adds_up(pause)


def test_a_persist_slower_than_the_period_makes_saves_wait() -> None:
    # No failures. Each save after the first waits for the previous persist: 25 - 10 = 15 s, plus the 1 s stall.
    job = free_job(save_stall=1.0, persist_time=25.0)
    res = simulate(job, "pause", Schedule(10.0), horizon=275.0, failures=TraceFailures([]))
    assert res.badput["checkpoint"] == pytest.approx(1.0 + 10 * 16.0)
    assert res.useful == pytest.approx(114.0)


@pytest.mark.parametrize("policy", POLICIES)
def test_badput_adds_up_under_every_policy(policy: Policy) -> None:
    job = JobModel(slices=6, save_stall=3.0, persist_time=40.0, restore_time=30.0, recovery_time=20.0,
                   replace_time=900.0, detect_time=10.0, resize_recovery_time=50.0, min_slices=3,
                   degraded_efficiency=0.9, persist_overhead=2.0)
    for schedule in (Schedule(300.0), Schedule(600.0, 60.0)):
        res = poisson(job, policy, schedule, mtbf=1800.0, failures=500, seed=6)
        assert res.failures >= 400
        assert 0.3 < res.goodput < 1.0
        assert_adds_up(res)


# ---- speed --------------------------------------------------------------------------------------------


def test_54_days_on_16384_chips_in_seconds() -> None:
    # Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs. As 64 slices of 256 chips, and as
    # 16,384 one-chip slices (every chip its own failure domain).
    per_chip = 419 / (54 * DAY) / 16_384
    job = JobModel(slices=64, save_stall=2.0, persist_time=60.0, restore_time=60.0, recovery_time=60.0,
                   resize_recovery_time=180.0, replace_time=1800.0)
    chips = JobModel(slices=16_384, save_stall=2.0, persist_time=60.0, restore_time=60.0, recovery_time=60.0,
                     resize_recovery_time=180.0, replace_time=1800.0)
    started = time.perf_counter()
    results = [simulate(j, policy, Schedule(600.0, 60.0), horizon=54 * DAY,
                        failures=PoissonFailures(per_chip * 16_384 / j.slices, seed=7))
               for j in (job, chips) for policy in POLICIES]
    elapsed = time.perf_counter() - started
    print(f"\n54 days x 16,384 chips, 3 policies x 2 slicings: {elapsed:.3f} s")
    assert elapsed < 20.0
    for res in results:
        assert 300 < res.failures < 560  # 419 expected
        assert res.wall >= 54 * DAY
        assert_adds_up(res)


def test_inputs_are_checked() -> None:
    with pytest.raises(ValueError):
        free_job(min_slices=9)
    with pytest.raises(ValueError):
        free_job(degraded_efficiency=0.0)
    with pytest.raises(ValueError):
        Schedule(0.0)
    with pytest.raises(ValueError):
        simulate(free_job(), "wait", Schedule(1.0), horizon=1.0, failures=TraceFailures([]))  # type: ignore[arg-type]
