"""The fault proxy sees every request of a resumable upload, not only the first.

fake-gcs-server answers a resumable upload's first request with the upload's URL in ``Location``, built
from its own ``-external-url`` (the emulator's address). Unless the proxy points that URL back at itself,
the upload's later requests go straight to the emulator: the GCS request counts of bench/gcs_requests.py
miss them and no fault is ever injected into them. And once they pass it, a fault the proxy injects into
an upload's last part must be survivable as on GCS (a retry gets the finished upload's object).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.support.fault_proxy import FaultPlan, FaultProxy
from tests.support.gcs_emulator import GcsEmulator


@contextmanager
def _upload_through(gcs: GcsEmulator, plan: FaultPlan, name: str) -> Iterator[tuple[FaultProxy, httpx.Client, str]]:
    """A proxy with ``plan`` in front of the emulator, a client of it, and the URL of a resumable upload of
    ``name`` started through it (its start is a POST: give ``plan`` ``only_methods`` without POST)."""
    with (
        FaultProxy(gcs.url, plan) as proxy,
        httpx.Client(base_url=proxy.url, trust_env=False, timeout=10) as http,
    ):
        started = http.post(f"/upload/storage/v1/b/{gcs.bucket}/o", params={"uploadType": "resumable", "name": name},
                            json={"name": name})
        assert started.status_code == 200, started.text
        yield proxy, http, started.headers["Location"]


def test_a_gcsfs_resumable_upload_passes_the_proxy_whole(request: pytest.FixtureRequest) -> None:
    gcs: GcsEmulator = request.getfixturevalue("gcs_emulator")
    import gcsfs  # only once the emulator's settings are in place (tests/support/gcs_emulator.py)

    block = gcsfs.core.GCS_MIN_BLOCK_SIZE
    data = bytes(range(256)) * ((block + 1000) // 256 + 1)
    with FaultProxy(gcs.url) as proxy:
        fs = gcsfs.GCSFileSystem(endpoint_url=proxy.url, token="anon", skip_instance_cache=True)
        path = f"{gcs.bucket}/fault-proxy/resumable.bin"
        with fs.open(path, "wb", block_size=block) as f:
            f.write(data)  # over one block: the upload starts, its first block goes, the rest on close
        sent = dict(proxy.stats)
    # the start (uploadType=resumable), then one POST per part to the upload's URL: all three counted here
    assert sent == {"requests": 3, "method:POST": 3}, sent
    assert gcs.other_writer().cat_file(path) == data


def test_the_upload_url_names_the_proxy_and_its_requests_can_be_faulted(request: pytest.FixtureRequest) -> None:
    gcs: GcsEmulator = request.getfixturevalue("gcs_emulator")
    name = "fault-proxy/faulted.bin"
    with _upload_through(gcs, FaultPlan(p_503=1.0, only_methods=frozenset({"PUT"})), name) as (proxy, http, location):
        assert location.startswith(f"{proxy.url}/upload/storage/v1/b/{gcs.bucket}/o?"), location
        assert "upload_id=" in location
        assert proxy.to_proxy("http://example.com:1/x") == "http://example.com:1/x"  # only the upstream's URLs
        refused = http.put(location, content=b"abc", headers={"Content-Range": "bytes 0-2/3"})
        assert refused.status_code == 503 and proxy.stats["fault:503"] == 1  # the follow-up met the plan
        proxy.plan = FaultPlan.healthy()
        done = http.put(location, content=b"abc", headers={"Content-Range": "bytes 0-2/3"})
        assert done.status_code == 200, done.text
        assert proxy.stats["method:PUT"] == 2 and proxy.stats["requests"] == 3
    assert gcs.other_writer().cat_file(f"{gcs.bucket}/{name}") == b"abc"


def test_a_retried_last_part_of_a_finished_upload_gets_its_object_as_on_gcs(request: pytest.FixtureRequest) -> None:
    """The proxy's ``503`` after forwarding the last part: the client retries it; GCS answers with the object,
    fake-gcs-server alone would answer ``404`` (it forgets a finished upload) and fail the client."""
    gcs: GcsEmulator = request.getfixturevalue("gcs_emulator")
    name = "fault-proxy/retried.bin"
    plan = FaultPlan(p_503_after=1.0, only_methods=frozenset({"PUT"}))
    with _upload_through(gcs, plan, name) as (proxy, http, location):
        part = {"content": b"abcd", "headers": {"Content-Range": "bytes 0-3/4"}}
        assert http.put(location, **part).status_code == 503  # it went through; the client is told it did not
        proxy.plan = FaultPlan.healthy()
        retried = http.put(location, **part)
        assert retried.status_code == 200, retried.text
        assert retried.json()["name"] == name and retried.json()["size"] == "4"
        assert proxy.stats["finished_upload_replayed"] == 1
        unknown = http.put(location.replace("upload_id=", "upload_id=0"), **part)
        assert unknown.status_code == 404  # an upload the proxy never saw finish: the emulator's answer as it is
    assert gcs.other_writer().cat_file(f"{gcs.bucket}/{name}") == b"abcd"
