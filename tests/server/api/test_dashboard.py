"""The dashboard (GET /) in a real headless Chromium against a real ckptd: what the page SHOWS.

Chromium (Debian's ``chromium``; ``.ci/run`` installs it) loads the page from a server with a token (taken
from the URL fragment), runs its JavaScript, and the tests read what it laid out: the DOM dumped by the
command line, and, driven over the DevTools pipe (tests/support/chromium.py), the positions, colours and
widths of what was drawn, with screenshots saved next to the test's files. The DOM must show both jobs,
every step state (deleted ones from retention's events), the failure and the recovery with its duration,
and the goodput figure ckptd computes. The timeline places a step where it was SAVED (step 20 here was
saved before the failure and committed by ckptd after it), draws the memory snapshots a recovery restores
from on their own lane, and has a step axis; bad steps say why in plain text; a short run's goodput is
shown with its window and a note in a neutral colour; an unknown ``?job=`` is named; the auto-refresh
checkbox sits by its label; at 800 px nothing scrolls sideways. Without the token the page says what is
missing instead of showing stale data.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptd.catalog._retention import Decision, record_retention
from ckptd.events._events import EventStore
from tests.support.chromium import Browser, run_chromium
from tests.support.server import ServerHandle, start_server
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import CHECKPOINT_METADATA, COMMIT_MARKER, QUARANTINE_FILE, TMP_DIR_SUFFIX
from trainer_client.core.format._manifest import quarantine_record
from trainer_client.core.protocol import StepState

TOKEN = "dash-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SAVED_20, COMMITTED_20, FAILURE = 13.51, 17.0, 16.0  # step 20: saved before the failure, committed after it
GREEN, NEUTRAL = "rgb(46, 125, 50)", "rgb(29, 35, 41)"  # --verified and --fg of dashboard.html


def fake_step(job: Path, step: int, saved_at: float, committed_at: float, *, name: str | None = None) -> Path:
    """A finalized step in Orbax's layout (metadata, one item, the commit marker) with ckptd metadata."""
    path = job / (name or str(step))
    (path / "default" / "d").mkdir(parents=True)
    (path / "default" / "_METADATA").write_text("{}")
    (path / "default" / "d" / "chunk").write_bytes(bytes(range(256)) * 4)
    training = {"step": step, "data_position": step * 48, "global_batch": 48, "slices": [0, 1, 2, 3],
                "mesh": {"axis_names": ["replica", "data"], "shape": [4, 2]}, "wall_time": saved_at}
    (path / CHECKPOINT_METADATA).write_text(json.dumps({
        "item_handlers": {"default": "StandardCheckpointHandler"}, "commit_timestamp_nsecs": int(committed_at * 1e9),
        "custom_metadata": {"ckptd": training}}))
    (path / COMMIT_MARKER).write_text("committed")
    return path


def _event(t0: float, t: float, kind: str, step: int | None = None, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "time": t0 + t, "step": step, "id": f"r:{t}:{kind}", "run": "r", "pid": 4242, **fields}


def history(t0: float) -> list[dict[str, Any]]:
    """50 s of a job: saves to storage and to host memory every 0.5 s step, a failure at step 25, a
    recovery from the memory snapshot of step 24 (one step lost), more saves."""
    def save(t: float, step: int, tier: str, blocked: float) -> dict[str, Any]:
        return _event(t0, t, "checkpoint_started", step, detail=f"{tier}, {blocked:.3f}s blocked",
                      blocked_seconds=blocked)

    ev = lambda t, kind, step=None, **f: _event(t0, t, kind, step, **f)  # noqa: E731
    return [
        ev(0, "start"), ev(0.5, "slices_ready"), ev(1, "initialized", 0), ev(3, "first_step_done", 1),
        save(8, 10, "storage", 0.5), save(10.51, 15, "memory", 0.01), save(SAVED_20, 20, "memory+persist", 0.5),
        save(15.52, 24, "memory", 0.01),
        ev(FAILURE, "failure_detected", 25, detail="DATA_LOSS: slice(s) [3] stopped responding"),
        ev(16.1, "waiting_for_slices"), ev(20, "slices_ready"), ev(20.2, "plan_received", 24),
        ev(21, "restored", 24, detail="from memory: /dev/shm/ckptd/llama/24"), ev(24, "first_step_done", 25),
        ev(24, "recovered", 25, recovery_seconds=8.0, lost_steps=1, restored_step=24, mesh_before=[4, 2],
           mesh_after=[3, 2]),
        save(27, 30, "storage", 0.5), ev(50, "finished", 40),
    ]


