"""Storage requests per restore and per persist on GCS: ckptd against plain Orbax, counted at a proxy.

``gcs_requests_per_restore_ratio_vs_orbax``: requests that ``trainer_client.runtime.saving._checkpointing.restore``
makes for one step on ``gs://`` ÷ those of plain ``ocp.CheckpointManager(job).restore(step)`` of the same
step onto the same target. ``gcs_requests_per_persist_ratio_vs_orbax``: requests of a ``Checkpointer`` save
until committed (what ckptd's persist worker runs for every snapshot, manifest and commit included) ÷
those of a plain Orbax ``CheckpointManager.save`` until finished, same state.

Every request passes through ``tests.support.fault_proxy.FaultProxy`` (healthy plan: nothing injected) in
front of the fake-gcs-server of ``tests.support.gcs_emulator``; the proxy counts each request it forwards,
and points the upload URLs the emulator answers with back at itself, so a resumable upload's follow-up
requests are counted too.
All of it runs in a child process (``python -m bench.gcs_requests``) whose environment points gcsfs and
tensorstore at the proxy before either is imported, so the parent's clients are never redirected. A
request count does not depend on the bytes (one object per OCDBT data file, one ranged read per chunk),
so the state here is the io state's arrays on a smaller shape.

A save's count varies by a few requests between repeats, on both sides alike: Orbax reads its metadata
files (``_CHECKPOINT_METADATA``, ``array_metadatas``) while its own asynchronous writes of them are in
flight (a read before the write is two requests, after it one), and tensorstore batches the OCDBT commits
of ``ocdbt.process_*`` as they come. ``settled`` counts the rest, which is the same in every repeat
(``LoggingProxy`` keeps each request's method and path); ``python -m bench.gcs_requests --urls UPSTREAM
BUCKET`` prints both saves' requests one by one, for reading them side by side
(``tests/system/test_gcs_persist_requests.py`` pins the settled counts).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import functools
import json
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import Figure, Profile, Results

ROWS, COLS = 768, 1024  # per array: 3 MiB (rows divide by 8)
REPEATS = 4  # a restore's count varies by ~10% between repeats on both sides (tensorstore's reads race as they come)


def counted(proxy: Any, work: Callable[[], object]) -> Counter[str]:
    """Run ``work``; the requests ``proxy`` (a ``FaultProxy``) saw meanwhile: ``requests`` and per method."""
    before = Counter(proxy.stats)
    work()
    after = Counter(proxy.stats)
    return Counter({k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)})


# Requests whose number depends on timing (module docstring): reads of Orbax's metadata files, OCDBT commits.
_RACING = re.compile(r"^GET .*(_CHECKPOINT_METADATA|array_metadatas)|ocdbt\.process_")


def settled(requests: list[str]) -> int:
    """How many of ``requests`` (``"METHOD path"``, as ``LoggingProxy`` keeps them) do not depend on timing."""
    return sum(1 for r in requests if not _RACING.search(r))


def logging_proxy(upstream: str) -> Any:
    """A ``FaultProxy`` (healthy) in front of ``upstream`` that also keeps ``"METHOD path"`` of every request
    it is sent, in order, in ``.requests``."""
    from tests.support.fault_proxy import FaultProxy

    class LoggingProxy(FaultProxy):
        requests: list[str]

        def _handler_class(self) -> Any:
            base = super()._handler_class()
            kept = self.requests = []

            class Handler(base):  # type: ignore[misc,valid-type]
                def _handle(self) -> None:
                    kept.append(f"{self.command} {self.path}")
                    super()._handle()

                do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _handle

            return Handler

    return LoggingProxy(upstream)


def forget_listings() -> None:
    """Empty the listings cache of every gcsfs client in this process (fsspec keeps one per set of arguments),
    so that a counted restore lists what it needs, whatever ran before it."""
    import gcsfs

    for fs in list(gcsfs.GCSFileSystem._cache.values()):
        fs.invalidate_cache()


def _savers(arrays: int, rows: int, cols: int) -> tuple[Callable[[str], None], Callable[[str], None], Any]:
    """A ckptd save and a plain Orbax save of the same state, each into the job it is given; and the state."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from trainer_client.runtime.saving._checkpointing import Checkpointer

    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data", None))
    rng = np.random.default_rng(0)
    state = {"params": {f"layer{i}": jax.device_put(rng.standard_normal((rows, cols), dtype=np.float32), sharding)
                        for i in range(arrays)}}

    def ckptd_save(job: str) -> None:
        ck = Checkpointer(job)
        ck.save(1, state, data_position=0, global_batch=8, mesh=mesh, slices=list(range(8)))
        ck.close()

    def orbax_save(job: str) -> None:
        mgr = ocp.CheckpointManager(job)
        mgr.save(1, args=ocp.args.StandardSave(state))
        mgr.wait_until_finished()
        mgr.close()

    return ckptd_save, orbax_save, state


