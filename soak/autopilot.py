"""``python -m soak.autopilot``: one long elastic run whose failure rate rises mid-run, every period left to the
autopilot (docs/planning.md, "Autopilot in a run"), against a real ``ckptd serve``.

Why it exists: the autopilot's tests script its costs and failures; this is the run that checks it end to end,
the way an operator would read it: from the run's own events. The demo MLP trains on 4 fake CPU slices (the
shared-memory tier on, no period set); a slice is lost every ``--sparse`` steps until ``--change-at``, then every
``--dense`` steps (``pause``: it comes back 0.2 s later). Each step also sleeps ``--step-sleep`` seconds, so that a
step, and so the failure rate in seconds, is about the same on any machine. The autopilot has no prior: the run's
first failures make it. The replica tier is off unless ``--replicas``: on this CPU its pacer's 2% period (the
replica tier's floor, and so the memory tier's through the order of the periods) follows how busy the two cores
are, not the failure rate, and would hide the autopilot's part.

Two verdicts, printed and written to ``soak-output/autopilot.json``; exit 0 only when both hold:

* the periods moved the right way: per tier, the median period in force over the second half after the change is
  no longer than before the change, and at least one is shorter. A tier whose period was set by a floor or a limit
  (``autopilot_<tier>_bound``: its copy's time, the pacer's period, storage's rate) on most of those late steps is
  left out of this verdict, and listed with the floor: such a period follows the floor (how busy the cores are),
  not the failure rate, and says nothing of the autopilot's answer to it;
* the steps lost per failure, on average, are within what the autopilot predicted: the mean over the failures of
  the expected steps lost (``autopilot_lost_steps`` of the decision in force at each) is at least the mean lost.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import stop_process
from examples.demo import free_port, start_ckptd
from examples.elastic_mlp import TrainLog, make_train_fn
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.runtime.autopilot._options import AutopilotOptions
from trainer_client.runtime.elastic._elastic import ElasticConfig, ElasticResult, ElasticRunner, Event
from trainer_client.runtime.elastic._elastic_config import ElasticOptions, HealthOptions
from trainer_client.runtime.memory._options import MemoryTierOptions
from trainer_client.runtime.replicas._options import ReplicaOptions
from trainer_client.runtime.slices._slices import SimulatedSlices, SliceFault

JOB = "autopilot"
TIERS = ("replicas", "memory", "storage")
OUTPUT = Path("soak-output") / "autopilot.json"


def faults(steps: int, change_at: int, sparse: int, dense: int) -> list[SliceFault]:
    """A slice lost every ``sparse`` steps before ``change_at``, every ``dense`` after it; each a different slice."""
    at = [*range(sparse, change_at, sparse), *range(change_at + dense, steps - dense, dense)]
    return [SliceFault(1 + k % 3, step, down_for_s=0.2) for k, step in enumerate(at)]


def periods(fields: dict[str, Any]) -> dict[str, int | None]:
    return {tier: fields.get(f"autopilot_{tier}_period") for tier in TIERS}


def _in_force_at(decided: list[Event], start: int, end: int) -> Iterator[Event]:
    """The decision in force at each step ``start``..``end`` that has one."""
    for step in range(start, end):
        last = [e for e in decided if e.step is not None and e.step <= step]
        if last:
            yield last[-1]


def in_force(decided: list[Event], start: int, end: int) -> dict[str, float | None]:
    """Per tier, the median over the steps ``start``..``end`` of the period in force at each (None: no decision
    was in force there)."""
    at: dict[str, list[int]] = {tier: [] for tier in TIERS}
    for decision in _in_force_at(decided, start, end):
        for tier, period in periods(decision.fields).items():
            if period is not None:
                at[tier].append(period)
    return {tier: statistics.median(values) if values else None for tier, values in at.items()}


def floor_set(decided: list[Event], start: int, end: int) -> dict[str, str]:
    """The tiers whose period in force over the steps ``start``..``end`` was set by a floor or a limit (the decision's
    ``autopilot_<tier>_bound``) on more than half of those steps, each with the floor named most."""
    named: dict[str, list[str]] = {tier: [] for tier in TIERS}
    steps = 0
    for decision in _in_force_at(decided, start, end):
        steps += 1
        for tier in TIERS:
            if bound := decision.fields.get(f"autopilot_{tier}_bound"):
                named[tier].append(str(bound))
    return {tier: statistics.mode(names) for tier, names in named.items() if names and len(names) * 2 > steps}


def verdicts(result: ElasticResult[Any], steps: int, change_at: int) -> dict[str, Any]:
    """The decisions, the recoveries and the two verdicts (see the module): the periods in force before the change
    against those over the second half of the dense part (the estimate has followed the new rate by then)."""
    decided: list[Event] = [e for e in result.events if e.kind == "autopilot_decided"]
    early, late = in_force(decided, 0, change_at), in_force(decided, (change_at + steps) // 2, steps)
    floors = floor_set(decided, (change_at + steps) // 2, steps)
    judged = [t for t in TIERS if t not in floors]
    pairs = [(a, b) for a, b in ((late[t], early[t]) for t in judged) if a is not None and b is not None]
    moved = bool(pairs) and all(a <= b for a, b in pairs) and any(a < b for a, b in pairs)
    lost, predicted = [], []
    for rec in result.recoveries:
        if rec.kind != "slice_down" or rec.lost_steps is None:
            continue
        then = [e for e in decided if e.step is not None and e.step <= rec.failed_at_step]
        if then:
            lost.append(rec.lost_steps)
            predicted.append(float(then[-1].fields["autopilot_lost_steps"]))
    within = bool(lost) and statistics.fmean(lost) <= statistics.fmean(predicted)
    return {
        "decisions": [{"step": e.step, **periods(e.fields), "mtbf_s": e.fields["autopilot_mtbf_s"],
                       "expected_lost_steps": e.fields["autopilot_lost_steps"],
                       "goodput_before": e.fields["autopilot_goodput_before"],
                       "goodput_after": e.fields["autopilot_goodput_after"]} for e in decided],
        "recoveries": [{"failed_at_step": r.failed_at_step, "lost_steps": r.lost_steps,
                        "restored_from": r.restored_from} for r in result.recoveries],
        "periods_before_the_change": early,
        "periods_late_after_it": late,
        "set_by_a_floor_late": floors,
        "mean_lost_steps": statistics.fmean(lost) if lost else None,
        "mean_predicted_lost_steps": statistics.fmean(predicted) if predicted else None,
        "periods_moved_the_right_way": moved,
        "lost_within_prediction": within,
    }


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    root, shm = workdir / "root", workdir / "shm"
    for d in (root / JOB, shm, workdir / "state"):
        d.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ckptd = start_ckptd(root, workdir / "state", shm, port, workdir / "ckptd.log")
    try:
        config = ElasticConfig(
            job=JOB, mesh_axes=("replica", "data"), mesh_shape=(4, 2), global_batch=48,
            elastic=ElasticOptions(policy="pause", elastic_timeout_s=60, elastic_max_retries=10_000),
            health=HealthOptions(poll_interval_s=0.05, scale_up_check_interval_s=0.0),
            memory_tier=MemoryTierOptions(max_snapshots=8, replicas=ReplicaOptions(enabled=args.replicas)),
            autopilot=AutopilotOptions(min_failures=args.min_failures))
        client = CkptdClient(ClientSettings(url=f"http://127.0.0.1:{port}", shm_dir=str(shm), timeout_s=2.0,
                                            resume_deadline_s=3.0), root=str(root))
        slices = SimulatedSlices(num_slices=4, faults=faults(args.steps, args.change_at, args.sparse, args.dense))

        def show(e: Event) -> None:
            if e.kind == "autopilot_decided":
                print(f"  step {e.step:5}: {e.detail}", flush=True)

        runner = ElasticRunner(config, slices=slices, client=client, checkpoint_dir=str(root / JOB), on_event=show)
        train = make_train_fn(args.steps, TrainLog(), step_hook=lambda step: time.sleep(args.step_sleep))
        started = time.monotonic()
        try:
            result = runner.run(train)
        finally:
            runner.checkpointer.close()
            client.close()
        out = verdicts(result, args.steps, args.change_at)
        out.update(seconds=round(time.monotonic() - started, 1), steps=args.steps, change_at=args.change_at,
                   sparse=args.sparse, dense=args.dense, step_sleep=args.step_sleep, final_step=result.final_step)
        return out
    finally:
        stop_process(ckptd, 60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m soak.autopilot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--change-at", type=int, default=1000, help="the step from which failures come more often")
    parser.add_argument("--sparse", type=int, default=150, help="steps between failures before the change")
    parser.add_argument("--dense", type=int, default=30, help="steps between failures after it")
    parser.add_argument("--step-sleep", type=float, default=0.02, help="seconds each step sleeps")
    parser.add_argument("--min-failures", type=int, default=3, help="failures that make the autopilot's prior")
    parser.add_argument("--replicas", action=argparse.BooleanOptionalAction, default=False,
                        help="the replica tier on, paced (off by default: see the module)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="soak-autopilot-") as tmp:
        out = run(args, Path(tmp))
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(json.dumps(out, indent=2) + "\n")
    print(f"periods in force (median) before the rate rose: {out['periods_before_the_change']}; over the second "
          f"half after it: {out['periods_late_after_it']}; set by a floor then (not judged): "
          f"{out['set_by_a_floor_late'] or 'none'}")
    print(f"steps lost per failure: {out['mean_lost_steps']} on average, predicted {out['mean_predicted_lost_steps']}")
    print(f"periods moved the right way: {out['periods_moved_the_right_way']}; lost within the prediction: "
          f"{out['lost_within_prediction']} ({out['seconds']} s; {OUTPUT})")
    return 0 if out["periods_moved_the_right_way"] and out["lost_within_prediction"] else 1


if __name__ == "__main__":
    sys.exit(main())