def two_hours(t0: float) -> list[dict[str, Any]]:
    """A long run: two hours, a save every half hour."""
    return [_event(t0, 0, "start"), _event(t0, 1, "slices_ready"), _event(t0, 2, "initialized", 0),
            _event(t0, 60, "first_step_done", 1),
            *(_event(t0, 60 + 1800 * i, "checkpoint_started", 1000 * i, detail="storage, 2.000s blocked",
                     blocked_seconds=2.0) for i in (1, 2, 3)),
            _event(t0, 7200, "finished", 4000)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerHandle, float]]:
    """One ckptd for the module (each test loads the page afresh): jobs llama (a short run with a failure),
    mlp (no events) and long (two hours, no failure)."""
    root = tmp_path_factory.mktemp("dashboard") / "root"
    now = time.time()
    t0 = now - 60  # the run: t0 .. t0 + 50; retention deletes a step now
    llama, mlp, long = root / "llama", root / "mlp", root / "long"
    fake_step(llama, 10, t0 + 8, t0 + 8.2)
    fake_step(llama, 20, t0 + SAVED_20, t0 + COMMITTED_20)
    fake_step(llama, 30, t0 + 27, t0 + 27.2)
    bad = fake_step(llama, 35, t0 + 34.5, t0 + 35)
    (bad / QUARANTINE_FILE).write_text(quarantine_record(str(bad), "deep validation failed: crc mismatch", ["crc"]))
    broken = fake_step(llama, 38, t0 + 37.5, t0 + 38)
    (broken / CHECKPOINT_METADATA).write_text("{garbled")
    fake_step(llama, 40, t0 + 48.5, t0 + 49, name=f"40{TMP_DIR_SUFFIX}-1")
    fake_step(mlp, 100, t0 + 39.5, t0 + 40)
    fake_step(long, 3000, now - 1800, now - 1790)
    record_retention(EventStore(Storage(str(root))), [
        Decision(5, str(llama / "5"), StepState.VERIFIED, "delete", ["not kept by: keep the last 3"])])
    server = start_server(root, tmp_path_factory.mktemp("ckptd-state"), token=TOKEN)
    try:
        for job, events in (("llama", history(t0)), ("long", two_hours(now - 7300))):
            response = httpx.post(f"{server.url}/v1/jobs/{job}/events", json={"events": events}, headers=AUTH,
                                  timeout=10)
            assert response.status_code == 200, response.text
        yield server, t0
    finally:
        server.stop()


def dump_dom(url: str, profile: Path) -> str:
    """The page's DOM once its scripts ran, without the script's own source (which holds every message)."""
    return re.sub(r"<script>.*?</script>", "", run_chromium(url, profile, "--dump-dom"), flags=re.S)


