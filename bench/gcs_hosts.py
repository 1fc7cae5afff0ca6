"""N simulated hosts persisting one step of a multi-host job to one bucket that behaves like GCS under load
(docs/gcs.md, "Many hosts on one bucket"): ``python -m bench.gcs_hosts --hosts 64,256,1024``.

Each host is what ckptd runs on it: a ``PartSaves`` (``ckptd/multihost/_part_commit.py``) with its own gcsfs client
(its own listing cache), persisting its own part of the step (``bench/gcs_host_parts.py``: a real layout at a
small size) through a persist worker child, as the sidecar's keeper does: claim, the part's Orbax writes, the
part record; a failed try is tried again after the keeper's ``PART_RETRY_S``. One leader (its own client and
worker) runs the commit pass every ``poll_s`` until the step is committed. The bucket is the GCS emulator behind
``tests/support/gcs_shaper.py`` (GCS's write and read rates, one write a second per object name, 429/503 past
them); the hosts' requests pass one door of it and the leader's another, so each is counted apart. Each host
paces its part's writes at its share of the bucket's write budget (``PartSaves``' ``WriteShare``: the bucket's
write rate over the host count, spread with jitter), as ckptd does by default; ``--no-budget`` runs the hosts
unpaced, on back-off alone (the figures before the shared budget: docs/gcs.md).

What a run reports (``persist_step``): whether the step was committed, when (from the start of every host's
persist), the time the bucket's rates themselves allow for the requests the step was admitted
(``Limits.bound_s``) and the ratio of the two; requests per host (reads and writes) and the leader's; refusals
(by reason and status); objects written twice within a second; failed tries and parts never written; lost
parts (committed without a part's record or files). Here the host workers are ``--workers`` children serving
the hosts in turn (a real host has its own), so on a small machine the bound only shows where the rates are
scaled down to below what the machine can drive (``--rate-scale``). The suite runs it at a few hosts
(``tests/system/test_gcs_many_hosts.py``).
"""

from __future__ import annotations

import os

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # read when gcsfs is imported

import argparse
import contextlib
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.gcs_host_parts import write_host_parts
from ckptd.memory_tier._snapshots import PART_RETRY_S
from ckptd.multihost._commit_pass import CommitPass
from ckptd.multihost._part_commit import PartSaves
from ckptd.persist._worker_client import (
    PersistSnapshot,
    PersistWorker,
    PersistWorkerClient,
    WorkerAnswer,
    WorkerRequest,
)
from trainer_client.core._storage import Storage, join_path
from trainer_client.core.format._files import COMMIT_MARKER
from trainer_client.core.format._manifest import read_manifest
from trainer_client.core.format._parts import read_part, record_path
from trainer_client.core.format._snapshot import SnapshotMeta, read_meta

JOB, STEP = "hosts", 100
Stats = Callable[[], dict[str, Any]]


class WorkerPool(PersistWorker):
    """Several persist workers behind one: each request goes to the next free one."""

    def __init__(self, workers: Sequence[PersistWorker]) -> None:
        self.workers = list(workers)
        self._free: queue.Queue[PersistWorker] = queue.Queue()
        for worker in self.workers:
            self._free.put(worker)

    def exchange(self, request: WorkerRequest) -> WorkerAnswer:
        worker = self._free.get()
        try:
            return worker.exchange(request)
        finally:
            self._free.put(worker)

    def close(self, timeout_s: float = 10.0) -> None:
        for worker in self.workers:
            worker.close(timeout_s)


class MarkedWorker(PersistWorker):
    """``worker``, calling ``mark()`` once before its first request (the leader's: the commit starts)."""

    def __init__(self, worker: PersistWorker, mark: Callable[[], object]) -> None:
        self.worker, self.mark = worker, mark
        self._marked = threading.Event()

    def exchange(self, request: WorkerRequest) -> WorkerAnswer:
        if not self._marked.is_set():
            self._marked.set()
            self.mark()
        return self.worker.exchange(request)


