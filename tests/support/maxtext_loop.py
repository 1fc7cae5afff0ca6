"""A reproduction of MaxText's call structure around checkpoints and elasticity, with ckptd's patch applied.

MaxText (commit e591f30, docs/maxtext.md) needs Python >= 3.12 and is not installed here; this module keeps
its control flow and the calls that touch checkpoints, by the same names, with a one-array model:
``get_train_func`` wraps the run in ``elastic_utils.elastic_retry`` (pathwaysutils' ``Manager.elastic_retry``,
chaining ``callback_fn``/``pre_callback_fn``), each attempt runs ``train_loop`` → ``setup_train_loop`` (mesh
on the live devices, ``create_orbax_checkpoint_manager``, ``load_state_if_possible``) → the loop with
``maybe_save_checkpoint``. The lines of ``integrations/maxtext/ckptd.patch`` are here as they are there
(each ``+`` line appears verbatim; the test checks), everything else as MaxText has it. ``clean_up_checkpoints``
is MaxText's, on a local directory: the function the patch takes out of the loop.
"""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from orbax.checkpoint._src.checkpoint_managers import preservation_policy as preservation_policy_lib
from orbax.checkpoint._src.checkpoint_managers import save_decision_policy as save_decision_policy_lib
from pathwaysutils.elastic import manager

from trainer_client import MaxTextHooks

elastic_manager: manager.Manager | None = None  # MaxText's module global; the test sets a SliceManager
CheckpointManagerOptions = ocp.CheckpointManagerOptions


def config(checkpoint_dir: str, steps: int, checkpoint_period: int) -> SimpleNamespace:
    """The keys of MaxText's config these calls read (``configs/base.yml`` defaults otherwise)."""
    return SimpleNamespace(
        checkpoint_dir=checkpoint_dir.rstrip("/") + "/", steps=steps, checkpoint_period=checkpoint_period,
        enable_checkpointing=True, async_checkpointing=True, dataset_type="synthetic",
        max_num_checkpoints_to_keep=None, elastic_enabled=True, elastic_max_retries=10,
        elastic_timeout_seconds=300, elastic_min_slice_count=-1,
    )


# ---- src/maxtext/utils/elastic_utils.py -------------------------------------------------------------------

def clean_up_checkpoints(checkpoint_dir: str) -> None:
    """MaxText's: delete the newest step directory without a ``commit_success`` file (on a local path)."""
    checkpoints = sorted((cp for cp in os.listdir(checkpoint_dir) if cp.isdigit()), key=int)
    if not checkpoints:
        return
    latest_checkpoint_path = os.path.join(checkpoint_dir, checkpoints[-1])
    if not any(name.startswith("commit_success") for name in os.listdir(latest_checkpoint_path)):
        shutil.rmtree(latest_checkpoint_path)


def chain_callbacks(*funcs: Any) -> Any:
    def wrapper() -> None:
        for func in funcs:
            func()

    return wrapper


def elastic_retry(config: Any, callback_fn: Any = None, pre_callback_fn: Any = None) -> Any:
    assert elastic_manager is not None

    # ckptd: fence the failed attempt's saves instead of deleting the newest marker-less step,
    # and ask ckptd where each attempt resumes.
    hooks = MaxTextHooks.for_directory(config.checkpoint_dir)
    cleanup_partial = hooks.on_elastic_event
    pre_callback_fn = MaxTextHooks.chain(hooks.before_attempt, pre_callback_fn)

    if callback_fn is None:  # noqa: SIM108 - MaxText's lines, as they are
        effective_callback = cleanup_partial
    else:
        effective_callback = chain_callbacks(cleanup_partial, callback_fn)

    return elastic_manager.elastic_retry(
        max_retries=config.elastic_max_retries,
        timeout=config.elastic_timeout_seconds,
        minimum_slice_count=None if config.elastic_min_slice_count == -1 else config.elastic_min_slice_count,
        pre_callback=pre_callback_fn,
        on_elastic_event_callback=effective_callback,
    )


def live_devices(config: Any = None) -> list[Any]:
    assert elastic_manager is not None
    return [d for d in jax.devices() if d is not None and any(
        d in elastic_manager.slice_to_devices[k] for k in elastic_manager.active_slice_indices)]


# ---- src/maxtext/common/checkpointing.py ------------------------------------------------------------------

def create_orbax_checkpoint_manager(checkpoint_dir: str, enable_checkpointing: bool, use_async: bool,
                                    save_interval_steps: int, max_num_checkpoints_to_keep: int | None = None,
                                    ) -> Any:
    if not enable_checkpointing:
        return None
    item_names = ("items",)
    item_handlers = {"items": ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)}
    p = checkpoint_dir
    os.makedirs(p, exist_ok=True)
    save_decision_policy = save_decision_policy_lib.FixedIntervalPolicy(interval=save_interval_steps)
    preservation_policy = preservation_policy_lib.LatestN(max_num_checkpoints_to_keep)
    manager = MaxTextHooks.for_directory(checkpoint_dir).checkpoint_manager(  # ckptd: only good steps named
        p,
        item_names=item_names,
        item_handlers=item_handlers,
        options=CheckpointManagerOptions(
            create=True,
            enable_async_checkpointing=use_async,
            save_decision_policy=save_decision_policy,
            preservation_policy=preservation_policy,
        ),
    )
    return manager


