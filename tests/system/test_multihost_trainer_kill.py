"""A *trainer* process of a multi-host job SIGKILLed at a seeded point of a persistent save, then every trainer
restarted as JobSet restarts them (tests/support/jax_job.py, ``TrainerJob``: real ``jax.distributed`` processes
on 127.0.0.1, a ``ckptd serve`` per host with its own shared memory, one root, the leader lease on).

Kill points (``Kill``, drawn by ``chaos_rng``: printed, replayed with ``CHAOS_SEED``): while the victim's
snapshot is being copied into its shared memory (``memory-write``: the copy is widened by a pause either side so
that a kill lands inside it), after every host's snapshot was taken while the sidecars persist the parts and the
leader commits (``memory-persist``), and while a save through Orbax directly is written (``orbax-save``: a job
without a memory tier, where every persistent save is a multi-process Orbax save). After the restart:

- every step committed on storage holds every host's part (its ``ckptd_parts`` records all there, of one save
  and of the job's process count) and passes ``ckptd validate --deep``;
- no sidecar ever serves a step missing a part (a watcher asks every sidecar for the latest good step while the
  job runs and checks each answer on storage at once);
- every host resumes the same step, from the same tier;
- the data is deterministic and the restore exact, so the run ends bitwise equal (every host's shards of the
  final state, the final loss) to the same job run without a kill.

Every form takes one to three minutes on this 2-core machine (two incarnations of the job, each starting its
JAX processes): the long forms (each kill phase, 3 hosts, and the bitwise comparison with a run without a
kill) are ``chaos`` and ``slow`` (``make chaos``). The normal suite runs the short form: 2 hosts, a kill while
the sidecars persist and commit, every check but the bitwise one (~25-60 s); beside it the demo's trainer kill
(tests/system/test_multihost_demo.py) and the sidecar kills (tests/trainer/runtime/test_multihost_parts.py)."""

from __future__ import annotations

import posixpath
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from examples.demo import last_step_on_storage
from examples.multihost_demo import JOB, validate_deep
from tests.support.chaos_support import chaos_rng
from tests.support.gcs_emulator import GcsEmulator
from tests.support.jax_job import Trainer, TrainerJob, wait_exit
from trainer_client.core._errors import StorageError
from trainer_client.core._storage import Storage
from trainer_client.core.format._parts import part_problems, parts_of

PAUSE_S = 0.3  # each side of a snapshot's copy into shared memory: the window a memory-write kill lands in
STEPS, PERIOD = 40, 15  # persistent saves at 15, 30 (and 40, the end); memory-only ones every 5
STEP_TIME_S = 0.05  # paces the job: a kill drawn after the save of step 30 mostly lands before the run's end
# A step whose save the kill left with some parts on storage is claimed by that save; the restarted job's save
# of the same step takes that claim over at once, on a local root and on ``gs://`` alike (docs/multihost.md,
# section 5): ``save_timeout_s`` stays its default, 1 h.
SIDECAR_ENV = {"CKPTD_GC_INTERVAL_S": "2"}


@dataclass(frozen=True)
class Kill:
    """Trainer ``host`` SIGKILLed ``delay_s`` after it reached ``phase`` of its persistent save of ``step``."""

    host: int
    phase: str
    step: int
    delay_s: float


def draw_kill(name: str, hosts: int, phases: list[str]) -> Kill:
    rng = chaos_rng(name)
    phase = rng.choice(phases)
    window = {"memory-write": 2 * PAUSE_S + 0.1, "memory-persist": 1.5, "orbax-save": 0.4}[phase]
    kill = Kill(host=rng.randrange(hosts), phase=phase, step=rng.choice([PERIOD, 2 * PERIOD]),
                delay_s=round(rng.uniform(0.0, window), 3))
    print(f"[chaos] {name}: {kill}")
    return kill


@dataclass
class ServedWatch:
    """Asks every sidecar for the job's latest good step every 0.2 s while the job runs; a step it serves must be
    committed with every host's part record, checked on storage right then."""

    job: TrainerJob
    seen: set[int] = field(default_factory=set)
    bad: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        storage = Storage(self.job.url)
        while not self._stop.wait(0.2):
            for step in self.job.served():
                if step is None:
                    continue
                storage.invalidate()  # what is on storage now, not a listing read before the step was there
                self.seen.add(step)
                path = storage.join(self.job.job, str(step))
                why = part_problems(storage, path)
                if not storage.exists(storage.join(self.job.job, str(step), "commit_success.txt")):
                    why.append("no commit marker")
                if why:
                    self.bad.append(f"step {step} served: {why}")

    def __enter__(self) -> ServedWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Outcome:
    results: list[dict[str, Any]]  # each restarted (or, without a kill, each only) trainer's report
    validation: dict[str, Any]
    watch: ServedWatch
    hit: str = ""  # what the kill found on the victim's host and on storage
    root: str = ""  # the storage root the job ran on


