"""One choice of periods for every process of a multi-controller job (trainer_client/runtime/autopilot/
_autopilot_agreement.py): process 0 chooses, the others apply its choice at the same step, whatever they were told;
the slowest process's costs and the smallest host's memory bound the choice; what is read from the channel is
checked, and the channel holds a bounded number of keys over any number of points. On the scripted run of
``test_autopilot_runner`` with the job's key-value store in one process (threads as processes), then with two real
``jax.distributed`` processes running ``ElasticRunner``."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.jax_job import PREAMBLE, run_job
from tests.support.kv_store import InProcessKeyValueStore
from tests.trainer.runtime.test_autopilot_runner import STALL, STEP, Run
from trainer_client.core import protocol as p
from trainer_client.runtime.autopilot._autopilot_agreement import (
    FIRST_INTERVAL_STEPS,
    AgreedPeriods,
    PeriodsAgreement,
    ProcessReport,
    interval_steps,
)
from trainer_client.runtime.autopilot._autopilot_costs import Footprint, MeasuredCosts
from trainer_client.runtime.autopilot._autopilot_runner import DEFAULT_CHECKPOINT_PERIOD
from trainer_client.runtime.autopilot._host_memory import HostMemory
from trainer_client.runtime.autopilot._options import AutopilotOptions

H = 3600.0
GB = 10**9


def _job(options: list[AutopilotOptions], budgets: list[float], *, store: InProcessKeyValueStore | None = None,
         incarnation: str | None = None, **more: object) -> list[Run]:
    """One run of a job of ``len(options)`` processes (``incarnation``: a new one unless given)."""
    store = store if store is not None else InProcessKeyValueStore()
    incarnation = incarnation or uuid.uuid4().hex[:16]
    return [Run(o, agreement=PeriodsAgreement(k, len(options), incarnation=incarnation, store=store,
                                              timeout_ms=30_000),
                host_memory=HostMemory(b, "option"), **more)
            for k, (o, b) in enumerate(zip(options, budgets, strict=True))]


def _train_together(runs: list[Run], seconds: float, after_step: Callable[[], None] | None = None) -> None:
    """The processes step together, as a job's do (their steps' collectives wait for one another); ``after_step``
    once all have passed each step."""
    barrier = threading.Barrier(len(runs), action=after_step)

    def train(run: Run) -> None:
        for _ in range(round(seconds / STEP)):
            run.train(STEP)
            barrier.wait(timeout=60)

    with ThreadPoolExecutor(len(runs)) as pool:
        for done in [pool.submit(train, run) for run in runs]:
            done.result(timeout=300)


def test_every_process_applies_process_0s_choice_at_the_same_step() -> None:
    """Process 1 is told an MTBF of 100 h and measures snapshots ten times as costly: alone it chooses other
    periods. In the job it never chooses (its costs count, its prior does not): at every step both processes have
    the same periods in force, and it reports process 0's decisions as its own events, at the same steps."""
    leader, follower = _job([AutopilotOptions(mtbf_hours=1.0), AutopilotOptions(mtbf_hours=100.0)], [100 * GB] * 2)
    follower.stall = STALL * 10
    _train_together([leader, follower], 3 * H)
    assert leader.in_force == follower.in_force  # step by step
    changed = [(s, m, n) for s, m, n, _ in leader.in_force if (m, n) != (None, DEFAULT_CHECKPOINT_PERIOD)]
    assert changed, "the leader chose nothing"
    decided = [(step, fields) for kind, step, fields in leader.events if kind == "autopilot_decided"]
    assert decided and decided == [(step, fields) for kind, step, fields in follower.events
                                   if kind == "autopilot_decided"]
    step, first = decided[0]
    assert (first["autopilot_processes"], first["autopilot_decided_by"]) == (2, 0)
    assert first["autopilot_mtbf_s"] == pytest.approx(H, rel=0.05)  # the leader's prior, in process 1's event too
    p.ElasticEvent(kind="autopilot_decided", time=1.0, **first)
    assert follower.pilot.decisions == [] and follower.pilot.pilot is None  # it never chose
    # the agreement points: the first boundary, then about 30 s of the leader's steps apart, the same in both
    points = [a.step for a in leader.pilot.agreed]
    assert points == [a.step for a in follower.pilot.agreed]
    assert points[:2] == [1, 1 + FIRST_INTERVAL_STEPS] and points[-1] - points[-2] == interval_steps(2.0) == 15
    assert step in points
    alone = Run(AutopilotOptions(mtbf_hours=100.0))
    alone.stall = STALL * 10
    alone.train(3 * H)
    assert (alone.pilot.periods.memory, alone.pilot.periods.persist) != (leader.pilot.periods.memory,
                                                                        leader.pilot.periods.persist)


