"""A persistent save's route agreed by every process of a multi-process job (``trainer_client/runtime/
save_route.py``): two real JAX processes, host 1's memory tier full (its one snapshot marked persist, no ckptd
to persist it), host 0's with room. Host 0 takes its snapshot, host 1 cannot; both then save the step through
Orbax — one multi-process Orbax save, committed — instead of host 1 waiting alone in Orbax's barrier."""

from __future__ import annotations

from pathlib import Path

from tests.support.jax_job import PREAMBLE, run_job
from trainer_client.core.format.snapshot import complete_snapshots, read_meta
from trainer_client.core.storage import Storage
from trainer_client.core.validation import latest_good_on_storage

_HOST = PREAMBLE + """
from trainer_client.runtime._saver import Saver
from trainer_client.runtime.checkpointing import Checkpointer, training_metadata
from trainer_client.runtime.memory_tier import MemoryTier
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
    from tests.trainer.test_multihost_parts import _deep_problems

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
