"""Run and topology identity (docs/protocol.md, "Identity"): every manifest records the job, run, process count
and mesh of its step; a resume of a step saved by another run or another process count is refused with
``409 FOREIGN_CHECKPOINT`` (the one error body) unless the request allows it, and then noted in the plan; a
different mesh is never refused; a step plain Orbax wrote (no identity) stays resumable with a note. The same
rule holds in the server, ``ckptd plan`` and the client's storage fallback (the one planner)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from fastapi.testclient import TestClient
from jax.sharding import Mesh

from ckptd.api._app import create_app
from ckptd.catalog._catalog import Catalog
from ckptd.cli._main import main as ckptd_main
from tests.support.helpers import make_settings
from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings, reset_client_settings
from trainer_client.core import protocol as p
from trainer_client.core._errors import PlanningError
from trainer_client.core._identity import identity_notes
from trainer_client.core._storage import Storage
from trainer_client.core.format._manifest import Manifest, read_manifest, write_manifest
from trainer_client.errors import CkptdRequestError
from trainer_client.runtime.saving import _checkpointing as checkpointing

RUN = "jobset-7f3a"


def _with_identity(step: int, run_id: str | None = RUN, process_count: int | None = 2) -> dict[str, Any]:
    meta = training_metadata(step)
    meta["ckptd"].update({k: v for k, v in (("run_id", run_id), ("process_count", process_count)) if v is not None})
    return meta


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mlp``: steps 10 and 20 saved by run RUN on 2 processes; ``plain``: step 5 by plain Orbax."""
    root = tmp_path_factory.mktemp("identity") / "root"
    write_orbax_jobs({root / "mlp": [10, 20], root / "plain": [5]},
                     custom_metadata={10: _with_identity(10), 20: _with_identity(20)})
    catalog = Catalog(Storage(str(root)), ":memory:")
    catalog.rebuild()  # adopt: the manifests are written now
    return root


def _training(**identity: Any) -> p.TrainingMetadata:
    return p.TrainingMetadata.model_validate({**training_metadata(3)["ckptd"], **identity})


def test_the_rule() -> None:
    saved = _training(run_id="a", process_count=4)
    assert identity_notes(3, saved, p.ResumeRequest(alive_devices=8, run_id="a", process_count=4)) == []
    assert identity_notes(3, saved, p.ResumeRequest(alive_devices=8)) == []  # the request names no one
    with pytest.raises(PlanningError) as refused:
        identity_notes(3, saved, p.ResumeRequest(alive_devices=8, run_id="b"))
    assert refused.value.code is p.ErrorCode.FOREIGN_CHECKPOINT and "run 'a', not by run 'b'" in refused.value.message
    assert "allow_foreign_run" in refused.value.message
    with pytest.raises(PlanningError) as refused:
        identity_notes(3, saved, p.ResumeRequest(alive_devices=8, run_id="a", process_count=2))
    message = refused.value.message
    assert "4 process(es), this run has 2" in message and "allow_foreign_topology" in message
    notes = identity_notes(3, saved, p.ResumeRequest(alive_devices=8, run_id="b", process_count=2,
                                                     allow_foreign_run=True, allow_foreign_topology=True))
    assert len(notes) == 2 and "(allow_foreign_run)" in notes[0] and "(allow_foreign_topology)" in notes[1]
    # what is not recorded is not checked, and said so
    assert "records no run id" in identity_notes(3, _training(), p.ResumeRequest(alive_devices=8, run_id="b"))[0]
    assert "records no run identity" in identity_notes(3, None, p.ResumeRequest(alive_devices=8, run_id="b"))[0]


def test_manifests_record_the_identity_and_older_ones_still_check(root: Path, tmp_path: Path) -> None:
    storage = Storage(str(root))
    manifest = read_manifest(storage, str(root / "mlp" / "20"))
    assert manifest is not None and manifest.identity == p.StepIdentity(
        job="mlp", run_id=RUN, process_count=2, mesh=p.MeshSpec(axis_names=["replica", "data"], shape=[4, 2]))
    plain = read_manifest(storage, str(root / "plain" / "5"))  # adopted: its job, and the mesh of its _sharding
    assert plain is not None and plain.identity == p.StepIdentity(
        job="plain", mesh=p.MeshSpec(axis_names=["replica", "data"], shape=[4, 2]))
    # a manifest of an older ckptd (no identity, training metadata without it) reads and checks as before
    older = Manifest(step=1, writer="adopted", created_at=0.0, files={}, training=_training())
    step = tmp_path / "job" / "1"
    step.mkdir(parents=True)
    written = write_manifest(Storage(str(tmp_path)), str(step), older)
    text = (step / "ckptd_manifest.json").read_text()
    assert '"identity"' not in text and '"run_id"' not in text and '"process_count"' not in text
    assert read_manifest(Storage(str(tmp_path)), str(step)) == written


