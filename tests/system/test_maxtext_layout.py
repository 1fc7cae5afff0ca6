"""Steps MaxText writes (``<run>/checkpoints/<step>/items/...`` and Grain's ``iter``; written here by plain
Orbax in another process exactly as MaxText's checkpointing does: tests/support/orbax_steps.py) are
listed, validated quick and deep, planned onto fewer devices (6 of 8) with the plan naming the item and its
arrays, and restored exactly by trainer_client onto the plan's mesh. A step with several array items (and a
JSON one) is planned and restored item by item."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from fastapi.testclient import TestClient
from jax.sharding import Mesh, NamedSharding

from ckptd.api._app import create_app
from ckptd.catalog._catalog import Catalog
from ckptd.cli._main import main as ckptd_main
from tests.support.helpers import make_settings, tree_from_leaf_names
from tests.support.orbax_steps import MAXTEXT_MESH_AXES, write_maxtext_jobs, write_multi_item_steps
from trainer_client.core import protocol as p
from trainer_client.core._step_plan import plan_for_step
from trainer_client.core._storage import Storage
from trainer_client.core._validation import latest_good_on_storage, validate_step
from trainer_client.core.format._array_index import decode_all_arrays
from trainer_client.runtime.saving._checkpointing import restore, spec_from_json

STEPS = (100, 200)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(ckptd's root: MaxText's ``<base_output_directory>/<run_name>``, the saved values by step and leaf);
    the job is MaxText's ``checkpoints`` directory."""
    base = tmp_path_factory.mktemp("maxtext")
    write_maxtext_jobs({base / "run" / "checkpoints": STEPS}, values=base / "values.npz")
    return base / "run", base / "values.npz"


def test_a_maxtext_job_is_listed_and_validated_quick_and_deep(
    run: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    shutil.copytree(run[0], root)
    assert ckptd_main(["show", f"{root}/checkpoints", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(c["step"], c["state"]) for c in listed] == [(s, "verified") for s in STEPS]
    storage = Storage(str(root))
    for step in STEPS:
        assert validate_step(storage, str(root / "checkpoints" / str(step)), "quick").ok
    # deep: every byte against the manifest, and every array of the item "items" decoded
    assert decode_all_arrays(root / "checkpoints" / "200") == []
    assert ckptd_main(["validate", f"{root}/checkpoints", "--deep", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bad"] == 0 and all(r["level"] == "deep" and r["ok"] for r in report["steps"]), report
    # a damaged array of "items" is found by decoding it (no manifest involved)
    data = sorted((root / "checkpoints" / "200" / "items").rglob("d/*"), key=lambda f: f.stat().st_size)[-1]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    problems = decode_all_arrays(root / "checkpoints" / "200")
    assert problems and all("/items/" in problem for problem in problems), problems


def test_a_maxtext_step_is_planned_onto_6_of_8_devices_and_restored_exactly(
    run: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, values_file = run
    catalog = Catalog(Storage(str(root)), tmp_path / "catalog.sqlite3")
    catalog.rebuild()
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    with TestClient(create_app(make_settings(root, tmp_path, shm_dir=str(shm)), catalog, background=False)) as server:
        assert server.get(p.ROUTE_LATEST_GOOD.format(job="checkpoints")).json()["step"] == 200
        answer = server.post(p.ROUTE_RESUME.format(job="checkpoints"), json={"alive_devices": 6})
    assert answer.status_code == 200, answer.text
    plan = p.ResumePlan.model_validate_json(answer.content)
    values = np.load(values_file)
    saved = {name.split("/", 1)[1]: values[name] for name in values.files if name.startswith("200/")}
    assert plan.step == 200 and plan.items == {"items": sorted(saved)}
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.shape, strict=True))
    assert tuple(plan.mesh.axis_names) == MAXTEXT_MESH_AXES and (sizes["fsdp"], sizes["tensor"]) == (3, 2)
    assert plan.idle_devices == 0 and not any("not in the mesh" in note for note in plan.notes), plan.notes
    embedding = plan.arrays["params.params.token_embedder.embedding"]
    assert embedding.shape == [256, 48] and not embedding.changed
    assert embedding.partition_spec[1] == ["fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert"]
    assert ckptd_main(["plan", f"{root}/checkpoints", "--devices", "6"]) == 0  # the CLI names the item
    assert f"items          items ({len(saved)} arrays)" in capsys.readouterr().out.splitlines()
    # the client's storage fallback finds the step and its items
    found = latest_good_on_storage(Storage(str(root)), str(root / "checkpoints"))
    assert found is not None and found.step == 200 and found.item_names == ("items", "iter")

    mesh = Mesh(np.array(jax.devices()[:6]).reshape(plan.mesh.shape), tuple(plan.mesh.axis_names))
    target = tree_from_leaf_names({name: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(
        mesh, spec_from_json(plan.arrays[name].partition_spec))) for name, value in saved.items()})
    restored = restore(plan.path, target)
    flat = jax.tree_util.tree_flatten_with_path(restored)[0]
    assert len(flat) == len(saved)
    for path, leaf in flat:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        assert leaf.sharding.mesh.devices.shape == tuple(plan.mesh.shape), name
        assert leaf.dtype == saved[name].dtype and np.array_equal(np.asarray(leaf), saved[name]), name


def test_a_step_with_several_array_items_is_planned_and_restored_per_item(tmp_path: Path) -> None:
    """``params`` and ``opt_state`` (Orbax's standard handler) and ``extra`` (JSON): the plan names both
    array items and their arrays as ``<item>.<leaf>``; a restore takes a target with one tree per item."""
    write_multi_item_steps(tmp_path / "root" / "job", [5], tmp_path / "values.npz")
    storage = Storage(str(tmp_path / "root"))
    plan = plan_for_step(storage, str(tmp_path / "root" / "job" / "5"), p.ResumeRequest(alive_devices=6),
                         job="job", step=5)
    values = np.load(tmp_path / "values.npz")
    saved = {name.split("/", 1)[1]: values[name] for name in values.files}
    assert plan.items == {"params": ["params.b", "params.w"], "opt_state": ["opt_state.count", "opt_state.mu.w"]}
    assert set(plan.arrays) == set(saved) and plan.mesh.shape == [3, 2]
    mesh = Mesh(np.array(jax.devices()[:6]).reshape(3, 2), ("data", "model"))
    dtypes = {name: spec.dtype for name, spec in plan.arrays.items()}
    target = tree_from_leaf_names({name: jax.ShapeDtypeStruct(value.shape, dtypes[name], sharding=NamedSharding(
        mesh, spec_from_json(plan.arrays[name].partition_spec))) for name, value in saved.items()})
    restored = restore(plan.path, target)
    assert set(restored) == {"params", "opt_state"}
    for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        assert leaf.sharding.mesh.devices.shape == (3, 2), name
        assert str(leaf.dtype) == dtypes[name] and np.array_equal(np.asarray(leaf).astype(saved[name].dtype),
                                                                  saved[name]), name