def test_the_smallest_hosts_memory_bounds_the_choice_of_every_process() -> None:
    """Shared-memory snapshots of 6 GB: process 0's host has room, process 1's only 5 GB. Process 0 turns the tier off
    for both, at the same step (their persistent saves go to Orbax alike)."""
    turned: list[list[bool]] = [[], []]
    footprint = Footprint(memory_bytes=lambda: 6 * GB)
    store, incarnation = InProcessKeyValueStore(), uuid.uuid4().hex
    runs = [Run(AutopilotOptions(mtbf_hours=1.0), footprint=footprint, host_memory=HostMemory(b, "option"),
                use_memory_tier=turned[k].append,
                agreement=PeriodsAgreement(k, 2, incarnation=incarnation, store=store, timeout_ms=30_000))
            for k, b in enumerate((100 * GB, 5 * GB))]
    _train_together(runs, 600.0)
    assert turned == [[False], [False]]
    assert runs[0].in_force == runs[1].in_force and not runs[0].pilot.periods.memory_tier
    first = runs[0].decided()[0]
    assert first["autopilot_host_memory_bytes"] == 5 * GB and first["autopilot_memory_period"] is None
    assert "process 1's host" in first["autopilot_host_memory_source"]


def test_what_the_channel_holds_is_checked() -> None:
    good = AgreedPeriods(10, 25, 60, 20, True, {"autopilot_storage_period": 60}, "memory every 20")
    assert AgreedPeriods.decode(good.encode()) == good
    for bad in ("[]", "{}", '{"step": 10, "next": 10, "persist": 6, "memory": null, "memory_tier": true}',
                '{"step": 10, "next": 20, "persist": -1, "memory": null, "memory_tier": true}',
                '{"step": 10, "next": 20, "persist": 6, "memory": 0, "memory_tier": true}',
                '{"step": 10, "next": 20, "persist": true, "memory": null, "memory_tier": true}',
                '{"step": 10, "next": 20, "persist": 6, "memory": null, "memory_tier": "yes"}',
                '{"step": 10, "next": 20, "persist": 6, "memory": null, "memory_tier": true, "decision": {"x": 1}}',
                '{"step": 10, "next": 20, "persist": 6, "memory": null, "memory_tier": true, '
                '"decision": {"autopilot_x": [1]}}',
                '{"step": 10, "next": 20, "persist": 6, "memory": null, "memory_tier": true, '
                '"decision": {"autopilot_x": NaN}}', "x" * 70_000):
        with pytest.raises(ValueError):
            AgreedPeriods.decode(bad)
    leader, other = _pair()
    other.report(MeasuredCosts({}), None)
    assert leader.reports() == [ProcessReport(0, None, MeasuredCosts({}))]
    leader.publish(good)
    with pytest.raises(RuntimeError, match="do not step alike"):
        other.receive(11)  # process 1 is at another step than process 0 was at this point


def _pair() -> tuple[PeriodsAgreement, PeriodsAgreement]:
    store, incarnation = InProcessKeyValueStore(), uuid.uuid4().hex
    leader, other = (PeriodsAgreement(k, 2, incarnation=incarnation, store=store, timeout_ms=1000) for k in (0, 1))
    return leader, other


def _report(read: object = 1, budget: object = 10**9, values: object = None, version: object = 3) -> str:
    values = {"step": 2.0} if values is None else values
    return json.dumps({"read": read, "budget": budget, "costs": {"version": version, "values": values}})


