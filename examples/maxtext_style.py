"""A MaxText-style run under ckptd: a small decoder LM, MaxText's config names, Grain data, a slice lost and back.

MaxText users know these settings (``src/maxtext/configs/base.yml``): ``checkpoint_period``,
``enable_checkpointing``, ``async_checkpointing``, ``elastic_enabled``, ``elastic_timeout_seconds``,
``elastic_max_retries``, ``elastic_min_slice_count``, ``elastic_backup_kind`` (``snapshot``: ckptd's replica
tier), ``base_output_directory``/``run_name``,
``dataset_type: grain``, ``per_device_batch_size``. Here they drive ckptd's ``ElasticRunner`` instead of
MaxText's ``elastic_utils.elastic_retry``: checkpoints land where MaxText puts them,
``<base_output_directory>/<run_name>/checkpoints/<step>/items`` with the Grain iterator in ``<step>/iter``
(Grain's ``process_0-of-1.json``), so MaxText restores them and ckptd plans MaxText's own (docs/maxtext.md).

The model is a one-layer decoder in plain JAX with MaxText's parameter names (``token_embedder``,
``decoder/layers/self_attention``, ``mlp``, ``decoder_norm``) on the mesh ``(data, fsdp)``: one slice per
``data`` row (dcn), ``fsdp`` inside a slice, the embedding dimension sharded over ``fsdp``. Data: a Grain
pipeline of synthetic token sequences. Slice 2 goes down at ``--fail-at``; training goes on on 3 slices
(``elastic_min_slice_count`` > 0: ckptd's ``resize``; the global batch kept by gradient accumulation) and
grows back when the slice returns at ``--back-at``, restored from the replicas the loss spared
(``--elastic-backup-kind snapshot``, MaxText's default) or from the last checkpoint (``checkpoint``). The run
checks that every step read exactly the batch an uninterrupted Grain iterator gives.
``python -m examples.maxtext_style``; prints ``report: PATH`` last.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import functools
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from examples.demo import DRAIN_TIMEOUT_S, free_port, start_ckptd, step_label
from trainer_client import (
    BatchScalingOptions,
    CkptdClient,
    ClientSettings,
    ElasticConfig,
    ElasticContext,
    ElasticOptions,
    ElasticRunner,
    Event,
    HealthOptions,
    MemoryTierOptions,
    ReplicaOptions,
    SaveOptions,
    SimulatedSlices,
    SliceFault,
)
from trainer_client.core.protocol import BatchPlan

PyTree = Any
MESH_AXES = ("data", "fsdp")  # MaxText's names: dcn_data_parallelism across slices, ici_fsdp_parallelism within


@dataclasses.dataclass(frozen=True)
class MaxTextConfig:
    """The MaxText settings this run honours (names and meanings as in MaxText's configs/base.yml)."""

    run_name: str = "maxtext-style"
    base_output_directory: str = "maxtext-output"
    steps: int = 60
    enable_checkpointing: bool = True
    async_checkpointing: bool = True
    checkpoint_period: int = 10
    elastic_enabled: bool = True
    elastic_timeout_seconds: int = 300
    elastic_max_retries: int = 10
    elastic_min_slice_count: int = 3  # -1 (MaxText's default): wait for every slice, ckptd's "pause"
    # "snapshot" (MaxText's default): recover from in-memory snapshots of the state, ckptd's replica tier;
    # "checkpoint": from checkpoints only (ckptd's host-memory tier, then storage)
    elastic_backup_kind: str = "snapshot"
    dataset_type: str = "grain"
    per_device_batch_size: int = 6  # 48 a step on 8 devices; on 6 (a slice lost) 2 microbatches of 24
    max_target_length: int = 16
    vocab_size: int = 128
    emb_dim: int = 32
    mlp_dim: int = 64
    learning_rate: float = 3e-3
    dcn_data_parallelism: int = 4  # slices
    ici_fsdp_parallelism: int = 2  # devices per slice

    @property
    def checkpoint_dir(self) -> str:
        """MaxText's ``config.checkpoint_dir``: ``<base_output_directory>/<run_name>/checkpoints``."""
        return f"{self.base_output_directory}/{self.run_name}/checkpoints"

    @property
    def global_batch_size_to_train_on(self) -> int:
        return self.per_device_batch_size * self.dcn_data_parallelism * self.ici_fsdp_parallelism


def elastic_config(cfg: MaxTextConfig, **groups: Any) -> ElasticConfig:
    """ckptd's runner configured from MaxText's settings: the job is ``checkpoints`` under ckptd's root
    ``<base_output_directory>/<run_name>``, the state's item ``items``; ``elastic_min_slice_count=-1`` waits
    for every slice (``pause``), a count trains on that many (``resize``); without ``elastic_enabled`` the
    first slice loss ends the run (no retries). ``groups``: the option groups MaxText has no flags for
    (``health``, ``memory_tier``, ...); the memory tier's ``replicas`` follow ``elastic_backup_kind``
    (``replica_options``)."""
    resize = cfg.elastic_min_slice_count != -1
    tier = groups.pop("memory_tier", MemoryTierOptions())
    groups["memory_tier"] = dataclasses.replace(tier, replicas=replica_options(cfg, tier.replicas))
    return ElasticConfig(
        job="checkpoints", mesh_axes=MESH_AXES, mesh_shape=(cfg.dcn_data_parallelism, cfg.ici_fsdp_parallelism),
        global_batch=cfg.global_batch_size_to_train_on,
        checkpoint_period=cfg.checkpoint_period if cfg.enable_checkpointing else 0,
        elastic=ElasticOptions(
            policy="resize" if resize else "pause", min_slices=cfg.elastic_min_slice_count if resize else 1,
            elastic_timeout_s=float(cfg.elastic_timeout_seconds),
            elastic_max_retries=cfg.elastic_max_retries if cfg.elastic_enabled else 0),
        batch=BatchScalingOptions(batch_mode="keep_global_batch"),
        saving=SaveOptions(async_save=cfg.async_checkpointing, checkpoint_item="items"),
        **groups)


def replica_options(cfg: MaxTextConfig, given: ReplicaOptions | None = None) -> ReplicaOptions:
    """MaxText's ``elastic_backup_kind``: ``snapshot`` is ckptd's replica tier (snapshots of the state in the
    hosts' memory, paced unless ``given`` sets a period, restored from the replicas a slice loss spares, along
    ``data``: one replica per slice); ``checkpoint`` turns it off (a resume reads the shared-memory tier or
    storage). Any other kind is refused, as MaxText's config refuses it. ``given``: the options MaxText has no
    flag for (``period``, ``host_budget_bytes``) are kept from it."""
    if cfg.elastic_backup_kind not in ("snapshot", "checkpoint"):
        raise ValueError(f"elastic_backup_kind must be one of 'snapshot' or 'checkpoint', got "
                         f"{cfg.elastic_backup_kind!r}")
    return dataclasses.replace(given or ReplicaOptions(), replica_axis=MESH_AXES[0],
                               enabled=cfg.elastic_enabled and cfg.elastic_backup_kind == "snapshot")


# ---- data: Grain -------------------------------------------------------------------------------------


def _sequence(cfg: MaxTextConfig, index: int) -> np.ndarray:
    """Sample ``index``: ``max_target_length + 1`` tokens of an arithmetic sequence (learnable next tokens)."""
    start, stride = index % cfg.vocab_size, 1 + index % 7
    return ((start + stride * np.arange(cfg.max_target_length + 1)) % cfg.vocab_size).astype(np.int32)


def data_pipeline(cfg: MaxTextConfig, records: int = 1 << 20) -> grain.IterDataset:
    """The Grain pipeline (``dataset_type: grain``): shuffled samples, global batches."""
    return (grain.MapDataset.range(records).shuffle(seed=0).map(functools.partial(_sequence, cfg))
            .batch(cfg.global_batch_size_to_train_on, drop_remainder=True).to_iter_dataset())


# ---- model: a one-layer decoder with MaxText's parameter names ---------------------------------------


def init_state(cfg: MaxTextConfig, seed: int = 0) -> PyTree:
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    d, m, v = cfg.emb_dim, cfg.mlp_dim, cfg.vocab_size

    def dense(shape: tuple[int, ...]) -> jax.Array:
        return jax.random.normal(next(keys), shape) / np.sqrt(shape[0])

    params = {"params": {
        "token_embedder": {"embedding": dense((v, d))},
        "decoder": {
            "layers": {"self_attention": {name: {"kernel": dense((d, d))} for name in ("query", "key", "value", "out")},
                       "mlp": {"wi": {"kernel": dense((d, m))}, "wo": {"kernel": dense((m, d))}}},
            "decoder_norm": {"scale": jnp.ones((d,))},
        },
    }}
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer(cfg).init(params)}


