"""A persistent save's route agreed by every process of a multi-process job (``trainer_client/runtime/
saving/_save_route.py``): two real JAX processes, host 1's memory tier full (its one snapshot marked persist, no ckptd
to persist it), host 0's with room. Host 0 takes its snapshot, host 1 cannot; both then save the step through
Orbax — one multi-process Orbax save, committed — instead of host 1 waiting alone in Orbax's barrier. A host
whose snapshot fails otherwise still answers the route (threads over ``tests/support/kv_store.py``), and the
route's timeout is a setting."""

from __future__ import annotations

import errno
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.jax_job import PREAMBLE, run_job
from tests.support.kv_store import InProcessKeyValueStore
from trainer_client.config import reset_client_settings
from trainer_client.core._errors import UnsafePathError
from trainer_client.core._storage import Storage
from trainer_client.core._validation import latest_good_on_storage
from trainer_client.core.format._snapshot import read_meta
from trainer_client.core.format._snapshot_dirs import complete_snapshots
from trainer_client.runtime.saving._save_route import SaveRoute
from trainer_client.runtime.saving._saver import Saver

_HOST = PREAMBLE + """
from trainer_client.runtime.saving._saver import Saver
from trainer_client.runtime.saving._checkpointing import Checkpointer, training_metadata
from trainer_client.runtime.memory._memory_tier import MemoryTier
state = {"w": jax.make_array_from_callback((16, 4), NamedSharding(mesh, P("data")),
                                           lambda i: np.arange(64, dtype=np.float32).reshape(16, 4)[i])}
meta = lambda step: training_metadata(step, state, data_position=8 * step, global_batch=8, mesh=mesh, slices=[0])
tier = MemoryTier(shm, "job", max_snapshots=1, preallocate=False)
if index == 1:  # host 1's tier is full: its one snapshot waits for a ckptd that is not there
    tier.save(1, state, meta(1), persist=True)
saver = Saver(Checkpointer(root + "/job"), tier, None)
went = saver.save(2, state, meta(2), persist=True)
saver.wait()
print(went, flush=True)
jax.distributed.shutdown()
"""


def test_one_hosts_full_tier_sends_every_process_to_orbax(tmp_path: Path) -> None:
    from tests.trainer.runtime.test_multihost_parts import _deep_problems

    went = run_job(_HOST, tmp_path, timeout_s=90)  # a hang (one process alone in Orbax's barrier) fails here
    assert went == ["storage", "storage"]
    shm = [tmp_path / f"shm{k}" for k in (0, 1)]
    held = [[p.name for p in complete_snapshots(s, "job")] for s in shm]
    assert held == [["2"], ["1"]]  # host 0 had room (its snapshot stays), host 1's was full
    assert read_meta(shm[0] / "job" / "2").persist
    storage = Storage(str(tmp_path / "root"))
    good = latest_good_on_storage(storage, str(tmp_path / "root" / "job"))
    assert good is not None and good.step == 2  # one multi-process Orbax save, committed
    step = tmp_path / "root" / "job" / "2"
    assert sorted(p.name for p in (step / "default").glob("ocdbt.process_*")) == ["ocdbt.process_0",
                                                                               "ocdbt.process_1"]
    assert _deep_problems(storage, step) == []


@pytest.mark.parametrize(("full", "busy"), [((False, False), (False, False)), ((False, True), (False, False)),
                                            ((False, False), (True, False)), ((True, False), (False, True))])
