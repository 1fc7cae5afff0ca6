"""Verified records (``ckptd_verified.json``) and what they make cheap: a start catalogues a verified step from
that one small file; a damaged or outdated record is never trusted; answers still check the step named;
resume plans are made once per (step, request) and shared by concurrent askers."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ckptd.catalog._catalog as catalog_module
from ckptd.api import _plan_cache
from ckptd.api._plan_cache import PlanCache
from ckptd.catalog._catalog import Catalog
from tests.support.golden import copy_root
from tests.support.helpers import wait_until
from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from trainer_client.core._storage import Storage
from trainer_client.core.format._files import CHECKPOINT_METADATA, VERIFIED_FILE
from trainer_client.core.format._manifest import read_manifest, read_verified_record, training_summary
from trainer_client.core.protocol import StepState

STEPS = [10, 20, 30]


@pytest.fixture(scope="module")
def golden_root(
    tmp_path_factory: pytest.TempPathFactory,
    ) -> Path:
    """job: steps 10, 20, 30 with ckptd training metadata, verified once by a catalog (records written)."""
    root = tmp_path_factory.mktemp("verified-golden")
    write_orbax_jobs({root / "job": STEPS}, custom_metadata={s: training_metadata(s) for s in STEPS})
    first = Catalog(Storage(str(root)), ":memory:")
    first.rebuild()
    assert [c.state for c in first.checkpoints("job")] == [StepState.VERIFIED] * len(STEPS)
    first.close()
    return root


@pytest.fixture
def root(golden_root: Path, tmp_path: Path) -> Path:
    return copy_root(golden_root, tmp_path)  # modification times kept, so the records' fingerprints hold


@pytest.fixture
def inspected(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The step directories the catalog inspects the full way (reading their Orbax metadata)."""
    seen: list[str] = []
    real = catalog_module.inspect_step

    def spy(storage: Storage, entry: Any, **kwargs: Any) -> Any:
        seen.append(entry.name)
        return real(storage, entry, **kwargs)

    monkeypatch.setattr(catalog_module, "inspect_step", spy)
    yield seen


def test_a_start_catalogues_verified_steps_from_their_records_alone(root: Path, inspected: list[str]) -> None:
    cat = Catalog(Storage(str(root)), ":memory:")
    cat.rebuild()
    assert inspected == []  # no step's metadata was read
    infos = cat.checkpoints("job")
    assert [(c.step, c.state) for c in infos] == [(s, StepState.VERIFIED) for s in STEPS]
    for info in infos:  # the training metadata, without the per-array part
        assert info.training is not None and info.training.step == info.step and info.training.arrays == {}
    # the arrays are read when a plan needs them, from the step itself
    layout = cat.layout(infos[-1])
    training = layout.training
    assert training is not None and training.arrays and set(layout.arrays) == set(training.arrays)
    assert layout.mesh == training.mesh


def test_a_damaged_record_is_not_trusted_and_is_rewritten(root: Path, inspected: list[str]) -> None:
    record_path = root / "job" / "20" / VERIFIED_FILE
    data = bytearray(record_path.read_bytes())
    at = data.index(b'"data_position": ') + len(b'"data_position": ')
    data[at] = ord("9") if data[at] != ord("9") else ord("8")  # a plausible, wrong number: still valid JSON
    record_path.write_bytes(bytes(data))
    storage = Storage(str(root))
    assert read_verified_record(storage, str(root / "job" / "20")) is None  # its own checksum catches it

    cat = Catalog(storage, ":memory:")
    cat.rebuild()
    assert inspected == ["20"]  # that step, and only that one, verified the full way
    info = cat.step("job", 20)
    assert info is not None and info.state is StepState.VERIFIED
    manifest = read_manifest(storage, str(root / "job" / "20"))
    assert manifest is not None and info.training == training_summary(manifest.training)  # not the damaged value
    rewritten = read_verified_record(storage, str(root / "job" / "20"))
    assert rewritten is not None and rewritten.training == info.training


def test_a_step_rewritten_after_its_verdict_is_verified_again(root: Path, inspected: list[str]) -> None:
    meta = root / "job" / "30" / CHECKPOINT_METADATA
    stat = meta.stat()
    os.utime(meta, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))  # same bytes, a later write
    cat = Catalog(Storage(str(root)), ":memory:")
    cat.rebuild()
    assert inspected == ["30"]
    assert cat.step("job", 30).state is StepState.VERIFIED  # type: ignore[union-attr]
    # a quarantine record wins over a verified record
    (root / "job" / "20" / "ckptd_quarantine.json").write_text('{"reason": "found bad by an operator"}')
    cat.rebuild()
    assert cat.step("job", 20).state is StepState.QUARANTINED  # type: ignore[union-attr]
    assert cat.confirmed_latest_good("job").step == 30  # type: ignore[union-attr]


