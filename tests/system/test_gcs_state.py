"""On ``gs://`` (the fake-gcs-server emulator) a step keeps its Grain iterator state (the item ``iter``, written
by Orbax's path layer) and its values that are not arrays, and both come back on a restore planned onto 4 of
8 devices: the next batch is an uninterrupted iterator's, the values are exact."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support import grain_data
from tests.support.gcs_emulator import GcsEmulator
from trainer_client.checkpoint_io._iterator_state import ITER_ITEM
from trainer_client.core import protocol as p
from trainer_client.core._step_plan import plan_for_step
from trainer_client.core._storage import Storage, join_path
from trainer_client.runtime.saving._checkpointing import Checkpointer, restore
from trainer_client.runtime.saving._data_iterator import restore_iterator, state_record


def test_grain_state_and_values_round_trip_on_gcs(gcs_emulator: GcsEmulator) -> None:
    mesh = jax.make_mesh((4, 2), ("replica", "data"))
    state = {"w": jax.device_put(np.arange(32, dtype=np.float32).reshape(4, 8), NamedSharding(mesh, P(None, "data"))),
             "run": "gcs-run", "epoch": 2, "lr": np.float32(0.5)}
    it = iter(grain_data.data_loader(8))
    for _ in range(5):
        next(it)
    job = gcs_emulator.gs("state-root", "job")
    checkpointer = Checkpointer(job)
    try:
        checkpointer.save(5, state, data_position=40, global_batch=8, mesh=mesh, slices=[0],
                          data_iterator=state_record(it))
    finally:
        checkpointer.close()
    storage = Storage(gcs_emulator.gs("state-root"))
    step = storage.join("job", "5")
    assert storage.exists(join_path(step, ITER_ITEM, "process_0-of-1.json"))
    plan = plan_for_step(storage, step, p.ResumeRequest(alive_devices=4), job="job", step=5)
    small = jax.make_mesh((2, 2), ("replica", "data"), devices=jax.devices()[:4])
    target = {"w": jax.ShapeDtypeStruct((4, 8), np.float32, sharding=NamedSharding(small, P(None, "data"))),
              "run": "", "epoch": 0, "lr": np.float32(0)}
    restored = restore(plan.path, target)
    assert np.array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))
    assert (restored["run"], restored["epoch"], restored["lr"]) == ("gcs-run", 2, np.float32(0.5))
    assert type(restored["lr"]) is np.float32
    fresh = iter(grain_data.data_loader(8))
    assert restore_iterator(plan, fresh)
    assert np.array_equal(next(fresh), next(it))
