"""Compile the likely next meshes ahead of time, so an elastic event does not compile on the critical path.

Recovery after a slice failure is dominated by re-tracing and recompiling the training step for the new
mesh. While training runs on a mesh, a background thread asks the user's ``precompile(mesh, batch)``
hook to lower and compile the step for the meshes an elastic event would lead to next: the full mesh
again when running degraded (the regrow), with hot spares the same mesh with a spare in place of each slice
that could be lost, then every mesh with one slice fewer (one per slice that could be lost).

What the hook returns (``jit(step).lower(...).compile()``, a ``jax.stages.Compiled``) is kept per exact mesh
(axis names, shape and the devices in order: ``mesh_key``) as a ``Precompiled``. At an elastic event the runner
drops every one that uses a lost slice before it clears JAX's caches (docs/architecture.md), and hands the one
built for exactly the new attempt's mesh to it (``ElasticContext.precompiled``), dropping the rest: the first
step on the new mesh runs that executable, with no trace, no lowering and no compile. A hook that returns
nothing still helps through the compilation cache, which outlives the cache clear: JAX's persistent cache
(``compilation_cache_dir``, or a private default, ``ensure_compilation_cache``), or Pathways' own; the first
step then traces and lowers again and loads its executable from there.

The hook is the user's because only the training code knows its step function and input layouts (see
``examples/elastic_mlp.py``). A failing compile is logged and skipped: precompiling is an optimisation.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from trainer_client.core._batching import plan_batch
from trainer_client.core._errors import UnsafePathError
from trainer_client.core._planner import plan_mesh
from trainer_client.core.format._private_files import ensure_private_dir
from trainer_client.core.protocol import BatchOptions, BatchPlan, MeshSpec
from trainer_client.errors import PlanningError
from trainer_client.runtime.elastic._fault_classification import pathwaysutils_says_slice_down

_log = logging.getLogger(__name__)

PrecompileHook = Callable[[Mesh, BatchPlan], object]  # returns what it compiled (kept for the mesh), or None
MeshKey = tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]


def mesh_key(mesh: Mesh) -> MeshKey:
    """What makes an executable fit a mesh: its axis names, its shape and its devices, in order."""
    return tuple(str(a) for a in mesh.axis_names), tuple(int(n) for n in mesh.devices.shape), tuple(
        int(d.id) for d in mesh.devices.flat)


@dataclass(frozen=True)
class Precompiled:
    """What the precompile hook returned for one mesh (e.g. a ``jax.stages.Compiled``), with what it was built
    for: the mesh (``key``: axis names, shape, devices in order), the slices it uses and the batch plan the hook
    was given. ``ElasticContext.precompiled`` hands it to the attempt whose mesh is exactly that mesh."""

    executable: object
    key: MeshKey
    slices: frozenset[int]
    batch: BatchPlan

    def fits(self, mesh: Mesh) -> bool:
        """Built for exactly ``mesh`` (the same devices in the same order, the same shape and axis names)."""
        return self.key == mesh_key(mesh)


def enable_persistent_cache(directory: str) -> None:
    """Turn on JAX's persistent compilation cache in ``directory`` for every compiled program."""
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def default_cache_dir() -> Path:
    """This user's private compilation cache: ``<tmp>/ckptd-<uid>/jax-compilation-cache``."""
    return Path(tempfile.gettempdir()) / f"ckptd-{os.geteuid()}" / "jax-compilation-cache"


def ensure_compilation_cache() -> str | None:
    """Make compiled executables outlive ``jax.clear_caches()`` (which the runner calls after every elastic
    event, docs/architecture.md): JAX's persistent compilation cache, in ``default_cache_dir()`` (private:
    0700, refused when another user owns it — a cache is loaded as code) unless one is configured. Nothing
    when JAX's cache is off, as ``pathwaysutils.initialize()`` sets it on Pathways, which keeps compiled
    programs itself. Returns the directory in use."""
    if not jax.config.jax_enable_compilation_cache:  # type: ignore[attr-defined]
        return None
    configured = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
    if configured:
        return str(configured)
    directory = default_cache_dir()
    try:
        ensure_private_dir(directory)
    except (OSError, UnsafePathError) as exc:
        _log.warning("no compilation cache (%s): after an elastic event the new mesh's step is compiled again",
                     exc)
        return None
    enable_persistent_cache(str(directory))
    return str(directory)


