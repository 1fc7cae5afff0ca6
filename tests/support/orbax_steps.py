"""Checkpoints written by plain Orbax in another interpreter, and the training metadata trainer_client
records with a step (as the JSON a step holds under Orbax's custom metadata key ``ckptd``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support.helpers import clean_env

# The writer runs in its own interpreter: plain Orbax, nothing from ckptd or trainer_client.
_ORBAX_WRITER = r"""
import json, sys
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

spec = json.loads(sys.argv[1])
assert jax.device_count() == 8, jax.device_count()
mesh = jax.make_mesh((4, 2), ("replica", "data"))
for job_dir, steps in spec["jobs"].items():
    mgr = ocp.CheckpointManager(job_dir, options=ocp.CheckpointManagerOptions(max_to_keep=None))
    for step in steps:
        w = jnp.arange(32, dtype=jnp.float32).reshape(4, 8) + step
        state = {"params": {"w": jax.device_put(w, NamedSharding(mesh, P(None, "data")))},
                 "step": jnp.int32(step)}
        custom = spec["custom_metadata"].get(str(step))
        mgr.save(step, args=ocp.args.StandardSave(state), custom_metadata=custom)
    mgr.wait_until_finished()
    mgr.close()
"""


def write_orbax_jobs(
    jobs: Mapping[str | Path, Sequence[int]],
    *,
    custom_metadata: Mapping[int, Mapping[str, Any]] | None = None,
    timeout: float = 120.0,
) -> None:
    """Save steps with plain ``orbax.checkpoint.CheckpointManager`` in a separate process.

    ``jobs`` maps a job directory to the steps to save there (all in one interpreter, so the ~2 s of
    importing jax is paid once). The state is ``{"params": {"w": f32[4, 8]}, "step": i32}`` with ``w``
    sharded ``P(None, "data")`` on the mesh ``("replica", "data") = (4, 2)``; ``custom_metadata[step]``
    becomes that step's Orbax custom metadata.
    """
    spec = {
        "jobs": {str(k): [int(s) for s in v] for k, v in jobs.items()},
        "custom_metadata": {str(k): dict(v) for k, v in (custom_metadata or {}).items()},
    }
    proc = subprocess.run(
        [sys.executable, "-c", _ORBAX_WRITER, json.dumps(spec)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"orbax writer failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")


def write_orbax_steps(
    job_dir: str | Path,
    steps: Sequence[int],
    *,
    custom_metadata: Mapping[int, Mapping[str, Any]] | None = None,
) -> None:
    """``write_orbax_jobs`` for one job directory."""
    write_orbax_jobs({job_dir: steps}, custom_metadata=custom_metadata)


def training_metadata(
    step: int,
    *,
    global_batch: int = 64,
    mesh: tuple[Sequence[str], Sequence[int]] = (("replica", "data"), (4, 2)),
    arrays: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """What trainer_client records under Orbax custom metadata key ``ckptd`` (protocol.TrainingMetadata).

    By default the mesh is ``(replica=4, data=2)`` with ``params.w`` sharded ``P(None, "data")`` and
    ``opt.mu`` sharded ``P("replica", "data")``, both f32[4, 8].
    """
    if arrays is None:
        arrays = {
            "params.w": {"shape": [4, 8], "dtype": "float32", "partition_spec": [None, "data"]},
            "opt.mu": {"shape": [4, 8], "dtype": "float32", "partition_spec": ["replica", "data"]},
        }
    return {
        "ckptd": {
            "step": step,
            "data_position": step * global_batch,
            "global_batch": global_batch,
            "mesh": {"axis_names": list(mesh[0]), "shape": list(mesh[1])},
            "slices": [0, 1, 2, 3],
            "wall_time": 1_700_000_000.0 + step,
            "arrays": {k: dict(v) for k, v in arrays.items()},
        }
    }


# A saved layout with a model-parallel axis: (data=2, model=4); it cannot run on fewer than 4 devices.
MODEL_PARALLEL_MESH: tuple[tuple[str, ...], tuple[int, ...]] = (("data", "model"), (2, 4))
MODEL_PARALLEL_ARRAYS: dict[str, dict[str, Any]] = {
    "params.w": {"shape": [8, 16], "dtype": "float32", "partition_spec": ["data", "model"]},
}


def model_parallel_metadata(step: int) -> dict[str, Any]:
    """``training_metadata`` of a step saved on the model-parallel mesh (``MODEL_PARALLEL_MESH``)."""
    return training_metadata(step, mesh=MODEL_PARALLEL_MESH, arrays=MODEL_PARALLEL_ARRAYS)


__all__ = [
    "MODEL_PARALLEL_ARRAYS",
    "MODEL_PARALLEL_MESH",
    "model_parallel_metadata",
    "training_metadata",
    "write_orbax_jobs",
    "write_orbax_steps",
]