def _wait(predicate: Any, timeout_s: float, what: str, trainers: list[Trainer], job: TrainerJob) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        ended = [t.index for t in trainers if t.proc.poll() is not None]
        if ended or time.monotonic() > deadline:
            logs = "\n".join(job.log(f"trainer-{k}-run1.log") for k in ended or range(job.hosts))
            why = f"trainer(s) {ended} ended first" if ended else "timed out"
            pytest.fail(f"{what}: {why}\n{logs}")
        time.sleep(0.005)


def _reached(victim: Trainer, kill: Kill) -> bool:
    if kill.phase == "memory-persist":  # every host took its snapshot and the route is agreed: ckptd's turn
        return any(e["kind"] == "checkpoint_started" and e["step"] == kill.step and e.get("tier") == "memory+persist"
                   for e in victim.events)
    return ("memory-write" if kill.phase == "memory-write" else "orbax-save", kill.step) in victim.phases


def _names(storage: Storage, path: str) -> list[str]:
    try:
        return sorted(posixpath.basename(e.path.rstrip("/")) for e in storage.list_dir(path))
    except (FileNotFoundError, StorageError):
        return []


def _committed(storage: Storage, job: str) -> list[int]:
    """The job's step numbers whose directory holds the commit marker."""
    return sorted(int(name) for name in _names(storage, storage.join(job))
                  if name.isdigit() and storage.exists(storage.join(job, name, "commit_success.txt")))


def _hit(job: TrainerJob, kill: Kill) -> str:
    held = sorted(p.name for p in (job.shms[kill.host] / job.job).glob("*")) if job.memory_tier else []
    storage = Storage(job.url)
    storage.invalidate()
    on_storage = [n for n in _names(storage, storage.join(job.job)) if n.startswith(str(kill.step))]
    committed = kill.step in _committed(storage, job.job)
    return (f"host {kill.host}'s shared memory held {held}; storage had {on_storage} for step {kill.step} "
            f"(committed: {committed})")


def run_job(base: Path, hosts: int, kill: Kill | None, *, memory_tier: bool = True,
            gcs: GcsEmulator | None = None) -> Outcome:
    """The job to its end: without ``kill`` in one incarnation; with it, the victim killed, the others left to
    jax (they abort once the heartbeat times out; SIGKILLed as JobSet would after 60 s more) and every trainer
    restarted. Then the last step committed and verified, the sidecars stopped, every step deep-validated."""
    job = TrainerJob(base, hosts, JOB, steps=STEPS, checkpoint_period=PERIOD, memory_tier=memory_tier,
                     pause_s=PAUSE_S, step_time_s=STEP_TIME_S,
                     sidecar_env=SIDECAR_ENV,
                     storage_url=gcs.gs(f"kill-{uuid.uuid4().hex[:8]}") if gcs is not None else None,
                     env=gcs.env if gcs is not None else {})
    trainers: list[Trainer] = []
    hit = ""
    try:
        job.start()
        with ServedWatch(job) as watch:
            trainers = job.launch(1)
            if kill is not None:
                victim = trainers[kill.host]
                _wait(lambda: _reached(victim, kill), 600, f"the kill point {kill}", trainers, job)
                time.sleep(kill.delay_s)
                victim.proc.kill()
                hit = _hit(job, kill)
                print(f"[kill] {kill}: {hit}")
                killed_at = time.monotonic()
                ended = wait_exit(trainers, job.heartbeat_s + 60)
                print(f"[kill] the trainers ended: {ended} within {time.monotonic() - killed_at:.1f} s "
                      "(None: still running, SIGKILLed as JobSet would)")
                job.kill(trainers)
                trainers = job.launch(2)
            codes = wait_exit(trainers, 600)
            run = 2 if kill is not None else 1
            assert codes == [0] * hosts, "\n".join(job.log(f"trainer-{k}-run{run}.log") for k in range(hosts))
            deadline = time.monotonic() + 180
            while last_step_on_storage(job.url, JOB) != STEPS:
                assert time.monotonic() < deadline, f"step {STEPS} not committed and verified within 180 s"
                time.sleep(0.2)
        results = [t.report() for t in trainers]
    finally:
        job.stop(trainers)
    return Outcome(results, validate_deep(job.url, job.env), watch, hit, job.url)


