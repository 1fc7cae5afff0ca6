"""The Orbax writer: how a training state becomes a step in Orbax's layout, jax-bound, shared by both sides.

The trainer runtime saves through it (``checkpointer.Checkpointer``) and ckptd's persist worker child writes
memory snapshots and multi-host parts through it (``checkpointer``, ``part_writer``); nothing else of ckptd
imports it, and it imports nothing of ``trainer_client.runtime`` (docs/architecture.md, the package map).

``checkpointer``     the Checkpointer: Orbax's CheckpointManager with ckptd's metadata and manifest
``handlers``         the standard handler's settings (zstd, string leaves, data file size)
``state_tree``       leaves that are not arrays, as Orbax saves and restores them
``iterator_state``   a data iterator's state as the item ``iter`` in Grain's format, and its handler
``part_writer``      one host's part of a multi-process step and the commit from the parts (docs/multihost.md)

What a step records names stable identifiers, never a module path of these packages: the iterator handler's
Orbax type string is ``ckptd.IteratorStateHandler`` (``iterator_state``), and the module path earlier releases
recorded is still read.

Its public face: the names below, what the persist worker imports; each is imported from its private module on
first use (``trainer_client/core/_faces.py``), so importing this package loads neither jax nor Orbax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer_client.core._faces import exported, lazy_face

if TYPE_CHECKING:  # the real types for type checkers (``X as X``: re-exported); at run time, on first use
    from trainer_client.checkpoint_io._checkpointer import Checkpointer as Checkpointer
    from trainer_client.checkpoint_io._checkpointer import spec_from_json as spec_from_json
    from trainer_client.checkpoint_io._part_writer import commit_parts as commit_parts
    from trainer_client.checkpoint_io._part_writer import write_part as write_part

_EXPORTS = {
    "trainer_client.checkpoint_io._checkpointer": ("Checkpointer", "spec_from_json"),
    "trainer_client.checkpoint_io._part_writer": ("commit_parts", "write_part"),
}

__all__ = exported(_EXPORTS)

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
