"""One resume step for every host of a multi-process job (docs/multihost.md, "One resume step"): two real JAX
processes (jax.distributed on 127.0.0.1, 4 CPU devices each, one global mesh of 8), each with its own shared
memory, one storage root. A first job saves step 5 to storage (a plain multi-process Orbax save) and keeps
memory snapshots of steps 10 and 20 (each host its own part); a restarted job agrees through JAX's key-value
store (``ResumeAgreement``) and restores. Each step's state differs (``w = arange + step``, ``b = step``), so
the global sums each process computes after the restore say which step the whole job holds. ckptd is not
running: process 0's storage answer is the client's storage scan (one restart has one: its sidecar's answer).
The restarts, each on its own copy of the saved hosts, run one after the other in one restarted 2-process job
(``restarted``): each agrees through its own keys of the job's store and restores as a job started for it would."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from tests.support.helpers import free_port
from tests.support.jax_job import PREAMBLE, run_job
from tests.support.kv_store import InProcessKeyValueStore
from tests.support.server import start_server
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.core.protocol import ResumePlan, ResumeRequest
from trainer_client.errors import NoCheckpointError
from trainer_client.runtime.multihost import _multihost as multihost
from trainer_client.runtime.multihost._multihost import Part, ResumeAgreement, decide

_COMMON = PREAMBLE + """
from trainer_client.runtime.saving._checkpointing import Checkpointer, training_metadata
specs = {"w": P("data"), "b": P()}
def state_of(step):
    w = np.arange(64, dtype=np.float32).reshape(16, 4) + step
    return {"w": jax.make_array_from_callback((16, 4), NamedSharding(mesh, specs["w"]), lambda i: w[i]),
            "b": jax.make_array_from_callback((4,), NamedSharding(mesh, specs["b"]),
                                              lambda i: np.full(4, step, np.float32)[i])}
def meta_of(step, state):
    return training_metadata(step, state, data_position=8 * step, global_batch=8, mesh=mesh, slices=[0])
"""

_BEFORE = _COMMON + """
from trainer_client.runtime.memory._memory_tier import MemoryTier
checkpointer = Checkpointer(root + "/job")
checkpointer.save_with_metadata(5, state_of(5), meta_of(5, state_of(5)))
checkpointer.wait()
tier = MemoryTier(shm, "job", max_snapshots=3, preallocate=False)
for step in (10, 20):
    tier.save(step, state_of(step), meta_of(step, state_of(step)), persist=False)
print("saved", flush=True)
"""

# Every restart of argv[6] ([[name, ckptd url], ...]: the hosts of <base>/<name>), one after the other; the keys of
# each in the job's store under <name>/ (a job started for it alone would have a store of its own).
_AFTER = _COMMON + """
import os
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.core.protocol import ResumeRequest
from trainer_client.runtime.saving._checkpointing import target_shardings
from trainer_client.runtime.multihost._job_store import job_store
from trainer_client.runtime.multihost._multihost import ResumeAgreement
class Scoped:
    def __init__(self, prefix):
        self.store, self.prefix = job_store(), prefix
    def key_value_set(self, key, value, allow_overwrite=False):
        self.store.key_value_set(self.prefix + key, value, allow_overwrite=allow_overwrite)
    def blocking_key_value_get(self, key, timeout_in_ms):
        return self.store.blocking_key_value_get(self.prefix + key, timeout_in_ms)
