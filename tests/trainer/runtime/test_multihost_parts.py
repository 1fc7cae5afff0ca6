"""One host's part of a multi-process job's memory snapshot: two real JAX processes (jax.distributed on
127.0.0.1, 4 CPU devices each, one global mesh of 8) each snapshot their own shards through the real
``MemoryTier``. The part records its process, is never taken for a whole snapshot, and ckptd's keeper keeps
it — never committed alone (a step missing the other host's shards) nor deleted as broken (a persistent
save lost); the trainer's ``Saver`` sends a persistent save of such a job to the memory tier, in every
process (docs/multihost.md). The multi-host persist: each part written as that process's part of a plain
multi-process Orbax step, committed only with every part there, a commit redone after a crash, a claim of
another save refused (``ckptd/multihost/_part_commit.py``)."""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptd.memory_tier._snapshots import SnapshotKeeper
from ckptd.multihost._abandoned_parts import clean_abandoned_parts
from ckptd.multihost._part_commit import PartSaves
from ckptd.persist._persist_worker import handle, persist
from ckptd.persist._worker_client import InProcessWorker
from tests.support.chaos_support import CkptdProcess
from tests.support.helpers import clean_env, wait_until
from tests.support.jax_job import PREAMBLE, run_job
from trainer_client.core._storage import Storage
from trainer_client.core._validation import latest_good_on_storage, validate_step
from trainer_client.core.format._array_index import decode_all_arrays
from trainer_client.core.format._parts import make_claim, part_problems, read_part
from trainer_client.core.format._snapshot import problems, read_meta
from trainer_client.core.format._snapshot_dirs import is_persisted, newest_whole

_HOST = PREAMBLE + """
from trainer_client.runtime.saving._saver import Saver
from trainer_client.runtime.saving._checkpointing import Checkpointer, training_metadata
from trainer_client.runtime.memory._memory_tier import MemoryTier
state = {
    "w": jax.make_array_from_callback((16, 4), NamedSharding(mesh, P("data")),
                                      lambda i: np.arange(64, dtype=np.float32).reshape(16, 4)[i]),
    "b": jax.make_array_from_callback((4,), NamedSharding(mesh, P()), lambda i: np.ones(4, np.float32)[i]),
}
import optax  # what real users train with: its adam state holds an EmptyState (stored by Orbax as None)
init = optax.adam(1e-3).init
layout = jax.tree.map(lambda x: NamedSharding(mesh, P("data") if x.ndim else P()),
                      jax.eval_shape(init, {"w": state["w"]}))
state.update(opt=jax.jit(init, out_shardings=layout)({"w": state["w"]}), none=None, empty={}, scale=np.float32(1.5))
meta = training_metadata(5, state, data_position=40, global_batch=8, mesh=mesh, slices=[0])
tier = MemoryTier(shm, "job", preallocate=False)
from trainer_client.core.format._snapshot import DataIteratorRecord
path = tier.save(5, state, meta, persist=True,
                 data_iterator=DataIteratorRecord(process_index=index, process_count=2, state={"pos": 40 + index}))
saver = Saver(Checkpointer(root + "/job"), tier, None)
went = saver.save(6, state, training_metadata(6, state, data_position=48, global_batch=8, mesh=mesh, slices=[0]),
                  persist=True)
saver.wait()
plain = Checkpointer(root + "/plain")  # a plain 2-process Orbax save of step 5: the layout the parts must give
plain.save_with_metadata(5, state, meta)
plain.wait()
print(went, path, flush=True)
jax.distributed.shutdown()
"""


# every test joins processes with jax.distributed, which needs TCP on 127.0.0.1
pytestmark = pytest.mark.needs_tcp


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], list[Path]]:
    """A 2-process job: step 5 snapshotted (marked persist) by both processes, each into its own host's
    shared memory; step 6 saved through the trainer's ``Saver`` with the memory tier on. The storage root,
    the tier each process's save of step 6 took, and the two parts of step 5."""
    base = tmp_path_factory.mktemp("hosts")
    root = base / "root"
    tiers, parts = [], []
    for line in run_job(_HOST, base):
        went, path = line.split()[-2:]
        tiers.append(went)
        parts.append(Path(path))
    return root, tiers, parts


