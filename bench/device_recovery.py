"""``python -m bench.device_recovery inprocess|relaunch ...``: one process of the device profile's recovery, on
whatever devices jax has, as ONE slice that holds every device (one chip: one slice of one device).

Why it exists: bench/recovery.py measures recovery in the same PID against a relaunch on 8 CPU devices in 4 slices
over TCP; a lent chip is one device, and its machine has no TCP or UDP socket at all. This is the same comparison
in that shape, on bench/decoder.py's model (the profile's size) trained by the ``ElasticRunner`` with the
policy ``pause``, ckptd reached over its unix socket (``--url unix:///PATH``), replicas off (a lost slice takes
the only replica with it) and a shared-memory snapshot every ``--memory-period`` steps:

* ``inprocess``: the slice is lost from inside JAX at step ``--fail-at`` (``InJaxFaults``: reading that step's
  loss raises ``DATA_LOSS``, as on Pathways) and comes back ``--down-s`` seconds later; the runner waits for it,
  asks ckptd, restores the memory snapshot and runs on, in this process. Printed: the seconds from the raise to
  the first step done after the restore with the down time included (``seconds_total``) and without it
  (``seconds``: from the slice's return, the raise plus ``--down-s``, to that step), and the phases.
* ``relaunch``: a new process with the slice up: imports, devices, the runner, ckptd's plan, the restore of the
  same job's snapshot (what survives a process: replicas do not), the step traced and compiled (JAX's
  persistent compilation cache, ``--cache``, warm from the in-process run) and run once.

The parent (bench/device_profile.py) times the spawn and forms the figure. Every mark is a wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from typing import Any

from bench.recovery import INPROCESS_PHASES, RESULT_PREFIX, StopRun, event_marks, split_phases
from bench.stack_sampler import StackSampler


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["inprocess", "relaunch"])
    for name in ("--job", "--root", "--shm", "--url", "--cache", "--size"):
        parser.add_argument(name, required=True)
    parser.add_argument("--fail-at", type=int, default=7)
    parser.add_argument("--down-s", type=float, default=2.0)
    parser.add_argument("--memory-period", type=int, default=5)
    return parser


def watch_compiles() -> list[list[Any]]:
    """JAX's compile events as they happen, ``[wall time, what, seconds]``: each persistent-cache hit or miss and
    each backend compile, so a recovery's first step says whether it compiled again or loaded its executable."""
    import jax.monitoring

    seen: list[list[Any]] = []
    wanted = {"/jax/compilation_cache/cache_hits": "cache hit", "/jax/compilation_cache/cache_misses": "cache miss"}

    def on_event(event: str, **_: str | int) -> None:
        if event in wanted:
            seen.append([round(time.time(), 4), wanted[event], None])

    def on_duration(event: str, duration_secs: float, **_: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append([round(time.time(), 4), "backend compile", round(duration_secs, 3)])

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    return seen


def describe(state: Any) -> list[str]:
    """Each array leaf of ``state`` as an executable's key sees it: dtype, shape, weak type, sharding (its memory
    kind included) and layout where jax reports one."""
    import jax

    return [f"{a.dtype}{list(a.shape)} weak={a.weak_type} {a.sharding} {getattr(a, 'format', '')}"
            for a in jax.tree_util.tree_leaves(state) if isinstance(a, jax.Array)]


def state_changes(attempts: list[list[str]]) -> list[list[str]]:
    """Where the first attempt's state and a later one's differ, leaf by leaf (at most 5): ``[first, later]``."""
    if len(attempts) < 2:
        return []
    return [[a, b] for a, b in zip(attempts[0], attempts[-1], strict=False) if a != b][:5]


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    args = _parser().parse_args(argv)
    import jax
    from jax.sharding import PartitionSpec

    from bench.decoder import AXES, SIZES, init_fn, make_batch, make_step
    from trainer_client.client._ckptd_client import CkptdClient
    from trainer_client.config import ClientSettings
    from trainer_client.runtime.compilation._options import CompilationOptions
    from trainer_client.runtime.elastic._elastic import ElasticConfig, ElasticContext, ElasticRunner, Event
    from trainer_client.runtime.elastic._elastic_config import ElasticOptions, HealthOptions
    from trainer_client.runtime.memory._options import MemoryTierOptions
    from trainer_client.runtime.replicas._options import ReplicaOptions
    from trainer_client.runtime.slices._jax_faults import InJaxFaults, Op
    from trainer_client.runtime.slices._slices import SimulatedSlices

    imported = time.time()
    devices = jax.devices()  # the backend's initialisation
    devices_up = time.time()
    size = SIZES[args.size]
    inprocess = args.mode == "inprocess"
    config = ElasticConfig(
        job=args.job, mesh_axes=AXES, mesh_shape=(1, len(devices)), global_batch=size.batch, checkpoint_period=0,
        elastic=ElasticOptions(policy="pause", elastic_timeout_s=120, elastic_max_retries=2),
        health=HealthOptions(scale_up_check_interval_s=3600),
        memory_tier=MemoryTierOptions(shm_dir=args.shm, memory_period=args.memory_period, max_snapshots=2,
                                      replicas=ReplicaOptions(enabled=False)),
        compilation=CompilationOptions(compilation_cache_dir=args.cache, precompile=False),
    )

    class TimedFaults(InJaxFaults):
        """Records when the slice-loss error is first raised: where the in-process recovery's time starts."""

        raised_wall: float | None = None

        def touch(self, op: Op, devices: Any, arrays: Any = ()) -> None:
            try:
                super().touch(op, devices, arrays)
            except jax.errors.JaxRuntimeError:
                if self.raised_wall is None:
                    self.raised_wall = time.time()
                raise

    slices = SimulatedSlices(devices, num_slices=1)
    faults = TimedFaults(slices)
    step_fn = make_step(size)  # one jit for every attempt: the runner clears JAX's caches at an event

    def train(ctx: ElasticContext) -> Any:
        state, step, position = ctx.restore_or_init(
            init_fn(size), lambda abstract: jax.tree_util.tree_map(lambda _: PartitionSpec(), abstract))
        attempts.append(describe(state))
        while step < args.fail_at + 50:  # a bound: the event callback ends the run long before
            ctx.step_boundary(step, state, position)
            if inprocess and step == args.fail_at and not faults.fired and not faults.armed:
                faults.fail_during("to_host", 0, down_for_s=args.down_s)  # this step's loss meets the dead slice
            state, loss = step_fn(state, make_batch(size, ctx.mesh, step))
            float(loss)  # read, as a loop that logs it does
            step += 1
            position += size.batch
        return state

    events: list[Event] = []
    attempts: list[list[str]] = []  # each attempt's state as the step sees it: what its executable is keyed on
    compiles = watch_compiles()
    stacks: list[list[Any]] = []

    sampling: list[StackSampler] = []  # from a restore to the first step done: where that time went, by thread

    def on_event(event: Event) -> None:
        events.append(event)
        if event.kind == "restored":
            sampling[:] = [StackSampler()]
            sampling[0].start()
        if event.kind == "first_step_done" and sampling:
            stacks[:] = sampling.pop().stop()
        if event.kind == ("recovered" if inprocess else "first_step_done"):
            raise StopRun

    client = CkptdClient(ClientSettings(url=args.url, shm_dir=args.shm, report_events=False), root=args.root)
    runner = ElasticRunner(config, slices=slices, client=client, checkpoint_dir=f"{args.root}/{args.job}",
                           on_event=on_event)
    with faults, contextlib.suppress(StopRun):
        runner.run(train)
    timeline = [(e.kind, e.wall_time) for e in events]
    out: dict[str, Any] = {"mode": args.mode, "devices": len(devices), "platform": devices[0].platform,
                           "started_wall": started, "imported_wall": imported, "devices_wall": devices_up,
                           "timeline": [[kind, round(wall, 4)] for kind, wall in timeline],
                           "compiles": compiles, "state_changed": state_changes(attempts),
                           "first_step_stacks": stacks}
    if inprocess:
        raised = faults.raised_wall
        if raised is None:
            raise RuntimeError(f"the slice was never lost: {timeline}")
        marks = {**event_marks(timeline, raised), "raised": raised}
        back = raised + args.down_s  # the slice's return
        recovered = next(e for e in events if e.kind == "recovered")
        out.update(seconds_total=marks["first_step_done"] - raised, down_s=args.down_s,
                   seconds=marks["first_step_done"] - back, phases=split_phases(marks, INPROCESS_PHASES),
                   after_return={"notice": marks["slices_ready"] - back,
                                 "plan": marks["plan_received"] - marks["slices_ready"],
                                 "restore": marks["restored"] - marks["plan_received"],
                                 "first_step": marks["first_step_done"] - marks["restored"]},
                   restored_from=recovered.fields.get("restored_from"),
                   restored_step=recovered.fields.get("restored_step"), lost_steps=recovered.fields.get("lost_steps"),
                   fired=[f.__dict__ for f in faults.fired])
    else:
        first = next(e for e in events if e.kind == "first_step_done")
        restored = next((e for e in events if e.kind == "restored"), None)
        out.update(marks={**event_marks(timeline, 0.0), "started": started, "imported": imported,
                          "devices": devices_up},
                   first_step_wall=first.wall_time, restored_from=restored.detail if restored else None,
                   restored_step=restored.step if restored else None)
    print(RESULT_PREFIX + json.dumps(out), flush=True)
    os._exit(0)  # no teardown: the figure is taken, and background threads need not be joined


if __name__ == "__main__":
    raise SystemExit(main())