abstract = jax.eval_shape(lambda: state_of(0))
total_of = jax.jit(lambda s: (s["w"].sum(), s["b"].sum()), out_shardings=NamedSharding(mesh, P()))
out = {}
for name, url in json.loads(sys.argv[6]):
    here = os.path.join(os.path.dirname(root), name)
    client = CkptdClient(ClientSettings(url=url, resume_deadline_s=5, timeout_s=2, report_events=False),
                         root=os.path.join(here, "root"))
    agreement = ResumeAgreement("job", os.path.join(here, f"shm{index}"), client, process_index=index,
                                process_count=2, store=Scoped(name + "/"))
    plan = agreement.plan(ResumeRequest(policy="pause", alive_devices=8, process_count=2))
    state, restored = agreement.restore(plan, lambda p: target_shardings(abstract, mesh, specs, p.arrays))
    total = total_of(state)
    local = [[list(map(int, (s.index[0].start or 0, s.index[0].stop or 16))), float(np.asarray(s.data).sum())]
             for s in state["w"].addressable_shards]
    out[name] = {"step": restored.step, "tier": restored.tier, "path": restored.path, "source": restored.source,
                 "agreed": agreement.decision, "w_sum": float(total[0]), "b_sum": float(total[1]), "local": local}
    client.close()
print(json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Storage step 5 (committed by a 2-process Orbax save); each host's parts of steps 10 and 20 in memory."""
    base = tmp_path_factory.mktemp("job")
    assert run_job(_BEFORE, base) == ["saved", "saved"]
    assert (base / "root" / "job" / "5" / "commit_success.txt").is_file()
    return base


def _wipe_host_1(base: Path) -> None:
    shutil.rmtree(base / "shm1")


def _drop_host_1s_step_20(base: Path) -> None:
    shutil.rmtree(base / "shm1" / "job" / "20")


def _other_save(base: Path) -> None:  # host 1's step 20 as if saved by another incarnation of the job
    meta = base / "shm1" / "job" / "20" / "snapshot.json"
    recorded = json.loads(meta.read_text())
    recorded["save_id"] = "0123456789abcdef-20"
    meta.write_text(json.dumps(recorded))


def _damage(base: Path) -> None:  # intact in size (offered), wrong in bytes (found by the restore's checksums)
    data = base / "shm1" / "job" / "20" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))


# Each restart: what is changed on its copy of the saved hosts first (None: nothing). "ckptd": process 0's sidecar is
# up (on its copy's root); the others have none (the client scans storage).
RESTARTS: dict[str, Callable[[Path], None] | None] = {
    "as_saved": None, "wiped": _wipe_host_1, "ckptd": _wipe_host_1, "different_newest": _drop_host_1s_step_20,
    "other_save": _other_save, "damaged": _damage}


@pytest.fixture(scope="module")
def restarted(saved: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[dict[str, Any]]]]:
    """Per restart of ``RESTARTS``: its copy of the saved hosts, and what each process restored."""
    base = tmp_path_factory.mktemp("restarts")
    for name, change in RESTARTS.items():
        shutil.copytree(saved, base / name, symlinks=True)
        if change is not None:
            change(base / name)
    server = start_server(base / "ckptd" / "root", tmp_path_factory.mktemp("ckptd-state"))
    try:
        none = f"http://127.0.0.1:{free_port()}"
        lines = run_job(_AFTER, base, json.dumps([[name, server.url if name == "ckptd" else none]
                                                  for name in RESTARTS]), timeout_s=300)
    finally:
        server.stop()
    hosts = [json.loads(line) for line in lines]
    return {name: (base / name, [host[name] for host in hosts]) for name in RESTARTS}


def _expected(step: int) -> tuple[float, float]:
    return float(sum(range(64)) + 64 * step), float(4 * step)


def _assert_same_step(hosts: list[dict[str, Any]], step: int, tier: str) -> None:
    assert [(h["step"], h["tier"]) for h in hosts] == [(step, tier), (step, tier)]
    assert all((h["w_sum"], h["b_sum"]) == _expected(step) for h in hosts)  # the global state, seen by each
    for h in hosts:  # and each process's own shards hold that step's rows
        for (start, stop), got in h["local"]:
            assert got == sum(range(start * 4, stop * 4)) + (stop - start) * 4 * step


