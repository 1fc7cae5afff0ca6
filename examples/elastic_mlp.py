"""A small real model for the demo and the tests: an MLP regressor trained with optax on a teacher.

Data is deterministic and synthetic: sample ``i`` is generated on the devices from ``fold_in(key, i)``,
so the data position (the global sample index) alone says what the next batch is — after any failure and
on any mesh. Hidden-layer weights are sharded over the ``data`` axis; the batch is sharded over every
mesh axis.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer_client import ElasticContext
from trainer_client.core.protocol import BatchPlan

D_IN, HIDDEN, D_OUT = 32, 128, 8
PyTree = Any


def _teacher(x: jax.Array) -> jax.Array:
    k1, k2 = jax.random.split(jax.random.key(1234))
    w1 = jax.random.normal(k1, (D_IN, 64)) / np.sqrt(D_IN)
    w2 = jax.random.normal(k2, (64, D_OUT)) / 8.0
    return jnp.tanh(x @ w1) @ w2


def make_batch(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inputs and targets of the samples ``ids`` (deterministic per id)."""
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(7), i))(ids)
    x = jax.vmap(lambda k: jax.random.normal(k, (D_IN,)))(keys)
    return x, _teacher(x)


def optimizer(learning_rate: float = 3e-3) -> optax.GradientTransformation:
    return optax.adam(learning_rate)


def init_state(seed: int = 0) -> PyTree:
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {
        "w1": jax.random.normal(k1, (D_IN, HIDDEN)) / np.sqrt(D_IN),
        "b1": jnp.zeros((HIDDEN,)),
        "w2": jax.random.normal(k2, (HIDDEN, D_OUT)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros((D_OUT,)),
    }
    return {"params": params, "opt": optimizer().init(params)}


def partition_specs(abstract_state: PyTree) -> PyTree:
    """Shard every hidden-sized dimension over ``data``; replicate the rest."""

    def spec(leaf: Any) -> PartitionSpec:
        shape = tuple(leaf.shape)
        return PartitionSpec(*["data" if d == HIDDEN else None for d in shape])

    return jax.tree_util.tree_map(spec, abstract_state)


def loss_fn(params: PyTree, ids: jax.Array) -> jax.Array:
    x, y = make_batch(ids)
    pred = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
    return jnp.mean((pred - y) ** 2)


def train_step(state: PyTree, ids: jax.Array) -> tuple[PyTree, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], ids)
    updates, opt = optimizer().update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


@functools.lru_cache(maxsize=32)
def jitted_step(accumulation_steps: int = 1, lr_scale: float = 1.0) -> Any:
    """One jitted step per batch plan, shared by every attempt, so a mesh compiled ahead of time (by
    ``precompile``) is found in jax's cache after a recovery."""
    return jax.jit(make_train_step(accumulation_steps, lr_scale))


def batch_layout(mesh: Mesh, batch: BatchPlan) -> tuple[tuple[int, ...], NamedSharding]:
    """Shape and sharding of a step's sample ids: ``[global]``, or ``[steps, micro]`` when accumulating."""
    axes = tuple(mesh.axis_names)
    if batch.accumulation_steps > 1:
        return (batch.accumulation_steps, batch.micro_batch), NamedSharding(mesh, PartitionSpec(None, axes))
    return (batch.global_batch,), NamedSharding(mesh, PartitionSpec(axes))


def precompile(mesh: Mesh, batch: BatchPlan) -> jax.stages.Compiled:
    """Lower and compile the training step for ``mesh`` (the ElasticRunner calls it in the background). The
    runner keeps what this returns and hands it to the attempt after an event onto exactly this mesh
    (``ctx.precompiled``): its first step runs it with no trace."""
    specs = partition_specs(jax.eval_shape(init_state))
    abstract = jax.tree_util.tree_map(
        lambda leaf, spec: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec)),
        jax.eval_shape(init_state), specs, is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    shape, sharding = batch_layout(mesh, batch)
    ids = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
    return jitted_step(batch.accumulation_steps, batch.lr_scale).lower(abstract, ids).compile()


def step_layout(batch: BatchPlan) -> tuple[int, int, int, float]:
    """What a compiled step depends on in a batch plan: the ids' shape (``batch_layout``) and ``jitted_step``'s
    key (microbatches, lr scale)."""
    return batch.accumulation_steps, batch.micro_batch, batch.global_batch, batch.lr_scale