def build_mesh(
    spec: MeshSpec, slice_order: Sequence[int], slice_to_devices: Mapping[int, Sequence[jax.Device]]
) -> Mesh:
    """Devices of the given slices, slice by slice, reshaped to ``spec``."""
    devices = [d for k in slice_order for d in slice_to_devices[k]]
    if len(devices) < spec.size:
        raise ValueError(f"the mesh needs {spec.size} devices, {len(devices)} are in those slices")
    grid = np.array(devices[: spec.size], dtype=object).reshape(spec.shape)
    return Mesh(grid, tuple(spec.axis_names))


def likely_next(
    current: MeshSpec,
    active: frozenset[int],
    slice_to_devices: Mapping[int, Sequence[jax.Device]],
    mesh_slices: int | None = None,
) -> list[tuple[MeshSpec, list[int]]]:
    """(mesh, slices) an elastic event most likely leads to: the regrow first (to ``mesh_slices`` slices, default
    all), then a spare (the first idle slice) in place of each slice in use when the allocation has spares,
    then one slice fewer."""
    everything = sorted(slice_to_devices)
    width = len(everything) if mesh_slices is None else mesh_slices
    idle = [k for k in everything if k not in active]
    options: list[list[int]] = []
    if len(active) < width and idle:
        options.append(sorted(set(active) | set(idle[: width - len(active)])))
    if width < len(everything) and len(active) == width and idle:
        options += [sorted((active - {lost}) | {idle[0]}) for lost in sorted(active)]
    options += [sorted(active - {lost}) for lost in sorted(active) if len(active) > 1]
    out = []
    for slices in options:
        alive = sum(len(slice_to_devices[k]) for k in slices)
        try:
            spec = plan_mesh(current, {}, alive, "resize").mesh
        except PlanningError:
            continue
        out.append((spec, slices))
    return out


