"""``python -m examples.demo --hosts 2``: a multi-controller job loses a host's trainer and restarts from memory.

Each host k gets its own ``ckptd serve`` (its own port, state and shared-memory directory, the leader lease
on: ``CKPTD_LEASE_TTL_S``) over one storage root under ``--out``, and its own trainer process
(examples/multihost_trainer.py: jax.distributed on 127.0.0.1, 4 CPU devices each, gloo, one global mesh; with
``--hosts 3`` a mesh of 3 replicas by 4, the MLP's hidden size being split over 4 devices, not 12).
The trainers save to storage every ``--checkpoint-period`` steps and to host memory (each host its part) every
``--memory-period``. Past step ``--kill-after`` the trainers wait at each step boundary until the demo has
seen host ``--kill-host``'s memory save of that step and a step committed on storage; then it SIGKILLs that
trainer. The survivors are left to what jax does (docs/multihost.md, section 2): their coordination agent
aborts them once the heartbeat timeout passes (at once when process 0 died). Then the demo restarts every
trainer as a JobSet restarting its pods' trainer containers in place would (new PIDs; sidecars and shared
memory stay) and all resume the step they agree on: from memory, or, with ``--lose-host-memory K`` (host K's
shared memory wiped first, as on a replaced node), host K's part from the peer sidecar that keeps a copy of it
(each sidecar sends its host's newest whole part to the next host's: docs/multihost.md, "Peer copies") and
the others' from their memory; with a host and its peer both wiped (``--lose-host-memory 1,0``), or without the
copies (``--no-peers``), every host from storage. At the end it waits until the last step is
committed and verified, stops the sidecars, and checks every step on storage with ``ckptd validate --deep``.
Prints a timeline and, last, ``report: PATH`` (exit 1 when anything above did not hold).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from examples.demo import DRAIN_TIMEOUT_S, free_port, last_step_on_storage, start_ckptd, step_label
from trainer_client.core._storage import Storage

JOB = "demo-multihost"
REPO = Path(__file__).resolve().parent.parent
QUIET = {"checkpoint_started"}  # printed only for the first saves of each kind


@dataclass
class Timeline:
    """What every process reported, printed as it comes, in one clock (seconds since the demo started)."""

    t0: float = field(default_factory=time.time)
    events: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def say(self, who: str, what: str, step: int | None = None, detail: str = "", wall: float | None = None) -> None:
        with self.lock:
            t = (wall if wall is not None else time.time()) - self.t0
            self.events.append({"t": round(t, 3), "who": who, "what": what, "step": step, "detail": detail})
            print(f"  [{t:7.2f}s] {who:<10} {what:<20} {step_label(step):<10} {detail}", flush=True)


@dataclass
class Trainer:
    proc: subprocess.Popen[str]
    index: int
    result: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    losses: dict[int, float] = field(default_factory=dict)


def _follow(trainer: Trainer, stream: TextIO, timeline: Timeline) -> None:
    """Read a trainer's stdout: its ``EVENT`` lines go to the timeline (gloo's chatter is dropped)."""
    for line in stream:
        if line.startswith("LOSS "):
            _, step, loss = line.split()
            trainer.losses[int(step)] = float(loss)
        if not line.startswith("EVENT "):
            continue
        event = json.loads(line[6:])
        trainer.events.append(event)
        tier = event.get("tier")
        if event["kind"] == "checkpoint_started":
            detail = f"{tier} save"
            if sum(1 for e in trainer.events if e["kind"] == event["kind"] and e.get("tier") == tier) > 1:
                continue
            detail += " (the next saves of this kind are not printed)"
        else:
            detail = event["detail"][:110]
        timeline.say(f"trainer {trainer.index}", event["kind"], event["step"], detail, event["wall"])


def launch(args: argparse.Namespace, hosts: list[dict[str, Any]], out: Path, round_: int,
           timeline: Timeline) -> list[Trainer]:
    """Every host's trainer process, one job (a fresh coordinator port: a new incarnation of the job)."""
    coordinator = f"127.0.0.1:{free_port()}"
    replicas = 1 if 128 % (4 * len(hosts)) == 0 else len(hosts)  # the MLP's hidden size over the data axis
    trainers = []
    for k, host in enumerate(hosts):
        result = out / f"trainer-{k}-run{round_}.json"
        result.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "examples.multihost_trainer", "--index", str(k), "--count", str(len(hosts)),
               "--coordinator", coordinator, "--url", host["url"], "--shm", str(host["shm"]), "--root", str(args.root),
               "--job", JOB, "--steps", str(args.steps), "--checkpoint-period", str(args.checkpoint_period),
               "--memory-period", str(args.memory_period), "--step-time-s", str(args.step_time_s),
               "--heartbeat-s", str(args.heartbeat_s), "--cache", str(out / "jax-cache"), "--result", str(result),
               "--hold-after", str(args.kill_after), "--hold-file", str(out / "hold"), "--replicas", str(replicas)]
        env = {**_env(), "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
        with (out / f"trainer-{k}-run{round_}.log").open("w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        trainer = Trainer(proc, k, result)
        assert proc.stdout is not None
        threading.Thread(target=_follow, args=(trainer, proc.stdout, timeline), daemon=True).start()
        timeline.say(f"trainer {k}", "process started", None, f"pid {proc.pid}, run {round_}")
        trainers.append(trainer)
    return trainers


def _env() -> dict[str, str]:
    return dict(os.environ)


def wait_for(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(interval_s)


def committed_step(root: Path | str) -> int | None:
    """The newest step committed and verified on storage, listed afresh (gcsfs keeps a process's listings)."""
    Storage(str(root)).invalidate()
    return last_step_on_storage(root, JOB)


def holder_of(k: int, hosts: int) -> int:
    """The host whose sidecar keeps the copy of host k's part (ckptd's default: the next host)."""
    return (k + 1) % hosts


def expected_tiers(args: argparse.Namespace) -> list[str]:
    """Where each host must restore from: its memory, a peer's copy (a wiped host whose peer kept its part),
    or storage (every host, when a wiped host's part is nowhere)."""
    if args.no_kill:
        return ["none"] * args.hosts
    lost = set(args.lost)
    if lost and (args.no_peers or args.corrupt_peer_copy or any(holder_of(k, args.hosts) in lost for k in lost)):
        return ["storage"] * args.hosts
    return ["peer" if k in lost else "memory" for k in range(args.hosts)]


def newest_own_step(shm: Path) -> int | None:
    steps = [int(p.name) for p in (shm / JOB).glob("*") if p.name.isdigit()] if (shm / JOB).is_dir() else []
    return max(steps, default=None)


def wait_for_copies(args: argparse.Namespace, hosts: list[dict[str, Any]], timeline: Timeline) -> None:
    """Before a wipe: the copy of each wiped host's newest part is held by its peer (the sidecars copy in the
    background; a node lost before its copy landed takes the job to the newest step every host can still get)."""
    for k in args.lost:
        step = newest_own_step(hosts[k]["shm"])
        holder = holder_of(k, args.hosts)
        copy = hosts[holder]["shm"] / JOB / f".peer-{k}" / str(step)
        try:
            wait_for(lambda copy=copy: copy.is_dir(), 60, f"host {holder}'s copy of host {k}'s step {step}")
            timeline.say(f"ckptd {holder}", "peer copy held", step, f"host {k}'s part, in {copy.parent}")
        except TimeoutError as exc:
            timeline.say(f"ckptd {holder}", "NO peer copy", step, str(exc))
            continue
        if args.corrupt_peer_copy:  # one bit of a shard flipped: the size still right, the checksum not
            with (copy / "data.bin").open("r+b") as f:
                first = f.read(1)
                f.seek(0)
                f.write(bytes([first[0] ^ 1]))
            timeline.say(f"ckptd {holder}", "peer copy damaged", step, "one bit flipped (--corrupt-peer-copy)")


def first_run(args: argparse.Namespace, hosts: list[dict[str, Any]], out: Path, timeline: Timeline) -> list[Trainer]:
    """Train until host ``kill_host`` has saved ``kill_after`` to memory, SIGKILL it, wait for the others to end."""
    hold = out / "hold"  # the trainers wait past step kill_after while it exists: the kill comes there
    if not args.no_kill:
        hold.touch()
    trainers = launch(args, hosts, out, 1, timeline)
    if args.no_kill:
        for t in trainers:
            rc = t.proc.wait(timeout=600)
            timeline.say(f"trainer {t.index}", "exited", None, f"exit {rc}")
        return trainers
    victim = trainers[args.kill_host]

    def ready_to_kill() -> bool:  # a memory-only save past kill_after, and a step committed on storage before it
        if any(t.proc.poll() is not None for t in trainers):
            raise RuntimeError("a trainer ended before the kill: see its log under --out")
        return any(e["kind"] == "checkpoint_started" and e.get("tier") == "memory" and e["step"] >= args.kill_after
                   for e in victim.events) and committed_step(args.root) is not None

    wait_for(ready_to_kill, 600, f"trainer {args.kill_host}'s memory save of step {args.kill_after} and a step "
             "committed on storage", 0.1)
    killed_at = time.time()
    victim.proc.kill()
    on_storage = committed_step(args.root)
    timeline.say(f"trainer {victim.index}", "SIGKILL", None, f"pid {victim.proc.pid} (step {on_storage} committed "
                 "on storage)", killed_at)
    victim.proc.wait()
    hold.unlink()
    for t in trainers:
        if t is victim:
            continue
        try:
            rc = t.proc.wait(timeout=args.heartbeat_s + 60)
            how = "aborted by jax (SIGABRT)" if rc == -6 else f"exited {rc}"
        except subprocess.TimeoutExpired:  # never seen with jax 0.10.2; JobSet would delete the pod
            t.proc.kill()
            rc = t.proc.wait()
            how = "still running: SIGKILLed as JobSet would"
        timeline.say(f"trainer {t.index}", "ended", None, f"{how}, {time.time() - killed_at:.1f} s after the kill")
    return trainers


def validate_deep(root: Path | str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``ckptd validate ROOT/JOB --deep``: every finalized step read back and decoded (``root``: a directory or
    a storage URL; ``env``: more environment for the CLI, e.g. a storage emulator's)."""
    proc = subprocess.run([sys.executable, "-m", "ckptd", "validate", f"{root}/{JOB}", "--deep", "--no-quarantine",
                           "--json"], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**_env(), **(env or {})})
    try:
        answer = json.loads(proc.stdout)
    except json.JSONDecodeError:
        answer = {"steps": [], "error": proc.stderr[-2000:]}
    answer["exit_code"] = proc.returncode
    return answer


def build_parser() -> argparse.ArgumentParser:
    """The multi-controller demo's options."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hosts", type=int, default=2, help="hosts of the job, one trainer process and one ckptd each")
    parser.add_argument("--out", default="demo-output", help="directory for checkpoints, logs and the report")
    parser.add_argument("--lose-host-memory", default=None, metavar="K[,J...]",
                        help="wipe these hosts' shared memory before the restart (replaced nodes): a wiped host gets "
                        "its part from its peer's copy; when its peer was wiped too, every host resumes from storage")
    parser.add_argument("--corrupt-peer-copy", action="store_true",
                        help="flip a bit in the peer's copy of each wiped host's part: found, every host from storage")
    parser.add_argument("--trainer-asks", action="store_true",
                        help="sidecars that wait for the trainer's request to bring a wiped host's part back "
                        "(CKPTD_PEER_REFILL=false): the agreement's fetch path")
    parser.add_argument("--no-peers", action="store_true",
                        help="sidecars without the peer channel: a wiped host sends every host to storage")
    parser.add_argument("--steps", type=int, default=100, help="steps to train (default 100)")
    parser.add_argument("--checkpoint-period", type=int, default=30, help="steps between saves to storage")
    parser.add_argument("--memory-period", type=int, default=10, help="steps between memory-only saves")
    parser.add_argument("--kill-after", type=int, default=50,
                        help="host --kill-host dies after its memory save of this step")
    parser.add_argument("--kill-host", type=int, default=1, help="the host whose trainer is SIGKILLed (default 1)")
    parser.add_argument("--step-time-s", type=float, default=0.03, help="seconds each step sleeps (default 0.03)")
    parser.add_argument("--heartbeat-s", type=int, default=10, help="jax.distributed heartbeat timeout")
    parser.add_argument("--no-kill", action="store_true", help="the same run without a failure (for comparison)")
    parser.add_argument("--root", default=None, metavar="URL",
                        help="the storage root, empty (default: OUT/checkpoints): a directory or gs://BUCKET/PREFIX "
                        "(its credentials, or an emulator's variables, in the environment)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.lost = sorted({int(k) for k in (args.lose_host_memory or "").split(",") if k.strip()})
    except ValueError:
        args.lost = [-1]
    if args.hosts < 2 or not 0 <= args.kill_host < args.hosts or not all(0 <= k < args.hosts for k in args.lost):
        parser.error("--hosts must be at least 2; --kill-host and --lose-host-memory name hosts 0..hosts-1")

    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if args.root is None or "://" not in args.root:  # a directory; else an object store's prefix
        args.root = Path(args.root).resolve() if args.root else out / "checkpoints"
        (args.root / JOB).mkdir(parents=True, exist_ok=True)
    shm_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else out
    timeline = Timeline()
    hosts: list[dict[str, Any]] = []
    servers: list[subprocess.Popen[bytes]] = []
    secret = secrets.token_hex(32)  # every sidecar of the job shares it (in a pod: a Secret)
    try:
        for k in range(args.hosts):  # one sidecar per host; the lease makes one of them the job's only writer
            shm = Path(tempfile.mkdtemp(prefix=f"ckptd-demo-host{k}-", dir=shm_base))
            hosts.append({"shm": shm, "port": free_port(), "peer_port": free_port()})
            hosts[-1]["url"] = f"http://127.0.0.1:{hosts[-1]['port']}"
        with ThreadPoolExecutor(args.hosts) as pool:  # started side by side, as the pods' sidecars are
            peers = {} if args.no_peers else {"CKPTD_PEER_SECRET": secret, "CKPTD_PEER_HOST": "127.0.0.1",
                                              "CKPTD_PEER_REFILL": "false" if args.trainer_asks else "true"}
            started = [pool.submit(start_ckptd, args.root, out / f"ckptd-state-{k}", host["shm"], host["port"],
                                   out / f"ckptd-{k}.log", {"CKPTD_LEASE_TTL_S": "3", **peers, **(
                                       {"CKPTD_PEER_PORT": str(host["peer_port"])} if peers else {})})
                       for k, host in enumerate(hosts)]
            for k, future in enumerate(started):
                servers.append(future.result())
                timeline.say(f"ckptd {k}", "serving", None,
                             f"{hosts[k]['url']} (pid {servers[-1].pid}), shm {hosts[k]['shm']}")
        before = first_run(args, hosts, out, timeline)
        after = before
        if not args.no_kill:
            if args.lost and not args.no_peers:
                wait_for_copies(args, hosts, timeline)
            for k in args.lost:
                wiped = hosts[k]["shm"]
                for child in wiped.iterdir():
                    shutil.rmtree(child, ignore_errors=True)
                timeline.say(f"host {k}", "memory wiped", None, f"{wiped} emptied (node replaced)")
            after = launch(args, hosts, out, 2, timeline)  # JobSet: every trainer container restarts in place
            for t in after:
                rc = t.proc.wait(timeout=600)
                timeline.say(f"trainer {t.index}", "exited", None, f"exit {rc}")
        results = [json.loads(t.result.read_text()) if t.result.exists() else None for t in after]
        committed = None
        try:
            wait_for(lambda: committed_step(args.root) == args.steps, 120,
                     f"step {args.steps} committed and verified", 0.25)
            committed = args.steps
            timeline.say("storage", "committed", args.steps, "the last step: committed and verified by the leader")
        except TimeoutError as exc:
            timeline.say("storage", "NOT committed", args.steps, str(exc))
    finally:
        for server in servers:  # SIGTERM: a sidecar persists what still waits in its memory first
            server.terminate()
        for server in servers:
            server.wait(timeout=DRAIN_TIMEOUT_S + 30)
        for host in hosts:
            shutil.rmtree(host["shm"], ignore_errors=True)
    validation = validate_deep(args.root)
    steps_ok = [r["step"] for r in validation["steps"] if r.get("ok")]
    timeline.say("ckptd", "validate --deep", None, f"steps {sorted(steps_ok)} ok, {validation.get('bad')} bad, "
                 f"exit {validation['exit_code']}")
    return _report(args, out, timeline, results, before, after, committed, validation)


def _report(args: argparse.Namespace, out: Path, timeline: Timeline, results: list[Any],
            before: list[Trainer], after: list[Trainer], committed: int | None, validation: dict[str, Any]) -> int:
    done = [r for r in results if r is not None]
    losses = {k: v for t in before for k, v in t.losses.items()}
    losses.update({int(k): v for r in done for k, v in r["losses"].items()})
    agreed = {r["resume_step"] for r in done}
    report: dict[str, Any] = {
        "root": str(args.root),
        "job": JOB,
        "initial_loss": losses.get(0),
        "final_loss": losses.get(args.steps - 1),
        "final_step": done[0]["final_step"] if done else None,
        "agreed_step": agreed.pop() if len(agreed) == 1 and len(done) == len(after) else None,
        "hosts": [{"process_index": k, "pid_before": b.proc.pid, "pid_after": a.proc.pid,
                   "resume_step": r["resume_step"] if r else None, "restored_from": r["restored_from"] if r else None,
                   "state_sha256": r["state_sha256"] if r else None}
                  for k, (b, a, r) in enumerate(zip(before, after, results, strict=True))],
        "killed_host": None if args.no_kill else args.kill_host,
        "lost_host_memory": args.lost[0] if len(args.lost) == 1 else (args.lost or None),
        "peers": not args.no_peers,
        "last_step_committed": committed,
        "validate_deep": {"exit_code": validation["exit_code"], "steps": [
            {"step": r["step"], "ok": r.get("ok"), "problems": r.get("problems", [])[:3]}
            for r in validation["steps"]]},
        "timeline": timeline.events,
    }
    path = out / "report.json"
    path.write_text(json.dumps(report, indent=2))
    expect = expected_tiers(args)
    tiers = [str(h["restored_from"]).split(":")[0] for h in report["hosts"]]
    problems = [
        *([] if report["agreed_step"] is not None else ["the hosts resumed different steps"]),
        *([] if tiers == expect else [f"restored from {tiers}, expected {expect}"]),
        *([] if report["final_step"] == args.steps else [f"final step {report['final_step']}"]),
        *([] if (report["final_loss"] or 1e9) < (report["initial_loss"] or 0) else ["the loss did not go down"]),
        *([] if committed == args.steps else [f"step {args.steps} not committed and verified"]),
        *([] if validation["exit_code"] == 0 and validation["steps"] else ["ckptd validate --deep failed"]),
    ]
    print(f"\nagreed step {report['agreed_step']}: "
          + "; ".join(f"host {h['process_index']} pid {h['pid_before']} -> {h['pid_after']}, {h['restored_from']}"
                      for h in report["hosts"]))
    print(f"loss {report['initial_loss']} (step 0) -> {report['final_loss']} (step {args.steps - 1}); "
          f"{len(validation['steps'])} step(s) on storage, validate --deep exit {validation['exit_code']}")
    for problem in problems:
        print(f"FAILED: {problem}")
    print(f"report: {path}")
    return 0 if not problems else 1


__all__ = ["JOB", "main"]
