"""A memory plan whose snapshot cannot be resumed from goes to storage (``_saver.restore_plan``): bytes that no
longer match their checksums, or a snapshot gone by the time it is read (evicted between the plan naming it
and the restore). A storage plan's errors stand, and so does the memory error when the storage step needs
another mesh."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from trainer_client.core._errors import StoredFormatError
from trainer_client.runtime import _saver


def _plan(tier: str, mesh: tuple[int, ...] = (4, 2)) -> Any:
    return SimpleNamespace(tier=tier, mesh=mesh)


@pytest.mark.parametrize("error", [StoredFormatError("checksum differs"),
                                   FileNotFoundError("snapshot.json is gone")])
def test_a_memory_snapshot_that_cannot_be_read_sends_the_restore_to_storage(
        monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    budgets: list[int | None] = []

    def restore(plan: Any, target: Any, host_bytes: int | None = None) -> str:
        budgets.append(host_bytes)
        if plan.tier == "memory":
            raise error
        return "state from storage"

    monkeypatch.setattr(_saver, "restore_from_plan", restore)
    storage = _plan("storage")
    state, used = _saver.restore_plan(_plan("memory"), lambda plan: None, lambda: storage, host_bytes=1 << 20)
    assert (state, used) == ("state from storage", storage)
    assert budgets == [1 << 20, 1 << 20]  # the runner's budget (ClientSettings.restore_host_bytes) to both
    with pytest.raises(type(error)):  # the storage step would need another mesh: the error stands
        _saver.restore_plan(_plan("memory"), lambda plan: None, lambda: _plan("storage", (3, 2)))
    with pytest.raises(type(error)):  # nothing on storage
        _saver.restore_plan(_plan("memory"), lambda plan: None, lambda: None)


def test_a_storage_plans_missing_file_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    def restore(plan: Any, target: Any, host_bytes: int | None = None) -> str:
        raise FileNotFoundError("step gone")

    monkeypatch.setattr(_saver, "restore_from_plan", restore)
    asked = []
    with pytest.raises(FileNotFoundError):
        _saver.restore_plan(_plan("storage"), lambda plan: None, lambda: asked.append(1))  # type: ignore[func-returns-value]
    assert asked == []
