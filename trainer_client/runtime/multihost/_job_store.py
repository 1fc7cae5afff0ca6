"""The key-value store of a multi-controller JAX job, and the job incarnation published through it.

``jax.distributed``'s coordination service (run by process 0) holds a key-value store every process of the
job reaches (``jax._src.distributed.global_state.client``, jaxlib's ``DistributedRuntimeClient``; what works
in jax 0.10.2 is in docs/multihost.md). It starts empty with every incarnation of the job (it dies with
process 0), so keys never go stale across restarts. The resume agreement (``runtime/multihost/_multihost.py``), a
save's route (``runtime/saving/_save_route.py``) and the autopilot's periods (``runtime/autopilot``) agree through
it, each a ``JobProcess``, and the memory tier's save ids (``runtime/memory/_memory_tier.py``) come from it; one
module, so none of them imports another.

``initialize_multihost`` joins a trainer process to its job the way ckptd's recovery needs: a short heartbeat
timeout (jax's default of 100 s leaves a dead host unnoticed that long before the others abort and the job
restarts) and JAX's preemption service on, which turns SIGTERM into a preemption notice the elastic loop
answers at an agreed step (``ElasticContext.step_boundary``).
"""

from __future__ import annotations

import secrets
from typing import Protocol

import jax

from trainer_client.config import ClientSettings, client_settings

INCARNATION_KEY = "ckptd/incarnation"
INCARNATION_TIMEOUT_MS = 120_000  # process 0 may start its tier this much later than the others


class KeyValueStore(Protocol):
    """What ``jax._src.distributed.global_state.client`` offers (the part used here)."""

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None: ...

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]: ...  # every (key, value) under ``key/``

    def key_value_delete(self, key: str) -> None: ...  # ``key`` and every key under ``key/`` (none: nothing)


def initialize_multihost(coordinator_address: str, num_processes: int, process_id: int, *,
                         heartbeat_timeout_s: int | None = None, initialization_timeout_s: int = 300,
                         cpu_collectives: str | None = "gloo", settings: ClientSettings | None = None) -> None:
    """``jax.distributed.initialize`` for one process of a multi-controller job, with the heartbeat timeout of
    ``heartbeat_timeout_s`` (default: the ``heartbeat_timeout_s`` of ``settings``, the process's
    ``ClientSettings``; none given: ``CKPTD_HEARTBEAT_TIMEOUT_S``, 10 s) and the preemption service on (a
    SIGTERM is a preemption notice: ``ElasticRunner`` saves at the agreed step and stops; docs/multihost.md,
    section 2). ``cpu_collectives``: the CPU backend's collectives (gloo; None leaves jax's choice)."""
    if heartbeat_timeout_s is None:
        heartbeat_timeout_s = (settings or client_settings()).heartbeat_timeout_s
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.config.update("jax_enable_preemption_service", True)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=initialization_timeout_s,
                               heartbeat_timeout_seconds=int(heartbeat_timeout_s))


def preemption_reached(step: int) -> bool:
    """Whether every process of this job has reached the step at which to save and stop after a preemption
    notice (a SIGTERM to any of them): ``multihost_utils.reached_preemption_sync_point``, False when the job
    has no preemption service (not ``jax.distributed``, or the service off)."""
    from jax._src import distributed
    from jax.experimental import multihost_utils

    if distributed.global_state.preemption_sync_manager is None:
        return False
    return bool(multihost_utils.reached_preemption_sync_point(step))


def job_store() -> KeyValueStore:
    """The coordination service's key-value store of this JAX job (``jax.distributed.initialize`` first)."""
    from jax._src import distributed  # the one place its client is exposed (jax 0.10.2: docs/multihost.md)

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized: no coordination service to agree through")
    return client


class JobProcess:
    """One process's end of an agreement among the ``process_count`` processes of a job (the resume step, a save's
    route, the autopilot's periods): its index, the job's store (``job_store()``, looked up when first used, unless
    one is given: a test's) and ``timeout_ms``, the wait for another process's word (the ``route_timeout_s`` of
    ``settings``, or of this process's settings, unless given)."""

    def __init__(self, process_index: int, process_count: int, *, store: KeyValueStore | None = None,
                 timeout_ms: int | None = None, settings: ClientSettings | None = None) -> None:
        if not 0 <= process_index < process_count:
            raise ValueError(f"process {process_index} of {process_count}")
        self.index = process_index
        self.count = process_count
        self._store = store
        if timeout_ms is None:
            timeout_ms = max(1, round((settings or client_settings()).route_timeout_s * 1000))
        self.timeout_ms = timeout_ms

    @property
    def store(self) -> KeyValueStore:
        if self._store is None:
            self._store = job_store()
        return self._store


# The store of the job's current jax.distributed start and its incarnation. Held by the store itself, not its
# id(): a restart's new store could be given a freed one's id, and would then read the old incarnation.
_incarnation: tuple[KeyValueStore, str] | None = None


def job_incarnation(store: KeyValueStore | None = None) -> str:
    """This incarnation of the job: 16 hex digits process 0 draws and publishes (create-only), every other
    process reads (waiting up to ``INCARNATION_TIMEOUT_MS`` for process 0). The same in every process of one
    incarnation, different after every restart of the job."""
    global _incarnation
    store = job_store() if store is None else store
    if _incarnation is not None and _incarnation[0] is store:
        return _incarnation[1]
    if jax.process_index() == 0:
        known = secrets.token_hex(8)
        store.key_value_set(INCARNATION_KEY, known)
    else:
        known = store.blocking_key_value_get(INCARNATION_KEY, INCARNATION_TIMEOUT_MS)
    _incarnation = (store, known)
    return known


__all__ = ["JobProcess", "KeyValueStore", "initialize_multihost", "job_incarnation", "job_store", "preemption_reached"]
