"""A save of a step another process committed since the ``Checkpointer`` was opened leaves that step as it was, on
``gs://`` (the fake-gcs-server emulator) and on a local disk (docs/gcs.md, "Fencing on gs://").

Orbax's manager knows the steps it listed when it was opened, and those it saved; for any other step its save
first removes what stands at the step's name (on ``gs://`` the commit-file path's create, locally ``force``), then
writes the step again in place. A second writer of the same job (a dead incarnation's late save, a second persist
of one snapshot) would so delete a committed step and write it anew. Before the check on storage this test failed:
every object of step 5 was rewritten (other generations), its values the second writer's."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support.gcs_emulator import GcsEmulator
from trainer_client import Checkpointer
from trainer_client.core._generations import listed_generations
from trainer_client.core._storage import Storage, join_path
from trainer_client.core.format._files import COMMIT_MARKER


def _save(checkpointer: Checkpointer, value: float) -> None:
    mesh = jax.make_mesh((4, 2), ("replica", "data"))
    state = {"w": jax.device_put(np.full((4, 8), value, np.float32), NamedSharding(mesh, P(None, "data")))}
    try:
        checkpointer.save(5, state, data_position=40, global_batch=8, mesh=mesh, slices=[0])
    finally:
        checkpointer.close()


def _stored(storage: Storage, step_dir: str) -> dict[str, object]:
    """Every object (gs://: its generation) or file (its inode and mtime) of a step, as storage has it now."""
    if storage.is_remote:
        return {name: obj.generation for name, obj in listed_generations(storage, step_dir).items()}
    return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for p in Path(step_dir).rglob("*") if p.is_file()}


@pytest.mark.parametrize("where", ["gcs", "local"])
def test_a_save_over_a_step_committed_since_the_checkpointer_opened_leaves_it_whole(
        where: str, gcs_emulator: GcsEmulator, tmp_path: Path) -> None:
    job = gcs_emulator.gs("resave-root", "job") if where == "gcs" else str(tmp_path / "job")
    if where == "local":
        os.makedirs(job)
    late = Checkpointer(job)  # opened first: its manager lists no step 5
    _save(Checkpointer(job), 1.0)  # another writer commits step 5
    storage = Storage(job)
    step_dir = storage.join("5")
    before = _stored(storage, step_dir)
    assert join_path(str(storage.fs._strip_protocol(step_dir)), COMMIT_MARKER) in before

    _save(late, 2.0)  # the late writer saves step 5 again

    assert late.saved_steps == []
    assert _stored(storage, step_dir) == before, "the committed step was deleted and written again"