def test_a_report_that_is_not_what_a_process_writes_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """What another process reports is checked before the leader counts it: a time that is not a finite number of
    seconds from 0 to about 115 days, bytes beyond 2^60, a measure the model has no use for, more points read than
    were published, a budget that is not a positive number of bytes, too long or too deep a text: each a
    ``ValueError`` that says what. The leader ignores such a report whole (logged): its costs are not pooled, its
    budget is not known, and no point is deleted on its word."""
    assert ProcessReport.decode(_report(), 1) == ProcessReport(1, 1e9, MeasuredCosts({"step": 2.0}, 3))
    for bad, says in ((_report(values={"step": float("nan")}), "step of nan"),
                      (_report(values={"block/memory": -1.0}), "block/memory of -1.0"),
                      (_report(values={"copy/persist": 1e12}), "copy/persist of 1000000000000.0"),
                      (_report(values={"memory_bytes": 2.0**61}), "memory_bytes of"),
                      (_report(values={"step": True}), "step of True"),
                      (_report(values={"step": "2"}), "step of '2'"),
                      (_report(values={"__class__": 1.0}), "unknown measures"),
                      (_report(values=[1.0]), "measured costs of"),
                      (_report(version=-1), "count of measurements"),
                      (_report(read=2), "2 points read, of 1 published"),
                      (_report(read=-1), "-1 points read"),
                      (_report(budget="lots"), "budget of 'lots'"),
                      (_report(budget=0), "budget of 0"),
                      (_report(budget=float("inf")), "budget of inf"),
                      (_report(values={"step": 10**400}), "step of 1000"),  # no float holds it: not an OverflowError
                      (_report(budget=10**400), "budget of 1000"),
                      ('{"read": 1}', "an object of read, budget and costs"),
                      ("[" * 10_000 + "]" * 10_000, "characters"),
                      ("[" * 5_000 + "]" * 5_000, "nested too deep"),
                      ("not json", "Expecting value")):
        with pytest.raises(ValueError, match=says.replace("(", r"\(").replace("+", r"\+")):
            ProcessReport.decode(bad, 1)
    # in the job: process 1 reports junk; process 0 counts nothing of it and deletes no point on its word
    leader, other = _pair()
    store = leader.store
    for step in (1, 2):
        other.report(MeasuredCosts({"step": 2.0}, step), None)
        assert leader.reports()[0] is not None
        leader.publish(AgreedPeriods(step, step + 1, 10, None, True))
        other.receive(step)
    report_key = next(k for k in store.values if k.endswith("/process/1"))
    store.values[report_key] = _report(read=0, budget=-5, values={"step": 1e9})
    with caplog.at_level("WARNING", logger="trainer_client.runtime.autopilot._autopilot_agreement"):
        assert leader.reports() == [None]
    assert any("process 1's report refused" in r.getMessage() and "budget of -5" in r.getMessage()
               for r in caplog.records)
    store.values[report_key] = _report(read=2)
    assert leader.reports()[0] == ProcessReport(2, 1e9, MeasuredCosts({"step": 2.0}, 3))
    assert sorted(k.rsplit("/", 1)[1] for k in store.values) == ["1"]  # points 0 and 1 read, deleted; the report


def test_the_store_holds_a_bounded_number_of_keys_over_any_number_of_points() -> None:
    """Three processes pass some 200 agreement points, then run again in the same incarnation of the job (a second
    runner in the same processes): every process applies every point, and the store never holds more than the last
    two points and a report per other process; the first run's keys are gone once the second has started."""
    store, incarnation = InProcessKeyValueStore(), uuid.uuid4().hex
    held: list[int] = []

    def count() -> None:
        held.append(sum(key.startswith("ckptd/autopilot/") for key in store.values))

    for run in range(2):
        runs = _job([AutopilotOptions(mtbf_hours=1.0)] * 3, [100 * GB] * 3, store=store, incarnation=incarnation)
        _train_together(runs, 3000 * STEP, count)
        assert max(held) <= 2 + 2, max(held)  # two points, two reports
        points = [a.step for a in runs[0].pilot.agreed]
        assert len(points) > 150
        assert all([a.step for a in r.pilot.agreed] == points for r in runs[1:])
        assert runs[0].decided() and all(r.decided() == runs[0].decided() for r in runs[1:])
        assert all(k.startswith(f"ckptd/autopilot/{incarnation}/{run}/") for k in store.values), sorted(store.values)


def test_the_slowest_process_s_costs_move_the_choice() -> None:
    """Process 1's snapshots block its loop ten times as long as process 0's: the job waits for it at every
    snapshot, so process 0 chooses from its block (and snapshots less often than where both are fast)."""
    fast = _job([AutopilotOptions(mtbf_hours=1.0)] * 2, [100 * GB] * 2)
    slow = _job([AutopilotOptions(mtbf_hours=1.0)] * 2, [100 * GB] * 2)
    slow[1].stall = STALL * 10
    for runs in (fast, slow):
        _train_together(runs, 2 * H)
    assert fast[0].decided()[0]["autopilot_memory_block_s"] == STALL
    first = slow[0].decided()[0]
    assert first["autopilot_memory_block_s"] == STALL * 10 and slow[1].decided()[0] == first
    assert first["autopilot_memory_period"] > fast[0].decided()[0]["autopilot_memory_period"]
    assert slow[0].in_force == slow[1].in_force


