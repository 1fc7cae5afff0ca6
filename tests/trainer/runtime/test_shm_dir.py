"""One shared-memory directory per trainer process: ``CKPTD_SHM_DIR`` (``ClientSettings.shm_dir``), which the
runner's memory tier defaults to (``ElasticConfig.with_shm_dir``), so the tier it snapshots into and the
directory the client's own plan from storage reads are the same; ``MemoryTierOptions(shm_dir=...)`` still
overrides it, with a deprecation warning where it names another directory (docs/operations.md, "Settings")."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.runtime.compilation._options import CompilationOptions
from trainer_client.runtime.elastic._elastic import ElasticRunner
from trainer_client.runtime.elastic._elastic_config import ElasticConfig
from trainer_client.runtime.memory._options import MemoryTierOptions
from trainer_client.runtime.slices._slices import SimulatedSlices

MESH: dict[str, Any] = {"job": "job", "mesh_axes": ("replica", "data"), "mesh_shape": (4, 2), "global_batch": 8}


def test_the_tier_takes_the_clients_directory_when_none_is_given() -> None:
    config = ElasticConfig(**MESH, memory_tier=MemoryTierOptions(memory_period=5, max_snapshots=3))
    assert config.with_shm_dir(None) is config, "no directory anywhere: the tier stays off"
    resolved = config.with_shm_dir("/dev/shm/tier")
    assert resolved.memory_tier == MemoryTierOptions(shm_dir="/dev/shm/tier", memory_period=5, max_snapshots=3)
    assert resolved.elastic == config.elastic and resolved.job == config.job


def test_a_directory_given_in_code_wins_and_one_apart_from_the_clients_is_deprecated() -> None:
    given = ElasticConfig(**MESH, memory_tier=MemoryTierOptions(shm_dir="/dev/shm/a"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert given.with_shm_dir("/dev/shm/a/") is given, "the same directory, spelled otherwise: no warning"
        off = ElasticConfig(**MESH, memory_tier=MemoryTierOptions(shm_dir=""))
        assert off.with_shm_dir("/dev/shm/b").memory_tier.shm_dir == "", "an empty directory: the tier off"
    for client_dir in ("/dev/shm/b", None):
        with pytest.warns(DeprecationWarning, match=r"MemoryTierOptions\(shm_dir='/dev/shm/a'\) apart from .*"
                                                     r"is deprecated: set CKPTD_SHM_DIR"):
            assert given.with_shm_dir(client_dir) is given


@pytest.mark.needs_devices(8)
def test_the_runner_snapshots_into_the_clients_directory(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    settings = ClientSettings(url="http://127.0.0.1:9", report_events=False, shm_dir=str(shm))
    config = ElasticConfig(**MESH, compilation=CompilationOptions(precompile=False))
    client = CkptdClient(settings, root=str(tmp_path))
    runner = ElasticRunner(config, slices=SimulatedSlices(num_slices=4), client=client,
                           checkpoint_dir=str(tmp_path / "job"))
    try:
        assert runner.config.memory_tier.shm_dir == str(shm)
        assert runner.saver.memory is not None and runner.saver.memory.dir.parent == shm
    finally:
        runner.saver.close()
        runner.checkpointer.close()