@pytest.fixture(scope="module")
def parts(hosts: tuple[Path, list[str], list[Path]]) -> list[Path]:
    return hosts[2]


def test_a_persistent_save_of_a_multi_process_job_goes_to_the_memory_tier(
        hosts: tuple[Path, list[str], list[Path]]) -> None:
    root, tiers, parts = hosts
    assert tiers == ["memory+persist", "memory+persist"]  # every process alike: each host's part, for its ckptd
    assert not (root / "job" / "6").exists()  # nothing written to storage by the trainers
    for k, part in enumerate(parts):
        meta = read_meta(part.parent / "6")
        assert (meta.persist, meta.process_index, meta.process_count) == (True, k, 2)


def test_each_host_snapshots_its_own_part_and_records_which(parts: list[Path]) -> None:
    metas = [read_meta(path) for path in parts]
    assert [(m.process_index, m.process_count, m.is_part) for m in metas] == [(0, 2, True), (1, 2, True)]
    w = [{tuple(map(tuple, s.index)) for s in m.arrays["w"].shards} for m in metas]
    assert not w[0] & w[1]  # the hosts hold different rows of the sharded array ...
    covered = [sum(math.prod(b - a for a, b in index) for index in part) for part in w]
    assert covered == [32, 32]  # ... each half of its 64 elements
    # a replicated array: one copy in each part, so that each process restores from its own part alone
    assert [len(m.arrays["b"].shards) for m in metas] == [1, 1]
    # ... and which part writes it to storage: jax's replica 0 is on process 0's devices, as Orbax decides
    assert [m.arrays["b"].shards[0].replica_id for m in metas] == [0, 4]
    assert all(s.replica_id == 0 for m in metas for s in m.arrays["w"].shards)
    for path in parts:
        assert problems(path) == []  # intact as a part ...
        assert newest_whole(path.parent.parent, "job") is None  # ... and never a whole snapshot on its own
    recorded = json.loads((parts[1] / "snapshot.json").read_text())
    assert (recorded["process_index"], recorded["process_count"]) == (1, 2)
    single = json.loads(metas[0].model_copy(update={"process_index": 0, "process_count": 1}).model_dump_json())
    assert "process_index" not in single and "process_count" not in single  # what older readers parse


def test_one_hosts_part_alone_is_written_but_never_committed(parts: list[Path], tmp_path: Path) -> None:
    part = parts[0]
    root = tmp_path / "root"
    keeper = SnapshotKeeper(Storage(str(root)), str(part.parent.parent), max_snapshots=1)
    keeper.parts.worker = _in_process  # the worker's own handling, without a child's start (the system test has one)
    keeper.start()
    keeper.scan()
    left = keeper.stop(drain_timeout_s=60)
    assert part.is_dir() and problems(part) == [] and not is_persisted(part)  # kept: not committed yet
    assert left == [] and keeper.stats.parts_written >= 1 and keeper.stats.broken == 0
    assert not (root / "job" / "5").exists()  # host 1's part is missing
    staged = root / "job" / ".ckptd" / "staging" / f"5.{read_meta(part).save_id}"
    assert sorted(p.name for p in (staged / "ckptd_parts").iterdir()) == ["process_0.json"]
    assert (root / "job" / ".ckptd" / "claims" / "5.json").is_file()
    assert latest_good_on_storage(Storage(str(root)), str(root / "job")) is None  # never served


