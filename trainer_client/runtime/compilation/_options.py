"""Compilation's options: ``CompilationOptions``, the group ``compilation`` of ``ElasticConfig``
(trainer_client/runtime/elastic/_elastic_config.py), read by the runner's compile-ahead (``_precompile``).

jax-free: the config reads it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompilationOptions:
    """Compiled steps kept across an elastic event, and compiled ahead for the next meshes."""

    # JAX's persistent compilation cache (shared with relaunches); unset: a private one under the temp dir,
    # unless one is configured already (it carries compiled steps across the cache clear after an event)
    compilation_cache_dir: str | None = None
    precompile: bool = True  # compile the likely next meshes in the background (needs ctx.set_precompile)


__all__ = ["CompilationOptions"]
