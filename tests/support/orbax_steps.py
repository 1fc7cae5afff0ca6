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


# MaxText's checkpointing, reproduced with plain Orbax (src/maxtext/common/checkpointing.py at
# AI-Hypercomputer/maxtext e591f30: create_orbax_checkpoint_manager and save_checkpoint): a CheckpointManager
# with item_names ("items", "iter"), a PyTreeCheckpointHandler on OCDBT and zarr3 for "items" and Grain's
# handler for "iter", a fixed-interval save policy; each save is Composite(items=PyTreeSave(train_state,
# SaveArgs(chunk_byte_size) per leaf, ocdbt_target_data_file_size), iter=the data iterator's state) with
# custom metadata {"scan_layers": ...}. MaxText's mesh axes and logical axis rules (configs/base.yml) give
# the partition specs: with ici_fsdp_parallelism=4 and ici_tensor_parallelism=2 every other axis has size 1.
# The iterator is a real Grain DataLoader (tests/support/grain_data.py) saved by MaxText's handler, which is
# Grain's own (src/maxtext/common/grain_utility.py: GrainCheckpointHandler(PyGrainCheckpointHandler,
# ocp.CheckpointHandler) and its GrainCheckpointSave/Restore; for one iterator per process it saves exactly
# as Grain's handler does, so the subclass here keeps Grain's save): process_<index>-of-<count>.json.
MAXTEXT_MESH_AXES = ("diloco", "data", "stage", "fsdp", "fsdp_transpose", "context", "context_usp_ulysses",
                     "context_autoregressive", "tensor", "tensor_sequence", "expert", "autoregressive")
