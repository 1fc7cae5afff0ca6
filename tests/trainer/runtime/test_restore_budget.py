"""A restore keeps to the host-memory cap (``host_bytes`` / ``CKPTD_RESTORE_HOST_BYTES``) and stays exact.

Each restore runs in a child process of its own (``bench.restore_rss``: the kernel's peak RSS, reset just
before the restore), so the figure is that restore's alone. The fake CPU devices keep the restored arrays
in host memory, so the peak is the state itself plus what the restore held besides it; that extra must
stay within the cap plus a bounded overhead. Through Orbax (a compressed step: the direct reader refuses
it) an uncapped restore of this state held ~129 MiB besides it (~1.0x the state: tensorstore's read
buffers), capped at 16 MiB ~50 MiB on an idle machine and up to 65 MiB on a loaded one (tensorstore keeps
more reads in flight); the direct reader holds ~1 MiB either way.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from bench.common import PROFILES
from bench.io import make_state
from bench.restore_rss import digest, measure, peak_reset_problem
from tests.support.helpers import clean_env
from trainer_client.config import reset_client_settings
from trainer_client.runtime.restore._restore_budget import batches, host_budget
from trainer_client.runtime.saving._checkpointing import Checkpointer

LAYOUT = replace(PROFILES["toy"], arrays=8, rows=1536, cols=2816)  # 8 arrays of 16.5 MiB = 132 MiB
CAP = 16 << 20
OVERHEAD = 48 << 20  # what a restore holds besides its batch: tensorstore's pools, zstd contexts, jax
ORBAX_OVERHEAD = 60 << 20  # through Orbax: also its in-flight read buffers (still well under the uncapped ~129 MiB)


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """(an uncompressed step, a compressed step, the state's digest)."""
    if (problem := peak_reset_problem()) is not None:  # the figure is the peak above a reset high-water mark
        pytest.skip(problem)
    base = tmp_path_factory.mktemp("budget")
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    state = make_state(LAYOUT, mesh)
    for name, compression in (("plain", False), ("zstd", True)):
        ck = Checkpointer(str(base / name), compression=compression)
        ck.save(1, state, data_position=0, global_batch=8, mesh=mesh, slices=list(range(8)))
        ck.close()
    return base / "plain" / "1", base / "zstd" / "1", digest(state)


def _extra(result: dict[str, object]) -> int:
    peak = result["peak_above_bytes"]
    assert isinstance(peak, int)
    return peak - LAYOUT.state_bytes


@pytest.mark.needs_devices(8)
def test_capped_restore_through_orbax_is_exact_and_bounded(steps: tuple[Path, Path, str]) -> None:
    _, zstd, want = steps
    # the cap from the environment (ClientSettings), as a user sets it
    result = measure(zstd, "ckptd", arrays=LAYOUT.arrays, rows=LAYOUT.rows, cols=LAYOUT.cols, digest=True,
                     env=clean_env(CKPTD_RESTORE_HOST_BYTES=str(CAP)))
    assert result["digest"] == want
    # one array (16.5 MiB) per batch: the peak is the state plus about one batch, not a second copy of it
    assert _extra(result) <= CAP + ORBAX_OVERHEAD, f"held {_extra(result) / 2**20:.0f} MiB besides the state"
    assert _extra(result) < LAYOUT.state_bytes * 0.6


def test_capped_direct_restore_is_exact_and_bounded(steps: tuple[Path, Path, str]) -> None:
    plain, _, want = steps
    result = measure(plain, "ckptd", arrays=LAYOUT.arrays, rows=LAYOUT.rows, cols=LAYOUT.cols, cap=CAP, digest=True,
                     env=clean_env())
    assert result["digest"] == want
    assert _extra(result) <= CAP + OVERHEAD, f"held {_extra(result) / 2**20:.0f} MiB besides the state"


def test_batches_keep_to_the_budget() -> None:
    sizes = [5, 5, 20, 1, 1, 9]
    assert list(batches(list("abcdef"), sizes, 10)) == [["a", "b"], ["c"], ["d", "e"], ["f"]]
    assert list(batches(list("abcdef"), sizes, None)) == [list("abcdef")]
    assert host_budget(7) == 7
    with pytest.raises(ValueError):
        host_budget(0)


def test_host_budget_reads_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTD_RESTORE_HOST_BYTES", raising=False)
    assert host_budget(None) is None
    monkeypatch.setenv("CKPTD_RESTORE_HOST_BYTES", str(1 << 30))
    assert host_budget(None) is None, "the environment is read once per process"
    reset_client_settings()  # as a new process would read it
    assert host_budget(None) == 1 << 30


def test_batched_orbax_restore_keeps_values_and_every_array(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through Orbax, one array per batch (a 1-byte cap) and the value leaves read at the end: the same tree
    as an uncapped restore."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import trainer_client.runtime.saving._checkpointing as checkpointing
    from trainer_client.runtime.saving._checkpointing import restore

    calls: list[int] = []
    batched = checkpointing.orbax_restore_batched
    monkeypatch.setattr(checkpointing, "orbax_restore_batched",
                        lambda path, target, budget: calls.append(budget) or batched(path, target, budget))

    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    rng = np.random.default_rng(3)
    state = {"w": jax.device_put(rng.standard_normal((16, 4)).astype(np.float32), NamedSharding(mesh, P("data"))),
             "b": jax.device_put(np.arange(8, dtype=np.int32), NamedSharding(mesh, P())), "epoch": 7, "name": "run"}
    ck = Checkpointer(str(tmp_path / "job"), compression=True)
    ck.save(2, state, data_position=0, global_batch=8, mesh=mesh, slices=list(range(8)))
    ck.close()
    target = {k: (jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) if isinstance(v, jax.Array) else v)
              for k, v in state.items()}
    capped = restore(str(tmp_path / "job" / "2"), target, host_bytes=1)
    assert calls == [1]  # the compressed step went through the batched Orbax path
    assert capped["epoch"] == 7 and capped["name"] == "run"
    for k in ("w", "b"):
        assert capped[k].sharding == state[k].sharding
        np.testing.assert_array_equal(np.asarray(capped[k]), np.asarray(state[k]))