class DoorWorker(PersistWorkerClient):
    """A persist worker child whose gcsfs and tensorstore talk to ``url`` (a door of the shaper)."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.url = url

    def command(self) -> list[str]:
        from tests.support.gcs_emulator import emulator_env

        return ["env", *(f"{k}={v}" for k, v in emulator_env(self.url).items()), *super().command()]


def warm_clients(storages: list[Storage], settle_s: float) -> list[Storage]:
    """``storages``, each having asked storage once (a listing of the root), as a running sidecar's client has long
    before a persist: the hosts' first requests of the step then do not queue behind the opening of hundreds of
    connections on this process's one gcsfs event loop (which bunched them, and the bucket refused the bunch).
    Then ``settle_s`` for the bucket's token buckets to fill again; the caller forgets these requests' counts."""
    def ask(storage: Storage) -> None:
        with contextlib.suppress(FileNotFoundError):
            storage.fs.ls(storage.root)

    with ThreadPoolExecutor(min(32, max(1, len(storages))), thread_name_prefix="warm") as pool:
        list(pool.map(ask, storages))
    time.sleep(settle_s)
    return storages


def lost_parts(storage: Storage, job: str, step: int, hosts: int) -> list[int]:
    """The processes whose part the committed step lacks: its record, or a file of it, not in the manifest (all
    of them when the step is not committed)."""
    final = storage.join(job, str(step))
    storage.invalidate()
    manifest = read_manifest(storage, final) if storage.exists(join_path(final, COMMIT_MARKER)) else None
    if manifest is None:
        return list(range(hosts))
    lost = []
    for k in range(hosts):
        part = read_part(storage, final, k)
        rel = record_path("", k).lstrip("/")
        if part is None or rel not in manifest.files or any(f.path not in manifest.files for f in part.files):
            lost.append(k)
    return lost


def persist_step(parts: list[Path], *, host_storage: Callable[[int], Storage], leader_storage: Storage,
                 host_worker: PersistWorker, leader_worker: PersistWorker, stats: Stats, reset: Callable[[], object],
                 concurrency: int, poll_s: float = 0.5, retry_s: float = PART_RETRY_S,
                 timeout_s: float = 600.0, bucket_writes_per_s: float = 0.0) -> dict[str, Any]:
    """Every host persists its part of ``STEP`` of ``JOB`` at once (``concurrency`` at a time), the leader commits;
    what happened, counted at the shaper (``stats``: its snapshot, ``reset``: forget its counts).
    ``bucket_writes_per_s``: the write budget the hosts share (``PartSaves``; 0: unpaced, back-off alone)."""
    hosts = len(parts)
    marks: dict[str, dict[str, Any]] = {}
    leader = CommitPass(leader_storage, jobs=lambda: [JOB], writes=lambda _job: True, interval_s=poll_s,
                        worker=MarkedWorker(leader_worker, lambda: marks.setdefault("commit", stats())))
    failures: list[str] = []
    written: dict[int, float] = {}
    paced_s: list[float] = []  # each host's waits for its share of the budget, in all
    committed_at: list[float] = []
    done = threading.Event()
    lock = threading.Lock()
    storages = warm_clients([host_storage(k) for k in range(hosts)], settle_s=1.0)
    reset()
    started = time.perf_counter()
    deadline = started + timeout_s

    def lead() -> None:
        while not done.is_set() and time.perf_counter() < deadline:
            leader_storage.invalidate(leader_storage.join(JOB))  # as the refresher's scan before it does
            if leader.run_once():
                committed_at.append(time.perf_counter() - started)
                return
            if leader.last_error is not None:
                failures.append(f"leader: {leader.last_error}"[:400])
                leader.last_error = None
            done.wait(poll_s)

    def host(k: int) -> None:
        saves = PartSaves(storages[k], host_worker, sidecar=f"host-{k}", bucket_writes_per_s=bucket_writes_per_s)
        meta = read_meta(parts[k])
        try:
            try_part(k, saves, meta)
        finally:
            with lock:
                paced_s.append(saves.share.waited_s)

    def try_part(k: int, saves: PartSaves, meta: SnapshotMeta) -> None:
        while time.perf_counter() < deadline:
            try:
                outcome = saves.persist_part(JOB, str(parts[k]), meta)
                if outcome in ("written", "committed"):
                    with lock:
                        written[k] = time.perf_counter() - started
                        last = len(written) == hosts
                    if last:  # the last part landed: what the step asked so far is its parts' share
                        marks["parts"] = stats()
                    return
                failures.append(f"host {k}: {outcome}")
            except Exception as exc:  # the keeper reports it and tries the part again after PART_RETRY_S
                failures.append(f"host {k}: {type(exc).__name__}: {exc}"[:400])
            time.sleep(retry_s)

    leading = threading.Thread(target=lead, name="leader", daemon=True)
    leading.start()
    with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="host") as pool:
        list(pool.map(host, range(hosts)))
    leading.join(timeout=max(0.0, deadline - time.perf_counter()) + poll_s + 60)
    done.set()
    end = stats()
    at_commit = marks.get("commit", end)["stats"]
    at_parts = marks.get("parts", end)["stats"]
    total = end["stats"]
    host_requests = at_commit.get("door:hosts:requests", 0)
    host_writes = at_commit.get("door:hosts:admitted_writes", 0)
    host_reads = at_commit.get("door:hosts:admitted_reads", 0)
    return {
        "hosts": hosts, "committed": bool(committed_at), "commit_s": committed_at[0] if committed_at else None,
        "parts_s": max(written.values(), default=None), "failed_tries": len(failures), "failures": failures[:20],
        "failed_parts": sorted(set(range(hosts)) - set(written)),
        "lost_parts": lost_parts(leader_storage, JOB, STEP, hosts),
        "asked_per_host": host_requests / hosts,  # refused ones included
        "requests_per_host": (host_writes + host_reads) / hosts,  # admitted: what the step needs of each host
        "writes_per_host": host_writes / hosts, "reads_per_host": host_reads / hosts,
        "leader_requests": total.get("door:leader:requests", 0) + total.get("door:hosts:requests", 0) - host_requests,
        "admitted_writes": total.get("admitted_writes", 0), "admitted_reads": total.get("admitted_reads", 0),
        "parts_writes": at_parts.get("admitted_writes", 0), "parts_reads": at_parts.get("admitted_reads", 0),
        "budget_per_s": bucket_writes_per_s, "paced_s_per_host": sum(paced_s) / hosts,
        "refused": {k.split(":", 1)[1]: v for k, v in total.items() if k.startswith(("refused:", "status:"))},
        "refusals": total.get("refused", 0), "written_twice": end["twice_count"], "twice": end["twice"][:10],
        "most_writes_of_one_name": end["most_writes_of_one_name"],
    }


def with_bound(result: dict[str, Any], write_per_s: float, read_per_s: float) -> dict[str, Any]:
    """``result`` with the time the bucket's rates allow for its admitted requests (``bound_s``: all of them as if
    they could all overlap; ``phased_bound_s``: the parts' requests, then those after the last part landed, which
    the commit needs first) and the commit's ratio to each."""
    def bound(writes: float, reads: float) -> float:
        return max(writes / write_per_s, reads / read_per_s)

    writes, reads = result["admitted_writes"], result["admitted_reads"]
    simple = bound(writes, reads)
    phased = bound(result["parts_writes"], result["parts_reads"]) + bound(writes - result["parts_writes"],
                                                                           reads - result["parts_reads"])
    commit = result["commit_s"]
    return {**result, "bound_s": simple, "phased_bound_s": phased,
            "commit_over_bound": commit / simple if commit is not None and simple > 0 else None,
            "commit_over_phased_bound": commit / phased if commit is not None and phased > 0 else None}