def test_the_persist_worker_refuses_a_part(parts: list[Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="process 1 of 2's part only"):
        persist(parts[1], str(tmp_path / "root" / "job"))
    assert not (tmp_path / "root" / "job" / "5").exists()


# The persist worker's own request handling, run in this process (which has jax already): the same code
# ``ckptd.persist._persist_worker --serve`` runs, without a child's start-up.
_in_process = InProcessWorker(handle)


def _deep_problems(storage: Storage, step: Path) -> list[str]:
    return validate_step(storage, str(step), "deep", decode_arrays=decode_all_arrays).problems


def _target(devices: int) -> dict[str, Any]:
    """The job's state as a restore target on ``devices`` devices: its arrays' shapes on a mesh of that size,
    its values and empty nodes as they are (an optax adam state among them)."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    rows = NamedSharding(mesh, P("data") if 16 % devices == 0 else P())
    w = jax.ShapeDtypeStruct((16, 4), np.float32, sharding=rows)
    adam = optax.ScaleByAdamState(count=jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh, P())),
                                  mu={"w": w}, nu={"w": w})
    return {"w": w, "b": jax.ShapeDtypeStruct((4,), np.float32, sharding=NamedSharding(mesh, P())),
            "opt": (adam, optax.EmptyState()), "none": None, "empty": {}, "scale": np.float32(0)}


def _restored(step: Path, devices: int) -> dict[str, Any]:
    """The step restored by plain Orbax (its PyTree handler, one process) onto ``_target(devices)``; the
    tree Orbax gives must have the target's structure."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    target = _target(devices)

    def args(leaf: Any) -> Any:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return ocp.ArrayRestoreArgs(sharding=leaf.sharding, global_shape=leaf.shape, dtype=leaf.dtype)
        return ocp.RestoreArgs(restore_type=np.ndarray)

    with ocp.PyTreeCheckpointer() as checkpointer:
        out = checkpointer.restore(step / "default", args=ocp.args.PyTreeRestore(
            item=target, restore_args=jax.tree_util.tree_map(args, target)))
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(target)
    assert out["none"] is None and out["empty"] == {} and out["opt"][1] == ()  # EmptyState: no fields
    assert int(out["opt"][0].count) == 0 and not np.asarray(out["opt"][0].mu["w"]).any()
    assert np.asarray(out["scale"]).dtype == np.float32 and float(out["scale"]) == 1.5
    return {name: np.asarray(out[name]) for name in ("w", "b")}


def test_both_parts_make_one_plain_orbax_step_committed_once(parts: list[Path], tmp_path: Path) -> None:
    import numpy as np

    storage = Storage(str(tmp_path / "root"))
    sidecars = [PartSaves(storage, _in_process) for _ in parts]
    for sidecar, part in zip(sidecars, parts, strict=True):
        assert sidecar.persist_part("job", str(part), read_meta(part)) == "written"
    assert sidecars[0].commit_ready("job") == [5]
    assert sidecars[1].commit_ready("job") == [] and sidecars[0].commit_ready("job") == []  # once
    step = tmp_path / "root" / "job" / "5"
    assert sorted(p.name for p in (step / "ckptd_parts").iterdir()) == ["process_0.json", "process_1.json"]
    assert sorted(p.name for p in (step / "default").glob("ocdbt.process_*")) == ["ocdbt.process_0", "ocdbt.process_1"]
    assert not (tmp_path / "root" / "job" / ".ckptd" / "staging" / f"5.{read_meta(parts[0]).save_id}").exists()
    for k in (0, 1):  # Grain's per-process iterator files, as each process of a plain save writes its own
        assert json.loads((step / "iter" / f"process_{k}-of-2.json").read_text()) == {"pos": 40 + k}
    assert json.loads((step / "_CHECKPOINT_METADATA").read_text())["item_handlers"]["iter"].endswith(
        "IteratorStateHandler")
    assert _deep_problems(storage, step) == [] and part_problems(storage, str(step)) == []
    plain = parts[0].parents[2] / "root" / "plain" / "5"  # the job's own multi-process save
    for rel in ("default/_METADATA", "default/array_metadatas/process_0", "default/array_metadatas/process_1"):
        assert json.loads((step / rel).read_text()) == json.loads((plain / rel).read_text()), rel
    kinds = {key: entry["value_metadata"]["value_type"]
             for key, entry in json.loads((step / "default" / "_METADATA").read_text())["tree_metadata"].items()}
    assert (kinds["('opt', '1')"], kinds["('none',)"], kinds["('empty',)"], kinds["('scale',)"]) == (
        "None", "None", "Dict", "np.ndarray")  # adam's EmptyState, None, {}, a numpy scalar: as Orbax records them
    ours, theirs = (json.loads((s / "default" / "_sharding").read_text()) for s in (step, plain))
    assert ours.keys() == theirs.keys()  # the same arrays, each on the trainer's mesh with its partition spec
    for name in ours:
        a, b = json.loads(ours[name]), json.loads(theirs[name])
        assert {k: v for k, v in a.items() if k != "device_mesh"} == {k: v for k, v in b.items() if k != "device_mesh"}
    assert [sidecar.state("job", read_meta(part)) for sidecar, part in zip(sidecars, parts, strict=True)] == [
        "committed", "committed"]
    rerun = read_meta(parts[0]).model_copy(update={"save_id": "00ff-5"})  # step 5 saved again after a restart
    assert sidecars[0].state("job", rerun) == "committed"  # the committed step stands: that part is done
    for devices in (8, 6):  # plain Orbax, one process: on the saved mesh's size and onto another
        out = _restored(step, devices)
        assert np.array_equal(out["w"], np.arange(64, dtype=np.float32).reshape(16, 4))
        assert np.array_equal(out["b"], np.ones(4, np.float32))
    assert latest_good_on_storage(storage, str(tmp_path / "root" / "job")).step == 5  # type: ignore[union-attr]
    (step / "ckptd_parts" / "process_1.json").unlink()  # the fallback never takes a step missing a part record
    assert latest_good_on_storage(storage, str(tmp_path / "root" / "job")) is None


def test_a_claim_of_another_save_is_refused(parts: list[Path], tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "root"))
    assert make_claim(storage, "job", 5, "00ff-5", 2) is not None  # an earlier incarnation's save of step 5
    sidecar = PartSaves(storage, _in_process)
    assert sidecar.persist_part("job", str(parts[0]), read_meta(parts[0])) == "claimed by another save"
    assert sidecar.state("job", read_meta(parts[0])) == "claimed by another save"
    assert not (tmp_path / "root" / "job" / ".ckptd" / "staging").exists()  # nothing written
    assert sidecar.commit_ready("job") == []  # its parts never came: never committed
    found = sidecar.abandoned("job", older_than_s=0.0)
    assert [(a.step, a.save_id, a.missing) for a in found] == [(5, "00ff-5", [0, 1])]
    sidecar.clean(found[0])  # the claim is free again: this save goes on
    assert sidecar.persist_part("job", str(parts[0]), read_meta(parts[0])) == "written"


