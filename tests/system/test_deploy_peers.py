"""deploy/k8s/jobset.yaml turns the peer channel on (docs/deploy.md, "Peer copies are on"): the sidecar's
environment, resolved as Kubernetes resolves it for one pod (the downward API's labels and annotations, then
``$(VAR)`` references to variables defined before), is a valid ckptd configuration that names the right host,
copies across slices, advertises the pod's stable DNS name and reads its secret from the mounted Secret."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from ckptd.config import Settings
from tests.system.test_deploy import _config, _one, _only, _pod_spec, _sidecar

ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _resolved_env(sidecar: dict[str, Any], pod: dict[str, str]) -> dict[str, str]:
    """The sidecar's variables as the kubelet sets them: ``fieldRef``s from ``pod`` (label or annotation name ->
    value), ``$(VAR)`` expanded from the variables before it (an unknown one stays as written, as Kubernetes
    leaves it)."""
    out: dict[str, str] = {}
    for entry in sidecar["env"]:
        if "value" in entry:
            out[entry["name"]] = ENV_REF.sub(lambda m: out.get(m.group(1), m.group(0)), entry["value"])
        elif "fieldRef" in entry["valueFrom"]:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            key = re.fullmatch(r"metadata\.(?:labels|annotations)\['([^']+)'\]", path)
            assert key is not None, entry
            out[entry["name"]] = pod[key.group(1)]
    return out


def _pod(slice_index: int, pod_index: int) -> dict[str, str]:
    return {"jobset.sigs.k8s.io/job-index": str(slice_index), "jobset.sigs.k8s.io/jobset-name": "llm-train",
            "jobset.sigs.k8s.io/replicatedjob-name": "slice",
            "batch.kubernetes.io/job-completion-index": str(pod_index)}


def _settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slice_index: int, pod_index: int,
              secret: str = "0123456789abcdef0123456789abcdef") -> Settings:
    pod = _pod_spec(_one("JobSet"))
    sidecar = _sidecar(pod)
    env = {**_config(), **_resolved_env(sidecar, _pod(slice_index, pod_index)),
           "JOB_COMPLETION_INDEX": str(pod_index)}  # the Job controller adds it to every container
    mount = _only(sidecar["volumeMounts"], "ckptd-peer-secret")["mountPath"]
    item = _only(pod["volumes"], "ckptd-peer-secret")["secret"]["items"][0]
    secret_file = tmp_path / "peer-secret"
    secret_file.write_text(secret + "\n")
    assert env["CKPTD_PEER_SECRET_FILE"] == f"{mount}/{item['path']}" and item["key"] == "peer-secret"
    env["CKPTD_PEER_SECRET_FILE"] = str(secret_file)
    (tmp_path / "token").write_text("t0ken\n")
    env["CKPTD_TOKEN_FILE"] = str(tmp_path / "token")
    for name in [n for n in os.environ if n.startswith("CKPTD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Settings()


def test_every_pod_of_the_jobset_knows_which_host_it_is_and_copies_to_the_other_slice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jobset = _one("JobSet")
    (workers,) = jobset["spec"]["replicatedJobs"]
    slices, per_slice = workers["replicas"], workers["template"]["spec"]["parallelism"]
    hosts = set()
    for slice_index in range(slices):
        for pod_index in range(per_slice):
            settings = _settings(tmp_path, monkeypatch, slice_index, pod_index)
            host = settings.peer.this_host()
            assert host == (slice_index * per_slice + pod_index, slices * per_slice), (slice_index, pod_index, host)
            hosts.add(host[0])
            # the stable DNS name of this pod (enableDNSHostnames), no unexpanded reference left
            assert settings.peer.peer_advertise == f"llm-train-slice-{slice_index}-{pod_index}.llm-train:9472"
            assert settings.peer.peer_secret == "0123456789abcdef0123456789abcdef"
            # the copy goes to the same position on the other slice: another failure domain
            assert settings.peer.peer_stride == per_slice
    assert hosts == set(range(slices * per_slice)), "two pods would think they are the same host"
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    ports = {p["name"]: p["containerPort"] for p in _sidecar(_pod_spec(jobset))["ports"]}
    assert ports["ckptd-peer"] == int(_settings(tmp_path, monkeypatch, 0, 0).peer.peer_port or 0)


def test_the_example_secret_s_peer_placeholder_and_a_host_outside_its_slice_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    placeholder = _one("Secret")["stringData"]["peer-secret"]
    with pytest.raises(ValidationError, match="placeholder"):
        _settings(tmp_path, monkeypatch, 0, 0, secret=placeholder)
    with pytest.raises(ValidationError, match="CKPTD_HOSTS_PER_SLICE"):
        _settings(tmp_path, monkeypatch, 1, 4)  # a completion index past the slice's hosts
    monkeypatch.delenv("CKPTD_HOSTS_PER_SLICE")
    with pytest.raises(ValidationError, match="needs CKPTD_HOSTS_PER_SLICE"):
        Settings()