def optimizer(cfg: MaxTextConfig) -> optax.GradientTransformation:
    return optax.adamw(cfg.learning_rate)


def partition_specs(cfg: MaxTextConfig, abstract_state: PyTree) -> PyTree:
    """MaxText's ``embed -> fsdp`` rule: the (first) embedding dimension sharded over ``fsdp``, the rest
    replicated."""
    def spec(leaf: Any) -> PartitionSpec:
        dims = list(leaf.shape)
        first = dims.index(cfg.emb_dim) if cfg.emb_dim in dims else None
        return PartitionSpec(*["fsdp" if k == first else None for k in range(len(dims))])

    return jax.tree_util.tree_map(spec, abstract_state)


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def loss_fn(params: PyTree, tokens: jax.Array) -> jax.Array:
    p = params["params"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    embedding = p["token_embedder"]["embedding"]
    x = embedding[inputs]
    attn = p["decoder"]["layers"]["self_attention"]
    q, k, v = (x @ attn[name]["kernel"] for name in ("query", "key", "value"))
    scores = q @ jnp.swapaxes(k, -1, -2) / np.sqrt(x.shape[-1])
    causal = jnp.tril(jnp.ones((inputs.shape[1], inputs.shape[1]), bool))
    x = x + jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1) @ v @ attn["out"]["kernel"]
    mlp = p["decoder"]["layers"]["mlp"]
    x = x + jax.nn.gelu(x @ mlp["wi"]["kernel"]) @ mlp["wo"]["kernel"]
    logits = _norm(x, p["decoder"]["decoder_norm"]["scale"]) @ embedding.T
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