def test_the_commit_is_redone_after_a_crash_between_merge_and_marker(parts: list[Path], tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "root"))
    sidecars = [PartSaves(storage, _in_process) for _ in parts]
    for sidecar, part in zip(sidecars, parts, strict=True):
        sidecar.persist_part("job", str(part), read_meta(part))
    save_id = read_meta(parts[0]).save_id
    staged = tmp_path / "root" / "job" / ".ckptd" / "staging" / f"5.{save_id}"
    record = read_part(storage, str(staged), 0)
    assert record is not None
    _in_process.commit_parts(str(staged), record.model_dump(mode="json"))  # then it died
    assert (staged / "default" / "manifest.ocdbt").is_file() and not (staged / "commit_success.txt").exists()
    assert latest_good_on_storage(storage, str(tmp_path / "root" / "job")) is None
    assert sidecars[1].commit_ready("job") == [5]  # the next leader redoes the commit from the start
    step = tmp_path / "root" / "job" / "5"
    assert _deep_problems(storage, step) == []


SEED = 1414  # where the sidecar is killed, reproducibly


def _served(proc: CkptdProcess) -> int | None:
    try:
        answer = httpx.get(f"{proc.url}/v1/jobs/job/checkpoints/latest-good", timeout=5)
    except httpx.HTTPError:
        return None
    return answer.json().get("step") if answer.status_code == 200 else None


