"""``make demo``: lose a slice mid-run and keep training in the same process.

Starts a real ckptd (``python -m ckptd serve``) on 127.0.0.1 over a local directory, with the host-memory
tier in ``/dev/shm``; trains the demo MLP on 8 fake CPU devices grouped into 4 slices (a replica snapshot in
the hosts' pinned memory after every step, a shared-memory snapshot every 5 steps, a persistent one every 50,
which ckptd writes to storage), takes slice 2 down mid-run, recovers on 3 slices in the same PID from the
replicas of the newest step on the slices left (the meshes compiled ahead of time in the background; at
most one step lost), grows back to 4 when the slice returns, finishes and stops the server, which first
persists what the run saved last: the run ends with its last step committed and verified on storage.
Prints a timeline and, as its last line, ``report: PATH`` naming a JSON report.

Options: ``--spares 1`` keeps one of the 4 slices as a hot spare (mesh 3 x 2): the spare takes slice 2's place
at once, same mesh, and slice 2 becomes the spare when it returns. ``--fault in-jax`` loses the slice from inside
a JAX operation (``InJaxFaults``: reading the step's loss raises ``DATA_LOSS`` mid-step, as on Pathways) instead
of at the step boundary. ``--no-replicas`` turns the replica snapshot tier off: the recovery then restores the
newest snapshot in shared memory (up to 5 steps lost), as before that tier existed. Each recovery in the report
says where it restored from (``restored_from``: ``replicas``, ``memory: PATH`` or ``storage: PATH``).

On one accelerator chip (the single-slice pause form: the run waits for its one slice and restores onto it, in
the same PID): ``JAX_PLATFORMS=tpu python -m examples.demo --slices 1 --policy pause --fault in-jax --uds``
(``--uds``: ckptd on a unix socket, for a machine that allows no TCP; without ``JAX_PLATFORMS`` the demo runs on
8 fake CPU devices).

``--hosts 2 [--lose-host-memory K]``: a multi-controller job instead (a trainer process and a ckptd per host, one
lost and every trainer restarted): examples/multihost_demo.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import contextlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import jax

from examples.elastic_mlp import TrainLog, make_train_fn
from trainer_client import (
    CkptdClient,
    ClientSettings,
    CompilationOptions,
    ElasticConfig,
    ElasticOptions,
    ElasticRunner,
    Event,
    HealthOptions,
    InJaxFaults,
    MemoryTierOptions,
    ReplicaOptions,
    SimulatedSlices,
    SliceFault,
)
from trainer_client.core._ckptd_url import parse_ckptd_url, unix_url
from trainer_client.core._storage import Storage
from trainer_client.core.format._manifest import read_verified_record
from trainer_client.core.format._steps import inspect_step, step_entries
from trainer_client.core.protocol import StepState

JOB = "demo-mlp"
DRAIN_TIMEOUT_S = 60  # how long ckptd may take at shutdown to persist what the run saved last


def step_label(step: int | None) -> str:
    """An event's step for a timeline line: ``step  150``, or blank for an event of no step (a wait, the start)."""
    return "" if step is None else f"step {step:>4}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ckptd_url(listen: int | Path) -> str:
    """The URL a client reaches a ckptd of ``start_ckptd`` at: a TCP port on 127.0.0.1, or a unix socket's path."""
    return unix_url(listen) if isinstance(listen, Path) else f"http://127.0.0.1:{listen}"


def start_ckptd(root: Path | str, state_dir: Path, shm_dir: Path, listen: int | Path, log: Path,
                extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``ckptd serve`` in its own process, on 127.0.0.1 at the port ``listen`` or on the unix socket at the path
    ``listen`` (where a machine allows no TCP: docs/deploy.md, "Over a unix socket"), its log (and its persist
    worker's) in ``log``: a pipe nobody reads would fill up and stall it. ``extra_env``: more ckptd settings."""
    env = {**os.environ, "CKPTD_REFRESH_INTERVAL_S": "0.5", "CKPTD_MAX_SNAPSHOTS": "8",
           "CKPTD_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S), **(extra_env or {})}
    where = ["--uds", str(listen)] if isinstance(listen, Path) else ["--host", "127.0.0.1", "--port", str(listen)]
    with log.open("ab") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "serve", "--root", str(root), *where,
             "--state-dir", str(state_dir), "--shm-dir", str(shm_dir)],
            env=env, stdout=sink, stderr=subprocess.STDOUT,
        )
    address = parse_ckptd_url(ckptd_url(listen))
    deadline = time.monotonic() + 30
    with httpx.Client(base_url=address.base_url, transport=httpx.HTTPTransport(uds=address.uds), timeout=0.5) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"ckptd exited: {log.read_text(errors='replace')[-4000:]}")
            try:
                if http.get("/readyz").status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("ckptd did not become ready within 30 s")