def test_the_server_refuses_another_run_or_process_count_unless_allowed(root: Path, tmp_path: Path) -> None:
    catalog = Catalog(Storage(str(root)), tmp_path / "c.sqlite3")
    catalog.rebuild()
    with TestClient(create_app(make_settings(root, tmp_path), catalog, background=False)) as server:
        def resume(job: str, **body: Any) -> Any:
            return server.post(p.ROUTE_RESUME.format(job=job), json={"alive_devices": 6, **body})

        same = resume("mlp", run_id=RUN, process_count=2)
        assert same.status_code == 200 and same.json()["step"] == 20, same.text
        assert same.json()["mesh"]["shape"] == [3, 2]  # another mesh: what a resize is, never refused
        other = resume("mlp", run_id="another-run", process_count=2)
        assert other.status_code == 409, other.text
        body = p.ErrorBody.model_validate(other.json())
        assert body.code is p.ErrorCode.FOREIGN_CHECKPOINT and f"run {RUN!r}" in body.message
        allowed = resume("mlp", run_id="another-run", allow_foreign_run=True)
        assert allowed.status_code == 200 and any("(allow_foreign_run)" in n for n in allowed.json()["notes"])
        topology = resume("mlp", run_id=RUN, process_count=1)
        assert topology.status_code == 409 and "allow_foreign_topology" in topology.json()["message"]
        assert resume("mlp", process_count=1, allow_foreign_topology=True).status_code == 200
        plain = resume("plain", run_id="another-run", process_count=1)  # nothing recorded: resumable, noted
        assert plain.status_code == 200 and "records no run identity" in plain.json()["notes"][0]
        bad = resume("mlp", run_id="")
        assert bad.status_code == 422 and bad.json()["code"] == "INVALID_REQUEST"


def test_the_cli_and_the_client_s_fallback_apply_the_same_rule(
    root: Path, tcp_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ckptd_main(["plan", f"{root}/mlp", "--devices", "6", "--json"]) == 0  # the CLI asks as no one
    assert json.loads(capsys.readouterr().out)["step"] == 20
    assert ckptd_main(["plan", f"{root}/mlp", "--devices", "6", "--run-id", "another-run"]) == 1
    assert "ckptd: FOREIGN_CHECKPOINT: step 20 was saved by run" in capsys.readouterr().err
    assert ckptd_main(["plan", f"{root}/mlp", "--devices", "6", "--process-count", "4", "--allow-foreign-topology",
                       "--json"]) == 0
    assert any("(allow_foreign_topology)" in n for n in json.loads(capsys.readouterr().out)["notes"])
    down = ClientSettings(url=f"http://127.0.0.1:{tcp_port}", run_id="another-run", resume_deadline_s=0.5,
                          timeout_s=0.2)
    with CkptdClient(down, root=str(root)) as client:  # ckptd is down: the fallback plans, and refuses alike
        with pytest.raises(CkptdRequestError) as refused:
            client.resume("mlp", p.ResumeRequest(alive_devices=6))
        assert refused.value.code == "FOREIGN_CHECKPOINT" and refused.value.status == 409
        plan = client.resume("mlp", p.ResumeRequest(alive_devices=6, allow_foreign_run=True))
        assert plan.source == "storage_scan" and plan.step == 20
    with CkptdClient(down.model_copy(update={"run_id": RUN}), root=str(root)) as client:
        assert client.resume("mlp", p.ResumeRequest(alive_devices=6)).step == 20


def test_the_trainer_records_its_run_and_process_count(monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2), ("data",))
    monkeypatch.setenv("CKPTD_RUN_ID", RUN)
    reset_client_settings()  # the environment is read once per process: as a new process would read it
    meta = checkpointing.training_metadata(1, {"w": jax.numpy.zeros(4)}, data_position=0, global_batch=2,
                                           mesh=mesh, slices=[0])
    assert (meta.run_id, meta.process_count) == (RUN, jax.process_count())
    monkeypatch.delenv("CKPTD_RUN_ID")
    reset_client_settings()
    assert checkpointing.training_metadata(1, {}, data_position=0, global_batch=2, mesh=mesh, slices=[0]).run_id is None
