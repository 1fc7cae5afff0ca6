"""trainer_client.CheckpointManager: an Orbax loop runs unchanged with the import swapped; only good steps are
named and restored (a step without its commit marker, a step with a truncated data file), by a new process with
no ckptd and by a fresh manager asking a real ckptd; plain Orbax restores what it wrote; what it cannot honour is
refused (docs/adopt.md, "Plain Orbax")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.support.helpers import REPO, clean_env
from tests.support.orbax_steps import _MAXTEXT_WRITER, MAXTEXT_MESH_AXES, MAXTEXT_MESH_SHAPE
from tests.support.server import StartServer
from trainer_client import CheckpointManager, CkptdClient, ClientSettings
from trainer_client.core._ckptd_url import parse_ckptd_url
from trainer_client.core._storage import Storage
from trainer_client.core._validation import validate_step
from trainer_client.core.format._files import CKPTD_MANIFEST, COMMIT_MARKER

# A loop written against Orbax's CheckpointManager (two items, metrics, an interval, restore of the latest step).
ORBAX_LOOP = """
import json, sys
import jax.numpy as jnp
import orbax.checkpoint as ocp
from orbax.checkpoint import CheckpointManager

directory, steps = sys.argv[1], int(sys.argv[2])
options = ocp.CheckpointManagerOptions(save_interval_steps=2)
with CheckpointManager(directory, options=options, item_names=("state", "extra"), metadata={"model": "mlp"}) as mgr:
    for step in range(steps):
        state = {"w": jnp.arange(8.0) * step, "b": jnp.full((2, 3), step, jnp.int32), "step": step}
        mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               extra=ocp.args.JsonSave({"lr": 0.5 * step})),
                 metrics={"loss": 1.0 / (step + 1)})
    mgr.wait_until_finished()
    latest = mgr.latest_step()
    got = mgr.restore(latest, args=ocp.args.Composite(state=ocp.args.StandardRestore(), extra=ocp.args.JsonRestore()))
    print(json.dumps({"all": list(mgr.all_steps()), "latest": latest, "w": got.state["w"].tolist(),
                      "b": got.state["b"].tolist(), "step": int(got.state["step"]), "lr": got.extra["lr"],
                      "should_save_next": mgr.should_save(steps), "names": sorted(mgr.item_metadata(latest).keys()),
                      "root": dict(mgr.metadata().custom_metadata), "step_meta": mgr.metadata(latest).custom_metadata,
                      "preempted": mgr.reached_preemption(latest), "dir": mgr.directory.name}))
"""
ORBAX_IMPORT = "from orbax.checkpoint import CheckpointManager"
SWAPPED_IMPORT = "from trainer_client import CheckpointManager"

# A new process resuming: restore(None) is the newest good step.
RESUME = """
import json, sys
import orbax.checkpoint as ocp
from trainer_client import CheckpointManager

with CheckpointManager(sys.argv[1], item_names=("state", "extra")) as mgr:
    got = mgr.restore(None, args=ocp.args.Composite(state=ocp.args.StandardRestore(), extra=ocp.args.JsonRestore()))
    print(json.dumps({"latest": mgr.latest_step(), "all": list(mgr.all_steps()), "w": got.state["w"].tolist(),
                      "b": got.state["b"].tolist(), "step": int(got.state["step"]), "lr": got.extra["lr"],
                      "should_save": [mgr.should_save(s) for s in (3, 4, 6)]}))
