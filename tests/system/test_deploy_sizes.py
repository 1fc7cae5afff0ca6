"""The memory tier's volumes in deploy/ hold the snapshots of the manifests' own example job.

Every manifest trains ``python -m train --job=llm-7b``: 7e9 parameters (the ``7b`` of its name) in float32 with
Adam's two moments (``optax.adam`` keeps ``mu`` and ``nu`` in the parameters' dtype), 12 bytes a parameter, 84 GB
of training state (docs/deploy.md, "Sizing the memory tier"). The tier keeps ``MemoryTierOptions.max_snapshots`` of
them, and shared-memory pages count against the container that writes them (the trainer):

- the Pathways head (single controller) holds the whole state, in both the JobSet and the PathwaysJob;
- a TPU host of the multi-controller JobSet holds its part: the state sharded over a slice's hosts and
  replicated across slices, as the README's ``(replica, data)`` mesh lays it out.

So each ``shm`` volume's ``sizeLimit`` must hold ``max_snapshots`` snapshots, and a trainer with a memory limit
must have the volume and Google's figure for the trainer itself (100G on the Pathways head) under it.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.system.test_deploy import _one, _only, _pod_spec, _quantity, _trainer
from tests.system.test_deploy_pathways import HEAD, TRAINER, container, jobset, pod
from tests.system.test_deploy_pathwaysjob import template
from trainer_client.runtime.memory._options import MemoryTierOptions

BYTES_PER_PARAMETER = 12  # float32 weights + Adam's mu and nu, each in the weights' dtype
HEAD_TRAINER_OWN = 100e9  # Google's memory figure for the head's user container (xpk), besides the tier
MAX_SNAPSHOTS = MemoryTierOptions().max_snapshots


def state_bytes(trainer: dict[str, Any]) -> float:
    """The training state of the job the trainer's command names (``--job=llm-<N>b``)."""
    (job,) = [re.fullmatch(r"--job=llm-(\d+)b", arg) for arg in trainer["command"] if arg.startswith("--job=")]
    assert job, trainer["command"]
    return int(job.group(1)) * 1e9 * BYTES_PER_PARAMETER


def shm_limit(pod_spec: dict[str, Any]) -> float:
    volume = _only(pod_spec["volumes"], "shm")["emptyDir"]
    assert volume["medium"] == "Memory"
    return _quantity(volume["sizeLimit"])


def memory_limit(c: dict[str, Any]) -> float | None:
    limit = c.get("resources", {}).get("limits", {}).get("memory")
    return None if limit is None else _quantity(limit)


def test_the_example_state_is_llm_7b_at_84_gb() -> None:
    assert MAX_SNAPSHOTS == 2
    assert state_bytes(container(pod(jobset(), HEAD), TRAINER)) == 84e9


@pytest.mark.parametrize("variant", ["jobset", "pathwaysjob"])
def test_the_pathways_head_holds_every_snapshot_of_the_whole_state(variant: str) -> None:
    head = pod(jobset(), HEAD) if variant == "jobset" else template()["spec"]
    trainer = container(head, TRAINER)
    needed = MAX_SNAPSHOTS * state_bytes(trainer)  # the single controller holds every shard's host copy
    shm = shm_limit(head)
    assert shm >= needed, f"{variant}: /dev/shm {shm / 2**30:.1f} GiB < {MAX_SNAPSHOTS} x the state"
    limit = memory_limit(trainer)
    assert limit is not None and limit >= shm + HEAD_TRAINER_OWN, (
        f"{variant}: the trainer's limit {limit} does not hold the tier's pages and the trainer itself")


def test_a_tpu_host_holds_every_snapshot_of_its_part_of_the_state() -> None:
    js = _one("JobSet")
    (workers,) = js["spec"]["replicatedJobs"]
    hosts_per_slice = workers["template"]["spec"]["parallelism"]
    pod_spec = _pod_spec(js)
    trainer = _trainer(pod_spec)
    sidecar = {e["name"]: e.get("value") for e in _only(pod_spec["initContainers"], "ckptd")["env"]}
    # peer copies on: the newest copy of K other hosts' parts, and one more while a newer copy lands
    held = MAX_SNAPSHOTS + (int(sidecar.get("CKPTD_PEER_COPIES") or 1) + 1 if "CKPTD_PEER_PORT" in sidecar else 0)
    needed = held * state_bytes(trainer) / hosts_per_slice
    shm = shm_limit(pod_spec)
    assert shm >= needed, f"/dev/shm {shm / 2**30:.1f} GiB < {held} x this host's part"
    limit = memory_limit(trainer)
    assert limit is None or limit >= shm, "the tier's pages count against the trainer"