def check(outcome: Outcome, hosts: int) -> None:
    results = outcome.results
    assert [r["process_index"] for r in results] == list(range(hosts))
    assert len({r["resume_step"] for r in results}) == 1, f"hosts resumed different steps: {results}"
    assert len({r["restored_from"].split(":")[0] for r in results}) == 1, results
    assert all(r["final_step"] == STEPS for r in results)
    assert outcome.watch.bad == [], outcome.watch.bad
    validated = outcome.validation
    assert validated["exit_code"] == 0 and all(s["ok"] for s in validated["steps"]), validated
    storage = Storage(outcome.root)
    storage.invalidate()
    committed = _committed(storage, JOB)
    assert STEPS in committed and {s["step"] for s in validated["steps"]} >= set(committed)
    for step in committed:  # a step committed from parts has every host's, of one save
        path = storage.join(JOB, str(step))
        assert part_problems(storage, path) == [], step
        if storage.exists(storage.join(JOB, str(step), "ckptd_parts")):
            parts = parts_of(storage, path, hosts)
            assert all(p is not None and p.process_count == hosts for p in parts), (step, parts)
    assert outcome.watch.seen <= set(committed)


_CLEAN: dict[int, Outcome] = {}


def clean_run(hosts: int, factory: pytest.TempPathFactory) -> Outcome:
    """The same job without a kill, once per host count in a session: what the killed runs must end bitwise
    equal to."""
    if hosts not in _CLEAN:
        base = factory.mktemp(f"clean{hosts}")
        _CLEAN[hosts] = run_job(base, hosts, None)
        check(_CLEAN[hosts], hosts)
    return _CLEAN[hosts]


def assert_bitwise_equal(killed: Outcome, clean: Outcome) -> None:
    assert all(r["state_sha256"] for r in killed.results)
    assert [r["state_sha256"] for r in killed.results] == [r["state_sha256"] for r in clean.results]
    last = str(STEPS - 1)
    if killed.results[0]["resume_step"] == STEPS:  # killed after the last save: nothing left to run, no loss
        return
    assert killed.results[0]["losses"][last] == clean.results[0]["losses"][last]


@pytest.mark.timeout(900)
def test_short_a_trainer_killed_while_the_sidecars_persist_leaves_one_whole_step_for_all(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The normal suite's short form: 2 hosts, one trainer killed while the sidecars persist its save's parts."""
    kill = draw_kill("multihost-trainer-kill-short", 2, ["memory-persist"])
    base = tmp_path_factory.mktemp("kill-short")
    killed = run_job(base, 2, kill)
    check(killed, 2)
    assert all(r["restored_from"].startswith(("memory: ", "storage: ")) for r in killed.results), killed.results


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("phase", ["memory-write", "memory-persist", "orbax-save"])
def test_a_trainer_killed_mid_persist_resumes_every_host_from_one_whole_step(
        phase: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    kill = draw_kill(f"multihost-trainer-kill-{phase}", 2, [phase])
    base = tmp_path_factory.mktemp(f"kill-{phase}")
    killed = run_job(base, 2, kill, memory_tier=phase != "orbax-save")
    check(killed, 2)
    if phase == "orbax-save":  # no memory tier: storage is the only tier
        assert all(r["restored_from"].startswith(("storage: ", "none: ")) for r in killed.results)
    assert_bitwise_equal(killed, clean_run(2, tmp_path_factory))


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_three_hosts_persist_commit_and_resume_one_step_after_a_trainer_kill(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """3 JAX processes (12 devices: 3 replicas of 4), 3 sidecars, one root: one trainer killed mid-persist."""
    kill = draw_kill("multihost-trainer-kill-3-hosts", 3, ["memory-write", "memory-persist"])
    base = tmp_path_factory.mktemp("kill3")
    killed = run_job(base, 3, kill)
    check(killed, 3)
    assert_bitwise_equal(killed, clean_run(3, tmp_path_factory))


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_on_the_gcs_emulator_a_trainer_killed_mid_persist_leaves_one_whole_step_for_all(
        tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> None:
    """The same on a ``gs://`` root (the GCS emulator; parts written in place, the commit marker create-only)."""
    gcs: GcsEmulator = request.getfixturevalue("gcs_emulator")
    kill = draw_kill("multihost-trainer-kill-gcs", 2, ["memory-write", "memory-persist"])
    base = tmp_path_factory.mktemp("kill-gcs")
    killed = run_job(base, 2, kill, gcs=gcs)
    check(killed, 2)
    assert killed.root.startswith("gs://")
    storage = Storage(killed.root)
    storage.invalidate()  # every persistent save committed: one saved again after the kill took the claim over
    assert {PERIOD, 2 * PERIOD, STEPS} <= set(_committed(storage, JOB)), (kill, killed.hit)