@functools.lru_cache(maxsize=16)
def train_step(cfg: MaxTextConfig, accumulation_steps: int, lr_scale: float) -> Any:
    """One optimizer step over ``accumulation_steps`` microbatches (``[steps, micro, length]`` tokens)."""

    def step(state: PyTree, tokens: jax.Array) -> tuple[PyTree, jax.Array]:
        def micro(carry: tuple[jax.Array, PyTree], batch: jax.Array) -> tuple[tuple[jax.Array, PyTree], None]:
            loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
            return (carry[0] + loss, jax.tree_util.tree_map(jnp.add, carry[1], grads)), None

        zero = (jnp.zeros(()), jax.tree_util.tree_map(jnp.zeros_like, state["params"]))
        (loss, grads), _ = jax.lax.scan(micro, zero, tokens)
        grads = jax.tree_util.tree_map(lambda g: g / accumulation_steps, grads)
        updates, opt_state = optimizer(cfg).update(grads, state["opt_state"], state["params"])
        updates = jax.tree_util.tree_map(lambda u: u * lr_scale, updates)
        return {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state}, loss / accumulation_steps

    return jax.jit(step)


def batch_sharding(mesh: Mesh, plan: BatchPlan) -> tuple[tuple[int, int], NamedSharding]:
    """``(accumulation steps, microbatch)`` and the sharding of a step's ``[steps, micro, length]`` tokens."""
    return (plan.accumulation_steps, plan.micro_batch), NamedSharding(mesh, PartitionSpec(None, MESH_AXES))


# ---- the training function the elastic runner calls (again after every recovery) ---------------------


