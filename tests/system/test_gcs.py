"""ckptd and trainer_client on ``gs://`` roots, against a real GCS JSON API on 127.0.0.1 (fake-gcs-server).

One trainer subprocess (jax imported once) saves with trainer_client's Checkpointer straight to
``gs://`` (Orbax's commit-file mode: steps are written in place, ``commit_success.txt`` last), in phases
driven from here: the catalog, a real ckptd server and the client's fallback scan look at the bucket
between phases, and the trainer finally restores the plan's ``gs://`` path onto a smaller mesh.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptd.catalog._catalog import Catalog
from tests.support.gcs_emulator import GcsEmulator
from tests.support.helpers import REPO, clean_env
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import COMMIT_MARKER, TMP_DIR_SUFFIX
from trainer_client.core.format._steps import inspect_step, latest_committed, step_entries
from trainer_client.core.protocol import ResumePlan, ResumeRequest, StepState
from trainer_client.errors import CkptdRequestError

pytestmark = pytest.mark.integration

ROOT = "root"
JOB = "job"




@pytest.fixture
def gcs(gcs_emulator: GcsEmulator) -> GcsEmulator:
    return gcs_emulator


# ---- the trainer: a separate interpreter, driven line by line over stdin/stdout ----------------------

_TRAINER = r"""
import json, sys, time
import fsspec
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from trainer_client.runtime.saving._checkpointing import Checkpointer, restore, target_shardings
from trainer_client.core.protocol import ResumePlan

job = sys.argv[1]
fs, _ = fsspec.core.url_to_fs(job)
assert jax.device_count() == 8, jax.device_count()
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("replica", "data"))
SPECS = {"params": {"w": P("replica", "data"), "b": P("data")}, "step": P()}

def say(tag, **kw):
    print("CKPTD-GCS " + json.dumps({"tag": tag, **kw}), flush=True)

def expect(tag):
    msg = json.loads(sys.stdin.readline())
    assert msg["tag"] == tag, msg
    return msg

def state_at(step, on):
    values = {"params": {"w": jnp.arange(128, dtype=jnp.float32).reshape(8, 16) * 0.25 + step,
                         "b": jnp.arange(16, dtype=jnp.float32) - step},
              "step": jnp.int32(step)}
    return jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(on, s)), values, SPECS)

def save(ck, step):
    ck.save(step, state_at(step, mesh), data_position=step * 32, global_batch=32, mesh=mesh,
            slices=[0, 1, 2, 3])

def in_flight(step):
    # What a commit-file save looks like before it finalizes: Orbax wrote the step's metadata with only
    # init_timestamp_nsecs at the start, and commit_success.txt comes last.
    d = f"{job}/{step}"
    kept = {n: fs.cat(f"{d}/{n}") for n in ("_CHECKPOINT_METADATA", "commit_success.txt")}
    fs.rm(f"{d}/commit_success.txt")
    fs.pipe(f"{d}/_CHECKPOINT_METADATA", json.dumps({"init_timestamp_nsecs": time.time_ns()}).encode())
    return kept

ck = Checkpointer(job)  # no atomicity given: Orbax picks commit-file mode on gs://
for step in (10, 20, 30):
    save(ck, step)
ck.wait()
kept30 = in_flight(30)
say("phase1")

expect("finish")
fs.pipe(f"{job}/30/_CHECKPOINT_METADATA", kept30["_CHECKPOINT_METADATA"])  # finalize: metadata, then
fs.pipe(f"{job}/30/commit_success.txt", kept30["commit_success.txt"])    # the commit marker last
for step in (40, 50):
    save(ck, step)
ck.close()
in_flight(50)  # and 50 is cut short for good: the trainer died before finalizing it
say("phase2")

plan = ResumePlan.model_validate(expect("restore")["plan"])
new_mesh = Mesh(np.array(jax.devices()[: plan.mesh.size]).reshape(plan.mesh.shape),
                tuple(plan.mesh.axis_names))
expected = state_at(plan.step, mesh)
abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), expected)
target = target_shardings(abstract, new_mesh, SPECS, plan.arrays)
restored = restore(plan.path, target)
leaves = jax.tree_util.tree_leaves_with_path(restored)
say("restored",
    exact=all(bool(np.array_equal(np.asarray(r), np.asarray(e)))
              for r, e in zip(jax.tree.leaves(restored), jax.tree.leaves(expected))),
    dtypes={jax.tree_util.keystr(p): str(a.dtype) for p, a in leaves},
    devices={jax.tree_util.keystr(p): len(a.sharding.device_set) for p, a in leaves},
    specs={jax.tree_util.keystr(p): list(a.sharding.spec) for p, a in leaves},
    w_sum=float(np.asarray(restored["params"]["w"]).sum()))
