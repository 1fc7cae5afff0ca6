"""A decoder-only language model sized to the device, for the benchmarks that need a real training step.

Why it exists: a tier's cost is a fact of the hardware (docs/benchmarks.md, "Device profile"): a snapshot's copy
slows a step only where the step donates the buffers it reads, and a restore runs at the host-to-device link's
rate only when the state is large. Those need a realistic step: a transformer decoder (scanned layers, bf16
compute with rematerialisation, fp32 parameters and AdamW moments) whose jitted step donates the train state,
as MaxText's does. ``SIZES["chip"]`` is the 435M-parameter model measured on one TPU v5e chip (5.22 GB of state,
~0.28 s a step); ``"toy"`` runs in seconds on CPU so that the suite keeps the code working.

The state is laid out on a mesh ``(replica, data)`` with every array replicated along ``replica`` (the
data-parallel axis across slices, what the replica tier splits along) and the batch split along both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PyTree = Any
AXES = ("replica", "data")


@dataclass(frozen=True)
class DecoderSize:
    """The model's shape and the batch a step trains on."""

    layers: int
    d_model: int
    d_ff: int
    heads: int
    vocab: int
    seq: int
    batch: int

    @property
    def parameters(self) -> int:
        per_layer = 4 * self.d_model ** 2 + 2 * self.d_model * self.d_ff + 2 * self.d_model
        return self.vocab * self.d_model + self.layers * per_layer + self.d_model

    @property
    def state_bytes(self) -> int:
        """fp32 parameters and AdamW's two moments."""
        return 3 * 4 * self.parameters

    @property
    def flops_per_step(self) -> float:
        """Forward and backward (6 N per token) plus attention, with the forward recomputed under remat."""
        tokens = self.batch * self.seq
        attention = 4 * self.layers * self.seq * self.d_model * tokens
        return 8.0 * self.parameters * tokens + 4.0 * attention


SIZES: dict[str, DecoderSize] = {
    # one TPU v5e chip (15.75 GiB HBM): 435M parameters, 5.22 GB of state, peak ~6 GiB in the step
    "chip": DecoderSize(layers=20, d_model=1280, d_ff=5120, heads=10, vocab=32768, seq=1024, batch=8),
    # half of it: for a quick look on a chip
    "chip-small": DecoderSize(layers=10, d_model=1280, d_ff=5120, heads=10, vocab=32768, seq=1024, batch=8),
    # seconds on 8 fake CPU devices: keeps the device profile's code working in the CPU suite
    "toy": DecoderSize(layers=2, d_model=64, d_ff=128, heads=2, vocab=256, seq=32, batch=8),
}


def mesh_of(devices: list[jax.Device], replicas: int = 1) -> Mesh:
    """``(replica, data)`` over ``devices``: ``replicas`` groups, the rest along ``data``."""
    if len(devices) % replicas:
        raise ValueError(f"{len(devices)} devices do not split into {replicas} replicas")
    return Mesh(np.array(devices).reshape(replicas, len(devices) // replicas), AXES)


def _init_params(size: DecoderSize, key: jax.Array) -> PyTree:
    k = iter(jax.random.split(key, 8))
    d, f, n = size.d_model, size.d_ff, size.layers

    def normal(shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return jax.random.normal(next(k), shape, jnp.float32) / math.sqrt(fan_in)

    return {
        "embed": normal((size.vocab, d), d),
        "layers": {
            "wq": normal((n, d, d), d), "wk": normal((n, d, d), d), "wv": normal((n, d, d), d),
            "wo": normal((n, d, d), d), "w1": normal((n, d, f), d), "w2": normal((n, f, d), f),
            "ln1": jnp.ones((n, d), jnp.float32), "ln2": jnp.ones((n, d), jnp.float32),
        },
        "ln_f": jnp.ones((d,), jnp.float32),
    }


def _rms(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x.astype(jnp.float32) ** 2, -1, keepdims=True) + 1e-6).astype(x.dtype) * \
        scale.astype(x.dtype)


def _forward(size: DecoderSize, params: PyTree, tokens: jax.Array) -> jax.Array:
    bf = jnp.bfloat16
    h = params["embed"].astype(bf)[tokens]
    b, s, d = h.shape
    heads, hd = size.heads, size.d_model // size.heads
    mask = jnp.tril(jnp.ones((s, s), bool))

    def layer(h: jax.Array, w: PyTree) -> tuple[jax.Array, None]:
        x = _rms(h, w["ln1"])
        q, kk, v = (jnp.einsum("bsd,de->bse", x, w[n].astype(bf)).reshape(b, s, heads, hd)
                    for n in ("wq", "wk", "wv"))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(hd)
        att = jax.nn.softmax(jnp.where(mask, att.astype(jnp.float32), -1e9), -1).astype(bf)
        o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
        h = h + jnp.einsum("bsd,de->bse", o, w["wo"].astype(bf))
        x = _rms(h, w["ln2"])
        h = h + jnp.einsum("bsf,fd->bsd", jax.nn.gelu(jnp.einsum("bsd,df->bsf", x, w["w1"].astype(bf))),
                           w["w2"].astype(bf))
        return h, None

    h, _ = jax.lax.scan(jax.checkpoint(layer), h, params["layers"])
    h = _rms(h, params["ln_f"])
    return jnp.einsum("bsd,vd->bsv", h, params["embed"].astype(bf))


def _loss(size: DecoderSize, params: PyTree, tokens: jax.Array) -> jax.Array:
    logits = _forward(size, params, tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def optimizer() -> optax.GradientTransformation:
    return optax.adamw(1e-4, weight_decay=0.01)


def init_fn(size: DecoderSize, seed: int = 0) -> Callable[[], PyTree]:
    """The state's initialiser, ``() -> {"params", "opt"}``: what ``make_state`` runs, and what an elastic
    runner's ``restore_or_init`` takes (bench/device_recovery.py)."""

    def init() -> PyTree:
        params = _init_params(size, jax.random.key(seed))
        return {"params": params, "opt": optimizer().init(params)}

    return init


def make_state(size: DecoderSize, mesh: Mesh, seed: int = 0) -> PyTree:
    """``{"params", "opt"}`` on ``mesh``, every array replicated (one copy per device)."""
    replicated = NamedSharding(mesh, P())
    init = init_fn(size, seed)
    shapes = jax.eval_shape(init)
    return jax.jit(init, out_shardings=jax.tree.map(lambda _: replicated, shapes))()


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(AXES))


def make_batch(size: DecoderSize, mesh: Mesh, step: int) -> jax.Array:
    """Deterministic tokens of ``step``, the batch split over every device."""
    rng = np.random.default_rng(step)
    tokens = rng.integers(0, size.vocab, (size.batch, size.seq + 1), dtype=np.int32)
    return jax.device_put(tokens, batch_sharding(mesh))


def make_step(size: DecoderSize) -> Callable[[PyTree, jax.Array], tuple[PyTree, jax.Array]]:
    """The jitted train step ``(state, tokens) -> (state, loss)``; the state is donated, as in MaxText."""
    opt = optimizer()

    def step(state: PyTree, tokens: jax.Array) -> tuple[PyTree, jax.Array]:
        loss, grads = jax.value_and_grad(lambda p: _loss(size, p, tokens))(state["params"])
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, loss

    return jax.jit(step, donate_argnums=0)


def tree_bytes(state: PyTree) -> int:
    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array))


__all__ = ["AXES", "SIZES", "DecoderSize", "batch_sharding", "init_fn", "make_batch", "make_state", "make_step",
           "mesh_of", "tree_bytes"]