MAXTEXT_MESH_SHAPE = (1, 1, 1, 4, 1, 1, 1, 1, 2, 1, 1, 1)
_MAXTEXT_WRITER = r"""
import dataclasses, json, sys
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec as P
from orbax.checkpoint._src.checkpoint_managers import preservation_policy as preservation_policy_lib
from orbax.checkpoint._src.checkpoint_managers import save_decision_policy as save_decision_policy_lib

spec = json.loads(sys.argv[1])
DEFAULT_OCDBT_TARGET_DATA_FILE_SIZE = 2 * 1024**3  # maxtext/utils/globals.py

from grain import python as grain_python
from tests.support.grain_data import data_loader

class GrainCheckpointHandler(grain_python.PyGrainCheckpointHandler, ocp.CheckpointHandler):
    pass  # MaxText's subclass; its save of one iterator is Grain's

@dataclasses.dataclass
class GrainCheckpointSave(ocp.args.CheckpointArgs):
    item: object

@dataclasses.dataclass
class GrainCheckpointRestore(ocp.args.CheckpointArgs):
    item: object
GrainCheckpointHandler.__module__ = "maxtext.common.grain_utility"
ocp.args.register_with_handler(GrainCheckpointHandler, for_save=True)(GrainCheckpointSave)
ocp.args.register_with_handler(GrainCheckpointHandler, for_restore=True)(GrainCheckpointRestore)

mesh = jax.make_mesh(tuple(spec["mesh_shape"]), tuple(spec["mesh_axes"]))
VOCAB = ("tensor", "tensor_sequence", "autoregressive")  # logical axis rules of configs/base.yml
EMBED = ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert")
MLP = ("tensor", "tensor_sequence", "autoregressive")  # its rule's fsdp_transpose is taken by embed (flax)
HEADS = ("tensor", "tensor_sequence", "autoregressive")
LAYERS = "stage"
# the values are drawn on the host and placed on the mesh by device_put, sharded as MaxText's are: each op on a
# jax array of a new shape (a random draw, a reshard, mu's and nu's arithmetic) would compile a program first
def param(key, shape, step):
    return np.random.default_rng(key).standard_normal(shape, dtype=np.float32) + np.float32(step)
def place(value, pspec):
    return jax.device_put(value, NamedSharding(mesh, pspec))
def train_state(step):
    values = {"params": {
        "token_embedder": {"embedding": param(1, (256, 48), step)},
        "decoder": {
            "decoder_norm": {"scale": param(2, (48,), step)},
            "layers": {
                "mlp": {"wi_0": {"kernel": param(3, (48, 2, 96), step)},
                        "wo": {"kernel": param(4, (96, 2, 48), step)}},
                "self_attention": {"query": {"kernel": param(5, (48, 2, 4, 12), step)}},
            },
        },
    }}
    specs = {"params": {
        "token_embedder": {"embedding": P(VOCAB, EMBED)},
        "decoder": {
            "decoder_norm": {"scale": P("tensor")},
            "layers": {
                "mlp": {"wi_0": {"kernel": P(EMBED, LAYERS, MLP)}, "wo": {"kernel": P(MLP, LAYERS, EMBED)}},
                "self_attention": {"query": {"kernel": P(EMBED, LAYERS, HEADS, None)}},
            },
        },
    }}
    def on_mesh(tree):
        return jax.tree_util.tree_map(place, tree, specs)
    params = on_mesh(values)
    mu = on_mesh(jax.tree_util.tree_map(lambda x: x * np.float32(0.5), values))
    nu = on_mesh(jax.tree_util.tree_map(lambda x: x * x, values))
    count = jnp.int32(step)
    return {"step": jnp.int32(step), "params": params,
            "opt_state": [{"count": count, "mu": mu, "nu": nu}, {"count": count}]}

for job_dir, steps in spec["jobs"].items():
    item_names = ("items", "iter") if spec["grain"] else ("items",)
    item_handlers = {"items": ocp.PyTreeCheckpointHandler(restore_concurrent_gb=96, save_concurrent_gb=96,
                                                          use_ocdbt=True, use_zarr3=True)}
    if spec["grain"]:
        item_handlers["iter"] = GrainCheckpointHandler()
    p = epath.Path(job_dir)
    p.mkdir(exist_ok=True, parents=True)
    mgr = ocp.CheckpointManager(
        p, item_names=item_names, item_handlers=item_handlers,
        options=ocp.CheckpointManagerOptions(
            create=True, enable_async_checkpointing=True,
            save_decision_policy=save_decision_policy_lib.FixedIntervalPolicy(interval=spec["period"]),
            preservation_policy=preservation_policy_lib.LatestN(spec["keep"]),
        ),
    )
    data_iterator = iter(data_loader(spec["batch"]))  # MaxText's data_iterator.local_iterator
    consumed = 0
    for step in steps:
        while consumed < step:  # one batch per training step
            next(data_iterator)
            consumed += 1
        state = train_state(step)
        jax.block_until_ready(state)
        chunk_byte_size = DEFAULT_OCDBT_TARGET_DATA_FILE_SIZE
        checkpoint_args = ocp.args.PyTreeSave(
            item=state,
            save_args=jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=chunk_byte_size), state),
            ocdbt_target_data_file_size=chunk_byte_size,
        )
        save_args_composite = {"items": checkpoint_args}
        if spec["grain"]:
            save_args_composite["iter"] = GrainCheckpointSave(item=data_iterator)
        assert mgr.save(step, args=ocp.args.Composite(**save_args_composite),
                        custom_metadata={"scan_layers": True}), step
    mgr.wait_until_finished()
    mgr.close()
    out = sys.argv[2] if len(sys.argv) > 2 else None
    if out:  # every saved state, as numpy, by Orbax's dotted leaf name: for exact comparisons
        leaves = {}
        for step in steps:
            for path, leaf in jax.tree_util.tree_flatten_with_path(train_state(step))[0]:
                name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
                leaves[f"{step}/{name}"] = np.asarray(leaf)
        np.savez(out, **leaves)
"""


