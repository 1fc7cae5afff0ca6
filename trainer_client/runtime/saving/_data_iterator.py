"""A data iterator's state saved with every step, as Grain checkpoints it: the Orbax item ``iter``.

A Grain ``DataLoaderIterator`` or ``DatasetIterator`` (``grain.DatasetIterator``, the iterator of a
``MapDataset``/``IterDataset``, Grain's ``experimental.ElasticIterator``) — or any iterator with the same
``get_state()``/``set_state()`` protocol — says where it is with ``get_state()``: a JSON document (bytes, for
a ``DataLoaderIterator``) or a dict of JSON data. Grain's Orbax handler (``grain.checkpoint.CheckpointHandler``,
``grain.python.PyGrainCheckpointHandler``; MaxText's ``GrainCheckpointHandler`` subclasses it) writes it into
the step's item ``iter`` as ``process_<index>-of-<count>.json`` (one file per JAX process, each the state of
that process's iterator, ``json.dumps(state, indent=4)``), so MaxText's ``<step>/items`` + ``<step>/iter``.

ckptd does the same, through its own handler of the item (``trainer_client.checkpoint_io._iterator_state``,
the file format and the reader, shared with ckptd's persist worker): the state is taken at the step boundary
(``state_record``, as data: nothing is ever pickled), travels with the step — into Orbax directly, or into
a memory snapshot's ``snapshot.json`` from which ckptd's persist worker writes the same ``iter`` item — and
on resume ``restore_iterator`` gives it back to the iterator with ``set_state`` (read from the snapshot or
from ``<step>/iter``, as untrusted input: bounded, parsed as JSON only). A step Grain's own handler wrote
(MaxText's) restores the same way, and Grain's handler restores a step ckptd wrote.

What the state means on a resize: it is per process. An elastic event in ckptd keeps the processes (the
same PID, fewer devices), so each process gets its own state back; with ``batch_mode="keep_global_batch"``
the global batch stays and the iterator's next batch is exactly the one that would have come. A resize
that changes the global batch (``scale_batch``) needs an iterator that can change its batch size from a
state: Grain's ``ElasticIterator`` (its state is the global index of the next sample,
``global_next_index``), rebuilt with the new batch size. A step saved by a different number of processes
has no file for this one: refused (ckptd's planner refuses another process count unless asked,
docs/protocol.md), as Grain's handler refuses it; MaxText's one shared ``process_0.json`` (its
``ElasticIterator`` layout) is read by every process.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol

import jax

from trainer_client.checkpoint_io._iterator_state import ITER_ITEM, read_step_state, state_text
from trainer_client.core._storage import Storage, join_path
from trainer_client.core.format._snapshot import DataIteratorRecord, read_meta
from trainer_client.core.protocol import ResumePlan, Tier

_log = logging.getLogger(__name__)

class DataIterator(Protocol):
    """What ckptd needs of a data iterator (Grain's ``DataLoaderIterator`` and ``DatasetIterator`` have it)."""

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


def state_record(iterator: DataIterator) -> DataIteratorRecord:
    """The iterator's state now, as data, for this JAX process."""
    state = iterator.get_state()
    if isinstance(state, bytes | bytearray):  # a DataLoaderIterator: a JSON document as bytes
        state = json.loads(bytes(state).decode())
    return DataIteratorRecord(process_index=jax.process_index(), process_count=jax.process_count(), state=state)


def set_iterator_state(iterator: DataIterator, state: Any) -> None:
    """Give ``iterator`` the state ``state`` (JSON data) in the form its ``set_state`` takes: a document as
    bytes for an iterator whose ``get_state`` gives bytes (Grain's ``DataLoaderIterator``), else the data."""
    if isinstance(iterator.get_state(), bytes | bytearray):
        iterator.set_state(state_text(state).encode())
    else:
        iterator.set_state(state)


def planned_state(plan: ResumePlan) -> DataIteratorRecord | None:
    """The iterator state saved with the plan's step, for this process: from the memory snapshot, or from the
    step's ``iter`` item on storage; None when the step has none."""
    index, count = jax.process_index(), jax.process_count()
    if plan.tier == Tier.MEMORY:
        record = read_meta(Path(plan.path)).data_iterator
        if record is not None and (record.process_index, record.process_count) != (index, count):
            raise ValueError(f"the snapshot {plan.path} holds the iterator state of process {record.process_index} "
                             f"of {record.process_count}, not of process {index} of {count}")
        return record
    item = join_path(plan.path, ITER_ITEM)
    record = read_step_state(item, index, count)
    if record is None and Storage(item).exists(Storage(item).root):
        raise ValueError(f"{item} has no iterator state for process {index} of {count} (saved by another "
                         "number of processes?)")
    return record


def restore_iterator(plan: ResumePlan, iterator: DataIterator, record: DataIteratorRecord | None = None) -> bool:
    """Set ``iterator`` to the state saved with the plan's step (``record``: that state, read already);
    False (iterator untouched, a warning) when the step saved none (a step written without an iterator: the
    data restarts where the iterator is)."""
    record = record if record is not None else planned_state(plan)
    if record is None:
        _log.warning("step %s (%s) holds no data iterator state: the iterator is left where it is", plan.step,
                     plan.path)
        return False
    set_iterator_state(iterator, record.state)
    return True


__all__ = [
    "DataIterator",
    "planned_state",
    "restore_iterator",
    "set_iterator_state",
    "state_record",
]
