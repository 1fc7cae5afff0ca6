"""One trainer process of the ``--hosts`` demo (examples/multihost_demo.py starts one per host).

A process of a multi-controller JAX job: ``initialize_multihost`` joins it to the others (jax.distributed on
127.0.0.1, a short heartbeat, the preemption service on), then the example MLP (examples/elastic_mlp.py)
trains on the global mesh of every process's CPU devices through ``ElasticRunner``, talking to this host's
own ckptd sidecar and shared-memory directory. A restarted process resumes the step all processes agree on
(``ResumeAgreement``: from every host's memory when each holds its part, a wiped host's part brought back from
the peer sidecar that kept a copy, else from storage). Each event goes
to stdout as one ``EVENT {json}`` line (the demo prints the timeline); at the end the process writes
``--result`` (what it restored, the losses, a digest of its shards of the final state).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from examples.elastic_mlp import TrainLog, make_train_fn
from trainer_client import (
    CkptdClient,
    ClientSettings,
    CompilationOptions,
    ElasticConfig,
    ElasticOptions,
    ElasticRunner,
    Event,
    MemoryTierOptions,
    SimulatedSlices,
    initialize_multihost,
)


def state_digest(state: Any) -> str:
    """sha256 over this process's shards of every leaf (in tree and device order): equal digests, equal bytes."""
    digest = hashlib.sha256()
    for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(state)[0], key=lambda kv: str(kv[0])):
        digest.update(str(path).encode())
        for shard in sorted(leaf.addressable_shards, key=lambda s: s.device.id):
            digest.update(np.ascontiguousarray(np.asarray(shard.data)).tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--coordinator", required=True, help="host:port of process 0's coordination service")
    parser.add_argument("--url", required=True, help="this host's ckptd: http://HOST:PORT or unix:///PATH")
    parser.add_argument("--shm", required=True, help="this host's shared-memory directory")
    parser.add_argument("--root", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--checkpoint-period", type=int, required=True)
    parser.add_argument("--memory-period", type=int, required=True)
    parser.add_argument("--step-time-s", type=float, default=0.0, help="extra time per step (paces the demo)")
    parser.add_argument("--heartbeat-s", type=int, default=None)
    parser.add_argument("--cache", default=None, help="JAX's persistent compilation cache")
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--hold-after", type=int, default=None,
                        help="past this step, wait at each step boundary while --hold-file exists (the demo's kill)")
    parser.add_argument("--hold-file", type=Path, default=None)
    parser.add_argument("--replicas", type=int, default=1,
                        help="the mesh's replica axis (e.g. one per process: a state replicated across hosts)")
    parser.add_argument("--no-memory-tier", action="store_true",
                        help="no host-memory tier: every persistent save goes through Orbax directly")
    args = parser.parse_args(argv)

    shm = None if args.no_memory_tier else args.shm
    settings = ClientSettings(url=args.url, shm_dir=shm)  # the process's one reading of its environment
    initialize_multihost(args.coordinator, args.count, args.index, heartbeat_timeout_s=args.heartbeat_s,
                         initialization_timeout_s=120, settings=settings)
    config = ElasticConfig(
        job=args.job, mesh_axes=("replica", "data"), mesh_shape=(args.replicas, jax.device_count() // args.replicas),
        global_batch=48, checkpoint_period=args.checkpoint_period,
        elastic=ElasticOptions(policy="pause"),
        memory_tier=MemoryTierOptions(shm_dir=shm, memory_period=args.memory_period, max_snapshots=4),
        compilation=CompilationOptions(compilation_cache_dir=args.cache, precompile=False),
    )

    def show(event: Event) -> None:
        detail = event.detail
        if event.kind == "restored" and (peer := peer_source()) is not None:
            detail = f"from peer: host {peer} ({detail})"
        if event.kind != "checkpoint_started" or event.fields.get("tier") != "skipped":
            print("EVENT " + json.dumps({"host": args.index, "kind": event.kind, "step": event.step,
                                         "wall": event.wall_time, "detail": detail,
                                         "tier": event.fields.get("tier")}), flush=True)

    client = CkptdClient(settings, root=args.root)
    runner = ElasticRunner(config, slices=SimulatedSlices(num_slices=1), client=client,
                           checkpoint_dir=f"{args.root}/{args.job}", on_event=show)
    log = TrainLog()

    def peer_source() -> int | None:  # the host whose copy of this host's part was restored, if any
        return runner.agreement.peer_source if runner.agreement is not None else None

    def hook(step: int) -> None:  # the previous step's loss, as it happens (a killed process writes no result)
        if args.index == 0 and step - 1 in log.losses:
            print(f"LOSS {step - 1} {log.losses[step - 1]!r}", flush=True)
        if args.step_time_s > 0:
            time.sleep(args.step_time_s)
        while args.hold_after is not None and step > args.hold_after and args.hold_file and args.hold_file.exists():
            time.sleep(0.02)  # the demo kills a trainer here, once a step is committed on storage

    result = runner.run(make_train_fn(args.steps, log, step_hook=hook, use_precompile=False))
    runner.checkpointer.close()
    client.close()
    restored = next((e for e in result.events if e.kind == "restored"), None)
    report = {
        "process_index": jax.process_index(),
        "pid": os.getpid(),
        "resume_step": restored.step if restored is not None else 0,
        # "from memory: PATH" -> "memory: PATH"
        "restored_from": ("none: fresh state" if restored is None else restored.detail.removeprefix("from ")
                          if peer_source() is None else f"peer: host {peer_source()} ({restored.detail})"),
        "final_step": args.steps if result.value is not None else result.final_step,  # the state's step
        "preempted": result.preempted,
        "losses": {str(k): v for k, v in sorted(log.losses.items())},
        "state_sha256": state_digest(result.value) if result.value is not None else None,
    }
    args.result.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
