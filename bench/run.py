"""``python -m bench.run`` (``make bench``; ``BENCH_QUICK=1`` for the short form): measure every figure of
docs/benchmarks.md on this machine, print each as it is measured, write ``results.json`` and the table of
docs/benchmarks.md. The quick profile writes ``results-quick.json`` and a table of its own, each figure beside
the full run's and whether that lies within the quick run's spread (the quick profile is a stand-in for the full
one only where it agrees).

Where: ``bench-output/`` in the current directory (the repository's root under ``make bench``; untracked), the
report as ``bench-output/benchmarks.md`` (docs/benchmarks.md's prose with this run's table). Only
``--publish`` (``BENCH_PUBLISH=1``) writes the tracked files: ``bench/results*.json`` and docs/benchmarks.md.

Families: ``io`` (save, persist, restore, memory tier: bench/io.py), ``service`` (resume latency, burst,
catalog rebuild: bench/service.py), ``recovery`` (in-process recovery against a relaunch:
bench/recovery.py), ``replicas`` (a replica snapshot every step against none, and a recovery from the
replicas against one from the shared-memory tier: bench/replicas.py), ``multihost`` (a 2-process job's
restart from memory against from storage, and the multi-host persist when bench/multihost_persist.py is
there: bench/multihost.py), ``peers`` (the same job's restart with one host's part from a peer's copy against
from storage, and what the copies cost training: bench/peers.py), ``first_sight`` (ms per step of 1,000
arrays seen without records: bench/first_sight.py).

The device profile (``--profile device``; ``BENCH_DEVICE=tpu``; or found from the platform: bench/device_profile.py's
``choose``, decided here before anything loads jax) runs on whatever device jax has instead of 8 fake CPU
devices: families ``device`` (the replica tier's step overhead and chosen period, rates per memory kind, each
tier's restore and first step, the shm tier's save stall: bench/device_tiers.py) and ``device_recovery`` (recovery
in the same PID against a relaunch on one slice, ckptd on a unix socket: bench/device_recovery.py), at
``--size`` (bench/decoder.py's: ``chip`` on an accelerator, ``toy`` on CPU), into ``results-device.json`` and the
table of docs/benchmarks.md's "Device profile". Work files go to a fresh
directory under ``--workdir`` (default: the system temp directory) and a shared-memory directory under
``--shm`` (default /dev/shm), named ``ckptd-bench-<pid>-<random>-work`` and ``-shm``; each family works in its own
subdirectory of each, removed when the family ends (as are the processes it started that still run), and
both are removed at the end. A run that is interrupted (SIGINT, SIGTERM, SIGHUP) cleans up the same way; one
that is killed outright is cleaned up by its reaper, and failing that by the next run's start-up sweep
(bench/lifetime.py).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from bench import lifetime
from bench.common import DEVICE_PROFILES, Profile, Results, free_gib, profile_from_env, rmtree, write_json
from bench.report import write_report

FAMILIES = ("io", "interference", "recovery", "replicas", "multihost", "peers", "first_sight", "gcs_hosts",
            "service")  # the longest (service) last
DEVICE_FAMILIES = ("device", "device_recovery")  # the device profile's (bench/device_profile.py)
ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = ROOT / "bench"  # the tracked results (--publish), and the tracked report beside them
PUBLISHED_DOCS = ROOT / "docs" / "benchmarks.md"
OUTPUT = Path("bench-output")  # a run's results unless it publishes (relative to where it runs)


def _merge(previous: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` over an earlier run's results of the same profile: keys, measurements and context of
    the families not run this time are kept, and ``key_runs`` says which run measured each key."""
    if any(previous.get("profile", {}).get(k) != payload["profile"].get(k) for k in ("name", "decoder")):
        return payload
    merged = dict(payload)
    for part in ("keys", "measurements", "context", "notes"):
        merged[part] = {**previous.get(part, {}), **payload.get(part, {})}
    merged["errors"] = payload.get("errors", {})
    # which run measured each key now in the table (a key re-run since an older merge is this run's)
    earlier = previous.get("key_runs", {})
    merged["key_runs"] = {
        **{k: earlier.get(k, previous.get("started_at")) for k in previous.get("keys", {})},
        **{k: payload.get("started_at") for k in payload.get("keys", {})},
    }
    return merged