# ---- the bench: emulator, shaper and workers as processes -----------------------------------------------------

def _shaper(upstream: str, write_per_s: float, read_per_s: float) -> tuple[subprocess.Popen[str], dict[str, str]]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.gcs_shaper", upstream, "--doors", "hosts,leader",
                             "--write-per-s", str(write_per_s), "--read-per-s", str(read_per_s)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("the shaper did not start")
    return proc, dict(json.loads(line)["urls"])


def run(hosts_list: list[int], *, workers: int, concurrency: int, rate_scale: float, rows: int, cols: int,
        poll_s: float, retry_s: float, timeout_s: float, budget: bool = True) -> list[dict[str, Any]]:
    """Each count's step persisted and committed (``persist_step``); ``budget``: the hosts share the bucket's write
    rate as their budget (ckptd's default), else they run on back-off alone."""
    import gcsfs
    import httpx

    from tests.support.gcs_emulator import fake_gcs
    from tests.support.gcs_shaping import Limits

    limits = Limits().scaled(rate_scale)
    out = []
    with tempfile.TemporaryDirectory(prefix="gcs-hosts-") as tmp, fake_gcs("gcs-hosts") as gcs:
        shaper, urls = _shaper(gcs.url, limits.write_per_s, limits.read_per_s)
        pool = WorkerPool([DoorWorker(urls["hosts"], nice=0, devices=1) for _ in range(workers)])
        leader_worker = DoorWorker(urls["leader"], nice=0, devices=1)
        http = httpx.Client(trust_env=False, timeout=60)
        try:
            warm = [threading.Thread(target=w.exchange, args=(PersistSnapshot(snapshot="/nonexistent",
                                                                              job_url=f"{tmp}/warm"),))
                    for w in [*pool.workers, leader_worker]]
            for thread in warm:
                thread.start()
            for thread in warm:
                thread.join()

            def client(door: str) -> Any:
                return gcsfs.GCSFileSystem(endpoint_url=urls[door], token="anon", skip_instance_cache=True)

            for hosts in hosts_list:
                root = gcs.gs(f"run-{hosts}-{uuid.uuid4().hex[:6]}")
                parts = write_host_parts(Path(tmp) / f"shm-{hosts}", JOB, STEP, hosts, rows=rows, cols=cols)

                def host_storage(_k: int, root: str = root) -> Storage:
                    return Storage(root, fs=client("hosts"))  # a client of its own: its own listing cache

                result = persist_step(
                    parts, host_storage=host_storage, leader_storage=Storage(root, fs=client("leader")),
                    host_worker=pool, leader_worker=leader_worker,
                    stats=lambda: dict(http.get(f"{urls['hosts']}/_shaper/stats").json()),
                    reset=lambda: http.post(f"{urls['hosts']}/_shaper/reset"),
                    concurrency=concurrency or hosts, poll_s=poll_s, retry_s=retry_s, timeout_s=timeout_s,
                    bucket_writes_per_s=limits.write_per_s if budget else 0.0)
                result = with_bound(result, limits.write_per_s, limits.read_per_s)
                out.append({**result, "write_per_s": limits.write_per_s, "read_per_s": limits.read_per_s,
                            "workers": workers, "part_bytes": rows * cols * 4 * 2 + cols * 4})
                print(json.dumps(out[-1]), flush=True)
        finally:
            http.close()
            pool.close()
            leader_worker.close()
            if shaper.stdin is not None:
                shaper.stdin.close()
            shaper.wait(timeout=30)
    return out