def make_train_fn(cfg: MaxTextConfig, seen: dict[int, np.ndarray], losses: dict[int, float],
                  step_hook: Any = None) -> Any:
    def train(ctx: ElasticContext) -> PyTree:
        data_iterator = iter(data_pipeline(cfg))  # fresh each attempt; restored to the step's state below
        state, step, position = ctx.restore_or_init(
            functools.partial(init_state, cfg), functools.partial(partition_specs, cfg), data_iterator=data_iterator)
        (steps, micro), sharding = batch_sharding(ctx.mesh, ctx.batch)
        step_fn = train_step(cfg, steps, ctx.batch.lr_scale)
        while step < cfg.steps:
            ctx.step_boundary(step, state, position)  # every checkpoint_period steps a checkpoint, with Grain's state
            if step_hook is not None:
                step_hook(step)
            batch = np.asarray(next(data_iterator))
            seen[step] = batch
            tokens = jax.device_put(batch.reshape(steps, micro, -1), sharding)
            state, loss = step_fn(state, tokens)
            losses[step] = float(loss)
            position += len(batch)
            step += 1
        ctx.save(step, state, position)  # MaxText's save_checkpoint_on_completion
        return state

    return train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-output-directory", default="maxtext-output")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-period", type=int, default=10)
    parser.add_argument("--fail-at", type=int, default=23, help="step at which slice 2 goes down")
    parser.add_argument("--back-at", type=int, default=37, help="step at which slice 2 is healthy again")
    parser.add_argument("--memory-period", type=int, default=5,
                        help="host-memory snapshots every N steps between checkpoints (0: storage only)")
    parser.add_argument("--elastic-backup-kind", default="snapshot", choices=("snapshot", "checkpoint"),
                        help="MaxText's elastic_backup_kind: snapshot (ckptd's replica tier) or checkpoint")
    args = parser.parse_args(argv)
    cfg = MaxTextConfig(base_output_directory=str(Path(args.base_output_directory).resolve()), steps=args.steps,
                        checkpoint_period=args.checkpoint_period, elastic_backup_kind=args.elastic_backup_kind)
    out = Path(cfg.base_output_directory)
    shutil.rmtree(out, ignore_errors=True)
    root = Path(cfg.checkpoint_dir).parent  # ckptd's root: <base_output_directory>/<run_name>; the job: checkpoints
    Path(cfg.checkpoint_dir).mkdir(parents=True)
    shm_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else out
    shm_dir = Path(tempfile.mkdtemp(prefix="ckptd-maxtext-", dir=shm_base))
    port = free_port()
    server = start_ckptd(root, out / "ckptd-state", shm_dir, port, out / "ckptd.log")
    print(f"ckptd serving {root} on http://127.0.0.1:{port}; checkpoints in {cfg.checkpoint_dir}/<step>/items")

    def show(event: Event) -> None:
        if event.kind != "checkpoint_started":
            print(f"  [{event.t:7.2f}s] {event.kind:<18} {step_label(event.step):<10} {event.detail}", flush=True)

    # every step held, the loop waiting for a copy in flight: this CPU state is small, and the run's loss costs
    # one step (the default paces snapshots from measured costs: docs/concepts.md, "Pacing the replica tier")
    every_step = ReplicaOptions(period=1, when_busy="wait")
    # the memory tier's directory is the client's (CKPTD_SHM_DIR, ClientSettings.shm_dir): given with a memory period
    tier = MemoryTierOptions(memory_period=args.memory_period or None, max_snapshots=8, replicas=every_step)
    tier_dir = str(shm_dir) if args.memory_period else None
    slices = SimulatedSlices(num_slices=cfg.dcn_data_parallelism, faults=[SliceFault(2, args.fail_at, None)])

    def bring_back(step: int) -> None:
        if step == args.back_at and 2 not in runner.manager.active_slice_indices:  # once, not again after it
            slices.bring_back(2)
            # steps take milliseconds here: give pathwaysutils' monitor thread the time to see the slice healthy
            # (it checks the slices not in use every monitor_interval_s), so the run grows back at the next step
            deadline = time.monotonic() + 60
            while 2 not in runner.manager.available_inactive_slices and time.monotonic() < deadline:
                time.sleep(0.05)

    seen: dict[int, np.ndarray] = {}
    losses: dict[int, float] = {}
    try:
        client = CkptdClient(ClientSettings(url=f"http://127.0.0.1:{port}", shm_dir=tier_dir), root=str(root))
        health = HealthOptions(poll_interval_s=0.05, scale_up_check_interval_s=0.0, monitor_interval_s=0.2)
        runner = ElasticRunner(elastic_config(cfg, health=health, memory_tier=tier),
                               slices=slices, client=client, checkpoint_dir=cfg.checkpoint_dir, on_event=show)
        result = runner.run(make_train_fn(cfg, seen, losses, bring_back))
        runner.checkpointer.close()
        client.close()
    finally:
        server.terminate()  # ckptd persists what waits in shared memory first
        server.wait(timeout=DRAIN_TIMEOUT_S + 30)
        shutil.rmtree(shm_dir, ignore_errors=True)
    reference = iter(data_pipeline(cfg))
    exact = all(np.array_equal(seen[step], next(reference)) for step in range(cfg.steps))
    last = Path(cfg.checkpoint_dir) / str(cfg.steps)
    report: dict[str, Any] = {
        "pid": result.pid, "final_step": result.final_step,
        "recoveries": [{"kind": r.kind, "failed_at_step": r.failed_at_step, "restored_step": r.restored_step,
                        "mesh_after": r.mesh_after, "restored_from": r.restored_from} for r in result.recoveries],
        "grain_resumed_exactly": exact,
        "first_loss": losses[0], "final_loss": losses[cfg.steps - 1],
        "last_checkpoint": sorted(p.name for p in last.iterdir()) if last.is_dir() else [],
    }
    report_path = out / "report.json"
    report_path.write_text(json.dumps(report, indent=2))
    print(f"grain resumed exactly: {exact}; loss {report['first_loss']:.3f} -> {report['final_loss']:.3f}; "
          f"recoveries {[(r['kind'], r['restored_step'], r['mesh_after']) for r in report['recoveries']]}")
    print(f"report: {report_path}")
    ok = exact and report["final_loss"] < report["first_loss"] and {"items", "iter"} <= set(report["last_checkpoint"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