def test_the_step_named_is_validated_again_once_its_last_check_is_old(root: Path) -> None:
    cat = Catalog(Storage(str(root)), ":memory:", revalidate_after_s=0.3)
    cat.rebuild()
    assert cat.confirmed_latest_good("job").step == 30  # type: ignore[union-attr]
    data = next(p for p in (root / "job" / "30" / "default").rglob("*") if p.is_file() and p.stat().st_size > 8)
    data.write_bytes(data.read_bytes()[:-4])  # truncated after its verdict
    time.sleep(0.35)
    good = cat.confirmed_latest_good("job")
    assert good is not None and good.step == 20  # 30 failed quick validation: quarantined, files kept
    assert cat.step("job", 30).state is StepState.QUARANTINED  # type: ignore[union-attr]
    assert data.exists()


def test_the_refresher_pass_checks_each_jobs_newest_good_step_ahead_of_answers(root: Path) -> None:
    cat = Catalog(Storage(str(root)), ":memory:", revalidate_after_s=60)
    cat.rebuild()
    (root / "job" / "30" / CHECKPOINT_METADATA).unlink()
    cat.revalidate_latest()  # what the refresher runs after each refresh
    assert cat.latest_good("job").step == 20  # type: ignore[union-attr]
    assert cat.step("job", 30).state is not StepState.VERIFIED  # type: ignore[union-attr]


# ---- the plan cache ------------------------------------------------------------------------------------


def test_concurrent_askers_share_one_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = PlanCache(size=4)
    calls: list[int] = []
    gate = threading.Event()
    waiting: list[int] = []

    class CountedWait(threading.Event):  # the askers waiting on a plan being made, counted
        def wait(self, timeout: float | None = None) -> bool:
            waiting.append(1)
            return super().wait(timeout)

    @dataclasses.dataclass
    class Entry(_plan_cache._Entry):
        ready: threading.Event = dataclasses.field(default_factory=CountedWait)

    monkeypatch.setattr(_plan_cache, "_Entry", Entry)

    def plan() -> bytes:
        calls.append(1)
        gate.wait(60)
        return b'{"step": 30}'

    source = object()
    answers: list[bytes] = []
    threads = [threading.Thread(target=lambda: answers.append(cache.answer("p", "r", source, plan)))
               for _ in range(16)]
    for t in threads:
        t.start()
    # the plan is let go only once the other 15 wait on it (counted: a 0.2 s sleep let a loaded machine start
    # them after it was made, when they would have found it kept instead)
    wait_until(lambda: len(waiting) == 15, timeout=30, interval=0.01, what="15 askers waiting on the plan")
    gate.set()
    for t in threads:
        t.join(10)
    assert answers == [b'{"step": 30}'] * 16 and len(calls) == 1
    assert (cache.misses, cache.hits) == (1, 15)
    # another request, or the same one for a step loaded again (a new layout object), is planned afresh
    assert cache.answer("p", "other", source, lambda: b"2") == b"2"
    assert cache.answer("p", "r", object(), lambda: b"3") == b"3"


def test_a_refusal_is_not_kept() -> None:
    cache = PlanCache()
    source = object()

    def refuse() -> bytes:
        raise ValueError("does not fit")

    with pytest.raises(ValueError, match="does not fit"):
        cache.answer("p", "r", source, refuse)
    assert cache.answer("p", "r", source, lambda: b"ok") == b"ok"
    for n in range(10):  # bounded
        cache.answer("p", str(n), source, lambda: b"x")
    assert len(cache._entries) <= cache.size


def test_training_metadata_that_differs_from_the_manifest_is_caught_on_the_full_path(root: Path) -> None:
    meta = root / "job" / "20" / CHECKPOINT_METADATA
    text = meta.read_text()
    doc = json.loads(text)
    position = doc["custom_metadata"]["ckptd"]["data_position"]
    other = position + 1 if position % 10 != 9 else position - 1
    forged = text.replace(f'"data_position": {position}', f'"data_position": {other}')
    assert forged != text and len(forged) == len(text)  # same size: only the content check can tell
    meta.write_text(forged)
    cat = Catalog(Storage(str(root)), ":memory:")
    cat.rebuild()  # the record's fingerprint of _CHECKPOINT_METADATA no longer holds: verified the full way
    info = cat.step("job", 20)
    assert info is not None and info.state is StepState.QUARANTINED
    assert "training metadata differs from the manifest" in (info.reason or "")
