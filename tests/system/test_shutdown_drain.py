"""A SIGTERM to ``ckptd serve`` persists the snapshots trainers already handed over before it exits, and says
which it could not (issue: shutdown must never drop an accepted save)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support.server import serve_process
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import COMMIT_MARKER
from trainer_client.core.format._manifest import read_verified_record
from trainer_client.runtime.memory._memory_tier import MemoryTier
from trainer_client.runtime.saving._checkpointing import training_metadata


def _serve(root: Path, shm: Path, tmp: Path, drain_s: float) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp / "ckptd.log"
    proc, _ = serve_process(root, log, "--shm-dir", str(shm), CKPTD_STATE_DIR=str(tmp / "state"),
                            CKPTD_REFRESH_INTERVAL_S="30", CKPTD_DRAIN_TIMEOUT_S=str(drain_s), CKPTD_LOG_LEVEL="info")
    return proc, log


def _snapshot(shm: Path, step: int) -> None:
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    state = {"w": jax.device_put(jnp.arange(4096.0).reshape(64, 64), NamedSharding(mesh, P("data")))}
    meta = training_metadata(step, state, data_position=step, global_batch=8, mesh=mesh, slices=[0])
    MemoryTier(str(shm), "job", preallocate=False).save(step, state, meta, persist=True)


def test_sigterm_persists_the_last_accepted_snapshot_before_exiting(tmp_path: Path) -> None:
    root, shm = tmp_path / "root", tmp_path / "shm"
    (root / "job").mkdir(parents=True)
    proc, log = _serve(root, shm, tmp_path, drain_s=120)
    # saved just before the shutdown, long before the next scan (30 s): only the drain can persist it
    _snapshot(shm, 400)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=150) in (0, -signal.SIGTERM), log.read_text()[-3000:]  # uvicorn re-raises the signal
    step = root / "job" / "400"
    assert (step / COMMIT_MARKER).exists(), log.read_text()[-3000:]
    assert read_verified_record(Storage(str(root)), str(step)) is not None  # confirmed before ckptd exited
    assert "persisting 1 snapshot(s) first" in log.read_text()


def test_a_drain_that_runs_out_of_time_names_what_it_left(tmp_path: Path) -> None:
    root, shm = tmp_path / "root", tmp_path / "shm"
    (root / "job").mkdir(parents=True)
    proc, log = _serve(root, shm, tmp_path, drain_s=0.001)  # no time: the persist worker cannot even start
    _snapshot(shm, 7)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    text = log.read_text()
    assert "not persisted to storage" in text and str(shm / "job" / "7") in text, text[-3000:]
    assert not (root / "job" / "7" / COMMIT_MARKER).exists()
    assert (shm / "job" / "7").is_dir()  # kept in shared memory for the next ckptd
