"""The runner's surface: ``ElasticConfig``'s option groups, one ``ClientSettings`` for the whole run, and a
preemption that a training function's ``except CkptdError`` cannot swallow.

No sidecar: the client points at a port nothing listens on, and saves go to storage through Orbax.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core._errors import CkptdError
from trainer_client.core._storage import Storage
from trainer_client.core.format._manifest import read_manifest
from trainer_client.runtime.compilation._options import CompilationOptions
from trainer_client.runtime.elastic import _elastic_context as elastic_context
from trainer_client.runtime.elastic._elastic import ElasticConfig, ElasticContext, ElasticRunner
from trainer_client.runtime.elastic._elastic_config import ElasticOptions, HealthOptions
from trainer_client.runtime.elastic._elastic_context import Preempted
from trainer_client.runtime.memory._options import MemoryTierOptions
from trainer_client.runtime.saving._options import SaveOptions
from trainer_client.runtime.slices._slices import SimulatedSlices

MESH: dict[str, Any] = {"job": "job", "mesh_axes": ("replica", "data"), "mesh_shape": (4, 2), "global_batch": 8}

# every option of the flat ElasticConfig that came before, with its default then; but checkpoint_period, whose
# default (None) is now the autopilot's to choose, every 10 steps until it does and without it
FLAT_DEFAULTS: dict[str, Any] = {
    "checkpoint_period": None, "elastic_timeout_s": 300.0, "elastic_max_retries": 10, "policy": "resize",
    "spare_slices": 0, "batch_mode": "keep_global_batch", "lr_scaling": "linear", "device_memory_bytes": None,
    "memory_headroom_bytes": 0, "poll_interval_s": 0.25, "scale_up_check_interval_s": 1.0,
    "monitor_interval_s": 1.0, "min_slices": 1, "shm_dir": None, "memory_period": None, "max_snapshots": 2,
    "preallocate_snapshots": True, "compilation_cache_dir": None, "precompile": True, "when_save_busy": "wait",
    "checkpoint_item": "default", "async_save": True,
}


def test_config_has_at_most_thirteen_fields_and_every_old_option_keeps_its_default() -> None:
    config = ElasticConfig(**MESH)
    top = dataclasses.fields(ElasticConfig)
    assert len(top) <= 13  # the mesh and batch (4), the persistent period, and one group per concern (8)
    found: dict[str, Any] = {}
    for f in top:
        value: Any = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            with pytest.raises(dataclasses.FrozenInstanceError):  # each group is frozen
                setattr(value, dataclasses.fields(value)[0].name, None)
            found.update({g.name: getattr(value, g.name) for g in dataclasses.fields(value)})
        else:
            found[f.name] = value
    assert {k: found[k] for k in FLAT_DEFAULTS} == FLAT_DEFAULTS


@pytest.mark.parametrize(("flat", "spelling"), [
    ("shm_dir", "shm_dir is now MemoryTierOptions.shm_dir: ElasticConfig(memory_tier=MemoryTierOptions(shm_dir=...))"),
    ("policy", "policy is now ElasticOptions.policy: ElasticConfig(elastic=ElasticOptions(policy=...))"),
    ("async_save", "async_save is now SaveOptions.async_save: ElasticConfig(saving=SaveOptions(async_save=...))"),
])
def test_an_old_flat_keyword_is_refused_with_its_new_spelling(flat: str, spelling: str) -> None:
    with pytest.raises(TypeError) as refused:
        ElasticConfig(**MESH, **{flat: FLAT_DEFAULTS[flat]})
    assert spelling in str(refused.value)
    assert "is_now" not in str(refused.value)
    with pytest.raises(TypeError, match="not_an_option"):  # an unknown keyword is refused as always
        ElasticConfig(**MESH, not_an_option=1)  # type: ignore[call-arg]


def test_the_groups_given_are_the_ones_the_config_holds() -> None:
    tier = MemoryTierOptions(shm_dir="/dev/shm/x", memory_period=5)
    config = ElasticConfig(**MESH, elastic=ElasticOptions(policy="pause"), memory_tier=tier,
                           compilation=CompilationOptions(precompile=False), saving=SaveOptions(async_save=False))
    assert (config.elastic.policy, config.memory_tier.memory_period, config.compilation.precompile,
            config.saving.async_save, config.health) == ("pause", 5, False, False, HealthOptions())
    assert dataclasses.replace(config, checkpoint_period=3).memory_tier is tier


def test_the_attempts_context_does_not_import_the_runner() -> None:
    """elastic imports elastic_context, never the other way (not even for type checking), and the context takes
    no runner: it is handed the parts of the run it uses (``AttemptParts``) and its hooks as plain callables
    (``AttemptHooks``), and reaches through no ``runner``."""
    tree = ast.parse(inspect.getsource(elastic_context))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "trainer_client.runtime.elastic._elastic" not in imported
    reached = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
               and (node.attr == "runner" or ast.unparse(node.value).endswith("runner"))]
    assert reached == [], f"the context reaches through a runner: {reached}"
    assert not hasattr(elastic_context, "AttemptRunner")
    taken = list(inspect.signature(ElasticContext).parameters)
    assert taken[:2] == ["parts", "hooks"] and not [name for name in taken if "runner" in name]


def _values(value: Any) -> list[Any]:
    """``value`` with what its frozen dataclasses hold, one level down."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [value, *(getattr(value, f.name) for f in dataclasses.fields(value))]
    return [value]


