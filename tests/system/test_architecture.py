"""The architecture of docs/architecture.md holds: imports go only the ways its package map draws, no two
modules import each other (directly or around a circle), the sidecar process maps no jax, tensorstore or
orbax, the client API loads no server framework, ckptd reaches trainer_client only through its public faces
(never a private module of another package), every module says what it holds and stays under a generous ceiling.

The import graph is read from the source (every ``import`` outside ``if TYPE_CHECKING:``), so a rule is
broken the moment a line is written, whether or not a test happens to execute it. An import inside a
function is *lazy*: allowed where the rule says so (the core's zarr reader loads tensorstore only when it
reads an index; the CLI loads the HTTP service only inside ``serve``).
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.chaos_support import CkptdProcess
from tests.support.helpers import REPO, clean_env, wait_until
from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from tests.support.roles import closure

PACKAGES = ("ckptd", "trainer_client")
# A generous ceiling only: a module is as long as its one concept needs (cohesion decides a split, not a count);
# past this it has almost surely become several.
MAX_MODULE_LINES = 1000

# What the jax-free core may import besides the standard library and itself.
CORE_THIRD_PARTY = {"numpy", "pydantic", "pydantic_settings", "fsspec", "google_crc32c", "zstandard", "ml_dtypes",
                    "xxhash", "orjson"}
CORE_LAZY_ONLY = {"tensorstore"}  # only inside the functions that read zarr metadata or decode chunks
JAX_SIDE = ("jax", "jaxlib", "orbax", "tensorstore", "pathwaysutils", "optax", "flax")
SERVER_FRAMEWORK = ("fastapi", "starlette", "uvicorn", "prometheus_client")
PERSIST_WORKER = "ckptd.persist._persist_worker"  # a child process of the sidecar: the one server module with jax
CHECKPOINT_IO = "trainer_client.checkpoint_io"  # the Orbax writer (jax-bound): the trainer runtime and the worker

# ckptd's settings groups (ckptd/config.py, GROUPS): each module lives beside the part whose settings it holds and
# belongs to the shared layer, so ckptd.config composes them; they import nothing of the part beside them.
SETTINGS_GROUPS = ("ckptd._settings_group", "ckptd.api._settings", "ckptd.catalog._settings", "ckptd.events._settings",
                   "ckptd.memory_tier._settings", "ckptd.cli._serve_settings", "ckptd.peers._settings")
# The package map (docs/architecture.md, "Package map"). Every module of both packages is in exactly one part:
# the part of its longest prefix below, or, for the modules named, that part (``exact``).
PARTS: dict[str, tuple[str, ...]] = {
    "trainer_client.core": ("trainer_client.core",),
    "trainer_client.client": ("trainer_client.client",),
    "trainer_client.checkpoint_io": (CHECKPOINT_IO,),
    "trainer_client.runtime": ("trainer_client.runtime",),
    "ckptd.cli": ("ckptd.cli",),
    "ckptd.api": ("ckptd.api",),
    "ckptd.events": ("ckptd.events",),
    "ckptd.lease": ("ckptd.lease",),
    "ckptd.persist": ("ckptd.persist",),
    "ckptd.catalog": ("ckptd.catalog",),
    "ckptd.multihost": ("ckptd.multihost",),
    "ckptd.memory_tier": ("ckptd.memory_tier",),
    "ckptd.advisor": ("ckptd.advisor",),
    "ckptd.peers": ("ckptd.peers",),
}
EXACT: dict[str, tuple[str, ...]] = {
    "trainer_client": ("trainer_client", "trainer_client.config", "trainer_client.errors"),  # the public surface
    "ckptd": ("ckptd", "ckptd.config", "ckptd.errors", "ckptd._metrics", "ckptd._process_metrics",
              "ckptd._event_stats", "ckptd._peer_lists",  # shared by every part of the sidecar, below all of them
              # the settings groups: each beside the part that uses it, composed by ckptd.config
              *SETTINGS_GROUPS),
    "ckptd._sidecar": ("ckptd._sidecar",),  # the composition root
    "ckptd.cli": ("ckptd.__main__",),  # python -m ckptd
    "ckptd.persist_worker": (PERSIST_WORKER,),  # the child process (jax on the CPU)
}
# part -> the parts it may import (besides itself). An arrow not here fails, naming the importer and line.
ALLOWED: dict[str, frozenset[str]] = {
    "trainer_client.core": frozenset(),
    "trainer_client": frozenset({"trainer_client.core"}),
    "trainer_client.client": frozenset({"trainer_client.core", "trainer_client"}),
    "trainer_client.checkpoint_io": frozenset({"trainer_client.core", "trainer_client"}),
    "trainer_client.runtime": frozenset({"trainer_client.core", "trainer_client", "trainer_client.client",
                                         "trainer_client.checkpoint_io"}),
    "ckptd": frozenset({"trainer_client.core"}),
    "ckptd.advisor": frozenset({"ckptd", "trainer_client.core"}),
    # the rooms of the sidecar, bottom up: events, lease, persist; the catalog; the multi-host commit; the memory tier
    "ckptd.events": frozenset({"ckptd.advisor", "ckptd", "trainer_client.core"}),
    "ckptd.lease": frozenset({"trainer_client.core"}),
    "ckptd.persist": frozenset({"ckptd", "trainer_client.core"}),
    "ckptd.catalog": frozenset({"ckptd.events", "ckptd.lease", "ckptd", "trainer_client.core"}),
    "ckptd.multihost": frozenset({"ckptd.catalog", "ckptd.lease", "ckptd.persist", "trainer_client.core"}),
    "ckptd.memory_tier": frozenset({"ckptd.multihost", "ckptd.persist", "ckptd", "trainer_client.core"}),
    "ckptd.peers": frozenset({"ckptd", "trainer_client.core"}),
    "ckptd._sidecar": frozenset({"ckptd.catalog", "ckptd.events", "ckptd.lease", "ckptd.persist", "ckptd.multihost",
                                 "ckptd.memory_tier", "ckptd.peers", "ckptd", "trainer_client.core"}),
    "ckptd.api": frozenset({"ckptd._sidecar", "ckptd.catalog", "ckptd.events", "ckptd.lease", "ckptd.memory_tier",
                            "ckptd.advisor", "ckptd", "trainer_client.core"}),
    "ckptd.cli": frozenset({"ckptd.api", "ckptd._sidecar", "ckptd.catalog", "ckptd.events", "ckptd.lease",
                            "ckptd.advisor", "ckptd", "trainer_client.core"}),
    "ckptd.persist_worker": frozenset({"trainer_client.checkpoint_io", "ckptd.persist", "trainer_client.core"}),
}
# Arrows allowed only inside a function: the CLI loads the HTTP service and the composition root only in ``serve``
# (``pip install ckptd`` has the CLI without FastAPI).
LAZY_ONLY = frozenset({("ckptd.cli", "ckptd.api"), ("ckptd.cli", "ckptd._sidecar")})

@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    lazy: bool
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@functools.cache
def _faces() -> dict[str, dict[str, str]]:
    """Each public face (a package whose ``__init__`` has an ``_EXPORTS`` table: trainer_client/core/_faces.py) with
    its names, each with the private module that defines it."""
    faces = {}
    for name, path in _modules().items():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_EXPORTS"]:
                table: dict[str, tuple[str, ...]] = ast.literal_eval(node.value)
                faces[name] = {member: module for module, members in table.items() for member in members}
    return faces


def _imports(name: str, path: Path, known: set[str]) -> list[Import]:
    found: list[Import] = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub, lazy)
                continue
            inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                found.extend(Import(name, a.name, inner, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                found.append(Import(name, base, inner, child.lineno))
                for alias in child.names:  # ``from pkg import module`` imports the module
                    if f"{base}.{alias.name}" in known:
                        found.append(Import(name, f"{base}.{alias.name}", inner, child.lineno))
                    defined = _faces().get(base, {}).get(alias.name)
                    if defined is not None:  # a public face's name: reading it imports the module defining it
                        found.append(Import(name, defined, inner, child.lineno))
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return found


@pytest.fixture(scope="module")
def graph() -> list[Import]:
    modules = _modules()
    known = set(modules)
    return [imp for name, path in modules.items() for imp in _imports(name, path, known)]


def _top(target: str) -> str:
    return target.split(".")[0]


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _broken(graph: list[Import], importers: tuple[str, ...], forbidden: tuple[str, ...],
            *, except_importers: tuple[str, ...] = (), lazy_ok: tuple[str, ...] = ()) -> list[str]:
    return [
        f"{i.importer}:{i.line} imports {i.target}{' (lazily)' if i.lazy else ''}"
        for i in graph
        if _under(i.importer, *importers) and not _under(i.importer, *except_importers)
        and _under(i.target, *forbidden) and not (i.lazy and _under(i.target, *lazy_ok))
    ]


def test_the_graph_is_read(graph: list[Import]) -> None:
    """The reader sees the edges the rules are about (a reader that saw nothing would pass every rule)."""
    edges = {(i.importer, i.target) for i in graph}
    assert ("ckptd.api._app", "ckptd.api.routes._jobs") in edges
    assert ("ckptd.api._app", "ckptd._sidecar") in edges and ("ckptd._sidecar", "ckptd.catalog._catalog") in edges
    assert ("trainer_client.runtime.elastic._elastic", "jax") in edges
    assert any(i.importer == "trainer_client.core.format._item_keys" and i.target == "tensorstore" and i.lazy
               for i in graph)
    assert not any(i.importer == "trainer_client" and _under(i.target, "trainer_client.runtime") for i in graph), \
        "TYPE_CHECKING imports must not count"
    assert (PERSIST_WORKER, "trainer_client.checkpoint_io._checkpointer") in edges, "a face's name is its module's"


def part_of(module: str) -> str | None:
    """The part of the package map ``module`` belongs to (``None``: a module of neither package, or one the map
    does not place)."""
    for part, names in EXACT.items():
        if module in names:
            return part
    prefixes = [(prefix, part) for part, found in PARTS.items() for prefix in found if _under(module, prefix)]
    return max(prefixes, key=lambda pp: len(pp[0]))[1] if prefixes else None


def test_every_module_is_in_the_package_map() -> None:
    unplaced = [name for name in _modules() if part_of(name) is None]
    assert not unplaced, f"modules the package map does not place (PARTS, EXACT): {unplaced}"
    assert set(ALLOWED) == set(PARTS) | set(EXACT), "every part says what it may import"


def test_imports_between_parts_follow_the_package_map(graph: list[Import]) -> None:
    """Every import from one part into another is an arrow of ``ALLOWED`` (lazily only where ``LAZY_ONLY`` says);
    any other, in either package, fails with the importer and its line."""
    bad = []
    for i in graph:
        source, target = part_of(i.importer), part_of(i.target)
        if target is None or source == target:
            continue  # a library, or inside one part
        assert source is not None
        if target not in ALLOWED[source] or ((source, target) in LAZY_ONLY and not i.lazy):
            bad.append(f"{i.importer}:{i.line} imports {i.target}{' (lazily)' if i.lazy else ''}: "
                       f"{source} -> {target}{' eagerly' if target in ALLOWED[source] else ''} is not in the map")
    assert not bad, "\n".join(bad)


def test_every_arrow_of_the_map_is_taken(graph: list[Import]) -> None:
    """The map is exact: each arrow of ``ALLOWED`` is taken by at least one import (an arrow nothing takes would let
    a later change take it unnoticed: drop it from the map and from docs/architecture.md instead)."""
    taken = {(part_of(i.importer), part_of(i.target)) for i in graph}
    untaken = sorted(f"{part} -> {target}" for part, targets in ALLOWED.items() for target in targets
                     if (part, target) not in taken)
    assert not untaken, f"arrows of the package map no import takes: {untaken}"


def test_the_map_keeps_the_layers_apart() -> None:
    """What docs/architecture.md promises of the map itself: ckptd never imports the trainer runtime or client;
    only the persist worker (a child process, which nothing imports) reaches the Orbax writer; the Orbax writer
    and everything of trainer_client know nothing of ckptd; the core imports no other part."""
    ckptd_parts = [part for part in ALLOWED if part.split(".")[0] == "ckptd"]
    for part in ckptd_parts:
        assert not {"trainer_client.runtime", "trainer_client.client"} & ALLOWED[part], part
        assert ("trainer_client.checkpoint_io" in ALLOWED[part]) == (part == "ckptd.persist_worker"), part
    for part, allowed in ALLOWED.items():
        assert "ckptd.persist_worker" not in allowed, f"{part}: the persist worker runs as a child process only"
        if part.startswith("trainer_client"):
            assert not {p for p in allowed if p.split(".")[0] == "ckptd"}, part
    assert ALLOWED["trainer_client.core"] == frozenset()
    assert part_of("ckptd.persist._persist_worker") == "ckptd.persist_worker"
    assert part_of("trainer_client.runtime.elastic._elastic") == "trainer_client.runtime"
    assert part_of("ckptd.config") == "ckptd" and part_of("ckptd._sidecar") == "ckptd._sidecar"


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself): Tarjan's."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_two_modules_import_each_other(graph: list[Import]) -> None:
    """No circle of eager (module-level) imports between modules of both packages, however long: each module
    can be read, and loaded, after the ones it imports. Imports inside functions and under TYPE_CHECKING are
    not edges."""
    known = set(_modules())
    edges: dict[str, set[str]] = {}
    for i in graph:
        if not i.lazy and i.target in known and i.target != i.importer:
            edges.setdefault(i.importer, set()).add(i.target)
    circles = _circles(edges)
    lines = {(i.importer, i.target): i.line for i in graph if not i.lazy}
    described = ["; ".join(f"{a}:{lines[a, b]} imports {b}" for a in circle for b in sorted(edges.get(a, ()))
                           if b in circle) for circle in circles]
    assert not circles, "import circles:\n" + "\n".join(described)


def test_the_circle_finder_finds_circles() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_core_imports_only_the_standard_library_its_own_modules_and_a_few_pure_libraries(
    graph: list[Import],
) -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    allowed = stdlib | CORE_THIRD_PARTY
    bad = [
        f"{i.importer}:{i.line} imports {i.target}{' (lazily)' if i.lazy else ''}"
        for i in graph
        if _under(i.importer, "trainer_client.core")
        and not _under(i.target, "trainer_client.core")
        and _top(i.target) not in allowed
        and not (i.lazy and _top(i.target) in CORE_LAZY_ONLY)
    ]
    assert not bad, "the core reaches outside itself:\n" + "\n".join(bad)


def test_the_client_side_never_imports_jax_or_a_server_framework(graph: list[Import]) -> None:
    jax_free = ("trainer_client.client", "trainer_client.config", "trainer_client.errors")
    bad = _broken(graph, jax_free, (*JAX_SIDE, *SERVER_FRAMEWORK))
    bad += [f"trainer_client:{i.line} imports {i.target}" for i in graph
            if i.importer == "trainer_client" and not _under(i.target, "importlib", "typing", "__future__")
            and not (i.lazy and i.target == "trainer_client.core._extras")]  # says which extra a name needs
    assert not bad, "\n".join(bad)


def test_the_trainer_library_never_imports_a_server_framework(graph: list[Import]) -> None:
    bad = _broken(graph, ("trainer_client",), SERVER_FRAMEWORK)
    assert not bad, "\n".join(bad)


def test_the_server_never_imports_jax(graph: list[Import]) -> None:
    """Only the persist worker (a child process) imports jax; the rest of ckptd neither it nor Orbax."""
    bad = _broken(graph, ("ckptd",), JAX_SIDE, except_importers=(PERSIST_WORKER,))
    assert not bad, "\n".join(bad)
    assert any(i.importer == PERSIST_WORKER and _under(i.target, CHECKPOINT_IO) for i in graph)


def test_the_catalog_and_advisor_know_no_server_framework_and_the_advisor_no_storage(graph: list[Import]) -> None:
    """The rooms below the API (catalog, events, lease, persist worker, multi-host commit, memory tier) and the
    advisor know nothing of HTTP; the advisor is pure computation (no storage)."""
    rooms = ("ckptd.catalog", "ckptd.events", "ckptd.lease", "ckptd.persist", "ckptd.multihost", "ckptd.memory_tier")
    bad = _broken(graph, (*rooms, "ckptd.advisor", CHECKPOINT_IO), SERVER_FRAMEWORK)
    bad += _broken(graph, ("ckptd.advisor",), ("trainer_client.core._storage",))
    assert not bad, "\n".join(bad)


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _private_reaches(source: str, package: str) -> list[tuple[int, str]]:
    """Every import in ``source`` (a module of ``package``) of a private module or name of another of both
    packages, wherever it stands (inside a function, under ``TYPE_CHECKING``): ``import a._m``, ``from a._m
    import x``, ``from a import _m``; by line. Dunders (``__version__``) are not private."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _top(a.name) in PACKAGES and _top(a.name) != package
                      and any(_private(part) for part in a.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and _top(node.module) in PACKAGES \
                and _top(node.module) != package:
            if any(_private(part) for part in node.module.split(".")):
                found.append((node.lineno, node.module))
            else:
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if _private(a.name)]
    return sorted(found)