def _child(arrays: int, repeats: int) -> dict[str, Any]:
    from tests.support.gcs_emulator import emulator_env, fake_gcs

    with fake_gcs("bench-requests") as gcs, logging_proxy(gcs.url) as proxy:
        os.environ.update(emulator_env(proxy.url))
        import jax
        import orbax.checkpoint as ocp

        from trainer_client.runtime.saving._checkpointing import restore

        ckptd_save, orbax_save, state = _savers(arrays, ROWS, COLS)
        target = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
        out: dict[str, Any] = {k: [] for k in ("ckptd_persist", "orbax_persist", "ckptd_restore", "orbax_restore",
                                               "settled_persist")}

        def ckptd_restore(job: str) -> None:
            jax.block_until_ready(restore(f"{job}/1", target))

        def orbax_restore(job: str) -> None:
            mgr = ocp.CheckpointManager(job)
            jax.block_until_ready(mgr.restore(1, args=ocp.args.StandardRestore(target)))
            mgr.close()

        for i in range(repeats):
            ckptd_job, orbax_job = gcs.gs(f"ckptd-{i}"), gcs.gs(f"orbax-{i}")
            settled_counts = {}
            for name, save, job in (("ckptd", ckptd_save, ckptd_job), ("orbax", orbax_save, orbax_job)):
                first = len(proxy.requests)
                out[f"{name}_persist"].append(dict(counted(proxy, functools.partial(save, job))))
                settled_counts[name] = settled(proxy.requests[first:])
            out["settled_persist"].append(settled_counts)
            restores = [("ckptd_restore", ckptd_restore), ("orbax_restore", orbax_restore)]
            for name, work in restores[:: 1 if i % 2 == 0 else -1]:  # the same step, alternating order
                forget_listings()  # neither side finds the other's listings cached
                out[name].append(dict(counted(proxy, functools.partial(work, ckptd_job))))
        return out


def run_gcs_requests(profile: Profile, results: Results) -> None:
    """The two request-count figures, from a child process (``python -m bench.gcs_requests``)."""
    root = Path(__file__).resolve().parent.parent
    repeats = min(profile.repeats, REPEATS)
    done = subprocess.run([sys.executable, "-m", "bench.gcs_requests", str(profile.arrays), str(repeats)],
                          cwd=root, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"gcs request counting failed: {done.stderr[-3000:]}")
    counts: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    results.context["gcs_persist_settled_requests"] = counts.pop("settled_persist")
    series = {k: [float(c.get("requests", 0)) for c in v] for k, v in counts.items()}
    for k, v in series.items():
        results.measure(f"gcs.requests.{k}", v, "requests")
    results.context["gcs_requests_by_method"] = {k: v[-1] for k, v in counts.items()}
    state = f"{profile.arrays} float32 arrays of {ROWS} x {COLS} on 8 devices"
    for kind, what in (("restore", "checkpointing.restore of one gs:// step / plain CheckpointManager.restore"),
                       ("persist", "Checkpointer save until committed (the persist worker's path) / plain "
                                   "CheckpointManager.save until finished")):
        ratio = [a / b for a, b in zip(series[f"ckptd_{kind}"], series[f"orbax_{kind}"], strict=True)]
        results.figure(Figure(
            f"gcs_requests_per_{kind}_ratio_vs_orbax", ratio, "<=", 1.0, "ratio",
            f"requests at the GCS emulator's proxy: {what}, same state ({state})",
            {"ckptd_requests_median": results.measurements[f"gcs.requests.ckptd_{kind}"]["median"],
             "orbax_requests_median": results.measurements[f"gcs.requests.orbax_{kind}"]["median"],
             "ckptd_by_method": counts[f"ckptd_{kind}"][-1], "orbax_by_method": counts[f"orbax_{kind}"][-1]}))


def saves_of(proxy: Any, prefix: str, arrays: int = 2, repeats: int = 1) -> tuple[list[str], ...]:
    """The requests of each save (ckptd's, then Orbax's, ``repeats`` times), in order, its job's name replaced
    by ``JOB``; through ``proxy`` (a ``logging_proxy`` that gcsfs and tensorstore already talk to), into
    jobs under ``prefix`` (``gs://bucket/...``)."""
    ckptd_save, orbax_save, _ = _savers(arrays, 64, 128)
    out: list[list[str]] = []
    for i in range(repeats):
        for name, save in (("ckptd", ckptd_save), ("orbax", orbax_save)):
            job = f"{prefix.rstrip('/')}/{name}-{i}"
            first = len(proxy.requests)
            save(job)
            key = job.split("/", 3)[3]  # the object prefix, as the requests name it
            out.append([r.replace(key.replace("/", "%2F"), "JOB").replace(key, "JOB")
                        for r in proxy.requests[first:]])
    return tuple(out)


def _child_urls(upstream: str, bucket: str, arrays: int, repeats: int) -> dict[str, list[list[str]]]:
    """``saves_of`` through a proxy in front of the emulator at ``upstream`` (one already running)."""
    from tests.support.gcs_emulator import emulator_env

    with logging_proxy(upstream) as proxy:
        os.environ.update(emulator_env(proxy.url))
        saves = saves_of(proxy, f"gs://{bucket}/requests-{os.getpid()}", arrays, repeats)
        return {"ckptd": list(saves[::2]), "orbax": list(saves[1::2])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("arrays", type=int)
    parser.add_argument("repeats", type=int)
    parser.add_argument("--urls", nargs=2, metavar=("UPSTREAM", "BUCKET"),
                        help="only the two saves, through a proxy in front of a running emulator: their requests")
    args = parser.parse_args(argv)
    if args.urls:
        upstream, bucket = args.urls
        out: dict[str, Any] = _child_urls(upstream, bucket, args.arrays, args.repeats)
    else:
        out = _child(args.arrays, args.repeats)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
