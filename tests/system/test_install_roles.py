"""Each install role has a working command line for what it can do, and says which extra the rest needs.

``pip install ckptd`` (the base role) once gave a ``ckptd`` that crashed on every call (``--help`` included:
``ModuleNotFoundError: tqdm``). Here each role runs in a subprocess that can import only what that role's install
brings (``tests/support/roles.py``: every other distribution installed here fails to import as an absent one does):
the base role's ``ckptd --help``, ``--version``, ``ls``, ``show``, ``plan``, ``events``, ``advise`` and ``validate``
work, ``ckptd serve`` and the trainer's names say which extra they need; the server role's ``ckptd serve`` answers
``/healthz``; the trainer role's names load, and ``PathwaysSlices()`` on CPU says what to use instead.
``.ci/run`` installs each role in a fresh virtual environment and runs the same smoke commands.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ckptd import __version__
from ckptd.events._events import EventStore
from tests.support.helpers import free_port
from tests.support.orbax_steps import training_metadata, write_orbax_jobs
from tests.support.roles import blocked_modules, role_env
from tests.support.serve_cli import served
from trainer_client.core import protocol as p
from trainer_client.core._storage import Storage

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small root: job ``llm`` with steps 10 and 20 (ckptd's metadata) and a few events."""
    root = tmp_path_factory.mktemp("roles") / "root"
    write_orbax_jobs({root / "llm": [10, 20]}, custom_metadata={s: training_metadata(s) for s in (10, 20)})
    EventStore(Storage(str(root))).append("llm", [p.ElasticEvent(kind="start", time=1.7e9, run="r", id="0")])
    return root


def _run(role: str, tmp: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], env=role_env(role, tmp), capture_output=True, text=True,
                          timeout=timeout, check=False)


def _ckptd(role: str, tmp: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return _run(role, tmp, "-m", "ckptd", *argv)


@pytest.mark.parametrize(("role", "module"), [("base", "tqdm"), ("base", "fastapi"), ("base", "jax"),
                                              ("server", "pathwaysutils"), ("trainer", "pytest")])
def test_a_role_cannot_import_what_its_install_does_not_bring(tmp_path: Path, role: str, module: str) -> None:
    """The roles' subprocesses are what the other tests take them for (tqdm is in the base install now)."""
    done = _run(role, tmp_path, "-c", f"import {module}")
    if module == "tqdm":
        assert module not in blocked_modules(role) and done.returncode == 0, done.stderr
        return
    assert module in blocked_modules(role)
    assert done.returncode == 1 and f"ModuleNotFoundError: No module named '{module}'" in done.stderr


def test_the_base_install_has_a_working_cli(root: Path, tmp_path: Path) -> None:
    for argv in (["--help"], ["ls", "--help"], ["serve", "--help"]):
        done = _ckptd("base", tmp_path, *argv)
        assert done.returncode == 0 and "usage: ckptd" in done.stdout, (argv, done.stderr)
    done = _ckptd("base", tmp_path, "--version")
    assert (done.returncode, done.stdout.strip()) == (0, f"ckptd {__version__}"), done.stderr
    done = _ckptd("base", tmp_path, "ls", str(root))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1].split() == ["llm", "2", "20", "20"]
    for argv, expect in ((["show", f"{root}/llm"], "verified"), (["plan", f"{root}/llm", "--devices", "4"], "step"),
                         (["events", f"{root}/llm"], "start"), (["validate", f"{root}/llm"], "2 checked, 0 bad"),
                         (["advise", f"{root}/llm", "--save-stall", "1", "--points", "3", "--min-failures", "50"],
                          "recommended:")):
        done = _ckptd("base", tmp_path, *argv)
        assert done.returncode == 0 and expect in done.stdout + done.stderr, (argv, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr, (argv, done.stderr)


def test_the_base_install_says_which_extra_the_rest_needs(tmp_path: Path) -> None:
    done = _ckptd("base", tmp_path, "serve", "--root", str(tmp_path), "--port", str(free_port()))
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        "ckptd: ckptd serve needs the server install (no module 'uvicorn' here): pip install 'ckptd[server]'"]
    done = _run("base", tmp_path, "-c", "from trainer_client import CkptdClient, ClientSettings, CkptdError")
    assert done.returncode == 0, done.stderr
    for role, statement, what, module in (
        ("base", "from trainer_client import ElasticRunner", "trainer_client.runtime", "jax"),
        ("base", "import trainer_client.runtime.elastic._elastic", "trainer_client.runtime", "jax"),
        ("server", "from trainer_client import ElasticRunner", "trainer_client.ElasticRunner", "pathwaysutils"),
    ):
        done = _run(role, tmp_path, "-c", statement)
        assert done.returncode == 1
        assert done.stderr.strip().splitlines()[-1] == (
            f"trainer_client.core._errors.MissingExtra: {what} needs the trainer install (no module {module!r} here): "
            "pip install 'ckptd[trainer]'"), (role, statement, done.stderr)


def test_the_server_install_serves(root: Path, tmp_path: Path) -> None:
    """Without the trainer's libraries (pathwaysutils, optax, flax, grain): ``ckptd serve`` answers."""
    port = free_port()
    log = tmp_path / "serve.log"
    with served(["--root", str(root), "--state-dir", str(tmp_path / "state")], port, role_env("server", tmp_path),
                log):
        jobs = httpx.get(f"http://127.0.0.1:{port}/v1/jobs", timeout=10)
        assert jobs.status_code == 200 and [j["name"] for j in jobs.json()["jobs"]] == ["llm"], jobs.text
    assert "ModuleNotFoundError" not in log.read_text()


def test_the_trainer_install_loads_its_names_and_pathways_slices_say_what_fits_on_cpu(tmp_path: Path) -> None:
    program = (
        "from trainer_client import Checkpointer, ElasticRunner, PathwaysSlices, SimulatedSlices\n"
        "print(len(SimulatedSlices(num_slices=4).slice_to_devices))\n"
        "PathwaysSlices()\n"
    )
    done = _run("trainer", tmp_path, "-c", program)
    assert done.stdout.strip() == "4", done.stderr
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ValueError: PathwaysSlices needs Pathways devices (each with a slice_index); these 8 cpu device(s) have "
        "none: on CPU use SimulatedSlices(num_slices=...)")
