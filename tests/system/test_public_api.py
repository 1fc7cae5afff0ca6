"""The public API is pinned: what each package exports is exactly its ``__all__``, and it all resolves."""

from __future__ import annotations

import importlib
import re

import pytest

import trainer_client
from tests.support.helpers import REPO

# Every module of both packages (``__main__`` runs the CLI when imported).
PUBLIC_MODULES = sorted(
    ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
    for pkg in ("ckptd", "trainer_client") for path in (REPO / pkg).rglob("*.py") if path.name != "__main__.py"
)


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_name_in_all_resolves(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    if exported is None:  # a package whose __init__ only says what it holds
        assert name.count(".") >= 1 and module.__doc__, f"{name} has neither __all__ nor a docstring"
        return
    assert len(set(exported)) == len(exported), f"{name}.__all__ has duplicates"
    for member in exported:
        assert getattr(module, member) is not None, f"{name}.{member}"


def test_trainer_client_top_level_names() -> None:
    assert set(trainer_client.__all__) == {
        "__version__", "CkptdClient", "ClientSettings", "ElasticConfig", "ElasticContext", "ElasticRunner",
        "ElasticResult", "Checkpointer", "SimulatedSlices", "PathwaysSlices", "SliceFault", "CkptdError",
        # Orbax's CheckpointManager backed by ckptd (docs/adopt.md)
        "CheckpointManager",
        # MaxText's own elastic loop kept, through integrations/maxtext/ckptd.patch (docs/maxtext.md)
        "MaxTextHooks",
        "CkptdUnavailable", "CkptdRequestError", "NoCheckpointError", "ElasticTimeoutError",
        "ElasticRetriesExhausted", "MemoryTierFull", "PlanningError", "StorageError",
        # the rest of the error tree (trainer_client/errors.py)
        "StoredFormatError", "ArrayIndexError", "RecordTooLargeError", "OcdbtFormatError", "OcdbtRefusedError",
        "UnsafePathError", "MissingExtra", "DirectRestoreUnsupported", "NoWholeReplica",
        # ElasticConfig's option groups
        "ElasticOptions", "BatchScalingOptions", "MemoryFitOptions", "HealthOptions", "MemoryTierOptions",
        "ReplicaOptions", "CompilationOptions", "SaveOptions", "AutopilotOptions",
        # the runtime's functions and the fault injector a test or demo uses
        "restore", "Event", "InJaxFaults", "initialize_multihost",
    }
    with pytest.raises(AttributeError):
        _ = trainer_client.NotAThing  # type: ignore[attr-defined]


# Modules a user may import by name; every other module of both packages is private (``_name``).
PUBLIC_MODULE_FILES = {"trainer_client.errors", "trainer_client.config", "ckptd.config", "ckptd.errors"}


def test_ckptd_top_level_names() -> None:
    import ckptd
    from ckptd.api._app import create_app
    from ckptd.cli._main import main
    from ckptd.config import Settings

    assert set(ckptd.__all__) == {"__version__", "create_app", "Settings", "main"}
    assert (ckptd.create_app, ckptd.Settings, ckptd.main) == (create_app, Settings, main)
    with pytest.raises(AttributeError):
        _ = ckptd.NotAThing  # type: ignore[attr-defined]


def test_internals_are_private_modules() -> None:
    """A module is private (``_name``) unless it is a package or named in PUBLIC_MODULE_FILES: what a user imports
    is a package's ``__all__``."""
    public = [name for name in PUBLIC_MODULES
              if not name.rpartition(".")[2].startswith("_") and name not in PUBLIC_MODULE_FILES
              and not (REPO / name.replace(".", "/") / "__init__.py").exists()]
    assert not public, f"modules neither private nor public by intent: {public}"


def test_error_tree_subclasses_builtins() -> None:
    from trainer_client import errors

    assert issubclass(errors.CkptdUnavailable, ConnectionError)
    assert issubclass(errors.NoCheckpointError, LookupError)
    assert issubclass(errors.ElasticTimeoutError, TimeoutError)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.CkptdError)


def test_every_error_of_trainer_client_is_in_its_tree_its_exports_and_the_docs() -> None:
    """A user can catch what trainer_client raises by a name it exports: every ``CkptdError`` class defined
    in trainer_client is in ``trainer_client.errors.__all__`` (and so in its docstring's tree, checked below),
    importable from ``trainer_client`` itself, and named in docs/architecture.md's "Errors"."""
    import inspect

    from trainer_client import errors

    defined = {
        attr for name in PUBLIC_MODULES if name.startswith("trainer_client")
        for attr, value in vars(importlib.import_module(name)).items()
        if inspect.isclass(value) and issubclass(value, errors.CkptdError) and value.__module__ == name
    }
    assert defined == set(errors.__all__)
    assert set(errors.__all__) <= set(trainer_client.__all__)
    for name in errors.__all__:
        assert getattr(trainer_client, name) is getattr(errors, name)
    docs = (REPO / "docs" / "architecture.md").read_text()
    section = docs.split("### Errors", 1)[1].split("\n## ", 1)[0]
    assert not [name for name in errors.__all__ if f"`{name}`" not in section]


def test_every_exception_of_both_packages_has_one_root() -> None:
    """Every exception class defined anywhere in ckptd or trainer_client derives from ``CkptdError`` (but the
    runner's control-flow signals, which must not: ``RunnerSignal``), and each package's errors module
    documents its whole tree."""
    import inspect

    from trainer_client.core._errors import CkptdError
    from trainer_client.runtime.elastic._elastic_context import RunnerSignal

    stray = []
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            is_exception = inspect.isclass(value) and issubclass(value, BaseException)
            signal = is_exception and issubclass(value, RunnerSignal)
            if is_exception and value.__module__ == name and not issubclass(value, CkptdError) and not signal:
                stray.append(f"{name}.{attr}")
    assert not stray, f"exceptions outside the tree: {stray}"
    for errors_module in ("trainer_client.errors", "ckptd.errors", "trainer_client.core._errors"):
        module = importlib.import_module(errors_module)
        doc = module.__doc__ or ""
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value) and issubclass(value, BaseException):
                assert name in doc, f"{errors_module}'s docstring does not show {name} in the tree"


def test_every_setting_is_documented_in_its_group() -> None:
    """docs/operations.md, "Settings": one section per group of ``ckptd.config.GROUPS``, in their order, each
    listing its group's variables in the group's order (as ``ckptd serve --help`` does), then the trainer's
    (``ClientSettings``) and the commands' (``CliSettings``)."""
    from ckptd.config import GROUPS, CliSettings, env_names
    from trainer_client.config import ClientSettings

    doc = (REPO / "docs" / "operations.md").read_text()
    start = doc.index("\n## Settings\n")
    end = doc.find("\n## ", start + 1)
    sections = doc[start:end if end >= 0 else None].split("\n### ")[1:]
    found = [(text.split("\n", 1)[0], re.findall(r"^\| `([A-Z_]+)` \|", text, re.MULTILINE)) for text in sections]
    expected = [(group.replace("_", " "), [env_names(name)[0] for name in cls.model_fields])
                for group, cls in GROUPS.items()]
    expected += [("trainer", [f"CKPTD_{name.upper()}" for name in ClientSettings.model_fields]),
                 ("commands", [f"CKPTD_{name.upper()}" for name in CliSettings.model_fields])]
    assert found == expected
