"""Steps saved by a bare Orbax ``Checkpointer`` (``StandardCheckpointer``, ``PyTreeCheckpointer``, with or
without OCDBT), one directory per step named as the user likes (``100``, ``checkpoint_200``), written by
plain Orbax in another process (tests/support/bare_orbax_steps.py): catalogued, validated quick and deep,
planned onto fewer devices (the plan names the step directory itself as the item, ``""``) and restored
exactly by trainer_client onto the plan's mesh. An unfinished save (tmp name, or no commit marker) is never
served, and a directory that only looks like a step by its name is neither a step nor deleted."""

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
from tests.support.bare_orbax_steps import write_bare_steps
from tests.support.helpers import make_settings, tree_from_leaf_names
from tests.support.server import app_over
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core import protocol as p
from trainer_client.core._errors import ArrayIndexError
from trainer_client.core._step_plan import plan_for_step
from trainer_client.core._storage import Storage
from trainer_client.core._validation import latest_good_on_storage
from trainer_client.core.format._array_index import decode_all_arrays
from trainer_client.core.format._files import COMMIT_MARKER, ROOT_ITEM
from trainer_client.runtime.saving._checkpointing import restore, spec_from_json

ARRAYS = ["opt.mu", "params.b", "params.w"]
# job -> [(step directory name, checkpointer kind, step)]
JOBS = {
    "std": [("100", "standard", 100), ("200", "standard", 200)],
    "named": [("checkpoint_100", "pytree", 100), ("checkpoint_200", "pytree", 200)],
    "zarr": [("0100", "pytree_no_ocdbt", 100), ("0200", "pytree_no_ocdbt", 200)],
}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a root with the three jobs as plain Orbax left them, the saved values)."""
    base = tmp_path_factory.mktemp("bare")
    saves = [(base / "root" / job / name, kind, step) for job, steps in JOBS.items() for name, kind, step in steps]
    write_bare_steps(saves, values=base / "values.npz")
    return base / "root", base / "values.npz"


@pytest.fixture()
def root(written: tuple[Path, Path], tmp_path: Path) -> Path:
    """A copy of the root to change, with what a user's directory also holds: a save cut short (a tmp
    name; a final name without its commit marker) and a directory of their own named like a step."""
    copy = tmp_path / "root"
    shutil.copytree(written[0], copy)
    shutil.copytree(copy / "named" / "checkpoint_200", copy / "named" / "checkpoint_300.orbax-checkpoint-tmp-17")
    shutil.copytree(copy / "std" / "200", copy / "std" / "300")
    (copy / "std" / "300" / COMMIT_MARKER).unlink()
    (copy / "named" / "data_1").mkdir()
    (copy / "named" / "data_1" / "notes.txt").write_text("not a checkpoint")
    return copy


def test_bare_steps_are_listed_with_their_own_names_and_unfinished_saves_are_never_served(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ckptd_main(["show", f"{root}/named", "--json"]) == 0
    listed = {Path(c["path"]).name: (c["step"], c["state"]) for c in json.loads(capsys.readouterr().out)}
    assert listed == {"checkpoint_100": (100, "verified"), "checkpoint_200": (200, "verified"),
                      "checkpoint_300.orbax-checkpoint-tmp-17": (300, "writing")}  # data_1 is not a step
    assert ckptd_main(["show", f"{root}/std", "--json"]) == 0
    states = {c["step"]: c["state"] for c in json.loads(capsys.readouterr().out)}
    assert states == {100: "verified", 200: "verified", 300: "writing"}  # 300: no commit marker
    catalog = Catalog(Storage(str(root)), tmp_path / "catalog.sqlite3")
    catalog.rebuild()
    with TestClient(create_app(make_settings(root, tmp_path), catalog, background=False)) as server:
        for job in JOBS:
            good = server.get(p.ROUTE_LATEST_GOOD.format(job=job))
            assert good.status_code == 200 and good.json()["step"] == 200, (job, good.text)
        refused = server.post(p.ROUTE_RESUME.format(job="named"), json={"alive_devices": 8, "step": 300})
        assert refused.status_code == 409 and refused.json()["code"] == "STEP_NOT_GOOD", refused.text
    for job in JOBS:  # the client's fallback applies the same rule
        found = latest_good_on_storage(Storage(str(root)), str(root / job))
        assert found is not None and found.step == 200 and found.item_names == (ROOT_ITEM,), job
    # retention cleans nothing that is not an Orbax step, and keeps a save in progress
    assert ckptd_main(["gc", f"{root}/named", "--keep-last", "1", "--json"]) == 0
    decisions = {Path(d["path"]).name: d["action"] for d in json.loads(capsys.readouterr().out)}
    assert decisions == {"checkpoint_100": "delete", "checkpoint_200": "keep",
                         "checkpoint_300.orbax-checkpoint-tmp-17": "keep"}
    assert (root / "named" / "data_1" / "notes.txt").is_file() and not (root / "named" / "checkpoint_100").exists()


def test_bare_steps_are_validated_quick_and_deep(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for job in JOBS:
        assert ckptd_main(["validate", f"{root}/{job}", "--deep", "--json"]) == 0  # finalized steps only
        report = json.loads(capsys.readouterr().out)
        assert [(r["step"], r["ok"], r["level"]) for r in report["steps"]] == [(100, True, "deep"), (200, True, "deep")]
        assert decode_all_arrays(root / job / dict((s, n) for n, _, s in JOBS[job])[200]) == []
    # a damaged array is found by decoding it, in an OCDBT database (the merged tree: these small arrays are
    # stored in its nodes) and in a plain zarr directory
    for job, pattern in (("std", "d/*"), ("zarr", "params.w/*")):
        step_dir = root / job / dict((s, n) for n, _, s in JOBS[job])[200]
        data = sorted((f for f in step_dir.glob(pattern) if f.is_file() and f.name != ".zarray"),
                      key=lambda f: f.stat().st_size)[-1]
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        try:  # the array cannot be decoded, or the database that holds it cannot be read
            assert decode_all_arrays(step_dir), job
        except ArrayIndexError as exc:
            assert "200" in str(exc), exc
        assert ckptd_main(["validate", f"{root}/{job}", "200", "--deep", "--json"]) == 1
        report = json.loads(capsys.readouterr().out)
        assert report["steps"][0]["state"] == "quarantined", report


@pytest.mark.parametrize("job", sorted(JOBS))
def test_a_bare_step_is_planned_onto_6_of_8_devices_and_restored_exactly(
    job: str, written: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, values_file = written
    name = dict((s, n) for n, _, s in JOBS[job])[200]
    storage = Storage(str(root))
    plan = plan_for_step(storage, str(root / job / name), p.ResumeRequest(alive_devices=6), job=job, step=200)
    assert plan.items == {ROOT_ITEM: ARRAYS} and sorted(plan.arrays) == ARRAYS
    assert plan.mesh == p.MeshSpec(axis_names=["replica", "data"], shape=[3, 2]) and plan.idle_devices == 0
    assert plan.arrays["params.w"].partition_spec == [None, "data"] and plan.arrays["params.w"].shape == [8, 8]
    assert plan.arrays["opt.mu"].dtype == "bfloat16" and not any(a.changed for a in plan.arrays.values())
    assert any("records no run identity" in note for note in plan.notes), plan.notes
    assert ckptd_main(["plan", f"{root}/{job}", "--devices", "6"]) == 0
    assert "items          (the step directory) (3 arrays)" in capsys.readouterr().out.splitlines()
    # one planner: the server, `ckptd plan --json` and the client's storage fallback give the same plan
    assert ckptd_main(["plan", f"{root}/{job}", "--devices", "6", "--json"]) == 0
    cli = p.ResumePlan.model_validate_json(capsys.readouterr().out)
    with TestClient(app_over(root, tmp_path)) as server:
        served = p.ResumePlan.model_validate_json(server.post(p.ROUTE_RESUME.format(job=job),
                                                              json={"alive_devices": 6}).content)
    with CkptdClient(ClientSettings(url="http://127.0.0.1:9"), root=str(root)) as client:
        fallback = client.resume_from_storage(job, p.ResumeRequest(alive_devices=6))
    assert served == cli == plan == fallback.model_copy(update={"source": "ckptd"})

    values = np.load(values_file)
    mesh = Mesh(np.array(jax.devices()[:6]).reshape(3, 2), ("replica", "data"))
    target = tree_from_leaf_names({a: jax.ShapeDtypeStruct(tuple(plan.arrays[a].shape or ()), plan.arrays[a].dtype,
                                            sharding=NamedSharding(mesh, spec_from_json(plan.arrays[a].partition_spec)))
                    for a in ARRAYS})
    restored = restore(plan.path, target)
    for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
        leaf_name = ".".join(str(getattr(k, "key", k)) for k in path)
        assert leaf.sharding.mesh.devices.shape == (3, 2), leaf_name
        assert np.array_equal(np.asarray(leaf).astype(np.float32), values[f"200/{leaf_name}"]), leaf_name


def test_two_names_of_one_step_are_resolved_alike_by_every_reader(root: Path, tmp_path: Path) -> None:
    """``200`` and ``step_200`` in one job (a copy, a second naming scheme): the server, the catalog's step
    lookup and the client's fallback all name the same directory, the first by name."""
    shutil.copytree(root / "std" / "200", root / "std" / "step_200")
    catalog = Catalog(Storage(str(root)), ":memory:")
    catalog.rebuild()
    good = catalog.confirmed_latest_good("std")
    assert good is not None and good.path == str(root / "std" / "200")
    assert catalog.step("std", 200).path == good.path  # type: ignore[union-attr]
    found = latest_good_on_storage(Storage(str(root)), str(root / "std"))
    assert found is not None and found.path == good.path