@pytest.mark.needs_tcp
def test_every_host_restores_the_newest_step_all_hold_in_memory(restarted: dict[str, Any]) -> None:
    _, hosts = restarted["as_saved"]
    _assert_same_step(hosts, 20, "memory")
    assert [Path(h["path"]).parent.parent.name for h in hosts] == ["shm0", "shm1"]  # each from its own part
    # made by the processes from their own memory: neither ckptd's answer nor a storage scan
    assert [h["source"] for h in hosts] == ["memory_agreement", "memory_agreement"]
    assert hosts[0]["agreed"] == hosts[1]["agreed"] and hosts[0]["agreed"]["storage"]["step"] == 5


@pytest.mark.needs_tcp
def test_a_host_whose_memory_was_wiped_sends_every_host_to_storage(restarted: dict[str, Any]) -> None:
    base, hosts = restarted["wiped"]
    _assert_same_step(hosts, 5, "storage")
    assert {h["path"] for h in hosts} == {str(base / "root" / "job" / "5")}
    assert [h["source"] for h in hosts] == ["storage_scan", "storage_scan"]  # no sidecar up: process 0 scanned


@pytest.mark.needs_tcp
def test_with_ckptd_up_every_host_restores_the_step_process_0s_sidecar_names(restarted: dict[str, Any]) -> None:
    _, hosts = restarted["ckptd"]  # host 1's memory wiped, as above
    _assert_same_step(hosts, 5, "storage")
    assert [h["source"] for h in hosts] == ["ckptd", "ckptd"]  # ckptd adopted the plain Orbax step: one answer


@pytest.mark.needs_tcp
def test_hosts_holding_different_newest_steps_agree_on_the_newest_common_one(restarted: dict[str, Any]) -> None:
    _, hosts = restarted["different_newest"]
    _assert_same_step(hosts, 10, "memory")  # host 0 holds 20 and 10, host 1 only 10


@pytest.mark.needs_tcp
def test_parts_of_one_step_from_different_saves_are_not_a_whole(saved: Path, restarted: dict[str, Any]) -> None:
    ids = {json.loads((saved / f"shm{k}" / "job" / "20" / "snapshot.json").read_text())["save_id"] for k in (0, 1)}
    assert len(ids) == 1 and ids.pop().endswith("-20")  # one save: one id in every host's part
    _, hosts = restarted["other_save"]  # host 1's part of 20 recorded as another save's (_other_save)
    _assert_same_step(hosts, 10, "memory")


@pytest.mark.needs_tcp
def test_a_part_found_damaged_at_restore_sends_every_host_to_storage(restarted: dict[str, Any]) -> None:
    _, hosts = restarted["damaged"]  # host 1's part of 20 with a byte flipped (_damage)
    assert [h["agreed"]["tier"] for h in hosts] == ["memory", "memory"]  # agreed on 20, then host 1 failed it
    _assert_same_step(hosts, 5, "storage")  # no host runs on step 20 while another runs on 5


def test_the_decision_takes_the_newest_step_every_process_offered() -> None:
    assert decide([[[20, "a"], [10, "b"]], [[10, "b"]]], 5) == ("memory", 10, "b")
    assert decide([[[20, "a"]], [[20, "other save"]]], 5) == ("storage", 5, None)  # one step, two saves
    assert decide([[[20, "a"]], []], 5) == ("storage", 5, None)  # a host with its memory wiped
    assert decide([[[20, "a"]], [[20, "a"]]], 30) == ("storage", 30, None)  # storage is newer
    assert decide([[[20, "a"]], [[20, "a"]]], 20) == ("memory", 20, "a")  # a tie: memory is the faster restore
    assert decide([[], []], None) == ("none", None, None)


