"""MaxText's own elastic loop, kept, with ckptd's patch: a slice lost mid-run recovers in the same process.

``tests/support/maxtext_loop.py`` reproduces MaxText's call structure (``elastic_retry`` → ``train_loop`` →
``setup_train_loop`` / ``load_state_if_possible`` → the loop with ``maybe_save_checkpoint``) on pathwaysutils'
``Manager.elastic_retry`` over 4 fake slices of 2 CPU devices, with only the lines of
``integrations/maxtext/ckptd.patch`` changed (docs/maxtext.md, "The patch").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.support import maxtext_loop
from tests.support.elastic_runs import in_jax_faults
from tests.support.helpers import REPO
from trainer_client import CkptdClient, ClientSettings, MaxTextHooks
from trainer_client.runtime.slices._jax_faults import Fired, InJaxFaults
from trainer_client.runtime.slices._slice_manager import SliceManager

PATCH = REPO / "integrations" / "maxtext" / "ckptd.patch"
STEPS, PERIOD = 12, 3


@pytest.fixture
def faults() -> Iterator[InJaxFaults]:
    yield from in_jax_faults()


@pytest.fixture
def slice_manager(faults: InJaxFaults) -> Iterator[SliceManager]:
    """MaxText's ``elastic_utils.elastic_manager``, over the fake slices (pathwaysutils' Manager subclassed
    only for CPU devices without ``slice_index``: runtime/slices/_slice_manager.py)."""
    maxtext_loop.elastic_manager = SliceManager(faults.slices.slice_to_devices, monitor_interval_s=0.2)
    yield maxtext_loop.elastic_manager
    maxtext_loop.elastic_manager = None


def _changed_lines(patch: str) -> tuple[list[str], list[str]]:
    lines = [line for line in patch.splitlines() if not line.startswith(("+++", "---"))]
    return [line[1:] for line in lines if line.startswith("+")], [line[1:] for line in lines if line.startswith("-")]


def test_the_reproduction_carries_the_patch_lines_only() -> None:
    added, removed = _changed_lines(PATCH.read_text())
    assert len(added) + len(removed) <= 30
    reproduction = (REPO / "tests" / "support" / "maxtext_loop.py").read_text()
    for line in added:  # MaxText indents by 2, the reproduction by 4: compare the code
        assert line.strip() in reproduction, line
    assert "functools.partial(clean_up_checkpoints" not in reproduction
    assert "ocp.CheckpointManager(" not in reproduction


def test_a_slice_lost_with_a_save_in_flight_recovers_in_this_process(
        tmp_path: Path, ckptd_server: Any, faults: InJaxFaults, slice_manager: SliceManager) -> None:
    run = tmp_path / "run"  # MaxText's <base_output_directory>/<run_name>: ckptd's root
    run.mkdir()
    server = ckptd_server(run)
    config = maxtext_loop.config(str(run / "checkpoints"), STEPS, PERIOD)
    hooks = MaxTextHooks.for_directory(config.checkpoint_dir, CkptdClient(ClientSettings(url=server.url)))

    def hook(step: int) -> None:  # step 6's save was just handed to Orbax's background thread
        if step == 7 and not faults.fired:
            faults.fail_during("to_host", 1, down_for_s=0.05)

    log: list[tuple[int, float]] = []
    train_func = maxtext_loop.get_train_func(config, log, hook)
    state = train_func()

    assert faults.fired == [Fired("to_host", 1, "MainThread", None)]
    assert train_func.events == ["slices_ready", "elastic_event", "slices_ready"]  # MaxText's callbacks still run
    assert hooks.resume_step == 6  # ckptd's answer before the second attempt: the save in flight, fenced
    assert [s for s, _ in log] == list(range(STEPS))  # resumed right after step 6: nothing lost, nothing twice
    np.testing.assert_array_equal(state["w"], np.full_like(state["w"], STEPS))
    assert int(state["step"]) == STEPS
    with ocp.CheckpointManager(run / "checkpoints") as plain:  # plain Orbax reads what the patched loop wrote
        assert list(plain.all_steps()) == [3, 6, 9, 11]


def test_an_elastic_event_deletes_no_step_being_written(tmp_path: Path, slice_manager: SliceManager) -> None:
    config = maxtext_loop.config(str(tmp_path / "run" / "checkpoints"), STEPS, PERIOD)
    hooks = MaxTextHooks.for_directory(config.checkpoint_dir)
    manager = maxtext_loop.create_orbax_checkpoint_manager(config.checkpoint_dir, True, False, PERIOD)
    manager.save(3, args=ocp.args.Composite(items=ocp.args.PyTreeSave({"w": np.ones(4)})))
    writing = Path(config.checkpoint_dir) / "6" / "items"  # a save another process is still writing
    writing.mkdir(parents=True)
    (writing / "manifest.ocdbt").write_bytes(b"partial")

    hooks.on_elastic_event()  # the patched callback: fences this process's saves, deletes nothing
    hooks.before_attempt()
    assert writing.is_dir()
    assert hooks.resume_step == 3  # the marker-less step is never named
    maxtext_loop.clean_up_checkpoints(config.checkpoint_dir)  # the callback the patch replaces
    assert not writing.parent.exists()


def test_the_event_callback_waits_for_saves_and_survives_one_that_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint_dir = str(tmp_path / "run" / "checkpoints")
    hooks = MaxTextHooks.for_directory(checkpoint_dir)
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=True)
    writing = hooks.checkpoint_manager(checkpoint_dir, item_names=("items",), options=options)
    writing.save(3, args=ocp.args.Composite(items=ocp.args.PyTreeSave({"w": np.ones(4)})))
    failing = hooks.checkpoint_manager(checkpoint_dir, item_names=("items",), options=options)
    closed: list[bool] = []

    def lost_with_its_slice() -> None:
        raise RuntimeError("DATA_LOSS: the save's slice is gone")

    monkeypatch.setattr(failing, "wait_until_finished", lost_with_its_slice)
    monkeypatch.setattr(failing, "close", lambda: closed.append(True))

    hooks.on_elastic_event()  # never raises: the next attempt must start
    assert (Path(checkpoint_dir) / "3" / "commit_success.txt").is_file()  # the save in flight finished first
    assert closed == [True]  # the failed save's manager is closed all the same
    hooks.before_attempt()
    assert hooks.resume_step == 3
