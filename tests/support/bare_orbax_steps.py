"""Steps saved by a bare Orbax ``Checkpointer`` (no ``CheckpointManager``), in another interpreter.

Users who call ``StandardCheckpointer().save(f"{dir}/{step}", state)`` or ``PyTreeCheckpointer`` themselves
get one directory per step holding Orbax's files directly (``_CHECKPOINT_METADATA``, ``_METADATA``,
``_sharding``, the OCDBT database or plain zarr arrays): no item directory, names of their own choosing
(``checkpoint_100``). The writer runs plain Orbax only, nothing of ckptd or trainer_client.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.support.helpers import clean_env

MESH_AXES = ("replica", "data")
MESH_SHAPE = (4, 2)

_WRITER = r"""
import json, sys
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

spec = json.loads(sys.argv[1])
assert jax.device_count() == 8, jax.device_count()
mesh = jax.make_mesh(tuple(spec["mesh_shape"]), tuple(spec["mesh_axes"]))

def put(x, pspec):
    return jax.device_put(x, NamedSharding(mesh, pspec))

def state(step):
    w = jnp.arange(64, dtype=jnp.float32).reshape(8, 8) * 0.5 + step
    return {"params": {"w": put(w, P(None, "data")), "b": put(jnp.full((8,), step, jnp.float32), P("data"))},
            "opt": {"mu": put(jnp.ones((12, 16), jnp.bfloat16) * step, P("replica", None))}}

def checkpointer(kind):
    if kind == "standard":  # OCDBT, Orbax's default
        return ocp.StandardCheckpointer()
    if kind == "pytree":
        return ocp.PyTreeCheckpointer()
    if kind == "pytree_no_ocdbt":  # one zarr array per leaf, plain files
        return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))
    raise ValueError(kind)

leaves = {}
for path, kind, step in spec["saves"]:
    c = checkpointer(kind)
    value = state(step)
    if kind == "standard":
        c.save(path, value)
    else:
        c.save(path, args=ocp.args.PyTreeSave(value))
    if hasattr(c, "wait_until_finished"):  # StandardCheckpointer is asynchronous; the others are not
        c.wait_until_finished()
    c.close()
    for leaf_path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
        name = ".".join(str(getattr(k, "key", k)) for k in leaf_path)
        leaves[f"{step}/{name}"] = np.asarray(leaf.astype(jnp.float32))
if spec["values"]:
    np.savez(spec["values"], **leaves)
"""


def write_bare_steps(saves: Sequence[tuple[str | Path, str, int]], *, values: str | Path | None = None,
                     timeout: float = 180.0) -> None:
    """Save each ``(step directory, kind, step)`` with a bare Orbax checkpointer in a separate process:
    ``kind`` is ``standard`` (``StandardCheckpointer``, OCDBT), ``pytree`` (``PyTreeCheckpointer``, OCDBT) or
    ``pytree_no_ocdbt`` (``PyTreeCheckpointHandler(use_ocdbt=False)``: a zarr directory per array). The state
    is ``{"params": {"w": f32[8, 8] P(None, "data"), "b": f32[8] P("data")}, "opt": {"mu": bf16[12, 16]
    P("replica", None)}}`` on ``("replica", "data") = (4, 2)``, its values a function of the step; ``values``:
    an ``.npz`` of every saved leaf (as float32) by ``"<step>/<dotted leaf name>"``."""
    spec = {"saves": [[str(path), kind, int(step)] for path, kind, step in saves],
            "values": str(values) if values else None, "mesh_axes": list(MESH_AXES), "mesh_shape": list(MESH_SHAPE)}
    proc = subprocess.run([sys.executable, "-c", _WRITER, json.dumps(spec)], env=clean_env(), capture_output=True,
                          text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        pytest.fail(f"bare Orbax writer failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")


__all__ = ["MESH_AXES", "MESH_SHAPE", "write_bare_steps"]