def table(results: list[dict[str, Any]]) -> str:
    rows = ["hosts | budget /s | committed | last part s | commit s | bound s (phased) | ratio (phased) | "
            "req/host (w+r) | leader req | refused (429/503/object; writes/reads) | written twice | failed tries | "
            "lost parts", "---|---|---|---|---|---|---|---|---|---|---|---|---"]

    def num(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    for r in results:
        refused = r["refused"]
        rows.append(f"{r['hosts']} | {r['budget_per_s'] or 'none'} | {r['committed']} | {num(r['parts_s'], '.1f')} | "
                    f"{num(r['commit_s'], '.1f')} | "
                    f"{r['bound_s']:.1f} ({r['phased_bound_s']:.1f}) | {num(r['commit_over_bound'], '.2f')} "
                    f"({num(r['commit_over_phased_bound'], '.2f')}) | "
                    f"{r['requests_per_host']:.1f} ({r['writes_per_host']:.1f}+{r['reads_per_host']:.1f}) | "
                    f"{r['leader_requests']} | {r['refusals']} ({refused.get('429', 0)}/{refused.get('503', 0)}/"
                    f"{refused.get('object_rate', 0)}; {refused.get('write_rate', 0)}/{refused.get('read_rate', 0)}) | "
                    f"{r['written_twice']} | {r['failed_tries']} | "
                    f"{len(r['lost_parts'])}")
    return "\n".join(rows)


# ---- the family of bench.run -------------------------------------------------------------------------------

# by profile: the host counts, persist worker children, the fraction of GCS's starting rates (docs/gcs.md, "Many
# hosts on one bucket": this machine drives ~500 requests/s in all, so GCS's own rates would measure the machine)
FAMILY_RUNS: dict[str, tuple[tuple[int, ...], int, float]] = {
    "full": ((64, 256, 1024), 8, 0.05), "quick": ((64, 256), 8, 0.05), "toy": ((4,), 2, 0.05)}
COMMIT_BOUND = 1.2  # the commit within this much of the time the bucket's rates allow for the requests


def run_gcs_hosts(profile: Any, results: Any) -> None:
    """The ``gcs_hosts`` family of ``bench.run``: a step of N simulated hosts persisted to the shaped bucket at each
    of the profile's host counts. Keys, at the largest count: ``gcs_commit_over_rate_bound`` (the commit's time over
    what the rates allow for the admitted requests, writes and reads overlapping; the phased bound's beside it)
    and ``gcs_lost_or_failed_parts`` and ``gcs_objects_written_twice`` (both 0). Measurements per count: the
    commit, the bound, requests per host, refusals absorbed."""
    from bench.common import Figure

    counts, workers, scale = FAMILY_RUNS.get(profile.name, FAMILY_RUNS["toy"])
    timeout_s = 900.0
    runs = run(list(counts), workers=workers, concurrency=0, rate_scale=scale, rows=4, cols=256, poll_s=0.5,
               retry_s=PART_RETRY_S, timeout_s=timeout_s)
    for r in runs:
        n = r["hosts"]
        if r["commit_s"] is not None:
            results.measure(f"gcs_hosts.{n}.commit_s", [r["commit_s"]], "s",
                            f"{n} hosts' step committed, from the start of every host's persist")
        results.measure(f"gcs_hosts.{n}.bound_s", [r["bound_s"]], "s",
                        "the admitted requests at the bucket's rates, writes and reads overlapping")
        results.measure(f"gcs_hosts.{n}.requests_per_host", [r["requests_per_host"]], "requests",
                        "admitted requests a host makes for its part of a step (writes + reads)")
        results.measure(f"gcs_hosts.{n}.refusals_absorbed", [float(r["refusals"])], "requests",
                        "429/503 answers the hosts and the leader backed off from and tried again")
    last = runs[-1]
    where = (f"{last['hosts']} simulated hosts, one step, the GCS emulator behind tests/support/gcs_shaper.py at "
             f"{scale:g}x GCS's starting rates ({last['write_per_s']:g} writes/s, {last['read_per_s']:g} reads/s), "
             f"{workers} persist worker children (bench/gcs_hosts.py)")
    details = {f"{r['hosts']}_hosts": {k: r[k] for k in ("commit_s", "parts_s", "bound_s", "phased_bound_s",
                                                            "commit_over_bound", "commit_over_phased_bound",
                                                            "requests_per_host", "writes_per_host", "reads_per_host",
                                                            "leader_requests", "refusals", "refused",
                                                            "budget_per_s", "paced_s_per_host")} for r in runs}
    ratio = last["commit_over_bound"]
    if ratio is None:  # never committed: it took at least the timeout
        ratio = timeout_s / last["bound_s"] if last["bound_s"] > 0 else timeout_s
    results.figure(Figure("gcs_commit_over_rate_bound", [ratio], "<=",
                          COMMIT_BOUND, "ratio", f"the commit's time / the bucket's rate bound: {where}", details))
    lost = len(last["lost_parts"]) + len(last["failed_parts"]) + (0 if last["committed"] else last["hosts"])
    results.figure(Figure("gcs_lost_or_failed_parts", [float(lost)], "<=", 0, "parts",
                          f"parts lost from the committed step or never written, all of them if never committed: "
                          f"{where}", {"failed_tries": last["failed_tries"], "failures": last["failures"][:5]}))
    results.figure(Figure("gcs_objects_written_twice", [float(last["written_twice"])], "<=", 0, "objects",
                          f"objects written twice within a second (GCS allows one write a second a name): {where}",
                          {"twice": last["twice"], "most_writes_of_one_name": last["most_writes_of_one_name"]}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", default="64", help="comma-separated host counts, one step each")
    parser.add_argument("--workers", type=int, default=8, help="persist worker children serving the hosts")
    parser.add_argument("--concurrency", type=int, default=0, help="hosts persisting at once (0: all)")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="GCS's starting rates times this")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--cols", type=int, default=256)
    parser.add_argument("--poll-s", type=float, default=0.5, help="the leader's commit pass interval")
    parser.add_argument("--retry-s", type=float, default=PART_RETRY_S, help="a failed part is tried again after")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--no-budget", action="store_true",
                        help="hosts unpaced, on back-off alone (default: they share the bucket's write rate)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    results = run([int(h) for h in args.hosts.split(",")], workers=args.workers, concurrency=args.concurrency,
                  rate_scale=args.rate_scale, rows=args.rows, cols=args.cols, poll_s=args.poll_s,
                  retry_s=args.retry_s, timeout_s=args.timeout_s, budget=not args.no_budget)
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


__all__ = ["JOB", "STEP", "DoorWorker", "MarkedWorker", "WorkerPool", "lost_parts", "persist_step", "run_gcs_hosts",
           "with_bound"]

if __name__ == "__main__":
    raise SystemExit(main())
