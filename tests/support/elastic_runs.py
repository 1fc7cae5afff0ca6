"""Elastic runs for the trainer tests: the demo MLP on 4 fake slices of 2 CPU devices, against a real ckptd.

``elastic_runner`` builds an ``ElasticRunner`` (mesh 4 x 2 unless ``mesh_shape`` says otherwise, batch 48, a
save every 10 steps, short polls, the replica snapshot tier on (every step held) unless ``replicas=False``;
other options by their names, ``with_options`` puts each in its group),
``run_to_end`` runs it and closes its checkpointer and client, ``leaves`` reads a state back to numpy. The
``in_jax_faults`` fixture body gives 4 simulated slices whose losses JAX operations raise (``InJaxFaults``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from examples.elastic_mlp import TrainLog, make_train_fn
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.runtime.elastic._elastic import ElasticConfig, ElasticContext, ElasticResult, ElasticRunner, Event
from trainer_client.runtime.replicas._options import ReplicaOptions
from trainer_client.runtime.slices._jax_faults import InJaxFaults
from trainer_client.runtime.slices._slices import SimulatedSlices, SliceFault

JOB = "mlp"
BATCH = 48


def elastic_runner(root: Path, url: str, policy: str, faults: Sequence[SliceFault] = (), *,
                   slices: SimulatedSlices | None = None, on_event: Callable[[Event], None] | None = None,
                   shm_dir: str | None = None, replicas: bool | ReplicaOptions = True, **config: Any) -> ElasticRunner:
    (root / JOB).mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = dict(checkpoint_period=10, elastic_timeout_s=30, poll_interval_s=0.05,
                                   scale_up_check_interval_s=0.0, monitor_interval_s=0.2)
    options.update(config, policy=policy, shm_dir=shm_dir)
    # every due step held (the loop waits for a copy in flight): the step a loss restores is known to the step
    options["replicas"] = (replicas if isinstance(replicas, ReplicaOptions)
                           else ReplicaOptions(enabled=replicas, period=1, when_busy="wait"))
    cfg = with_options(ElasticConfig(job=JOB, mesh_axes=("replica", "data"), mesh_shape=(4, 2), global_batch=BATCH),
                       **options)
    client = CkptdClient(ClientSettings(url=url, timeout_s=2.0, resume_deadline_s=3.0, shm_dir=shm_dir),
                         root=str(root))
    return ElasticRunner(cfg, slices=slices if slices is not None else SimulatedSlices(num_slices=4, faults=faults),
                         client=client, checkpoint_dir=str(root / JOB), on_event=on_event)


def with_options(config: ElasticConfig, **options: Any) -> ElasticConfig:
    """``config`` with ``options`` changed, each named as in the group that holds it (``shm_dir`` in
    ``memory_tier``, ``policy`` in ``elastic``, ...) or as ``ElasticConfig``'s own field."""
    groups: dict[str, Any] = {}
    for top in dataclasses.fields(config):
        group: Any = getattr(config, top.name)
        if dataclasses.is_dataclass(group) and not isinstance(group, type):
            names = [f.name for f in dataclasses.fields(group) if f.name in options]
            if names:
                groups[top.name] = dataclasses.replace(group, **{name: options.pop(name) for name in names})
    return dataclasses.replace(config, **groups, **options)


def run_to_end(runner: ElasticRunner, train: Callable[[ElasticContext], Any]) -> ElasticResult[Any]:
    try:
        return runner.run(train)
    finally:
        runner.checkpointer.close()
        runner.client.close()


def leaves(state: Any) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]


def assert_bitwise_equal(expected: Any, actual: Any, what: str = "the run diverged from the failure-free run") -> None:
    for a, b in zip(leaves(expected), leaves(actual), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b), what


def failure_free_state(root: Path, state_dir: Path, policy: str, steps: int, **config: Any) -> list[np.ndarray]:
    """The final state of a run without failures (on the host: arrays alive when a slice is lost are lost with
    it), against a ckptd of its own."""
    from tests.support.server import start_server

    server = start_server(root, state_dir)
    try:
        return leaves(run_to_end(elastic_runner(root, server.url, policy, **config), make_train_fn(steps, TrainLog())
                                 ).value)
    finally:
        server.stop()


def every_sample_once(log: TrainLog, steps: int) -> bool:
    """Steps 0..steps-1 each read the next BATCH samples, in order, in the trajectory that survived."""
    return [log.samples[s] for s in range(steps)] == [(s * BATCH, (s + 1) * BATCH) for s in range(steps)]


def in_jax_faults() -> Iterator[InJaxFaults]:
    """For a fixture: 4 fake slices of 2 CPU devices, JAX patched to raise DATA_LOSS on the ones down."""
    with InJaxFaults(SimulatedSlices(num_slices=4)) as injector:
        yield injector


__all__ = ["BATCH", "JOB", "assert_bitwise_equal", "elastic_runner", "every_sample_once", "failure_free_state",
           "in_jax_faults", "leaves", "run_to_end"]
