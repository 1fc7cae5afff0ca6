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

- once the next attempt has completed its first step (``collect_failed_attempt``), collects the failed
  attempt's Python objects and gives the host memory freed by all this back to the OS (glibc's
  ``malloc_trim``): the allocator otherwise keeps freed pages, and the RSS of a process that recovered many
  times creeps up in steps that are free memory, not live data (the recovery soak measured +76 MiB over 16
  trials untrimmed, +11 MiB trimmed). Not before: during the event the exception's traceback still holds the
  failed attempt's frames, so a collection there frees little of it and costs the recovery a full garbage
  collection of the process (the largest part of the time from the failure to the first step on the demo
  model); after the first step those frames are gone and the collection frees them. Until then every object
  alive at the event is kept out of the collector's scans (``hold_collection``: ``gc.freeze``), so that an
  automatic full collection set off by the restore's allocations does not scan the whole process in the
  recovery's place. The device memory does not wait for any of this: the arrays were deleted before the next
  attempt began;

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
    tier's held snapshot, which the next attempt may restore from); returns how many were deleted. Every live
    array is deleted whether or not something still references it, so no garbage collection is needed first;
    the failed attempt's Python objects are collected later (``collect_failed_attempt``)."""
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
    if deleted:
        _log.info("elastic event: %d array(s) of the failed attempt deleted, JAX caches cleared", deleted)
    return deleted


def hold_collection(held: bool) -> bool:
    """Keep the garbage collector off every object alive now until ``collect_failed_attempt`` (``gc.freeze``):
    an automatic full collection, which allocations during the restore and the first step set off, then scans
    only what the next attempt creates, not the whole process (JAX, the model, the failed attempt's frames).
    ``held``: this runner froze them already (an event before the last one's first step). Nothing when the
    collector is off or something else froze objects (that freeze is not ours to undo). True when held."""
    if not held and (not gc.isenabled() or gc.get_freeze_count()):
        return False
    gc.freeze()
    return True


def collect_failed_attempt(held: bool) -> int:
    """Collect what the failed attempt left to the garbage collector (its frames, once the exception that held
    them is gone) and give the freed host memory back to the OS; ``held``: ``hold_collection`` froze the
    objects, given back to the collector first. Returns what ``gc.collect`` found."""
    if held:
        gc.unfreeze()
    found = gc.collect()
    give_back_host_memory()
    return found


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


__all__ = ["ArraysBefore", "collect_failed_attempt", "give_back_host_memory", "hold_collection",
           "release_failed_attempt"]