"""


class Trainer:
    """The trainer subprocess: ``expect(tag)`` waits for its next protocol line, ``send`` answers it."""

    def __init__(self, job_url: str, log_path: Path, env: dict[str, str]) -> None:
        self._log = log_path.open("w")
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _TRAINER, job_url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True, env=env, cwd=REPO,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("CKPTD-GCS "):
                self._lines.put(line[len("CKPTD-GCS "):])
        self._lines.put(None)

    def _fail(self, why: str) -> None:
        self._log.flush()
        pytest.fail(f"trainer: {why}\n{self.log_path.read_text(errors='replace')[-4000:]}")

    def expect(self, tag: str, timeout: float = 90.0) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self._fail(f"no {tag!r} within {timeout:.0f}s")
        if line is None:
            self._fail(f"exited (rc={self.proc.wait()}) before {tag!r}")
        msg: dict[str, Any] = json.loads(line)
        if msg.get("tag") != tag:
            self._fail(f"expected {tag!r}, got {msg!r}")
        return msg

    def send(self, tag: str, **payload: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"tag": tag, **payload}) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._log.close()


def _states(catalog: Catalog) -> dict[int, str]:
    return {c.step: c.state.value for c in catalog.checkpoints(JOB)}


# ---- the end-to-end run ------------------------------------------------------------------------------


def test_gcs_root_end_to_end(gcs: GcsEmulator, ckptd_server: Any, tmp_path: Path) -> None:
    root = gcs.gs(ROOT)
    job_url = gcs.gs(ROOT, JOB)
    trainer = Trainer(job_url, tmp_path / "trainer.log", clean_env())
    try:
        _run(gcs, trainer, root, job_url, ckptd_server, tmp_path)
        assert trainer.proc.wait(timeout=60) == 0, trainer.log_path.read_text(errors="replace")[-4000:]
    finally:
        trainer.close()


def _run(gcs: GcsEmulator, trainer: Trainer, root: str, job_url: str, ckptd_server: Any, tmp_path: Path) -> None:
    # (a) the trainer saved 10, 20, 30 to gs:// and 30 is still in flight (no commit_success.txt)
    trainer.expect("phase1")
    storage = Storage(root)
    assert storage.is_remote and storage.url_of(storage.join(JOB)) == job_url
    names = [e.name for e in storage.list_dir(storage.join(JOB))]
    assert names == ["10", "20", "30"], names  # in place: commit-file mode, no tmp directories
    assert not any(TMP_DIR_SUFFIX in n for n in names)

    # (b) the catalog over gs:// applies the commit rule
    catalog = Catalog(storage, tmp_path / "catalog.sqlite3")
    try:
        catalog.rebuild()
        jobs = catalog.jobs()
        assert [(j.name, j.path, j.latest_good_step) for j in jobs] == [(JOB, job_url, 20)]
        assert _states(catalog) == {10: "verified", 20: "verified", 30: "writing"}
        writing = next(c for c in catalog.checkpoints(JOB) if c.step == 30)
        assert COMMIT_MARKER in (writing.reason or "")
        good = catalog.latest_good(JOB)
        assert good is not None and good.step == 20 and good.path == f"{job_url}/20"
        assert good.training is not None and good.training.data_position == 640
        assert good.committed_at is not None and abs(good.committed_at - time.time()) < 300
        # the client's own scan agrees (it lists step 30's directory too: that listing gets cached)
        found = latest_committed(storage, storage.join(JOB))
        assert found is not None and found.step == 20

        # the in-flight save of 30 finalizes, 40 is saved, 50 is cut short for good
        trainer.send("finish")
        trainer.expect("phase2")
        # what a resume request does: rescan one job; cached listings must not hide the commit of 30
        catalog.refresh_job(JOB)
        assert _states(catalog) == {10: "verified", 20: "verified", 30: "verified", 40: "verified",
                                    50: "writing"}
        thirty = catalog.step(JOB, 30)
        assert thirty is not None and thirty.training is not None and thirty.training.step == 30
        good = catalog.latest_good(JOB)
        assert good is not None and good.step == 40 and good.path == f"{job_url}/40"
        catalog.refresh()  # a full rescan gives the same answer
        assert _states(catalog)[50] == "writing" and catalog.latest_good(JOB) == good
    finally:
        catalog.close()

    # (c) a real ckptd server over the gs:// root
    server = ckptd_server(root)
    request = ResumeRequest(policy="resize", alive_devices=4)
    with server.client() as http:
        latest = http.get(f"/v1/jobs/{JOB}/checkpoints/latest-good")
        assert latest.status_code == 200, latest.text
        assert (latest.json()["step"], latest.json()["path"]) == (40, f"{job_url}/40")
        listed = http.get(f"/v1/jobs/{JOB}/checkpoints").json()["checkpoints"]
        assert {c["step"]: c["state"] for c in listed} == {10: "verified", 20: "verified", 30: "verified",
                                                            40: "verified", 50: "writing"}
        resp = http.post(f"/v1/jobs/{JOB}/resume", json=request.model_dump(mode="json"))
        assert resp.status_code == 200, resp.text
        plan = ResumePlan.model_validate(resp.json())
    assert (plan.step, plan.path, plan.source) == (40, f"{job_url}/40", "ckptd")
    assert plan.mesh.axis_names == ["replica", "data"] and plan.mesh.shape == [2, 2]
    assert plan.data_position == 40 * 32 and plan.global_batch == 32

    # (d) ckptd down: the client's fallback computes the same plan from gs://
    server.stop()
    dead = CkptdClient(ClientSettings(url=server.url, timeout_s=0.2, resume_deadline_s=0.5), root=root)
    try:
        fallback = dead.resume(JOB, request)
        assert fallback.source == "storage_scan"
        assert fallback.model_dump(exclude={"source"}) == plan.model_dump(exclude={"source"})
        older = dead.resume_from_storage(JOB, ResumeRequest(policy="resize", alive_devices=4, step=30))
        assert (older.step, older.path) == (30, f"{job_url}/30")
        with pytest.raises(CkptdRequestError, match="STEP_NOT_FOUND"):  # as ckptd answers a step it has no good copy of
            dead.resume_from_storage(JOB, ResumeRequest(policy="resize", alive_devices=4, step=50))
    finally:
        dead.close()

    # (e) the trainer restores the plan's gs:// path onto the smaller mesh: exact values
    trainer.send("restore", plan=plan.model_dump(mode="json"))
    restored = trainer.expect("restored")
    assert restored["exact"] is True
    assert set(restored["devices"].values()) == {4}
    assert restored["specs"]["['params']['w']"] == ["replica", "data"]
    assert restored["specs"]["['params']['b']"] == ["data"]
    assert restored["dtypes"] == {"['params']['b']": "float32", "['params']['w']": "float32",
                                  "['step']": "int32"}
    assert restored["w_sum"] == pytest.approx(sum(i * 0.25 + 40 for i in range(128)))


# ---- storage details that object stores change (no jax) -----------------------------------------------


def test_invalidate_drops_cached_listings_below_the_path(gcs: GcsEmulator) -> None:
    """A listing cached for a step directory must not hide a commit marker written since."""
    writer = gcs.other_writer()
    base = f"{gcs.bucket}/inval/job"
    writer.pipe(f"{base}/7/_CHECKPOINT_METADATA", b"{}")
    storage = Storage(gcs.gs("inval"))
    job_path = storage.join("job")
    assert [e.name for e in storage.list_dir(f"{job_path}/7")] == ["_CHECKPOINT_METADATA"]
    assert not storage.exists(f"{job_path}/7/{COMMIT_MARKER}")
    writer.pipe(f"{base}/7/{COMMIT_MARKER}", b"ok")
    writer.pipe(f"{base}/7/_CHECKPOINT_METADATA", b'{"item_handlers": {}}')  # rewritten, longer

    storage.invalidate(job_path)
    assert storage.exists(f"{job_path}/7/{COMMIT_MARKER}")
    assert storage.read_json(f"{job_path}/7/_CHECKPOINT_METADATA") == {"item_handlers": {}}
    writer.rm(f"{base}/7/{COMMIT_MARKER}")
    storage.invalidate()
    assert not storage.exists(f"{job_path}/7/{COMMIT_MARKER}")


def test_directory_only_step_on_gcs_is_dated_and_ages_into_abandoned(gcs: GcsEmulator) -> None:
    """Object stores have no directory times: a step with only an item "directory" so far is dated by
    the objects under it (on local disk the directory's own mtime does this)."""
    writer = gcs.other_writer()
    writer.pipe(f"{gcs.bucket}/dironly/job/5/default/ocdbt.process_0/manifest.ocdbt", b"x")
    storage = Storage(gcs.gs("dironly"))
    entries = step_entries(storage, storage.join("job"))
    assert [(s.step, e.is_dir) for s, e in entries] == [(5, True)]  # a prefix, with no time of its own
    entry = entries[0][1]
    mtime = storage.newest_mtime(entry.path)
    assert mtime is not None and abs(mtime - time.time()) < 300
    now = inspect_step(storage, entry, save_timeout_s=60.0)
    later = inspect_step(storage, entry, save_timeout_s=60.0, now=time.time() + 3600)
    assert now is not None and now.state is StepState.WRITING
    assert later is not None and later.state is StepState.ABANDONED
    assert later.to_info(storage).path == gcs.gs("dironly", "job", "5")


def _listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as the kernel lists them) of the TCP sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, _remote, state = line.split()[1:4]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


def test_emulator_listens_on_loopback_only(gcs: GcsEmulator) -> None:
    assert gcs.url.startswith("http://127.0.0.1:")
    with httpx.Client(trust_env=False, timeout=5) as http:
        buckets = http.get(f"{gcs.url}/storage/v1/b").json()
    assert gcs.bucket in [b["name"] for b in buckets.get("items", [])]
    if not Path("/proc/net/tcp").exists():
        pytest.skip("no /proc/net/tcp to read listening sockets from")
    assert _listening_addresses(int(gcs.url.rsplit(":", 1)[1])) == ["0100007F"]  # 127.0.0.1 only
