"""Saving's options: ``SaveOptions``, the group ``saving`` of ``ElasticConfig``
(trainer_client/runtime/elastic/_elastic_config.py): how each save to storage is written.

jax-free: the config reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class SaveOptions:
    """How each save to storage is written."""

    # a periodic save while the previous save to storage is still being written: waits for it (Orbax's way),
    # or is skipped so the loop never waits (fewer checkpoints when saves take longer than checkpoint_period)
    when_save_busy: Literal["wait", "skip"] = "wait"
    checkpoint_item: str = "default"  # the Orbax item of the state in each step (MaxText's steps: "items")
    async_save: bool = True  # Orbax writes in the background (MaxText's async_checkpointing); False: blocking


__all__ = ["SaveOptions"]