class _Pass:
    """One attempt's background compile pass: its thread and its own stop flag."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


class Precompiler:
    """Runs the precompile hook for the likely next meshes in a daemon thread (one pass per attempt).

    Whatever a compile does — raise (a slice lost under it raises ``DATA_LOSS`` inside the compile), or
    never return — it happens in that thread: it is logged (``failed``) and never reaches the training
    loop. A pass that is still busy when an elastic event stops it is abandoned, not waited for: the next
    attempt's pass starts at once in a thread of its own, and what the abandoned one compiles is not kept.
    What the hook returns is kept per exact mesh until the event: ``forget`` drops those on the lost slices
    before the cache clear, then ``claim`` hands over the new mesh's and drops the rest."""

    def __init__(self, join_timeout_s: float = 60.0, mesh_slices: int | None = None) -> None:
        self.mesh_slices = mesh_slices  # slices a whole mesh uses (fewer than the allocation's: hot spares)
        self._done: set[MeshKey] = set()
        self._kept: dict[MeshKey, Precompiled] = {}  # what the hook returned, per exact mesh
        self._lock = threading.Lock()  # _kept and the passes' stop flags
        self._current: _Pass | None = None
        self._passes: list[_Pass] = []
        self._clear = threading.Event()  # set: no save is in progress, compiling may go on
        self._clear.set()
        self.join_timeout_s = join_timeout_s
        self.compiled: list[tuple[list[int], float]] = []  # (mesh shape, seconds)
        self.failed: list[tuple[list[int], str]] = []  # (mesh shape, error)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """While a save is in progress: start no new mesh (tracing one holds the GIL for long stretches, and
        a save's many short Python steps would each queue behind it; measured: a 70 ms save took 7-15 s)."""
        self._clear.clear()
        try:
            yield
        finally:
            self._clear.set()

    def start(
        self,
        hook: PrecompileHook,
        current: MeshSpec,
        active: frozenset[int],
        slice_to_devices: Mapping[int, Sequence[jax.Device]],
        batch: BatchPlan,
        options: BatchOptions,
    ) -> None:
        if self._current is not None and self._current.alive() and not self._current.stop.is_set():
            return
        targets = likely_next(current, active, slice_to_devices, self.mesh_slices)
        run = _Pass()
        run.thread = threading.Thread(
            target=self._run, args=(run, hook, targets, slice_to_devices, batch, options),
            name="ckptd-precompile", daemon=True,
        )
        self._current = run
        self._passes = [p for p in self._passes if p.alive()] + [run]
        run.thread.start()

    def _run(
        self,
        run: _Pass,
        hook: PrecompileHook,
        targets: list[tuple[MeshSpec, list[int]]],
        slice_to_devices: Mapping[int, Sequence[jax.Device]],
        batch: BatchPlan,
        options: BatchOptions,
    ) -> None:
        for spec, slices in targets:
            while not self._clear.wait(0.05):  # a save is in progress
                if run.stop.is_set():
                    return
            if run.stop.is_set():
                return
            mesh = build_mesh(spec, slices, slice_to_devices)
            key = mesh_key(mesh)
            if key in self._done:
                continue
            started = time.perf_counter()
            planned = plan_batch(batch, spec, options)
            try:
                executable = hook(mesh, planned)
            except Exception as exc:  # an optimisation only: never let it hurt training
                # a slice lost under the compile is part of the elastic event the runner reports: not a warning
                level = logging.INFO if pathwaysutils_says_slice_down(exc) else logging.WARNING
                _log.log(level, "precompiling for mesh %s failed: %s", spec.shape, exc)
                self.failed.append((list(spec.shape), f"{type(exc).__name__}: {exc}"))
                continue
            with self._lock:
                if run.stop.is_set():  # compiled for an attempt that is over: dropped, not kept past the event
                    return
                self._done.add(key)
                if executable is not None:
                    self._kept[key] = Precompiled(executable, key, frozenset(slices), planned)
            self.compiled.append((list(spec.shape), time.perf_counter() - started))

    def wait(self, timeout: float | None = None) -> None:
        """Block until the current pass is done (tests; benchmarks)."""
        if self._current is not None and self._current.thread is not None:
            self._current.thread.join(timeout)

    def forget(self, lost: Set[int] = frozenset()) -> None:
        """At an elastic event, before JAX's in-memory caches are cleared: compile every mesh again when asked,
        and drop every kept executable that uses a slice in ``lost`` (it can never run again; the clear frees
        it). The others wait for ``claim``, which hands over the new mesh's."""
        self._done.clear()
        with self._lock:
            self._kept = {k: p for k, p in self._kept.items() if not p.slices & lost}

    def claim(self, mesh: Mesh) -> Precompiled | None:
        """The executable built for exactly ``mesh`` (None when there is none), handed over once; every other
        kept executable is dropped with it, so the next attempt holds only what it runs."""
        with self._lock:
            found = self._kept.pop(mesh_key(mesh), None)
            self._kept.clear()
        return found

    def release(self) -> None:
        """Drop every kept executable (the end of the run)."""
        with self._lock:
            self._kept.clear()

    def kept(self) -> list[Precompiled]:
        """The executables kept now (tests; diagnostics)."""
        with self._lock:
            return list(self._kept.values())

    def stop(self, wait: bool = False) -> None:
        """Stop every pass; with ``wait``, wait for their compiles in flight (XLA aborts the process if the
        interpreter exits while one runs), at most ``join_timeout_s`` in all: a compile that hangs (a dead
        slice under it) is abandoned with an error line rather than hang the process."""
        with self._lock:  # a compile that finishes after this keeps nothing
            for run in self._passes:
                run.stop.set()
        if not wait:
            return
        deadline = time.monotonic() + self.join_timeout_s
        for run in self._passes:
            if run.thread is not None:
                run.thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [p for p in self._passes if p.alive()]
        if stuck:
            _log.error("%d background compile(s) still running after %.0fs: not waiting for them",
                       len(stuck), self.join_timeout_s)
        self._passes = stuck


__all__ = [
    "MeshKey", "PrecompileHook", "Precompiled", "Precompiler", "build_mesh", "default_cache_dir",
    "enable_persistent_cache", "ensure_compilation_cache", "likely_next", "mesh_key",
]