def _end_family(family: str, work: Path, shm: Path, token: str) -> None:
    """Stop what ``family`` started that still runs (its own ``finally`` should have) and remove its
    directories, on disk and in shared memory."""
    left = lifetime.stop_marked(token)
    if left:
        print(f"  {family}: stopped {len(left)} process(es) it left running: {left}", flush=True)
    rmtree(work)
    rmtree(shm)


def run(profile: Profile, families: tuple[str, ...], out: Path, docs: Path | None, workdir: str | None,
        shm: str, merge: bool = False) -> dict[str, Any]:
    started = time.time()
    previous = json.loads(out.read_text()) if merge and out.exists() else None
    results = Results(profile)

    def write_so_far() -> None:  # what is measured so far survives a kill
        so_far = results.to_json(started, time.time())
        write_json(out, _merge(previous, so_far) if previous else so_far)
        lifetime.check_interrupted()  # a signal whose raise was swallowed ends the run here

    results.on_progress = write_so_far
    work_parent = Path(workdir) if workdir else Path(tempfile.gettempdir())
    shm_parent = Path(shm) if Path(shm).is_dir() else Path(tempfile.gettempdir())
    lifetime.sweep_stale({work_parent, shm_parent})  # what killed runs left behind
    token = lifetime.new_token()
    base = lifetime.make_run_dir(work_parent, token, "work")
    shm_base = lifetime.make_run_dir(shm_parent, token, "shm")
    reaper = lifetime.start_reaper(token, [base, shm_base])
    os.environ[lifetime.TOKEN_ENV] = token  # every process the families start carries it
    print(f"bench profile {profile.name}: families {', '.join(families)}; work {base}; shm {shm_base}; "
          f"reaper {reaper.pid}; {free_gib():.1f} GiB available", flush=True)
    try:
        for family in families:
            print(f"\n== {family} ==", flush=True)
            t0 = time.perf_counter()
            family_shm = shm_base / family
            family_shm.mkdir(mode=0o700)
            try:
                if family == "io":
                    from bench.io import run_io

                    run_io(profile, results, base / "io", family_shm)
                elif family == "interference":
                    from bench.interference import run_interference

                    run_interference(profile, results, base / "interference", family_shm)
                elif family == "service":
                    from bench.service import run_service

                    run_service(profile, results, base / "service")
                elif family == "recovery":
                    from bench.recovery import run_recovery

                    run_recovery(profile, results, base / "recovery", family_shm)
                elif family == "replicas":
                    from bench.replicas import run_replicas

                    run_replicas(profile, results, base / "replicas", family_shm)
                elif family == "first_sight":
                    from bench.first_sight import run_first_sight

                    run_first_sight(profile, results, base / "first_sight")
                elif family == "multihost":
                    from bench.multihost import run_multihost

                    run_multihost(profile, results, base / "multihost", family_shm)
                elif family == "gcs_hosts":
                    from bench.gcs_hosts import run_gcs_hosts

                    run_gcs_hosts(profile, results)
                elif family == "peers":
                    from bench.peers import run_peers

                    run_peers(profile, results, base / "peers", family_shm)
                elif family == "device":
                    from bench.device_profile import run_device

                    run_device(profile, results, base / "device", family_shm)
                elif family == "device_recovery":
                    from bench.device_profile import run_device_recovery

                    run_device_recovery(profile, results, base / "device_recovery", family_shm)
                else:
                    raise ValueError(f"unknown family {family!r}")
            except Exception as exc:  # one family failing must not lose the others' numbers
                traceback.print_exc()
                results.errors[family] = f"{type(exc).__name__}: {exc}"
            finally:  # the next family starts with nothing of this one's running or in memory
                _end_family(family, base / family, family_shm, token)
            results.context[f"{family}_seconds"] = round(time.perf_counter() - t0, 1)
            write_so_far()
    finally:
        lifetime.stop_marked(token)
        rmtree(base)
        rmtree(shm_base)
        os.environ.pop(lifetime.TOKEN_ENV, None)
    payload = results.to_json(started, time.time())
    if previous:
        payload = _merge(previous, payload)
    write_json(out, payload)
    print(f"\nwrote {out}", flush=True)
    if docs is not None:
        # a quick run's table says how each figure compares with the full run's: the one beside it, else the published
        full = next((f for f in (out.parent / "results.json", PUBLISHED / "results.json") if f.exists()), None)
        reference = json.loads(full.read_text()) if profile.name == "quick" and full is not None else None
        write_report(payload, docs, reference, template=PUBLISHED_DOCS)
        print(f"wrote {docs}", flush=True)
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", choices=["full", "quick", "toy", "device"], default=None,
                        help="default: device when BENCH_DEVICE is set or jax's platform is not cpu "
                        "(bench/device_profile.py), else quick when BENCH_QUICK=1, else full")
    parser.add_argument("--only", default=None, help="comma-separated families (default: all of the profile's: "
                        f"{','.join(FAMILIES)}; the device profile's: {','.join(DEVICE_FAMILIES)})")
    parser.add_argument("--size", choices=sorted(DEVICE_PROFILES), default=None,
                        help="the device profile's model size (bench/decoder.py; BENCH_DEVICE_SIZE): default chip on "
                        "an accelerator, toy on CPU")
    parser.add_argument("--schedule", default=None, metavar="OFF,ON,REPEATS",
                        help="the device profile's replica arms (bench/device.py's --schedule; default by --size)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: results.json (full), results-quick.json (quick), results-toy.json (toy), "
                        f"results-device.json (device) in {OUTPUT}/ (with --publish: in bench/)")
    parser.add_argument("--docs", type=Path, default=None,
                        help=f"the Markdown report to (re)write; 'none' to skip (default: {OUTPUT}/benchmarks.md, "
                        "with --publish: docs/benchmarks.md)")
    parser.add_argument("--publish", action="store_true", default=os.environ.get("BENCH_PUBLISH") == "1",
                        help="write the tracked bench/results*.json and docs/benchmarks.md (BENCH_PUBLISH=1)")
    parser.add_argument("--workdir", default=os.environ.get("BENCH_WORKDIR"),
                        help="storage for checkpoints (default: the temp directory)")
    parser.add_argument("--shm", default=os.environ.get("BENCH_SHM", "/dev/shm"))
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=INT",
                        help="override a profile field, e.g. --set bursts=1 --set rebuilds=0 (repeatable)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other families' figures from an earlier run of the same profile in --out")
    args = parser.parse_args(argv)
    from bench.device_profile import choose, device_size

    chosen, platform = choose(args.profile, os.environ)
    if platform is None:  # the CPU profiles: 8 fake CPU devices, unless the environment says otherwise
        if args.size or args.schedule:
            parser.error("--size and --schedule are the device profile's")
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        profile = profile_from_env(chosen)
    else:  # every child of the device profile runs on this platform
        os.environ["JAX_PLATFORMS"] = platform
        profile = DEVICE_PROFILES[device_size(platform, args.size, os.environ)]
        if args.schedule:
            try:
                off, on, arms = (int(x) for x in args.schedule.split(","))
            except ValueError:
                parser.error("--schedule takes three numbers: OFF,ON,REPEATS")
            profile = replace(profile, replica_schedule=(off, on, arms))
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in {f.name for f in fields(Profile)} or not isinstance(getattr(profile, name), int):
            parser.error(f"--set: no integer profile field {name!r}")
        profile = replace(profile, **{name: type(getattr(profile, name))(int(value))})
    known = DEVICE_FAMILIES if profile.name == "device" else FAMILIES
    families = tuple(f for f in (args.only if args.only is not None else ",".join(known)).split(",") if f)
    if set(families) - set(known):
        parser.error(f"the {profile.name} profile's families are {', '.join(known)}")
    where = PUBLISHED if args.publish else OUTPUT
    out = args.out or where / ("results.json" if profile.name == "full" else f"results-{profile.name}.json")
    report = PUBLISHED_DOCS if args.publish else OUTPUT / "benchmarks.md"
    docs = None if str(args.docs) == "none" else args.docs or report
    payload = run(profile, families, out, docs, args.workdir, args.shm, merge=args.merge)
    lifetime.check_interrupted()
    return 1 if payload["errors"] else 0


if __name__ == "__main__":
    lifetime.raise_on_termination()  # SIGTERM and SIGHUP unwind the run like Ctrl-C: every finally runs
    raise SystemExit(main())