"""


@pytest.fixture(autouse=True)
def _no_ckptd_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTD_URL", raising=False)  # a manager asks ckptd only where a test says so


def _run(code: str, *args: str, **env: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", code, *args], env=clean_env(**env), cwd=REPO, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# What ORBAX_LOOP saved as step 2 (its state and extra item), as a new process's RESUME prints it.
_STEP_2 = {"w": [2.0 * i for i in range(8)], "b": [[2] * 3] * 2, "step": 2, "lr": 1.0}


def _restore_args() -> ocp.args.Composite:
    """Restore what ORBAX_LOOP saved onto this process's first device. The steps were written by a child on CPU;
    without a target Orbax places each array on the device its metadata names (``cpu:0``), which a process on an
    accelerator does not have (``make test-device``)."""
    on = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"w": jax.ShapeDtypeStruct((8,), np.float32, sharding=on),
              "b": jax.ShapeDtypeStruct((2, 3), np.int32, sharding=on), "step": 0}
    return ocp.args.Composite(state=ocp.args.StandardRestore(target), extra=ocp.args.JsonRestore())


def _damage(job: Path) -> None:
    """Step 6 loses its commit marker (a save cut before its commit); a data file of step 4 is truncated."""
    (job / "6" / COMMIT_MARKER).unlink()
    data = max((p for p in (job / "4" / "state").rglob("*") if p.is_file() and "/d/" in str(p)),
               key=lambda p: p.stat().st_size)
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size // 2)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The loop run by plain Orbax and, with the import swapped, by trainer_client (steps 0, 2, 4, 6)."""
    base = tmp_path_factory.mktemp("cm")
    orbax_dir, ours_dir = base / "orbax" / "checkpoints", base / "ours" / "checkpoints"
    return {"orbax": _run(ORBAX_LOOP, str(orbax_dir), "8"),
            "ours": _run(ORBAX_LOOP.replace(ORBAX_IMPORT, SWAPPED_IMPORT), str(ours_dir), "8"), "dir": ours_dir}


def test_an_orbax_loop_runs_unchanged_with_the_import_swapped(written: dict[str, Any]) -> None:
    assert SWAPPED_IMPORT not in ORBAX_LOOP
    assert written["ours"] == written["orbax"]
    assert written["ours"]["all"] == [0, 2, 4, 6] and written["ours"]["w"] == [6.0 * i for i in range(8)]
    assert written["ours"]["root"] == {"model": "mlp"} and written["ours"]["preempted"] is False  # Orbax's own
    storage = Storage(str(written["dir"]))
    for step in (0, 2, 4, 6):  # every step carries ckptd's manifest, and its files match it
        assert (written["dir"] / str(step) / CKPTD_MANIFEST).is_file()
        assert validate_step(storage, storage.join(str(step))).ok


def test_plain_orbax_restores_every_step_it_wrote(written: dict[str, Any], tmp_path: Path) -> None:
    with ocp.CheckpointManager(written["dir"], item_names=("state", "extra")) as plain:
        assert list(plain.all_steps()) == [0, 2, 4, 6]
        for step in (0, 2, 4, 6):
            got = plain.restore(step, args=_restore_args())
            np.testing.assert_array_equal(np.asarray(got.state["w"]), np.arange(8.0) * step)
            assert got.extra == {"lr": 0.5 * step}


@pytest.fixture
def damaged(written: dict[str, Any], tmp_path: Path) -> Path:
    """A copy of the written job with step 6 marker-less and step 4 truncated: the newest good step is 2."""
    job = tmp_path / "run" / "checkpoints"
    shutil.copytree(written["dir"], job)
    _damage(job)
    return job


def test_a_new_process_without_ckptd_names_and_restores_the_newest_good_step(damaged: Path) -> None:
    got = _run(RESUME, str(damaged))
    assert got["latest"] == 2 and got["all"] == [0, 2]
    assert got == {**got, **_STEP_2}  # step 2's state, exactly as saved
    assert got["should_save"] == [True, True, True]  # Orbax's own view counts no bad step either
    with ocp.CheckpointManager(damaged, item_names=("state", "extra")) as plain:
        assert plain.latest_step() == 6  # what plain Orbax would have resumed from


class _Counting(httpx.HTTPTransport):
    def __init__(self, url: str) -> None:
        super().__init__(uds=parse_ckptd_url(url).uds)  # TCP, or the server's unix socket
        self.paths: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        return super().handle_request(request)


