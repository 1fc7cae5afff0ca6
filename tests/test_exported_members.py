"""The public API is pinned: what each package exports is exactly its ``__all__``, and it all resolves."""

from __future__ import annotations

import importlib

import pytest

import trainer_client

PUBLIC_MODULES = [
    "ckptd",
    "ckptd.api.app",
    "ckptd.catalog.catalog",
    "ckptd.config",
    "ckptd.errors",
    "ckptd.catalog.integrity",
    "ckptd.catalog.retention",
    "trainer_client",
    "trainer_client.core.protocol",
    "trainer_client.core.storage",
    "trainer_client.core.format.steps",
    "trainer_client.core.planner",
    "trainer_client.core.batching",
    "trainer_client.core.format.array_index",
    "trainer_client.core.format.manifest",
    "trainer_client.core.validation",
    "trainer_client.core.durability",
    "trainer_client.client.ckptd_client",
    "trainer_client.config",
    "trainer_client.errors",
    "trainer_client.client.retry",
    "trainer_client.runtime.checkpointing",
    "trainer_client.runtime.direct_restore",
    "trainer_client.core.format.ocdbt_index",
    "trainer_client.runtime.slices",
    "trainer_client.runtime.elastic",
]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_name_in_all_resolves(name: str) -> None:
    module = importlib.import_module(name)
    exported = module.__all__
    assert len(set(exported)) == len(exported), f"{name}.__all__ has duplicates"
    for member in exported:
        assert getattr(module, member) is not None, f"{name}.{member}"


def test_trainer_client_top_level_names() -> None:
    assert set(trainer_client.__all__) == {
        "__version__", "CkptdClient", "ClientSettings", "ElasticConfig", "ElasticContext", "ElasticRunner",
        "ElasticResult", "Checkpointer", "SimulatedSlices", "PathwaysSlices", "SliceFault", "CkptdError",
        "CkptdUnavailable", "CkptdRequestError", "NoCheckpointError", "ElasticTimeoutError",
        "ElasticRetriesExhausted",
    }
    with pytest.raises(AttributeError):
        _ = trainer_client.NotAThing  # type: ignore[attr-defined]


def test_error_tree_subclasses_builtins() -> None:
    from trainer_client import errors

    assert issubclass(errors.CkptdUnavailable, ConnectionError)
    assert issubclass(errors.NoCheckpointError, LookupError)
    assert issubclass(errors.ElasticTimeoutError, TimeoutError)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.CkptdError)


def test_every_setting_is_documented() -> None:
    from pathlib import Path

    from ckptd.config import Settings

    doc = (Path(__file__).parent.parent / "docs" / "protocol.md").read_text()
    missing = [name for name in Settings.model_fields if f"`CKPTD_{name.upper()}`" not in doc]
    assert not missing, f"docs/protocol.md does not document {missing}"
