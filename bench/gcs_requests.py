"""Storage requests per restore and per persist on GCS: ckptd against plain Orbax, counted at the emulator.

``gcs_requests_per_restore_ratio_vs_orbax``: requests that ``trainer_client.runtime.checkpointing.restore``
makes for one step on ``gs://`` ÷ those of plain ``ocp.CheckpointManager(job).restore(step)`` of the same
step onto the same target. ``gcs_requests_per_persist_ratio_vs_orbax``: requests of a ``Checkpointer`` save
until committed (what ckptd's persist worker runs for every snapshot, manifest and commit included) ÷
those of a plain Orbax ``CheckpointManager.save`` until finished, same state.

Every request passes through ``tests.support.fault_proxy.FaultProxy`` (healthy plan: nothing injected) in
front of the fake-gcs-server of ``tests.support.gcs_emulator``; the proxy counts each request it forwards.
All of it runs in a child process (``python -m bench.gcs_requests``) whose environment points gcsfs and
tensorstore at the proxy before either is imported, so the parent's clients are never redirected. A
request count does not depend on the bytes (one object per OCDBT data file, one ranged read per chunk),
so the state here is the io state's arrays on a smaller shape.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import functools
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import Figure, Profile, Results

ROWS, COLS = 768, 1024  # per array: 3 MiB (rows divide by 8)
REPEATS = 2  # a count hardly varies (by a few requests: gcsfs's listing cache); a repeat costs two saves


def counted(proxy: Any, work: Callable[[], object]) -> Counter[str]:
    """Run ``work``; the requests ``proxy`` (a ``FaultProxy``) saw meanwhile: ``requests`` and per method."""
    before = Counter(proxy.stats)
    work()
    after = Counter(proxy.stats)
    return Counter({k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)})


def _child(arrays: int, repeats: int) -> dict[str, list[dict[str, int]]]:
    from tests.support.fault_proxy import FaultProxy
    from tests.support.gcs_emulator import emulator_env, fake_gcs

    with fake_gcs("bench-requests") as gcs, FaultProxy(gcs.url) as proxy:
        os.environ.update(emulator_env(proxy.url))
        import jax
        import numpy as np
        import orbax.checkpoint as ocp
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        from trainer_client.runtime.checkpointing import Checkpointer, restore

        mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
        sharding = NamedSharding(mesh, PartitionSpec("data", None))
        rng = np.random.default_rng(0)
        state = {"params": {f"layer{i}": jax.device_put(rng.standard_normal((ROWS, COLS), dtype=np.float32),
                                                        sharding) for i in range(arrays)}}
        target = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
        out: dict[str, list[dict[str, int]]] = {k: [] for k in ("ckptd_persist", "orbax_persist", "ckptd_restore",
                                                                 "orbax_restore")}
        def ckptd_save(job: str) -> None:
            ck = Checkpointer(job)
            ck.save(1, state, data_position=0, global_batch=8, mesh=mesh, slices=list(range(8)))
            ck.close()

        def orbax_save(job: str) -> None:
            mgr = ocp.CheckpointManager(job)
            mgr.save(1, args=ocp.args.StandardSave(state))
            mgr.wait_until_finished()
            mgr.close()

        def ckptd_restore(job: str) -> None:
            jax.block_until_ready(restore(f"{job}/1", target))

        def orbax_restore(job: str) -> None:
            mgr = ocp.CheckpointManager(job)
            jax.block_until_ready(mgr.restore(1, args=ocp.args.StandardRestore(target)))
            mgr.close()

        for i in range(repeats):
            ckptd_job, orbax_job = gcs.gs(f"ckptd-{i}"), gcs.gs(f"orbax-{i}")
            out["ckptd_persist"].append(dict(counted(proxy, functools.partial(ckptd_save, ckptd_job))))
            out["orbax_persist"].append(dict(counted(proxy, functools.partial(orbax_save, orbax_job))))
            restores = [("ckptd_restore", ckptd_restore), ("orbax_restore", orbax_restore)]
            for name, work in restores[:: 1 if i % 2 == 0 else -1]:  # the same step, alternating order
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
    counts: dict[str, list[dict[str, int]]] = json.loads(done.stdout.strip().splitlines()[-1])
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("arrays", type=int)
    parser.add_argument("repeats", type=int)
    args = parser.parse_args(argv)
    print(json.dumps(_child(args.arrays, args.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