def _sidecars(root: str, parts: list[Path], tmp_path: Path) -> tuple[list[CkptdProcess], list[Path]]:
    """A ``ckptd serve`` per host, each with a copy of its host's shared memory, one root, the lease on."""
    shms = []
    for k, part in enumerate(parts):
        shm = tmp_path / f"shm{k}"
        shutil.copytree(part.parent.parent, shm, ignore=shutil.ignore_patterns(".spare-*"))
        shms.append(shm / "job")
    procs = [CkptdProcess(root, tmp_path / f"state{k}", log_path=tmp_path / f"ckptd{k}.log",
                          env={"CKPTD_SHM_DIR": str(shms[k].parent), "CKPTD_LEASE_TTL_S": "2",
                               "CKPTD_PERSIST_DEVICES": "8", "CKPTD_LOG_LEVEL": "info"})
             for k in range(len(parts))]
    return procs, shms


def _whole_or_unserved(storage: Storage, procs: list[CkptdProcess]) -> None:
    """What any sidecar serves is committed with every host's part record."""
    for proc in procs:
        step = _served(proc)
        if step is not None:
            assert part_problems(storage, storage.join("job", str(step))) == [], step


def _persist_with_two_sidecars(root: str, parts: list[Path], tmp_path: Path, *, kill_at: float | None) -> None:
    storage = Storage(root)
    procs, shms = _sidecars(root, parts, tmp_path)
    try:
        for proc in procs:
            proc.start()
        if kill_at is not None:  # host 1's sidecar SIGKILLed somewhere in its start, claim, part write or commit
            time.sleep(kill_at)
            procs[1].kill()
            for _ in range(20):
                _whole_or_unserved(storage, procs[:1])
                time.sleep(0.1)
            procs[1].start()
        wait_until(lambda: all(_served(p) == 6 for p in procs), timeout=90, interval=0.2,
                   what="steps 5 and 6 committed from both parts and served by both sidecars")
        _whole_or_unserved(storage, procs)
        wait_until(lambda: all(is_persisted(shm / str(step)) for shm in shms for step in (5, 6)), timeout=30,
                   what="every host's part marked persisted once its step is committed")
    finally:
        for proc in procs:
            proc.stop()
    logs = "".join((tmp_path / f"ckptd{k}.log").read_text() for k in range(len(procs)))
    for step in (5, 6):
        assert logs.count(f"committed step {step} of job from 2 host parts") == 1, logs[-3000:]  # exactly once
        step_path = storage.join("job", str(step))
        assert part_problems(storage, step_path) == []
        assert sorted(storage.fs.ls(storage.join("job", str(step), "ckptd_parts"))) == sorted(
            storage.join("job", str(step), "ckptd_parts", f"process_{k}.json") for k in (0, 1))
    job_url = storage.url_of(storage.join("job"))
    validated = subprocess.run([sys.executable, "-m", "ckptd", "validate", "--deep", job_url],
                               capture_output=True, text=True, env=clean_env(), timeout=120)
    assert validated.returncode == 0 and "2 checked, 0 bad" in validated.stderr, validated.stdout + validated.stderr


def test_two_sidecars_commit_each_step_once_with_a_sidecar_killed_mid_persist(parts: list[Path],
                                                                              tmp_path: Path) -> None:
    import numpy as np

    root = tmp_path / "root"
    root.mkdir()
    _persist_with_two_sidecars(str(root), parts, tmp_path, kill_at=random.Random(SEED).uniform(1.0, 6.0))
    for devices in (8, 6):  # plain Orbax, one process, restores the steps committed from parts
        out = _restored(root / "job" / "6", devices)
        assert np.array_equal(out["w"], np.arange(64, dtype=np.float32).reshape(16, 4))


@pytest.mark.slow  # ~40 s on this loaded machine: the local short form above covers the same path
@pytest.mark.chaos  # so that `make chaos` runs it (neither `make test` nor `make chaos` did while only slow)
def test_two_sidecars_commit_from_parts_on_gcs(parts: list[Path], tmp_path: Path,
                                               request: pytest.FixtureRequest) -> None:
    emulator = request.getfixturevalue("gcs_emulator")
    _persist_with_two_sidecars(emulator.gs(f"parts-{uuid.uuid4().hex[:8]}"), parts, tmp_path, kill_at=None)