def test_ckptd_imports_no_private_module_of_another_package() -> None:
    """ckptd reaches trainer_client only through public faces (a package's ``__all__``: ``trainer_client.core``,
    ``core.format``, ``core.protocol``, ``core.planning``, and ``checkpoint_io`` in the persist worker): what a
    face exports is what the core promises ckptd, and a private module may change under it. Inside ckptd a
    private module of another part is fine (the package map says which)."""
    bad = [f"{path.relative_to(REPO)}:{line} imports {target}: import it from its package's public face"
           for name, path in _modules().items() if _top(name) == "ckptd"
           for line, target in _private_reaches(path.read_text(encoding="utf-8"), "ckptd")]
    assert not bad, "\n".join(bad)


def test_the_private_import_finder_finds_each_form() -> None:
    source = "\n".join([
        "import trainer_client.core._storage as storage",
        "from trainer_client.core._errors import CkptdError",
        "from trainer_client.core import _storage, Storage",
        "from trainer_client import __version__",
        "from ckptd.catalog._catalog import Catalog",
        "from . import _own",
        "import numpy._core",
        "def f():",
        "    from trainer_client.core.format._steps import inspect_step",
        "if TYPE_CHECKING:",
        "    from trainer_client.checkpoint_io._checkpointer import Checkpointer",
    ])
    assert _private_reaches(source, "ckptd") == [
        (1, "trainer_client.core._storage"), (2, "trainer_client.core._errors"), (3, "trainer_client.core._storage"),
        (9, "trainer_client.core.format._steps"), (11, "trainer_client.checkpoint_io._checkpointer")]


