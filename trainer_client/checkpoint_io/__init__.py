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
"""
