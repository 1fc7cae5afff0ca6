"""Install roles in one interpreter: what ``pip install ckptd``, ``ckptd[server]`` and ``ckptd[trainer]`` would
bring, and a subprocess that can import nothing else.

``closure(requirements)`` is every distribution installing the requirements brings (as installed here). A role's
subprocess (``role_env``) gets a ``sitecustomize`` whose meta-path finder makes every module of the other installed
distributions fail to import exactly as an absent one does (``ModuleNotFoundError``): the ``ckptd`` command of the
base install runs as if ``pip install ckptd`` were all there is, without a fresh virtual environment (``.ci/run``
builds those too, slower).
"""

from __future__ import annotations

import sys
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.helpers import REPO, clean_env

ROLES = ("base", "server", "trainer")
BLOCKED_VAR = "ROLE_BLOCKED_IMPORTS"  # read by the finder below (a test's variable, no setting)

_SITECUSTOMIZE = f'''
"""Written by tests/support/roles.py: modules of distributions outside this role's install cannot be imported."""
import importlib.abc
import os
import sys

_BLOCKED = frozenset(filter(None, os.environ.get({BLOCKED_VAR!r}, "").split(",")))


class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not in this install role)", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
'''


def closure(requirements: list[str]) -> set[str]:
    """Every distribution that installing ``requirements`` brings (as installed here), names normalised."""
    seen: set[str] = set()
    todo = [(Requirement(r), frozenset(Requirement(r).extras)) for r in requirements]
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (*extras, "")):
            continue
        if name in seen and not extras:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in (*extras, "")):
                todo.append((sub, frozenset(sub.extras)))
    return seen


def requirements(role: str) -> list[str]:
    """What ``pyproject.toml`` asks for in ``role``: the base dependencies, plus the extra's."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *(project["optional-dependencies"][role] if role != "base" else [])]


@cache
def blocked_modules(role: str) -> frozenset[str]:
    """Top-level modules installed here that only distributions outside ``role``'s install provide."""
    allowed = closure(requirements(role)) | {"ckptd"}
    blocked = set()
    for module, dists in metadata.packages_distributions().items():
        if module in sys.stdlib_module_names or module.startswith("_"):
            continue  # interpreter start-up hooks (_distutils_hack, __editable__ finders) are no library
        if not {canonicalize_name(d) for d in dists} & allowed:
            blocked.add(module)
    return frozenset(blocked)


def role_env(role: str, tmp: Path, **extra: str) -> dict[str, str]:
    """A subprocess environment in which only ``role``'s libraries (and the repository) can be imported."""
    site = tmp / f"role-{role}"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    env = clean_env(**extra)
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    env[BLOCKED_VAR] = ",".join(sorted(blocked_modules(role)))
    return env


__all__ = ["BLOCKED_VAR", "ROLES", "blocked_modules", "closure", "requirements", "role_env"]
