"""The key-value store of a multi-controller JAX job, and the job incarnation published through it.

``jax.distributed``'s coordination service (run by process 0) holds a key-value store every process of the
job reaches (``jax._src.distributed.global_state.client``, jaxlib's ``DistributedRuntimeClient``; what works
in jax 0.10.2 is in docs/multihost.md). It starts empty with every incarnation of the job (it dies with
process 0), so keys never go stale across restarts. The resume agreement (``runtime/multihost.py``) and
the memory tier's save ids (``runtime/memory_tier.py``) use it; one module, so neither imports the other.
"""

from __future__ import annotations

import secrets
from typing import Protocol

import jax

INCARNATION_KEY = "ckptd/incarnation"
INCARNATION_TIMEOUT_MS = 120_000  # process 0 may start its tier this much later than the others


class KeyValueStore(Protocol):
    """What ``jax._src.distributed.global_state.client`` offers (the part used here)."""

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None: ...

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...


def job_store() -> KeyValueStore:
    """The coordination service's key-value store of this JAX job (``jax.distributed.initialize`` first)."""
    from jax._src import distributed  # the one place its client is exposed (jax 0.10.2: docs/multihost.md)

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized: no coordination service to agree through")
    return client


_incarnations: dict[int, str] = {}  # per store (one per jax.distributed start): its incarnation


def job_incarnation(store: KeyValueStore | None = None) -> str:
    """This incarnation of the job: 16 hex digits process 0 draws and publishes (create-only), every other
    process reads (waiting up to ``INCARNATION_TIMEOUT_MS`` for process 0). The same in every process of one
    incarnation, different after every restart of the job."""
    store = job_store() if store is None else store
    known = _incarnations.get(id(store))
    if known is None:
        if jax.process_index() == 0:
            known = secrets.token_hex(8)
            store.key_value_set(INCARNATION_KEY, known)
        else:
            known = store.blocking_key_value_get(INCARNATION_KEY, INCARNATION_TIMEOUT_MS)
        _incarnations[id(store)] = known
    return known


__all__ = ["KeyValueStore", "job_incarnation", "job_store"]
