"""One planner, one answer: ``ckptd plan``, the server's ``POST /resume`` and the client's storage fallback
give the same plan for the same step and devices, for every kind of step (docs/architecture.md, "One
planner"): written by the trainer's Checkpointer, persisted from a memory snapshot by ckptd's persist worker,
written by plain Orbax in another process, and written the way MaxText does (item ``items``, Grain's ``iter``).

The plans are compared as the bytes each one serialises to; only ``source`` says where a plan was made
(``ckptd`` or ``storage_scan``), so the fallback's is set to ``ckptd`` before comparing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from fastapi.testclient import TestClient
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ckptd.api._app import create_app
from ckptd.catalog._catalog import Catalog
from ckptd.cli._main import main as ckptd_main
from examples.elastic_mlp import init_state, partition_specs
from tests.support.helpers import make_settings
from tests.support.orbax_steps import MAXTEXT_MESH_AXES, write_maxtext_jobs, write_orbax_steps
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core import protocol as p
from trainer_client.core._storage import Storage
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.saving._checkpointing import Checkpointer, training_metadata

DEVICES = (8, 6, 3)


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("replica", "data"))


def _state(mesh: Mesh) -> Any:
    specs = partition_specs(jax.eval_shape(init_state))
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    return jax.jit(lambda: init_state(4), out_shardings=shardings)()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """trainer/30: saved by trainer_client's Checkpointer (trainer_items/35: as the item ``items``);
    persisted/40: a memory snapshot persisted by
    ckptd's persist worker; plain/50: plain Orbax in another process; maxtext/100: MaxText's layout."""
    from ckptd.persist._persist_worker import persist

    root = tmp_path_factory.mktemp("one-planner")
    mesh = _mesh()
    state = _state(mesh)
    checkpointer = Checkpointer(str(root / "trainer"))
    checkpointer.save(30, state, data_position=30 * 48, global_batch=48, mesh=mesh, slices=[0, 1, 2, 3])
    checkpointer.close()
    named = Checkpointer(str(root / "trainer_items"), item="items")  # MaxText's item name for the state
    named.save(35, state, data_position=35 * 48, global_batch=48, mesh=mesh, slices=[0, 1, 2, 3])
    named.close()
    meta = training_metadata(40, state, data_position=40 * 48, global_batch=48, mesh=mesh, slices=[0, 1, 2, 3])
    snapshot = MemoryTier(str(tmp_path_factory.mktemp("shm")), "persisted").save(40, state, meta, persist=True)
    persist(snapshot, str(root / "persisted"))
    write_orbax_steps(root / "plain", [50])
    write_maxtext_jobs({root / "maxtext": [100]})
    return root


def _cli(root: Path, job: str, devices: int, capsys: pytest.CaptureFixture[str]) -> p.ResumePlan:
    capsys.readouterr()
    assert ckptd_main(["plan", f"{root}/{job}", "--devices", str(devices), "--json"]) == 0
    return p.ResumePlan.model_validate_json(capsys.readouterr().out)


def _fallback(root: Path, job: str, devices: int, shm: Path) -> p.ResumePlan:
    client = CkptdClient(ClientSettings(url="http://127.0.0.1:9", shm_dir=str(shm)), root=str(root))
    try:
        plan = client.resume_from_storage(job, p.ResumeRequest(alive_devices=devices))
    finally:
        client.close()
    assert plan.source == "storage_scan"
    return plan.model_copy(update={"source": "ckptd"})


@pytest.mark.parametrize("job", ["trainer", "trainer_items", "persisted", "plain", "maxtext"])
def test_the_cli_the_server_and_the_fallback_give_the_same_plan(
    root: Path, job: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    catalog = Catalog(Storage(str(root)), tmp_path / "catalog.sqlite3")
    catalog.rebuild()
    app = create_app(make_settings(root, tmp_path, shm_dir=str(shm)), catalog, background=False)
    with TestClient(app) as server:
        for devices in DEVICES:
            answer = server.post(p.ROUTE_RESUME.format(job=job), json={"alive_devices": devices})
            assert answer.status_code == 200, answer.text
            served = p.ResumePlan.model_validate_json(answer.content)
            cli = _cli(root, job, devices, capsys)
            fallback = _fallback(root, job, devices, shm)
            assert served.model_dump_json() == cli.model_dump_json() == fallback.model_dump_json(), (
                f"{job} on {devices} devices:\nserver   {served.model_dump_json()}\ncli      "
                f"{cli.model_dump_json()}\nfallback {fallback.model_dump_json()}")
            # the answer keeps the saved shardings (here: on the trainer's mesh axes) wherever they divide
            axes = MAXTEXT_MESH_AXES if job == "maxtext" else ("replica", "data")
            assert served.saved_mesh is not None and tuple(served.saved_mesh.axis_names) == axes
            assert not any("not in the mesh" in note for note in served.notes), served.notes
            # the plan names the item the arrays are in, as the step records it
            # (absent when it is ``default``, as older ckptd sent it)
            assert list(served.items or {"default": []}) == [
                "items" if job in ("trainer_items", "maxtext") else "default"]
            assert any(spec.partition_spec and any(spec.partition_spec) for spec in served.arrays.values())
            json.loads(answer.content)  # the bytes served are the plan's JSON
