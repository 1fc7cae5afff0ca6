"""deploy/pathways: the single-controller (Pathways) JobSet, checked without a cluster.

The JobSet is validated like deploy/k8s's (tests/system/test_deploy.py): the JobSet against the strict schema
written from kubernetes-sigs/jobset's API types, every replicated job's Job and pod template against the
upstream Kubernetes JSON schemas (strict, Kubernetes 1.29 and the newest ``kubernetes-validate`` ships). Then
what makes it a Pathways deployment with ckptd, pinned explicitly: the head pod runs the trainer on the proxy
backend, Pathways' resource manager and proxy, and ckptd as a native sidecar sharing the memory tier's volume;
one worker Job per slice, as many as the resource manager is told; the wiring between the containers (ports,
``$(VAR)`` references, the coordinator); pinned images whose JAX the trainer role accepts; a grace period that
covers ckptd's drain; deploy/k8s's shared objects select the new pods. Last, the head's ckptd command runs for
real with its settings. The PathwaysJob variant is tests/system/test_deploy_pathwaysjob.py.
"""

from __future__ import annotations

import re
import stat
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement

from ckptd.config import Settings
from tests.support.helpers import REPO, wait_until
from tests.system.test_deploy import (
    JOBSET_SCHEMA,
    K8S_VERSIONS,
    TPU_PORTS,
    _as_job,
    _check_labels,
    _config,
    _env,
    _load,
    _one,
    _only,
    _pod_spec,
    _sidecar,
    _trainer,
    _walk_labels,
    serve_sidecar,
)

PATHWAYS = REPO / "deploy" / "pathways"
HEAD, WORKER = "pathways-head", "worker"
RM, PROXY, CKPTD, TRAINER, PW_WORKER = "pathways-rm", "pathways-proxy", "ckptd", "trainer", "pathways-worker"
PATHWAYS_IMAGES = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/"
COORDINATOR_LABEL = "metadata.labels['jobset.sigs.k8s.io/coordinator']"
# GKE's accelerator label for each Pathways instance type (google/pathways-job's machine-type tables).
ACCELERATOR = {"tpuv5e": "tpu-v5-lite-podslice", "tpuv5": "tpu-v5p-slice", "tpuv6e": "tpu-v6e-slice",
               "tpuv4": "tpu-v4-podslice", "tpu7x": "tpu7x"}


def jobset() -> dict[str, Any]:
    (doc,) = _load(PATHWAYS / "jobset.yaml")
    return doc


def replicated(js: dict[str, Any], name: str) -> dict[str, Any]:
    return _only(js["spec"]["replicatedJobs"], name)


def pod(js: dict[str, Any], name: str) -> dict[str, Any]:
    spec: dict[str, Any] = replicated(js, name)["template"]["spec"]["template"]["spec"]
    return spec


def pod_labels(js: dict[str, Any], name: str) -> dict[str, str]:
    labels: dict[str, str] = replicated(js, name)["template"]["spec"]["template"]["metadata"]["labels"]
    return labels


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    return _only(pod_spec.get("initContainers", []) + pod_spec["containers"], name)


def flags(c: dict[str, Any]) -> dict[str, str]:
    """A container's ``--name=value`` arguments."""
    out = {}
    for arg in c.get("args", []):
        m = re.fullmatch(r"--(\w+)=(.*)", arg)
        assert m, f"{c['name']}: argument {arg!r} is not --name=value"
        out[m.group(1)] = m.group(2)
    return out


def ports(c: dict[str, Any]) -> set[int]:
    return {int(p["containerPort"]) for p in c.get("ports", [])}


def mounts(c: dict[str, Any]) -> dict[str, str]:
    """mountPath -> volume name."""
    return {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}


def images(doc: Any) -> list[str]:
    if isinstance(doc, dict):
        return [v for k, v in doc.items() if k == "image" and isinstance(v, str)] + [
            i for k, v in doc.items() for i in images(v)]
    if isinstance(doc, list):
        return [i for v in doc for i in images(v)]
    return []


def image_jax_version(image: str) -> str:
    m = re.fullmatch(re.escape(PATHWAYS_IMAGES) + r"(?:server|proxy_server):jax-(\d+\.\d+\.\d+)", image)
    assert m, f"not a Pathways image pinned to a JAX version: {image}"
    return m.group(1)


