"""The smallest whole training script under ckptd (README, "Your own training script"): a linear model on 8 CPU
devices in 4 simulated slices, slice 2 lost at step 25 and back 2 s later (``pause``: the run waits, restores and
goes on in this process). It starts its own ckptd; until that answers, the client plans from storage itself."""

import os
import socket
import subprocess
import sys
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # 8 CPU devices
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer_client import (
    CkptdClient,
    ClientSettings,
    ElasticConfig,
    ElasticContext,
    ElasticOptions,
    ElasticRunner,
    SimulatedSlices,
    SliceFault,
)

OUT = os.path.abspath("quickstart-output")
ROOT, JOB, STEPS = f"{OUT}/checkpoints", "quickstart", 60  # the storage root (or gs://bucket/prefix), the job
optimizer = optax.adam(0.1)


def init_fn() -> Any:  # the training state: a pytree of arrays
    params = {"w": jnp.zeros((4, 1)), "b": jnp.zeros((1,))}
    return {"params": params, "opt": optimizer.init(params)}


def specs_fn(state: Any) -> Any:  # how each array is laid out on the mesh: here every one replicated
    return jax.tree_util.tree_map(lambda _: PartitionSpec(), state)


@jax.jit
def train_step(state: Any, micro: list[tuple[jax.Array, jax.Array]], lr_scale: float) -> tuple[Any, jax.Array]:
    def loss_fn(p: Any) -> Any:  # the mean over the step's microbatches (ctx.batch.accumulation_steps of them)
        return sum(jnp.mean((x @ p["w"] + p["b"] - y) ** 2) for x, y in micro) / len(micro)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = optimizer.update(grads, state["opt"])
    updates = jax.tree_util.tree_map(lambda u: u * lr_scale, updates)  # the plan's learning-rate scale
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


def batch_at(position: int, size: int, mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    """Samples ``position`` .. ``position + size``, each from its index alone: a resumed run reads what comes next."""
    x = np.stack([np.random.default_rng(i).normal(size=4) for i in range(position, position + size)])
    y = x @ np.array([[1.0], [-2.0], [3.0], [0.5]]) + 1.0
    sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))  # the batch split over every device
    return jax.device_put(x.astype(np.float32), sharding), jax.device_put(y.astype(np.float32), sharding)


def train(ctx: ElasticContext) -> Any:  # called again after every recovery, in the same process
    state, step, position = ctx.restore_or_init(init_fn, specs_fn)
    while step < STEPS:
        ctx.step_boundary(step, state, position)  # saves every checkpoint_period steps; a lost slice raises here
        b = ctx.batch  # on a smaller mesh the plan may split the step into microbatches or scale the lr
        micro = [batch_at(position + k * b.micro_batch, b.micro_batch, ctx.mesh) for k in range(b.accumulation_steps)]
        state, loss = train_step(state, micro, b.lr_scale)
        position, step = position + ctx.global_batch, step + 1
    ctx.save(step, state, position)
    print(f"step {step}: loss {float(loss):.4f}")
    return state


if __name__ == "__main__":
    os.makedirs(f"{ROOT}/{JOB}", exist_ok=True)
    with socket.socket() as s:  # a free port for this script's own ckptd
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ckptd = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", ROOT, "--port", str(port),
                              "--state-dir", f"{OUT}/ckptd-state"], stderr=subprocess.DEVNULL)
    config = ElasticConfig(job=JOB, mesh_axes=("replica", "data"), mesh_shape=(4, 2), global_batch=32,
                           checkpoint_period=10, elastic=ElasticOptions(policy="pause", elastic_timeout_s=60))
    slices = SimulatedSlices(num_slices=4, faults=[SliceFault(2, at_step=25, down_for_s=2)])
    client = CkptdClient(ClientSettings(url=f"http://127.0.0.1:{port}"), root=ROOT)
    runner = ElasticRunner(config, slices=slices, client=client, checkpoint_dir=f"{ROOT}/{JOB}")
    try:
        result = runner.run(train)
        runner.checkpointer.close()  # waits for the last save
        print(f"recoveries {[(r.kind, r.failed_at_step, r.restored_step) for r in result.recoveries]}; "
              f"same pid: {result.pid == os.getpid()}; checkpoints in {ROOT}/{JOB}")
    finally:
        client.close()
        ckptd.terminate()  # ckptd stops on SIGTERM (after persisting what it was handed)
        ckptd.wait(timeout=90)
