"""What the elastic runner does between a failed attempt and the next: free everything the old one left.

A recovered process lives on for the whole job, so what a failed attempt leaves behind adds up over
recoveries (freeing memory after an in-process restart is a known complaint about elastic JAX
training). After every elastic event the runner:

- clears JAX's compilation and tracing caches (``jax.clear_caches()``): the executables of the old mesh,
  including the ones compile-ahead made for meshes that did not happen, and every trace that captured the
  old devices. Compile-ahead survives it through the compilation cache (``precompile.ensure_compilation_cache``:
  JAX's persistent cache; on Pathways the runtime's own), so the new mesh's step is not compiled again;
- deletes the arrays the failed attempt created (``jax.live_arrays()`` minus those alive before the first
  attempt) even where something still references them — a training function or a callback that keeps its
  state or metrics would otherwise hold device memory (on the dead slice, or on a live one) into the next
  attempt. The next attempt needs none of them: it restores from storage or from the memory tier, whose
  snapshots are files;

and ``Manager.elastic_retry`` runs the next attempt under ``jax.default_device`` on a device of a live
slice, so nothing without an explicit sharding lands on a dead slice 0.
"""

from __future__ import annotations

import gc
import logging
import weakref
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


def release_failed_attempt(keep: ArraysBefore) -> int:
    """Clear JAX's caches and delete every live array not in ``keep``; returns how many were deleted."""
    gc.collect()  # what nothing references any more goes the ordinary way first
    jax.clear_caches()
    deleted = 0
    for arr in jax.live_arrays():
        if arr in keep:
            continue
        try:
            arr.delete()
            deleted += 1
        except Exception as exc:  # already deleted by its owner meanwhile, or its runtime is gone
            _log.debug("could not delete an array of the failed attempt: %s", exc)
    gc.collect()
    if deleted:
        _log.info("elastic event: %d array(s) of the failed attempt deleted, JAX caches cleared", deleted)
    return deleted


__all__ = ["ArraysBefore", "release_failed_attempt"]
