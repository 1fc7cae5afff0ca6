"""What a save costs the training loop: the device-to-host copy and Orbax's start of an asynchronous save,
never a compile (issue: a save blocked the loop for seconds after every elastic event)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from examples.elastic_mlp import init_state, partition_specs
from trainer_client.runtime.saving._checkpointing import Checkpointer, training_metadata

pytestmark = pytest.mark.needs_devices(8)

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax.monitoring: one per XLA compile


def test_the_first_save_on_a_new_mesh_compiles_nothing(tmp_path: Path) -> None:
    # a fresh mesh shape (2 x 4): nothing this process compiled before matches its shards
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("replica", "data"))
    specs = partition_specs(jax.eval_shape(init_state))
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    state: Any = jax.jit(lambda: init_state(7), out_shardings=shardings)()
    jax.block_until_ready(state)
    checkpointer = Checkpointer(str(tmp_path / "job"))
    meta = training_metadata(5, state, data_position=0, global_batch=48, mesh=mesh, slices=[0, 1])
    compiles: list[float] = []

    def count(event: str, seconds: float, **_: Any) -> None:
        if event == BACKEND_COMPILE:
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        checkpointer.save_with_metadata(5, state, meta)
        # Orbax's replica-parallel write used to compile a slice per replicated array here, in the loop
        assert compiles == [], f"{len(compiles)} compiles ({sum(compiles):.2f}s) while the loop waited"
        checkpointer.wait()
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
        checkpointer.close()
    assert (tmp_path / "job" / "5").is_dir()
