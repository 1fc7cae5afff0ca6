"""A package's public face, loaded on first use (PEP 562).

A package of trainer_client that another package uses (ckptd uses the core, its formats and, in the persist
worker, the Orbax writer) exports the names it offers from its ``__init__``: its ``__all__``, with the
private module that defines each name. The ``__init__`` imports nothing at run time, so importing one module
of the package (the trainer loads the wire contract at start) costs no more than before and no package
``__init__`` takes part in an import circle; a name's module is imported when the name is first read, then
the name is kept in the package's namespace. Type checkers see the same names through a ``TYPE_CHECKING``
block of the ``__init__``; tests/system/test_architecture.py checks that the block and the table agree.
"""

from __future__ import annotations

import importlib
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

Exports = Mapping[str, tuple[str, ...]]  # defining module -> the names the face takes from it


def exported(exports: Exports) -> list[str]:
    """The face's ``__all__``: every name of ``exports``, each once, sorted."""
    names = [name for found in exports.values() for name in found]
    if len(set(names)) != len(names):
        twice = sorted(name for name, n in Counter(names).items() if n > 1)
        raise ValueError(f"names exported twice: {twice}")
    return sorted(names)


def lazy_face(package: str, exports: Exports) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: a name of ``exports`` is imported from its module on first
    use and kept in the package's namespace; any other name is an ``AttributeError`` (so ``from package import
    submodule`` still imports the submodule)."""
    where = {name: module for module, names in exports.items() for name in names}
    namespace = sys.modules[package].__dict__
    names = exported(exports)

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})

    return __getattr__, __dir__