def trainer_jax() -> Requirement:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    (jax,) = [r for r in map(Requirement, pyproject["project"]["optional-dependencies"]["trainer"]) if r.name == "jax"]
    return jax


def k8s_sidecar() -> dict[str, Any]:
    """deploy/k8s/jobset.yaml's ckptd container."""
    return _sidecar(_pod_spec(_one("JobSet")))


# ---- schemas ------------------------------------------------------------------------------------------


def test_jobset_matches_the_jobset_schema() -> None:
    js = jobset()
    jsonschema.Draft202012Validator(JOBSET_SCHEMA).validate(js)
    assert js["metadata"]["namespace"] == _one("Namespace")["metadata"]["name"]
    for labels, at in _walk_labels(js, "deploy/pathways/jobset.yaml"):
        _check_labels(labels, at)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", [HEAD, WORKER])
def test_job_and_pod_templates_match_the_kubernetes_schema(name: str, version: str) -> None:
    kubernetes_validate.validate(_as_job(replicated(jobset(), name)), version, strict=True)


def test_schema_validation_rejects_a_broken_head_pod() -> None:
    js = jobset()
    container(pod(js, HEAD), PROXY)["restartPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicyy"):
        kubernetes_validate.validate(_as_job(replicated(js, HEAD)), K8S_VERSIONS[0], strict=True)


def test_kustomization_is_deploy_k8s_without_its_jobset_plus_this_one() -> None:
    """`kubectl apply -k deploy/pathways`: deploy/k8s's objects, its multi-controller JobSet deleted by a patch
    that names it exactly, and the Pathways JobSet; the PathwaysJob variant the same way one level down."""
    k8s_jobset = _one("JobSet")
    target = {"apiVersion": k8s_jobset["apiVersion"], "kind": "JobSet",
              "metadata": {"name": k8s_jobset["metadata"]["name"], "namespace": k8s_jobset["metadata"]["namespace"]}}
    for directory, base, own in ((PATHWAYS, "../k8s", "jobset.yaml"),
                                 (PATHWAYS / "pathwaysjob", "../../k8s", "pathwaysjob.yaml")):
        (kustomization,) = _load(directory / "kustomization.yaml")
        assert kustomization["namespace"] == k8s_jobset["metadata"]["namespace"]
        assert kustomization["resources"] == [base, own]
        assert (directory / base).resolve() == REPO / "deploy" / "k8s"
        (patch,) = kustomization["patches"]
        assert yaml.safe_load(patch["patch"]) == {"$patch": "delete", **target}
    assert jobset()["metadata"]["name"] != k8s_jobset["metadata"]["name"], "both names would clash in one namespace"


# ---- the head pod -----------------------------------------------------------------------------------------


