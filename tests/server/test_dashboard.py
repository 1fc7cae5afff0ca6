"""The dashboard (GET /) in a real headless Chromium against a real ckptd: what the page SHOWS.

Chromium (Debian's ``chromium``; ``.ci/run`` installs it) loads the page from a server with a token, runs
its JavaScript (the token comes from the URL fragment), and dumps the DOM and a screenshot. The DOM must
show both jobs, every step state (deleted ones from retention's events), the failure and the recovery
with its duration, and the goodput figure ckptd computes; the screenshot must really be painted in the
dashboard's colours. Without the token the page says what is missing instead of showing stale data.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptd.catalog.events import EventStore, record_retention
from ckptd.catalog.retention import Decision
from trainer_client.core.format.files import CHECKPOINT_METADATA, COMMIT_MARKER, QUARANTINE_FILE, TMP_DIR_SUFFIX
from trainer_client.core.format.manifest import quarantine_record
from trainer_client.core.protocol import StepState
from trainer_client.core.storage import Storage

TOKEN = "dash-s3cret"


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("REQUIRE_CHROMIUM") or os.environ.get("CI"):
            pytest.fail("chromium is not installed; .ci/run installs it (apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium); CI installs it")
    return found


def run_chromium(url: str, profile: Path, *extra: str) -> str:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
           f"--user-data-dir={profile}", "--virtual-time-budget=6000", *extra, url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def fake_step(job: Path, step: int, committed_at: float, *, name: str | None = None) -> Path:
    """A finalized step in Orbax's layout (metadata, one item, the commit marker) with ckptd metadata."""
    path = job / (name or str(step))
    (path / "default" / "d").mkdir(parents=True)
    (path / "default" / "_METADATA").write_text("{}")
    (path / "default" / "d" / "chunk").write_bytes(bytes(range(256)) * 4)
    training = {"step": step, "data_position": step * 48, "global_batch": 48, "slices": [0, 1, 2, 3],
                "mesh": {"axis_names": ["replica", "data"], "shape": [4, 2]}, "wall_time": committed_at - 0.5}
    (path / CHECKPOINT_METADATA).write_text(json.dumps({
        "item_handlers": {"default": "StandardCheckpointHandler"}, "commit_timestamp_nsecs": int(committed_at * 1e9),
        "custom_metadata": {"ckptd": training}}))
    (path / COMMIT_MARKER).write_text("committed")
    return path


def history(t0: float) -> list[dict[str, Any]]:
    def ev(t: float, kind: str, step: int | None = None, **fields: Any) -> dict[str, Any]:
        return {"kind": kind, "time": t0 + t, "step": step, "id": f"r:{t}:{kind}", "run": "r", "pid": 4242, **fields}

    return [
        ev(0, "start"), ev(0.5, "slices_ready"), ev(1, "initialized", 0), ev(3, "first_step_done", 1),
        ev(8, "checkpoint_started", 10, blocked_seconds=0.5), ev(13.5, "checkpoint_started", 20, blocked_seconds=0.5),
        ev(16, "failure_detected", 25, detail="DATA_LOSS: slice(s) [3] stopped responding"),
        ev(16.1, "waiting_for_slices"), ev(20, "slices_ready"), ev(20.2, "plan_received", 20),
        ev(21, "restored", 20), ev(24, "first_step_done", 21),
        ev(24, "recovered", 21, recovery_seconds=8.0, lost_steps=5, restored_step=20, mesh_before=[4, 2],
           mesh_after=[3, 2]),
        ev(29, "checkpoint_started", 30, blocked_seconds=0.5), ev(50, "finished", 40),
    ]


