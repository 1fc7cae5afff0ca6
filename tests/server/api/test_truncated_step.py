"""A verified step damaged behind ckptd's back is never named (docs/concepts.md, "Good"): before ``latest-good``
or a resume plan names a step, the size of every file its manifest lists is checked on storage, however
recently the step was verified (``revalidate_after_s`` only spaces out the full quick validation). ckptd's
answer and the client's storage-only answer agree. Real server, real Orbax steps.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.golden import copy_root, golden_fixture
from tests.support.orbax_steps import write_orbax_jobs
from tests.support.server import StartServer
from trainer_client.core import protocol as p
from trainer_client.core._storage import Storage
from trainer_client.core._validation import latest_good_on_storage, read_quarantine
from trainer_client.core.format._manifest import read_manifest

golden_root = golden_fixture(lambda root: write_orbax_jobs({root / "train": [10, 20]}), name="golden_root")

_RESUME = {"alive_devices": 8}


def _damage(step: Path, how: str) -> str:
    """Truncate (to half), grow (one byte) or delete the largest data file (OCDBT's ``d/``: array bytes, what a
    structural look at the step does not read) that the step's manifest lists; its name."""
    manifest = read_manifest(Storage(str(step.parent.parent)), str(step))
    assert manifest is not None, "the step was verified against a manifest"
    data = {rel: entry for rel, entry in manifest.expected_files().items() if "/d/" in rel}
    rel, entry = max(data.items(), key=lambda kv: kv[1].size)
    target = step / rel
    assert target.stat().st_size == entry.size > 1
    if how == "truncate":
        with open(target, "r+b") as f:
            f.truncate(entry.size // 2)
    elif how == "grow":
        with open(target, "ab") as f:
            f.write(b"\0")
    else:
        target.unlink()
    return rel


def _good_step(http: httpx.Client) -> int:
    response = http.get("/v1/jobs/train/checkpoints/latest-good")
    assert response.status_code == 200, response.text
    return int(response.json()["step"])


@pytest.mark.parametrize("how", ["truncate", "grow", "delete"])
def test_a_file_damaged_right_after_verification_is_never_named(golden_root: Path, tmp_path: Path,
                                                                ckptd_server: StartServer, how: str) -> None:
    """Step 20 verified and just named (its last check seconds old, the next full one an hour away); a file
    of it truncated, grown or deleted: latest-good and the resume plan name step 10 at once, step 20 is
    quarantined saying which file, and the storage-only answer says 10 too."""
    root = copy_root(golden_root, tmp_path)
    server = ckptd_server(root, revalidate_after_s=3600.0)
    with server.client() as http:
        assert _good_step(http) == 20
        plan = http.post("/v1/jobs/train/resume", json=_RESUME)
        assert plan.status_code == 200, plan.text
        assert p.ResumePlan.model_validate(plan.json()).step == 20
        rel = _damage(root / "train" / "20", how)
        assert _good_step(http) == 10
        plan = http.post("/v1/jobs/train/resume", json=_RESUME)
        assert plan.status_code == 200, plan.text
        assert p.ResumePlan.model_validate(plan.json()).step == 10
        [twenty] = [c for c in http.get("/v1/jobs/train/checkpoints").json()["checkpoints"] if c["step"] == 20]
    assert twenty["state"] == "quarantined" and rel in twenty["reason"]
    storage = Storage(str(root))
    assert read_quarantine(storage, str(root / "train" / "20")) is not None
    stored = latest_good_on_storage(storage, str(root / "train"))
    assert stored is not None and stored.step == 10
