"""Every Python block of README.md and docs/*.md runs as written, or says what it leaves out.

A block tagged ```python either runs as it is — in a fresh directory where ``examples/quickstart.py`` (the
README's own training script) ran first, as a reader following the README would have it — or starts with a
visible ``# fragment: needs ...`` comment naming what it leaves out; a fragment is compiled and its imports are
run (every name it imports exists). A block that looks like Python must be tagged so, or nothing here would see
it. The quickstart script itself must train through its slice loss in one process and leave its last step on
storage.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import REPO, clean_env

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
FRAGMENT = "# fragment: needs "
LOOKS_LIKE_PYTHON = re.compile(r"^(from [\w.]+ import |import [\w.]+$|def \w+\(|class \w+[(:])", re.M)


def _blocks() -> list[tuple[str, str, str]]:
    """``(where, tag, code)`` of every fenced block, ``where`` as ``file:line``."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text[: m.start()].count("\n") + 1
            found.append((f"{path.relative_to(REPO)}:{line}", m.group(1), m.group(2)))
    return found


PYTHON = [(where, code) for where, tag, code in _blocks() if tag == "python"]
RUNNABLE = [(where, code) for where, code in PYTHON if not code.startswith(FRAGMENT)]
FRAGMENTS = [(where, code) for where, code in PYTHON if code.startswith(FRAGMENT)]


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A fresh directory where ``python examples/quickstart.py`` ran, and how it ran."""
    cwd = tmp_path_factory.mktemp("reader")
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "quickstart.py")], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=240, check=False)
    return cwd, proc


def test_the_quickstart_script_trains_through_a_slice_loss_in_one_process(
        quickstart: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    cwd, proc = quickstart
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # restored in the same process, from the replica tier (on by default) when it held a step newer than the last
    # checkpoint (20), else from that checkpoint: the tier is paced from the measured step and copy times
    # (docs/concepts.md, "Pacing the replica tier"), and on this 2 ms step it may hold no newer snapshot
    found = re.search(r"recoveries \[\('slice_down', 25, (\d+)\)\]; same pid: True", proc.stdout)
    assert found is not None and 20 <= int(found.group(1)) < 25, proc.stdout
    job = cwd / "quickstart-output" / "checkpoints" / "quickstart"
    assert sorted(int(p.name) for p in job.iterdir() if p.name.isdigit()) == [10, 20, 30, 40, 50, 60]
    assert (job / "60" / "commit_success.txt").is_file()
    assert len((REPO / "examples" / "quickstart.py").read_text().splitlines()) < 100, "a short script"


def test_the_readme_shows_the_quickstart_script_and_a_client_snippet() -> None:
    readme = (REPO / "README.md").read_text()
    assert "examples/quickstart.py" in readme
    assert any(where.startswith("README.md") and "CkptdClient(" in code for where, code in RUNNABLE)


@pytest.mark.parametrize(("where", "code"), RUNNABLE, ids=[w for w, _ in RUNNABLE])
def test_a_python_block_runs_as_written(where: str, code: str,
                                        quickstart: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    cwd, ran = quickstart
    assert ran.returncode == 0, "the quickstart script, which the blocks build on, failed"
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, f"{where}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"


@pytest.mark.parametrize(("where", "code"), FRAGMENTS, ids=[w for w, _ in FRAGMENTS])
def test_a_fragment_says_what_it_leaves_out_compiles_and_imports_what_exists(where: str, code: str) -> None:
    needs = code.splitlines()[0].removeprefix(FRAGMENT).strip()
    assert len(needs) > 10, f"{where}: say what the fragment leaves out"
    tree = ast.parse(code, filename=where)  # a SyntaxError fails here
    imports = ast.Module(body=[n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)], type_ignores=[])
    proc = subprocess.run([sys.executable, "-c", ast.unparse(imports)], env=clean_env(), capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"{where}: {proc.stderr[-2000:]}"


def test_every_block_that_looks_like_python_is_tagged_python() -> None:
    untagged = [where for where, tag, code in _blocks() if tag != "python" and LOOKS_LIKE_PYTHON.search(code)]
    assert untagged == []
    assert RUNNABLE and FRAGMENTS  # the README's snippets run; the fragments of a training function are marked
