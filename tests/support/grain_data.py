"""Grain input pipelines for the tests, the same in every process: the plain-Orbax writers of MaxText-style
steps (tests/support/orbax_steps.py) build them too, so a test can compare what an iterator restored from a
checkpoint gives with what an uninterrupted one gives. Imports grain only (no ckptd, no trainer_client)."""

from __future__ import annotations

from typing import Any

import grain
import grain.python as pygrain
import numpy as np

RECORDS = 100_000  # samples of the synthetic source: record i is the token row of sample i


def _tokens(index: int) -> np.ndarray:
    return (np.arange(8, dtype=np.int32) * 31 + index * 7) % 1000


def data_loader(batch: int = 16, *, seed: int = 0, records: int = RECORDS, tokens: bool = True) -> pygrain.DataLoader:
    """A Grain ``DataLoader`` as MaxText's older pipelines make one: an index sampler shuffling a range
    source, a map to token rows (without ``tokens``: the sample indices themselves) and a batch, no worker
    processes (its iterator's state is Grain's ``DataLoader`` state: ``last_seen_indices`` and the rest, as
    a JSON document)."""
    sampler = pygrain.IndexSampler(records, pygrain.NoSharding(), shuffle=True, num_epochs=1, seed=seed)
    operations = [*([_Tokens()] if tokens else []), pygrain.Batch(batch, drop_remainder=True)]
    return pygrain.DataLoader(data_source=pygrain.RangeDataSource(0, records, 1), sampler=sampler,
                              operations=operations, worker_count=0)


class _Tokens(pygrain.MapTransform):
    def map(self, element: Any) -> np.ndarray:
        return _tokens(int(element))


def dataset(batch: int = 16, *, seed: int = 0, records: int = RECORDS, tokens: bool = True) -> grain.IterDataset:
    """A Grain dataset pipeline (``MapDataset`` shuffled, mapped to token rows unless not ``tokens``,
    batched, made an ``IterDataset``): its iterator is a ``grain.DatasetIterator`` whose state is a dict."""
    ds = grain.MapDataset.range(records).shuffle(seed=seed)
    return (ds.map(_tokens) if tokens else ds).batch(batch, drop_remainder=True).to_iter_dataset()


def elastic(global_batch: int, *, shard_index: int = 0, shard_count: int = 1, seed: int = 0,
            records: int = RECORDS) -> Any:
    """Grain's ``ElasticIterator`` over the same records: its state (the global index of the next sample)
    restores onto any shard count and global batch."""
    from grain.experimental import ElasticIterator

    return ElasticIterator(samples(seed=seed, records=records), global_batch,
                           pygrain.ShardOptions(shard_index, shard_count))


def samples(*, seed: int = 0, records: int = RECORDS) -> grain.MapDataset:
    """The shuffled token rows ``elastic`` batches (``samples()[i]``: the ``i``-th sample it reads)."""
    return grain.MapDataset.range(records).shuffle(seed=seed).map(_tokens)


__all__ = ["RECORDS", "data_loader", "dataset", "elastic", "samples"]
