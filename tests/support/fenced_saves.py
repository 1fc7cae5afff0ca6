"""Multi-host saves laid on a root (local or ``gs://``) for the fencing tests: a claim, host parts (a data file and
a part record each, no jax), a stand-in persist worker whose finalize succeeds, and the check that a committed
step is still whole (docs/multihost.md, section 5, "Fenced writers")."""

from __future__ import annotations

import json
import time
from typing import Any

from ckptd.persist._worker_client import InProcessWorker
from tests.support.orbax_steps import training_metadata
from trainer_client.core._storage import Storage, join_path
from trainer_client.core.format._files import COMMIT_MARKER
from trainer_client.core.format._parts import Claim, claim_path, record_path, step_path_for

JOB, STEP = "job", 7


def part_record(save_id: str, k: int, count: int = 2) -> bytes:
    record = {"save_id": save_id, "process_index": k, "process_count": count, "sidecar": f"host{k}/1",
              "item": "default", "has_iter": False, "training": training_metadata(STEP)["ckptd"], "tree": [],
              "files": [], "arrays": {}, "write_shapes": {}, "written_at": time.time()}
    return json.dumps(record).encode()


def data_file(storage: Storage, save_id: str, k: int) -> str:
    """Host ``k``'s data file of ``save_id`` (its name unique to the save, as OCDBT's data files are)."""
    return join_path(step_path_for(storage, JOB, STEP, save_id), f"default/ocdbt.process_{k}/d/{save_id}")


def land_part(storage: Storage, save_id: str, k: int) -> None:
    """Host ``k``'s part of ``save_id``: its data, then its record (create-only, as a sidecar makes it)."""
    assert storage.create_new(data_file(storage, save_id, k), f"part {k} of {save_id}".encode())
    assert storage.create_new(record_path(step_path_for(storage, JOB, STEP, save_id), k), part_record(save_id, k))


def lay_save(storage: Storage, save_id: str, parts: tuple[int, ...], *, age_s: float = 60.0) -> Claim:
    """A save of STEP by 2 hosts claimed ``age_s`` ago, with the parts ``parts`` landed."""
    claim = Claim(save_id=save_id, process_count=2, created_at=time.time() - age_s)
    assert storage.create_new(claim_path(storage, JOB, STEP), claim.model_dump_json().encode())
    for k in parts:
        land_part(storage, save_id, k)
    return claim


def finalizing_worker() -> InProcessWorker:
    """Stands in for the persist worker: its finalize succeeds and writes nothing (the commit writes the rest)."""
    def answer(request: dict[str, Any]) -> dict[str, Any]:
        return {"ok": "commit" in request}
    return InProcessWorker(answer)


def committed_whole(storage: Storage, save_id: str) -> bool:
    """Whether STEP is committed (its marker at ``<job>/<step>``) with every file of ``save_id``'s two parts."""
    final = storage.join(JOB, str(STEP))
    storage.invalidate()
    if not storage.exists(join_path(final, COMMIT_MARKER)):
        return False
    files = [join_path(final, f"default/ocdbt.process_{k}/d/{save_id}") for k in (0, 1)]
    files += [record_path(final, k) for k in (0, 1)]
    return all(storage.exists(f) for f in files)