def test_every_process_gets_one_answer_on_the_route_and_the_skip(full: tuple[bool, bool],
                                                                 busy: tuple[bool, bool]) -> None:
    """Any process's full tier sends all to Orbax; any process's unfinished direct save makes all skip (one
    process skipping while another starts the collective save would leave that one in its barrier)."""
    store = InProcessKeyValueStore()
    routes = [SaveRoute("inc", k, 2, store=store, timeout_ms=10_000) for k in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        for step in (5, 5, 6):  # a step saved twice never reads the earlier save's answers
            answers = list(pool.map(lambda k, s=step: routes[k].agree(s, not full[k], busy[k]), (0, 1)))
            assert answers == [(not any(full), any(busy))] * 2


class _Checkpointer:
    """What the ``Saver`` asks of Orbax's side: the saves it was handed."""

    item = "default"
    last_save_blocked_s = 0.0

    def __init__(self) -> None:
        self.saved: list[int] = []

    def is_saving(self) -> bool:
        return False

    def save_with_metadata(self, step: int, state: object, meta: object, data_iterator: object = None) -> None:
        self.saved.append(step)


class _Tier:
    """A host's memory tier whose snapshot succeeds, or fails with ``error``."""

    last_blocked_s = 0.01

    def __init__(self, error: BaseException | None) -> None:
        self.error = error
        self.saved: list[int] = []

    def save(self, step: int, state: object, meta: object, **_: object) -> None:
        if self.error is not None:
            raise self.error
        self.saved.append(step)


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EIO, "I/O"),
    RuntimeError("a device-to-host copy failed"), UnsafePathError("a directory others may write: refused")],
    ids=["ENOSPC", "EIO", "other", "unsafe"])
def test_a_failed_snapshot_still_answers_the_route(error: BaseException) -> None:
    """Host 1's snapshot fails; host 0's is taken. Before the fix host 1 published no answer unless the error was
    ``MemoryTierFull``, and host 0 waited out the route's timeout (600 s) in ``blocking_key_value_get``. Now an
    ``OSError`` of shared memory counts as a full tier (both save through Orbax), and any other error answers
    ``full`` before it propagates (host 0 goes on to Orbax; host 1 raises), ckptd's refusal of an unsafe directory
    (a ``PermissionError``) among them."""
    store = InProcessKeyValueStore()
    tiers = [_Tier(None), _Tier(error)]
    checkpointers = [_Checkpointer(), _Checkpointer()]
    savers = [Saver(checkpointers[k], tiers[k], None,  # type: ignore[arg-type]
                    route=SaveRoute("inc", k, 2, store=store, timeout_ms=5_000)) for k in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        went = [pool.submit(savers[k].save, 7, {}, None, persist=True) for k in (0, 1)]  # type: ignore[arg-type]
        assert went[0].result(timeout=30) == "storage"  # the old code: the store's wait for host 1 failed
        if isinstance(error, OSError) and not isinstance(error, UnsafePathError):
            assert went[1].result(timeout=30) == "storage"
        else:  # the error stands (ckptd's refusal of an unsafe directory too), once host 1 answered
            with pytest.raises(type(error), match=str(error)):
                went[1].result(timeout=30)
    assert tiers[0].saved == [7]  # host 0's snapshot stays (its ckptd marks it persisted once 7 is committed)
    assert checkpointers[0].saved == [7]
    shm_failed = isinstance(error, OSError) and not isinstance(error, UnsafePathError)
    assert checkpointers[1].saved == ([7] if shm_failed else [])


def test_the_route_timeout_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SaveRoute("inc", 0, 2, store=InProcessKeyValueStore()).timeout_ms == 600_000
    monkeypatch.setenv("CKPTD_ROUTE_TIMEOUT_S", "2.5")
    reset_client_settings()  # the environment is read once per process: as a new process would read it
    assert SaveRoute("inc", 0, 2, store=InProcessKeyValueStore()).timeout_ms == 2_500
    assert SaveRoute("inc", 0, 2, store=InProcessKeyValueStore(), timeout_ms=10).timeout_ms == 10


def test_a_failing_process_raises_without_waiting_for_the_others() -> None:
    """The process whose snapshot failed with an error that stands publishes its answer and raises at once: it
    does not wait for the others' answers (a peer that is itself failing may never give one)."""
    store = InProcessKeyValueStore()
    saver = Saver(_Checkpointer(), _Tier(RuntimeError("a device-to-host copy failed")), None,  # type: ignore[arg-type]
                  route=SaveRoute("inc", 1, 2, store=store, timeout_ms=60_000))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="device-to-host"):
        saver.save(7, {}, None, persist=True)  # type: ignore[arg-type]
    assert time.monotonic() - started < 30, "waited for host 0's answer"
    assert store.blocking_key_value_get("ckptd/save_route/inc/7/0/1", 1_000) == "full"