def step_for(ctx: ElasticContext) -> Callable[..., tuple[PyTree, jax.Array]]:
    """The attempt's step: compile-ahead's executable for this mesh when the runner kept one for this batch plan
    (called like the jitted step, nothing traced), the jitted step otherwise."""
    plan, pre = ctx.batch, ctx.precompiled
    compiled = pre.executable if pre is not None and step_layout(pre.batch) == step_layout(plan) else None
    if isinstance(compiled, jax.stages.Compiled):
        return compiled
    step: Callable[..., tuple[PyTree, jax.Array]] = jitted_step(plan.accumulation_steps, plan.lr_scale)
    return step


def make_train_step(accumulation_steps: int = 1, lr_scale: float = 1.0) -> Callable[..., tuple[PyTree, jax.Array]]:
    """A training step for a batch plan: ``accumulation_steps`` microbatches (ids shaped
    ``[steps, micro]``) averaged into one update, the update scaled by ``lr_scale``."""
    if accumulation_steps == 1 and lr_scale == 1.0:
        return train_step

    def accumulated(state: PyTree, ids: jax.Array) -> tuple[PyTree, jax.Array]:
        def body(carry: tuple[jax.Array, PyTree], micro_ids: jax.Array) -> tuple[tuple[jax.Array, PyTree], None]:
            loss, grads = jax.value_and_grad(loss_fn)(state["params"], micro_ids)
            return (carry[0] + loss, jax.tree_util.tree_map(jnp.add, carry[1], grads)), None

        zero = (jnp.zeros(()), jax.tree_util.tree_map(jnp.zeros_like, state["params"]))
        micro = ids.reshape(accumulation_steps, -1)
        (loss, grads), _ = jax.lax.scan(body, zero, micro)
        grads = jax.tree_util.tree_map(lambda g: g / accumulation_steps, grads)
        updates, opt = optimizer().update(grads, state["opt"], state["params"])
        updates = jax.tree_util.tree_map(lambda u: u * lr_scale, updates)
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss / accumulation_steps

    return accumulated


@dataclass
class TrainLog:
    """What a run saw, across every attempt: loss per step and the sample ids consumed per step."""

    losses: dict[int, float] = field(default_factory=dict)
    samples: dict[int, tuple[int, int]] = field(default_factory=dict)  # step -> [start, stop) sample ids
    batches: dict[int, tuple[int, float]] = field(default_factory=dict)  # step -> (microbatches, lr scale)
    steps_run: int = 0
    # (step, time.time() when its jitted call returned: traced, compiled or loaded, dispatched), every step computed
    dispatched: list[tuple[int, float]] = field(default_factory=list)


def make_train_fn(
    total_steps: int,
    log: TrainLog,
    *,
    step_hook: Callable[[int], None] | None = None,
    use_precompile: bool = True,
) -> Callable[[ElasticContext], PyTree]:
    """The user's training function, as an ElasticRunner calls it (again after every recovery)."""

    def train(ctx: ElasticContext) -> PyTree:
        state, step, position = ctx.restore_or_init(init_state, partition_specs)
        if use_precompile:
            ctx.set_precompile(precompile)
        plan = ctx.batch
        shape, batch_sharding = batch_layout(ctx.mesh, plan)
        step_fn = step_for(ctx)
        batch = plan.global_batch
        while step < total_steps:
            ctx.step_boundary(step, state, position)
            if step_hook is not None:
                step_hook(step)
            ids_host = np.arange(position, position + batch, dtype=np.int32).reshape(shape)
            ids = jax.device_put(ids_host, batch_sharding)
            state, loss = step_fn(state, ids)
            log.dispatched.append((step, time.time()))
            log.samples[step] = (position, position + batch)
            log.batches[step] = (plan.accumulation_steps, plan.lr_scale)
            log.losses[step] = float(loss)
            log.steps_run += 1
            position += batch
            step += 1
        ctx.save(step, state, position)
        return state

    return train


__all__ = [
    "TrainLog",
    "init_state",
    "jitted_step",
    "loss_fn",
    "make_batch",
    "make_train_fn",
    "make_train_step",
    "partition_specs",
    "precompile",
    "step_for",
    "step_layout",
    "train_step",
]