def test_a_fresh_manager_asking_ckptd_names_and_restores_the_newest_good_step(
    damaged: Path, ckptd_server: StartServer
) -> None:
    server = ckptd_server(damaged.parent)
    transport = _Counting(server.url)
    client = CkptdClient(ClientSettings(url=server.url), root=str(damaged.parent), transport=transport)
    with CheckpointManager(str(damaged), item_names=("state", "extra"), ckptd=client) as mgr:
        assert mgr.latest_step() == 2
        assert list(mgr.all_steps()) == [0, 2]
        got = mgr.restore(None, args=_restore_args())
    np.testing.assert_array_equal(np.asarray(got.state["w"]), np.arange(8.0) * 2)
    assert any(path.endswith("/latest-good") for path in transport.paths)
    assert any(path.endswith("/checkpoints") for path in transport.paths)
    with server.client() as http:
        states = {c["step"]: c["state"] for c in http.get("/v1/jobs/checkpoints/checkpoints").json()["checkpoints"]}
    assert states[4] == "quarantined" and states[6] in ("writing", "abandoned") and states[2] == "verified"
    # a new process with only the import swapped, told where ckptd is by CKPTD_URL, resumes the same
    again = _run(RESUME, str(damaged), CKPTD_URL=server.url)
    assert (again["latest"], again["all"]) == (2, [0, 2]) and again == {**again, **_STEP_2}


def test_ckptd_down_falls_back_to_storage(damaged: Path, tcp_port: int) -> None:
    client = CkptdClient(ClientSettings(url=f"http://127.0.0.1:{tcp_port}", resume_deadline_s=0.2, timeout_s=0.2),
                         root=str(damaged.parent))
    with CheckpointManager(str(damaged), item_names=("state", "extra"), ckptd=client) as mgr:
        assert mgr.latest_step() == 2 and list(mgr.all_steps()) == [0, 2]


def test_a_step_saved_after_ckptd_looked_is_judged_from_storage(written: dict[str, Any], tmp_path: Path) -> None:
    """ckptd answers latest-good 2 (it has not seen 8 yet): the step this manager just committed is named."""
    job = tmp_path / "run" / "checkpoints"
    shutil.copytree(written["dir"], job)

    def ckptd(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/latest-good"):
            return httpx.Response(200, json={"step": 2, "state": "verified", "path": str(job / "2")})
        return httpx.Response(200, json={"job": "checkpoints", "checkpoints": [
            {"step": s, "state": st, "path": str(job / str(s))} for s, st in ((0, "verified"), (2, "verified"),
                                                                             (4, "quarantined"))]})

    client = CkptdClient(ClientSettings(url="http://ckptd"), transport=httpx.MockTransport(ckptd))
    with CheckpointManager(str(job), item_names=("state", "extra"), ckptd=client) as mgr:
        mgr.save(8, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.ones(2)}),
                                            extra=ocp.args.JsonSave({"lr": 1.0})))
        mgr.wait_until_finished()
        assert mgr.latest_step() == 8
        assert list(mgr.all_steps()) == [0, 2, 6, 8]  # 4: ckptd quarantined it; 6 and 8: the rule on storage


@pytest.mark.parametrize("options, named", [
    (ocp.CheckpointManagerOptions(cleanup_tmp_directories=True), "cleanup_tmp_directories"),
    (ocp.CheckpointManagerOptions(step_prefix="ckpt"), "step_prefix"),
])
def test_an_option_ckptd_cannot_honour_is_refused(tmp_path: Path, options: Any, named: str) -> None:
    with pytest.raises(ValueError, match=rf"CheckpointManagerOptions\({named}=.*is not supported: "):
        CheckpointManager(tmp_path / "checkpoints", options=options)
    assert not os.path.exists(tmp_path / "checkpoints")  # refused before Orbax touched the directory


