"""ckptd: the checkpoint sidecar for elastic JAX training.

The service owns the checkpoint catalog of a storage root (local directory or ``gs://``) and answers,
after a failure, where a trainer resumes and on which mesh. Its parts (docs/architecture.md):
``ckptd.api`` (the HTTP service, ``create_app``), ``ckptd.catalog`` (what storage holds, integrity,
retention), ``ckptd.events`` (the trainers' events), ``ckptd.lease`` (one writer per job among sidecars),
``ckptd.multihost`` (multi-host saves committed from their parts), ``ckptd.memory_tier`` (host-memory
snapshots persisted), ``ckptd.persist`` (the persist worker), ``ckptd.peers`` (copies among hosts),
``ckptd.advisor`` (checkpoint periods and recovery policy) and ``ckptd.cli`` (the ``ckptd`` command). It never
imports jax; the wire contract, stored format and planner come from ``trainer_client.core``, shared with the
trainer. Its persist worker, a child process, is the one part that runs jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real types for type checkers; at run time each name is imported on first use
    from ckptd.api._app import create_app
    from ckptd.cli._main import main
    from ckptd.config import Settings

__version__ = "0.1.0"

# The public surface: everything else is a private module (its name starts with ``_``). ``create_app`` needs
# ckptd[server]; ``Settings`` and ``main`` (the ``ckptd`` command) work in every install.
_LAZY = {"create_app": "ckptd.api._app", "Settings": "ckptd.config", "main": "ckptd.cli._main"}

__all__ = ["Settings", "__version__", "create_app", "main"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptd' has no attribute {name!r}")
    if name != "create_app":
        return getattr(importlib.import_module(module), name)
    from trainer_client.core import needs_extra

    with needs_extra("server", "ckptd.create_app"):
        return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
