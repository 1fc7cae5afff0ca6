"""Many hosts persisting one step to one bucket that behaves like GCS under load (``bench/gcs_hosts.py``, at a few
hosts here; ``python -m bench.gcs_hosts --hosts 1024`` is the bench): each host's sidecar writes its real part of the
step through ckptd's part-commit path (``PartSaves.persist_part``: claim, the part's Orbax writes in the persist
worker's code, the part record) to ``gs://`` through the shaper (``tests/support/gcs_shaper.py``), the leader's commit
pass commits it. Rates scaled down so that the bucket refuses: no save fails, no part is lost, no object is written
twice within a second, the refusals are absorbed, and each host asks what its part needs. Given the bucket's write
budget, the hosts share it (each paces its part's writes at the budget over the host count) and the bucket refuses
none of their writes where, on back-off alone, it refuses some; a host given a count of 1 is not slowed."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.gcs_host_parts import REPLICATED, SHARDED, expected, write_host_parts
from bench.gcs_hosts import JOB, STEP, persist_step
from tests.support.gcs_emulator import GcsEmulator
from tests.support.gcs_shaper import GcsShaper, shaped_env
from tests.support.gcs_shaping import Limits
from trainer_client.core._storage import Storage

HOSTS = 12
ROWS, COLS = 4, 64
# A host's part, admitted (refused tries aside): its claim's create-only write (one creates it, the others get 412),
# its OCDBT data file and manifest, its array metadatas, its part record.
WRITES_PER_HOST = 5
READS_PER_HOST_AT_MOST = 12


@pytest.fixture
def shaper(gcs_emulator: GcsEmulator, monkeypatch: pytest.MonkeyPatch) -> Iterator[GcsShaper]:
    """The shaper, at a fiftieth of GCS's starting rates, with a door for the hosts and one for the leader; this
    process's default gcsfs and tensorstore (the persist worker's code, run in process) go through the hosts'."""
    with GcsShaper(gcs_emulator.url, Limits().scaled(0.02), doors=("hosts", "leader")) as shaped:
        for key, value in shaped_env(shaped.urls["hosts"]).items():
            monkeypatch.setenv(key, value)
        yield shaped


def _client(url: str) -> Any:
    import gcsfs  # once the emulator's settings are in place (tests/support/gcs_emulator.py)

    return gcsfs.GCSFileSystem(endpoint_url=url, token="anon", skip_instance_cache=True)


@pytest.mark.parametrize("budget", [False, True], ids=["back-off-alone", "shared-budget"])
def test_hosts_persist_one_step_through_a_bucket_that_refuses(shaper: GcsShaper, gcs_emulator: GcsEmulator,
                                                              tmp_path: Path, budget: bool) -> None:
    from ckptd.persist._persist_worker import handle
    from ckptd.persist._worker_client import InProcessWorker

    parts = write_host_parts(tmp_path / "shm", JOB, STEP, HOSTS, rows=ROWS, cols=COLS)
    root = gcs_emulator.gs(f"many-hosts-{uuid.uuid4().hex[:8]}")
    worker = InProcessWorker(handle)
    result = persist_step(
        parts, host_storage=lambda _k: Storage(root, fs=_client(shaper.urls["hosts"])),
        leader_storage=Storage(root, fs=_client(shaper.urls["leader"])), host_worker=worker, leader_worker=worker,
        stats=shaper.rules.snapshot, reset=shaper.rules.reset, concurrency=HOSTS, poll_s=0.2, retry_s=1.0,
        timeout_s=240.0, bucket_writes_per_s=shaper.rules.limits.write_per_s if budget else 0.0)
    print(f"[gcs many hosts] {result}")
    assert result["committed"], result["failures"]
    assert result["failed_parts"] == [] and result["lost_parts"] == []
    assert result["failed_tries"] == 0, result["failures"]  # every refusal absorbed by a retry of the request
    assert result["written_twice"] == 0 and result["refused"].get("object_rate", 0) == 0
    if budget:  # 12 hosts' 60 writes paced at the bucket's 20/s: 0 or 1 refused (back-off alone: about 13), the
        # parts within 1.2x of what the rate allows
        assert result["refused"].get("write_rate", 0) <= 2, result["refused"]
        assert result["parts_s"] <= 1.2 * result["parts_writes"] / shaper.rules.limits.write_per_s + 1.0
    else:
        assert result["refused"].get("write_rate", 0) > 0  # the bucket did refuse: the rates bind
    assert result["writes_per_host"] == WRITES_PER_HOST
    assert result["reads_per_host"] <= READS_PER_HOST_AT_MOST
    # the step holds every host's rows: read back through tensorstore from the emulator itself
    import tensorstore as ts

    from trainer_client.core._storage import join_path

    item = join_path(root, JOB, str(STEP), "default")
    for name in (*SHARDED, REPLICATED):
        spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"{item}/"}, "path": name}
        got = ts.open(spec, open=True, read=True).result().read().result()
        want = (expected(name, 0, ROWS, COLS) if name == REPLICATED
                else np.concatenate([expected(name, k, ROWS, COLS) for k in range(HOSTS)]))
        assert np.array_equal(got, want), name


def test_a_host_given_a_count_of_1_is_not_slowed(shaper: GcsShaper, gcs_emulator: GcsEmulator, tmp_path: Path) -> None:
    """A budget of one write in 100 s: a host told it writes alone persists its part without waiting for it."""
    from ckptd.multihost._part_commit import PartSaves
    from ckptd.persist._persist_worker import handle
    from ckptd.persist._worker_client import InProcessWorker
    from trainer_client.core.format._snapshot import read_meta

    parts = write_host_parts(tmp_path / "shm", JOB, STEP, 2, rows=ROWS, cols=COLS)
    root = gcs_emulator.gs(f"one-host-{uuid.uuid4().hex[:8]}")
    saves = PartSaves(Storage(root, fs=_client(shaper.urls["hosts"])), InProcessWorker(handle), hosts=1,
                      bucket_writes_per_s=0.01)
    assert saves.persist_part(JOB, str(parts[1]), read_meta(parts[1])) == "written"
    assert saves.share.interval_s == 0.0 and saves.share.waited_s == 0.0