_JOB = PREAMBLE + """
import time
from trainer_client.runtime.autopilot import _autopilot_agreement
_autopilot_agreement.AGREE_INTERVAL_S = 0.3  # points a few steps apart, so that a short run has several
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.runtime.elastic._elastic import ElasticConfig, ElasticRunner
from trainer_client.runtime.autopilot._options import AutopilotOptions
from trainer_client.runtime.compilation._options import CompilationOptions
from trainer_client.runtime.elastic._elastic_config import ElasticOptions
from trainer_client.runtime.slices._slices import SimulatedSlices
url, steps = sys.argv[6], int(sys.argv[7])
# process 1 is told failures come 10,000 times less often: alone it would save far less often than process 0
pilot = AutopilotOptions(mtbf_hours=0.005 if index == 0 else 50.0, host_memory_budget_bytes=10**12)
cfg = ElasticConfig(job="job", mesh_axes=("replica", "data"), mesh_shape=(1, 8), global_batch=8, checkpoint_period=None,
                    elastic=ElasticOptions(policy="pause"), compilation=CompilationOptions(precompile=False),
                    autopilot=pilot)
client = CkptdClient(ClientSettings(url=url, timeout_s=2, resume_deadline_s=5, report_events=False), root=root)
runner = ElasticRunner(cfg, slices=SimulatedSlices(num_slices=1), client=client, checkpoint_dir=root + "/job")
def train(ctx):
    state, step, position = ctx.restore_or_init(lambda: {"w": jax.numpy.zeros((16, 4))}, lambda a: {"w": P("data")})
    add = jax.jit(lambda s: {"w": s["w"] + 1})
    while step < steps:
        ctx.step_boundary(step, state, position)
        state, step, position = add(state), step + 1, position + 8
        jax.block_until_ready(state)
        time.sleep(0.01)
    return step
result = runner.run(train)
runner.saver.wait()
from jax._src import distributed
held = len(distributed.global_state.client.key_value_dir_get("ckptd/autopilot"))  # the agreement's keys left
print(json.dumps({"decided": [[e.step, e.fields] for e in result.events if e.kind == "autopilot_decided"],
                  "saved": [e.step for e in result.events if e.kind == "checkpoint_started"],
                  "points": [a.step for a in runner.autopilot.agreed], "held": held}), flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.needs_tcp
def test_two_jax_processes_save_at_the_steps_process_0_chose(tmp_path: Path) -> None:
    """Two real processes of one ``jax.distributed`` job, each with its own autopilot and its own (different) prior:
    they decide by process 0's prior and their slowest costs, save at the same steps, and leave a few of the
    agreement's keys in the job's store, however many points they passed; every save is at the period in force
    (a save one process made alone would have left the other waiting in the save's route until the timeout)."""
    from tests.support.helpers import free_port

    url = f"http://127.0.0.1:{free_port()}"  # no ckptd: the storage scan answers the resume
    out = run_job(_JOB, tmp_path, url, "240", timeout_s=240)
    results = [json.loads(line) for line in out]
    held = [r.pop("held") for r in results]
    assert len(results[0]["points"]) > 2 + 1 + 2 >= max(held), held  # 2 points, 1 report; 2 of slack
    assert results[0] == results[1]  # decisions, saves and agreement points: all alike
    decided, saved = results[0]["decided"], results[0]["saved"]
    assert decided, results[0]
    first = decided[0][1]
    assert (first["autopilot_processes"], first["autopilot_decided_by"]) == (2, 0)
    assert first["autopilot_mtbf_s"] == pytest.approx(18.0, rel=0.1)  # process 0's prior, 0.005 h
    assert decided[0][0] in results[0]["points"]
    period, changes = DEFAULT_CHECKPOINT_PERIOD, {step: f["autopilot_storage_period"] for step, f in decided}
    done = 0
    for step in saved:
        period = next((changes[s] for s in sorted(changes, reverse=True) if s <= step), period)
        assert step % period == 0, (step, period, decided)
        done += 1
    assert done >= 2