def _type_checking_imports(path: Path) -> dict[str, str]:
    """What type checkers see of a face: each name its ``if TYPE_CHECKING:`` block re-exports (``x as x``), with
    the module it names."""
    seen: dict[str, str] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module, f"{path}:{imp.lineno}: imports only"
                for alias in imp.names:
                    assert alias.asname == alias.name, f"{path}:{imp.lineno}: {alias.name} re-exported as itself"
                    seen[alias.name] = imp.module
    return seen


def test_each_public_face_exports_what_its_table_says() -> None:
    """Each public face (trainer_client/core/_faces.py): its ``__all__`` is its table's names; every one resolves
    to the object of the module the table names; its ``TYPE_CHECKING`` block (what type checkers see) re-exports
    exactly those names from those modules; ckptd imports each (a face exports what its users need, no more);
    and importing the faces loads none of those modules, nor jax (each name is loaded on first use)."""
    faces = _faces()
    assert {"trainer_client.core", "trainer_client.core.format", CHECKPOINT_IO} <= set(faces)
    modules = _modules()
    used = {(node.module, alias.name) for name, path in modules.items() if _top(name) == "ckptd"
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.ImportFrom) and node.module in faces for alias in node.names}
    for face, names in faces.items():
        module = importlib.import_module(face)
        assert module.__all__ == sorted(names), face
        for member, defined_in in names.items():
            assert getattr(module, member) is getattr(importlib.import_module(defined_in), member), \
                f"{face}.{member} is not {defined_in}.{member}"
        assert _type_checking_imports(modules[face]) == names, f"{face}: its TYPE_CHECKING block and _EXPORTS differ"
        unused = sorted(member for member in names if (face, member) not in used)
        assert not unused, f"{face} exports names ckptd does not import (drop them, or import them): {unused}"
    program = (f"import importlib, sys\nfor face in {sorted(faces)!r}: importlib.import_module(face)\n"
               "print(','.join(sorted(m for m in sys.modules if m in {defining!r} or m.split('.')[0] in {jax!r})))")
    program = program.replace("{defining!r}", repr({m for names in faces.values() for m in names.values()}))
    out = subprocess.run([sys.executable, "-c", program.replace("{jax!r}", repr(set(JAX_SIDE)))],
                         capture_output=True, text=True, env=clean_env(), timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing the faces loaded {out.stdout.strip()}"


ISSUE_CITATION = re.compile(r"\bissues?\s*#?\d+|\(#\d+\)", re.IGNORECASE)


def test_no_module_cites_an_issue() -> None:
    """Why code is as it is belongs in docs/ (the invariants, the contract), not in a tracker's numbers."""
    dirs = ("ckptd", "trainer_client", "tests", "bench", "soak", "examples")
    sources = [p for d in dirs for p in (REPO / d).rglob("*.py") if "fixtures" not in p.parts]
    assert len(sources) > 100
    cited = [f"{p.relative_to(REPO)}:{n}" for p in sources
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if ISSUE_CITATION.search(line)]
    assert not cited, f"modules citing an issue: {cited}"


def test_every_module_says_why_it_exists_and_stays_under_the_ceiling() -> None:
    """A docstring in every module; ``MAX_MODULE_LINES`` is a generous ceiling, not a target: a module holds one
    concept, however many lines that takes."""
    long, undocumented = [], []
    for name, path in _modules().items():
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long.append(f"{name}: {len(text.splitlines())} lines")
        if not ast.get_docstring(ast.parse(text)):
            undocumented.append(name)
    assert not long, f"modules over the ceiling of {MAX_MODULE_LINES} lines (several concepts in one?): {long}"
    assert not undocumented, f"modules without a docstring: {undocumented}"


CITED = r"(?<![\w/.])((?:docs|ckptd|trainer_client|tests|bench|deploy)/[\w/.-]+\.(?:md|py))"


def test_comments_cite_files_of_the_repository() -> None:
    """Docstrings and comments point at docs/ and source files that exist, never at documents outside."""
    import re

    missing = []
    for name, path in _modules().items():
        text = path.read_text(encoding="utf-8")
        if "DESIGN" in text or "facts.md" in text:
            missing.append(f"{name}: cites a document outside the repository")
        for cited in re.findall(CITED, text):
            if not (REPO / cited).exists():
                missing.append(f"{name}: {cited}")
    assert not missing, "\n".join(missing)


_CLIENT_PROGRAM = """
import sys
from trainer_client import CkptdClient, ClientSettings, CkptdError, NoCheckpointError
from trainer_client.core.protocol import ResumeRequest
settings = ClientSettings(url="http://127.0.0.1:9", timeout_s=0.5, resume_deadline_s=1.0)
with CkptdClient(settings, root=sys.argv[1]) as client:
    try:
        client.resume("job", ResumeRequest(alive_devices=8))
    except NoCheckpointError:
        pass
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {mods})
print(",".join(loaded))
"""


def test_the_client_api_loads_no_server_framework_and_no_jax(tmp_path: Path) -> None:
    """A resume through the client (ckptd down, storage fallback on an empty root) in a fresh interpreter."""
    (tmp_path / "job").mkdir()
    program = _CLIENT_PROGRAM.replace("{mods}", repr({*SERVER_FRAMEWORK, *JAX_SIDE, "ckptd"}))
    out = subprocess.run([sys.executable, "-c", program, str(tmp_path)], capture_output=True, text=True,
                         env=clean_env(), timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the client loaded {out.stdout.strip()}"


def _mapped_libraries(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {line.split()[-1] for line in maps.splitlines() if line.split()[-1].startswith("/")}


@pytest.mark.integration
def test_the_sidecar_process_maps_no_jax_tensorstore_or_orbax(tmp_path: Path) -> None:
    """A real ``ckptd serve`` answers every kind of request, over steps written with ckptd's metadata and
    over steps of plain Orbax (planned from their zarr metadata), and its process never maps jaxlib's or
    tensorstore's shared libraries (orbax is pure Python, but cannot load without jaxlib)."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc (Linux)")
    root = tmp_path / "root"
    write_orbax_jobs({root / "job": [10, 20], root / "plain": [5]},
                     custom_metadata={s: training_metadata(s) for s in (10, 20)})
    ckptd = CkptdProcess(root, tmp_path / "state", log_path=tmp_path / "ckptd.log",
                         env={"CKPTD_ADOPT_AFTER_S": "0"})
    ckptd.start()
    try:
        ckptd.wait_ready(timeout=60)
        def verified() -> bool:
            body = httpx.get(f"{ckptd.url}/v1/jobs/job/checkpoints/latest-good", timeout=5)
            return body.status_code == 200 and body.json()["step"] == 20

        wait_until(verified, timeout=60, what="ckptd to verify step 20")
        with httpx.Client(base_url=ckptd.url, timeout=10) as http:
            assert http.get("/v1/jobs").status_code == 200
            assert http.get("/v1/jobs/job/checkpoints").status_code == 200
            plan = http.post("/v1/jobs/job/resume", json={"alive_devices": 6})
            assert plan.status_code == 200 and plan.json()["step"] == 20, plan.text
            wait_until(lambda: http.get("/v1/jobs/plain/checkpoints/latest-good").status_code == 200, timeout=60,
                       what="ckptd to adopt the plain-Orbax step")
            plain = http.post("/v1/jobs/plain/resume", json={"alive_devices": 4})
            assert plain.status_code == 200 and plain.json()["arrays"]["params.w"]["shape"] == [4, 8], plain.text
            advice = {"step_time_s": 1, "save_stall_s": 0.1, "persist_time_s": 5, "restore_time_s": 5,
                      "recovery_time_s": 10, "replace_time_s": 300, "slices": 4, "mtbf_hours": 10, "horizon_days": 2}
            assert http.get("/v1/jobs/job/advice", params=advice).status_code == 200
            assert http.get("/v1/jobs/job/goodput").status_code == 200
            assert http.get("/metrics").status_code == 200
        assert ckptd.proc is not None
        mapped = _mapped_libraries(ckptd.proc.pid)
    finally:
        ckptd.stop()
    assert any("python" in m or "libc" in m for m in mapped), "the reader saw the process's own libraries"
    loaded = sorted(m for m in mapped if any(f"/{name}" in m for name in ("jaxlib", "tensorstore", "orbax", "jax/")))
    assert not loaded, f"ckptd serve mapped {loaded}"


def test_each_role_installs_what_its_modules_import(graph: list[Import]) -> None:
    """``pip install ckptd`` gives the jax-free core and client, ``ckptd[server]`` the sidecar,
    ``ckptd[trainer]`` the runtime: each role's requirements bring every library its modules import, and
    the sidecar's image gets no trainer-only library (optax, pathwaysutils)."""
    import tomllib
    from importlib import metadata

    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base, extras = project["dependencies"], project["optional-dependencies"]
    providers = {mod: {canonicalize_name(d) for d in dists} for mod, dists in metadata.packages_distributions().items()}
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    roles = {
        "base": (("trainer_client.core", "trainer_client.client", "trainer_client.config", "trainer_client.errors"),
                 closure(base)),
        "server": (("ckptd", "trainer_client.core", CHECKPOINT_IO), closure([*base, *extras["server"]])),
        "trainer": (("trainer_client",), closure([*base, *extras["trainer"]])),
    }
    missing = []
    for role, (packages, installed) in roles.items():
        for imp in graph:
            top = _top(imp.target)
            if not _under(imp.importer, *packages) or top in stdlib or top in PACKAGES:
                continue
            if role == "base" and imp.lazy and top in CORE_LAZY_ONLY:
                continue  # without it the core says which extra to install (ArrayIndexError)
            if not providers.get(top, set()) & installed:
                missing.append(f"{role}: {imp.importer} imports {top}, which {role}'s requirements do not install")
    assert not missing, "\n".join(sorted(set(missing)))
    server = closure([*base, *extras["server"]])
    assert not {"optax", "pathwaysutils", "flax"} & server, "the sidecar installs trainer-only libraries"
    # (the trainer role does install fastapi and uvicorn: pathwaysutils requires them; the client never loads
    # them, which test_the_client_api_loads_no_server_framework_and_no_jax checks)


def test_the_docs_cite_files_that_exist() -> None:
    """README and docs/ name source files by path; every one of them is where they say."""
    import re

    missing = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for cited in set(re.findall(CITED, doc.read_text(encoding="utf-8"))):
            if not (REPO / cited).exists():
                missing.append(f"{doc.relative_to(REPO)}: {cited}")
    assert not missing, "\n".join(missing)