def write_maxtext_jobs(
    jobs: Mapping[str | Path, Sequence[int]],
    *,
    grain: bool = True,
    period: int = 100,
    keep: int | None = None,
    batch: int = 16,
    values: str | Path | None = None,
    timeout: float = 180.0,
) -> None:
    """Save steps the way MaxText does (``<job>/<step>/items/...`` and, with ``grain``, Grain's
    ``<job>/<step>/iter/process_0-of-1.json``: the state of ``grain_data.data_loader(batch)``'s iterator after
    ``step`` batches, saved by Grain's handler), with plain Orbax and Grain in a separate process. ``jobs`` maps a
    checkpoint directory (MaxText's ``<base_output_directory>/<run_name>/checkpoints``) to its steps, each a
    multiple of ``period`` (MaxText's ``checkpoint_period``). The train state is a decoder LM's
    ``{"step", "params": {"params": {...}}, "opt_state": [...]}`` on MaxText's 12 mesh axes with
    ``fsdp=4, tensor=2`` (``MAXTEXT_MESH_AXES``, ``MAXTEXT_MESH_SHAPE``); ``values``: an ``.npz`` written
    with every saved leaf as ``"<step>/<dotted leaf name>"``."""
    spec = {"jobs": {str(k): [int(s) for s in v] for k, v in jobs.items()}, "grain": grain, "period": period,
            "keep": keep, "batch": batch, "mesh_axes": list(MAXTEXT_MESH_AXES), "mesh_shape": list(MAXTEXT_MESH_SHAPE)}
    argv = [sys.executable, "-c", _MAXTEXT_WRITER, json.dumps(spec), *([str(values)] if values else [])]
    proc = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        pytest.fail(f"maxtext-style writer failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")


# Several items at once, as a Flax/Orbax user writes them: Composite(params=StandardSave(...),
# opt_state=StandardSave(...), extra=JsonSave(...)); "extra" is JSON, not arrays.
_ITEMS_WRITER = r"""
import json, sys
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

spec = json.loads(sys.argv[1])
mesh = jax.make_mesh((4, 2), ("data", "model"))
def put(x, pspec):
    return jax.device_put(x, NamedSharding(mesh, pspec))
mgr = ocp.CheckpointManager(spec["job"], item_names=("params", "opt_state", "extra"))
leaves = {}
for step in spec["steps"]:
    params = {"w": put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8) + step, P("data", "model")),
              "b": put(jnp.arange(8, dtype=jnp.bfloat16) * step, P("model"))}
    opt_state = {"mu": {"w": put(jnp.ones((8, 8), jnp.float32) * step, P("data", "model"))}, "count": jnp.int32(step)}
    mgr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                           opt_state=ocp.args.StandardSave(opt_state),
                                           extra=ocp.args.JsonSave({"step": step, "note": "json item"})))
    for item, tree in (("params", params), ("opt_state", opt_state)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            name = ".".join(str(getattr(k, "key", k)) for k in path)
            wide = leaf.astype(jnp.float32) if leaf.dtype == jnp.bfloat16 else leaf
            leaves[f"{step}/{item}.{name}"] = np.asarray(wide)
mgr.wait_until_finished()
mgr.close()
np.savez(spec["values"], **leaves)
"""


def write_multi_item_steps(job_dir: str | Path, steps: Sequence[int], values: str | Path) -> None:
    """Save steps with the array items ``params`` and ``opt_state`` and the JSON item ``extra`` (plain
    Orbax, another process), on the mesh ``(data=4, model=2)``; ``values``: an ``.npz`` of every saved leaf
    as ``"<step>/<item>.<dotted leaf name>"`` (bfloat16 leaves as float32)."""
    spec = {"job": str(job_dir), "steps": [int(s) for s in steps], "values": str(values)}
    proc = subprocess.run([sys.executable, "-c", _ITEMS_WRITER, json.dumps(spec)], env=clean_env(),
                          capture_output=True, text=True, timeout=180, check=False)
    if proc.returncode != 0:
        pytest.fail(f"multi-item writer failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")