@pytest.mark.chaos
@pytest.mark.slow  # a long form (~30 s a seed): out of `make test` (-m "not slow"), which runs the seed above
@pytest.mark.parametrize("seed", range(4))
def test_a_sidecar_killed_at_a_random_point_never_leaves_a_step_served_without_every_part(
        parts: list[Path], tmp_path: Path, seed: int) -> None:
    rng = random.Random(SEED + seed)
    (tmp_path / "root").mkdir()
    _persist_with_two_sidecars(str(tmp_path / "root"), parts, tmp_path, kill_at=rng.uniform(0.5, 12.0))


def test_retention_cleans_an_abandoned_multi_host_save(parts: list[Path], tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "root"))
    sidecar = PartSaves(storage, _in_process)
    assert sidecar.persist_part("job", str(parts[0]), read_meta(parts[0])) == "written"  # host 1's never comes
    assert clean_abandoned_parts(storage, "job", older_than_s=3600) == []  # younger than the save timeout: kept
    deleted = clean_abandoned_parts(storage, "job", older_than_s=0.0)
    assert [(d.step, d.action) for d in deleted] == [(5, "delete")] and "parts 1 missing" in deleted[0].reasons[0]
    assert not (tmp_path / "root" / "job" / ".ckptd" / "staging" / f"5.{read_meta(parts[0]).save_id}").exists()
    assert not (tmp_path / "root" / "job" / ".ckptd" / "claims" / "5.json").exists()


def test_a_leader_without_the_job_in_its_shared_memory_commits_the_parts_on_storage(parts: list[Path],
                                                                                      tmp_path: Path) -> None:
    """Both hosts' parts of step 5 are durable on storage (written by their sidecars); the job's only sidecar
    now, so its leader, was started without ``CKPTD_SHM_DIR`` (a replaced node, a sidecar serving reads): the
    commit pass starts from the catalog, not from a host's memory, so the step gets committed and served."""
    root = tmp_path / "root"
    storage = Storage(str(root))
    for part in parts:  # each host's sidecar wrote its part, then went away before any leader committed
        assert PartSaves(storage, _in_process).persist_part("job", str(part), read_meta(part)) == "written"
    assert not (root / "job" / "5").exists()
    proc = CkptdProcess(str(root), tmp_path / "state", log_path=tmp_path / "ckptd.log",
                        env={"CKPTD_LEASE_TTL_S": "2", "CKPTD_PERSIST_DEVICES": "8", "CKPTD_LOG_LEVEL": "info"})
    try:
        proc.start()
        proc.wait_ready()
        wait_until(lambda: _served(proc) == 5, timeout=60, interval=0.2, what="step 5 committed and served")
    finally:
        proc.stop()
    assert (tmp_path / "ckptd.log").read_text().count("committed step 5 of job from 2 host parts") == 1
    assert part_problems(storage, storage.join("job", "5")) == [] and _deep_problems(storage, root / "job" / "5") == []


def test_the_commit_pass_commits_only_where_it_leads_and_once(parts: list[Path], tmp_path: Path) -> None:
    """``CommitPass`` over the catalog's jobs (here a list): a follower commits nothing and lists nothing;
    the leader commits step 5 once; the keeper no longer commits (one owner of the commit pass)."""
    from ckptd.multihost._commit_pass import CommitPass

    storage = Storage(str(tmp_path / "root"))
    for part in parts:
        assert PartSaves(storage, _in_process).persist_part("job", str(part), read_meta(part)) == "written"
    leads = {"job": False}
    committed: list[tuple[str, int]] = []
    commits = CommitPass(storage, jobs=lambda: ["job", "other"], writes=lambda job: leads.get(job, False),
                         interval_s=3600, worker=_in_process,
                         on_committed=lambda job, step: committed.append((job, step)))
    assert commits.run_once() == [] and not (tmp_path / "root" / "job" / "5").exists()
    keeper = SnapshotKeeper(storage, str(parts[0].parent.parent), max_snapshots=2)
    keeper.parts.worker = _in_process
    keeper.scan()  # a leader's keeper with the job in its memory: queues parts (step 6's), nothing to commit
    assert {item.kind for item in list(keeper._queue.queue) if item is not None} <= {"part"}
    leads["job"] = True
    assert commits.run_once() == [("job", 5)] == committed
    assert commits.run_once() == [] and commits.commits == 1
    assert (tmp_path / "root" / "job" / "5" / "commit_success.txt").is_file()


