"""The request counter behind ``gcs_requests_per_{restore,persist}_ratio_vs_orbax`` (bench/gcs_requests.py).

``counted(proxy, work)`` must report exactly the requests ``work`` sent through the proxy, by method, and
nothing sent before it: the bench's ratios are differences of these counts.
"""

from __future__ import annotations

import httpx

from bench.gcs_requests import counted
from tests.support.fault_proxy import FaultProxy
from tests.support.gcs_emulator import GcsEmulator


def test_counted_reports_the_requests_of_its_work_alone(gcs_emulator: GcsEmulator) -> None:
    with FaultProxy(gcs_emulator.url) as proxy, httpx.Client(base_url=proxy.url, trust_env=False) as http:
        assert http.get("/storage/v1/b").status_code == 200  # before: not counted below
        bucket = gcs_emulator.bucket

        def work() -> None:
            for i in range(3):
                up = http.post(f"/upload/storage/v1/b/{bucket}/o", params={"uploadType": "media", "name": f"n{i}"},
                               content=b"x" * (i + 1))
                assert up.status_code == 200, up.text
            listed = http.get(f"/storage/v1/b/{bucket}/o", params={"prefix": "n"})
            assert listed.status_code == 200
            assert {o["name"] for o in listed.json()["items"]} >= {"n0", "n1", "n2"}
            for i in range(3):
                assert http.delete(f"/storage/v1/b/{bucket}/o/n{i}").status_code in (200, 204)

        got = counted(proxy, work)
        assert got == {"requests": 7, "method:POST": 3, "method:GET": 1, "method:DELETE": 3}
        assert counted(proxy, lambda: None) == {}