def load_state_if_possible(checkpoint_manager: Any, abstract_unboxed_pre_state: Any, step: int = -1) -> Any:
    if checkpoint_manager is not None:
        step = checkpoint_manager.latest_step() if step < 0 else step
        if step is not None:
            def map_to_pspec(data: Any) -> Any:
                return ocp.type_handlers.ArrayRestoreArgs(sharding=data.sharding)

            restore_args = jax.tree_util.tree_map(map_to_pspec, abstract_unboxed_pre_state)
            return checkpoint_manager.restore(step, args=ocp.args.Composite(items=ocp.args.PyTreeRestore(
                item=abstract_unboxed_pre_state, restore_args=restore_args)))
    return None


def save_checkpoint(checkpoint_manager: Any, step: int, state: Any, config: Any = None, force: bool = False) -> bool:
    jax.block_until_ready(state)
    checkpoint_args = ocp.args.PyTreeSave(item=state, save_args=jax.tree.map(lambda _: ocp.SaveArgs(), state))
    return bool(checkpoint_manager.save(step, args=ocp.args.Composite(items=checkpoint_args), force=force))


def maybe_save_checkpoint(checkpoint_manager: Any, state: Any, config: Any, data_iterator: Any,
                          step: int | None = None) -> None:
    if checkpoint_manager is None:
        return
    actual_step = int(step) if step is not None else int(state["step"]) - 1
    force_ckpt_save = step is None and actual_step != -1 and (actual_step % config.checkpoint_period != 0)
    if not (force_ckpt_save or (actual_step != 0 and actual_step % config.checkpoint_period == 0)):
        return
    if checkpoint_manager.latest_step() == actual_step or actual_step in checkpoint_manager.all_steps():
        return
    save_checkpoint(checkpoint_manager, actual_step, state, config, force_ckpt_save)
    if force_ckpt_save:
        checkpoint_manager.wait_until_finished()


# ---- src/maxtext/utils/train_utils.py and src/maxtext/trainers/pre_train/train.py ---------------------------

def setup_train_loop(config: Any) -> tuple[Any, Any, Mesh, int]:
    """Mesh on the live devices, the checkpoint manager, the state restored or initialized."""
    devices = live_devices(config)
    mesh = Mesh(np.array(devices), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    replicated = NamedSharding(mesh, PartitionSpec())
    n = 4 * len(jax.devices())
    abstract = {"w": jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sharding),
                "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)}
    checkpoint_manager = create_orbax_checkpoint_manager(
        config.checkpoint_dir, config.enable_checkpointing, config.async_checkpointing, config.checkpoint_period,
        config.max_num_checkpoints_to_keep)
    restored = load_state_if_possible(checkpoint_manager, abstract)
    if restored is not None:
        state = restored["items"]
    else:
        state = {"w": jax.device_put(jnp.zeros((n,), jnp.float32), sharding),
                 "step": jax.device_put(jnp.zeros((), jnp.int32), replicated)}
    return checkpoint_manager, state, mesh, int(state["step"])


@jax.jit
def train_step(state: Any) -> tuple[Any, Any]:
    new = {"w": state["w"] + 1.0, "step": state["step"] + 1}
    return new, jnp.sum(new["w"])


def train_loop(config: Any, log: list[tuple[int, float]], step_hook: Any = None) -> Any:
    checkpoint_manager, state, _mesh, start_step = setup_train_loop(config)
    for step in range(start_step, config.steps):
        if step_hook is not None:
            step_hook(step)
        state, loss = train_step(state)
        log.append((step, float(loss)))  # reading the loss: where a lost slice shows up
        maybe_save_checkpoint(checkpoint_manager, state, config, None, step)
    maybe_save_checkpoint(checkpoint_manager, state, config, None)
    checkpoint_manager.wait_until_finished()
    return jax.tree.map(np.asarray, state)


def get_train_func(config: Any, log: list[tuple[int, float]], step_hook: Any = None) -> Any:
    """MaxText's: the run wrapped in ``elastic_retry`` with its goodput callbacks (here: recorded)."""
    events: list[str] = []

    def on_elastic_event() -> None:
        events.append("elastic_event")

    def on_slices_ready() -> None:
        events.append("slices_ready")

    def elastic_train_wrapper() -> Any:
        return train_loop(config, log, step_hook)

    train_func = elastic_retry(config, callback_fn=on_elastic_event, pre_callback_fn=on_slices_ready)(
        elastic_train_wrapper)
    train_func.events = events
    return train_func


__all__ = ["clean_up_checkpoints", "config", "elastic_retry", "get_train_func"]
