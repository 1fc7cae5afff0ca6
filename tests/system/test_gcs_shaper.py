"""The bucket that behaves like GCS under load (``tests/support/gcs_shaping.py``, ``tests/support/gcs_shaper.py``):
the documented ramp (at most 2x every 20 minutes, only under load) on a clock the test moves, the token buckets of
writes and reads, one write a second per object name, what each request of the JSON API is, and the proxy in
front of the emulator answering 429/503 past the limits, counting every request and refusal, per door."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.gcs_emulator import GcsEmulator
from tests.support.gcs_shaper import GcsShaper
from tests.support.gcs_shaping import (
    BucketRules,
    Limits,
    ManualClock,
    ObjectWrites,
    Op,
    RampingRate,
    TokenBucket,
    classify,
)

PERIOD = 1200.0


def test_the_rate_doubles_at_most_once_a_period_and_only_under_load() -> None:
    rate = RampingRate(1000.0, period_s=PERIOD)
    assert rate.at(0.0) == 1000.0
    rate.ask(10.0, 0.5 * 1000 * PERIOD)  # half the period's capacity asked: busy
    assert rate.at(PERIOD - 1) == 1000.0  # not before the period ends
    assert rate.at(PERIOD) == 2000.0
    rate.ask(PERIOD + 1, 100 * 2000 * PERIOD)  # far more than it takes: still only 2x at the next end
    assert rate.at(2 * PERIOD) == 4000.0
    rate.ask(2 * PERIOD + 1, 0.4 * 4000 * PERIOD)  # under half: no ramp
    assert rate.at(3 * PERIOD) == 4000.0
    assert rate.at(10 * PERIOD) == 4000.0  # idle periods: none either, and never down


def test_a_token_bucket_starts_full_refuses_past_its_burst_and_refills_at_its_rate() -> None:
    bucket = TokenBucket(RampingRate(10.0, period_s=PERIOD), burst_s=1.0)
    assert [bucket.take(0.0) for _ in range(11)] == [True] * 10 + [False]
    assert not bucket.take(0.05)
    assert bucket.take(0.1)  # one token a tenth of a second
    assert not bucket.take(0.1)
    assert sum(bucket.take(5.0) for _ in range(20)) == 10  # never more than the burst


def test_one_write_a_second_per_object_name() -> None:
    writes = ObjectWrites(1.0)
    assert writes.admit("a", 0.0)
    writes.written("a", 0.0)
    assert not writes.admit("a", 0.5) and writes.admit("b", 0.5)
    assert writes.admit("a", 0.5, create_only=True)  # an object is there: it writes nothing (412)
    assert writes.admit("a", 1.0)
    writes.written("a", 0.7)  # two admitted together, both done within the second: recorded, never hidden
    assert writes.twice == [("a", 0.0, 0.7)]
    writes.written("a", 2.0, deleted=True)
    assert not writes.admit("a", 2.5, create_only=True)  # deleted: a create would write


@pytest.mark.parametrize(("method", "target", "body", "expected"), [
    ("POST", "/upload/storage/v1/b/bkt/o?uploadType=multipart&ifGenerationMatch=0",
     b'--==0==\nContent-Type: application/json\n\n{"name": "job/a.json"}\n--==0==\n\nx\n--==0==--',
     Op("write", "bkt", "job/a.json", completes=True, create_only=True)),
    ("POST", "/upload/storage/v1/b/bkt/o?uploadType=media&name=job%2Fd%2F1", b"x", Op("write", "bkt", "job/d/1", True)),
    ("POST", "/upload/storage/v1/b/bkt/o?name=job/m&uploadType=resumable", b"", Op("write", "bkt", "job/m")),
    ("PUT", "/upload/storage/v1/b/bkt/o?uploadType=resumable&upload_id=U1", b"x",
     Op("write", "bkt", "job/r", completes=True, upload_id="U1")),
    ("GET", "/storage/v1/b/bkt/o/job%2Fa.json", b"", Op("read", "bkt", "job/a.json")),
    ("GET", "/storage/v1/b/bkt/o?prefix=job/&delimiter=/", b"", Op("read", "bkt")),
    ("GET", "/download/storage/v1/b/bkt/o/job%2Fa.json?alt=media", b"", Op("read", "bkt", "job/a.json")),
    ("DELETE", "/storage/v1/b/bkt/o/job%2Fa.json", b"", Op("write", "bkt", "job/a.json", completes=True)),
    ("POST", "/storage/v1/b/bkt/o/job%2Fall/compose", b"{}", Op("write", "bkt", "job/all", completes=True)),
    ("POST", "/storage/v1/b", b'{"name": "bkt"}', Op("other")),
])
def test_each_request_is_a_read_or_a_write_of_a_named_object(method: str, target: str, body: bytes,
                                                             expected: Op) -> None:
    assert classify(method, target, body, {"U1": "job/r"}) == expected


def test_refusals_are_counted_by_reason_status_and_door() -> None:
    clock = ManualClock()
    rules = BucketRules(Limits(write_per_s=2.0, read_per_s=4.0, share_503=0.5), clock=clock, seed=3)
    writes = [rules.admit(Op("write", "bkt", f"o{i}", completes=True), "hosts") for i in range(10)]
    reads = [rules.admit(Op("read", "bkt", "o0"), "leader") for _ in range(10)]
    assert writes[:2] == [None, None] and all(r is not None for r in writes[2:])
    assert reads[:4] == [None] * 4 and all(r is not None for r in reads[4:])
    refused = [r for r in writes + reads if r is not None]
    assert {r.status for r in refused} == {429, 503}  # both, from the seeded draw
    stats = rules.snapshot()["stats"]
    assert stats["refused"] == 14 == stats["status:429"] + stats["status:503"]
    assert (stats["refused:write_rate"], stats["refused:read_rate"]) == (8, 6)
    assert (stats["door:hosts:requests"], stats["door:hosts:refused"], stats["door:leader:reads"]) == (10, 8, 10)
    assert stats["admitted_writes"] == 2 and stats["admitted_reads"] == 4


def test_a_bucket_under_load_ramps_on_the_injected_clock() -> None:
    clock = ManualClock()
    rules = BucketRules(Limits(write_per_s=1.0, read_per_s=5.0, burst_s=1.0), clock=clock)
    for i in range(int(PERIOD)):  # asked twice what it takes, for a whole period
        clock.now = float(i)
        rules.admit(Op("write", "bkt", f"a{i}", completes=True))
        rules.admit(Op("write", "bkt", f"b{i}", completes=True))
    assert rules.rate("bkt", "write") == 1.0
    clock.now = PERIOD
    assert rules.rate("bkt", "write") == 2.0
    assert rules.rate("bkt", "read") == 5.0  # reads were not asked for: no ramp


# ---- the proxy in front of the emulator ---------------------------------------------------------------------

def _upload(http: httpx.Client, bucket: str, name: str, data: bytes = b"x") -> httpx.Response:
    return http.post(f"/upload/storage/v1/b/{bucket}/o", params={"uploadType": "media", "name": name}, content=data)


def test_the_proxy_refuses_past_the_rates_as_gcs_does_and_counts_it(gcs_emulator: GcsEmulator) -> None:
    clock = ManualClock()
    limits = Limits(write_per_s=3.0, read_per_s=6.0, share_503=0.0)
    with (GcsShaper(gcs_emulator.url, limits, doors=("hosts", "leader"), clock=clock) as shaper,
          httpx.Client(base_url=shaper.urls["hosts"], trust_env=False, timeout=10) as http):
        bucket = gcs_emulator.bucket
        answers = [_upload(http, bucket, f"shaper/rate/{i}").status_code for i in range(4)]
        assert answers == [200, 200, 200, 429]
        refused = _upload(http, bucket, "shaper/rate/3")
        error = json.loads(refused.content)["error"]
        assert error["code"] == 429 and error["errors"][0]["reason"] == "rateLimitExceeded"
        clock.now = 1.0  # a second's tokens: three more
        assert [_upload(http, bucket, f"shaper/rate/{i}").status_code for i in range(3, 7)] == [200, 200, 200, 429]
        clock.now = 1.5  # rate/3 was written at 1.0: not again within the second
        again = _upload(http, bucket, "shaper/rate/3")
        assert again.status_code == 429 and "object mutation" in json.loads(again.content)["error"]["message"]
        clock.now = 2.0
        assert _upload(http, bucket, "shaper/rate/3", b"y").status_code == 200
        got = http.get(f"/download/storage/v1/b/{bucket}/o/shaper%2Frate%2F3", params={"alt": "media"})
        assert got.status_code == 200 and got.content == b"y"
        snap = httpx.get(f"{shaper.urls['leader']}/_shaper/stats", trust_env=False).json()
    stats = snap["stats"]
    assert stats["refused:write_rate"] == 3 and stats["refused:object_rate"] == 1 and stats["status:429"] == 4
    assert stats["door:hosts:requests"] == 12 and stats.get("door:leader:requests", 0) == 0
    assert snap["objects_written"] == 7 and snap["names_written"] == 6 and snap["twice_count"] == 0


def test_a_resumable_upload_is_one_write_of_its_object_and_its_url_names_the_door(gcs_emulator: GcsEmulator) -> None:
    import gcsfs  # once the emulator's settings are in place (tests/support/gcs_emulator.py)

    with GcsShaper(gcs_emulator.url, doors=("hosts", "leader")) as shaper:
        fs = gcsfs.GCSFileSystem(endpoint_url=shaper.urls["leader"], token="anon", skip_instance_cache=True)
        path = f"{gcs_emulator.bucket}/shaper/resumable.json"
        with fs.open(path, "wb") as f:  # gcsfs writes a file as a resumable upload: its start, then its data
            f.write(b"{}")
        assert gcs_emulator.other_writer().cat_file(path) == b"{}"
        snap = shaper.rules.snapshot()
    assert snap["stats"]["door:leader:writes"] == 2 and snap["stats"].get("door:hosts:requests", 0) == 0
    assert snap["objects_written"] == 1 and snap["most_writes_of_one_name"] == 1
