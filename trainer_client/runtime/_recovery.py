"""What the elastic runner does between a failed attempt and the next: free everything the old one left.

A recovered process lives on for the whole job, so what a failed attempt leaves behind adds up over
recoveries (freeing memory after an in-process restart is a known complaint about elastic JAX
training). After every elastic event the runner:

- clears JAX's compilation and tracing caches (``jax.clear_caches()``): the executables of the old mesh and
  every trace that captured the old devices. Compile-ahead's executables that use a lost slice are dropped
  just before (``Precompiler.forget``), so the clear frees them; the one built for exactly the new mesh is
  handed to the next attempt (``ElasticContext.precompiled``: its first step runs with no trace) and every
  other one is dropped when that mesh is built (``Precompiler.claim``). A step the hook did not return is
  found in the compilation cache (``precompile.ensure_compilation_cache``: JAX's persistent cache; on
  Pathways the runtime's own): it is traced and lowered again, not compiled;
- deletes the arrays the failed attempt created (``jax.live_arrays()`` minus those alive before the first
  attempt, and minus the replica tier's held snapshot in host memory, which the next attempt may restore
  from) even where something still references them — a training function or a callback that keeps its
  state or metrics would otherwise hold device memory (on the dead slice, or on a live one) into the next
  attempt. The next attempt needs none of them: it restores from storage or from the memory tier, whose
  snapshots are files;

- gives the host memory freed by all this back to the OS (glibc's ``malloc_trim``): the allocator otherwise
  keeps freed pages, and the RSS of a process that recovered many times creeps up in steps that are free
  memory, not live data (the recovery soak measured +76 MiB over 16 trials untrimmed, +11 MiB trimmed);

and ``Manager.elastic_retry`` runs the next attempt under ``jax.default_device`` on a device of a live
slice, so nothing without an explicit sharding lands on a dead slice 0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import weakref
from collections.abc import Iterable
from typing import Any

import jax

_log = logging.getLogger(__name__)


class ArraysBefore:
    """The arrays alive before the first attempt (the caller's own: kept across events), weakly held."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[Any]] = {id(a): weakref.ref(a) for a in jax.live_arrays()}

    def __contains__(self, arr: object) -> bool:
        ref = self._refs.get(id(arr))
        return ref is not None and ref() is arr


def release_failed_attempt(keep: ArraysBefore, also_keep: Iterable[jax.Array] = ()) -> int:
    """Clear JAX's caches and delete every live array not in ``keep`` nor in ``also_keep`` (the replica
    tier's held snapshot, which the next attempt may restore from); returns how many were deleted."""
    gc.collect()  # what nothing references any more goes the ordinary way first
    jax.clear_caches()
    kept = {id(a) for a in also_keep}
    deleted = 0
    for arr in jax.live_arrays():
        if arr in keep or id(arr) in kept:
            continue
        try:
            arr.delete()
            deleted += 1
        except Exception as exc:  # already deleted by its owner meanwhile, or its runtime is gone
            _log.debug("could not delete an array of the failed attempt: %s", exc)
    gc.collect()
    give_back_host_memory()
    if deleted:
        _log.info("elastic event: %d array(s) of the failed attempt deleted, JAX caches cleared", deleted)
    return deleted


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def give_back_host_memory() -> bool:
    """Return the heap pages the allocator holds free to the OS (glibc ``malloc_trim(0)``); False where the C
    library has no such call (musl, macOS): nothing to do there."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


__all__ = ["ArraysBefore", "give_back_host_memory", "release_failed_attempt"]