_RUNNER = PREAMBLE + """
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.runtime.elastic._elastic import ElasticConfig, ElasticRunner
from trainer_client.runtime.compilation._options import CompilationOptions
from trainer_client.runtime.elastic._elastic_config import ElasticOptions
from trainer_client.runtime.memory._options import MemoryTierOptions
from trainer_client.runtime.slices._slices import SimulatedSlices
stop = int(sys.argv[7])
cfg = ElasticConfig(job="job", mesh_axes=("replica", "data"), mesh_shape=(1, 8), global_batch=8, checkpoint_period=0,
                    elastic=ElasticOptions(policy="pause"), compilation=CompilationOptions(precompile=False),
                    memory_tier=MemoryTierOptions(shm_dir=shm, memory_period=5, preallocate_snapshots=False))
client = CkptdClient(ClientSettings(url=sys.argv[6], timeout_s=2, resume_deadline_s=5, report_events=False),
                     root=root)
runner = ElasticRunner(cfg, slices=SimulatedSlices(num_slices=1), client=client, checkpoint_dir=root + "/job")
def train(ctx):
    state, step, position = ctx.restore_or_init(lambda: {"w": jax.numpy.zeros((16, 4))}, lambda a: {"w": P("data")})
    first, add = step, jax.jit(lambda s: {"w": s["w"] + 1})
    while step < stop:
        ctx.step_boundary(step, state, position)
        state, step, position = add(state), step + 1, position + 8
    return first, float(jax.jit(lambda s: s["w"].sum(), out_shardings=NamedSharding(ctx.mesh, P()))(state))
result = runner.run(train)
print(json.dumps({"first": result.value[0], "sum": result.value[1], "pid": result.pid, "restored": [
    e.detail for e in result.events if e.kind == "restored"]}), flush=True)
"""


@pytest.mark.needs_tcp
def test_the_elastic_runner_of_every_process_resumes_the_agreed_step(tmp_path: Path) -> None:
    """``ElasticRunner`` in each process of a 2-process job: memory snapshots at steps 5 and 10 of a run to 12;
    the restarted job's runners agree on step 10 and restore it, each from its own host's part."""
    url = f"http://127.0.0.1:{free_port()}"  # no ckptd: process 0's storage answer is the scan (no step there)
    first = [json.loads(line) for line in run_job(_RUNNER, tmp_path, url, "12")]
    assert [(h["first"], h["sum"]) for h in first] == [(0, 64.0 * 12)] * 2
    again = [json.loads(line) for line in run_job(_RUNNER, tmp_path, url, "20")]
    assert [(h["first"], h["sum"]) for h in again] == [(10, 64.0 * 20)] * 2  # 10 steps on from step 10's state
    assert [h["restored"] for h in again] == [[f"from memory: {tmp_path / f'shm{k}' / 'job' / '10'}"] for k in (0, 1)]


def test_process_0_asks_for_the_storage_answer_while_it_lists_its_own_parts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sidecar's storage answer is asked on a thread as process 0 enters the round: here process 0's
    listing of its own parts finishes only once that call has started (asked after the listing, as before,
    process 0 would wait out the listing's timeout and fail). Every process still gets the one decision."""
    asked = threading.Event()
    calls: list[bool] = []

    class Client:
        def resume(self, job: str, request: ResumeRequest) -> ResumePlan:
            calls.append(request.use_memory_tier)
            asked.set()
            raise NoCheckpointError("no committed step")

    def listing(shm_dir: str | None, job: str, index: int, count: int, at_most: int | None = None) -> list[Part]:
        if index == 0:
            assert asked.wait(10), "the storage answer was not asked while process 0 listed its parts"
        return []

    monkeypatch.setattr(multihost, "own_parts", listing)
    store = InProcessKeyValueStore()
    agreements = [ResumeAgreement("job", "/nonexistent", cast(CkptdClient, Client()), process_index=k,
                                  process_count=2, store=store) for k in range(2)]
    plans: dict[int, ResumePlan | None] = {}
    threads = [threading.Thread(target=lambda k=k: plans.__setitem__(k, agreements[k].plan(
        ResumeRequest(policy="pause", alive_devices=8, process_count=2)))) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert plans == {0: None, 1: None}
    assert calls == [False]  # asked once, by process 0, with the memory tier off
    assert agreements[0].decision == agreements[1].decision
    assert agreements[0].decision is not None and agreements[0].decision["tier"] == "none"
    assert {"list_parts_s", "offers_wait_s", "storage_answer_s", "agreement_s"} <= set(agreements[0].timings)