def build_parser() -> argparse.ArgumentParser:
    """The demo's options (``--hosts N``: the multi-controller demo's own, ``main`` hands it those)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hosts", type=int, metavar="N",
                        help="a multi-controller job of N hosts instead, one trainer process and one ckptd each "
                        "(its own options: --hosts 2 --help)")
    parser.add_argument("--out", default="demo-output", help="directory for checkpoints and the report")
    parser.add_argument("--steps", type=int, default=400, help="steps to train (default 400)")
    parser.add_argument("--fail-at", type=int, default=150, help="step at which the slice goes down")
    parser.add_argument("--down-for", type=float, default=3.0, help="seconds until the slice returns")
    parser.add_argument("--policy", choices=["pause", "resize"], default="resize",
                        help="resize: go on on the slices left (default); pause: wait for the slice to return")
    parser.add_argument("--slices", type=int, default=4,
                        help="slices the devices are grouped into (default 4; 1 on one chip, with --policy pause)")
    parser.add_argument("--lose-slice", type=int, default=None,
                        help="the slice that goes down (default 2, or the last slice when there are fewer)")
    parser.add_argument("--uds", action="store_true",
                        help="ckptd on a unix socket instead of a TCP port (where the machine allows no TCP)")
    parser.add_argument("--no-memory-tier", action="store_true", help="save to storage only, through Orbax")
    parser.add_argument("--no-replicas", action="store_true",
                        help="no replica snapshots in the hosts' pinned memory: recover from shared memory or storage")
    parser.add_argument("--spares", type=int, choices=[0, 1, 2], default=0,
                        help="hot spare slices: the mesh uses all slices but N, a spare takes a lost slice's place")
    parser.add_argument("--fault", choices=["boundary", "in-jax"], default="boundary",
                        help="where the slice's loss surfaces: at a step boundary, or inside a JAX operation mid-step")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--hosts" or a.startswith("--hosts=") for a in argv):  # a multi-controller job: its own demo
        from examples.multihost_demo import main as multihost_main

        return multihost_main(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    devices = jax.device_count()
    lost = min(2, args.slices - 1) if args.lose_slice is None else args.lose_slice
    if args.slices < 1 or devices % args.slices:
        parser.error(f"--slices {args.slices}: the {devices} device(s) do not split into that many equal slices")
    if not 0 <= lost < args.slices or args.spares >= args.slices:
        parser.error(f"--lose-slice {lost} / --spares {args.spares}: the job has slices 0..{args.slices - 1}")
    if args.policy == "resize" and args.slices - args.spares < 2:
        parser.error("--policy resize needs a slice to go on on: with one slice, use --policy pause")

    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    root, state_dir = out / "checkpoints", out / "ckptd-state"
    (root / JOB).mkdir(parents=True)
    shm_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else out
    shm_dir = Path(tempfile.mkdtemp(prefix="ckptd-demo-", dir=shm_base))
    # a unix socket's path must be short (sun_path): its own directory under the temp directory
    listen: int | Path = Path(tempfile.mkdtemp(prefix="ckptd-demo-")) / "ckptd.sock" if args.uds else free_port()
    url = ckptd_url(listen)
    server = start_ckptd(root, state_dir, shm_dir, listen, out / "ckptd.log")
    print(f"ckptd serving {root} on {url} (pid {server.pid}); memory tier in {shm_dir}; log {out / 'ckptd.log'}")
    print(f"trainer pid {os.getpid()}, {devices} {jax.devices()[0].platform} device(s) in {args.slices} slice(s), "
          f"policy {args.policy}" + (f", {args.spares} hot spare(s)" if args.spares else "")
          + f", slice {lost} lost {args.fault}" + ("" if args.no_replicas else ", replica snapshots every step"))

    previous = [0.0]

    def show(event: Event) -> None:
        took = event.t - previous[0]
        previous[0] = event.t
        print(f"  [{event.t:7.2f}s +{took:5.2f}s] {event.kind:<18} {step_label(event.step):<10} {event.detail}",
              flush=True)

    quiet = {"checkpoint_started"}
    config = ElasticConfig(
        job=JOB, mesh_axes=("replica", "data"), mesh_shape=(args.slices - args.spares, devices // args.slices),
        global_batch=48,
        checkpoint_period=50,
        elastic=ElasticOptions(policy=args.policy, elastic_timeout_s=60, elastic_max_retries=5,
                               spare_slices=args.spares),
        health=HealthOptions(scale_up_check_interval_s=0.5),
        compilation=CompilationOptions(compilation_cache_dir=str(out / "jax-cache")),
        # the memory tier snapshots into the client's shared-memory directory (ClientSettings.shm_dir: tier_dir)
        memory_tier=MemoryTierOptions(memory_period=None if args.no_memory_tier else 5, max_snapshots=8,
                                      # every step; the loop waits for a copy still in flight (the demo's
                                      # state is small): every step is held, a slice loss costs at most one
                                      # step however busy the machine (the default skips a busy snapshot)
                                      replicas=ReplicaOptions(enabled=not args.no_replicas, period=1,
                                                              when_busy="wait")),
    )
    in_jax = args.fault == "in-jax"
    slices = SimulatedSlices(num_slices=args.slices,
                             faults=[] if in_jax else [SliceFault(lost, args.fail_at, args.down_for)])
    injector = InJaxFaults(slices)

    def lose_inside_jax(step: int) -> None:  # the step's loss, read to the host, meets the dead slice
        if in_jax and step == args.fail_at and not injector.fired and not injector.armed:
            injector.fail_during("to_host", lost, down_for_s=args.down_for)

    log = TrainLog()
    pid_before = os.getpid()
    try:
        tier_dir = None if args.no_memory_tier else str(shm_dir)  # the one shared-memory directory of the run
        client = CkptdClient(ClientSettings(url=url, shm_dir=tier_dir), root=str(root))
        runner = ElasticRunner(config, slices=slices, client=client, checkpoint_dir=str(root / JOB),
                               on_event=lambda e: None if e.kind in quiet else show(e))
        with injector if in_jax else contextlib.nullcontext():
            result = runner.run(make_train_fn(args.steps, log, step_hook=lose_inside_jax))
        runner.checkpointer.close()
        client.close()
    finally:
        # SIGTERM: ckptd persists the snapshots still waiting (the run's last save among them) before it exits
        server.terminate()
        server.wait(timeout=DRAIN_TIMEOUT_S + 30)
        shutil.rmtree(shm_dir, ignore_errors=True)
        if isinstance(listen, Path):
            shutil.rmtree(listen.parent, ignore_errors=True)
    on_storage = last_step_on_storage(root)
    first, last = min(log.losses), max(log.losses)
    report = {
        "pid_before": pid_before,
        "pid_after": result.pid,
        "policy": args.policy,
        "platform": jax.devices()[0].platform,
        "slices": args.slices,
        "ckptd_url": url,
        "spares": args.spares,
        "fault": args.fault,
        "replicas": not args.no_replicas,
        "in_jax_faults": [f.__dict__ for f in injector.fired],
        "events": [{"kind": e.kind, "step": e.step, "time": round(e.t, 4), "detail": e.detail}
                   for e in result.events],
        "recoveries": [r.__dict__ for r in result.recoveries],
        "recovery_seconds": [round(r.seconds or 0.0, 4) for r in result.recoveries],
        "lost_steps": sum(r.lost_steps or 0 for r in result.recoveries),
        "final_step": result.final_step,
        "first_loss": log.losses[first],
        "final_loss": log.losses[last],
        "steps_computed": log.steps_run,
        "last_step_on_storage": on_storage,
    }
    report_path = out / "report.json"
    report_path.write_text(json.dumps(report, indent=2))
    print("\nrecoveries:")
    for r in result.recoveries:
        print(f"  {r.kind:<10} at step {r.failed_at_step}: mesh {r.mesh_before} -> {r.mesh_after}, "
              f"slices {r.slices_before} -> {r.slices_after}"
              + (f" (spare {r.spares_used} in)" if r.spares_used else "")
              + f", restored step {r.restored_step} from {r.restored_from}, lost {r.lost_steps} steps, "
              f"{r.seconds:.2f}s to first step")
    print(f"loss {report['first_loss']:.4f} (step {first}) -> {report['final_loss']:.4f} (step {last}); "
          f"same pid: {pid_before == result.pid}")
    print(f"on storage: step {on_storage} committed and verified"
          + ("" if on_storage == args.steps else f" -- NOT the run's last step {args.steps}"))
    print(f"report: {report_path}")
    ok = pid_before == result.pid and report["final_loss"] < report["first_loss"] and on_storage == args.steps
    return 0 if ok else 1


def last_step_on_storage(root: Path | str, job_name: str = JOB) -> int | None:
    """The newest step of the job that is committed on storage and carries ckptd's verified record."""
    storage = Storage(str(root))
    job = storage.join(job_name)
    for parsed, entry in step_entries(storage, job):
        inspection = None if parsed.is_tmp else inspect_step(storage, entry)
        if inspection is not None and inspection.state == StepState.COMMITTED and \
                read_verified_record(storage, entry.path) is not None:
            return parsed.step
    return None


if __name__ == "__main__":
    sys.exit(main())
