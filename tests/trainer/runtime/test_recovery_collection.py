"""The failed attempt's Python objects are collected after the next attempt's first step, not on the way to it.

During the event the exception's traceback still holds the failed attempt's frames, so a garbage collection
there would scan the whole process and free little; the runner deletes the failed attempt's arrays before the
next attempt (device memory does not wait), keeps the collector off the objects alive at the event until the
first step on the new mesh (``gc.freeze``), then collects them and gives the host memory back.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from examples.elastic_mlp import TrainLog, make_train_fn
from tests.support.elastic_runs import elastic_runner, run_to_end
from trainer_client.runtime.elastic._elastic import ElasticContext, Event
from trainer_client.runtime.slices._slices import SliceFault

FAIL_AT = 12
# no ckptd: the plan comes from the client's scan of storage (a ckptd served from this process would freeze
# objects of its own: its catalog does, once it is built)
NO_CKPTD = "http://127.0.0.1:9"


@pytest.fixture(autouse=True)
def _no_freeze_of_others() -> Any:
    """Start with nothing frozen: an earlier test in this worker may have served a ckptd, whose catalog freezes
    what it built and never unfreezes it (the runner then leaves the collector alone, as it must). Their freeze
    is given back afterwards."""
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    yield
    if frozen:
        gc.freeze()


class _Cycle:
    """An object in a reference cycle: only the garbage collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _recovering_run(tmp_path: Path, url: str, trace: list[str], at_step: Callable[[int, int], None],
                    garbage: list[weakref.ref[_Cycle]] | None = None) -> Any:
    """A run that loses slice 2 at step ``FAIL_AT``; ``trace`` gets every event's kind, ``at_step(attempt,
    step)`` is called after each step boundary, ``garbage`` a weak reference to a cyclic object that the
    failed attempt's frame held. Returns the run's result."""
    attempt = [0]
    garbage = [] if garbage is None else garbage

    def hook(step: int) -> None:
        at_step(attempt[0], step)

    inner = make_train_fn(FAIL_AT + 3, TrainLog(), step_hook=hook, use_precompile=False)

    def train(ctx: ElasticContext) -> Any:
        attempt[0] += 1
        held = _Cycle()  # in this frame until the exception lets go of it, then in its cycle
        if attempt[0] == 1:
            garbage.append(weakref.ref(held))
        return inner(ctx)

    def on_event(event: Event) -> None:
        trace.append(event.kind)

    runner = elastic_runner(tmp_path, url, "resize", faults=[SliceFault(2, FAIL_AT, None)],
                            on_event=on_event, precompile=False)
    return run_to_end(runner, train)


@pytest.mark.needs_devices(4)
def test_no_garbage_collection_between_the_failure_and_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace: list[str] = []
    collect = gc.collect

    def recorded(*args: Any) -> int:
        trace.append("gc.collect")
        return collect(*args)

    monkeypatch.setattr(gc, "collect", recorded)
    after_first: list[tuple[bool, int]] = []  # (the failed attempt's garbage is gone, objects frozen)
    garbage: list[weakref.ref[_Cycle]] = []

    def at_step(attempt: int, step: int) -> None:
        if attempt == 2 and trace.count("first_step_done") == 2 and not after_first:
            after_first.append((garbage[0]() is None, gc.get_freeze_count()))

    result = _recovering_run(tmp_path, NO_CKPTD, trace, at_step, garbage)
    assert [r.kind for r in result.recoveries] == ["slice_down"]
    failed = trace.index("failure_detected")
    first = trace.index("first_step_done", failed)  # the first step on the new mesh
    window = trace[failed:first]
    assert "restored" in window and "gc.collect" not in window, window
    after = trace[first:]
    assert after.index("gc.collect") < after.index("finished"), after  # once the new mesh has stepped
    assert after_first == [(True, 0)], "the failed attempt's garbage outlived the first step, or stayed frozen"


@pytest.mark.needs_devices(4)
def test_the_objects_alive_at_the_event_are_frozen_until_the_first_step(
    tmp_path: Path
) -> None:
    trace: list[str] = []
    frozen: dict[str, int] = {}

    def at_step(attempt: int, step: int) -> None:
        if attempt == 2 and "restored" in trace and "before_first" not in frozen:
            frozen["before_first"] = gc.get_freeze_count()  # the restore is done, the first step not yet
        if attempt == 2 and trace.count("first_step_done") == 2 and "after_first" not in frozen:
            frozen["after_first"] = gc.get_freeze_count()

    assert gc.get_freeze_count() == 0
    result = _recovering_run(tmp_path, NO_CKPTD, trace, at_step)
    assert [r.kind for r in result.recoveries] == ["slice_down"]
    assert frozen["before_first"] > 0 and frozen["after_first"] == 0, frozen
    assert gc.get_freeze_count() == 0


@pytest.mark.needs_devices(4)
def test_a_freeze_that_is_not_the_runners_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that froze its own objects (a pre-fork server does) keeps them frozen: the runner neither
    freezes more nor unfreezes theirs."""
    gc.freeze()
    calls: list[str] = []
    freeze, unfreeze = gc.freeze, gc.unfreeze

    def recorded(name: str, call: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            calls.append(name)
            call()
        return run

    monkeypatch.setattr(gc, "freeze", recorded("freeze", freeze))
    monkeypatch.setattr(gc, "unfreeze", recorded("unfreeze", unfreeze))
    try:
        trace: list[str] = []
        result = _recovering_run(tmp_path, NO_CKPTD, trace, lambda attempt, step: None)
        assert [r.kind for r in result.recoveries] == ["slice_down"]
        assert calls == [] and gc.get_freeze_count() > 0
    finally:
        unfreeze()
