"""``ckptd validate`` and ``ckptd gc`` on a root where sidecars hold the job's leadership lease
(docs/multihost.md section 7): they refuse, naming the holder, and write nothing (no adoption manifest, no
deletion); ``--force`` overrides; a released or expired lease lets them run. The lease is a real one
(``ckptd.lease._lease.Lease``) on the job's directory."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ckptd.cli._main import main as ckptd_main
from ckptd.lease._lease import Lease, beat_name, epoch_name, lease_directory
from tests.support.orbax_steps import write_orbax_steps
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import CKPTD_MANIFEST

TTL = 30.0


def _held(root: Path, *, read_only: bool = False) -> Lease:
    storage = Storage(str(root))
    lease = Lease(storage, lease_directory(storage, "job", read_only=read_only), "host-a/123/abcd", TTL)
    lease.tick()
    assert lease.leads()
    return lease


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name) for p in (root / "job").iterdir() if p.name.isdigit())


def test_gc_and_validate_refuse_while_a_sidecar_leads_and_write_nothing(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    write_orbax_steps(tmp_path / "job", [1, 2, 3])
    _held(tmp_path)
    assert ckptd_main(["gc", f"{tmp_path}/job", "--keep-last", "1"]) == 1
    err = capsys.readouterr().err
    assert "led by the sidecar host-a/123/abcd" in err and "lease epoch 0" in err and "--force" in err
    assert ckptd_main(["gc", f"{tmp_path}/job", "--keep-last", "1", "--dry-run"]) == 1  # settling writes too
    assert ckptd_main(["validate", f"{tmp_path}/job", "--deep", "--no-quarantine"]) == 1
    assert "led by the sidecar host-a/123/abcd" in capsys.readouterr().err
    assert _steps(tmp_path) == [1, 2, 3]
    assert not any((tmp_path / "job" / str(s) / CKPTD_MANIFEST).exists() for s in (1, 2, 3))  # nothing adopted
    assert ckptd_main(["gc", f"{tmp_path}/job", "--keep-last", "1", "--force"]) == 0  # the operator's call
    assert _steps(tmp_path) == [3]


def test_a_lease_on_the_side_of_a_read_only_job_counts_too(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    write_orbax_steps(tmp_path / "job", [1])
    _held(tmp_path, read_only=True)
    assert ckptd_main(["validate", f"{tmp_path}/job", "--read-only"]) == 1
    assert "led by the sidecar host-a/123/abcd" in capsys.readouterr().err


def test_a_released_or_expired_lease_does_not_stop_them(tmp_path: Path) -> None:
    write_orbax_steps(tmp_path / "job", [1, 2])
    lease = _held(tmp_path)
    assert lease.release()
    assert ckptd_main(["validate", f"{tmp_path}/job"]) == 0  # a sidecar stopped cleanly: nobody leads
    assert (tmp_path / "job" / "2" / CKPTD_MANIFEST).exists()

    other = tmp_path / "other"
    write_orbax_steps(other / "job", [1, 2])
    _held(other)
    directory = Path(lease_directory(Storage(str(other)), "job"))
    old = time.time() - TTL - 5  # the holder died a while ago: its beat is older than the lease time
    for name in (epoch_name(0), beat_name(0)):
        os.utime(directory / name, (old, old))
    assert ckptd_main(["gc", f"{other}/job", "--keep-last", "1"]) == 0
    assert _steps(other) == [2]
