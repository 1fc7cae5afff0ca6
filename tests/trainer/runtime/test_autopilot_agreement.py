"""One choice of periods for every process of a multi-controller job (trainer_client/runtime/autopilot/
_autopilot_agreement.py): process 0 chooses, the others apply its choice at the same step, whatever they measure
and whatever they were told; the smallest host's memory bounds the choice; what is read from the channel is
checked. On the scripted run of ``test_autopilot_runner`` with the job's key-value store in one process (threads as
processes), then with two real ``jax.distributed`` processes running ``ElasticRunner``."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.jax_job import PREAMBLE, run_job
from tests.support.kv_store import InProcessKeyValueStore
from tests.trainer.runtime.test_autopilot_runner import STALL, Run
from trainer_client.core import protocol as p
from trainer_client.runtime.autopilot._autopilot_agreement import (
    FIRST_INTERVAL_STEPS,
    AgreedPeriods,
    PeriodsAgreement,
    interval_steps,
)
from trainer_client.runtime.autopilot._autopilot_costs import Footprint
from trainer_client.runtime.autopilot._autopilot_runner import DEFAULT_CHECKPOINT_PERIOD
from trainer_client.runtime.autopilot._host_memory import HostMemory
from trainer_client.runtime.autopilot._options import AutopilotOptions

H = 3600.0
GB = 10**9


def _job(options: list[AutopilotOptions], budgets: list[float], **more: object) -> list[Run]:
    store = InProcessKeyValueStore()
    return [Run(o, agreement=PeriodsAgreement(k, len(options), incarnation="inc", store=store, timeout_ms=30_000),
                host_memory=HostMemory(b, "option"), **more)
            for k, (o, b) in enumerate(zip(options, budgets, strict=True))]


def _train_together(runs: list[Run], seconds: float) -> None:
    with ThreadPoolExecutor(len(runs)) as pool:
        for done in [pool.submit(run.train, seconds) for run in runs]:
            done.result(timeout=120)


def test_every_process_applies_process_0s_choice_at_the_same_step() -> None:
    """Process 1 is told an MTBF of 100 h and measures snapshots ten times as costly: alone it chooses other
    periods. In the job it never chooses: at every step both processes have the same periods in force, and it
    reports process 0's decisions as its own events, at the same steps."""
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
    store = InProcessKeyValueStore()
    runs = [Run(AutopilotOptions(mtbf_hours=1.0), footprint=footprint, host_memory=HostMemory(b, "option"),
                use_memory_tier=turned[k].append,
                agreement=PeriodsAgreement(k, 2, incarnation="inc", store=store, timeout_ms=30_000))
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
    store = InProcessKeyValueStore()
    leader, other = (PeriodsAgreement(k, 2, incarnation="inc", store=store, timeout_ms=1000) for k in (0, 1))
    leader.publish(good)
    with pytest.raises(RuntimeError, match="do not step alike"):
        other.receive(11)  # process 1 is at another step than process 0 was at this point
    store.values["ckptd/autopilot/inc/budget/1"] = '"lots"'
    assert leader.budgets() == [None]  # a budget that is not a number is not known


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
print(json.dumps({"decided": [[e.step, e.fields] for e in result.events if e.kind == "autopilot_decided"],
                  "saved": [e.step for e in result.events if e.kind == "checkpoint_started"],
                  "points": [a.step for a in runner.autopilot.agreed]}), flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.needs_tcp
def test_two_jax_processes_save_at_the_steps_process_0_chose(tmp_path: Path) -> None:
    """Two real processes of one ``jax.distributed`` job, each with its own autopilot and its own (different) prior:
    they decide once, by process 0's measurements, and save at the same steps; every save is at the period in force
    (a save one process made alone would have left the other waiting in the save's route until the timeout)."""
    from tests.support.helpers import free_port

    url = f"http://127.0.0.1:{free_port()}"  # no ckptd: the storage scan answers the resume
    out = run_job(_JOB, tmp_path, url, "240", timeout_s=240)
    results = [json.loads(line) for line in out]
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