def _runner(tmp_path: Path, settings: ClientSettings, **options: Any) -> ElasticRunner:
    config = ElasticConfig(**MESH, compilation=CompilationOptions(precompile=False), **options)
    client = CkptdClient(settings, root=str(tmp_path))
    return ElasticRunner(config, slices=SimulatedSlices(num_slices=4), client=client,
                         checkpoint_dir=str(tmp_path / "job"))


def _loop(ctx: ElasticContext, until: int, guard: type[BaseException] | None = None) -> str:
    state, step, position = ctx.restore_or_init(lambda: {"w": jnp.zeros((8, 4))}, lambda a: {"w": P("data")})
    add = jax.jit(lambda s: {"w": s["w"] + 1})
    while step < until:
        # what a training function may well do around its step: except CkptdError (or Exception): pass
        with contextlib.suppress(*(() if guard is None else (guard,))):
            ctx.step_boundary(step, state, position)
        state, step, position = add(state), step + 1, position + 8
    return "finished"


class _NothingSaved:
    """A multi-controller job's resume agreement that finds no step (the runner's preemptible path)."""

    def plan(self, request: Any) -> None:
        return None


@pytest.mark.parametrize("guard", [CkptdError, Exception])
@pytest.mark.needs_devices(8)
def test_a_preemption_is_not_swallowed_by_the_training_functions_except(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, guard: type[BaseException]
) -> None:
    assert not issubclass(Preempted, CkptdError) and not issubclass(Preempted, Exception)
    runner = _runner(tmp_path, ClientSettings(url="http://127.0.0.1:9", report_events=False))
    runner.agreement = _NothingSaved()  # type: ignore[assignment]
    monkeypatch.setattr(elastic_context, "preemption_reached", lambda step: step == 5)
    try:
        result = runner.run(lambda ctx: _loop(ctx, 20, guard))
    finally:
        runner.checkpointer.close()
    assert result.preempted and result.final_step == 5 and result.value is None
    assert [e.step for e in result.events if e.kind == "preempted"] == [5]
    assert (tmp_path / "job" / "5").is_dir()


@pytest.mark.needs_devices(8)
def test_a_run_id_given_in_code_is_recorded_with_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTD_RUN_ID", raising=False)
    settings = ClientSettings(url="http://127.0.0.1:9", report_events=False, run_id="run-in-code")
    runner = _runner(tmp_path, settings, checkpoint_period=5)
    try:
        runner.run(lambda ctx: _loop(ctx, 7))
    finally:
        runner.checkpointer.close()
    storage = Storage(str(tmp_path))
    manifest = read_manifest(storage, storage.join("job", "5"))
    assert manifest is not None and manifest.identity is not None and manifest.training is not None
    assert manifest.identity.run_id == "run-in-code" and manifest.training.run_id == "run-in-code"


@pytest.mark.needs_devices(8)
def test_the_attempts_context_holds_the_runs_parts_not_the_runner(tmp_path: Path) -> None:
    """A real attempt's context: none of its attributes (nor what its parts hold) is the runner; its parts are
    the runner's own, and the attempt's events still reach the runner through the hooks."""
    runner = _runner(tmp_path, ClientSettings(url="http://127.0.0.1:9", report_events=False))
    seen: list[ElasticContext] = []

    def train(ctx: ElasticContext) -> str:
        seen.append(ctx)
        return _loop(ctx, 2)

    try:
        runner.run(train)
    finally:
        runner.checkpointer.close()
    (ctx,) = seen
    held = [value for attribute in vars(ctx).values() for value in _values(attribute)]
    assert not [value for value in held if isinstance(value, ElasticRunner)]
    parts = next(value for value in held if isinstance(value, elastic_context.AttemptParts))
    assert (parts.config, parts.saver, parts.replicas, parts.precompiler, parts.autopilot, parts.agreement,
            parts.slices) == (runner.config, runner.saver, runner.replicas, runner.precompiler, runner.autopilot,
                              runner.agreement, runner.slices)
    hooks = next(value for value in held if isinstance(value, elastic_context.AttemptHooks))
    assert all(callable(getattr(hooks, f.name)) for f in dataclasses.fields(hooks))
    assert [e.kind for e in runner.events if e.kind in {"initialized", "first_step_done", "finished"}] == [
        "initialized", "first_step_done", "finished"]