@pytest.fixture
def served(tmp_path: Path, ckptd_server: Any) -> tuple[Any, float]:
    root = tmp_path / "root"
    t0 = time.time() - 120
    llama, mlp = root / "llama", root / "mlp"
    for step, at in ((10, 8.2), (20, 13.7), (30, 29.2)):
        fake_step(llama, step, t0 + at)
    bad = fake_step(llama, 35, t0 + 35)
    (bad / QUARANTINE_FILE).write_text(quarantine_record(str(bad), "deep validation failed: crc mismatch", ["crc"]))
    broken = fake_step(llama, 38, t0 + 38)
    (broken / CHECKPOINT_METADATA).write_text("{garbled")
    fake_step(llama, 40, t0 + 49, name=f"40{TMP_DIR_SUFFIX}-1")
    fake_step(mlp, 100, t0 + 40)
    record_retention(EventStore(Storage(str(root))), [
        Decision(5, str(llama / "5"), StepState.VERIFIED, "delete", ["not kept by: keep the last 3"])])
    server = ckptd_server(root, token=TOKEN)
    response = httpx.post(f"{server.url}/v1/jobs/llama/events", json={"events": history(t0)},
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert response.status_code == 200, response.text
    return server, t0


def test_the_dashboard_shows_jobs_steps_events_and_goodput(served: tuple[Any, float], tmp_path: Path) -> None:
    server, _ = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    goodput = httpx.get(f"{server.url}/v1/jobs/llama/goodput", headers=auth, timeout=10).json()["goodput"]
    assert goodput == pytest.approx(0.72)  # 50 s, less startup 2.5, waiting 4, restore 1, recompile 2.5,
    #                                        checkpoint 1.5 and lost 5 x 0.5: 36 s productive

    dom = run_chromium(f"{server.url}/#token={TOKEN}", tmp_path / "profile", "--dump-dom")
    assert '<body data-state="ready">' in dom, dom[-3000:]
    assert TOKEN not in dom  # the token left the address bar and is not shown
    sections = dict(re.findall(r'<section class="job" data-job="([^"]+)">(.*?)</section>', dom, re.S))
    assert set(sections) == {"llama", "mlp"}
    llama = sections["llama"]
    chips = dict(re.findall(r'data-step="(\d+)" data-state="([a-z]+)"', llama))
    assert chips == {"5": "deleted", "10": "verified", "20": "verified", "30": "verified", "35": "quarantined",
                     "38": "corrupt", "40": "writing"}
    assert "latest good: step 30" in llama and "1 quarantined" in llama and "1 deleted" in llama
    shown = re.search(r'data-goodput="([0-9.]+)">([0-9.]+)%<', llama)
    assert shown is not None and float(shown.group(1)) == pytest.approx(goodput, abs=1e-4)
    assert shown.group(2) == f"{100 * goodput:.1f}" == "72.0"
    for cause, seconds in (("waiting", "4.00 s"), ("restore", "1.00 s"), ("recompile", "2.50 s"),
                           ("lost", "2.50 s"), ("checkpoint", "1.50 s")):
        row = re.search(rf'<tr data-cause="{cause}">(.*?)</tr>', llama)
        assert row is not None and seconds in row.group(1), (cause, row and row.group(1))
    failure = re.search(r'<tr class="event kind-failure_detected" data-kind="failure_detected">(.*?)</tr>', llama)
    assert failure is not None and "DATA_LOSS" in failure.group(1) and ">25<" in failure.group(1)
    recovered = re.search(r'<tr class="event kind-recovered" data-kind="recovered">(.*?)</tr>', llama)
    assert recovered is not None and "8.00 s" in recovered.group(1) and "4\u00d72 \u2192 3\u00d72" in recovered.group(1)
    timeline = re.search(r"<svg.*?</svg>", llama, re.S)
    assert timeline is not None  # it draws the outage and the three saves' stalls
    svg = timeline.group(0)
    assert svg.count('data-cause="waiting"') == 1 and svg.count('data-cause="checkpoint"') == 3
    assert "no elastic events reported" in sections["mlp"] and "latest good: step 100" in sections["mlp"]


def test_the_screenshot_is_painted_in_the_dashboards_colours(served: tuple[Any, float], tmp_path: Path) -> None:
    from PIL import Image

    server, _ = served
    shot = tmp_path / "dashboard.png"
    run_chromium(f"{server.url}/#token={TOKEN}", tmp_path / "profile", f"--screenshot={shot}",
                 "--window-size=1400,1000")
    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 1000)
    colours = image.getcolors(maxcolors=1 << 20) or []
    count = {rgb: n for n, rgb in colours}
    for name, rgb in (("productive", (0x43, 0xA0, 0x47)), ("waiting", (0xE5, 0x39, 0x35)),
                      ("verified", (0x2E, 0x7D, 0x32)), ("quarantined", (0xEF, 0x6C, 0x00))):
        assert count.get(rgb, 0) > 100, f"no {name} area painted"


def test_without_the_token_the_page_asks_for_it(served: tuple[Any, float], tmp_path: Path) -> None:
    server, _ = served
    dom = run_chromium(f"{server.url}/", tmp_path / "fresh-profile", "--dump-dom")
    assert '<body data-state="error">' in dom
    assert "requires a bearer token" in dom and "data-job=" not in dom