def test_retention_never_cleans_a_save_the_leader_is_committing(parts: list[Path], tmp_path: Path) -> None:
    """The leader's gc thread (retention's ``clean_abandoned_parts``) runs while its commit pass merges a save
    whose every part is durable but whose claim is older than ``save_timeout_s``; meanwhile host 1's sidecar
    redoes its part (its snapshot is not marked persisted). Seen in tests/system/test_multihost_trainer_kill.py
    (CKPTD_SAVE_TIMEOUT_S=30, a loaded machine): step 15 committed and served with process_1.json only."""
    storage = Storage(str(tmp_path / "root"))
    sidecars = [PartSaves(storage, _in_process) for _ in parts]
    for sidecar, part in zip(sidecars, parts, strict=True):
        assert sidecar.persist_part("job", str(part), read_meta(part)) == "written"

    def racing(request: dict[str, Any]) -> dict[str, Any]:
        answer = handle(request)
        if "commit" in request:  # merged; before the manifest and the marker, the gc thread and host 1's keeper run
            clean_abandoned_parts(storage, "job", older_than_s=0.0)
            sidecars[1].persist_part("job", str(parts[1]), read_meta(parts[1]))
        return answer

    leader = PartSaves(storage, InProcessWorker(racing))
    leader.commit_ready("job")
    step = tmp_path / "root" / "job" / "5"
    if (step / "commit_success.txt").exists():  # committed: then whole
        assert part_problems(storage, storage.join("job", "5")) == []
        assert _deep_problems(storage, step) == []


def test_a_part_that_lands_after_retention_looked_keeps_its_save(parts: list[Path], tmp_path: Path) -> None:
    """Retention finds a save abandoned (part 1 missing, the claim past ``save_timeout_s``); part 1 lands before
    it deletes: the save is the commit pass's now, and clean leaves it (checked again under the job's lock)."""
    storage = Storage(str(tmp_path / "root"))
    sidecars = [PartSaves(storage, _in_process) for _ in parts]
    assert sidecars[0].persist_part("job", str(parts[0]), read_meta(parts[0])) == "written"
    [found] = sidecars[0].abandoned("job", older_than_s=0.0)
    assert found.missing == [1]
    assert sidecars[1].persist_part("job", str(parts[1]), read_meta(parts[1])) == "written"
    sidecars[0].clean(found)
    assert sidecars[0].claims("job") == [5]
    assert sidecars[0].commit_ready("job") == [5]
    step = tmp_path / "root" / "job" / "5"
    assert part_problems(storage, storage.join("job", "5")) == []
    assert _deep_problems(storage, step) == []


def test_a_part_record_naming_a_missing_file_is_never_committed(parts: list[Path], tmp_path: Path) -> None:
    """Defence in depth beside the job's lock: the commit's manifest refuses a step when a file a part record
    names is not in the step (deleted behind the leader's back), so nothing partial is ever committed."""
    from trainer_client.core._errors import StorageError
    from trainer_client.core.format._parts import read_claim, step_path_for

    storage = Storage(str(tmp_path / "root"))
    sidecars = [PartSaves(storage, _in_process) for _ in parts]
    for sidecar, part in zip(sidecars, parts, strict=True):
        assert sidecar.persist_part("job", str(part), read_meta(part)) == "written"
    claim = read_claim(storage, "job", 5)
    assert claim is not None
    where = Path(step_path_for(storage, "job", 5, claim.save_id))
    record = read_part(storage, str(where), 1)
    assert record is not None
    gone = next(f.path for f in record.files if "ocdbt" not in f.path)  # not read by the merge
    (where / gone).unlink()
    with pytest.raises(StorageError, match="missing"):
        sidecars[0].commit_ready("job")
    assert not (where / "commit_success.txt").exists()
    assert not (tmp_path / "root" / "job" / "5").exists()