def test_synchronous_saves_are_manifested_and_a_callback_of_yours_runs_after_the_manifest(tmp_path: Path) -> None:
    job = tmp_path / "checkpoints"
    with CheckpointManager(job, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)) as mgr:
        assert mgr.save(1, args=ocp.args.StandardSave({"a": np.arange(3.0)}))
        assert validate_step(Storage(str(job)), str(job / "1")).manifest is not None
    seen: list[bool] = []
    callback = ocp.options.AsyncOptions(
        post_finalization_callback=lambda: seen.append((job / "2.orbax-checkpoint-tmp" / CKPTD_MANIFEST).is_file()))
    with CheckpointManager(job, options=ocp.CheckpointManagerOptions(async_options=callback)) as mgr:
        mgr.save(2, args=ocp.args.StandardSave({"a": np.arange(3.0)}))
        mgr.wait_until_finished()
        assert list(mgr.all_steps()) == [1, 2]
    assert seen == [True]


def test_maxtexts_own_save_calls_run_with_the_manager_swapped_in(tmp_path: Path) -> None:
    """MaxText's manager and saves (tests/support/orbax_steps.py: PyTreeSave with its save args, Grain's iterator
    handler, a FixedIntervalPolicy, LatestN(None), custom metadata) through trainer_client's manager."""
    plain = "    mgr = ocp.CheckpointManager("
    assert plain in _MAXTEXT_WRITER
    ours = "    from trainer_client import CheckpointManager\n    mgr = CheckpointManager("
    swapped = _MAXTEXT_WRITER.replace(plain, ours)
    job = tmp_path / "llama" / "checkpoints"
    spec = {"jobs": {str(job): [0, 100]}, "grain": True, "period": 100, "keep": None, "batch": 4,
            "mesh_axes": list(MAXTEXT_MESH_AXES), "mesh_shape": list(MAXTEXT_MESH_SHAPE)}
    done = subprocess.run([sys.executable, "-c", swapped, json.dumps(spec)], env=clean_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    storage = Storage(str(job))
    for step in (0, 100):
        assert (job / str(step) / "iter").is_dir()
        assert validate_step(storage, storage.join(str(step))).manifest is not None
    with CheckpointManager(job, item_names=("items", "iter")) as mgr:
        assert list(mgr.all_steps()) == [0, 100] and mgr.latest_step() == 100


def test_the_manager_loads_no_server_framework() -> None:
    code = ("import json, sys\nfrom trainer_client import CheckpointManager\n"
            "print(json.dumps(sorted(m for m in ('fastapi', 'starlette', 'uvicorn', 'ckptd') if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], env=clean_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_ckptd_named_by_the_environment_is_asked_and_told_of_every_save(
    damaged: Path, ckptd_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An Orbax loop that only swapped the import: CKPTD_URL (the sidecar beside the trainer) is enough."""
    server = ckptd_server(damaged.parent)
    monkeypatch.setenv("CKPTD_URL", server.url)
    with CheckpointManager(str(damaged), item_names=("state", "extra")) as mgr:
        assert mgr.latest_step() == 2
        assert mgr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.ones(2)}),
                                                   extra=ocp.args.JsonSave({"lr": 1.0})))
        mgr.wait_until_finished()
        assert mgr.latest_step() == 3
    with server.client() as http:
        events = http.get("/v1/jobs/checkpoints/events").json()["events"]
    saves = [e for e in events if e["kind"] == "checkpoint_started"]
    assert [e["step"] for e in saves] == [3] and saves[0]["tier"] == "storage"


def test_a_host_memory_tier_configured_for_ckptd_is_said_to_be_unused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """CKPTD_SHM_DIR (the tier the runner's client uses) is not taken by a manager not told the global batch
    (no training metadata for a snapshot): a warning says so, the save goes to storage and nothing is written to
    the tier's directory."""
    shm = tmp_path / "shm"
    monkeypatch.setenv("CKPTD_SHM_DIR", str(shm))
    with (caplog.at_level("WARNING", logger="trainer_client.runtime.orbax_compat._checkpoint_manager"),
          CheckpointManager(tmp_path / "checkpoints") as mgr):
        mgr.save(1, args=ocp.args.StandardSave({"a": np.arange(3.0)}))
    assert any("host-memory tier" in r.getMessage() and str(shm) in r.getMessage() for r in caplog.records)
    assert (tmp_path / "checkpoints" / "1" / COMMIT_MARKER).is_file() and not shm.exists()