# A Flax user's steps, saved the way Flax's guides save them: a linen TrainState (flax.training.train_state,
# optax adam) or an NNX model's and optimizer's states ({"model": nnx.state(model), "optimizer":
# nnx.state(optimizer)}: Flax >= 0.11's Optimizer does not hold the model) through CheckpointManager + StandardSave,
# on the mesh (replica=4, data=2), the hidden dimension (16) sharded over "data".
_FLAX_WRITER = r"""
import json, sys
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import linen as nn, nnx
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P

spec = json.loads(sys.argv[1])
mesh = jax.make_mesh((4, 2), ("replica", "data"))
def shard(tree):
    def put(x):
        if not hasattr(x, "shape"):
            return x
        return jax.device_put(x, NamedSharding(mesh, P(*["data" if d == 16 else None for d in x.shape])))
    return jax.tree_util.tree_map(put, tree)
def on_host(tree):
    return jax.tree_util.tree_map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree)
class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))
class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)
    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))
mgr = ocp.CheckpointManager(spec["job"])
leaves = {}
for step in spec["steps"]:
    # made and updated by one compiled program (op by op, each operation on each shape compiled one of its own),
    # then placed on the mesh from the host; the TrainState's step stays the Python int Flax keeps
    if spec["kind"] == "linen":
        model = Mlp()
        def trained(key):
            state = train_state.TrainState.create(apply_fn=model.apply, tx=optax.adam(1e-2),
                                                  params=model.init(key, jnp.ones((1, 8)))["params"])
            return state.apply_gradients(grads=jax.tree_util.tree_map(jnp.ones_like, state.params))
        state = jax.jit(trained)(jax.random.key(step))
        state = shard(on_host(state.replace(step=int(state.step))))
    else:
        @nnx.jit
        def trained():
            model = NnxMlp(nnx.Rngs(step))
            optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
            optimizer.update(model, jax.tree_util.tree_map(jnp.ones_like, nnx.state(model, nnx.Param)))
            return model, optimizer
        model, optimizer = trained()
        state = shard(on_host({"model": nnx.state(model), "optimizer": nnx.state(optimizer)}))
    mgr.save(step, args=ocp.args.StandardSave(state))
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        leaves[f"{step}/{name}"] = np.asarray(leaf)
mgr.wait_until_finished()
mgr.close()
np.savez(spec["values"], **leaves)
"""


def write_flax_steps(job_dir: str | Path, steps: Sequence[int], kind: str, values: str | Path) -> None:
    """Save a Flax ``kind`` (``linen``: a ``TrainState``; ``nnx``: ``nnx.state`` of a model and its optimizer) after
    one optimizer update, at each of ``steps``, with plain Flax + Orbax in another process; ``values``: an
    ``.npz`` of every saved leaf as ``"<step>/<dotted leaf name>"``."""
    spec = {"job": str(job_dir), "steps": [int(s) for s in steps], "kind": kind, "values": str(values)}
    proc = subprocess.run([sys.executable, "-c", _FLAX_WRITER, json.dumps(spec)], env=clean_env(),
                          capture_output=True, text=True, timeout=180, check=False)
    if proc.returncode != 0:
        pytest.fail(f"flax writer failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")


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
    "params.w": {"shape": [4, 8], "dtype": "float32", "partition_spec": ["data", "model"]},  # as stored
}


def model_parallel_metadata(step: int) -> dict[str, Any]:
    """``training_metadata`` of a step saved on the model-parallel mesh (``MODEL_PARALLEL_MESH``)."""
    return training_metadata(step, mesh=MODEL_PARALLEL_MESH, arrays=MODEL_PARALLEL_ARRAYS)


__all__ = [
    "MAXTEXT_MESH_AXES",
    "MAXTEXT_MESH_SHAPE",
    "MODEL_PARALLEL_ARRAYS",
    "MODEL_PARALLEL_MESH",
    "model_parallel_metadata",
    "training_metadata",
    "write_flax_steps",
    "write_maxtext_jobs",
    "write_multi_item_steps",
    "write_orbax_jobs",
    "write_orbax_steps",
]
