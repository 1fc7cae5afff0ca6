"""Batch semantics on a resized mesh: gradient accumulation or a scaled batch, stated explicitly.

When the data-parallel size changes, either the global batch stays what the job was tuned for
(``keep_global_batch``: the step is split into microbatches whose per-device size never exceeds what
the job ran with on its first mesh; exact when the numbers divide) or the per-device batch stays and
the global batch follows the device count (``scale_batch``), with the learning rate scaled by the rule
asked for (none, linear, sqrt). Pure and jax-free, part of the resume planner.
"""

from __future__ import annotations

import math

from trainer_client.core.protocol import BatchOptions, BatchPlan, MeshSpec

# Mesh axes that shard the batch, whichever of them a mesh has.
BATCH_AXES: tuple[str, ...] = ("replica", "data", "dp", "batch", "fsdp")


def data_parallel_size(mesh: MeshSpec) -> int:
    """How many ways the batch is split on ``mesh`` (product of its batch axes)."""
    n = 1
    for name, size in zip(mesh.axis_names, mesh.shape, strict=True):
        if name in BATCH_AXES:
            n *= size
    return n


def initial_batch(global_batch: int, mesh: MeshSpec, mode: str = "keep_global_batch") -> BatchPlan:
    """The batch plan of a job on its first mesh: no accumulation, the job's own global batch."""
    dp = data_parallel_size(mesh)
    if global_batch % dp:
        raise ValueError(f"global batch {global_batch} does not split over {dp} data-parallel devices")
    per_device = global_batch // dp
    return BatchPlan(
        mode="scale_batch" if mode == "scale_batch" else "keep_global_batch",
        base_global_batch=global_batch, global_batch=global_batch, accumulation_steps=1,
        micro_batch=global_batch, per_device_batch=per_device, max_per_device_batch=per_device,
        data_parallel_size=dp,
    )


def describe_batch(batch: BatchPlan) -> str:
    """One line of what the training step must do with ``batch``: how many microbatches of how many samples
    make one step, and the learning-rate scale to apply (``1`` when the job's own global batch is kept)."""
    text = (f"batch {batch.global_batch} = {batch.accumulation_steps} x {batch.micro_batch} "
            f"({batch.per_device_batch} per device on {batch.data_parallel_size}), lr x {batch.lr_scale:.4g}")
    if batch.global_batch != batch.base_global_batch:
        text += f", not the job's {batch.base_global_batch}" + ("" if batch.exact else " (inexact)")
    return text


def _lr_scale(rule: str, new_global: int, base_global: int) -> float:
    ratio = new_global / base_global
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    return 1.0


def plan_batch(saved: BatchPlan, mesh: MeshSpec, options: BatchOptions) -> BatchPlan:
    """The batch plan for ``mesh``, carrying the job's base batch and per-device limit from ``saved``."""
    dp = data_parallel_size(mesh)
    base, limit = saved.base_global_batch, saved.max_per_device_batch
    if options.mode == "scale_batch":
        global_batch = limit * dp
        return BatchPlan(
            mode="scale_batch", base_global_batch=base, global_batch=global_batch, accumulation_steps=1,
            micro_batch=global_batch, per_device_batch=limit, max_per_device_batch=limit,
            data_parallel_size=dp, lr_scale=_lr_scale(options.lr_scaling, global_batch, base),
            note=f"global batch {base} -> {global_batch} ({limit} per device on {dp} devices)"
            if global_batch != base else "",
        )
    for steps in range(1, options.max_accumulation_steps + 1):
        if base % steps:
            continue
        micro = base // steps
        if micro % dp == 0 and micro // dp <= limit:
            return BatchPlan(
                mode="keep_global_batch", base_global_batch=base, global_batch=base, accumulation_steps=steps,
                micro_batch=micro, per_device_batch=micro // dp, max_per_device_batch=limit,
                data_parallel_size=dp,
                note=f"{steps} microbatches of {micro} keep the global batch {base}" if steps > 1 else "",
            )
    # No exact split: the nearest global batch below the base that does split, learning rate scaled.
    steps = max(1, math.ceil(base / (limit * dp)))
    per_device = max(1, min(limit, base // (steps * dp)))
    micro = per_device * dp
    global_batch = micro * steps
    return BatchPlan(
        mode="keep_global_batch", base_global_batch=base, global_batch=global_batch, accumulation_steps=steps,
        micro_batch=micro, per_device_batch=per_device, max_per_device_batch=limit, data_parallel_size=dp,
        lr_scale=_lr_scale(options.lr_scaling, global_batch, base), exact=False,
        note=f"global batch {base} cannot be split over {dp} devices within {limit} per device and "
        f"{options.max_accumulation_steps} microbatches; using {global_batch} ({steps} x {micro})",
    )


__all__ = ["BATCH_AXES", "data_parallel_size", "describe_batch", "initial_batch", "plan_batch"]
