"""Read-only adoption on ``gs://`` (fake-gcs-server): a bucket prefix ckptd must not write into. Steps
written by plain Orbax (in another process) are uploaded as a user's bucket holds them; ckptd catalogues,
verifies, plans and quarantines them with every record under ``<root>/.ckptd/``, and not one object under
the job's prefix is created, rewritten or deleted (names, sizes, CRC32C and generations compared)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptd.catalog._catalog import Catalog
from tests.support.gcs_emulator import GcsEmulator
from tests.support.orbax_steps import write_orbax_steps
from trainer_client.core import protocol as p
from trainer_client.core._step_plan import plan_for_step
from trainer_client.core._storage import Storage
from trainer_client.core._validation import latest_good_on_storage
from trainer_client.core.format._files import CKPTD_MANIFEST, QUARANTINE_FILE, TMP_DIR_SUFFIX, VERIFIED_FILE
from trainer_client.core.format._records import SIDE_DIR

pytestmark = pytest.mark.integration

REQUEST = p.ResumeRequest(alive_devices=6)


def _objects(storage: Storage, prefix: str) -> dict[str, tuple[Any, ...]]:
    """Every object under ``prefix``: (size, CRC32C, generation)."""
    storage.invalidate()
    found = storage.fs.find(prefix, detail=True)
    return {name: (info.get("size"), info.get("crc32c"), info.get("generation")) for name, info in found.items()}


def test_a_read_only_bucket_prefix_is_adopted_planned_and_quarantined_without_a_write(
    gcs_emulator: GcsEmulator, tmp_path: Path
) -> None:
    local = tmp_path / "root"
    write_orbax_steps(local / "llama", [100, 200, 300])
    shutil.copytree(local / "llama" / "300", local / "llama" / f"400{TMP_DIR_SUFFIX}-1")  # a save cut short
    url = gcs_emulator.gs("read-only-root")
    storage = Storage(url)
    storage.fs.put(str(local) + "/", url + "/", recursive=True)
    job_prefix = storage.join("llama")
    before = _objects(storage, job_prefix)
    assert before and not any(CKPTD_MANIFEST in name for name in before)

    catalog = Catalog(storage, ":memory:", read_only=True)
    catalog.rebuild()
    states = {c.step: c.state.value for c in catalog.checkpoints("llama")}
    assert states == {100: "verified", 200: "verified", 300: "verified", 400: "writing"}
    good = catalog.confirmed_latest_good("llama")
    assert good is not None and good.step == 300
    plan = plan_for_step(storage, good.path, REQUEST, job="llama", step=300, layout=catalog.layout(good))
    assert plan.mesh.shape == [3, 2] and plan.path == storage.url_of(storage.join("llama", "300"))
    assert _objects(storage, job_prefix) == before  # adopted, sealed, recorded: all on the side
    side = _objects(storage, storage.join(SIDE_DIR, "llama"))
    assert {name.rsplit("/", 2)[-2:][0] for name in side} == {"100", "200", "300"}
    assert {name.rsplit("/", 1)[-1] for name in side} == {CKPTD_MANIFEST, VERIFIED_FILE}

    # the same answers as from a local copy in normal mode
    normal = Catalog(Storage(str(local)), ":memory:")
    normal.rebuild()
    assert {c.step: c.state.value for c in normal.checkpoints("llama")} == states
    local_plan = plan_for_step(normal.storage, str(local / "llama" / "300"), REQUEST, job="llama", step=300)
    assert json.loads(plan.model_dump_json().replace(url, "R")) == json.loads(
        local_plan.model_dump_json().replace(str(local), "R"))

    # the bucket's owner damages step 300; ckptd's next check quarantines it by a record on the side
    victim = max((n for n in before if "/300/default/" in n and "/d/" in n), key=lambda n: before[n][0])
    writer = gcs_emulator.other_writer()
    data = writer.cat_file(victim)
    writer.pipe_file(victim, data[:-1])
    damaged = _objects(storage, job_prefix)
    assert not catalog.revalidate(catalog.step("llama", 300))  # type: ignore[arg-type]
    catalog.refresh_job("llama")
    assert catalog.confirmed_latest_good("llama").step == 200  # type: ignore[union-attr]
    assert _objects(storage, job_prefix) == damaged  # nothing written under the job: not even the record
    record = json.loads(storage.read_bytes(storage.join(SIDE_DIR, "llama", "300", QUARANTINE_FILE)))
    assert "quick validation failed" in record["reason"]
    assert record["path"] == storage.url_of(storage.join("llama", "300"))
    # a reader that knows nothing of the mode (the client's fallback) honours the record
    found = latest_good_on_storage(Storage(url), storage.join("llama"))
    assert found is not None and found.step == 200
