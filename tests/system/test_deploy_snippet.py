"""docs/deploy.md's "Add the sidecar to your JobSet": the kustomize patch, applied to a JobSet without ckptd (the
shipped one with its sidecar and ckptd settings taken out), gives a pod that matches the Kubernetes schema, runs the
shipped image as a native sidecar with valid settings, and listens where the trainer's library looks by default."""

from __future__ import annotations

import copy
import re
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from ckptd.config import Settings
from tests.support.helpers import REPO
from trainer_client.config import ClientSettings

JOBSET = REPO / "deploy" / "k8s" / "jobset.yaml"
DOC = REPO / "docs" / "deploy.md"
HEADING = "## Add the sidecar to your JobSet"


def _snippet() -> dict[str, Any]:
    text = DOC.read_text()
    section = text[text.index(HEADING):]
    section = section[: section.index("\n## ", 1)]
    (block,) = re.findall(r"^```yaml\n(.*?)^```", section, re.S | re.M)
    kustomization: dict[str, Any] = yaml.safe_load(block)
    return kustomization


def _pod(jobset: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return pod


def _jobset_without_ckptd() -> dict[str, Any]:
    (jobset,) = [d for d in yaml.safe_load_all(JOBSET.read_text()) if d is not None]
    users = copy.deepcopy(jobset)
    pod = _pod(users)
    del pod["initContainers"]
    for container in pod["containers"]:
        container["env"] = [e for e in container.get("env", []) if not e["name"].startswith("CKPTD_")]
    return users


def _apply(document: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """RFC 6902 ``add`` (the only operation the snippet uses): a new key, or ``-`` to append to a list."""
    for op in ops:
        assert op["op"] == "add", op
        *parents, last = op["path"].lstrip("/").split("/")
        node: Any = document
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), op["value"])
        else:
            node[last] = op["value"]


def _patched() -> tuple[dict[str, Any], dict[str, Any]]:
    kustomization = _snippet()
    (patch,) = kustomization["patches"]
    jobset = _jobset_without_ckptd()
    assert patch["target"]["kind"] == jobset["kind"] and patch["target"]["group"] == jobset["apiVersion"].split("/")[0]
    _apply(jobset, yaml.safe_load(patch["patch"]))
    (sidecar,) = _pod(jobset)["initContainers"]
    return jobset, sidecar


@pytest.mark.parametrize("version", ["1.29"])
def test_the_patched_pod_matches_the_kubernetes_schema(version: str) -> None:
    jobset, _ = _patched()
    job = jobset["spec"]["replicatedJobs"][0]
    kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": job["name"]},
                                  "spec": job["template"]["spec"]}, version, strict=True)


def test_the_sidecar_is_the_shipped_image_as_a_native_sidecar_with_valid_settings() -> None:
    _, sidecar = _patched()
    (shipped,) = _pod(yaml.safe_load(JOBSET.read_text()))["initContainers"]
    assert sidecar["name"] == "ckptd" and sidecar["image"] == shipped["image"]
    assert sidecar["restartPolicy"] == "Always"
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    assert all(name.startswith("CKPTD_") for name in env)
    settings = Settings(**{name.removeprefix("CKPTD_").lower(): value for name, value in env.items()})
    assert settings.serve.host == "127.0.0.1" and settings.storage.lease_ttl_s
    # the trainer needs no setting: its library's default address is where this sidecar listens
    default = urlsplit(ClientSettings.model_fields["url"].default)
    assert (default.hostname, default.port) == (settings.serve.host, settings.serve.port)
