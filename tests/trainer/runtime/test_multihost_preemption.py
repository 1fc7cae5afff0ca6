"""SIGTERM in a multi-controller job (docs/multihost.md, section 2): jax's preemption service takes it as a
preemption notice, not an end. Two real ``jax.distributed`` processes joined by ``initialize_multihost`` run
``ElasticRunner``; one gets SIGTERM mid-run; both reach the step they agreed on
(``reached_preemption_sync_point``), save it to storage and return cleanly (exit 0, ``preempted``), and that
step is committed on storage."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.helpers import REPO, clean_env, free_port

pytestmark = pytest.mark.needs_tcp

_WORKER = """
import json, sys, time
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
from trainer_client.runtime.multihost._job_store import initialize_multihost
port, index, root, url = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
initialize_multihost(f"127.0.0.1:{port}", 2, index, heartbeat_timeout_s=10, initialization_timeout_s=60)
from trainer_client.client._ckptd_client import CkptdClient
from trainer_client.config import ClientSettings
from trainer_client.runtime.elastic._elastic import ElasticConfig, ElasticRunner
from trainer_client.runtime.compilation._options import CompilationOptions
from trainer_client.runtime.elastic._elastic_config import ElasticOptions
from trainer_client.runtime.slices._slices import SimulatedSlices
cfg = ElasticConfig(job="job", mesh_axes=("replica", "data"), mesh_shape=(1, 8), global_batch=8, checkpoint_period=0,
                    elastic=ElasticOptions(policy="pause"), compilation=CompilationOptions(precompile=False))
client = CkptdClient(ClientSettings(url=url, timeout_s=2, resume_deadline_s=5, report_events=False), root=root)
runner = ElasticRunner(cfg, slices=SimulatedSlices(num_slices=1), client=client, checkpoint_dir=root + "/job")
def train(ctx):
    state, step, position = ctx.restore_or_init(lambda: {"w": jax.numpy.zeros((16, 4))}, lambda a: {"w": P("data")})
    add = jax.jit(lambda s: {"w": s["w"] + 1})
    while step < 100_000:
        ctx.step_boundary(step, state, position)
        if step == 5:
            print("running", flush=True)
        state, step, position = add(state), step + 1, position + 8
        jax.block_until_ready(state)
        time.sleep(0.02)
    return "finished"
result = runner.run(train)
print(json.dumps({"preempted": result.preempted, "step": result.final_step, "value": result.value,
                  "kinds": [e.kind for e in result.events]}), flush=True)
"""


@pytest.mark.chaos
@pytest.mark.slow  # ~15 s on a quiet machine: kept out of make test's budget, which the --hosts demo test uses up
def test_sigterm_to_one_process_saves_the_agreed_step_and_stops_every_process(tmp_path: Path) -> None:
    port, url = str(free_port()), f"http://127.0.0.1:{free_port()}"  # no ckptd: the storage scan answers
    env = clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, port, str(k), str(tmp_path / "root"), url], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in (0, 1)]
    try:
        assert procs[1].stdout is not None
        for line in procs[1].stdout:  # gloo prints to stdout too
            if line.strip() == "running":
                break
        time.sleep(0.3)
        procs[1].send_signal(signal.SIGTERM)  # what Kubernetes sends a pod it deletes
        outs = [p.communicate(timeout=90) for p in procs]
        for p, (_, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]  # process 1's: what was left unread
    assert [r["preempted"] for r in results] == [True, True]
    assert [r["value"] for r in results] == [None, None]
    step = results[0]["step"]
    assert results[1]["step"] == step and step > 5  # one agreed step, after the notice
    assert all(r["kinds"][-1] == "preempted" for r in results)
    assert (tmp_path / "root" / "job" / str(step) / "commit_success.txt").is_file()
