"""A ckptd save on ``gs://`` costs no more storage requests than plain Orbax's save of the same state.

Pins ``gcs_requests_per_persist_ratio_vs_orbax`` (bench/gcs_requests.py) on the requests whose number does
not depend on timing (``settled``): ckptd's manifest costs two (the step's listing, which gives every
file's CRC32C as stored, and the upload), paid for by Orbax's checks ckptd skips on an object store
(docs/gcs.md, Requests): the job root's existence check and barrier, the step's check before the one
Orbax's commit-file path makes anyway, and ckptd's own look for a ``<step>.orbax-checkpoint-tmp`` that
Orbax never makes there. Each of those checks is three requests: any one coming back fails the test. One
request is added back: ckptd's read of ``<step>/commit_success.txt`` before the save, which keeps Orbax from
clearing a step another process committed since the manager listed the job (docs/gcs.md, "Fencing on gs://").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench.gcs_requests import logging_proxy, saves_of, settled
from tests.support.gcs_emulator import GcsEmulator, emulator_env
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import CKPTD_MANIFEST

MARGIN = 3  # settled(orbax) - settled(ckptd): 6 skipped, 2 for the manifest, 1 for the committed-step check


@pytest.fixture
def proxied(gcs_emulator: GcsEmulator, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """The logging proxy in front of the emulator, with gcsfs and tensorstore pointed at it for the test."""
    import gcsfs  # only once the emulator's settings are in place (tests/support/gcs_emulator.py)

    with logging_proxy(gcs_emulator.url) as proxy:
        for key, value in emulator_env(proxy.url).items():
            monkeypatch.setenv(key, value)
        forget_filesystems(gcsfs)  # a cached instance still talks to the emulator itself
        try:
            yield proxy
        finally:
            forget_filesystems(gcsfs)  # and none made here may go on talking to the proxy, gone after the test


def forget_filesystems(gcsfs: Any) -> None:
    """Drop every gcsfs instance a later call would reuse: fsspec's instance cache, and the one etils' ``epath``
    (Orbax's paths) keeps for the whole process (``lru_cache``; made here, it would keep the proxy's URL and its
    own listings for every later test in the process)."""
    from etils.epath import backend

    gcsfs.GCSFileSystem.clear_instance_cache()
    backend._FileSystemSpecBackend._get_filesystem.cache_clear()


def test_a_gcs_save_settles_in_fewer_requests_than_orbax(gcs_emulator: GcsEmulator, proxied: object) -> None:
    ckptd, orbax = saves_of(proxied, gcs_emulator.gs("persist-requests"), arrays=2)
    assert any("ocdbt.process_0%2Fd%2F" in r for r in ckptd)  # tensorstore's writes pass the proxy too

    listing = f"GET /storage/v1/b/{gcs_emulator.bucket}/o?delimiter=&prefix=JOB/1/&maxResults=1000"
    assert ckptd.count(listing) == 1 and listing not in orbax  # the manifest's one listing, with the CRC32Cs
    # its one upload: a simple one (the object's name in the body), the only one of the save; never read back
    manifested = [i for i, r in enumerate(ckptd) if r.startswith("POST") and "uploadType=multipart" in r]
    assert len(manifested) == 1 and not any("uploadType=multipart" in r for r in orbax)
    assert not any("ckptd_manifest.json" in r for r in ckptd)
    step = Storage(gcs_emulator.gs("persist-requests", "ckptd-0", "1"))
    assert step.exists(step.join(CKPTD_MANIFEST))
    committed = [i for i, r in enumerate(ckptd) if r.startswith("POST") and "JOB/1/commit_success.txt" in r]
    assert committed and manifested[0] < committed[-1]  # the manifest before the commit
    assert not any("orbax-checkpoint-tmp" in r for r in ckptd + orbax)
    # the committed-step check: one read of the marker (absent), before the save's first write
    checked = [i for i, r in enumerate(ckptd) if r.startswith("GET ") and "JOB%2F1%2Fcommit_success.txt" in r]
    first_write = next(i for i, r in enumerate(ckptd) if r.startswith(("POST", "PUT", "DELETE")))
    assert len(checked) == 1 and checked[0] < first_write

    # the job root: Orbax checks it twice (create, then its list of steps); ckptd once
    root = [r for r in ckptd if r.split("?")[0].endswith("/o/JOB") or "prefix=JOB/&" in r]
    orbax_root = [r for r in orbax if r.split("?")[0].endswith("/o/JOB") or "prefix=JOB/&" in r]
    assert 0 < len(root) < len(orbax_root), (root, orbax_root)
    assert settled(ckptd) <= settled(orbax) - MARGIN, (settled(ckptd), settled(orbax), ckptd, orbax)