def test_head_runs_the_trainer_with_pathways_and_ckptd_as_native_sidecars() -> None:
    js = jobset()
    head_job = replicated(js, HEAD)
    assert head_job["replicas"] == 1 and js["spec"]["replicatedJobs"][0] is head_job, "the head comes first"
    job = head_job["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 1 and job["backoffLimit"] == 0
    head = pod(js, HEAD)
    assert head["restartPolicy"] == "Never"
    assert [c["name"] for c in head["containers"]] == [TRAINER], "the trainer is the pod's one main container"
    # Native sidecars (init containers that keep running), started in this order before the trainer.
    assert [c["name"] for c in head["initContainers"]] == [RM, PROXY, CKPTD]
    assert all(c["restartPolicy"] == "Always" for c in head["initContainers"])
    assert container(head, CKPTD)["command"] == ["ckptd", "serve"]
    assert flags(container(head, RM))["node_type"] == "resource_manager"
    # The JobSet's coordinator is the head pod: PATHWAYS_HEAD everywhere is its stable DNS name.
    assert js["spec"]["coordinator"] == {"replicatedJob": HEAD}
    assert js["spec"]["startupPolicy"] == {"startupPolicyOrder": "InOrder"}
    assert js["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": [HEAD]}
    assert js["spec"]["network"]["enableDNSHostnames"] is True
    # ckptd binds 0.0.0.0 of the pod's own network: never the node's (docs/deploy.md).
    for name in (HEAD, WORKER):
        assert not pod(js, name).get("hostNetwork", False), name


def test_trainer_and_ckptd_share_the_memory_tier() -> None:
    head = pod(jobset(), HEAD)
    trainer, ckptd = container(head, TRAINER), container(head, CKPTD)
    shm_dir = _env(ckptd)["CKPTD_SHM_DIR"]["value"]
    assert _env(trainer)["CKPTD_SHM_DIR"]["value"] == shm_dir
    # Both mount one memory-backed volume at the same path, and the tier is a directory inside it (Kubernetes
    # makes the volume 0777; the tier refuses a directory others may write: docs/operations.md).
    (mount_path,) = [m for m in mounts(ckptd) if Path(shm_dir).is_relative_to(m) and m != "/tmp"]
    assert Path(shm_dir) != Path(mount_path)
    assert mounts(trainer)[mount_path] == mounts(ckptd)[mount_path]
    volume = _only(head["volumes"], mounts(ckptd)[mount_path])["emptyDir"]
    assert volume["medium"] == "Memory" and "sizeLimit" in volume
    # Owner-only files: the trainer and ckptd must be the same user.
    for key in ("runAsUser", "runAsGroup"):
        assert trainer["securityContext"][key] == ckptd["securityContext"][key], key


def test_trainer_env_names_the_proxy_backend_and_ckptd() -> None:
    head = pod(jobset(), HEAD)
    env = _env(container(head, TRAINER))
    proxy_port = int(flags(container(head, PROXY))["server_port"])
    assert proxy_port in ports(container(head, PROXY))
    assert env["JAX_PLATFORMS"]["value"] == "proxy"
    assert env["JAX_BACKEND_TARGET"]["value"] == f"grpc://$(PATHWAYS_HEAD):{proxy_port}"
    assert env["PATHWAYS_HEAD"]["valueFrom"]["fieldRef"]["fieldPath"] == COORDINATOR_LABEL
    ckptd_port = _only(container(head, CKPTD)["ports"], CKPTD)["containerPort"]
    assert env["CKPTD_URL"]["value"] == f"http://127.0.0.1:{ckptd_port}"
    # The token and the root exactly as in deploy/k8s/jobset.yaml.
    k8s_trainer = _trainer(_pod_spec(_one("JobSet")))
    for name in ("CKPTD_TOKEN", "CHECKPOINT_ROOT", "CKPTD_RUN_ID"):
        assert env[name] == _env(k8s_trainer)[name], name


def test_every_variable_reference_is_defined_before_use() -> None:
    """Kubernetes expands ``$(NAME)`` in args and env only from variables defined earlier in the same
    container; anything else stays literal (a proxy dialling "$(PATHWAYS_HEAD)")."""
    js = jobset()
    for name in (HEAD, WORKER):
        p = pod(js, name)
        for c in p.get("initContainers", []) + p["containers"]:
            defined: list[str] = []
            for var in c.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", var.get("value", "")):
                    assert ref in defined, f"{c['name']}: {var['name']} uses $({ref}) before it is defined"
                defined.append(var["name"])
            for arg in c.get("args", []) + c.get("command", []):
                for ref in re.findall(r"\$\((\w+)\)", arg):
                    assert ref in defined, f"{c['name']}: {arg} uses $({ref}), which its env does not define"


def test_ckptd_is_deploy_k8s_sidecar_plus_the_memory_tier() -> None:
    """The same image, settings, token, probes and hardening as the multi-controller sidecar; only the memory
    tier's variable and volume and a larger budget (it persists the whole model) differ, and the head has no
    peer channel (one controller: a lost slice is restored from the replica tier, docs/multihost.md section 10
    is for multi-controller hosts)."""
    js = jobset()
    head, ckptd, sidecar = pod(js, HEAD), container(pod(js, HEAD), CKPTD), k8s_sidecar()
    peer_port = _only(sidecar["ports"], "ckptd-peer")
    sidecar = {**sidecar, "ports": [p for p in sidecar["ports"] if p is not peer_port],
               "volumeMounts": [m for m in sidecar["volumeMounts"] if m["name"] != "ckptd-peer-secret"]}
    for key in set(sidecar) | set(ckptd):
        if key not in ("env", "resources", "volumeMounts"):
            assert ckptd.get(key) == sidecar.get(key), key
    assert [e["name"] for e in ckptd["env"]] == ["CKPTD_SHM_DIR"]
    assert mounts(ckptd).items() >= mounts(sidecar).items()
    k8s_pod = _pod_spec(_one("JobSet"))
    for volume in k8s_pod["volumes"]:
        if volume["name"] == "ckptd-peer-secret":
            assert not any(v["name"] == volume["name"] for v in head["volumes"])
            continue
        if volume["name"] == "shm":  # the memory tier on both, sized apart: there a host's part, here the whole state
            assert _only(head["volumes"], "shm")["emptyDir"]["medium"] == volume["emptyDir"]["medium"] == "Memory"
            continue
        assert _only(head["volumes"], volume["name"]) == volume
    for key in ("serviceAccountName", "automountServiceAccountToken", "securityContext"):
        assert head[key] == k8s_pod[key], key
    for name in ("cpu", "memory"):
        assert name in ckptd["resources"]["requests"] and name in ckptd["resources"]["limits"]
    # Its port is clear of the TPU runtime's and of every Pathways container's in the pod.
    port = _only(ckptd["ports"], CKPTD)["containerPort"]
    assert port not in TPU_PORTS and all(port not in ports(container(head, n)) for n in (RM, PROXY, TRAINER))


def test_grace_period_covers_ckptd_drain() -> None:
    """On SIGTERM ckptd persists what the trainer handed over for up to CKPTD_DRAIN_TIMEOUT_S; the pod's grace
    period must outlast it (with 10 s to spare, as for deploy/k8s)."""
    grace = pod(jobset(), HEAD)["terminationGracePeriodSeconds"]
    settings = Settings(drain_timeout_s=float(_config()["CKPTD_DRAIN_TIMEOUT_S"]), token=None, token_file=None)
    drain = settings.memory_tier.drain_timeout_s
    assert 0 < drain <= grace - 10


def test_images_are_pinned_and_match_the_trainers_jax() -> None:
    js = jobset()
    for image in images(js):
        tag = image.rpartition(":")[2]
        assert "@sha256:" in image or (tag and tag != "latest" and "/" not in tag), f"unpinned image: {image}"
    pathways = [i for i in images(js) if i.startswith(PATHWAYS_IMAGES)]
    assert {i.rsplit(":", 1)[0].rsplit("/", 1)[1] for i in pathways} == {"server", "proxy_server"}
    (version,) = {image_jax_version(i) for i in pathways}  # one Pathways release everywhere
    assert trainer_jax().specifier.contains(version), f"jax {version} is outside the trainer role's {trainer_jax()}"
    assert container(pod(js, HEAD), CKPTD)["image"] == k8s_sidecar()["image"]


# ---- the workers ------------------------------------------------------------------------------------------


def test_one_worker_job_per_slice_as_the_resource_manager_is_told() -> None:
    js = jobset()
    assert [j["name"] for j in js["spec"]["replicatedJobs"]] == [HEAD, WORKER]
    head, workers = pod(js, HEAD), replicated(js, WORKER)
    rm = flags(container(head, RM))
    slices = int(rm["instance_count"])
    assert workers["replicas"] == slices >= 2
    # The slice shape the resource manager expects is the one the workers are scheduled on.
    version, topology = rm["instance_type"].split(":")
    worker_pod = pod(js, WORKER)
    assert worker_pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": ACCELERATOR[version],
                                          "cloud.google.com/gke-tpu-topology": topology}
    chips = 1
    for dim in topology.split("x"):
        chips *= int(dim)
    worker = container(worker_pod, PW_WORKER)
    chips_per_host = int(worker["resources"]["limits"]["google.com/tpu"])
    job = workers["template"]["spec"]
    assert job["parallelism"] == job["completions"] == chips // chips_per_host, "one pod per TPU host"
    assert job["template"]["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] == \
        "cloud.google.com/gke-nodepool", "one slice per node pool"
    # Elastic: a lost host restarts in place, and fewer slices than all may be lost.
    assert worker_pod["restartPolicy"] == "OnFailure" and job["backoffLimit"] >= job["completions"]
    assert 0 < int(flags(container(head, PROXY))["num_elastic_slices"]) < slices
    # Everything dials the head's resource manager on its port.
    rm_address = f"$(PATHWAYS_HEAD):{rm['server_port']}"
    assert int(rm["server_port"]) in ports(container(head, RM))
    assert flags(container(head, PROXY))["resource_manager_address"] == rm_address
    assert flags(worker)["resource_manager_address"] == rm_address
    assert int(flags(worker)["server_port"]) in ports(worker)
    assert flags(worker)["gcs_scratch_location"] == rm["gcs_scratch_location"] == \
        flags(container(head, PROXY))["gcs_scratch_location"]
    env = _env(worker)
    assert env["PATHWAYS_HEAD"]["valueFrom"]["fieldRef"]["fieldPath"] == COORDINATOR_LABEL
    assert env["MEGASCALE_SLICE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['jobset.sigs.k8s.io/job-index']"
    # The workers write the scratch location as the head does.
    assert worker_pod["serviceAccountName"] == head["serviceAccountName"]
    # ckptd runs beside the single controller, not on the TPU hosts.
    assert [c["name"] for c in worker_pod.get("initContainers", []) + worker_pod["containers"]] == [PW_WORKER]


def test_deploy_k8s_objects_select_the_pathways_pods() -> None:
    """NetworkPolicy: head and workers reach each other (resource manager, proxy, workers, Megascale); the ckptd
    Service and the PodMonitoring find the head's sidecar and nothing on the TPU hosts."""
    js = jobset()
    head, workers = pod_labels(js, HEAD), pod_labels(js, WORKER)
    policy = _one("NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= head.items()
    assert policy["podSelector"]["matchLabels"].items() <= workers.items()
    assert any(rule["from"] == [{"podSelector": policy["podSelector"]}] and "ports" not in rule
               for rule in policy["ingress"])
    for selector in (_one("Service")["spec"]["selector"], _one("PodMonitoring")["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= head.items() and not selector.items() <= workers.items()


# ---- the head's ckptd, run for real -------------------------------------------------------------------


@pytest.fixture
def head_ckptd(tmp_path: Path, tcp_port: int) -> Iterator[tuple[str, Path]]:
    """The head's ckptd served with the ConfigMap and its own env; /dev/shm is a tmp dir made 0777 as
    Kubernetes makes an emptyDir. Yields (url, the memory tier's directory)."""
    ckptd = container(pod(jobset(), HEAD), CKPTD)
    shm_mount = next(m for m in mounts(ckptd) if m.startswith("/dev/shm"))
    volume = tmp_path / "shm"
    volume.mkdir()
    volume.chmod(0o777)
    tier = volume / Path(_env(ckptd)["CKPTD_SHM_DIR"]["value"]).relative_to(shm_mount)
    own_env = {e["name"]: e["value"] for e in ckptd["env"]} | {"CKPTD_SHM_DIR": str(tier)}
    with serve_sidecar(ckptd, tmp_path, tcp_port, **own_env) as (url, _):
        yield url, tier


def test_head_ckptd_serves_and_owns_the_memory_tier(head_ckptd: tuple[str, Path]) -> None:
    url, tier = head_ckptd
    assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    # ckptd, first in the pod, made the tier inside the 0777 volume, private to its user.
    wait_until(tier.is_dir, timeout=10, interval=0.1, what=f"{tier} created")
    assert stat.S_IMODE(tier.stat().st_mode) == 0o700


def test_docs_deploy_what_the_manifests_say() -> None:
    """docs/deploy.md's commands cover the Pathways manifests and name their Pathways release."""
    docs = (REPO / "docs" / "deploy.md").read_text()
    for directory in ("deploy/pathways", "deploy/pathways/pathwaysjob"):
        assert re.search(rf"^kubectl apply -k {directory}\s", docs, re.M), f"no `kubectl apply -k {directory}`"
    sed = docs.split("\nsed -i", 1)[1].split("```", 1)[0]  # step 3: fill in the placeholders
    assert "deploy/pathways/*.yaml" in sed and "deploy/pathways/pathwaysjob/*.yaml" in sed
    head = pod(jobset(), HEAD)
    (version,) = {image_jax_version(container(head, n)["image"]) for n in (RM, PROXY)}
    assert f"jax-{version}" in docs and f"jax=={version}" in docs
    assert f"--instance_count={flags(container(head, RM))['instance_count']}" in docs