def api(server: ServerHandle, path: str) -> Any:
    response = httpx.get(f"{server.url}/v1/jobs/{path}", headers=AUTH, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_dashboard_shows_jobs_steps_events_and_goodput(served: tuple[ServerHandle, float], tmp_path: Path) -> None:
    server, _ = served
    goodput = api(server, "llama/goodput")["goodput"]
    assert goodput == pytest.approx(0.7596)  # 50 s, less startup 2.5, waiting 4, restore 1, recompile 2.5,
    #                                        checkpoint 1.52 and lost 1 x 0.5: 37.98 s productive

    dom = dump_dom(f"{server.url}/#token={TOKEN}", tmp_path / "profile")
    assert '<body data-state="ready">' in dom, dom[-3000:]
    assert TOKEN not in dom  # the token left the address bar and is not shown
    sections = dict(re.findall(r'<section class="job" data-job="([^"]+)">(.*?)</section>', dom, re.S))
    assert set(sections) == {"llama", "mlp", "long"}
    llama = sections["llama"]
    chips = dict(re.findall(r'class="chip state-[a-z]+" data-step="(\d+)" data-state="([a-z]+)"', llama))
    assert chips == {"5": "deleted", "10": "verified", "20": "verified", "30": "verified", "35": "quarantined",
                     "38": "corrupt", "40": "writing"}
    assert "latest good: step 30" in llama and "1 quarantined" in llama and "1 deleted" in llama
    shown = re.search(r'data-goodput="([0-9.]+)">([0-9.]+)%<', llama)
    assert shown is not None and float(shown.group(1)) == pytest.approx(goodput, abs=1e-4)
    assert shown.group(2) == f"{100 * goodput:.1f}" == "76.0"
    for cause, seconds in (("waiting", "4.00 s"), ("restore", "1.00 s"), ("recompile", "2.50 s"),
                           ("lost", "500 ms"), ("checkpoint", "1.52 s")):
        row = re.search(rf'<tr data-cause="{cause}">(.*?)</tr>', llama)
        assert row is not None and seconds in row.group(1), (cause, row and row.group(1))
    failure = re.search(r'<tr class="event kind-failure_detected" data-kind="failure_detected">(.*?)</tr>', llama)
    assert failure is not None and "DATA_LOSS" in failure.group(1) and ">25<" in failure.group(1)
    recovered = re.search(r'<tr class="event kind-recovered" data-kind="recovered">(.*?)</tr>', llama)
    assert recovered is not None and "8.00 s" in recovered.group(1) and "4\u00d72 \u2192 3\u00d72" in recovered.group(1)
    timeline = re.search(r"<svg.*?</svg>", llama, re.S)
    assert timeline is not None  # it draws the outage and the five saves' stalls
    svg = timeline.group(0)
    assert svg.count('data-cause="waiting"') == 1 and svg.count('data-cause="checkpoint"') == 5
    assert "no elastic events reported" in sections["mlp"] and "latest good: step 100" in sections["mlp"]


# What the laid-out llama section shows, measured in the page (centres of the drawn shapes, in CSS pixels).
MEASURE_TIMELINE = """(() => {
  const s = document.querySelector('section[data-job="llama"]');
  const at = (node) => { if (!node) return null; const r = node.getBoundingClientRect();
                         return {x: r.left + r.width / 2, y: r.top + r.height / 2, left: r.left, right: r.right}; };
  const one = (sel) => at(s.querySelector(sel));
  return {
    failure: one('svg .ev[data-kind="failure_detected"]'), restore: one('svg .ev[data-kind="restored"]'),
    steps: Object.fromEntries([...s.querySelectorAll('svg g.ck')].map((g) => [g.dataset.step, {
      dot: at(g.querySelector('circle:not(.restored-from)')), state: g.dataset.state,
      commit: at(g.querySelector('line:nth-of-type(2)'))}])),
    snaps: [...s.querySelectorAll('svg g.snap')].map((g) => ({step: +g.dataset.step, tier: g.dataset.tier,
      restored: g.dataset.restored === 'yes', ...at(g.querySelector('rect'))})),
    stepTicks: [...s.querySelectorAll('svg .step-axis text')].filter((t) => t.dataset.step)
      .map((t) => ({step: +t.dataset.step, ...at(t)})),
    timeTicks: s.querySelectorAll('svg .time-axis text[data-t]').length,
  };
})()"""

MEASURE_TEXT = """(() => {
  const s = (job) => document.querySelector(`section[data-job="${job}"]`);
  const big = (job) => { const b = s(job).querySelector('.goodput .big');
                         return {text: b.innerText, colour: getComputedStyle(b).color}; };
  const bad = s('llama').querySelector('table.bad-steps');
  return {
    llamaText: s('llama').innerText, longText: s('long').innerText, llama: big('llama'), long: big('long'),
    badRows: bad ? Object.fromEntries([...bad.querySelectorAll('tr[data-step]')]
                                      .map((r) => [r.dataset.step, r.innerText])) : null,
  };
})()"""

MEASURE_CHECKBOX = """(() => {
  const box = document.getElementById('auto');
  const label = box.closest('label') || document.querySelector('label[for=auto]');
  const walk = document.createTreeWalker(label, NodeFilter.SHOW_TEXT);
  let text = null;
  while (walk.nextNode()) if (walk.currentNode.textContent.trim()) { text = walk.currentNode; break; }
  const range = document.createRange(); range.selectNodeContents(text);
  const b = box.getBoundingClientRect(), t = range.getBoundingClientRect();
  return {word: text.textContent.trim(), gap: t.left - b.right, width: b.width,
          dy: Math.abs((t.top + t.bottom) / 2 - (b.top + b.bottom) / 2)};
})()"""

MEASURE_WIDTH = """(() => {
  const width = document.documentElement.clientWidth;
  const over = [...document.querySelectorAll('body *')].filter((e) => {
    const r = e.getBoundingClientRect(); return r.width > 0 && r.right > width + 0.5; })
    .map((e) => `${e.tagName}.${e.getAttribute('class') || ''}: ${Math.round(e.getBoundingClientRect().right)}`);
  return {width, scroll: Math.max(document.documentElement.scrollWidth, document.body.scrollWidth),
          overflow: [document.documentElement, document.body].map((e) => getComputedStyle(e).overflowX).join(' '),
          over: over.slice(0, 10)};
})()"""

READY = "document.body.dataset.state === 'ready' && document.querySelectorAll('svg.timeline').length === 3"


def painted(shot: Path) -> dict[Any, int]:
    """How many pixels of each colour the screenshot holds."""
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    return {rgb: n for n, rgb in image.getcolors(maxcolors=1 << 22) or []}


def check_checkbox(browser: Browser) -> None:
    box = browser.evaluate(MEASURE_CHECKBOX)
    assert box["word"] == "auto-refresh"
    # The box itself small (a wide box draws its tick far from the label), right before the text, centred.
    assert box["width"] <= 20 and 0 <= box["gap"] <= 10 and box["dy"] <= 3, f"checkbox apart from its label: {box}"


def test_the_timeline_goodput_bad_steps_and_header_as_laid_out(served: tuple[ServerHandle, float],
                                                                tmp_path: Path) -> None:
    server, _ = served
    reasons = {str(c["step"]): c["reason"] for c in api(server, "llama/checkpoints")["checkpoints"]
               if c["state"] in ("quarantined", "corrupt")}
    assert set(reasons) == {"35", "38"} and all(reasons.values())
    with Browser(tmp_path / "cdp") as browser:
        browser.open(f"{server.url}/#token={TOKEN}", width=1400, height=1000)
        browser.wait_for(READY)
        shot = browser.screenshot(tmp_path / "dashboard-1400.png")
        tl = browser.evaluate(MEASURE_TIMELINE)
        text = browser.evaluate(MEASURE_TEXT)
        check_checkbox(browser)

    # Steps at their save time: 20 was saved before the failure (its commit, by ckptd, came after it).
    steps, failure = tl["steps"], tl["failure"]
    assert failure is not None and set(steps) == {"10", "20", "30", "35"}, tl  # 38: unreadable metadata, no time
    assert steps["10"]["dot"]["x"] < steps["20"]["dot"]["x"] < failure["x"] < steps["30"]["dot"]["x"], tl
    assert steps["20"]["commit"] is not None and steps["20"]["commit"]["x"] > failure["x"]
    # Memory snapshots on their own lane, the one a recovery restored from marked; restores after failures.
    snaps = {s["step"]: s for s in tl["snaps"]}
    assert set(snaps) == {15, 20, 24}, snaps
    assert snaps[15]["tier"] == snaps[24]["tier"] == "memory" and snaps[20]["tier"] == "memory+persist"
    assert [s for s in snaps if snaps[s]["restored"]] == [24]
    assert snaps[24]["x"] < failure["x"] < tl["restore"]["x"]
    assert all(abs(s["y"] - steps["10"]["dot"]["y"]) >= 15 for s in snaps.values())  # not the storage lane
    # A step axis: failure and restore steps labelled where they happened, labels apart, in time order.
    ticks = tl["stepTicks"]
    near = lambda step, x: any(t["step"] == step and abs(t["x"] - x) < 2 for t in ticks)  # noqa: E731
    assert near(25, failure["x"]) and near(24, tl["restore"]["x"]), ticks
    lined = sorted(ticks, key=lambda t: t["x"])
    assert all(a["right"] <= b["left"] for a, b in itertools.pairwise(lined)), "step labels overlap"
    assert len(ticks) >= 5 and tl["timeTicks"] >= 4

    # Bad steps say why, in plain text (innerText holds only what is rendered, not tooltips).
    assert text["badRows"] is not None and set(text["badRows"]) == {"35", "38"}, text["badRows"]
    for step, reason in reasons.items():
        assert reason in text["badRows"][step] and reason in text["llamaText"]
    # A 50 s run: goodput with its window, productive and not, a note, no alarm colour; a 2 h run is judged.
    assert text["llama"]["colour"] == NEUTRAL and text["llama"]["text"] == "76.0%"
    assert "goodput over 50.0 s" in text["llamaText"]
    assert "productive 38.0 s, not productive 12.0 s" in text["llamaText"]
    assert "too short to judge goodput" in text["llamaText"]
    assert text["long"]["colour"] == GREEN and "too short" not in text["longText"]

    count = painted(shot)
    for name, rgb, least in (("productive", (0x43, 0xA0, 0x47), 100), ("waiting", (0xE5, 0x39, 0x35), 100),
                             ("verified", (0x2E, 0x7D, 0x32), 100), ("quarantined", (0xEF, 0x6C, 0x00), 100),
                             ("memory snapshots", (0x00, 0x89, 0x7B), 40)):
        assert count.get(rgb, 0) > least, f"no {name} area painted ({shot})"


def test_at_800_px_nothing_scrolls_sideways(served: tuple[ServerHandle, float], tmp_path: Path) -> None:
    server, _ = served
    with Browser(tmp_path / "cdp") as browser:
        browser.open(f"{server.url}/#token={TOKEN}", width=800, height=1000)
        browser.wait_for(READY)
        browser.screenshot(tmp_path / "dashboard-800.png")
        width = browser.evaluate(MEASURE_WIDTH)
        check_checkbox(browser)
    assert width["width"] == 800 and "hidden" not in width["overflow"], width
    assert width["scroll"] <= 800 and not width["over"], width


def test_an_unknown_job_is_named_with_the_jobs_there(served: tuple[ServerHandle, float], tmp_path: Path) -> None:
    server, _ = served
    dom = dump_dom(f"{server.url}/?job=unknown#token={TOKEN}", tmp_path / "profile")
    assert "job 'unknown' not found" in dom and "no jobs" not in dom, dom[-3000:]
    assert set(re.findall(r'<a href="\?job=([a-z]+)">', dom)) == {"llama", "mlp", "long"}
    assert "data-job=" not in dom
    one = dump_dom(f"{server.url}/?job=mlp#token={TOKEN}", tmp_path / "profile")
    assert re.findall(r'<section class="job" data-job="([^"]+)">', one) == ["mlp"] and "not found" not in one


def test_without_the_token_the_page_asks_for_it(served: tuple[ServerHandle, float], tmp_path: Path) -> None:
    server, _ = served
    dom = dump_dom(f"{server.url}/", tmp_path / "fresh-profile")
    assert '<body data-state="error">' in dom
    assert "requires a bearer token" in dom and "data-job=" not in dom
